"""The second set of handwritten plans (Phi, Ministral3 / Mistral3, Qwen3 classification,
Falcon-H1, Qwen3.5, Gemma4), verified against the unsharded model and compared with the synthesizer.

Tolerance: 1e-5 max abs difference on fp32 logits and on every parameter gradient, at tp 2 and 4.
Every tiny model has 2 decoder layers.

Tiny configs: most come from :func:`autotp.models.shrink_config`. Two need extra shrinking to keep
verification in seconds: Falcon-H1's Mamba2 mixer and Qwen3.5's Gated DeltaNet run transformers'
pure-PyTorch reference kernels, whose op count (not tensor size) dominates under simulated ranks,
so their SSM / linear-attention widths are cut further (they stay replicated; only their cost
changes). Gemma4 is built from a hand-written config: ``shrink_config`` cannot shrink it under
transformers 5.23, because ``Gemma4TextConfig`` derives a ``per_layer_config`` keyed by the layer
indices of the full-size model (``[5, 11, ...]``), which the 2-layer config then rejects
(``per_layer_config keys must be integer layer indices in the range [0, 2)``).

Plain-TP verifies of Falcon-H1 and Qwen3.5 take several seconds each: the reference SSM / delta-rule
kernels issue thousands of small ops, each run once per simulated rank.
"""

from __future__ import annotations

import pytest
import torch
import transformers
from transformers import AutoConfig

import handwritten_plans
from autotp.errors import PlanError
from autotp.models import build_model, load_config, shrink_config
from autotp.plan import plan_diff, resolve, sharded_param_dims
from autotp.verifier import verify

pytestmark = pytest.mark.filterwarnings("ignore:Parallelize plan key")

LAYERS = 2
TP = 4  # the tiny models shard at 2 and 4
# Reference-kernel widths small enough for a few seconds per verify (see the module docstring).
_TINY_MAMBA = dict(mamba_d_ssm=64, mamba_n_heads=8, mamba_d_head=8, mamba_d_state=16, mamba_chunk_size=16)
_TINY_DELTANET = dict(linear_key_head_dim=16, linear_value_head_dim=16, linear_num_key_heads=4,
                      linear_num_value_heads=8)
_GEMMA4_TEXT = dict(
    vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=LAYERS, num_attention_heads=8,
    num_key_value_heads=4, head_dim=16, global_head_dim=16, sliding_window=4,
    layer_types=["sliding_attention", "full_attention"], vocab_size_per_layer_input=256,
    hidden_size_per_layer_input=16, max_position_embeddings=128,
)


def _tiny_config(model_type: str, **options):
    """``shrink_config`` of the family's default config, with extra options applied."""
    config = shrink_config(load_config(model_type), tp=TP).to_dict()
    config.pop("model_type", None)
    return AutoConfig.for_model(model_type, **{**config, **options})


def _seeded(cls, config):
    torch.manual_seed(0)
    return cls(config).eval()


def _build(name: str) -> torch.nn.Module:
    if name == "mistral3":  # a Ministral3 text backbone, as the released Ministral3 VLMs have
        config = shrink_config(AutoConfig.for_model("mistral3", text_config={"model_type": "ministral3"}), tp=TP)
        return _seeded(transformers.Mistral3ForConditionalGeneration, config)
    if name == "qwen3-cls":
        config = _tiny_config("qwen3", pad_token_id=0, num_labels=3)
        return _seeded(transformers.Qwen3ForSequenceClassification, config)
    if name == "falcon_h1":
        return build_model(_tiny_config("falcon_h1", **_TINY_MAMBA), device="cpu")
    if name == "qwen3_5":
        return build_model(_tiny_config("qwen3_5", **_TINY_DELTANET), device="cpu")
    if name == "gemma4":
        return _seeded(transformers.Gemma4ForCausalLM, transformers.Gemma4TextConfig(**_GEMMA4_TEXT))
    if name == "gemma4-vlm":
        config = transformers.Gemma4Config(text_config=_GEMMA4_TEXT, vision_config=None, audio_config=None)
        return _seeded(transformers.Gemma4ForConditionalGeneration, config)
    return build_model(name, tiny=True, tp=TP, device="cpu")


SP_FAMILIES = ["phi", "ministral3", "mistral3", "qwen3-cls", "qwen3_5"]
TP_ONLY_FAMILIES = ["falcon_h1", "gemma4", "gemma4-vlm"]
FAMILIES = SP_FAMILIES + TP_ONLY_FAMILIES


@pytest.fixture(scope="module")
def tiny_models():
    return {name: _build(name) for name in FAMILIES}


