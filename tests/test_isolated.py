"""``verify(..., isolated=True)``: a verification whose worker dies is a failed report, not a dead test."""

from __future__ import annotations

import os
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from autotp import synthesize, verify
from autotp.errors import VerificationError
from autotp.verifier import require_ok
from synth_toy import VOCAB, NanoGPT, example_tokens

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))  # the coverage sweep


class AbortInForward(ParallelStyle):
    """A style whose module kills its process in forward, as a corrupted heap does (SIGABRT)."""

    def _apply(self, module: nn.Module, device_mesh) -> nn.Module:
        module.register_forward_hook(_abort)
        return module


def _abort(*_):
    os.abort()


@pytest.fixture(scope="module")
def toy_and_plan():
    model = NanoGPT()
    return model, synthesize(model, example_inputs=(example_tokens(),), tp_size=2, verify=False)


def test_isolated_run_reports_what_the_in_process_run_does(toy_and_plan):
    model, plan = toy_and_plan
    inputs = (example_tokens(),)
    isolated = verify(model, plan, tp_size=2, example_inputs=inputs, isolated=True)
    local = verify(model, plan, tp_size=2, example_inputs=inputs)
    assert isolated.ok and local.ok
    assert isolated.crash is None
    assert isolated.grad_max_abs_diff.keys() == local.grad_max_abs_diff.keys()
    assert isolated.collectives == local.collectives


def test_worker_killed_by_a_signal_is_a_failed_report_naming_it(toy_and_plan):
    """Would catch: a crash of the simulated runtime taking the caller down with it."""
    model, plan = toy_and_plan
    aborting = {**plan, "ln_f": AbortInForward()}
    report = verify(model, aborting, tp_size=2, example_inputs=(example_tokens(),), isolated=True)
    assert not report.ok
    assert report.crash == "SIGABRT"
    assert "verification worker died (SIGABRT)" in str(report)
    with pytest.raises(VerificationError, match="SIGABRT") as caught:
        require_ok(report, what="the toy's plan")
    assert caught.value.crash == "SIGABRT"


def test_bad_plan_raises_in_the_caller_as_it_would_in_process(toy_and_plan):
    """An error the verifier raises on bad input (a key matching nothing) crosses back unchanged."""
    from autotp.errors import PlanError

    model, plan = toy_and_plan
    with pytest.raises(PlanError, match="no_such_module"):
        verify(model, {**plan, "no_such_module": AbortInForward()}, tp_size=2, example_inputs=(example_tokens(),),
               isolated=True)


def test_model_that_cannot_be_sent_is_refused_before_starting_a_worker():
    class Local(nn.Module):  # defined in a function: the child cannot import it
        def __init__(self):
            super().__init__()
            self.proj = nn.Linear(4, 4)

    with pytest.raises(VerificationError, match="pickle"):
        verify(Local(), {}, tp_size=2, example_inputs=(), isolated=True)



class _TokenModel(nn.Module):
    """The toy behind a ``config.vocab_size``, so the sweep draws token ids for it as for a transformers model."""

    def __init__(self, inner: nn.Module):
        super().__init__()
        self.inner = inner
        self.config = SimpleNamespace(vocab_size=VOCAB)

    def forward(self, input_ids):
        return self.inner(input_ids)


@pytest.mark.multiprocess
def test_coverage_records_a_crash_with_its_signal(toy_and_plan):
    """The sweep's row for a plan whose verification kills its worker: runtime-crashed, the signal,
    each isolated run, and the gloo re-check that died too (so the crash stands)."""
    from coverage import check_and_verify

    model, plan = toy_and_plan
    aborting = {f"inner.{key}": style for key, style in {**plan, "ln_f": AbortInForward()}.items()}
    row = check_and_verify(_TokenModel(model), aborting, 2, isolated=1)
    assert row["status"] == "failed" and row["reason"] == "runtime-crashed"
    assert row["signal"] == "SIGABRT" and row["isolated_runs"] == ["crashed (SIGABRT)"]
    assert "SIGABRT" in row["gloo"]


def test_fake_tensor_left_in_module_state_is_dropped_from_the_copies_only():
    """Would catch: a trace's leftover fake tensor (module state written in forward) copied into the
    verified models, which corrupted the simulated runtime's memory on a recurrent block."""
    from torch._subclasses.fake_tensor import FakeTensorMode

    from autotp.verifier import clean_copy, trace_leftovers

    model = nn.Sequential(nn.Linear(4, 4))
    with FakeTensorMode():
        model[0].state = torch.zeros(2, 4)  # what a module saving its state in forward leaves after export
    assert list(trace_leftovers(model)) == ["0.state"]
    copied = clean_copy(model)
    assert copied[0].state is None and trace_leftovers(copied) == {}
    assert list(trace_leftovers(model)) == ["0.state"]  # the caller's model is not modified
    assert torch.equal(copied[0].weight, model[0].weight)
