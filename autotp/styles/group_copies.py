"""The runtime side of group copies (:class:`~autotp.styles.GroupCopies`): which rows a grouped part
expands to, the expansion of a module in place, and the collectives that give each rank its group.

The synthesizer (:mod:`autotp.synth.groups`) finds the parts and proves the expanded model; the
styles, the checker and the synthesizer all expand with the same functions, kept here below them.
"""

from __future__ import annotations

import copy
from dataclasses import dataclass, field

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard

from autotp._simulate import mesh_coordinate


@dataclass
class Copies:
    """What to expand in one module: rows of its parameters and buffers, and attribute values.

    ``rows``: dotted path -> ``(dim, width, ((start, end, groups), ...))``, the grouped parts along
    ``dim`` (of size ``width``) of that parameter or buffer (:func:`copy_index`); a parameter's is dim 0. ``values``: attribute path -> its value in
    the expanded model.
    """

    rows: dict[str, tuple[int, int, tuple[tuple[int, int, int], ...]]] = field(default_factory=dict)
    values: dict[str, int] = field(default_factory=dict)


def copy_index(width: int, parts, tp: int) -> torch.Tensor:
    """Rows of the expanded tensor, as rows of the original: each grouped part ``(start, end, G)``
    becomes ``tp`` groups, group j a copy of original group ``j * G // tp``. A part ``(start, end,
    G, pieces)`` (:class:`~autotp.synth.groups.GroupedPart`) gives group j, of the ``tp / G`` sharing that group the
    ``j % (tp / G)``-th, its share of each divided piece and the other pieces whole.

    >>> copy_index(5, ((2, 4, 1),), 2).tolist()
    [0, 1, 2, 3, 2, 3, 4]
    >>> copy_index(4, ((0, 4, 2),), 4).tolist()
    [0, 1, 0, 1, 2, 3, 2, 3]
    >>> copy_index(5, ((0, 5, 1, ((3, 0), (2, 1))),), 2).tolist()  # [k | q], q in shares of 1 row
    [0, 1, 2, 3, 0, 1, 2, 4]
    """
    order, at = [], 0
    for start, end, groups, *pieces in sorted(parts):
        order.extend(range(at, start))
        size = (end - start) // groups
        share = tp // groups
        for j in range(tp):
            first = start + (j * groups // tp) * size
            for piece, divided in (pieces[0] if pieces else ((size, 0),)):
                begin, rows = (first + j % share * piece // share, piece // share) if divided else (first, piece)
                order.extend(range(begin, begin + rows))
                first += piece
        at = end
    order.extend(range(at, width))
    return torch.tensor(order, dtype=torch.long)


def expanded_width(part, tp: int) -> int:
    """The width a grouped part (as :func:`copy_index` takes it) has once expanded at ``tp``.

    >>> expanded_width((2, 4, 1), 4), expanded_width((0, 5, 1, ((3, 0), (2, 1))), 2)
    (8, 8)
    """
    start, end, groups, *pieces = part
    share = tp // groups
    size = (end - start) // groups
    return tp * sum(piece // share if divided else piece for piece, divided in (pieces[0] if pieces else ((size, 0),)))


def expand_module(module: nn.Module, copies: Copies, tp: int) -> None:
    """Expand ``module``'s grouped rows to ``tp`` copies and set its attributes to their expanded
    values, in place (see :class:`Copies`)."""
    for path, value in copies.values.items():
        *owner_path, attr = path.split(".")
        owner = module
        for part in owner_path:
            child = getattr(owner, part)
            if not isinstance(child, nn.Module):  # a plain object (a config) may be shared: copy it
                child = copy.copy(child)
                setattr(owner, part, child)
            owner = child
        setattr(owner, attr, value)
    for path, (dim, width, parts) in copies.rows.items():
        owner_path, _, leaf = path.rpartition(".")
        owner = module.get_submodule(owner_path)
        index = copy_index(width, parts, tp)
        if leaf in owner._parameters:
            param = owner._parameters[leaf]
            if param is None:  # a Linear without a bias
                continue
            owner.register_parameter(leaf, nn.Parameter(param.detach().index_select(dim, index),
                                                        requires_grad=param.requires_grad))
        else:
            owner._buffers[leaf] = owner._buffers[leaf].index_select(dim, index)


def _groups_whole(local: torch.Tensor, sizes: tuple[int, ...], grouped: dict[int, int], dim: int,
                  mesh: DeviceMesh) -> torch.Tensor:
    """Rank r's tensor of the copies' layout from its packed shards along ``dim`` (``1/tp`` of each
    part of ``sizes``): the grouped parts gathered in one collective, group ``r * G // tp`` of each
    cut from it, the other parts left as they are."""
    tp = mesh.size()
    chunks = list(local.split([size // tp for size in sizes], dim=dim))
    order = sorted(grouped)
    for index, part in zip(order, _gather_blocks([chunks[index] for index in order], dim, mesh)):
        chunks[index] = _own_group(part, grouped[index], dim, mesh)
    return torch.cat(chunks, dim=dim)


def _cut_groups(module, args, output: torch.Tensor, *, sizes, grouped, mesh: DeviceMesh) -> torch.Tensor:
    """Rank r's output of the copies' layout from its shards: each grouped part's group ``r * G // tp``
    whole. It gathers whichever is smaller: the parts' outputs (``tokens x W`` features) or their
    weight rows (``W x in_features``), recomputing the parts from the gathered rows. Either way the
    forward all-gathers and the backward reduce-scatters as many bytes."""
    tp = mesh.size()
    x = args[0] if args else None  # a Linear called with keywords only: its outputs are gathered
    tokens = output.numel() // output.shape[-1]
    if x is None or tokens <= module.weight.shape[-1]:
        return _groups_whole(output, sizes, grouped, output.ndim - 1, mesh)
    chunks = list(output.split([size // tp for size in sizes], dim=-1))
    order = sorted(grouped)
    # Rows of each part in this rank's (packed) weight block, then the grouped parts' rows gathered.
    starts = [sum(sizes[:index]) // tp for index in range(len(sizes))]
    local_x = x.to_local(grad_placements=[Partial()]) if isinstance(x, DTensor) else x
    weights = {}
    for name in ("weight", "bias"):
        param = getattr(module, name, None)
        if param is None:
            continue
        local = param.to_local() if isinstance(param, DTensor) else param
        rows = [local.narrow(0, starts[index], sizes[index] // tp) for index in order]
        weights[name] = [_own_group(whole, grouped[index], 0, mesh)
                         for index, whole in zip(order, _gather_blocks(rows, 0, mesh))]
    for k, index in enumerate(order):
        bias = weights["bias"][k] if "bias" in weights else None
        chunks[index] = torch.nn.functional.linear(local_x, weights["weight"][k], bias)
    return torch.cat(chunks, dim=-1)


def _gather_blocks(blocks: list[torch.Tensor], dim: int, mesh: DeviceMesh) -> list[torch.Tensor]:
    """Each rank's ``blocks`` (its shards of parts along ``dim``) all-gathered in one collective, as
    the whole parts; the gradient taken as a partial sum, so the backward reduce-scatters it."""
    tp = mesh.size()
    local = torch.cat(blocks, dim=dim)
    gathered = DTensor.from_local(local, mesh, [Shard(dim)], run_check=False).redistribute(
        placements=[Replicate()]).to_local(grad_placements=[Partial()])
    by_rank = gathered.unflatten(dim, (tp, -1))
    return [part.flatten(dim, dim + 1) for part in by_rank.split([b.shape[dim] for b in blocks], dim=dim + 1)]


def _own_group(whole: torch.Tensor, groups: int, dim: int, mesh: DeviceMesh) -> torch.Tensor:
    """Group ``r * groups // tp`` of ``whole``'s ``groups`` equal groups along ``dim``, on rank r."""
    mine = (mesh_coordinate(mesh) * groups // mesh.size()).reshape(1).to(whole.device)
    return whole.unflatten(dim, (groups, -1)).index_select(dim, mine).flatten(dim, dim + 1)