def expected_collectives(name: str, sequence_parallel: bool) -> dict[str, int]:
    """Collectives of one forward, as each plan is designed (2 layers).

    - Llama-shaped (Ministral3, Mistral3, Qwen3 classification), Falcon-H1: 2 all-reduces per layer
      (o_proj, down_proj) + 1 for the vocab-parallel embedding. Falcon-H1's replicated Mamba2 branch
      adds none. SP: 2 all-gathers and 2 reduce-scatters per layer, + 1 reduce-scatter at the
      embedding and 1 all-gather before the head (the replicated ``score`` for classification).
    - Phi (a parallel block): attention and MLP share one LayerNorm, so SP has 1 all-gather per
      layer (+ 1 at the head), and their partial outputs are summed before one all-reduce /
      reduce-scatter per layer.
    - Qwen3.5 (layer 0 linear attention, layer 1 full attention): the head-sharded ``linear_attn``
      reduces at its ``out_proj`` as attention does at ``o_proj``: 2 per layer + 1, as Llama.
    - Gemma4: 2 per layer + 1 for each vocab-parallel table (``embed_tokens``, ``embed_tokens_per_layer``);
      the VLM keeps its tied ``embed_tokens`` / head replicated, so only the per-layer table reduces.
    """
    if name.startswith("gemma4"):
        return {"all_reduce": 2 * LAYERS + (1 if name == "gemma4-vlm" else 2)}
    per_layer = 1 if name == "phi" else 2
    if sequence_parallel:
        return {"all_gather_into_tensor": per_layer * LAYERS + 1, "reduce_scatter_tensor": per_layer * LAYERS + 1}
    return {"all_reduce": per_layer * LAYERS + 1}


def _check(model, plan, tp_size, name, sequence_parallel):
    report = verify(model, plan, tp_size=tp_size)
    assert report.ok, str(report)
    assert max(report.logits_max_abs_diff) <= 1e-5
    assert report.worst_grad[1] <= 1e-5
    assert report.collectives == expected_collectives(name, sequence_parallel)
    return report


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("name", SP_FAMILIES)
def test_handwritten_plan_matches_unsharded_model(tiny_models, name, tp_size, sequence_parallel):
    model = tiny_models[name]
    assert model.config.get_text_config().num_hidden_layers == LAYERS
    plan = handwritten_plans.plan_for(model, sequence_parallel=sequence_parallel)
    report = _check(model, plan, tp_size, name, sequence_parallel)
    if name in ("phi", "ministral3"):  # every parameter sharded
        assert all(abs(f - 1 / tp_size) < 0.01 for f in report.param_fraction), report.param_fraction


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("name", TP_ONLY_FAMILIES)
def test_tp_only_plan_matches_unsharded_model(tiny_models, name, tp_size):
    model = tiny_models[name]
    assert model.config.get_text_config().num_hidden_layers == LAYERS
    _check(model, handwritten_plans.plan_for(model), tp_size, name, False)


@pytest.mark.parametrize("name", TP_ONLY_FAMILIES)
def test_tp_only_plan_refuses_sequence_parallel_by_name(tiny_models, name):
    """Asking for SP raises rather than silently returning the plain plan (NeMo ignores the flag)."""
    with pytest.raises(PlanError, match=type(tiny_models[name]).__name__):
        handwritten_plans.plan_for(tiny_models[name], sequence_parallel=True)


def test_falcon_h1_keeps_the_mamba_mixer_replicated(tiny_models):
    """Would catch a plan that shards in_proj: its output is split into gate / conv / dt groups."""
    model = tiny_models["falcon_h1"]
    plan = handwritten_plans.plan_for(model)
    assert not any(".mamba." in key for key in plan)  # nothing inside the mixer gets a style
    report = verify(model, plan, tp_size=2, backward=False)
    sharded = {f"{fqn}.{n}" for fqn, (_, style) in resolve(model, plan).items()
               for n in sharded_param_dims(model.get_submodule(fqn), style)}
    numel = {n: p.numel() for n, p in model.named_parameters()}
    replicated = sum(v for n, v in numel.items() if n not in sharded)
    assert any(".mamba." in n for n in numel) and not any(".mamba." in n for n in sharded)
    total = sum(numel.values())
    assert report.param_fraction[0] == pytest.approx((replicated + (total - replicated) / 2) / total, abs=1e-6)


def test_qwen3_5_keys_select_each_layer_kind_only(tiny_models):
    """self_attn keys match only the full-attention layer, linear_attn only the linear one."""
    model = tiny_models["qwen3_5"]
    assert model.config.layer_types == ["linear_attention", "full_attention"]
    touched = resolve(model, handwritten_plans.plan_for(model, sequence_parallel=True))
    assert "model.layers.1.self_attn.q_proj" in touched and "model.layers.0.linear_attn.in_proj_qkv" in touched
    assert not any(fqn.startswith("model.layers.0.self_attn") or fqn.startswith("model.layers.1.linear_attn")
                   for fqn in touched)


def test_mistral3_vision_tower_and_projector_stay_replicated(tiny_models):
    model = tiny_models["mistral3"]
    plan = handwritten_plans.plan_for(model, sequence_parallel=True)
    assert all(key.startswith(("model.language_model.", "lm_head")) for key in plan)


# --- Plan equivalence with the synthesizer --------------------------------------------------------


def _synthesize(model, sequence_parallel):
    from autotp.synth import synthesize

    return synthesize(model, sequence_parallel=sequence_parallel, verify=False)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("name", ["phi", "ministral3", "mistral3", "qwen3-cls"])
