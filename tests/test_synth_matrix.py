"""The verification matrix: every supported family's synthesized plan, at tp 2 and 4, plain and SP.

Each case shards the model on simulated ranks and compares with the unsharded model (fp32 logits
and every parameter gradient within 1e-5), then checks two optimality claims:

- per-rank parameter fraction within 0.05 of the Megatron bound (:func:`megatron_fraction`);
- collectives of one forward equal the Megatron optimum (:func:`optimal_collectives`), with the
  model-specific deviations listed there.

It would catch a plan that runs but computes the wrong thing (a fused projection cut with global
sizes, a missing reduction, an unreduced gradient), a plan that silently replicates what Megatron
shards, and a plan that pays extra collectives (a per-consumer all-gather under SP).
"""

import warnings

import pytest
import torch
from torch import nn

from autotp.synth import synthesize
from autotp.verifier import verify
from synth_models import shardable_model
from synth_toy import HEADS, KV_HEADS, NanoGPT, TitanLlama, example_tokens

LAYERS = 2
FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3-vlm", "phi3", "olmo2", "cohere",
            "starcoder2", "granite", "glm4", "gpt_neox", "phi", "qwen3_moe", "mixtral"]
PARALLEL_BLOCKS = ("parallel_block", "cohere", "phi")
# Parallel blocks whose two branch outputs are added to each other before the residual
# (``attn + mlp + x``): the rows' partial sums meet first and are reduced once per layer.
SUMMED_BRANCHES = ("gpt_neox", "phi")
TOYS = {"nanogpt": NanoGPT, "titan_llama": TitanLlama, "parallel_block": lambda: TitanLlama(parallel=True)}


# Parameters no Megatron text plan shards: Gemma3's vision tower and projector (replicated in the
# handwritten plan too); counted in R.
UNSHARDED_PREFIXES = ("model.vision_tower.", "model.multi_modal_projector.")


def megatron_fraction(model: nn.Module, tp: int) -> float:
    """The smallest per-rank parameter fraction a Megatron-style plan reaches.

    ``(S / tp + R) / (S + R)``: S counts what Megatron shards, every ``nn.Linear`` weight (q, k, v,
    o, MLP, fused projections, the head), the token embedding (``get_input_embeddings()``, else the
    table with the most rows; position tables stay replicated) and every 3-D (per-expert) parameter; R is
    the rest, replicated: norms, biases (counted replicated even for column Linears, which makes the
    bound slightly high; biases are under 1% of these models), MoE routers (not ``nn.Linear`` in
    transformers 5), and the parameters under :data:`UNSHARDED_PREFIXES`. Tied parameters count once.
    """
    modules = [m for n, m in model.named_modules() if not n.startswith(UNSHARDED_PREFIXES)]
    sharded: set[int] = set()
    embeddings = [m for m in modules if isinstance(m, nn.Embedding)]
    tokens = getattr(model, "get_input_embeddings", lambda: None)()
    if isinstance(tokens, nn.Embedding) and any(tokens is m for m in embeddings):
        sharded.add(id(tokens.weight))  # the token table, even where a position table has more rows
    elif embeddings:
        sharded.add(id(max(embeddings, key=lambda m: m.num_embeddings).weight))
    for module in modules:
        if isinstance(module, nn.Linear):
            sharded.add(id(module.weight))
        sharded.update(id(p) for p in module.parameters(recurse=False) if p.ndim == 3)
    params = {id(p): p for p in model.parameters()}
    s = sum(p.numel() for k, p in params.items() if k in sharded)
    r = sum(p.numel() for k, p in params.items() if k not in sharded)
    return (s / tp + r) / (s + r)


def optimal_collectives(name: str, sequence_parallel: bool) -> dict[str, int]:
    """Collectives of one forward of the Megatron optimum for 2 layers, with deviations.

    Plain: 2 all-reduces per layer (attention and MLP rows) + 1 (vocab-parallel embedding).
    SP: 2 all-gathers and 2 reduce-scatters per layer + 1 of each at the embedding / head boundary.
    Deviations:
    - OLMo2: q_norm and k_norm normalise the sharded width; each all-reduces its (batch, seq, 1)
      statistic: +2 all-reduces per layer, plain and SP.
    - parallel blocks (the toy, Cohere, Phi): attention and MLP read one norm, so under SP one
      all-gather per layer, fewer than the sequential optimum.
    - parallel blocks whose branch outputs are added before the residual (GPT-NeoX, Phi): one
      all-reduce (SP: one reduce-scatter) per layer for both branches.
    Gemma3's scaled embedding needs no deviation: the vocab-parallel lookup reduces its partial sum
    (a reduce-scatter under SP) before the module scales it.
    """
    reductions = 1 if name in SUMMED_BRANCHES else 2
    if sequence_parallel:
        gathers = 1 if name in PARALLEL_BLOCKS else 2
        out = {"all_gather_into_tensor": gathers * LAYERS + 1, "reduce_scatter_tensor": reductions * LAYERS + 1}
    else:
        out = {"all_reduce": reductions * LAYERS + 1}
    if name == "olmo2":
        out["all_reduce"] = out.get("all_reduce", 0) + 2 * LAYERS
    return out


_MODELS: dict[str, tuple[nn.Module, object]] = {}


def _model(name: str):
    """(model, example inputs or None) built once per session: building costs more than verifying."""
    if name not in _MODELS:
        if name in TOYS:
            _MODELS[name] = (TOYS[name](), (example_tokens(),))
        else:
            _MODELS[name] = (shardable_model(name), None)
    return _MODELS[name]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("name", FAMILIES + list(TOYS))
def test_synthesized_plan_is_exact_and_megatron_optimal(name, tp_size, sequence_parallel):
    model, inputs = _model(name)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = synthesize(model, example_inputs=inputs, sequence_parallel=sequence_parallel, tp_size=tp_size,
                          verify=False)
        verify_inputs = inputs if inputs is None else (torch.randint(0, 256, (2, 16)),)
        report = verify(model, plan, tp_size=tp_size, example_inputs=verify_inputs)
    assert report.ok, str(report)
    assert max(report.logits_max_abs_diff) <= 1e-5 and report.worst_grad[1] <= 1e-5
    bound = megatron_fraction(model, tp_size)
    assert all(abs(f - bound) <= 0.05 for f in report.param_fraction), (report.param_fraction, bound)
    expected = optimal_collectives(name, sequence_parallel)
    if tp_size > _kv_heads(model):  # k and v of each layer gathered, their gradients reduce-scattered back
        expected["all_gather_into_tensor"] = expected.get("all_gather_into_tensor", 0) + 2 * LAYERS
    assert report.collectives == expected
    if tp_size > _kv_heads(model):
        assert report.comm_volume_backward <= report.comm_volume, report


def _kv_heads(model: nn.Module) -> int:
    """The kv heads of a transformers model's config; the toys' attention has KV_HEADS (nanoGPT's
    none: its heads are all kv heads)."""
    config = getattr(model, "config", None)
    if config is not None:
        text = config.get_text_config() if hasattr(config, "get_text_config") else config
        return getattr(text, "num_key_value_heads", None) or text.num_attention_heads
    return HEADS if isinstance(model, NanoGPT) else KV_HEADS
