"""Propagation: follow every candidate column's sharded dim op by op (:mod:`autotp.synth.ops`)
until a Linear contracts it (a row) or the graph output takes it (the head), recording what it
met in a :class:`~autotp.synth.flow.Flow`. One pass; :mod:`autotp.synth.fixpoint` repeats it.
"""

from __future__ import annotations

import dataclasses
import logging
import math

import networkx as nx

from autotp.synth.graph import Ref, param_modules, refs
from autotp.synth.head_loops import head_step, reads_head
from autotp.synth.statistics import statistic_breaks, statistic_in_block
from autotp.synth.ops import VIEW_LIKE, WRITE_VIEWS, WRITES, Break, Given, Out, Parts, Split, apply_rule
from autotp.synth.queries import is_linear, linear_weight
from autotp.synth.shard import Shard
from autotp.synth.flow import Flow, _projects_down, _packable_row

log = logging.getLogger(__name__)


def _sharded_inputs(flow: Flow, data) -> dict[str, int]:
    found = {}
    for ref in refs(data["args"], data["kwargs"]):
        value = flow.state.get(ref.name)
        if isinstance(value, Shard):
            found[ref.name] = value.dim
    return found


def _kept_span(flow: Flow, name: str, dims: dict, dim: int):
    """The span a rule's output keeps: its inputs' common span, if the sharded dim keeps its size
    (every rule that returns the shard on a dim of the same size keeps the features in order)."""
    spans = {flow.span(src) for src in dims}
    if len(spans) != 1 or None in spans:
        return None
    span = spans.pop()
    return span if flow.g.nodes[name]["shape"][dim] == span[1] - span[0] else None


def _kept_pieces(flow: Flow, name: str, dims: dict, dim: int):
    """The pieces a rule's output keeps: its sharded inputs' common pieces, if the sharded dim
    keeps its total width (the features stay in place, as for :func:`_kept_span`)."""
    pieces = {flow.pieces(src) for src in dims}
    if len(pieces) != 1 or None in pieces:
        return None
    pieces = pieces.pop()
    return pieces if flow.g.nodes[name]["shape"][dim] == sum(width for _, width in pieces) else None


def _kept_fold(flow: Flow, name: str, dims: dict, dim: int):
    """The fold a rule's output keeps: its sharded inputs' common fold, if the sharded dim keeps
    its size and the op is not a view (a view decides its fold itself)."""
    folds = {flow.state[src].fold for src in dims if isinstance(flow.state.get(src), Shard)}
    if len(folds) != 1 or None in folds or flow.g.nodes[name]["op"] in VIEW_LIKE:
        return None
    fold = folds.pop()
    return fold if flow.g.nodes[name]["shape"][dim] == math.prod(fold[0]) else None


