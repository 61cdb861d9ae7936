"""The verifier must fail wrong plans: each test gives it a plan with one known bug."""

import copy

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import handwritten_plans
from autotp.errors import PlanError, VerificationError
from autotp.models import build_model
from autotp.verifier import verify


@pytest.fixture(scope="module")
def phi3():
    return build_model("phi3", tiny=True, tp=2, device="cpu")


@pytest.fixture(scope="module")
def qwen3():
    return build_model("qwen3", tiny=True, tp=2, device="cpu")


def test_contiguous_split_of_fused_gate_up_gives_wrong_logits(phi3):
    """Plain ColwiseParallel on [gate | up] runs without error but mixes gate and up rows."""
    plan = handwritten_plans.plan_for(phi3)
    plan["model.layers.*.mlp.gate_up_proj"] = ColwiseParallel()
    report = verify(phi3, plan, tp_size=2)
    assert report.error is None
    assert not report.ok
    assert max(report.logits_max_abs_diff) > 1e-3


def test_unreduced_qk_norm_gradient_is_caught(qwen3):
    """Leaving q_norm/k_norm as plain replicated modules gives right logits but per-rank partial
    weight gradients, which would make the replicas drift apart after one step."""
    plan = handwritten_plans.plan_for(qwen3)
    del plan["model.layers.*.self_attn.q_norm"], plan["model.layers.*.self_attn.k_norm"]
    report = verify(qwen3, plan, tp_size=2)
    assert max(report.logits_max_abs_diff) <= 1e-5
    assert not report.ok
    assert "norm" in report.worst_grad[0]


def test_a_plan_that_breaks_shapes_is_reported_not_raised(qwen3):
    plan = handwritten_plans.plan_for(qwen3)
    plan["model.layers.*.self_attn.o_proj"] = ColwiseParallel()
    report = verify(qwen3, plan, tp_size=2)
    assert not report.ok and report.error is not None
    assert "FAILED" in str(report)


def test_plan_key_matching_nothing_is_an_error(qwen3):
    plan = {"model.layers.*.self_attn.qkv": ColwiseParallel(), "model.layers.*.self_attn.o_proj": RowwiseParallel()}
    with pytest.raises(PlanError, match="matches no module"):
        verify(qwen3, plan, tp_size=2)


def test_meta_model_is_refused():
    model = build_model("llama")  # real size, meta device
    with pytest.raises(VerificationError, match="meta device"):
        verify(model, handwritten_plans.plan_for(model), tp_size=2)


def test_verify_leaves_the_model_untouched(qwen3):
    before = copy.deepcopy(qwen3.state_dict())
    verify(qwen3, handwritten_plans.plan_for(qwen3), tp_size=2)
    after = qwen3.state_dict()
    assert all(torch.equal(before[k], after[k]) for k in before)
    assert all(p.grad is None for p in qwen3.parameters())


@pytest.mark.parametrize("tp_size", [2, 4, 8])
def test_verify_runs_at_tp_2_4_8(tp_size):
    model = build_model("llama", tiny=True, tp=8, device="cpu")
    report = verify(model, handwritten_plans.plan_for(model), tp_size=tp_size)
    assert report.ok, str(report)
    assert len(report.logits_max_abs_diff) == tp_size


def test_float32_rounding_above_tolerance_is_settled_in_float64(qwen3):
    """A correct plan judged at a tolerance below fp32 rounding: the differences are re-run in
    float64, where the plan agrees to ~1e-13, so the verdict is OK and the report says why."""
    report = verify(qwen3, handwritten_plans.plan_for(qwen3), tp_size=2, tolerance=1e-8)
    assert not report.within(1.0)  # fp32 alone would call it a mismatch
    assert report.float64 is not None and report.ok
    assert max(report.float64.logits_max_abs_diff) < 1e-11
    assert "rounding, the plan is exact" in str(report)


def test_float64_recheck_does_not_pass_a_wrong_plan(phi3):
    """A wrong plan whose fp32 error falls in the re-check window is still wrong in float64."""
    plan = handwritten_plans.plan_for(phi3)
    plan["model.layers.*.mlp.gate_up_proj"] = ColwiseParallel()
    report = verify(phi3, plan, tp_size=2, tolerance=1e-2)
    assert report.float64 is not None
    assert not report.ok and max(report.float64.logits_max_abs_diff) > 1e-3
