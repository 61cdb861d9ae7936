"""Fused q / k / v outputs laid out groups first: each rank a share of one group, its k / v copied.

Code written after litgpt's ``CausalSelfAttention`` (before 0.5) views a fused output as
``(b, t, G, q_per_kv + 2, hd)``: each of the ``G`` kv groups holds its query heads, then its one
k and one v head, and ``split((q_per_kv, 1, 1))`` of that dim cuts them apart; k and v are
``expand``-ed to the query heads. With ``G >= tp`` each rank holds whole groups (the plain
reading). With fewer groups (``tp`` a multiple of ``G``; one group is multi-query attention),
rank r holds group ``r * G // tp``'s k and v whole, a copy shared by ``tp / G`` ranks, and its
share of that group's query heads. That is the plain reading of an equivalent model with ``tp``
groups, each ``[its share of q | k | v]`` of an original group (:func:`~autotp.styles.group_copies.copy_index`
with ``pieces``), which :mod:`autotp.synth.groups` builds, proves equal on the module's real
inputs and analyses; until then the projection is kept whole (:func:`fewer_groups_than_tp`).

Found from the graph: a view of a candidate's whole output into ``(G, P, ...)``, a cut of ``P``
into pieces (through copies, transposes and permutes), each piece either divided among the
``tp / G`` ranks sharing its group (its ``P`` size a multiple of that) or one index broadcast to
the others by an ``expand`` (held whole).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field

import networkx as nx

from autotp.synth.flow import Flow

from autotp.synth.shard import Shard
from autotp.synth.graph import Ref
from autotp.synth.ops import PASSTHROUGH, SINKS, VIEW_LIKE

# Ops that cut a dim into pieces, returning them as a tuple: -> the position of the sizes argument.
_PIECE_CUTS = {"split_with_sizes": 1, "split": 1}
# Ops that broadcast a size-1 dim to the heads it serves (k / v of one group to its query heads).
_BROADCASTS = frozenset({"expand", "repeat_interleave"})

# GroupedPart is defined here, below autotp.synth.groups (which finds the plain parts and imports
# it from here, with the groups-first ones).


@dataclass(frozen=True)
class GroupedPart:
    """Features ``[start, end)`` of Linear node ``root``'s output, split into ``groups`` groups.

    ``pieces``: ``((width, divided), ...)`` tiling one group, when the ``tp / groups`` ranks sharing
    a group each hold a share of its ``divided`` pieces (its query heads) and the others whole (its
    k and v, :mod:`autotp.synth.groups_first`); empty: the whole group is held by each of them.
    ``cuts``: nodes that view and cut the output, where the flow records none.
    """

    root: str
    start: int
    end: int
    groups: int
    pieces: tuple[tuple[int, int], ...] = ()
    cuts: tuple[str, ...] = field(default=(), compare=False)

    def spec(self) -> tuple:
        """The part as :func:`~autotp.styles.group_copies.copy_index` takes it."""
        return (self.start, self.end, self.groups, *((self.pieces,) if self.pieces else ()))


def groups_first_view(in_shape: tuple, out_shape: tuple) -> tuple[int, int, int] | None:
    """``(groups, parts, inner)`` when a view splits the last dim of ``in_shape`` alone into
    ``(groups, parts, *dims)`` (``inner``: the features of one part), the dims before it kept.

    >>> groups_first_view((2, 11, 96), (2, 11, 2, 6, 8))
    (2, 6, 8)
    >>> groups_first_view((2, 11, 96), (2, 11, 12, 8)) is None
    True
    """
    dim = len(in_shape) - 1
    if len(out_shape) < len(in_shape) + 2 or tuple(out_shape[:dim]) != tuple(in_shape[:dim]):
        return None
    groups, parts, inner = out_shape[dim], out_shape[dim + 1], math.prod(out_shape[dim + 2:])
    return (groups, parts, inner) if parts > 1 and groups * parts * inner == in_shape[dim] else None


def _moved(g: nx.DiGraph, node: str, reader: str, dim: int) -> int | None:
    """Where ``node``'s ``dim`` lies in ``reader``'s output, for a copy, transpose or permute of it."""
    data, ndim = g.nodes[reader], len(g.nodes[node]["shape"] or ())
    args = data["args"]
    if not args or not isinstance(args[0], Ref) or args[0].name != node or not ndim:
        return None
    if data["op"] in PASSTHROUGH:
        return dim
    if data["op"] == "permute":
        return [x % ndim for x in args[1]].index(dim)
    if data["op"] == "transpose" and len(args) > 2:
        a, b = (x % ndim for x in args[1:3])
        return b if dim == a else a if dim == b else dim
    return None


def _readers(g: nx.DiGraph, node: str) -> list[str]:
    return [s for s in g.successors(node) if g.nodes[s]["op"] not in SINKS]


def _cut(g: nx.DiGraph, node: str, dim: int) -> tuple[str, int] | None:
    """``(cut node, dim there)``: the one op cutting ``node``'s ``dim`` into pieces, reached through
    a chain of copies, transposes and permutes that nothing else reads."""
    while True:
        readers = _readers(g, node)
        if len(readers) != 1:
            return None
        reader, data = readers[0], g.nodes[readers[0]]
        if data["op"] in _PIECE_CUTS:
            at = data["args"][2] if len(data["args"]) > 2 else data["kwargs"].get("dim", 0)
            ndim = len(g.nodes[node]["shape"])
            return (reader, dim) if isinstance(at, int) and at % ndim == dim else None
        dim = _moved(g, node, reader, dim)
        if dim is None:
            return None
        node = reader


def _piece_sizes(g: nx.DiGraph, cut: str, size: int) -> tuple[int, ...] | None:
    sizes = g.nodes[cut]["args"][_PIECE_CUTS[g.nodes[cut]["op"]]]
    if isinstance(sizes, int):
        sizes = [sizes] * (size // sizes) + ([size % sizes] if size % sizes else [])
    sizes = tuple(sizes) if all(isinstance(s, int) for s in sizes) else None
    return sizes if sizes and sum(sizes) == size else None


def _broadcast(g: nx.DiGraph, node: str, dim: int) -> bool:
    """Whether every reader of ``node`` (through copies, transposes and permutes) broadcasts its
    size-1 ``dim`` to several indices (``k.expand(b, G, q_per_kv, t, hd)``) and nothing else."""
    readers = _readers(g, node)
    for reader in readers:
        data = g.nodes[reader]
        if data["op"] in _BROADCASTS:
            if (data["shape"] or (0,) * (dim + 1))[dim] <= 1:
                return False
            continue
        moved = _moved(g, node, reader, dim)
        if moved is None or not _broadcast(g, reader, moved):
            return False
    return bool(readers)


def _element(g: nx.DiGraph, cut: str, index: int) -> str | None:
    found = [s for s in _readers(g, cut) if g.nodes[s]["op"] == "getitem" and g.nodes[s]["args"][1:2] == (index,)]
    return found[0] if len(found) == 1 else None


def groups_first_parts(g: nx.DiGraph, tp: int, flow: Flow) -> list[GroupedPart]:
    """Candidates of ``flow`` whose whole output is viewed groups first with fewer groups than
    ``tp`` (a divisor of it), as grouped parts with ``pieces``: each piece of a group divided
    among the ``tp / G`` ranks sharing the group, or broadcast to them (held whole)."""
    found = []
    for name, data in g.nodes(data=True):
        if data["kind"] != "call" or data["op"] not in VIEW_LIKE or not isinstance(data["args"][0], Ref):
            continue
        source = data["args"][0].name
        state = flow.state.get(source)
        if not isinstance(state, Shard) or len(state.origins) != 1 or state.pieces or state.fold:
            continue
        (root,), in_shape = state.origins, g.nodes[source]["shape"]
        layout = groups_first_view(in_shape, data["shape"] or ()) if in_shape else None
        if layout is None or state.span != (0, in_shape[-1]) or state.dim != len(in_shape) - 1:
            continue
        groups, parts, inner = layout
        share = tp // groups
        cut = _cut(g, name, len(in_shape)) if groups < tp and not tp % groups else None
        sizes = _piece_sizes(g, cut[0], parts) if cut else None
        if sizes is None:
            continue
        pieces = []
        for index, size in enumerate(sizes):
            element = _element(g, cut[0], index)
            if size % share == 0:
                pieces.append((size * inner, 1))
            elif size == 1 and element is not None and _broadcast(g, element, cut[1]):
                pieces.append((inner, 0))
            else:
                break
        else:
            if any(split for _, split in pieces) and not all(split for _, split in pieces):
                found.append(GroupedPart(root, 0, in_shape[-1], groups, tuple(pieces), (name, cut[0])))
    return sorted(found, key=lambda p: g.nodes[p.root]["order"])


def fewer_groups_than_tp(flow: Flow, tp: int | None) -> dict[str, str]:
    """Candidates sharded whole whose output is viewed groups first with fewer groups than
    ``tp``: kept whole, with that reason, rather than the plan refused (a rank would hold part of
    a group). :func:`~autotp.synth.groups.group_copies` then tries each rank a share of one group."""
    if not tp:
        return {}
    return {p.root: f"its output is viewed groups first as {p.groups} groups of parts {p.pieces}, fewer than "
                    f"tp={tp}; kept whole" for p in groups_first_parts(flow.g, tp, flow) if p.root in flow.roots}
