"""The self-check: ``synthesize`` (on by default, ``verify=False`` opts out), and ``parallelize`` /
``fsdp2_strategy_parallelize`` verifying a synthesized plan before sharding with it."""

from __future__ import annotations

import logging

import pytest
import torch
from torch.distributed.device_mesh import init_device_mesh

import autotp.facade
import autotp.synth.api
import autotp.training
from autotp import _simulate, synthesize
from autotp.errors import VerificationError
from autotp.models import build_model
from autotp.self_check import self_check
from autotp.selection import PlanChoice
from synth_toy import NanoGPT, example_tokens


def _count_checks(monkeypatch) -> list[dict]:
    """Record every self-check call (keywords), still running the real check."""
    calls, real = [], autotp.self_check.self_check

    def counted(model, plan, **kwargs):
        calls.append(kwargs)
        return real(model, plan, **kwargs)

    monkeypatch.setattr(autotp.self_check, "self_check", counted)
    return calls


def test_correct_plan_is_verified_by_default_and_returned(caplog, monkeypatch):
    """A correct synthesized plan comes back unchanged, after one check that actually ran; with
    ``verify=False`` no check runs."""
    model = build_model("llama", tiny=True, tp=2, device="cpu")
    calls = _count_checks(monkeypatch)
    with caplog.at_level(logging.INFO, logger="autotp.self_check"):
        checked = synthesize(model, tp_size=2)
    assert "on the model itself at tp=2: ok" in caplog.text
    assert len(calls) == 1
    unchecked = synthesize(model, tp_size=2, verify=False)
    assert len(calls) == 1
    assert {k: repr(v) for k, v in checked.items()} == {k: repr(v) for k, v in unchecked.items()}


def test_broken_plan_is_refused_by_default_naming_the_parameter(monkeypatch):
    """Would catch: a builder that leaves a per-head norm without its style, handed out by
    ``synthesize`` as it is. The forward is exact, each rank's norm gradient covers only its own
    heads; the default self-check refuses the plan naming that parameter, ``verify=False`` returns it."""
    def without_head_norms(*args, **kwargs):
        plan = build(*args, **kwargs)
        return {k: v for k, v in plan.items() if not k.endswith("q_norm")}

    build = autotp.synth.api.build_plan
    monkeypatch.setattr(autotp.synth.api, "build_plan", without_head_norms)
    model = build_model("qwen3", tiny=True, tp=2, device="cpu")
    with pytest.raises(VerificationError, match=r"q_norm\.weight differs .* \(allowed") as caught:
        synthesize(model, tp_size=2)
    error = caught.value
    assert error.parameter == "model.layers.0.self_attn.q_norm.weight"
    assert error.difference > error.allowed
    assert max(error.report.logits_max_abs_diff) <= error.allowed  # forward exact: only the gradient is wrong
    unchecked = synthesize(model, tp_size=2, verify=False)
    assert "model.layers.*.self_attn.q_proj" in unchecked
    assert not any(key.endswith("q_norm") for key in unchecked)  # the wrong plan, handed out on request


def test_model_without_config_is_verified_on_its_example_inputs(caplog):
    """A plain PyTorch model (no transformers config) is verified itself, on the inputs it was traced with."""
    with caplog.at_level(logging.INFO, logger="autotp.self_check"):
        plan = synthesize(NanoGPT(), example_inputs=(example_tokens(),), tp_size=2)
    assert plan
    assert "on the model itself at tp=2: ok" in caplog.text


def test_meta_model_without_config_says_it_could_not_check(caplog):
    """No values and no config to build a tiny copy from: a warning, not silence, and no report."""
    with torch.device("meta"):
        model = NanoGPT()
    with caplog.at_level(logging.WARNING, logger="autotp.self_check"):
        assert self_check(model, {}, tp_size=2) is None
    assert "could not self-check" in caplog.text and "meta device" in caplog.text


def test_meta_model_with_config_is_checked_on_a_tiny_copy(caplog, monkeypatch):
    """A real-size config on meta: ``synthesize`` verifies its plan on a tiny copy, once (the
    copy's own synthesis, where the plan does not fit it, does not check again)."""
    model = build_model("llama")  # 8B shapes, no storage
    calls = _count_checks(monkeypatch)
    with caplog.at_level(logging.INFO, logger="autotp.self_check"):
        plan = synthesize(model, tp_size=2)
    assert plan and len(calls) == 1
    assert "on a tiny copy at tp=2: ok" in caplog.text
    assert "does not fit" not in caplog.text  # the real plan itself ran on the copy


