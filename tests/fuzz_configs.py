"""Hypothesis strategies for random Llama-family configs and the tp sizes that divide them.

Shared by the short fuzz profile in the test suite and the long one in ``benchmarks/fuzz.py``.
"""

from hypothesis import strategies as st
from transformers import AutoConfig

ROPE_VARIANTS = [
    {"rope_type": "default", "rope_theta": 10000.0},
    {"rope_type": "linear", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0},
    {"rope_type": "llama3", "rope_theta": 500000.0, "factor": 8.0, "low_freq_factor": 1.0,
     "high_freq_factor": 4.0, "original_max_position_embeddings": 64},
    {"rope_type": "yarn", "rope_theta": 10000.0, "factor": 2.0, "original_max_position_embeddings": 64},
]


@st.composite
def llama_family_case(draw):
    """``(model_type, config kwargs, tp_size)`` with tp dividing every sharded size."""
    model_type = draw(st.sampled_from(["llama", "mistral", "qwen2", "qwen3"]))
    tp = draw(st.sampled_from([2, 4, 8]))
    kv = draw(st.sampled_from([k for k in (1, 2, 4, 8) if k % tp == 0] or [tp]))
    heads = kv * draw(st.sampled_from([1, 2]))
    heads = max(heads, tp)
    head_dim = draw(st.sampled_from([8, 16]))
    hidden = draw(st.sampled_from([32, 48, 64]))  # head_dim * heads need not equal hidden
    options = dict(
        hidden_size=hidden,
        intermediate_size=tp * draw(st.integers(4, 24)),
        num_attention_heads=heads,
        num_key_value_heads=kv,
        head_dim=head_dim,
        num_hidden_layers=2,
        vocab_size=tp * draw(st.integers(16, 40)),
        max_position_embeddings=128,
        tie_word_embeddings=draw(st.booleans()),
        rope_parameters=draw(st.sampled_from(ROPE_VARIANTS)),
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=2,
    )
    if model_type == "llama":
        options.update(attention_bias=draw(st.booleans()), mlp_bias=draw(st.booleans()))
    if model_type in ("mistral", "qwen2", "qwen3"):
        options["sliding_window"] = draw(st.sampled_from([None, 8]))
    if model_type in ("qwen2", "qwen3") and options["sliding_window"]:
        options.update(use_sliding_window=True, max_window_layers=1)
    return model_type, options, tp


def build_config(model_type: str, options: dict):
    return AutoConfig.for_model(model_type, **options)
