"""Per-token statistics over a sharded width inside a block: partial sums, all-reduced.

A block between column and row Linears may reduce its sharded activation to one value per token:
a mean and a standard deviation that set a sparsity cutoff (``relu(g - (g.mean(-1) + k * g.std(-1)))``
on the gate of an MLP). Each rank holds a slice of the width; a sum-based statistic (:data:`STATISTICS`)
is its slices' partial sums added up, so it is exact once those are all-reduced: a ``(b, t, 1)``
tensor per statistic, and as much again for its gradient, which each rank's slice contributes to.
:class:`~autotp.styles.ShardedStatistics` runs the block's own code on DTensors to do that.

Only where the block keeps both the shard and the statistic to itself:

- the reduced shard comes from plain ``nn.Linear`` columns inside the block (no packed parts, no
  heads cut from it) and is contracted by plain rows inside it; no shard enters or leaves it;
- the statistic is read only by pointwise ops inside the block, on its way to meeting the shard
  (broadcast back against it), never by a Linear, a reduction or the block's caller.

Anything else (a median, a max, a top-k over the width, a statistic read elsewhere) stays
default-deny: the reduction breaks the shard, and the block's Linears stay whole.
"""

from __future__ import annotations

import math
from dataclasses import replace

import networkx as nx

from autotp.errors import PlanError
from autotp.synth.graph import Ref, refs
from autotp.synth.ops import ELEMENTWISE, PASSTHROUGH, SINKS, STATISTICS, VIEW_LIKE
from autotp.synth.roles import Role
from autotp.synth.stages import Analysis, post_pass, role_kind


# The role kind this idiom assigns (stages.role_kind): what it means and its style.
WIDTH_STATS = role_kind(
    "width_stats",
    "block whose own code reduces its sharded width to per-token statistics (mean, std): run on "
    "DTensors, each statistic all-reduced",
    lambda role, lp: None)  # the ShardedStatistics wrapper alone (build.style_for)

# Ops a statistic may pass through on its way to the shard: pointwise, and the reshapes that
# broadcast a (b, t) value back against (b, t, width).
_STATISTIC_PATH = ELEMENTWISE | PASSTHROUGH | VIEW_LIKE | frozenset({
    "unsqueeze", "squeeze", "expand", "expand_as", "getitem", "type_as",
})


def statistic_in_block(flow, name: str, data: dict, origins: frozenset) -> bool:
    """Whether reduction ``name`` over the shard is a sum-based statistic in a block's own code:
    recorded in ``flow.width_stats`` (checked as a whole by :func:`statistic_breaks` once the pass
    is over), its output replicated."""
    g, module = flow.g, data["module"]
    if data["op"] not in STATISTICS or not module or module in flow.width_norms:
        return False
    if not all(_plain_linear(g, o) and _inside(g.nodes[o]["module"], module) for o in origins):
        return False
    flow.width_stats.setdefault(module, []).append(name)
    return True


def block_statistic(flow, other: str) -> bool:
    """Whether replicated operand ``other`` is computed, inside its block, from the block's
    statistics of the shard (and constants): its style all-reduces them and their gradients."""
    g = flow.g
    module = g.nodes[other]["module"]
    made = set(flow.width_stats.get(module, ()))
    if not made:
        return False
    seen, todo, reached = {other}, [other], False
    while todo:
        name = todo.pop()
        if name in made:
            reached = True
            continue
        for pred in refs(g.nodes[name]["args"], g.nodes[name]["kwargs"]) if g.nodes[name]["kind"] == "call" else ():
            pred, data = pred.name, g.nodes[pred.name]
            if pred in seen or data["op"] in SINKS:
                continue
            seen.add(pred)
            if flow.sharded(pred) or (data["kind"] == "call" and module not in data["stack"]) \
                    or (data["kind"] == "input" and not _scalar(data)):
                return False  # (a scalar placeholder: a constant the code makes, ``torch.tensor(0.95)``)
            if data["kind"] == "call":
                todo.append(pred)
    return reached


def statistic_breaks(flow) -> dict[str, tuple[str, str]]:
    """Candidates whose shard a block reduces to statistics it does not keep to itself (see the
    module docstring): candidate -> (reason, node), as :attr:`Flow.broken` holds them."""
    broken: dict[str, tuple[str, str]] = {}
    for module, stats in flow.width_stats.items():
        why = _statistic_read(flow, module, stats) or _block_keeps_shard(flow, module)
        if why is None:
            continue
        node, reason = why
        for stat in stats:
            origins = _origins_of(flow, stat)
            for root in origins:
                broken.setdefault(root, (f"{flow.g.nodes[stat]['op']} reduces over the sharded width in {module}, "
                                         f"{reason}", node))
    return broken


def _statistic_read(flow, module: str, stats: list[str]) -> tuple[str, str] | None:
    """Where a statistic of ``module`` is read other than by pointwise ops leading to the shard."""
    g = flow.g
    seen, todo = set(stats), list(stats)
    while todo:
        for succ in g.successors(todo.pop()):
            data = g.nodes[succ]
            if succ in seen or data["op"] in SINKS:
                continue
            seen.add(succ)
            if data["kind"] != "call" or module not in data["stack"] or _is_product(g, succ):
                return succ, f"and its statistic is read by {data['op']} {succ} outside the block's pointwise code"
            if flow.sharded(succ):
                if data["op"] not in ELEMENTWISE:
                    return succ, f"and its statistic meets the shard at {data['op']} {succ}, not pointwise"
                continue
            if data["op"] not in _STATISTIC_PATH:
                return succ, f"and its statistic is read by {data['op']} {succ}, which is no pointwise op"
            todo.append(succ)
    return None


