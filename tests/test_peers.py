"""The synthesizer on another project's own model classes, as shipped: torchtitan's Llama3, Qwen3,
Qwen3-MoE and DeepSeek-V3 (layers in an ``nn.ModuleDict``, torchtitan's ``Embedding`` that unwraps
a DTensor weight itself, fused wqkv, QK-norm, grouped experts beside their router, a dense layer
before MoE layers), tiny configs (two layers) with random weights.

Each model is verified against its unsharded self (logits and every gradient) at tp 2 and 4, plain
and sequence parallel, and the synthesized plan is compared with torchtitan's own tensor-parallel
sharding (``Module.parallelize`` with its ``set_*_sharding_config``), parameter by parameter: every
parameter's placement and local shape after each plan is applied on a simulated mesh.

One departure from the shipped configs: torchtitan 0.3.0 builds its language models with
FlexAttention, which has no backward on CPU, so the layers use torchtitan's own
``ScaledDotProductAttention`` module instead (same parameters, no attention mask: causal).

torchtitan's grouped experts compute in bfloat16 (``x.bfloat16()``, ``w.bfloat16()`` in
``GroupedExperts.forward``). Sharded on their FFN dim, each rank rounds its partial sum to bf16
before the reduction, so any TP plan of them (torchtitan's own too: the placements are the same)
differs from the unsharded model by bf16 rounding, which a float64 re-run keeps. ``verify`` finds
the casts and re-runs the check with them made exact (:mod:`autotp.casts`); its verdict says which:
``"rounding"`` on Qwen3-MoE (logits 2.4e-4 relative as shipped, 4.8e-7 with the casts exact, tp 2).

Skipped when torchtitan is not installed (``pip install -e .[peers]``).
"""

import copy
import importlib
import warnings

import pytest
import torch
from torch.distributed.tensor import DTensor, Replicate

pytest.importorskip("torchtitan", reason="torchtitan is an optional test dependency (extra 'peers')")

from torchtitan.distributed import ParallelDims
from torchtitan.models.common.attention import ScaledDotProductAttention

from autotp import _simulate
from autotp.apply import apply_plan
from autotp.styles import ExpertsParallel
from autotp.synth import synthesize
from autotp.verifier import verify

# model -> (torchtitan package, flavor, its sharding-config setter, setter options)
MODELS = {
    "llama3": ("llama3", "debugmodel", "set_llama3_sharding_config", {}),
    "qwen3": ("qwen3", "debugmodel", "set_qwen3_sharding_config", {"enable_ep": False}),
    "qwen3-moe": ("qwen3", "debugmodel_moe", "set_qwen3_sharding_config", {"enable_ep": False}),
    "deepseek-v3": ("deepseek_v3", "debugmodel", "set_deepseek_v3_sharding_config", {"enable_ep": False}),
}
VERIFIED = ["deepseek-v3", "llama3", "qwen3", "qwen3-moe"]
EQUAL = ["llama3", "qwen3", "qwen3-moe", "deepseek-v3"]
# verify's verdict as shipped (issue 42 item 6). Qwen3-MoE's bf16 experts put it 25 to 35 times
# the tolerance above the unsharded model, DeepSeek-V3's (one MoE layer, 8 experts) within it.
VERDICTS = {"llama3": "exact", "qwen3": "exact", "qwen3-moe": "rounding", "deepseek-v3": "exact"}
VOCAB = 2048  # the debug flavors' vocabulary


def build(name: str, *, sequence_parallel: bool | None = None, layers: int = 2):
    """torchtitan's debug flavor of ``name`` with ``layers`` layers, initialised by torchtitan; with
    its own sharding config filled in when ``sequence_parallel`` is given."""
    package, flavor, setter, options = MODELS[name]
    config = importlib.import_module(f"torchtitan.models.{package}").model_registry(flavor).model
    config.layers = config.layers[:layers]
    for layer in config.layers:
        layer.attention.inner_attention = ScaledDotProductAttention.Config()
    if sequence_parallel is not None:
        sharding = importlib.import_module(f"torchtitan.models.{package}.sharding")
        getattr(sharding, setter)(config, enable_sp=sequence_parallel, **options)
    torch.manual_seed(0)
    model = config.build()
    model.init_states(buffer_device=torch.device("cpu"))
    return model


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 16), generator=torch.Generator().manual_seed(0))


def layout(model) -> dict[str, tuple]:
    """Per parameter: its placements and local shape (a plain parameter is whole: ``Replicate()``)."""
    out = {}
    for name, param in model.named_parameters():
        if isinstance(param, DTensor):
            out[name] = (tuple(param.placements), tuple(param.to_local().shape))
        else:
            out[name] = ((Replicate(),), tuple(param.shape))
    return out


def verified(model, plan, tp_size: int, **options):
    """``verify`` on the test tokens, torch's DTensor warnings silenced."""
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        return verify(model, plan, tp_size=tp_size, example_inputs=(tokens(),), **options)


