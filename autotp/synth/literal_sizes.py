"""Sizes written in the code: a module that cuts or shapes its shard with constants.

Code written outside a framework often sizes its reshapes with module-level constants or literals
(``qkv.split(D, -1)``, ``view(b, t, 3, H, D // H)``, ``reshape(b, t, 512)``) rather than with
attributes. At per-rank widths such code cuts the fused output at global points or fails on a
view, and no attribute divided by tp (:class:`~autotp.styles.ShardCounts` ``names``) can change a
constant. This idiom is the last resort of the shape proof (:func:`~autotp.synth.stages.shape_fix`):
from the module's global trace and the per-rank shape each node must have
(:func:`~autotp.synth.local_run.per_rank_shapes`), it writes one rule per call that takes a size on
the shard:

- a view (``view`` / ``reshape`` / ``unflatten``) whose per-rank output differs from the global one
  in one dim, and whose code wrote that dim's size (not ``-1``): that size divided by tp;
- a split or slice along the sharded dim: its global cut points at their per-rank places.

The rules become :class:`~autotp.styles.ShardCounts` ``literals``; the proof then runs the module
at per-rank widths with them, as the plan will, and keeps them only if every cut and shape comes
out per rank. A module whose shard meets a constant some other way keeps its Linears whole.
"""

from __future__ import annotations

import sys

from autotp.styles import ShardCounts
from autotp.synth.graph import Ref
from autotp.synth.local_run import per_rank_shapes
from autotp.synth.ops import FIXED_SIZE_CUTS, VIEW_LIKE
from autotp.synth.stages import ShapeProblem, shape_fix

# Views whose shape argument lists the output sizes (``unflatten``'s lists the sizes of one dim).
_SIZED_VIEWS = frozenset({"view", "reshape", "_unsafe_view"})


@shape_fix(order=10)
def literal_sizes(problem: ShapeProblem) -> ShardCounts | None:
    """:class:`~autotp.styles.ShardCounts` with a rule for each size the module's code writes on its
    shard, or None when there is none (or the trace cannot be read)."""
    g = problem.traced()
    if g is None:
        return None
    flow, expected = per_rank_shapes(g, problem.roles, problem.tp)
    if flow is None:
        return None
    rules: list[tuple] = []
    for name in sorted(g.nodes, key=lambda n: g.nodes[n]["order"]):
        data = g.nodes[name]
        if data["op"] not in VIEW_LIKE | FIXED_SIZE_CUTS or not data["args"] or not isinstance(data["args"][0], Ref):
            continue
        source = data["args"][0].name
        in_dim = _sharded_dim(g.nodes[source]["shape"], expected.get(source))
        if in_dim is None:
            continue
        whole = tuple(g.nodes[source]["shape"])
        if data["op"] in VIEW_LIKE:
            rules += _view_rule(data, whole, in_dim, expected.get(name))
        else:
            rules += _cut_rules(data, whole, in_dim)
    return ShardCounts(literals=tuple(dict.fromkeys(rules))) if rules else None


def _sharded_dim(shape, local) -> int | None:
    """The one dim in which a per-rank shape differs from the global one (None: none, or several)."""
    if shape is None or local is None or len(shape) != len(local):
        return None
    differ = [dim for dim, (size, at_rank) in enumerate(zip(shape, local)) if size != at_rank]
    return differ[0] if len(differ) == 1 else None


def _view_rule(data: dict, whole: tuple, in_dim: int, local) -> list[tuple]:
    """The rule for a view whose code wrote the size of the dim that is per rank on the output."""
    shape = tuple(data["shape"] or ())
    at = _sharded_dim(shape, local)
    if at is None:
        return []
    if data["op"] in _SIZED_VIEWS:
        written = list(data["args"][1]) if len(data["args"]) > 1 else []
        if len(written) != len(shape) or written[at] == -1:
            return []  # inferred from the per-rank width: right as written
    elif data["op"] == "unflatten":
        dim, sizes = data["args"][1] % len(whole), list(data["args"][2])
        if not dim <= at < dim + len(sizes) or sizes[at - dim] == -1:
            return []
    else:
        return []  # sized from another tensor (view_as, flatten): right as written
    return [("view", len(whole), in_dim, whole[in_dim], at, shape[at], shape)]


def _cut_rules(data: dict, whole: tuple, in_dim: int) -> list[tuple]:
    """The rules for a split or slice along the sharded dim: its global cut points."""
    args = data["args"]
    if data["op"] == "slice":
        dim, start, end = (*args[1:4], *(0, 0, sys.maxsize)[len(args) - 1:])[:3]
        start, end = start or 0, sys.maxsize if end is None else end
        if dim % len(whole) != in_dim or not (isinstance(start, int) and isinstance(end, int)):
            return []
        if start < 0 or end < 0 or (start == 0 and end >= whole[in_dim]):
            return []  # counted from the end, or the whole dim: right as written
        return [("slice", len(whole), in_dim, whole[in_dim], start, end, ())]
    dim = args[2] if len(args) > 2 else 0
    if not isinstance(dim, int) or dim % len(whole) != in_dim:
        return []
    size = args[1] if isinstance(args[1], int) else args[1][0]
    return [("split", len(whole), in_dim, whole[in_dim], None, size, ())]
