"""Per-head loops: code that selects every head of a sharded dim in turn, processes each head the
same way, and joins the results along that dim again.

::

    xs = x.view(b, t, self.n_heads, d).transpose(1, 2)          # sharded on the heads (dim 1)
    outs = [f(xs[:, i], self.w[i], self.bias[i]) for i in range(self.n_heads)]
    y = torch.stack(outs, dim=2)                                 # sharded on the heads again

The trace unrolls the loop: one ``select`` of index ``i`` per head, each followed by its own copy of
the body. On a rank holding heads ``[r * H / tp, (r + 1) * H / tp)``, the same code with its head
count divided by tp (the shape proof finds that attribute, :mod:`autotp.synth.shape_proof`) runs the
body for its local heads ``0 .. H / tp - 1``, which are the global heads ``r * H / tp + i``: exactly
the global run's iterations of those heads, if every iteration is the same code but for the index.
The joined result is then the rank's block of the heads, in order.

So the analysis reads ``select(x, heads_dim, i)`` of a sharded ``x`` as *one head's value*
(:class:`HeadValue`, not a :class:`~autotp.synth.shard.Shard`: no dim of it is sharded), follows
it through any op that meets only values of that same head, and lets a ``cat`` / ``stack`` of the
values of heads ``0 .. H - 1``, in order, make a shard on the joined dim again. Per-head parameters
the body selects with its index (``self.w[i]``, also as the weight of ``x @ self.w[i]``) are sharded
on that dim with the heads. Each of these is default-deny; the shard breaks, and its Linears stay
whole, where:

- a head's value meets a sharded tensor, a value of another head, a Linear, an in-place write, the
  graph output, or a replicated value with a gradient that is made neither from parameters selected
  by the same index (sharded with the heads) nor from parameters and constants alone (replicated,
  its gradient all-reduced by :func:`~autotp.synth.params.param_roles`);
- the join is not of every head exactly once, in order (a subset, a repeat, another order);
- the iterations differ (:func:`head_loop_breaks` compares them op for op, the index aside);
- a per-head parameter selected for one head is read outside that head's iteration;
- tp does not divide the heads (``_indivisible_parts`` in :mod:`autotp.synth.pipeline`), or the
  rank's code, run alone, does not loop over exactly its own heads: the shape proof compares its
  trace with the global one less the iterations of the other ranks' heads (:func:`later_iterations`),
  so a count that no attribute divided by tp gives (a constant) keeps the Linears whole.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import networkx as nx

from autotp.synth.graph import Ref, refs
from autotp.synth.ops import CONSTANT_FACTORIES, JOINS, SELECTING_PRODUCTS, SINKS, WRITES
from autotp.synth.params import value_refs
from autotp.synth.queries import _only_params_behind, is_linear
from autotp.synth.shard import Shard
from autotp.synth.stages import drop_check


@dataclass(frozen=True)
class HeadValue:
    """One head's value: ``index`` of ``heads`` (the global size of the selected sharded dim), from
    the shards of ``origins``."""

    heads: int
    index: int
    origins: frozenset


def select_head(flow, name: str, src: str, dim: int) -> bool:
    """Whether ``select(src, dim, i)`` of a tensor sharded on ``dim`` may be read as head ``i``'s
    value: a plain block of whole heads (no joined pieces, no fold, no parts held whole per rank)
    and a constant index in range. Recorded in ``flow.per_head`` and ``flow.head_selects``."""
    g = flow.g
    shard, heads = flow.state[src], g.nodes[src]["shape"][dim]
    index = g.nodes[name]["args"][2] if len(g.nodes[name]["args"]) > 2 else None
    if shard.pieces or shard.fold or any(o in flow.copied for o in shard.origins) or heads < 2 \
            or not isinstance(index, int) or not 0 <= index < heads:
        return False
    flow.per_head[name] = HeadValue(heads, index, shard.origins)
    flow.head_selects.add(name)
    return True


def reads_head(flow, data) -> bool:
    """Whether an op reads a head's value (:class:`HeadValue`)."""
    return any(r.name in flow.per_head for r in refs(data["args"], data["kwargs"]))


