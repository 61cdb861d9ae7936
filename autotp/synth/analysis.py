"""Sharding analysis: which Linears can be column-parallel, and where each shard is contracted.

Every Linear fed a replicated input is a candidate column: its output's last dim is sharded. That
dim is followed op by op (:mod:`autotp.synth.ops`) until a Linear contracts over it (a row) or the
graph output takes it (the head). A candidate whose shard meets an op that needs the whole dim is
dropped with the op as its reason, and the propagation is run again without it, until nothing
changes: what is left is sound by construction.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import networkx as nx

from autotp.synth.graph import Ref, refs
from autotp.synth.ops import ATTENTION, ELEMENTWISE, MATMULS, PASSTHROUGH, Break, Out, Parts, Split, apply_rule

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class Shard:
    """A sharded value: its dim, the candidate Linears it comes from, and the path it took."""

    dim: int
    origins: frozenset
    intact: bool = False
    prev: str | None = None


@dataclass
class Flow:
    """The result of one propagation, and the context the op rules query while it runs."""

    g: nx.DiGraph
    state: dict = field(default_factory=dict)
    broken: dict = field(default_factory=dict)  # root -> (reason, node)
    rows: dict = field(default_factory=dict)  # row linear node -> origins
    heads: dict = field(default_factory=dict)  # root -> output node's sharded input
    splits: dict = field(default_factory=dict)  # root -> list of (start, end)
    split_nodes: dict = field(default_factory=dict)  # root -> nodes that cut its output into parts
    width_norms: dict = field(default_factory=dict)  # module -> node that reduces
    extent: dict = field(default_factory=dict)  # root -> gcd of every sharded extent it reached
    roots: set = field(default_factory=set)  # candidates that started a shard this pass
    unit_heads: frozenset = frozenset()  # candidates whose views may split off one head (one-kv-head k/v)
    param_shards: dict = field(default_factory=dict)  # parameter placeholder -> dim sharded with the heads

    def sharded(self, name: str) -> bool:
        """Whether ``name``'s output (or an element of it) is sharded."""
        return isinstance(self.state.get(name), (Shard, tuple))

    def shard_param(self, other: str, dim: int) -> bool:
        """Whether replicated operand ``other`` can be sharded on its ``dim`` along with the tensor
        it meets: a chain of one-tensor ops on a parameter read nowhere else (a per-head scale,
        a sink). Recorded in ``param_shards``; one parameter sharded on two dims cannot be."""
        from autotp.synth.params import param_dim

        found = param_dim(self.g, other, dim)
        if found is None or self.param_shards.get(found[0], found[1]) != found[1]:
            return False
        self.param_shards[found[0]] = found[1]
        return True

    def unit_heads_of(self, name: str) -> bool:
        """Whether the shard of ``name`` comes only from candidates read as one-kv-head k/v."""
        value = self.state.get(name)
        return isinstance(value, Shard) and bool(value.origins) and value.origins <= self.unit_heads

    def intact(self, name: str) -> bool:
        value = self.state.get(name)
        return isinstance(value, Shard) and value.intact

    def part(self, name: str, index: int):
        value = self.state.get(name)
        return value[index] if isinstance(value, tuple) else None

    def shards_along(self, other: str, name: str) -> bool:
        """Whether replicated operand ``other`` of ``name`` is a width-sharded norm's own weight."""
        source = param_source(self.g, other)
        if source is None:
            return False
        owner = self.g.nodes[source]["param"].rpartition(".")[0]
        return owner in self.width_norms and owner in self.g.nodes[name]["stack"]


def param_source(g: nx.DiGraph, name: str) -> str | None:
    """The parameter placeholder that ``name`` is a cast/pointwise function of, if any."""
    while True:
        data = g.nodes[name]
        if data["kind"] == "param":
            return name
        inputs = [r.name for r in refs(data["args"], data["kwargs"])]
        if data["kind"] != "call" or len(inputs) != 1 or data["op"] not in PASSTHROUGH | ELEMENTWISE:
            return None
        name = inputs[0]


