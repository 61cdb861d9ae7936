"""transformers' own ``labels=`` loss on a TP-sharded model, against the unsharded model.

The plans keep the logits vocabulary-sharded (``Shard(-1)``); :mod:`autotp.loss` installs a causal-LM
loss that reads them so. Simulated-rank tests check the loss and every gradient against the
unsharded model (labels with ``-100`` included); one launch of 4 gloo processes checks a whole
training step (FSDP2 x TP and TP alone, plain and sequence parallel) against single-process training.
"""

from __future__ import annotations

import copy

import pytest
import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch.distributed.device_mesh import init_device_mesh
from torch.distributed.tensor import DTensor, Shard, distribute_tensor
from torch.distributed.tensor.debug import CommDebugMode
from torch.distributed.tensor.parallel import loss_parallel

import autotp
import handwritten_plans
from autotp._simulate import per_rank, simulated_mesh
from autotp.errors import AutoTPError
from autotp.loss import (
    VocabParallelCausalLMLoss,
    install_vocab_parallel_loss,
    vocab_parallel_cross_entropy,
)
from autotp.models import build_model
from gloo_launch import run_on_ranks

TOLERANCE = 1e-5
IGNORE = -100


def _ids_and_labels(vocab: int, *, batch: int = 2, seq: int = 8, seed: int = 0):
    """Token ids, and labels that ignore (``-100``) a prompt of 3 tokens in every row and one more."""
    ids = torch.randint(0, vocab, (batch, seq), generator=torch.Generator().manual_seed(seed))
    labels = ids.clone()
    labels[:, :3] = IGNORE
    labels[0, 5] = IGNORE
    return ids, labels


def _full(t: torch.Tensor) -> torch.Tensor:
    return t.full_tensor() if isinstance(t, DTensor) else t


# ---------------------------------------------------------------- the loss function itself


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("num_items", [None, 7])
def test_vocab_parallel_cross_entropy_matches_cross_entropy(tp, num_items, vocab=16):
    """Value and gradient equal F.cross_entropy with ignored targets (mean, or sum / num_items).
    A mean over all targets (ignored ones counted) or an ignored target that still picks a logit
    would change both."""
    generator = torch.Generator().manual_seed(1)
    logits = 3 * torch.randn(2, 6, vocab, generator=generator)
    targets = torch.randint(0, vocab, (2, 6), generator=generator)
    targets[0, :2] = IGNORE
    reference = logits.clone().requires_grad_()
    reduction = "mean" if num_items is None else "sum"
    expected = F.cross_entropy(reference.flatten(0, 1), targets.flatten(), ignore_index=IGNORE, reduction=reduction)
    expected = expected if num_items is None else expected / num_items
    expected.backward()

    with simulated_mesh(tp) as mesh:
        sharded = distribute_tensor(logits, mesh, [Shard(-1)]).requires_grad_()
        loss = vocab_parallel_cross_entropy(sharded, targets, num_items_in_batch=num_items)
        loss.backward()
        for value in per_rank(loss, tp):
            torch.testing.assert_close(value, expected.detach(), atol=TOLERANCE, rtol=0)
        for grad in per_rank(sharded.grad.full_tensor(), tp):
            torch.testing.assert_close(grad, reference.grad, atol=TOLERANCE, rtol=0)


def test_vocab_parallel_cross_entropy_with_uneven_vocab_shards():
    """10 ids over 4 ranks split 3/3/3/1 (torch.chunk): the owner of each target follows the chunk
    size. (Value only: the simulated ranks cannot run backward through unevenly sized shards.)"""
    generator = torch.Generator().manual_seed(2)
    logits, targets = torch.randn(2, 6, 10, generator=generator), torch.randint(0, 10, (2, 6), generator=generator)
    targets[1, 4] = IGNORE
    expected = F.cross_entropy(logits.flatten(0, 1), targets.flatten(), ignore_index=IGNORE)
    with simulated_mesh(4) as mesh:
        loss = vocab_parallel_cross_entropy(distribute_tensor(logits, mesh, [Shard(-1)]), targets)
        for value in per_rank(loss, 4):
            torch.testing.assert_close(value, expected, atol=TOLERANCE, rtol=0)