def head_step(flow, name: str, data, dims: dict[str, int]) -> None:
    """An op that reads a head's value: a join of every head (a shard again), an op within one
    head (that head's value), or a break of every shard involved."""
    inputs = refs(data["args"], data["kwargs"])
    values = [flow.per_head[r.name] for r in inputs if r.name in flow.per_head]
    origins = frozenset().union(*(v.origins for v in values), *(flow.state[s].origins for s in dims))
    reason = _refusal(flow, name, data, dims, values)
    if reason is None and data["op"] in JOINS and _join(flow, name, data):
        return
    if reason is None and len({(v.heads, v.index) for v in values}) > 1:
        reason = "mixes the values of different heads selected from the sharded dim"
    if reason is None:
        reason = _operands(flow, name, data, values[0])
    if reason is not None:
        for o in origins:
            flow.broken.setdefault(o, (reason, name))
        return
    flow.per_head[name] = HeadValue(values[0].heads, values[0].index, origins)


def _refusal(flow, name: str, data, dims: dict[str, int], values) -> str | None:
    if dims:
        return "combines one head's values, selected from the sharded dim, with a sharded tensor"
    if is_linear(flow.g, name) and not (data["op"] in SELECTING_PRODUCTS and isinstance(data["args"][1], Ref)
                                        and _selected_operand(flow, data["args"][1].name, values[0])):
        # ``x @ self.w[i]`` by the head's own weight is an op within the head; any other Linear
        # would hand a whole weight one head's values (its gradient a per-rank share).
        return "a Linear reads one head's values selected from the sharded dim"
    if data["op"] in WRITES or data["op"].endswith("_"):
        return f"{data['op']} writes one head's values in place"
    return None


def _operands(flow, name: str, data, value: HeadValue) -> str | None:
    """Why a replicated operand of an op within one head cannot meet it, or None: it must be made
    from parameters selected by the head's index (then sharded with the heads,
    :func:`_selected_operand`), or from parameters and constants alone (replicated, their gradient
    all-reduced)."""
    for ref in value_refs(data):
        if ref.name in flow.per_head or flow.g.nodes[ref.name]["op"] in SINKS:
            continue
        if not _selected_operand(flow, ref.name, value) and not _only_params_behind(flow.g, ref.name):
            return (f"{data['op']} combines one head's values with {ref.name} {flow.g.nodes[ref.name]['shape']}, "
                    "which is neither made from parameters selected by the same head nor from parameters "
                    "and constants alone")
    return None


def _selected_operand(flow, other: str, value: HeadValue) -> bool:
    """Whether ``other`` is computed, with no Linear, model input or sharded value on the way, from
    parameters and constants of which at least one is selected by the head's index: ``select(p, d,
    i)``, ``p`` a parameter (or a pointwise tree of them) with the head count on ``d``. Each such
    ``p`` is sharded on ``d`` with the heads (:meth:`~autotp.synth.flow.Flow.shard_param`); the
    nodes from the selects to ``other`` are that head's (``flow.head_operands``), so the iteration
    comparison sees them and they may be read nowhere else (:func:`head_loop_breaks`)."""
    g, nodes, selects, todo = flow.g, set(), [], [other]
    while todo:
        node = todo.pop()
        data = g.nodes[node]
        if node in nodes or data["kind"] in ("param", "buffer") or data["op"] in SINKS:
            continue
        if data["kind"] != "call" or flow.sharded(node) or node in flow.per_head or is_linear(g, node):
            return False
        nodes.add(node)
        selected = _selected_source(g, node, value)
        if selected is not None:
            selects.append((node, *selected))
            continue
        todo.extend(r.name for r in value_refs(data))
    if not selects:
        return False
    for node, src, dim in selects:
        meeting, deciding = flow.meeting, flow.deciding
        flow.meeting, flow.deciding = (_shard(dim, value.origins),), node
        try:
            if not (flow.shard_param(src, dim) or flow.shard_tree(src, dim)):
                return False
        finally:
            flow.meeting, flow.deciding = meeting, deciding
    for node in nodes:
        flow.head_operands[node] = value
    flow.head_selects.update(node for node, _, _ in selects)
    return True