# Grouped (per-expert) matmuls ``x @ W[e]``: weight argument (experts, in, out), possibly a
# transposed view of a stored (experts, out, in) parameter (transformers 5 MoE experts).
GROUPED_MATMULS = frozenset({"grouped_mm_fallback", "_grouped_mm", "grouped_mm"})


@dataclass(frozen=True)
class Weight:
    """The parameter a Linear-like node multiplies by, and which of its dims are out / in features."""

    node: str
    out_dim: int
    in_dim: int


def weight_of(g: nx.DiGraph, name: str) -> Weight | None:
    """The parameter of a ``linear`` (2-D) or grouped matmul (3-D) node, or None."""
    data = g.nodes[name]
    args = data["args"]
    if len(args) < 2 or not isinstance(args[1], Ref):
        return None
    if data["op"] == "linear":
        source = param_source(g, args[1].name)
        if not source or len(g.nodes[source]["shape"] or ()) != 2:
            return None
        return Weight(source, 1, 0) if data.get("weight_in_out") else Weight(source, 0, 1)
    if data["op"] in GROUPED_MATMULS:
        node, swapped = args[1].name, False
        while g.nodes[node]["kind"] == "call" and g.nodes[node]["op"] in ("transpose", "t", *PASSTHROUGH):
            if g.nodes[node]["op"] != "transpose" or sorted(x % 3 for x in g.nodes[node]["args"][1:3]) == [1, 2]:
                swapped ^= g.nodes[node]["op"] == "transpose"
            node = g.nodes[node]["args"][0].name
        if g.nodes[node]["kind"] == "param" and len(g.nodes[node]["shape"]) == 3:
            return Weight(node, 1, 2) if swapped else Weight(node, 2, 1)
    return None


def linear_weight(g: nx.DiGraph, name: str) -> str | None:
    """The parameter placeholder a Linear-like node multiplies by, or None."""
    weight = weight_of(g, name)
    return weight.node if weight else None


def is_linear(g: nx.DiGraph, name: str) -> bool:
    """A ``linear`` or grouped-matmul node whose weight is a parameter."""
    return g.nodes[name]["op"] in GROUPED_MATMULS | {"linear"} and weight_of(g, name) is not None


def weight_uses(g: nx.DiGraph):
    """``(node, parameter placeholder)`` for every Linear-like node and token-embedding lookup
    that reads a parameter as its weight."""
    for name, data in g.nodes(data=True):
        if is_linear(g, name):
            weight = linear_weight(g, name)
        elif data["op"] == "embedding" and isinstance(data["args"][0], Ref):
            weight = param_source(g, data["args"][0].name)
        else:
            continue
        if weight:
            yield name, weight


def tied_params(g: nx.DiGraph) -> dict[str, str]:
    """Parameters read as a weight by more than one linear/embedding node: placeholder -> users."""
    users: dict[str, list[str]] = {}
    for name, weight in weight_uses(g):
        users.setdefault(weight, []).append(g.nodes[name]["module"])
    return {w: ", ".join(u) for w, u in users.items() if len(u) > 1}


def _param_modules(g: nx.DiGraph) -> set[str]:
    return {d["param"].rpartition(".")[0] for _, d in g.nodes(data=True) if d["kind"] == "param"}


def _sharded_inputs(flow: Flow, data) -> dict[str, int]:
    found = {}
    for ref in refs(data["args"], data["kwargs"]):
        value = flow.state.get(ref.name)
        if isinstance(value, Shard):
            found[ref.name] = value.dim
    return found