def test_vocab_parallel_loss_never_gathers_the_vocabulary():
    """Loss parallelism's memory property: three [batch, seq] all-reduces (max, sum, picked logit)
    and no all-gather, where ``F.cross_entropy`` on gathered logits would all-gather [b, s, vocab]."""
    logits, labels = torch.randn(2, 8, 16), _ids_and_labels(16)[1]
    loss_fn = VocabParallelCausalLMLoss(fallback=None)
    with simulated_mesh(2) as mesh:
        sharded = distribute_tensor(logits, mesh, [Shard(-1)])
        with CommDebugMode() as comm:
            loss_fn(sharded, labels, 16)
    counts = {str(op): n for op, n in comm.get_comm_counts().items()}
    assert counts == {"c10d.allreduce_": 3}, counts


@pytest.mark.parametrize("extra", ["none", "num_items_in_batch", "shift_labels"])
def test_installed_loss_matches_transformers_causal_lm_loss(extra):
    """The wrapper takes the keywords transformers passes: labels shifted by one, a summed loss
    over ``num_items_in_batch``, or ``shift_labels`` given ready-made (not shifted again)."""
    from transformers.loss.loss_utils import ForCausalLMLoss

    logits = 3 * torch.randn(2, 8, 16, generator=torch.Generator().manual_seed(4))
    labels = _ids_and_labels(16)[1]
    kwargs = {"none": {}, "num_items_in_batch": {"num_items_in_batch": torch.tensor(5)},
              "shift_labels": {"shift_labels": labels.roll(-2, dims=1)}}[extra]
    expected = ForCausalLMLoss(logits, labels, 16, **kwargs)
    with simulated_mesh(2) as mesh:
        loss = VocabParallelCausalLMLoss(fallback=ForCausalLMLoss)(
            distribute_tensor(logits, mesh, [Shard(-1)]), labels, 16, **kwargs)
        for value in per_rank(loss, 2):
            torch.testing.assert_close(value, expected, atol=TOLERANCE, rtol=0)


def test_sequence_sharded_logits_are_refused_with_the_fix():
    with simulated_mesh(2) as mesh:
        sharded = distribute_tensor(torch.randn(2, 8, 16), mesh, [Shard(1)])
        with pytest.raises(AutoTPError, match=r"expected Shard\(-1\)"):
            VocabParallelCausalLMLoss(fallback=None)(sharded, _ids_and_labels(16)[1], 16)


# ---------------------------------------------------------------- installed on a model


def _llama():
    return build_model("llama", tiny=True, tp=2, device="cpu").train()


def test_plain_logits_use_transformers_loss_unchanged():
    """On an unsharded model the installed loss is transformers' own, bit for bit."""
    model = _llama()
    ids, labels = _ids_and_labels(model.config.vocab_size)
    expected = model(input_ids=ids, labels=labels).loss
    assert install_vocab_parallel_loss(model)
    assert install_vocab_parallel_loss(model)  # twice: still one wrapper
    assert isinstance(model.loss_function, VocabParallelCausalLMLoss)
    assert not isinstance(model.loss_function.fallback, VocabParallelCausalLMLoss)
    assert torch.equal(model(input_ids=ids, labels=labels).loss, expected)


def test_a_custom_loss_function_is_left_alone():
    model = _llama()
    custom = lambda logits, labels, vocab_size, **kwargs: logits.sum() * 0
    model.loss_function = custom
    assert not install_vocab_parallel_loss(model)
    assert model.loss_function is custom
    assert not install_vocab_parallel_loss(torch.nn.Linear(2, 2))


