"""Training helpers for models whose parameters and logits are DTensors (the NeMo-RL set).

- :func:`to_local_if_dtensor`: this rank's shard of a tensor, whatever its type.
- :func:`get_grad_norm` / :func:`clip_grad_by_total_norm_`: the global gradient norm of a model
  sharded over tensor- and data-parallel groups, each element counted once, and clipping by it.
- :func:`get_logprobs_from_vocab_parallel_logits`: next-token log-probabilities from logits that
  are sharded over the vocabulary, without ever gathering the vocabulary on one rank;
  :func:`vocab_parallel_token_logprobs` is the same without the shift, for any targets.
"""

from __future__ import annotations

import math
from collections.abc import Iterable

import torch
import torch.distributed as dist
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor

from autotp.errors import AutoTPError

TensorOrList = torch.Tensor | Iterable[torch.Tensor]


def to_local_if_dtensor(tensor: torch.Tensor) -> torch.Tensor:
    """This rank's local shard if ``tensor`` is a DTensor, else ``tensor`` itself.

    >>> to_local_if_dtensor(torch.ones(2)).tolist()
    [1.0, 1.0]
    """
    return tensor.to_local() if isinstance(tensor, DTensor) else tensor


def _as_list(parameters: TensorOrList) -> list[torch.Tensor]:
    return [parameters] if isinstance(parameters, torch.Tensor) else list(parameters)


def _group_ranks(group) -> frozenset[int]:
    return frozenset(dist.get_process_group_ranks(group)) if group is not None else frozenset()


def _reduced_copies(grad: DTensor, reduced: frozenset[int], world: int, cache: dict, index: int) -> tuple[DTensor, int]:
    """``grad`` with no Partial placement, and on how many of the ``world`` ranks of ``reduced``
    each of its elements lives.

    Only Shard placements over mesh dims inside ``reduced`` (the dp and tp groups) split the
    tensor into distinct pieces; every other rank of ``reduced`` holds a copy of one of them:
    a Replicate dim, or a group the tensor's mesh does not span at all (FSDP2 puts a parameter
    that TP left alone on the dp mesh only, yet every tp rank holds it). A dim outside
    ``reduced`` (HSDP's replicate dim when only the shard group is passed) is not summed over.
    """
    mesh = grad.device_mesh
    if any(p.is_partial() for p in grad.placements):
        # A partial gradient holds summands, not values: reduce it before squaring anything.
        grad = grad.redistribute(mesh, [Replicate() if p.is_partial() else p for p in grad.placements])
    pieces = 1
    for dim, placement in enumerate(grad.placements):
        # Not isinstance(Shard): FSDP2 sharding a dim that TP already split (the vocab-parallel
        # embedding) gives a _StridedShard, which is no Shard subclass but splits all the same.
        if placement.is_replicate() or mesh.size(dim) == 1:
            continue
        key = (id(mesh), dim)
        if key not in cache:
            cache[key] = _group_ranks(mesh.get_group(dim)) <= reduced
        if not cache[key]:
            name = (mesh.mesh_dim_names or [f"dim {dim}"] * mesh.ndim)[dim]
            raise AutoTPError(
                f"get_grad_norm: parameter {index} is sharded over mesh dim {name!r} (size {mesh.size(dim)}), "
                "but neither dp_cp_group nor tp_group covers it, so its other shards would be missed; "
                f"pass that dim's group (device_mesh[{name!r}].get_group())."
            )
        pieces *= mesh.size(dim)
    return grad, world // pieces