def _record(flow: Flow, name: str, result, origins: frozenset, prev: str):
    """Store a rule's result as the node's state."""
    if isinstance(result, Out):
        flow.state[name] = Shard(result.dim, origins, result.intact, prev)
        size = flow.g.nodes[name]["shape"][result.dim]
        for o in origins:
            flow.extent[o] = math.gcd(flow.extent.get(o, 0), size)
    elif isinstance(result, Parts):
        flow.state[name] = tuple(Shard(p.dim, origins, p.intact, prev) if p else None for p in result.parts)
    elif isinstance(result, Split):
        for o in origins:
            flow.splits.setdefault(o, []).extend(result.ranges)
            flow.split_nodes.setdefault(o, []).append(name)
        shard = Shard(result.dim, origins, False, prev)
        flow.state[name] = tuple(shard for _ in result.ranges) if result.tuple_output else shard


def _linear_step(flow: Flow, name: str, data, dims: dict, active: set):
    """A Linear: contracts a shard of its last input dim (row), or starts one (column candidate)."""
    g = flow.g
    x = data["args"][0].name
    if x in dims and linear_weight(g, name):
        if dims[x] == len(g.nodes[x]["shape"]) - 1:
            flow.rows[name] = flow.state[x].origins
            return
        _record(flow, name, Out(dims[x]), flow.state[x].origins, x)  # per-position: shard passes
    elif x not in dims and name in active:
        flow.state[name] = Shard(len(data["shape"]) - 1, frozenset({name}), True, None)
        flow.roots.add(name)
        flow.extent[name] = data["shape"][-1]


def _getitem_step(flow: Flow, name: str, data) -> None:
    """``getitem`` of a tuple output takes that element's state (tuple outputs hold one per element)."""
    source, index = data["args"][0], data["args"][1]
    value = flow.state.get(source.name) if isinstance(source, Ref) else None
    if isinstance(value, tuple) and isinstance(index, int) and value[index] is not None:
        part = value[index]
        flow.state[name] = Shard(part.dim, part.origins, part.intact, source.name)


def _reduction_in_norm(flow: Flow, data, origins, param_modules) -> bool:
    """A reduction over the shard inside a parametrised, non-Linear module: a width-sharded norm."""
    module = data["module"]
    roots = {flow.g.nodes[o]["module"] for o in origins}
    if module in param_modules and module not in roots and module:
        flow.width_norms.setdefault(module, data)
        return True
    return False


def propagate(g: nx.DiGraph, active: set[str], unit_heads: frozenset = frozenset()) -> Flow:
    """Follow the shard of every active candidate Linear through ``g`` (one pass, program order).

    Args:
        g: the analysis graph.
        active: ``linear`` node names allowed to start a shard.
        unit_heads: candidates whose views may split off a single head (see :func:`analyse`).
    Returns:
        The :class:`Flow`: node states, rows, heads, splits and the candidates that broke.
    """
    flow, param_modules = Flow(g, unit_heads=frozenset(unit_heads)), _param_modules(g)
    for name in sorted(g.nodes, key=lambda n: g.nodes[n]["order"]):
        data = g.nodes[name]
        if data["kind"] == "output":
            for src, dim in _sharded_inputs(flow, data).items():
                for o in flow.state[src].origins:
                    flow.heads[o] = src
            continue
        if data["kind"] != "call":
            continue
        if data["op"] == "getitem":
            _getitem_step(flow, name, data)
            continue
        dims = _sharded_inputs(flow, data)
        if is_linear(g, name):
            _linear_step(flow, name, data, dims, active)
            continue
        if not dims:
            continue
        origins = frozenset().union(*(flow.state[s].origins for s in dims))
        result = apply_rule(g, name, dims, flow)
        if isinstance(result, Break):
            if result.reduction and _reduction_in_norm(flow, data, origins, param_modules):
                continue
            for o in origins:
                flow.broken.setdefault(o, (result.reason, name))
            continue
        _record(flow, name, result, origins, next(iter(dims)))
    return flow


