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


@pytest.mark.multiprocess
def test_gathered_kv_head_verifies_on_two_gloo_processes():
    """One kv head over 2 real processes, gathered (the default): each rank's head is cut from the
    all-gathered k/v outputs (few tokens) or recomputed from the all-gathered weight rows (more
    tokens than the model width), the gradients reduce-scattered back. Would catch the rank index
    or the collectives behaving differently outside simulated ranks."""
    import torch

    from autotp.models import load_config, shrink_config

    config = shrink_config(load_config("qwen3"), tp=2)
    config.num_key_value_heads = 1
    model = build_model(config, device="cpu")
    plan = handwritten_plans.plan_for(model, replicate_kv_for_tp=2)
    assert plan["model.layers.*.self_attn.k_proj"].gather
    many = torch.randint(0, config.vocab_size, (4, 2 * config.hidden_size // 4))
    for inputs in (None, (many,)):
        report = verify_multiprocess(model, plan, procs=2, example_inputs=inputs)
        assert report.ok, str(report)
        assert report.collectives["all_gather_into_tensor"] == 2 * config.num_hidden_layers, report