def _selected_source(g: nx.DiGraph, node: str, value: HeadValue) -> tuple[str, int] | None:
    """``(p, d)`` if ``node`` is ``select(p, d, i)`` of the head's index ``i`` on a dim of the head
    count (``p`` not yet known to be parameters: the caller shards it or refuses)."""
    data = g.nodes[node]
    if data["op"] != "select" or len(data["args"]) < 3 or not isinstance(data["args"][0], Ref):
        return None
    src, dim, index = data["args"][0].name, data["args"][1], data["args"][2]
    shape = g.nodes[src]["shape"]
    if not shape or not isinstance(dim, int) or index != value.index or shape[dim % len(shape)] != value.heads:
        return None
    return src, dim % len(shape)


def _shard(dim: int, origins: frozenset):
    return Shard(dim, origins)


def _join(flow, name: str, data) -> bool:
    """Whether ``cat`` / ``stack`` ``name`` joins the values of heads ``0 .. H - 1`` in order, all
    of one shape, along a dim: its output is then sharded on that dim, each rank its block of the
    heads. Recorded in ``flow.head_loops``."""
    g = flow.g
    tensors = data["args"][0] if data["args"] else None
    at = data["args"][1] if len(data["args"]) > 1 else data["kwargs"].get("dim", 0)
    if not isinstance(tensors, (list, tuple)) or not isinstance(at, int) \
            or not all(isinstance(t, Ref) and t.name in flow.per_head for t in tensors):
        return False
    values = [flow.per_head[t.name] for t in tensors]
    heads, shapes, out = values[0].heads, {tuple(g.nodes[t.name]["shape"] or ()) for t in tensors}, data["shape"]
    if [v.index for v in values] != list(range(heads)) or any(v.heads != heads for v in values) \
            or len(shapes) != 1 or not out:
        return False
    shape = shapes.pop()
    if data["op"] == "stack":
        dim = at % len(out)
        if out[dim] != heads:
            return False
    else:
        dim = at % len(shape) if shape else 0
        if not shape or out[dim] != heads * shape[dim]:
            return False
    origins = frozenset().union(*(v.origins for v in values))
    flow.state[name] = Shard(dim, origins, False, tensors[0].name)
    for o in origins:
        flow.extent[o] = math.gcd(flow.extent.get(o, 0), heads)
    flow.head_loops[name] = (heads, tuple(t.name for t in tensors))
    return True


def head_regions(flow) -> dict[str, list[list[str]]]:
    """For each join of a per-head loop (``flow.head_loops``), the nodes of each head's iteration,
    in program order: the values of that head connected to the joined one, the selected parameters
    and their chains that meet them, the constants made for them alone (a scan's zero state) and
    the metadata asserts on all of these."""
    g, out = flow.g, {}
    for join, (_, elements) in flow.head_loops.items():
        regions = []
        for element in elements:
            key = flow.per_head[element]
            region = _component(flow, element, key)
            region |= _supports(g, region)
            region |= {s for n in region for s in g.successors(n) if g.nodes[s]["op"] in SINKS}
            regions.append(sorted(region, key=lambda n: g.nodes[n]["order"]))
        out[join] = regions
    return out


def _component(flow, start: str, key: HeadValue) -> set[str]:
    """The values of ``key``'s head connected to ``start`` through ops of that head, with the
    selected parameters and chains (``flow.head_operands``) that feed them."""
    g = flow.g

    def member(node: str) -> bool:
        found = flow.per_head.get(node) or flow.head_operands.get(node)
        return found is not None and _key(found) == _key(key)

    seen, todo = {start}, [start]
    while todo:
        node = todo.pop()
        for other in (*g.predecessors(node), *g.successors(node)):
            if other not in seen and member(other):
                seen.add(other)
                todo.append(other)
    return seen