def test_synthesized_plan_equals_handwritten(tiny_models, name, sequence_parallel):
    """Would catch a handwritten plan that drifts from what the graph analysis derives."""
    model = tiny_models[name]
    hand = handwritten_plans.plan_for(model, sequence_parallel=sequence_parallel)
    assert plan_diff(model, _synthesize(model, sequence_parallel), hand) == {}


@pytest.mark.parametrize("name", ["falcon_h1", "gemma4"])
def test_synthesized_tp_plan_equals_handwritten(tiny_models, name):
    """Hybrid and per-layer-input models: plain TP plans agree module for module."""
    model = tiny_models[name]
    assert plan_diff(model, _synthesize(model, False), handwritten_plans.plan_for(model)) == {}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_qwen3_5_plan_equals_the_synthesized_one(tiny_models, sequence_parallel):
    """The Gated DeltaNet mixer sharded by heads, module for module as the graph analysis derives
    it (packed qkv, conv packed like the parts, per-head A_log / dt_bias, gated norm, row out_proj;
    under SP the mixer's pre-norm all-gathers to a plain tensor, since the mixer masks it).
    Would catch either drifting, or the mixer dropped back to whole."""
    model = tiny_models["qwen3_5"]
    hand = handwritten_plans.plan_for(model, sequence_parallel=sequence_parallel)
    assert plan_diff(model, _synthesize(model, sequence_parallel), hand) == {}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_qwen3_5_plan_survives_a_padded_batch(tiny_models, tp_size, sequence_parallel):
    """The mixer multiplies its input by the padding mask: a DTensor handed to it (a shared or
    sequence-sharded pre-norm output) meets the plain mask and the forward raises. Would catch
    that layout; the sharded mixer must also hold about 1/tp of the parameters."""
    model = tiny_models["qwen3_5"]
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    plan = handwritten_plans.plan_for(model, sequence_parallel=sequence_parallel)
    report = verify(model, plan, tp_size=tp_size, example_inputs={"input_ids": ids, "attention_mask": mask})
    assert report.ok, str(report)
    assert report.param_fraction[0] < 1 / tp_size + 0.02, report.param_fraction


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_qwen3_5_synthesized_plan_with_a_padded_batch(tiny_models, sequence_parallel):
    """The synthesizer traces a left-padded batch by default, so it sees the mixer's mask multiply
    and hands the pre-norm's output on as a plain tensor (under SP, all-gathered once: the mixer
    masks its input with the plain padding mask). Would catch a trace without padding (a shared or
    sequence-sharded DTensor there raises as soon as a batch is padded)."""
    model = tiny_models["qwen3_5"]
    ids = torch.randint(0, 100, (2, 12), generator=torch.Generator().manual_seed(0))
    mask = torch.ones_like(ids)
    mask[0, :3] = 0
    plan = _synthesize(model, sequence_parallel)
    report = verify(model, plan, tp_size=2, example_inputs={"input_ids": ids, "attention_mask": mask})
    assert report.ok, str(report)


def test_gemma4_vlm_tied_embedding_read_outside_its_module_stays_whole(tiny_models):
    """``Gemma4Model.forward`` indexes ``embed_tokens.weight[pad_token_id]`` itself. A vocab-sharded
    weight there mixes a DTensor with plain tensors (``aten.where``), so the synthesizer keeps the
    tied embedding and head whole, from the graph (a read of the weight outside its module), and
    so equals the handwritten VLM plan. Would catch a plan that crashes or reads a shard as the whole."""
    model = tiny_models["gemma4-vlm"]
    assert plan_diff(model, _synthesize(model, False), handwritten_plans.plan_for(model)) == {}
    from autotp.synth import explain

    reasons = {r.key: r.reason for r in explain(model)}
    assert "read by select in model, outside the module" in reasons["lm_head"]

def test_gemma4_kv_heads_replicated_beyond_tp_by_each_attention_head_size(tiny_models):
    """Gemma4's config refuses a single ``head_dim`` (it differs per layer type); the kv-replication
    opt-in reads each attention's own. 4 kv heads at tp=8: each rank holds the kv head it reads.
    Would catch the rewrite failing on the config, or a head split through its rows."""
    model = tiny_models["gemma4"]
    plan = handwritten_plans.plan_for(model, replicate_kv_for_tp=8)
    assert plan["model.layers.*.self_attn.k_proj"].kv_heads == 4
    report = verify(model, plan, tp_size=8)
    assert report.ok, str(report)


@pytest.mark.parametrize("tp_size", [2, TP])
def test_falcon_h1_synthesized_sp_plan_is_exact_where_the_handwritten_offers_none(tiny_models, tp_size):
    """The Mamba mixer stays whole: gathered at entry, its scaled output wrapped as a replicated
    DTensor where it meets the sequence-sharded stream. Would catch the Tensor/DTensor mix in the
    residual add (the reason the handwritten plan offers no SP)."""
    model = tiny_models["falcon_h1"]
    report = verify(model, _synthesize(model, True), tp_size=tp_size)
    assert report.ok, str(report)
    assert report.collectives["reduce_scatter_tensor"] == 5  # 2 per layer and the embedding's
