"""The handwritten plans, verified numerically against the unsharded model on simulated ranks.

Tolerance: 1e-5 max abs difference on fp32 logits and on every parameter gradient (each rank's
local shard against the matching slice of the reference gradient).
"""

import pytest

import handwritten_plans
from autotp.models import build_model
from autotp.verifier import verify

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3-vlm", "phi3"]
LAYERS = 2


def expected_collectives(name: str, sequence_parallel: bool) -> dict[str, int]:
    """Collectives of one forward, as the plans are designed.

    Llama-shaped plans: 2 all-reduces per layer (o_proj, down_proj) + 1 for the vocab-parallel
    embedding; under SP, 2 all-gathers and 2 reduce-scatters per layer + 1 of each at the
    embedding / head boundary. Gemma3 keeps the tied embedding and head replicated (as NeMo does),
    so it has no embedding all-reduce or reduce-scatter, and one all-gather before the head.
    """
    if name.startswith("gemma3"):
        if sequence_parallel:
            return {"all_gather_into_tensor": 2 * LAYERS + 1, "reduce_scatter_tensor": 2 * LAYERS}
        return {"all_reduce": 2 * LAYERS}
    if sequence_parallel:
        return {"all_gather_into_tensor": 2 * LAYERS + 1, "reduce_scatter_tensor": 2 * LAYERS + 1}
    return {"all_reduce": 2 * LAYERS + 1}


@pytest.fixture(scope="module")
def tiny_models():
    return {name: build_model(name, tiny=True, tp=4, device="cpu") for name in FAMILIES}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("name", FAMILIES)
def test_handwritten_plan_matches_unsharded_model(tiny_models, name, tp_size, sequence_parallel):
    model = tiny_models[name]
    assert model.config.get_text_config().num_hidden_layers == LAYERS
    plan = handwritten_plans.plan_for(model, sequence_parallel=sequence_parallel)
    report = verify(model, plan, tp_size=tp_size)
    assert report.ok, str(report)
    assert max(report.logits_max_abs_diff) <= 1e-5
    assert report.worst_grad[1] <= 1e-5
    assert report.collectives == expected_collectives(name, sequence_parallel)
    # Every gradient has its parameter's placement and local size (the vocab-parallel table's too).
    assert report.grads_not_local_size == []
    if not name.startswith("gemma3"):  # Gemma3's tied embedding stays replicated by design
        assert all(abs(f - 1 / tp_size) < 0.01 for f in report.param_fraction), report.param_fraction


def test_phi3_plan_shards_the_fused_projections(tiny_models):
    """The fused qkv_proj and gate_up_proj hold 1/tp of their rows on each rank, not a replica."""
    model = tiny_models["phi3"]
    plan = handwritten_plans.plan_for(model)
    assert type(plan["model.layers.*.self_attn.qkv_proj"]).__name__ == "Colwise"
    assert type(plan["model.layers.*.mlp.gate_up_proj"]).__name__ == "Colwise"


def test_registry_is_keyed_by_module_and_qualname(tiny_models):
    """A class another framework re-creates with type(...) and the same module/qualname finds the plan."""
    llama = tiny_models["llama"]
    original = type(llama)
    wrapper = type(original.__name__, (original,), {"__module__": original.__module__, "__qualname__": original.__qualname__})
    assert wrapper is not original
    assert handwritten_plans.plan_function(llama) is handwritten_plans.plan_function(object.__new__(wrapper))


def test_unregistered_class_gets_no_handwritten_plan(tiny_models):
    llama = tiny_models["llama"]
    other = type("MyLlama", (type(llama),), {"__module__": "my_framework.models"})
    assert handwritten_plans.plan_for(object.__new__(other)) is None


def test_sp_plan_works_on_a_plain_call_with_global_positions(tiny_models):
    """Under SP the residual stays a sequence-sharded DTensor, so transformers builds position ids
    and the causal mask from the global length: logits equal the unsharded ones at every position."""
    model = tiny_models["llama"]
    report = verify(model, handwritten_plans.plan_for(model, sequence_parallel=True), tp_size=4, backward=False)
    assert report.ok, str(report)