def _key(value: HeadValue) -> tuple[int, int]:
    return value.heads, value.index


def _supports(g: nx.DiGraph, region: set[str]) -> set[str]:
    """Calls read only inside ``region`` that read no tensor: constants made for one iteration."""
    found = set()
    for node in region:
        for pred in g.predecessors(node):
            data = g.nodes[pred]
            if pred in region or data["kind"] != "call" or data["op"] not in CONSTANT_FACTORIES or value_refs(data):
                continue
            if all(s in region or g.nodes[s]["op"] in SINKS for s in g.successors(pred)):
                found.add(pred)
    return found


@drop_check(order=60)
def head_loop_breaks(flow) -> dict[str, str]:
    """Candidates whose shard reaches a per-head loop that is not one body run for every head:
    iterations that differ (other ops, other constants, other outside values) but for the index,
    iterations that share a node, per-head parameters selected for one head and read by another,
    or a head's value read by something that neither stays within its head nor joins every head."""
    g, bad = flow.g, {}
    owner: dict[str, int] = {}  # node -> the head whose iteration it is in (two joins may share one loop)
    for join, regions in head_regions(flow).items():
        origins = flow.state[join].origins
        heads = len(regions)
        shapes = [_signature(g, flow, region) for region in regions]
        reason = None
        if any(s != shapes[0] for s in shapes):
            i = next(i for i, s in enumerate(shapes) if s != shapes[0])
            reason = f"its loop over {heads} heads does not run the same ops for head {i} as for head 0"
        for i, region in enumerate(regions):
            for node in region:
                if owner.setdefault(node, i) != i:
                    reason = reason or f"{g.nodes[node]['op']} takes part in two iterations of a loop over heads"
            for node in region:
                if node in flow.head_operands and any(s not in region and g.nodes[s]["op"] not in SINKS
                                                      for s in g.successors(node)):
                    reason = reason or (f"a parameter selected for head {i} is read outside that head's "
                                        "iteration")
        if reason is not None:
            for o in origins:
                bad.setdefault(o, f"{reason} (at {g.nodes[join]['op']} in {g.nodes[join]['module'] or 'the root'})")
    for node, value in flow.per_head.items():
        for succ in g.successors(node):
            data = g.nodes[succ]
            if data["op"] in SINKS or succ in flow.per_head or succ in flow.head_loops:
                continue
            for o in value.origins:
                bad.setdefault(o, f"one head's values, selected from the sharded dim, reach {data['op']} in "
                                  f"{data['module'] or 'the root'}, which neither stays within that head nor "
                                  "joins every head")
    return bad


def _signature(g: nx.DiGraph, flow, region: list[str]) -> list:
    """One iteration as comparable data: each node's op, shape and arguments, its inputs inside the
    iteration by position, outside values by name, and the index of a head's selects left out."""
    at = {n: k for k, n in enumerate(region)}

    def canon(value):
        if isinstance(value, Ref):
            return ("in", at[value.name]) if value.name in at else ("out", value.name)
        if isinstance(value, (list, tuple)):
            return tuple(canon(v) for v in value)
        if isinstance(value, dict):
            return tuple(sorted((k, canon(v)) for k, v in value.items()))
        return repr(value)

    found = []
    for node in region:
        data = g.nodes[node]
        args = list(data["args"])
        if data["op"] == "select" and (node in flow.head_selects or node in flow.head_operands):
            args[2:3] = ["index"]
        found.append((data["op"], tuple(data["shape"] or ()), canon(args), canon(data["kwargs"])))
    return found


def later_iterations(flow, tp: int) -> set[str]:
    """The nodes of the iterations a rank does not run: heads ``H / tp`` and on of each per-head
    loop (the rank's code, its head count divided, runs only its own ``H / tp`` heads)."""
    found = set()
    for join, regions in head_regions(flow).items():
        for region in regions[len(regions) // tp:]:
            found.update(region)
    return found
