"""A plain-PyTorch model (no transformers config) through the main entry points, with ``example_inputs``.

``get_plan``, ``parallelize`` and ``fsdp2_strategy_parallelize`` take the same ``example_inputs``
keyword as ``synthesize``, ``check_plan`` and ``verify``; without it a model that has no config to
make token ids from is refused with one line that says to pass them.
"""

from __future__ import annotations

import copy
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch.distributed.tensor import DTensor

import autotp
from autotp import _simulate
from autotp.errors import AutoTPError, NoPlanError
from autotp.plan import describe_plan
from synth_toy import VOCAB, TitanLlama, example_tokens

TP = 2


def _loss(logits: torch.Tensor) -> torch.Tensor:
    flat = logits.reshape(-1, logits.shape[-1])
    return F.cross_entropy(flat, torch.arange(flat.shape[0]) * 7 % VOCAB)


@pytest.fixture(scope="module")
def toy():
    """A torchtitan-style Llama (plain nn.Modules), tokens for it, and its unsharded logits and
    gradients."""
    torch.manual_seed(0)
    model, ids = TitanLlama(layers=2), example_tokens()
    reference = copy.deepcopy(model)
    logits = reference(ids)
    _loss(logits).backward()
    return model, ids, logits.detach(), {n: p.grad for n, p in reference.named_parameters()}


@pytest.mark.parametrize("verify_synthesized", [False, pytest.param(True, marks=pytest.mark.slow)],
                         ids=["unchecked", "self_checked"])
def test_plain_model_through_parallelize_gives_unsharded_logits_and_gradients(toy, verify_synthesized):
    """Would catch ``example_inputs`` not reaching selection (a NoPlanError) or the self-check, or
    the sharded model disagreeing with the unsharded one. (Under simulated ranks the self-check runs
    in a child interpreter, ~15-20 s: the default tier checks the model itself here.)"""
    model, ids, want_logits, want_grads = toy
    with _simulate.simulated_mesh(TP) as mesh:
        sharded = autotp.parallelize(copy.deepcopy(model), mesh, example_inputs=(ids,), loss_parallel=False,
                                     verify_synthesized=verify_synthesized)
        assert any(isinstance(p, DTensor) for p in sharded.parameters()), "nothing was sharded"
        logits = sharded(ids)
        _loss(logits).backward()
        for rank, got in enumerate(_simulate.per_rank(logits, TP)):
            torch.testing.assert_close(got, want_logits, atol=1e-5, rtol=1e-4, msg=f"rank {rank} logits")
        grads = {n: p.grad for n, p in sharded.named_parameters()}
        assert grads.keys() == want_grads.keys()
        for name, grad in grads.items():
            whole = grad.full_tensor() if isinstance(grad, DTensor) else grad
            for rank, got in enumerate(_simulate.per_rank(whole, TP)):
                torch.testing.assert_close(got, want_grads[name], atol=1e-5, rtol=1e-4, msg=f"rank {rank} {name}")


def test_get_plan_with_example_inputs_returns_the_synthesized_plan(toy):
    model, ids, _, _ = toy
    choice = autotp.get_plan(model, tp_size=TP, example_inputs=(ids,))
    assert choice.source == "synthesized"
    assert describe_plan(choice.plan) == describe_plan(autotp.synthesize(model, example_inputs=(ids,), tp_size=TP))


def test_without_example_inputs_the_error_says_to_pass_them(toy):
    model = toy[0]
    with pytest.raises(NoPlanError) as error:
        autotp.get_plan(model, tp_size=TP)
    text = str(error.value)
    assert "\n" not in text and len(text) < 300 and "example_inputs=" in text and text.startswith("TitanLlama:")
    with _simulate.simulated_mesh(TP) as mesh, pytest.raises(NoPlanError, match="pass example_inputs="):
        autotp.parallelize(copy.deepcopy(model), mesh)


def test_verify_takes_example_inputs_and_still_takes_inputs_with_a_warning(toy):
    model, ids, _, _ = toy
    plan = autotp.synthesize(model, example_inputs=(ids,), tp_size=TP)
    with warnings.catch_warnings():
        warnings.simplefilter("error", DeprecationWarning)  # the new name warns about nothing
        report = autotp.verify(model, plan, tp_size=TP, example_inputs=(ids,), backward=False)
    assert report.ok, str(report)
    with pytest.warns(DeprecationWarning, match="example_inputs"):
        old = autotp.verify(model, plan, tp_size=TP, inputs=(ids,), backward=False)
    assert old.logits_max_abs_diff == report.logits_max_abs_diff
    with pytest.raises(AutoTPError, match="both example_inputs= and inputs="):
        autotp.verify(model, plan, tp_size=TP, example_inputs=(ids,), inputs=(ids,))