@pytest.fixture
def titan_cpu_mesh(monkeypatch):
    """torchtitan builds its meshes on its module-level ``device_type`` (cuda when present)."""
    from torchtitan.distributed import parallel_dims

    monkeypatch.setattr(parallel_dims, "device_type", "cpu")


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("name", VERIFIED)
def test_torchtitan_model_as_shipped_is_synthesized_and_verified(name, tp_size, sequence_parallel):
    """Would catch ModuleDict layers not read as a layer stack, torchtitan's Embedding
    failing on DTensor ids (it unwraps its weight itself), or Qwen3-MoE's routing weights, applied
    to the experts' output in the block's combine, left with a partial gradient under SP (its
    router weight's gradient was 65% off)."""
    model = build(name)
    plan = synthesize(model, example_inputs=(tokens(),), sequence_parallel=sequence_parallel, tp_size=tp_size,
                      verify=False)
    assert any(key.startswith("layers.") for key in plan)  # keyed by the dict's keys
    report = verified(model, plan, tp_size)  # as shipped: the experts' bf16 casts run
    assert report.ok, str(report)
    assert report.verdict == VERDICTS[name], str(report)
    if report.verdict == "rounding":  # with the casts made exact it agrees at fp32 rounding
        assert report.exact_casts.verdict == "exact" and report.exact_casts.float64 is None, str(report)
    # DeepSeek-V3's MLA keeps its kv down-projection, norms and router whole on every rank (as
    # torchtitan's own plan does): 0.514 at tp 2, 0.271 at tp 4 in the debug flavor.
    slack = 0.03 if name == "deepseek-v3" else 0.01
    assert all(abs(f - 1 / tp_size) < slack for f in report.param_fraction), report.param_fraction


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("name", EQUAL)
def test_synthesized_plan_equals_torchtitans_own_sharding(name, tp_size, sequence_parallel, titan_cpu_mesh):
    """Every parameter's placement and local shape after the synthesized plan equals what
    torchtitan's own ``parallelize`` gives it: the regression anchor on code autotp did not write."""
    model = build(name, sequence_parallel=sequence_parallel)
    plan = synthesize(model, example_inputs=(tokens(),), sequence_parallel=sequence_parallel, tp_size=tp_size,
                      verify=False)
    with _simulate.simulated_mesh(tp_size) as mesh:
        ours = copy.deepcopy(model)
        apply_plan(ours, mesh, plan)
        theirs = copy.deepcopy(model)
        dims = ParallelDims(dp_replicate=1, dp_shard=1, cp=1, tp=tp_size, pp=1, ep=1, world_size=tp_size,
                            spmd_backend="partial_dtensor")
        dims.build_mesh()
        theirs.parallelize(dims)
        ours_layout, theirs_layout = layout(ours), layout(theirs)
    differ = {n: (ours_layout[n], theirs_layout[n]) for n in ours_layout if ours_layout[n] != theirs_layout[n]}
    assert differ == {}


def test_qwen3_moe_bf16_rounding_is_told_from_a_wrong_plan():
    """The same bf16 experts with their partial sums never reduced (``side="columns"``: each rank's
    partial output is handed on as the whole) stay a mismatch when the casts are made exact:
    ``"rounding"`` above is not a pass for any difference in a model that casts."""
    model = build("qwen3-moe")
    plan = synthesize(model, example_inputs=(tokens(),), sequence_parallel=False, tp_size=2, verify=False)
    key = "layers.*.moe.routed_experts.inner_experts"
    plan[key] = ExpertsParallel(shard_dims=plan[key].shard_dims, packed=plan[key].packed, side="columns")
    report = verified(model, plan, 2)
    assert report.verdict == "mismatch" and report.low_precision_casts, str(report)
    assert not report.exact_casts.ok, str(report)


def test_deepseek_v3_bf16_difference_is_rounding_below_the_tolerance():
    """DeepSeek-V3's one MoE layer casts too, but its difference as shipped is within the tolerance
    (logits 1.2e-5 on a scale of 4.5, the router's gradient 4.9e-7 where it peaks at 3e-4: 1.6e-3
    relative). Held to 5e-7, between that and what the same check gives with the casts made exact
    (logits 1.2e-6, gradients 2e-8), the verdict says the difference is bf16 rounding too, not a
    plan error the tolerance hides. (No float64 re-run: ``torch._grouped_mm`` has no float64 kernel.)"""
    model = build("deepseek-v3")
    plan = synthesize(model, example_inputs=(tokens(),), sequence_parallel=False, tp_size=2, verify=False)
    report = verified(model, plan, 2, tolerance=5e-7)
    assert report.verdict == "rounding", str(report)
    assert report.low_precision_casts == {"bfloat16": 6}, str(report)