@torch.no_grad()
def get_grad_norm(
    parameters: TensorOrList,
    dp_cp_group,
    tp_group,
    norm_type: float = 2,
    dtype: torch.dtype = torch.float32,
) -> float:
    """The ``norm_type``-norm of all gradients of a model sharded over ``dp_cp_group`` x ``tp_group``.

    Every gradient element is counted exactly once, as in the unsharded model: a gradient's
    pieces are its Shard placements over mesh dims inside the two groups, and every other rank of
    the groups is taken to hold a copy (a Replicate dim, a tp group that an FSDP-only parameter's
    mesh does not span, or a plain tensor on every rank), which is divided out. Partial
    gradients are reduced first.

    Args:
        parameters: parameters (or one parameter) whose ``.grad`` to measure; those without a
            gradient are skipped.
        dp_cp_group: the data-parallel (and context-parallel) group, or ``None`` for none.
        tp_group: the tensor-parallel group, or ``None`` for none.
        norm_type: ``p`` > 0, ``0`` (count of non-zeros), or ``math.inf`` (largest magnitude).
        dtype: precision of the accumulation.

    Returns:
        The norm, identical on every rank of the groups.

    Raises:
        AutoTPError: ``norm_type`` is negative, or a gradient is sharded over a mesh dim that
            neither group covers.
    """
    norm_type = float(norm_type)
    if norm_type < 0:
        raise AutoTPError(f"get_grad_norm: norm_type must be >= 0 or inf, got {norm_type}.")
    groups = [g for g in (dp_cp_group, tp_group) if g is not None]
    reduced = frozenset().union(*map(_group_ranks, groups))
    world = math.prod(dist.get_world_size(g) for g in groups)
    cache: dict = {}
    total = torch.zeros((), dtype=dtype)
    for index, param in enumerate(_as_list(parameters)):
        grad = param.grad
        if grad is None:
            continue
        copies = world
        if isinstance(grad, DTensor):
            grad, copies = _reduced_copies(grad, reduced, world, cache, index)
        local = to_local_if_dtensor(grad).detach().to(dtype)
        total = total.to(local.device)
        if norm_type == math.inf:
            total = torch.maximum(total, local.abs().max() if local.numel() else total)
        elif norm_type == 0:
            total = total + (local != 0).sum().to(dtype) / copies
        else:
            total = total + torch.linalg.vector_norm(local, norm_type) ** norm_type / copies
    op = dist.ReduceOp.MAX if norm_type == math.inf else dist.ReduceOp.SUM
    for group in groups:
        dist.all_reduce(total, op=op, group=group)
    if norm_type not in (0.0, math.inf):
        total = total ** (1.0 / norm_type)
    return total.item()


@torch.no_grad()
def clip_grad_by_total_norm_(
    parameters: TensorOrList,
    max_grad_norm: float,
    total_norm: float,
    dtype: torch.dtype = torch.float32,
) -> None:
    """Scale gradients in place by ``max_grad_norm / total_norm`` when that is below 1.

    ``total_norm`` is the global norm from :func:`get_grad_norm`, so every rank scales by the same
    factor and the sharded model clips exactly as the unsharded one would. Gradients keep their
    own dtype; the factor is formed in ``dtype``.
    """
    coefficient = torch.tensor(max_grad_norm, dtype=dtype) / (total_norm + 1.0e-6)
    if coefficient >= 1.0:
        return
    for param in _as_list(parameters):
        if param.grad is not None:
            to_local_if_dtensor(param.grad.detach()).mul_(coefficient.to(param.grad.dtype))


class _VocabParallelLogprob(torch.autograd.Function):
    """log_softmax(logits)[target] over a vocabulary split across ``group``, one local shard each.

    Forward: the max and the sum of exponentials are all-reduced (MAX, then SUM) so every rank
    has the global log-partition; the target logit is picked by the rank that owns its id and
    zero elsewhere, and summed. Backward needs no communication: d logp / d z_v is
    ``1[v == target] - softmax_v``, and each rank owns its slice of v.
    """

    @staticmethod
    def forward(ctx, local_logits, target, vocab_start, group):
        logits = local_logits.float()
        if logits.shape[-1]:
            local_max = logits.amax(dim=-1, keepdim=True)
        else:  # an empty shard must not win the MAX
            local_max = torch.full_like(logits[..., :1], -math.inf)
        if group is not None:
            dist.all_reduce(local_max, op=dist.ReduceOp.MAX, group=group)
        shifted = logits - local_max
        sum_exp = shifted.exp().sum(dim=-1, keepdim=True)
        if group is not None:
            dist.all_reduce(sum_exp, op=dist.ReduceOp.SUM, group=group)
        log_z = sum_exp.log()

        owned = (target >= vocab_start) & (target < vocab_start + logits.shape[-1])
        index = (target - vocab_start).masked_fill(~owned, 0)
        if logits.shape[-1]:
            picked = shifted.gather(-1, index.unsqueeze(-1)).squeeze(-1).masked_fill(~owned, 0.0)
        else:  # a rank with an empty shard (vocab smaller than tp) owns no id
            picked = torch.zeros_like(target, dtype=logits.dtype)
        if group is not None:
            dist.all_reduce(picked, op=dist.ReduceOp.SUM, group=group)

        if ctx.needs_input_grad[0]:
            ctx.save_for_backward((shifted - log_z).exp(), index, owned)
            ctx.logits_dtype = local_logits.dtype
        return picked - log_z.squeeze(-1)

    @staticmethod
    def backward(ctx, grad_output):
        softmax, index, owned = ctx.saved_tensors
        grad = softmax.mul_(-grad_output.unsqueeze(-1))
        if grad.shape[-1]:
            grad.scatter_add_(-1, index.unsqueeze(-1), (grad_output * owned).unsqueeze(-1))
        return grad.to(ctx.logits_dtype), None, None, None