def _record(flow: Flow, name: str, result, origins: frozenset, prev: str, dims: dict | None = None):
    """Store a rule's result as the node's state."""
    if isinstance(result, Given):
        flow.state[name] = result.value
        if isinstance(result.value, Shard) and result.value.fold:  # the heads folded in must divide
            sizes, k = result.value.fold
            for o in origins:
                flow.extent[o] = math.gcd(flow.extent.get(o, 0), sizes[k])
    elif isinstance(result, Out):
        span = _kept_span(flow, name, dims or {}, result.dim)
        pieces = _kept_pieces(flow, name, dims or {}, result.dim)
        fold = _kept_fold(flow, name, dims or {}, result.dim)
        heads = _kept_head_span(flow, name, dims or {}, result.dim)
        flow.state[name] = Shard(result.dim, origins, result.intact, prev, span, pieces, fold, heads)
        size = flow.g.nodes[name]["shape"][result.dim]
        for o in origins:
            if not _holds_copies(flow, o, span):  # parts held whole are not divided: their width says nothing
                flow.extent[o] = math.gcd(flow.extent.get(o, 0), size)
    elif isinstance(result, Parts):
        flow.state[name] = tuple(Shard(p.dim, origins, p.intact, prev) if p else None for p in result.parts)
    elif isinstance(result, Split) and result.heads:
        _record_head_cut(flow, name, result, origins, prev)
    elif isinstance(result, Split):
        start = flow.span(prev)[0] if flow.span(prev) else 0
        ranges = tuple((start + a, start + b) for a, b in result.ranges)
        for o in origins:
            # A candidate read per group (Flow.group_view): the span is group 0's, each group cut alike.
            groups, inner = flow.group_views.get(o, (1, 0))
            flow.splits.setdefault(o, []).extend((a + i * inner, b + i * inner) for i in range(groups)
                                                 for a, b in ranges)
            flow.split_nodes.setdefault(o, []).append(name)
        shards = [None if _held_whole(flow, origins, r) else Shard(result.dim, origins, False, prev, r) for r in ranges]
        for index, (shard, r) in enumerate(zip(shards, ranges)):
            if shard is None:  # a part held whole on every rank: replicated from here on
                flow.copy_cuts.setdefault(name, {})[index if result.tuple_output else None] = (next(iter(origins)), r)
        if result.tuple_output:
            flow.state[name] = tuple(shards)
        elif shards[0] is not None:
            flow.state[name] = shards[0]