def _labels_step(model, plan, *, tp: int = 2):
    """``labels=`` forward and backward of ``model`` unsharded, and sharded with ``plan`` over ``tp``
    simulated ranks by ``autotp.parallelize``. Returns (reference output, reference parameters,
    per-rank losses, per-rank full gradients, (logits placements, per-rank gathered logits),
    per-rank loss of torch's ``loss_parallel`` cross-entropy on the returned logits)."""
    ids, labels = _ids_and_labels(model.config.vocab_size)
    reference = copy.deepcopy(model)
    ref_out = reference(input_ids=ids, labels=labels)
    ref_out.loss.backward()
    with simulated_mesh(tp) as mesh:
        sharded = autotp.parallelize(copy.deepcopy(model), mesh, tp_shard_plan=plan)
        out = sharded(input_ids=ids, labels=labels)
        out.loss.backward()
        grads = {n: per_rank(_full(p.grad), tp) for n, p in sharded.named_parameters()}
        losses = per_rank(out.loss, tp)
        logits = out.logits
        logits_info = (isinstance(logits, DTensor) and logits.placements, per_rank(_full(logits).detach(), tp))
        with loss_parallel():  # torch's own loss parallelism reads the same logits
            shifted = F.pad(labels, (0, 1), value=IGNORE)[:, 1:]
            torch_loss = per_rank(F.cross_entropy(logits.flatten(0, 1), shifted.flatten()).full_tensor(), tp)
    return ref_out, dict(reference.named_parameters()), losses, grads, logits_info, torch_loss


def _assert_step_matches(ref_out, ref_params, losses, grads):
    for loss in losses:
        torch.testing.assert_close(loss, ref_out.loss.detach(), atol=TOLERANCE, rtol=0)
    assert grads.keys() == ref_params.keys()
    for name, per in grads.items():
        for grad in per:
            torch.testing.assert_close(grad, ref_params[name].grad, atol=TOLERANCE, rtol=0, msg=name)


@pytest.mark.parametrize("sp", [False, True], ids=["plain", "sp"])
def test_labels_loss_and_gradients_match_the_unsharded_model(sp):
    """``model(input_ids=..., labels=...)`` with ignored labels after ``autotp.parallelize``: the
    loss on every rank and every gradient equal the unsharded model's (handwritten plan). Before
    the loss was installed this raised ``got mixed torch.Tensor and DTensor``."""
    model = _llama()
    plan = handwritten_plans.plan_for(model, sequence_parallel=sp)
    ref_out, ref_params, losses, grads, (placements, logits), torch_loss = _labels_step(model, plan)
    _assert_step_matches(ref_out, ref_params, losses, grads)
    assert placements == (Shard(2),)  # the head's output stayed vocab-sharded
    for value, loss in zip(logits, torch_loss):  # the returned logits: gathered, and under loss_parallel
        torch.testing.assert_close(value, ref_out.logits.detach(), atol=TOLERANCE, rtol=0)
        torch.testing.assert_close(loss, ref_out.loss.detach(), atol=TOLERANCE, rtol=0)


def test_labels_loss_with_a_synthesized_plan_of_another_family():
    """The same on a Qwen3-shaped model (per-head q/k norms) with the plan the synthesizer derives."""
    model = build_model("qwen3", tiny=True, tp=2, device="cpu").train()
    plan = autotp.synthesize(model, sequence_parallel=True, verify=False)
    ref_out, ref_params, losses, grads, _, _ = _labels_step(model, plan)
    _assert_step_matches(ref_out, ref_params, losses, grads)


# ---------------------------------------------------------------- 4 gloo processes: a training step

MP_MODEL = "llama-1b"  # tied embedding and head: the tie must survive, and its gradient sums both uses
# AdamW's first step is about lr * g / (|g| + eps): eps=1e-3 keeps it a smooth function of the
# gradient, so the comparison tests the sharding rather than the sign of round-off (as test_training).
ADAMW = dict(lr=1e-2, eps=1e-3, weight_decay=0.1)
MP_CASES = [
    ((("dp_shard_cp", 2), ("tp", 2)), False),
    ((("dp_shard_cp", 2), ("tp", 2)), True),
    ((("tp", 4),), False),
    ((("tp", 4),), True),
]


