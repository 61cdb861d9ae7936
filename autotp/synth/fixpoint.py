"""The fixpoint: which Linears can be column-parallel, and where each shard is contracted.

Every Linear fed a replicated input is a candidate column. :func:`analyse` runs the propagation
(:mod:`autotp.synth.propagation`), drops each candidate whose shard met an op that needs the whole
dim (the op rules' breaks, and the checks here and in the idioms: packs that do not tile, mixed
parts, endless shards, a side giving way) and runs it again without them, until nothing changes:
what is left is sound by construction. Then the readings tried on top (one kv head, parts held
whole, low-rank pairs) each keep the one that shards more.
"""

from __future__ import annotations

import itertools
import logging
import math

import networkx as nx

from autotp.synth.graph import refs
from autotp.synth.ops import ATTENTION, ELEMENTWISE, MATMULS, SINKS
from autotp.synth.queries import is_linear, linear_weight, module_of, part_sizes, raw_like, raw_weight, weight_of
from autotp.synth.shard import Shard
from autotp.synth.flow import Flow, _weight_numel
from autotp.synth.propagation import propagate, unmet_scatters
from autotp.synth.stages import drop_checks

log = logging.getLogger(__name__)


def bad_packs(flow: Flow) -> dict[str, str]:
    """Candidates whose output is cut into pieces that do not tile it exactly once: the outermost
    pieces must tile it, and a piece cut again must be tiled by its own pieces (nested, never
    overlapping: each rank then holds its share of every finest part)."""
    bad = {}
    for root, ranges in flow.splits.items():
        width = flow.g.nodes[root]["shape"][-1]
        if not _tiles(sorted(set(ranges)), 0, width):
            bad[root] = f"its output is sliced into {sorted(set(ranges))}, which do not tile {width} features"
    return bad


def _tiles(ranges: list, start: int, end: int) -> bool:
    """Whether the outermost of ``ranges`` inside ``[start, end)`` tile it, each of them tiled in
    turn by the ranges inside it, and no range crosses another (a laminar family).

    >>> _tiles([(0, 4), (4, 12), (4, 8), (8, 12)], 0, 12), _tiles([(0, 8), (4, 12)], 0, 12)
    (True, False)
    """
    ranges = sorted({r for r in ranges if r != (start, end)})
    if not ranges:
        return True  # the whole, taken as one piece
    at, pieces = start, []
    while at < end:
        widest = max((r for r in ranges if r[0] == at), key=lambda r: r[1], default=None)
        if widest is None or widest[1] > end:
            return False
        pieces.append(widest)
        at = widest[1]
    for a, b in pieces:
        inner = [r for r in ranges if a <= r[0] and r[1] <= b and r != (a, b)]
        if inner and not _tiles(inner, a, b):
            return False
    return all(any(a <= r[0] and r[1] <= b for a, b in pieces) for r in ranges)


def inner_parts(flow: Flow, origins, span) -> tuple[int, ...] | None:
    """The finest parts of ``origins``' outputs inside ``span`` (one part: a contiguous shard), or
    None if the origins are cut differently there."""
    if span is None:
        return None
    found = set()
    for root in origins:
        points = sorted({span[0], span[1], *(p for r in flow.splits.get(root, ()) for p in r if span[0] < p < span[1])})
        found.add(tuple(b - a for a, b in zip(points, points[1:])))
    return found.pop() if len(found) == 1 else None