def _kept_head_span(flow: Flow, name: str, dims: dict, dim: int) -> tuple[int, int, int] | None:
    """The heads' span (:attr:`Shard.head_span`) a rule's output keeps: its sharded inputs hold the
    same features (a span, or a heads' span), on dims of one size ``n``; the output's dim has that
    size (the heads kept in place), or is a view's split of it into ``m`` outer indices (each then
    ``n / m`` of the input's units: a view of features into heads)."""
    g, found, sizes = flow.g, set(), set()
    for src, at in dims.items():
        value, size = flow.state.get(src), g.nodes[src]["shape"][at]
        if not isinstance(value, Shard) or value.pieces or value.fold:
            return None
        if value.span is not None and value.span[1] - value.span[0] == size:
            found.add((value.span, 1))
        elif value.head_span is not None:
            found.add((value.head_span[:2], value.head_span[2]))
        else:
            return None
        sizes.add(size)
    if len(found) != 1 or len(sizes) != 1:
        return None
    ((start, end), unit), n, m = found.pop(), sizes.pop(), g.nodes[name]["shape"][dim]
    if m == n:
        return (start, end, unit) if unit > 1 else None  # unit 1: the span itself (_kept_span)
    if g.nodes[name]["op"] in VIEW_LIKE and m < n and n % m == 0:
        return start, end, unit * (n // m)
    return None


def _record_head_cut(flow: Flow, name: str, result: Split, origins: frozenset, prev: str) -> None:
    """Store a cut of heads (:attr:`Shard.head_span`) into equal parts: each part is a range of the
    origins' output features, which are cut there as by a split of the features (``splits``); each
    part's heads must split over tp (``extent``, checked for ``head_cuts``)."""
    start, _, unit = flow.head_span(prev)
    ranges = tuple((start + a * unit, start + b * unit) for a, b in result.ranges)
    for o in origins:
        groups, inner = flow.group_views.get(o, (1, 0))
        flow.splits.setdefault(o, []).extend((a + i * inner, b + i * inner) for i in range(groups)
                                             for a, b in ranges)
        flow.split_nodes.setdefault(o, []).append(name)
        flow.head_cuts.add(o)
        for a, b in result.ranges:
            flow.extent[o] = math.gcd(flow.extent.get(o, 0), b - a)
    shards = []
    for index, (a, b) in enumerate(ranges):
        if _held_whole(flow, origins, (a, b)):
            flow.copy_cuts.setdefault(name, {})[index] = (next(iter(origins)), (a, b))
            shards.append(None)
        else:
            shards.append(Shard(result.dim, origins, False, prev, head_span=(a, b, unit)))
    flow.state[name] = tuple(shards)


def _held_whole(flow: Flow, origins: frozenset, span: tuple[int, int]) -> bool:
    """Whether the part ``span`` of one candidate's output lies within the spans it holds whole."""
    if len(origins) != 1:
        return False
    spans = flow.copied.get(next(iter(origins)), ())
    return sum(min(e, span[1]) - max(s, span[0]) for s, e in spans if s < span[1] and span[0] < e) == span[1] - span[0]


def _holds_copies(flow: Flow, origin: str, span: tuple[int, int] | None) -> bool:
    """Whether a shard of ``origin`` over ``span`` (None: unknown) holds parts kept whole per rank."""
    spans = flow.copied.get(origin, ())
    return bool(spans) and (span is None or any(s < span[1] and span[0] < e for s, e in spans))


def _linear_step(flow: Flow, name: str, data, dims: dict, active: set):
    """A Linear: contracts a shard of its last input dim (row), or starts one (column candidate)."""
    g = flow.g
    x = data["args"][0].name
    if x in dims and linear_weight(g, name):
        if dims[x] == len(g.nodes[x]["shape"]) - 1:
            if name in flow.whole:  # a row would shard its weight: the shard must stop before it
                for o in flow.state[x].origins:
                    flow.broken.setdefault(o, (f"it reaches {data['module']}, whose weight stays whole: "
                                               f"{flow.whole[name]}", name))
                return
            flow.rows[name] = flow.state[x].origins
            packs = _folded_parts(flow.state[x].fold)
            if packs and _packable_row(g, name):
                flow.row_packs[name] = packs
            if name in active and (per_head_row(flow, name, x) or name in flow.head_scatters):  # onto the heads
                width = data["shape"][-1]
                flow.state[name] = Shard(len(data["shape"]) - 1, frozenset({name}), True, None, (0, width))
                flow.scatters.add(name)
                flow.extent[name] = width
            return
        _record(flow, name, Out(dims[x]), flow.state[x].origins, x)  # per-position: shard passes
    elif x not in dims and name in active:
        flow.state[name] = Shard(len(data["shape"]) - 1, frozenset({name}), True, None, (0, data["shape"][-1]))
        flow.roots.add(name)
        flow.extent[name] = 0 if name in flow.copied else data["shape"][-1]  # its divided parts set it


def per_head_row(flow: Flow, name: str, x: str) -> bool:
    """Whether row ``name`` (its input ``x`` sharded on its features) makes one value per head of
    that shard, so that its reduced output may stay sharded on its last dim, reduce-scattered: each
    rank then gets the values of its own heads (a per-head gate or mask computed from the values).

    Its output features must be fewer than its input features and equal to a size the sharded dim
    had on its way to ``x`` (the head count where a view split the heads off); its input one
    contiguous block of heads (no pieces, no fold); it an ``nn.Linear``-like product by an (out, in)
    weight. Only a candidate: the shard it starts must meet those heads again (:func:`unmet_scatters`)
    and survive propagation like any other; tp must divide it.
    """
    g, shard = flow.g, flow.state[x]
    width = g.nodes[name]["shape"][-1]
    if shard.pieces or shard.fold or not 1 < width < g.nodes[x]["shape"][-1] or not _packable_row(g, name):
        return False
    sizes, node, value = set(), x, shard
    while isinstance(value, Shard):
        sizes.add(g.nodes[node]["shape"][value.dim])
        if value.prev is None:
            break
        node, value = value.prev, flow.state.get(value.prev)
    return width in sizes


def unmet_scatters(flow: Flow) -> dict[str, str]:
    """Rows left sharded on the heads (:func:`per_head_row`) whose output shard never met a shard of
    the heads they read: nothing is gained by leaving it sharded, so it is reduced whole."""
    return {row: "its per-head output, left sharded, never meets the heads it reads again"
            for row in flow.scatters - flow.scatters_met - set(flow.broken)}


def _meets_heads(flow: Flow, dims: dict) -> None:
    """Record the rows left sharded on the heads whose shard meets, at one op, a shard of the
    heads they read (:attr:`Flow.scatters_met`)."""
    held = [flow.state[s].origins for s in dims]
    for row in flow.scatters & frozenset().union(*held):  # a row scattered onto the heads it feeds: any heads
        if any(row not in origins and (origins & flow.rows[row] or row in flow.head_scatters) for origins in held):
            flow.scatters_met.add(row)


def _folded_parts(fold) -> tuple[int, ...] | None:
    """The parts of a row's input features that hold a folded shard: dims of ``sizes`` merged, the
    sharded one at position ``k`` (each rank its slice of it for every index of the dims before):
    ``prod(sizes[:k])`` parts of ``prod(sizes[k:])`` features, each rank a share of every part.

    >>> _folded_parts(((4, 2, 8), 1))
    (16, 16, 16, 16)
    """
    if fold is None:
        return None
    sizes, k = fold
    return (math.prod(sizes[k:]),) * math.prod(sizes[:k])


def _getitem_step(flow: Flow, name: str, data) -> None:
    """``getitem`` of a tuple output takes that element's state (tuple outputs hold one per element)."""
    source, index = data["args"][0], data["args"][1]
    value = flow.state.get(source.name) if isinstance(source, Ref) else None
    if isinstance(value, tuple) and isinstance(index, int) and value[index] is not None:
        part = value[index]
        flow.state[name] = Shard(part.dim, part.origins, part.intact, source.name, part.span, part.pieces,
                                 part.fold, part.head_span)


def _reduction_in_norm(flow: Flow, data, origins, owners: set[str], callers: set[str]) -> bool:
    """A reduction over the shard inside a parametrised, non-Linear module: a width-sharded norm.
    A module that calls Linears (``callers``: an attention with a per-head parameter reducing over
    its heads) is no norm: the width-norm style could not be given to it."""
    module = data["module"]
    roots = {flow.g.nodes[o]["module"] for o in origins}
    if module in owners and module not in roots and module and module not in callers:
        flow.width_norms.setdefault(module, data)
        return True
    return False


def _written(flow: Flow, name: str, data) -> None:
    """An in-place write: the tensor it changes (through the views of its first argument) now
    also holds the written shard, so its later readers carry that shard's candidates too (a
    recurrence that fills ``out`` chunk by chunk: the query's candidate reaches the output
    projection through ``out``)."""
    written = flow.state.get(name)
    base = data["args"][0] if data["args"] else None
    while isinstance(base, Ref) and flow.g.nodes[base.name]["op"] in WRITE_VIEWS and flow.g.nodes[base.name]["args"]:
        base = flow.g.nodes[base.name]["args"][0]
    if not isinstance(written, Shard) or not isinstance(base, Ref):
        return
    target = flow.state.get(base.name)
    if isinstance(target, Shard) and not written.origins <= target.origins:
        flow.state[base.name] = dataclasses.replace(target, origins=target.origins | written.origins)
        flow.writes[name] = base.name


def propagate(g: nx.DiGraph, active: set[str], unit_heads: frozenset = frozenset(),
              whole: dict[str, str] | None = None, *, module_alone: bool = False,
              copied: dict[str, frozenset] | None = None, per_group: frozenset = frozenset(),
              revivable: dict[str, str] | None = None, head_scatters: frozenset = frozenset()) -> Flow:
    """Follow the shard of every active candidate Linear through ``g`` (one pass, program order).

    Args:
        g: the analysis graph.
        active: ``linear`` node names allowed to start a shard.
        unit_heads: candidates whose views may split off a single head (see :func:`analyse`).
        whole: Linear nodes whose weight must stay whole (read outside their module, tied
            differently): neither a column nor a row; a shard reaching one breaks, with the reason.
        module_alone: ``g`` is one module exported alone (the shape proof): its inputs may be
            values its caller slices to its heads (:meth:`Flow.shard_entry`).
        copied: candidate -> spans of its output cut off as parts held whole on every rank (the
            one kv head of a fused multi-query qkv): replicated from the cut on (:func:`copy_leaks`).
        per_group: candidates whose views into fixed groups are read per group (:meth:`Flow.group_view`).
        revivable: dropped candidates -> the op (elementwise, or a product over the heads) where their
            shard met a whole operand (:meth:`Flow.revives`).
        head_scatters: rows whose reduced output is reduce-scattered onto the heads it feeds
            (:meth:`Flow.scatters_onto_heads`).
    Returns:
        The :class:`Flow`: node states, rows, heads, splits and the candidates that broke.
    """
    flow = Flow(g, unit_heads=frozenset(unit_heads), whole=dict(whole or {}), module_alone=module_alone,
                copied=dict(copied or {}), per_group=frozenset(per_group), revivable=dict(revivable or {}),
                head_scatters=frozenset(head_scatters))
    owners = param_modules(g)
    callers = {m for n in g.nodes if g.nodes[n]["kind"] == "call" and is_linear(g, n) for m in g.nodes[n]["stack"]
               if m != g.nodes[n]["module"]}
    for name in sorted(g.nodes, key=lambda n: g.nodes[n]["order"]):
        data = g.nodes[name]
        if data["kind"] == "output":
            for value in (flow.per_head[r.name] for r in refs(data["args"]) if r.name in flow.per_head):
                for o in value.origins:
                    flow.broken.setdefault(o, ("one head's values, selected from the sharded dim, are a graph "
                                               "output", name))
            for src, dim in _sharded_inputs(flow, data).items():
                for o in flow.state[src].origins:
                    if _projects_down(g, o):
                        flow.broken.setdefault(o, ("it projects down to the model output (fewer features than it "
                                                   "reads: a classifier's labels, a pooler); kept whole, as "
                                                   "Megatron keeps such a head", name))
                        continue
                    flow.heads[o] = src
            continue
        if data["kind"] != "call":
            continue
        if flow.per_head and reads_head(flow, data):
            head_step(flow, name, data, _sharded_inputs(flow, data))
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
        if flow.scatters and len(dims) > 1:
            _meets_heads(flow, dims)
        flow.meeting, flow.deciding = tuple(flow.state[s] for s in dims), name
        result = apply_rule(g, name, dims, flow)
        if isinstance(result, Break):
            if result.reduction and (_reduction_in_norm(flow, data, origins, owners, callers)
                                     or statistic_in_block(flow, name, data, origins)):
                continue
            for o in result.only or origins:
                flow.broken.setdefault(o, (result.reason, name))
            if result.only and result.then:
                kept = {s: d for s, d in dims.items() if not flow.state[s].origins & result.only}
                _record(flow, name, result.then, origins - result.only, next(iter(kept)), kept)
            continue
        _record(flow, name, result, origins, next(iter(dims)), dims)
        if data["op"] in WRITES:
            _written(flow, name, data)
    for root, why in statistic_breaks(flow).items():
        flow.broken.setdefault(root, why)
    return flow


def propagate_packed(g: nx.DiGraph, active: set[str], packed: set[str], **options) -> Flow:
    """:func:`propagate` as a plan shards ``active``: the packed columns among them (``packed``)
    whose output the plain reading never cuts into parts, but views into fixed groups, are read
    per group (:meth:`Flow.group_view`), the one reading in which a packed style fits them."""
    flow = propagate(g, active, **options)
    uncut = frozenset(r for r in set(packed) & set(flow.groupable) if r not in flow.splits)
    return propagate(g, active, per_group=uncut, **options) if uncut else flow
