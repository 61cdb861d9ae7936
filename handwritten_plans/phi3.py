"""Phi3: fused ``qkv_proj`` ([q | k | v], unequal under GQA) and ``gate_up_proj`` ([gate | up]).

Both fused projections are sharded part by part (:class:`Colwise`): a contiguous
column split would hand one rank all of q and another k and v, with wrong logits and no error.
The attention slices qkv with sizes computed from its head counts, so :class:`ShardCounts` gives
the attention module per-rank counts.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle, SequenceParallel

from autotp.styles import Colwise, RotaryEmbedParallel, ShardCounts
from handwritten_plans._blocks import row_output, shared_input, vocab_embedding, vocab_head


def parallelize_phi3(model: nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Plan for ``Phi3ForCausalLM``: same collectives as Llama's (2 per layer)."""
    config = model.config
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    q, kv = config.num_attention_heads * head_dim, config.num_key_value_heads * head_dim
    layer = "model.layers.*"
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": vocab_embedding(sequence_parallel=sequence_parallel),
        f"{layer}.self_attn": ShardCounts(names=("num_key_value_heads", "config.num_attention_heads")),
        f"{layer}.self_attn.qkv_proj": Colwise(sizes=(q, kv, kv)),
        f"{layer}.self_attn.o_proj": row_output(sequence_parallel=sequence_parallel),
        f"{layer}.mlp.gate_up_proj": Colwise(sizes=(config.intermediate_size,) * 2),
        f"{layer}.mlp.down_proj": row_output(sequence_parallel=sequence_parallel),
        "lm_head": vocab_head(sequence_parallel=sequence_parallel),
    }
    plan |= {f"{layer}.{norm}": shared_input(sequence_parallel=sequence_parallel)
             for norm in ("input_layernorm", "post_attention_layernorm")}
    if sequence_parallel:
        plan |= {"model.rotary_emb": RotaryEmbedParallel(), "model.norm": SequenceParallel()}
    return plan
