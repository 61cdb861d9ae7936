"""End to end on a real process group: 2 gloo processes on 127.0.0.1 (about 15 s)."""

import pytest

import handwritten_plans
from autotp.models import build_model
from autotp.multiprocess import verify_multiprocess


@pytest.mark.multiprocess
def test_sp_plan_verifies_on_two_gloo_processes():
    """Hooks, real collectives and autograd across processes agree with the unsharded model."""
    model = build_model("qwen3", tiny=True, tp=2, device="cpu")
    report = verify_multiprocess(model, handwritten_plans.plan_for(model, sequence_parallel=True), procs=2)
    assert report.ok, str(report)
    assert len(report.grad_max_abs_diff) == len(list(model.parameters()))
    assert report.collectives == {"all_gather_into_tensor": 5, "reduce_scatter_tensor": 5}