def _bad_packs(flow: Flow) -> dict[str, str]:
    """Candidates whose output is cut into pieces that do not tile it exactly once."""
    bad = {}
    for root, ranges in flow.splits.items():
        width = flow.g.nodes[root]["shape"][-1]
        ordered = sorted(set(ranges))
        ends = [0] + [end for _, end in ordered]
        if [s for s, _ in ordered] != ends[:-1] or ends[-1] != width:
            bad[root] = f"its output is sliced into {ordered}, which do not tile {width} features"
    return bad


def _endless(flow: Flow) -> dict[str, str]:
    """Candidates whose shard never reaches a row-parallel Linear or the output."""
    reached = set(flow.heads)
    for origins in flow.rows.values():
        reached |= origins
    return {r: "its output is never contracted by a Linear" for r in flow.roots - reached - set(flow.broken)}


def analyse(g: nx.DiGraph, forbidden: dict[str, str] | None = None, *,
            unit_heads: bool = False) -> tuple[Flow, dict[str, str]]:
    """Run :func:`propagate` to a fixpoint, dropping candidates that break.

    Args:
        forbidden: Linear nodes that may not start a shard, with the reason (tie conflicts).
        unit_heads: when candidates were dropped, try once more reading their views as splits into
            a single head (the k/v of one-kv-head attention, whose shard then has extent 1). Kept
            only for candidates that reach an attention with more heads than that; for a tp size
            is then needed to replicate them per rank (:mod:`autotp.synth.kvheads`).
    Returns:
        The final :class:`Flow` and, for each dropped candidate, why it was dropped.
    """
    flow, dropped = _fixpoint(g, dict(forbidden or {}), frozenset())
    retry = frozenset(dropped) - set(forbidden or {})
    if not unit_heads or not retry:
        return flow, dropped
    forbidden_now = dict(forbidden or {})
    for _ in range(2):  # the second round drops extent-1 roots that feed no wider attention
        second, second_dropped = _fixpoint(g, dict(forbidden_now), retry)
        stray = {r: dropped[r] for r in second.roots & retry
                 if second.extent.get(r) == 1 and wider_attention(second, r) is None}
        if not stray:
            break
        forbidden_now.update(stray)
    else:
        return flow, dropped
    if len(second.roots) > len(flow.roots):
        log.debug("one-kv-head reading rescued %s", sorted(second.roots - flow.roots))
        return second, second_dropped
    return flow, dropped


def _fixpoint(g: nx.DiGraph, dropped: dict[str, str], unit_heads: frozenset) -> tuple[Flow, dict[str, str]]:
    active = {name for name in g.nodes if is_linear(g, name)} - set(dropped)
    rounds = 0
    while True:
        rounds += 1
        flow = propagate(g, active, unit_heads)
        bad = {r: f"{reason} (at {g.nodes[node]['op']} in {g.nodes[node]['module'] or 'the root'})"
               for r, (reason, node) in flow.broken.items()}
        bad.update(_bad_packs(flow))
        bad.update(_endless(flow))
        if not bad:
            log.debug("analysis converged after %d rounds, %d candidates dropped", rounds, len(dropped))
            return flow, dropped
        dropped.update(bad)
        active -= set(bad)


def wider_attention(flow: Flow, root: str) -> str | None:
    """The first attention or batched matmul ``root``'s shard reaches, if its sharded dim there
    holds more heads than ``root``'s extent (the k/v of grouped-query attention), else None."""
    g = flow.g
    extent = flow.extent.get(root, 0)
    for name in sorted(g.nodes, key=lambda n: g.nodes[n]["order"]):
        data = g.nodes[name]
        if data["op"] not in ATTENTION | MATMULS:
            continue
        if any(isinstance(flow.state.get(r.name), Shard) and root in flow.state[r.name].origins
               for r in refs(data["args"])):
            state = flow.state.get(name)
            heads = data["shape"][state.dim] if isinstance(state, Shard) else 0
            return name if extent < heads else None
    return None
