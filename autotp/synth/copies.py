"""Parts of a packed column held whole on every rank, the other parts sharded.

A fused ``[q | k | v]`` projection of multi-query attention has one k head and one v head, read
by every query head through a broadcast (``k.expand(b, heads, t, d)``, the grouped-query repeat,
or a matmul that broadcasts over the heads). No tp splits one head; each rank holds the whole k
and v parts next to its share of the query heads (:func:`~autotp.synth.fixpoint.copied_parts`
finds them from the graph). That is :class:`~autotp.styles.GroupCopies` with one group: the
parts' rows are expanded to tp copies and the result packed-column sharded, so rank r holds
``[q_r | k | v]``. Forward needs nothing more; backward, each rank's output gradient of a copied
part is its heads' share (the analysis asks that the part meet the shard only as a broadcast,
:func:`~autotp.synth.fixpoint.copy_leaks`): the column's all-reduced input gradient adds those
shares up, and the copies' weight and bias gradients are summed, so every gradient is the
unsharded model's. By default the plan gathers instead (``GroupCopies(gather=True)``, see
:func:`autotp.synth.build.build_plan`): the copied parts' rows are sharded like the others, and each
forward all-gathers the parts (or their rows) for rank r to cut its copy, the backward
reduce-scattering their gradient; rank r's output is the same ``[q_r | k | v]``.
"""

from __future__ import annotations

from dataclasses import replace

import networkx as nx

from autotp.synth.flow import Flow

from autotp.synth.queries import module_of
from autotp.synth.roles import Role, kind_of


def expanded_sizes(sizes: tuple[int, ...], copied, tp: int) -> tuple[int, ...]:
    """Part widths with each part held whole expanded to ``tp`` copies.

    >>> expanded_sizes((64, 8, 8), ((64, 72), (72, 80)), 4)
    (64, 32, 32)
    """
    spans = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
    return tuple(size * tp if span in set(copied) else size for size, span in zip(sizes, spans))


def global_sizes(role: Role) -> tuple[int, ...]:
    """The part widths of ``role``'s output on the unsharded model (``role.sizes`` expands the
    parts held whole, each of which starts where a span of ``role.copied`` does).

    >>> global_sizes(Role("packed_column", "", sizes=(64, 32, 32), copied=((64, 72), (72, 80))))
    (64, 8, 8)
    """
    starts = dict(role.copied)
    out, at = [], 0
    for size in role.sizes:
        width = starts[at] - at if at in starts else size
        out.append(width)
        at += width
    return tuple(out)


def local_point(role: Role, point: int, tp: int) -> int:
    """Where feature ``point`` of the unsharded output lies in one rank's output: a sharded part
    holds ``1/tp`` of its features, a part held whole all of them.

    >>> role = Role("packed_column", "", sizes=(64, 32, 32), copied=((64, 72), (72, 80)))
    >>> [local_point(role, p, 4) for p in (0, 64, 72, 80)]
    [0, 16, 24, 32]
    """
    local, at = 0, 0
    for width in global_sizes(role):
        held = (at, at + width) in set(role.copied)
        if point < at + width:
            return local + ((point - at) if held else (point - at) // tp)
        local += width if held else width // tp
        at += width
    return local


def row_copies(role: Role) -> tuple[int, tuple[tuple[int, int, int], ...]]:
    """``(width, ((start, end, 1), ...))``: the rows of the weight (and bias) held whole, as
    :class:`~autotp.styles.GroupCopies` takes them (one group each).

    >>> row_copies(Role("packed_column", "", sizes=(64, 32, 32), copied=((64, 72), (72, 80))))
    (80, ((64, 72, 1), (72, 80, 1)))
    """
    return sum(global_sizes(role)), tuple((start, end, 1) for start, end in sorted(role.copied))


def copied_roles(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], tp: int) -> dict[str, Role]:
    """The packed-column roles of the candidates with parts held whole (``flow.copied``): their
    ``sizes`` expanded, the parts in ``copied``. A candidate whose module got another role (a
    Linear read outside it) stays as it is: the analysis then never shards it."""
    out = {}
    for root, spans in flow.copied.items():
        module = module_of(g, root)
        if root not in flow.roots or kind_of(roles, module) != "packed_column":
            continue
        role = roles[module]
        out[module] = replace(role, sizes=expanded_sizes(role.sizes, tuple(spans), tp), copied=tuple(sorted(spans)),
                              reason=f"{role.reason}; parts {', '.join(f'{s}:{e}' for s, e in sorted(spans))} held "
                                     "whole on every rank (one head read by every query head), their gradients summed")
    return out