@pytest.mark.slow  # a real-size synthesis and two tiny-copy checks; the default path is checked once above
def test_tiny_copy_that_needs_its_own_plan_synthesizes_it_unchecked(monkeypatch):
    """Would catch: the self-check's fallback (the plan does not fit the tiny copy) synthesizing the
    copy's plan with the default self-check, which would check it twice, or recurse."""
    model = build_model("llama")
    calls = _count_checks(monkeypatch)
    wrong_keys = {"model.layers.*.mlp.not_there": next(iter(synthesize(model, tp_size=2, verify=False).values()))}
    report = autotp.self_check.self_check(model, wrong_keys, tp_size=2)
    assert report is not None and report.ok  # the copy's own plan, verified explicitly
    assert len(calls) == 1


def _record_calls(monkeypatch, plan):
    """Make get_plan hand out ``plan`` as synthesized, and record the self-check's calls (both as
    autotp.decision, which parallelize and fsdp2_strategy_parallelize decide with, imported them)."""
    calls = []
    chosen = lambda model, **kw: PlanChoice(plan, "synthesized")  # noqa: E731
    monkeypatch.setattr("autotp.decision.get_plan", chosen)
    monkeypatch.setattr("autotp.decision.self_check", lambda model, plan, **kw: calls.append(kw))
    return calls


@pytest.mark.parametrize("opt_out", [False, True])
def test_parallelize_checks_synthesized_plans_unless_opted_out(monkeypatch, opt_out):
    from autotp import parallelize

    model = build_model("llama", tiny=True, tp=2, device="cpu")
    calls = _record_calls(monkeypatch, synthesize(model, tp_size=2, verify=False))
    with _simulate.simulated_mesh(2) as mesh:
        parallelize(model, mesh, **({"verify_synthesized": False} if opt_out else {}))
    assert calls == ([] if opt_out else [{"tp_size": 2, "sequence_parallel": False, "example_inputs": None}])
    assert hasattr(model.model.layers[0].mlp.up_proj.weight, "placements")  # sharded either way


@pytest.mark.parametrize("opt_out", [False, True])
def test_fsdp2_strategy_checks_synthesized_plans_unless_opted_out(monkeypatch, opt_out):
    from autotp.training import fsdp2_strategy_parallelize

    model = build_model("llama", tiny=True, tp=2, device="cpu")
    calls = _record_calls(monkeypatch, synthesize(model, tp_size=2, verify=False))
    with _simulate.simulated_mesh(2):
        mesh = init_device_mesh("cpu", (2,), mesh_dim_names=("tp",))
        fsdp2_strategy_parallelize(model, mesh, **({"verify_synthesized": False} if opt_out else {}))
    assert calls == ([] if opt_out else [{"tp_size": 2, "sequence_parallel": False, "example_inputs": None}])


def _gloo_rank(rank: int, port: int, results) -> None:
    """One rank: parallelize with the default self-check under a live gloo group, then use the group."""
    import copy
    import os

    import torch.distributed as dist

    from autotp import parallelize
    from autotp.verifier import call_model, default_inputs

    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=2)
    try:
        records = []
        handler = logging.Handler()
        handler.emit = records.append
        logging.getLogger("autotp.self_check").addHandler(handler)
        logging.getLogger("autotp.self_check").setLevel(logging.INFO)
        model = build_model("gemma2", tiny=True, tp=2, device="cpu")
        reference, inputs = copy.deepcopy(model), default_inputs(model, 2)
        mesh = init_device_mesh("cpu", (2,))
        parallelize(model, mesh)
        total = torch.tensor([float(rank + 1)])
        dist.all_reduce(total)  # the group still works after the check ran beside it
        logits = call_model(model, inputs)
        logits = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
        diff = (logits - call_model(reference, inputs)).abs().max().item()
        results.put((rank, [r.getMessage() for r in records], total.item(), diff, None))
    except Exception as error:  # reported to the test, which fails with it
        results.put((rank, [], None, None, f"{type(error).__name__}: {error}"))
    finally:
        dist.destroy_process_group()


@pytest.mark.multiprocess
def test_self_check_under_a_gloo_group_leaves_it_working():
    """Would catch: the self-check initialising simulated ranks inside a live process group (it
    refuses, or tears the group down). It runs isolated; the group all-reduces and the sharded
    model matches the unsharded one afterwards."""
    import torch.multiprocessing as mp

    from autotp.multiprocess import _free_port

    context = mp.get_context("spawn")
    results, port = context.Queue(), _free_port()
    workers = [context.Process(target=_gloo_rank, args=(rank, port, results)) for rank in range(2)]
    for worker in workers:
        worker.start()
    outcomes = sorted(results.get(timeout=300) for _ in workers)
    for worker in workers:
        worker.join(timeout=30)
    checked = []
    for rank, messages, total, diff, error in outcomes:
        assert error is None, f"rank {rank}: {error}"
        # Logged by the self-check, which runs only for a synthesized plan: the plan source too.
        checked.append(any("synthesized plan on the model itself at tp=2: ok" in m for m in messages))
        assert total == 3.0
        assert diff <= 1e-5
    assert checked == [True, False], "the first rank of the tp group checks, the other receives its plan"