def packing(flow: Flow, origins, span, pieces) -> tuple[int, ...] | None:
    """The widths of the parts each rank holds a share of, in order, for a shard of ``origins``
    over ``span`` (:func:`inner_parts`), or joined from ``pieces`` (each piece's own parts, or its
    width when it is one contiguous shard); None if they cannot be told."""
    if not pieces:
        return inner_parts(flow, origins, span)
    parts = []
    for shard, width in pieces:
        if shard.head_span is not None and not shard.pieces:  # its parts in heads, the piece's units
            start, end, unit = shard.head_span
            inner = inner_parts(flow, shard.origins, (start, end))
            if inner is None or any(p % unit for p in inner):
                return None
            parts.extend(p // unit for p in inner)
        elif shard.pieces or shard.span is not None:
            inner = packing(flow, shard.origins, shard.span, shard.pieces)
            if inner is None:
                return None
            parts.extend(inner)
        else:
            parts.append(width)  # a shard that kept no span: one contiguous block per rank
    return tuple(parts)


def packed_params(flow: Flow) -> dict[str, tuple[int, ...]]:
    """Co-sharded parameters that met a shard holding several parts of a packed output (a
    depthwise conv over ``[x | B | C]``, or over a ``cat`` of q, k and v): parameter placeholder ->
    those parts' widths. Each rank holds its share of every part, so the parameter is permuted
    like the packed Linear's rows."""
    found = {}
    for param, meetings in flow.param_spans.items():
        parts = {packing(flow, origins, span, pieces) for origins, span, pieces in meetings
                 if span is not None or pieces}
        parts = {p for p in parts if p is not None and len(p) > 1}
        if parts:
            found[param] = parts.pop()
    return found


def mixed_parts(flow: Flow) -> dict[str, str]:
    """Candidates with a shard holding several parts of their packed output (each rank has its
    share of every part, not one contiguous block) that reaches an op that does not keep it whole
    or cut it at the parts (a view merging heads back, a row Linear, a parameter met with two
    packings, or per head); viewed into heads, the parts must be whole heads, and heads of several
    outputs met at one op must be cut alike."""
    g, bad = flow.g, {}
    for name, state in flow.state.items():
        for index, shard in enumerate(state if isinstance(state, tuple) else (state,)):
            if not isinstance(shard, Shard) or shard.features is None:
                continue
            parts = inner_parts(flow, shard.origins, shard.features)
            if parts is None and shard.head_span:  # heads of origins cut differently: not one layout
                for root in shard.origins:
                    bad.setdefault(root, f"its heads meet heads of {len(shard.origins) - 1} other output(s) cut "
                                         f"differently into parts, in {g.nodes[name]['module'] or 'the root'}")
                continue
            if parts is None or len(parts) < 2:
                continue
            if shard.head_span and any(p % shard.head_span[2] for p in parts):
                for root in shard.origins:  # a head would hold features of two parts
                    bad.setdefault(root, f"its packed parts {parts} are viewed into heads of {shard.head_span[2]} "
                                         f"features in {g.nodes[name]['module'] or 'the root'}, which they do not tile")
                continue
            for succ in g.successors(name):
                data = g.nodes[succ]
                if data["op"] in SINKS or (isinstance(state, tuple) and data["args"][1:2] != (index,)):
                    continue  # a metadata assert, or the getitem of another element
                out = flow.state.get(succ)
                outs = out if isinstance(out, tuple) else (out,)
                held = shard.features
                if not any(isinstance(o, Shard) and o.features and held[0] <= o.features[0] and o.features[1] <= held[1]
                           for o in outs):
                    for root in shard.origins:
                        bad.setdefault(root, f"its packed parts {parts} meet {g.nodes[succ]['op']} in "
                                             f"{g.nodes[succ]['module'] or 'the root'}, which does not keep them apart")
    bad.update({r: reason for r, reason in _mixed_pieces(flow).items() if r not in bad})
    for param, meetings in flow.param_heads.items():  # a per-head parameter sharded contiguously
        for origins, (start, end, _) in meetings:
            parts = inner_parts(flow, origins, (start, end))
            if parts is None or len(parts) > 1:
                for root in origins:
                    bad.setdefault(root, f"parameter {g.nodes[param]['param']} meets heads holding several parts of "
                                         "its output, which a contiguous shard of it would not line up with")
    for param, meetings in flow.param_spans.items():
        packings = {packing(flow, o, s, p) for o, s, p in meetings}
        unknown = any(p is not None and packing(flow, o, s, p) is None for o, s, p in meetings)
        if unknown or len({p if p and len(p) > 1 else None for p in packings}) > 1:  # one part: contiguous
            for origins, _, _ in meetings:
                for root in origins:
                    bad.setdefault(root, f"parameter {g.nodes[param]['param']} meets shards of different packings")
    return bad


def _mixed_pieces(flow: Flow) -> dict[str, str]:
    """Candidates whose shard was joined with others by a ``cat`` along the sharded dim, or folded
    into a merged dim, and then reaches an op that neither keeps that layout nor undoes it (a view
    into heads, a row Linear, a tensor sharded contiguously): each rank's block is not what it reads."""
    g, bad = flow.g, {}
    for name, state in flow.state.items():
        for index, shard in enumerate(state if isinstance(state, tuple) else (state,)):
            if not isinstance(shard, Shard) or not (shard.pieces or shard.fold):
                continue
            for succ in g.successors(name):
                data = g.nodes[succ]
                if data["op"] in SINKS or (isinstance(state, tuple) and data["args"][1:2] != (index,)):
                    continue
                out = flow.state.get(succ)
                if succ in flow.piece_cuts or (isinstance(out, Shard) and (out.pieces, out.fold) == (shard.pieces, shard.fold)):
                    continue
                if succ in flow.row_packs and not shard.pieces:  # a row taking the folded parts (packed)
                    continue
                what = "joined with others along the sharded dim" if shard.pieces else "folded into a merged dim"
                for root in shard.origins:
                    bad.setdefault(root, f"its shard, {what}, meets {data['op']} in {data['module'] or 'the root'}, "
                                         "which does not keep that layout")
    return bad


def _raw_limits(flow: Flow) -> dict[str, str]:
    """Raw-parameter Linears (:func:`raw_weight`) sharded in a way their style does not realise:
    cut into parts, giving the model output, or a product by another module's parameter."""
    g, bad = flow.g, {}
    for root in flow.roots:
        if raw_weight(g, root) and (root in flow.splits or root in flow.heads):
            bad[root] = "a raw parameter used as a Linear weight is sharded whole, not cut into parts or as the output"
        elif raw_like(g, root) and not raw_weight(g, root):
            bad[root] = "its raw weight parameter is also read elsewhere, which would read a shard as the whole"
        elif g.nodes[root].get("raw_weight") and not raw_weight(g, root):
            bad[root] = "it multiplies by a parameter of another module, which that module's style would not shard"
    for row in flow.rows:
        if (g.nodes[row].get("raw_weight") or raw_like(g, row)) and not raw_weight(g, row):
            for root in flow.rows[row]:
                bad.setdefault(root, "it is contracted by a parameter of another module, which stays whole")
    return bad


def broadcast_leaks(flow: Flow) -> dict[str, str]:
    """Candidates whose shard met a broadcast span (:meth:`Flow.broadcast_from`) whose gradient
    would not be only per-rank shares: the values computed from the span, followed until they
    meet a shard, must reach no Linear, no output and no parameter. Each rank's gradient of the
    span is then the sum of its shares at the meetings, and their all-reduce is the whole one; a
    reader outside (``b.mean()`` added to the result) would be counted tp times."""
    g, bad = flow.g, {}
    for (linear, span), start in sorted(flow.broadcast_starts.items()):
        seen, todo, meets, leaks = {start}, [start], set(), []
        while todo:
            for succ in g.successors(todo.pop()):
                data = g.nodes[succ]
                if succ in seen or data["op"] in SINKS:
                    continue
                seen.add(succ)
                if data["kind"] != "call" or is_linear(g, succ):
                    leaks.append(succ)
                elif flow.sharded(succ):  # parameters met there are their module's (param_roles)
                    meets.add(succ)
                elif any(g.nodes[p]["kind"] == "param" for p in g.predecessors(succ)):
                    leaks.append(succ)
                else:
                    todo.append(succ)
        if not leaks:
            continue
        leak = min(leaks, key=lambda n: g.nodes[n]["order"])
        at = g.nodes[leak]["module"] or "the root"
        reason = (f"its shard meets output features {span[0]}:{span[1]} of {g.nodes[linear]['module']}, broadcast "
                  f"along the sharded dim, which {g.nodes[leak]['op']} in {at} also reads: their gradient would be "
                  "partly whole, partly a per-rank partial sum")
        for meet in meets:
            for origin in flow.state[meet].origins if isinstance(flow.state[meet], Shard) else ():
                bad.setdefault(origin, reason)
    return bad


def copy_leaks(flow: Flow) -> dict[str, str]:
    """Candidates with a part held whole on every rank (:attr:`Flow.copied`) whose gradient would
    not be only per-rank shares: as for :func:`broadcast_leaks`, the values computed from the part,
    followed until they meet a shard, must reach no Linear, no output and no parameter. Each rank's
    output gradient of the part is then its heads' share, which the column's input-gradient
    reduction and the copies' summed weight gradients (:class:`~autotp.styles.GroupCopies`) add up
    to the whole; a reader outside would be counted once per rank."""
    g, bad = flow.g, {}
    for cut, parts in sorted(flow.copy_cuts.items()):
        for index, (root, span) in sorted(parts.items(), key=lambda item: item[1][1]):
            starts = [cut] if index is None else [s for s in g.successors(cut) if g.nodes[s]["op"] == "getitem"
                                                  and g.nodes[s]["args"][1:2] == (index,)]
            seen, todo, meets, leak = set(starts), list(starts), 0, None
            while todo and leak is None:
                for succ in g.successors(todo.pop()):
                    data = g.nodes[succ]
                    if succ in seen or data["op"] in SINKS:
                        continue
                    seen.add(succ)
                    if data["kind"] != "call" or is_linear(g, succ) or (not flow.sharded(succ) and any(
                            g.nodes[p]["kind"] == "param" for p in g.predecessors(succ))):
                        leak = succ
                        break
                    if flow.sharded(succ):
                        meets += 1
                    else:
                        todo.append(succ)
            if leak is not None or not meets:
                at = f"{g.nodes[leak]['op']} in {g.nodes[leak]['module'] or 'the root'}" if leak else "nothing sharded"
                bad.setdefault(root, f"its part {span[0]}:{span[1]}, held whole on every rank, is also read by {at}: "
                                     "its gradient would be partly whole, partly a per-rank share")
    return bad


def same_weight(g: nx.DiGraph, bad: dict[str, str], active: set[str]) -> dict[str, str]:
    """Candidates that multiply by the weight of a dropped one (a module called twice): one weight
    has one style, so if one call needs it whole, every call keeps it whole."""
    weights = {linear_weight(g, n) for n in bad if is_linear(g, n)} - {None}
    return {n: f"another call of {module_of(g, n)} keeps its weight whole" for n in active
            if n not in bad and linear_weight(g, n) in weights}


def packed_groups(flow: Flow) -> dict[str, str]:
    """Candidates whose shard met a grouped convolution and whose output is also cut into parts
    (before or after it): each rank's channels are then shares of several parts, which need not be
    whole groups in order. Depthwise convolutions, one group per channel, are not concerned."""
    return {r: "its output is cut into parts and also read by a grouped convolution, whose groups a "
               "per-part shard would not keep whole" for r in flow.conv_groups if flow.splits.get(r)}


def endless_shards(flow: Flow) -> dict[str, str]:
    """Candidates whose shard never reaches a row-parallel Linear or the output."""
    reached = set(flow.heads)
    for origins in flow.rows.values():
        reached |= origins
    return {r: "its output is never contracted by a Linear" for r in flow.roots - reached - set(flow.broken)}


def analyse(g: nx.DiGraph, forbidden: dict[str, str] | None = None, *, unit_heads: bool = False,
            whole: dict[str, str] | None = None, copy_parts: bool = False,
            per_group: frozenset = frozenset()) -> tuple[Flow, dict[str, str]]:
    """Run :func:`propagate` to a fixpoint, dropping candidates that break.

    Args:
        forbidden: Linear nodes that may not start a shard, with the reason (tie conflicts).
        whole: Linear nodes whose weight stays whole, as a column and as a row (weights read outside
            their module, tie conflicts); they are forbidden as columns too.
        unit_heads: when candidates were dropped, try once more reading their views as splits into
            a single head (the k/v of one-kv-head attention, whose shard then has extent 1). Kept
            only for candidates that reach an attention with more heads than that; for a tp size
            is then needed to replicate them per rank (:mod:`autotp.synth.kvheads`).
        copy_parts: when packed candidates were dropped, try holding some of their parts whole on
            every rank (:func:`copied_parts`); a tp size is needed to expand those parts.
        per_group: candidates whose views into fixed groups are read per group (:meth:`Flow.group_view`).
    Returns:
        The final :class:`Flow` and, for each dropped candidate, why it was dropped.
    """
    whole = dict(whole or {})
    forbidden = {**whole, **(forbidden or {})}
    flow, dropped = _analyse_once(g, forbidden, whole, unit_heads, copy_parts, per_group)
    pairs = low_rank_pairs(g, flow)
    if not pairs:
        return flow, dropped
    # The up-projections may shard by what they feed (heads) once their down-projections stay whole,
    # as Megatron keeps a query down-projection whole: the reading that shards more weight is kept.
    kept = {c: f"a down-projection ({_out_in(g, c)}) whose up-projection {module_of(g, r)} shards more weight "
               "as a column of its own; kept whole, as Megatron keeps a low-rank down-projection"
            for c, r in pairs.items()}
    other, other_dropped = _analyse_once(g, {**forbidden, **kept}, whole, unit_heads, copy_parts, per_group)
    if sharded_numel(g, other) > sharded_numel(g, flow):
        log.debug("low-rank down-projections kept whole: %s", sorted(module_of(g, c) for c in kept))
        return other, other_dropped
    return flow, dropped


def _analyse_once(g, forbidden, whole, unit_heads, copy_parts, per_group):
    flow, dropped = _one_head_reading(g, forbidden, whole, unit_heads, per_group)
    if copy_parts and set(dropped) - set(forbidden):
        return copied_parts(g, flow, dropped, forbidden, whole, per_group)
    return flow, dropped


def low_rank_pairs(g: nx.DiGraph, flow: Flow) -> dict[str, str]:
    """Column roots that project down (fewer output features than input ones) whose shard ends
    at row Linears that project up, each its row alone: a low-rank pair ``up(down(x))`` (a query
    compressed to a rank), its down-projection -> its (first) up-projection. Such up-projections
    could instead start shards of their own (by the heads they feed), the down-projection whole."""
    rows_of: dict[str, list[str]] = {}
    for row, origins in flow.rows.items():
        for o in origins:
            rows_of.setdefault(o, []).append(row)
    pairs = {}
    for root in sorted(flow.roots):
        rows = rows_of.get(root, [])
        if not rows or not _narrows(g, root) or not all(_widens(g, r) and flow.rows[r] == {root} for r in rows):
            continue
        pairs[root] = rows[0]
    return pairs


def _features(g: nx.DiGraph, name: str) -> tuple[int, int] | None:
    weight = weight_of(g, name)
    if weight is None or weight.out_dim is None:
        return None
    shape = g.nodes[weight.node]["shape"]
    return shape[weight.out_dim], shape[weight.in_dim]


def _narrows(g: nx.DiGraph, name: str) -> bool:
    found = _features(g, name)
    return found is not None and found[0] < found[1]


def _widens(g: nx.DiGraph, name: str) -> bool:
    found = _features(g, name)
    return found is not None and found[0] > found[1]


def _out_in(g: nx.DiGraph, name: str) -> str:
    out, inp = _features(g, name)
    return f"{inp} -> {out} features"


def sharded_numel(g: nx.DiGraph, flow: Flow) -> int:
    """The weights a reading shards: its columns' and rows', and the parameters sharded with them."""
    params = sum(math.prod(g.nodes[p]["shape"] or ()) for p in flow.param_shards)
    return _weight_numel(g, set(flow.roots) | set(flow.rows)) + params


def _one_head_reading(g: nx.DiGraph, forbidden: dict[str, str], whole: dict[str, str],
                      unit_heads: bool, per_group: frozenset) -> tuple[Flow, dict[str, str]]:
    flow, dropped = _fixpoint(g, dict(forbidden), frozenset(), whole, per_group=per_group)
    retry = frozenset(dropped) - set(forbidden)
    if not unit_heads or not retry:
        return flow, dropped
    forbidden_now = dict(forbidden or {})
    for _ in range(2):  # the second round drops extent-1 roots that feed no wider attention
        second, second_dropped = _fixpoint(g, dict(forbidden_now), retry, whole, per_group=per_group)
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


# The most finest parts of one packed output among which parts held whole are searched (each
# proper subset is one trial of the analysis).
MAX_COPY_PARTS = 4


def copied_parts(g: nx.DiGraph, flow: Flow, dropped: dict[str, str], forbidden: dict[str, str],
                 whole: dict[str, str], per_group: frozenset = frozenset()) -> tuple[Flow, dict[str, str]]:
    """Packed candidates kept whole that shard once some of their parts are held whole on every
    rank: a fused q / k / v whose k and v are one head each (multi-query attention), read by every
    query head through a broadcast, while the query part is sharded by heads.

    For each dropped candidate cut into at most :data:`MAX_COPY_PARTS` finest parts, the proper
    subsets of its parts are tried, the narrowest first, until its shard survives the analysis
    with them held whole (:func:`copy_leaks` asks that each such part meet the shard only as a
    broadcast). Returns ``(flow, dropped)`` with the choices that held, or the inputs unchanged.
    """
    trial_flow = propagate(g, {n for n in g.nodes if is_linear(g, n)} - set(forbidden))
    choices: dict[str, list[frozenset]] = {}
    for root in sorted(set(dropped) - set(forbidden), key=lambda n: g.nodes[n]["order"]):
        width = g.nodes[root]["shape"][-1]
        ranges = trial_flow.splits.get(root)
        if not ranges or g.nodes[root].get("weight_in_out") or raw_like(g, root) \
                or not _tiles(sorted(set(ranges)), 0, width):
            continue
        sizes = part_sizes(ranges, width)
        spans = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
        if not 1 < len(spans) <= MAX_COPY_PARTS:
            continue
        # Copies cost memory on every rank: only parts narrower than half the output are held whole.
        subsets = [frozenset(c) for n in range(1, len(spans)) for c in itertools.combinations(spans, n)
                   if 2 * sum(e - s for s, e in c) < width]
        if subsets:
            choices[root] = sorted(subsets, key=lambda c: (sum(e - s for s, e in c), sorted(c)))
    chosen: dict[str, frozenset] = {}
    while choices:
        trial = {**chosen, **{root: options[0] for root, options in choices.items()}}
        second, _ = _fixpoint(g, dict(forbidden), flow.unit_heads, whole, trial, per_group=per_group)
        for root in list(choices):
            first, *rest = choices.pop(root)
            if root in second.roots:
                chosen[root] = first
            elif rest:
                choices[root] = rest
    if not chosen:
        return flow, dropped
    second, second_dropped = _fixpoint(g, dict(forbidden), flow.unit_heads, whole, chosen, per_group=per_group)
    if not set(chosen) <= second.roots or len(second.roots) <= len(flow.roots):
        return flow, dropped
    log.debug("parts held whole per rank: %s", {r: sorted(s) for r, s in chosen.items()})
    return second, second_dropped


def _fixpoint(g: nx.DiGraph, dropped: dict[str, str], unit_heads: frozenset, whole: dict[str, str],
              copied: dict[str, frozenset] | None = None,
              per_group: frozenset = frozenset()) -> tuple[Flow, dict[str, str]]:
    active = {name for name in g.nodes if is_linear(g, name)} - set(dropped)
    rounds, yielded, retried = 0, {}, set()
    idiom_checks = drop_checks()
    met_whole: dict[str, str] = {}  # dropped candidate -> the op where it broke, until revived once
    scattered: set[str] = set()  # rows asked to reduce-scatter onto the heads they feed (each once)
    while True:
        rounds += 1
        flow = propagate(g, active, unit_heads, whole, copied=copied, per_group=per_group, revivable=met_whole,
                         head_scatters=frozenset(scattered))
        asked = flow.revived | (flow.scatter_requests - scattered)
        if asked:  # the round read them as sharded where they are not: try them, decide anew
            log.debug("round %d: revived %s, scattered onto the heads %s", rounds, sorted(flow.revived),
                      sorted(flow.scatter_requests - scattered))
            for r in flow.revived:
                met_whole[r] = ""
            scattered |= flow.scatter_requests
            for r in asked:
                dropped.pop(r, None)
            active |= asked
            continue
        bad = {r: f"{reason} (at {g.nodes[node]['op']} in {g.nodes[node]['module'] or 'the root'})"
               for r, (reason, node) in flow.broken.items()}
        bad.update(bad_packs(flow))
        bad.update({r: reason for r, reason in mixed_parts(flow).items() if r not in bad})
        bad.update(endless_shards(flow))
        bad.update({r: reason for r, reason in unmet_scatters(flow).items() if r not in bad})
        bad.update({r: reason for r, reason in packed_groups(flow).items() if r not in bad})
        bad.update({r: reason for r, reason in _raw_limits(flow).items() if r not in bad})
        bad.update({r: reason for r, reason in broadcast_leaks(flow).items() if r not in bad})
        bad.update({r: reason for r, reason in copy_leaks(flow).items() if r not in bad})
        for check in idiom_checks:  # what each idiom cannot carry (stages.drop_check), in their order
            bad.update({r: reason for r, reason in check(flow).items() if r not in bad})
        bad.update({r: reason for r, reason in same_weight(g, bad, active).items() if r not in bad})
        yielded.update({r: mine for r, mine in flow.yielded.items() if r in bad})
        met_whole.update({r: node for r, (_, node) in flow.broken.items()
                          if r in bad and r not in met_whole and g.nodes[node]["op"] in ELEMENTWISE | MATMULS})
        if not bad:
            # A candidate that gave way to shards which were all dropped later gave way for nothing:
            # it is tried again (once), and the rounds go on.
            back = {r for r, mine in yielded.items() if r not in retried and not (mine & flow.roots)}
            if not back:
                log.debug("analysis converged after %d rounds, %d candidates dropped", rounds, len(dropped))
                return flow, dropped
            retried |= back
            for r in back:
                dropped.pop(r, None)
            active |= back
            continue
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