def _mp_model():
    return build_model(MP_MODEL, tiny=True, tp=4, device="cpu").train()


def _mp_batch(vocab: int):
    # Every row ignores the same number of labels, so the mean over each dp half of the batch,
    # averaged over the halves (FSDP's gradient average), is the mean over the whole batch.
    ids, labels = _ids_and_labels(vocab, batch=4, seq=16, seed=3)
    labels[:, 5] = IGNORE
    return ids, labels


def _mp_reference() -> dict:
    model = _mp_model()
    ids, labels = _mp_batch(model.config.vocab_size)
    loss = model(input_ids=ids, labels=labels).loss
    loss.backward()
    grads = {n: p.grad.clone() for n, p in model.named_parameters()}
    torch.optim.AdamW(model.parameters(), **ADAMW).step()
    return dict(loss=loss.item(), grads=grads, params={n: p.detach().clone() for n, p in model.named_parameters()})


def _mp_step(mesh_dims, sp: bool, reference: dict) -> dict:
    names, shape = zip(*mesh_dims)
    mesh = init_device_mesh("cpu", shape, mesh_dim_names=names)
    model = _mp_model()
    plan = handwritten_plans.plan_for(model, sequence_parallel=sp)
    autotp.fsdp2_strategy_parallelize(model, mesh, sequence_parallel=sp, tp_shard_plan=plan)
    ids, labels = _mp_batch(model.config.vocab_size)
    dp = mesh["dp_shard_cp"] if "dp_shard_cp" in names else None
    if dp is not None:
        ids, labels = ids.chunk(dp.size())[dp.get_local_rank()], labels.chunk(dp.size())[dp.get_local_rank()]
    out = model(input_ids=ids, labels=labels)
    out.loss.backward()
    loss = out.loss.detach().clone()
    dist.all_reduce(loss)  # each dp half's loss, once per tp rank
    diff = lambda t, ref: (_full(t).detach() - ref).abs().max().item()
    grad_diff = max(diff(p.grad, reference["grads"][n]) for n, p in model.named_parameters())
    torch.optim.AdamW(model.parameters(), **ADAMW).step()
    return dict(
        loss=loss.item() / dist.get_world_size(),
        grad_diff=grad_diff,
        param_diff=max(diff(p, reference["params"][n]) for n, p in model.named_parameters()),
        logits_placements=str(out.logits.placements),
    )


def _mp_cases(reference):
    return [_mp_step(dims, sp, reference) for dims, sp in MP_CASES]


@pytest.mark.multiprocess
def test_labels_training_step_on_4_processes_matches_single_process():
    """One AdamW step driven by ``model(input_ids, labels=labels).loss`` after
    ``fsdp2_strategy_parallelize``, on dp=2 x tp=2 (FSDP2) and tp=4, plain and SP: loss, every
    gradient and every updated parameter equal single-process training. Catches a loss that
    gathers or mis-offsets the vocabulary, mis-shifts labels, counts ignored labels, or a
    gradient that is not the full loss's on each tp rank."""
    reference = _mp_reference()
    results = run_on_ranks(_mp_cases, 4, reference, what="labels= workers")[0]
    for (dims, sp), result in zip(MP_CASES, results):
        label = f"{dict(dims)}{' sp' if sp else ''}: {result}; single process: loss {reference['loss']}"
        assert result["logits_placements"] == "(Shard(dim=2),)", label
        assert result["loss"] == pytest.approx(reference["loss"], abs=TOLERANCE), label
        assert result["grad_diff"] <= TOLERANCE, label
        assert result["param_diff"] <= TOLERANCE, label