def _vocab_shard(logits: DTensor) -> tuple[torch.Tensor, object, object]:
    """``(local logits, first vocab id this rank owns, tp group)`` for logits on ``Shard(-1)``."""
    last = logits.ndim - 1
    vocab_dims = [d for d, p in enumerate(logits.placements) if isinstance(p, Shard) and p.dim in (-1, last)]
    others = [p for d, p in enumerate(logits.placements) if d not in vocab_dims and not isinstance(p, Replicate)]
    if len(vocab_dims) != 1 or others:
        raise AutoTPError(
            f"vocab-parallel log-probs (loss): logits have placements {logits.placements}; "
            "expected Shard(-1) on one mesh dim (the lm head's ColwiseParallel output with "
            "output_layouts=Shard(-1), use_local_output=False) and Replicate on the others."
        )
    mesh, dim = logits.device_mesh, vocab_dims[0]
    # DTensor splits like torch.chunk: ceil(V / n) ids per rank, the last ranks possibly short.
    # The first id is found by sharding the table of first ids the same way (locally, no
    # communication), which keeps it a tensor: a rank index is not one under every backend.
    per_rank = -(-logits.shape[-1] // mesh.size(dim))
    placements = [Shard(0) if d == dim else Replicate() for d in range(mesh.ndim)]
    starts = torch.arange(mesh.size(dim), device=logits.device) * per_rank
    start = distribute_tensor(starts, mesh, placements, src_data_rank=None).to_local()
    return logits.to_local(), start, mesh.get_group(dim)


def vocab_parallel_token_logprobs(logits: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """``log_softmax(logits)[..., targets]`` at every position, the vocabulary possibly sharded.

    No shift: ``out[i] = log_softmax(logits[i])[targets[i]]``. A target outside the vocabulary
    (``-100``, the usual ignore index) is owned by no rank and scores ``-log Z``; mask it
    yourself (its gradient is zero when its weight is zero). Computed in float32; with a
    ``Shard(-1)`` DTensor each rank keeps only its own vocabulary slice and only
    ``logits.shape[:-1]``-sized max, sum and picked-logit tensors are all-reduced.

    Args:
        logits: ``[..., vocab]``: a DTensor placed ``Shard(-1)`` on one mesh dim (``Replicate``
            on the others), or a plain tensor taken as the whole vocabulary.
        targets: ``logits.shape[:-1]`` integer ids, the same on every rank of the vocab group.

    Returns:
        A float32 plain tensor of ``targets``' shape, the same on every rank, differentiable with
        respect to the logits.

    Raises:
        AutoTPError: the logits are a DTensor not sharded over the vocabulary, or the shapes disagree.
    """
    if tuple(logits.shape[:-1]) != tuple(targets.shape):
        raise AutoTPError(
            f"vocab_parallel_token_logprobs: logits {tuple(logits.shape)} do not match targets "
            f"{tuple(targets.shape)}; expected logits [..., vocab] and targets of the leading shape."
        )
    if isinstance(logits, DTensor):
        local, vocab_start, group = _vocab_shard(logits)
    else:
        local, vocab_start, group = logits, 0, None
    return _VocabParallelLogprob.apply(local, to_local_if_dtensor(targets), vocab_start, group)


def get_logprobs_from_vocab_parallel_logits(vocab_parallel_logits: DTensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Log-probability of each next token, from logits sharded over the vocabulary.

    Shift convention (as NeMo-RL's): ``logits[:, t]`` scores ``input_ids[:, t + 1]``, so pass the
    unshifted ids and get ``[batch, seq - 1]`` back: ``out[:, t] = log_softmax(logits[:, t])
    [input_ids[:, t + 1]]``. Numerically this is ``log_softmax`` + ``gather`` on the full logits,
    computed in float32, but no rank ever holds more than its own vocabulary shard: only
    ``[batch, seq]``-sized max, sum and picked-logit tensors are all-reduced over the tp group
    (see :func:`vocab_parallel_token_logprobs`).

    Args:
        vocab_parallel_logits: ``[batch, seq, vocab]`` DTensor placed ``Shard(-1)`` (a plain
            tensor is taken as the whole vocabulary).
        input_ids: ``[batch, seq]`` token ids, replicated across the tp group.

    Returns:
        A float32 ``[batch, seq - 1]`` tensor, the same on every tp rank, differentiable with
        respect to the logits.

    Raises:
        AutoTPError: the logits are not vocabulary-sharded, or the shapes disagree.
    """
    if tuple(vocab_parallel_logits.shape[:-1]) != tuple(input_ids.shape):
        raise AutoTPError(
            f"get_logprobs_from_vocab_parallel_logits: logits {tuple(vocab_parallel_logits.shape)} do not match "
            f"input_ids {tuple(input_ids.shape)}; expected logits [batch, seq, vocab] and ids [batch, seq]."
        )
    # Slicing the sequence dim of a Shard(-1) DTensor is local: no rank gathers anything.
    return vocab_parallel_token_logprobs(vocab_parallel_logits[:, :-1], to_local_if_dtensor(input_ids)[:, 1:])