def _block_keeps_shard(flow, module: str) -> tuple[str, str] | None:
    """Where a shard inside ``module`` comes from or goes to anything but its plain columns and rows."""
    g = flow.g
    for name, data in g.nodes(data=True):
        if module not in data["stack"] or not flow.sharded(name):
            continue
        state = flow.state[name]
        if isinstance(state, tuple) or state.pieces or state.fold:
            return name, f"and its shard is cut into parts at {data['op']} {name}"
        for root in state.origins:
            if not _inside(g.nodes[root]["module"], module) or not _plain_linear(g, root) or root in flow.splits \
                    or root in flow.part_views or root in flow.group_views or root in flow.copied or root in flow.heads:
                return name, f"and the shard of {root} at {name} is not a plain column of the block"
        if data["kind"] == "call" and data["op"] not in ("linear", "getitem"):
            for ref in refs(data["args"], data["kwargs"]):
                shape = g.nodes[ref.name]["shape"]
                if not flow.sharded(ref.name) and not _scalar(g.nodes[ref.name]) and not block_statistic(flow, ref.name):
                    # The block's code runs on DTensors: a plain tensor of its own would meet them.
                    return name, f"and its shard meets {ref.name} {shape} at {data['op']} {name}, no statistic of it"
        for succ in g.successors(name):
            sdata = g.nodes[succ]
            if sdata["op"] in SINKS:
                continue
            if sdata["kind"] != "call" or module not in sdata["stack"]:
                return succ, f"and its shard leaves the block at {sdata['op']} {succ}"
            if succ in flow.rows and (not _plain_linear(g, succ) or succ in flow.row_packs or succ in flow.scatters):
                return succ, f"and its shard is contracted by {succ}, which is no plain row Linear"
    return None


def _origins_of(flow, stat: str) -> frozenset:
    """The candidates whose shard reduction ``stat`` reads."""
    data = flow.g.nodes[stat]
    found = frozenset()
    for ref in refs(data["args"], data["kwargs"]):
        if flow.sharded(ref.name) and not isinstance(flow.state[ref.name], tuple):
            found |= flow.state[ref.name].origins
    return found


def _scalar(data: dict) -> bool:
    """Whether a node holds one value (a 0-d or size-1 tensor): DTensor code reads it as replicated."""
    return data["shape"] is not None and math.prod(data["shape"]) <= 1


def _inside(child: str, module: str) -> bool:
    """Whether module ``child`` lies strictly inside ``module``."""
    return child.startswith(module + ".")


def _plain_linear(g: nx.DiGraph, name: str) -> bool:
    """An ``nn.Linear``-like call: ``linear`` by its own module's ``(out, in)`` weight, which plain
    ``ColwiseParallel`` / ``RowwiseParallel`` shard (no raw parameter, no ``(in, out)`` storage)."""
    data = g.nodes[name]
    weight = data["args"][1] if len(data["args"]) > 1 else None
    return data["op"] == "linear" and isinstance(weight, Ref) and not data.get("raw_weight") \
        and not data.get("weight_in_out") and g.nodes[weight.name]["kind"] in ("param", "call")


def _is_product(g: nx.DiGraph, name: str) -> bool:
    return g.nodes[name]["op"] in {"linear", "matmul", "mm", "bmm", "einsum", "addmm", "baddbmm"}


def statistics_roles(g: nx.DiGraph, flow, roles: dict[str, Role]) -> dict[str, Role]:
    """``roles`` with each block of ``flow.width_stats`` marked ``statistics`` (a ``width_stats``
    role where it has none) and its column Linears' outputs handed on as DTensors."""
    roles = dict(roles)
    for module, stats in flow.width_stats.items():
        note = (f"its code takes {', '.join(sorted({g.nodes[s]['op'] for s in stats}))} over the sharded width; "
                "each statistic is all-reduced")
        current = roles.get(module)
        roles[module] = Role("width_stats", note, tuple(stats), statistics=True) if current is None else \
            replace(current, statistics=True, reason=f"{current.reason}; {note}")
        for root in flow.roots:
            owner = g.nodes[root]["module"]
            if _inside(owner, module) and owner in roles:
                if roles[owner].kind != "column":
                    raise PlanError(f"{owner}: a column of {module}, whose statistics over the sharded width "
                                         f"are all-reduced, has role {roles[owner].kind}; only a plain column can "
                                         "hand its output on as a DTensor")
                roles[owner] = replace(roles[owner], dtensor_output=True)
    return roles


@post_pass(order=100)
def width_statistics(a: Analysis) -> Analysis:
    """Blocks whose own code takes per-token statistics over their sharded width run on DTensors,
    each statistic all-reduced (:mod:`autotp.synth.statistics`); their columns hand on DTensors."""
    return replace(a, roles=statistics_roles(a.graph, a.flow, a.roles))
