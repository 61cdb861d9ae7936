"""The per-rank shape proof: a module that shapes a column shard must do so at per-rank widths.

For every view / reshape / split / chunk / unflatten / unbind / ``new_empty`` downstream of a
sharded dim, the module run alone at per-rank widths (:mod:`autotp.synth.local_run`) must produce
the global shape with the sharded extent divided along the heads (or feature) dim, and every other
extent (head size) intact. Where it does not, the integer attributes that size those ops (of the
module, or of a plain object it holds such as its config; a fixed width in a merge-back
``reshape(b, t, self.d_model)`` included) are searched for, to be divided by tp
(:class:`~autotp.styles.ShardCounts`); where none works, the projections are kept whole with the
reason. The checker (:mod:`autotp.check`) runs the same proof on any plan.

The pipeline's pass :func:`localize` (the fixed-size cuts of :mod:`autotp.synth.localize`, then
this proof) is here too, above both.
"""

from __future__ import annotations

import itertools
import logging

import networkx as nx
from torch import nn

from autotp.synth.flow import Flow

from autotp.synth.queries import module_of

from autotp.synth.shard import Shard
from autotp.synth.carried import carried_arguments, module_arguments, with_carried
from autotp.synth.entries import with_entries
from autotp.synth.ops import FIXED_SIZE_CUTS
from autotp.synth.local_run import (argument_roles, capture_inputs, inner_roles, outputs_match, run_local,
                                    shapes_are_local, trace_local)
from autotp.synth.localize import MAX_NAMES, Localization, candidate_names, cutting_module, find_names, fixed_size_roots
from autotp.synth.localize import part_numbers, resolve_entries, width_view_of, with_rewrites, with_width_view
from autotp.synth.ops import NEW_LIKE, VIEW_LIKE
from autotp.synth.roles import Role, kind_of
from autotp.synth.stages import ShapeProblem, shape_fixes
from autotp.synth.trace import LayerGroups, collapsed

log = logging.getLogger(__name__)


# Ops that reshape or cut a sharded tensor with sizes the module's code computes: at per-rank widths
# each must give the global shape with only the sharded extent divided (the shape proof).
# A convolution's ``groups`` is such a constant too: depthwise at the global width, it must be
# the per-rank channel count at per-rank widths.
SHAPING = VIEW_LIKE | FIXED_SIZE_CUTS | NEW_LIKE | {"chunk", "unbind", "conv1d", "conv2d", "conv3d", "convolution"}

# Roles whose Linear starts a shard that the module's own code then shapes.
_SHAPED_ROOTS = frozenset({"column", "packed_column", "linear_params", "experts"})


def shaped_roots(g: nx.DiGraph, flow: Flow, roles: dict[str, Role]) -> dict[str, list[str]]:
    """Column roots whose shard is reshaped or cut (:data:`SHAPING`): the module that runs the
    Linear and every such op -> roots.

    The sizes of a view are constants in the trace; at per-rank widths they must be the per-rank
    ones, which holds only if the code derives them from the width (``view(b, s, -1, head_dim)``)
    or from attributes divided by tp. A fixed count with an inferred size (``view(b, s, n_heads,
    -1)``) runs at per-rank widths too, but into heads of half the size: only comparing the
    per-rank shapes with the global ones tells the two apart.
    """
    found: dict[str, list[str]] = {}
    for root in sorted(flow.roots, key=lambda n: g.nodes[n]["order"]):
        if kind_of(roles, module_of(g, root)) not in _SHAPED_ROOTS:
            continue
        nodes = [n for n in _carriers(g, flow, root) if g.nodes[n]["op"] in SHAPING]
        nodes += [n for n, (_, origins) in flow.factory_shards.items() if root in origins]
        if nodes:
            found.setdefault(cutting_module(g, root, nodes), []).append(root)
    return found


def _carriers(g: nx.DiGraph, flow: Flow, root: str) -> list[str]:
    """Nodes whose output (or an element of it) carries ``root``'s shard, plus the ops that read
    one and cut it (a split's state is its parts)."""
    def carries(value):
        values = value if isinstance(value, tuple) else (value,)
        return any(isinstance(v, Shard) and root in v.origins for v in values)

    return [n for n in g.nodes if carries(flow.state.get(n))]


def shaped_sizes(g: nx.DiGraph, flow: Flow, roots: list[str]) -> set[int]:
    """Global sizes of the sharded dim at every shaping op of ``roots`` (heads, widths, parts):
    the values an attribute that sizes those ops would hold."""
    values = set()
    for root in roots:
        for node in _carriers(g, flow, root):
            state, shape = flow.state.get(node), g.nodes[node]["shape"]
            if g.nodes[node]["op"] in VIEW_LIKE and isinstance(state, Shard) and shape:
                values.add(shape[state.dim])
                if state.fold:  # heads merged with the batch into rows: the head count sizes the view
                    values.add(state.fold[0][state.fold[1]])
            if isinstance(state, Shard) and state.pieces:  # a cat's pieces, cut back at fixed widths,
                values.update(width for _, width in state.pieces)  # and their sum: a depthwise conv's groups
                values.add(sum(width for _, width in state.pieces))
        values.update(end - start for start, end in set(flow.splits.get(root, ())))
        values.update(g.nodes[n]["shape"][dim] for n, (dim, origins) in flow.factory_shards.items() if root in origins)
        values.update(flow.conv_groups.get(root, ()))  # a grouped convolution's ``groups``, divided per rank
    return {v for v in values if v > 0}  # 1: a single kv head, which tp cannot divide (kvheads.py)


def localize_shapes(model: nn.Module, example_inputs, g: nx.DiGraph, flow: Flow, roles: dict[str, Role],
                    tp: int, result: Localization, groups: LayerGroups | None = None) -> None:
    """The shape proof: every module that reshapes or cuts a column shard must, run alone at
    per-rank widths, produce each global shape with only the sharded extent divided.

    A module that does so as it is (``view(..., -1, head_dim)``) needs nothing. One that does not
    (fails, or runs into heads of another size: ``view(..., self.n_heads, -1)``) gets the integer
    attributes whose division makes it do so (:func:`head_names`), or its Linears are kept whole
    with the reason. ``groups``: the layer groups of the trace (modules run on the model collapsed
    the same way).
    """
    # Modules localized by their fused cuts are proven there; roots kept whole there keep that reason.
    by_module = {m: [x for x in r if x not in result.unlocal] for m, r in shaped_roots(g, flow, roles).items()
                 if m and m not in result.counts and m not in result.rewrites}
    by_module = {m: r for m, r in by_module.items() if r}
    if not by_module:
        return
    captured = capture_inputs(model, example_inputs, set(by_module), groups, roles)
    for fqn, roots in by_module.items():
        if fqn not in captured:
            if captured.failed is not None:  # the forward stopped before it: unproven, so whole
                for root in roots:
                    result.unlocal[root] = (f"{fqn} shapes its sharded output, and the fake forward that gives its "
                                            f"per-rank shapes stopped before it ({captured.failed}); kept whole")
            continue  # never called by the forward: nothing to prove
        inner = inner_roles(roles, fqn)
        if fqn in result.widths:  # its fused cuts were proven with it: so are its shapes
            inner = with_width_view(inner, result.widths[fqn])
        inputs = with_carried(captured[fqn], carried_arguments(g, flow, fqn, captured[fqn]),
                              module_arguments(model, roles, captured[fqn]))
        if fqn in captured.real:  # it reads values (a router's sizes): run on meta, it cannot be judged
            with collapsed(model, groups):
                if run_local(model.get_submodule(fqn), inputs, inner, [], (), 1) is None:
                    inputs = with_carried(captured.real[fqn], getattr(inputs, "carried", ()),
                                          getattr(inputs, "modules", ()))
        values = shaped_sizes(g, flow, roots)
        if any(v % tp for v in values):
            continue  # tp does not divide the heads: check_divisible names the module and the sizes
        # Attributes of modules inside it that are already divided (a fused split's sizes).
        known = tuple(f"{m[len(fqn) + 1:]}.{n}" for m, names in result.counts.items()
                      if m.startswith(fqn + ".") for n in names)
        with collapsed(model, groups):
            module = model.get_submodule(fqn)
            traces: dict = {}
            verdict = shape_proof(module, inputs, inner, tp, known, traces)
            if verdict is None and traces.get("unjudged") and any(
                    root in origins for root in roots for _, origins in flow.factory_shards.values()):
                # A constant tensor taken at its per-rank size is sound only once the proof has run.
                for root in roots:
                    result.unlocal[root] = (f"{fqn} makes a constant tensor that meets the shard, and it cannot "
                                            "be run alone to prove that tensor's per-rank size; kept whole")
                continue
            if verdict is None and traces.get("unjudged") and fqn not in captured.stateful:
                _unjudged(module, fqn, roots, values, result, grouped_experts=any(
                    getattr(roles.get(module_of(g, root)), "kind", None) == "experts" for root in roots))
                continue
            if verdict is None:
                continue  # already per-rank
            candidates = candidate_names(module, {v for v in values if v > 1})
            names = head_names(module, inputs, inner, candidates, tp, verdict, known, traces)
            view = width_view_of(g, roles, fqn, inputs) if not names and fqn not in result.widths else None
            if view is not None:  # sizes read from an input (``C = x.size(-1)``): the last resort
                widened = with_width_view(inner, view)
                names = head_names(module, inputs, widened, candidates, tp, verdict, known, {})
                if names is not None:
                    result.widths[fqn] = view
            if names is None and fqn not in captured.stateful:  # the last resort: a rewrite of its code
                rewrites = first_fix(fqn, module, inputs, inner, tp, traces, lambda fixed: _fits(
                    module, inputs, {**fixed, **argument_roles(inputs)}, known, tp, verdict, traces))
                if rewrites:
                    result.rewrites[fqn], names = rewrites, ()
        if names:
            result.counts[fqn] = names
        elif names is None and fqn in captured.stateful:
            # It reads what other layers stored in a state object (keys and values shared from an
            # earlier layer), seen here at their global sizes: not judged alone, as before the
            # state was captured; the verifier judges the numbers.
            log.debug("shape proof of %s: handed a filled state object and not proven; not judged", fqn)
        elif names is None or (fqn not in result.widths and fqn not in result.rewrites):
            tried = ", ".join(candidates) or "none found"
            for root in roots:
                result.unlocal[root] = (
                    f"{fqn} reshapes its sharded output with fixed sizes (a head count, a width), and no "
                    f"integer attributes (tried: {tried}) divided by tp make its per-rank shapes the global "
                    "ones with the heads divided; kept whole")
        log.info("localize heads %s: %s", fqn, names)


def first_fix(fqn: str, module: nn.Module, inputs, roles: dict[str, Role], tp: int, traces: dict,
              proves) -> tuple:
    """The rewrite of the first registered shape fix (:func:`~autotp.synth.stages.shape_fix`) that
    ``proves(roles)`` with the rewrite on the module itself, as a 1-tuple; () if none does."""
    problem = ShapeProblem(fqn, module, inputs, roles, tp, proves,
                           traced=lambda: _global_trace(module, inputs, roles, traces))
    for fix in shape_fixes():
        rewrite = fix(problem)
        if rewrite is not None and proves(with_rewrites(roles, (rewrite,))):
            log.info("shape fix %s for %s: %s", fix.__name__, fqn or "the root", rewrite)
            return (rewrite,)
    return ()


def _unjudged(module: nn.Module, fqn: str, roots: list[str], values: set[int], result: Localization, *,
              grouped_experts: bool = False) -> None:
    """``fqn`` shapes its shard and cannot run alone on meta tensors (it reads real values from
    outside, or code meta tensors cannot run): its per-rank shapes are not proven.

    Where it holds integer attributes equal to the sizes it shapes with (a head count fixed in the
    module or in a layer module, ``Rearrange(..., h=heads)``), at per-rank widths those would cut
    the shard into heads of another size and run silently wrong, or crash: its projections are kept
    whole (the DTensor-region pass may still run it sharded on DTensors). Without such attributes
    its sizes come from the widths it is handed (``view(b, t, -1, head_dim)``): the shards are kept,
    with a warning, for the verifier to judge. So are grouped experts' 3-D parameters
    (``grouped_experts``): their attributes size the FFN dim each expert's matmul reads whole, not
    heads, and their kernels (``torch._grouped_mm``: bf16 only on meta) often cannot run on meta.
    """
    candidates = candidate_names(module, {v for v in values if v > 1})
    if candidates and not grouped_experts:
        for root in roots:
            result.unlocal[root] = (f"{fqn} shapes its sharded output, holds attributes that may size it "
                                    f"({', '.join(candidates)}), and does not run alone on meta tensors to prove its "
                                    "per-rank shapes; kept whole")
        log.warning("shape proof: %s does not run alone on meta tensors, so its per-rank shapes (sized by "
                    "%s) are not proven; its projections are kept whole", fqn, ", ".join(candidates))
        return
    log.warning("shape proof: %s shapes its sharded output and does not run alone on meta tensors; its per-rank "
                "shapes are not proven: verify the plan (synthesize(verify=True) or autotp.verify)", fqn)


def shape_proof(module: nn.Module, inputs, roles: dict[str, Role], tp: int, names: tuple[str, ...] = (),
                traces: dict | None = None):
    """None if ``module``, with ``names`` divided by tp, runs right at per-rank widths; else the
    main output shape a fix must keep.

    Runs right: alone at per-rank widths, it keeps its outputs' global shapes and every
    intermediate shape is the global one with the sharded dim divided by tp (head size intact).
    A module that cannot run alone at global widths cannot be judged here: None, logged.
    Modules handed to it as arguments run at per-rank shapes with it (their roles included).
    """
    roles = {**roles, **argument_roles(inputs)}
    reference = run_local(module, inputs, roles, [], (), 1)
    if reference is None:
        log.debug("shape proof of %s: it does not run alone on meta; not judged", type(module).__name__)
        if traces is not None:
            traces["unjudged"] = True
        return None
    local = run_local(module, inputs, roles, [], names, tp)
    if local is not None and outputs_match(local[0], reference[0], tp):
        # An output still sharded (the module cuts a fused output and returns the product of the
        # parts, ``a * gelu(b)``, to a row outside it) is one dim divided: every shape, that one
        # included, is then held to the propagated layout below.
        traced = _global_trace(module, inputs, roles, {} if traces is None else traces)
        if traced is None:
            return None  # cannot be re-traced alone: the run at per-rank widths is all we know
        per_rank = trace_local(module, inputs, roles, names, tp)
        if per_rank is not None and shapes_are_local(traced, per_rank, roles, tp):
            return None
    return _main(reference[0])


def _global_trace(module: nn.Module, inputs, roles: dict[str, Role], traces: dict):
    """The global trace of ``module``, exported once per ``traces`` (the proof and the search that
    follows it compare with the same one; an export is the costly step of both)."""
    if "global" not in traces:
        traces["global"] = trace_local(module, inputs, roles, (), 1)
    return traces["global"]


def _main(shapes):
    """The shape of a module's main output: the first of a tuple (attention weights may follow)."""
    return shapes[0] if isinstance(shapes, tuple) and shapes and isinstance(shapes[0], tuple) else shapes


def runs_into_other_shapes(module: nn.Module, inputs, roles: dict[str, Role], tp: int,
                           names: tuple[str, ...] = (), traces: dict | None = None) -> bool:
    """Whether ``module`` (``names`` divided by tp) runs at per-rank widths without an error and
    with its global output shapes, yet some intermediate shape is not the global one with the
    sharded dim divided: the silent case (``view(b, t, n_heads, -1)`` into heads of half the size).
    A run that fails is loud at apply time and not reported here. ``traces``: shared with the
    :func:`shape_proof` and :func:`head_names` that follow on the same module, so its global trace
    is exported once (the checker once exported it up to three times)."""
    roles = {**roles, **argument_roles(inputs)}
    reference = run_local(module, inputs, roles, [], (), 1)
    local = run_local(module, inputs, roles, [], names, tp) if reference is not None else None
    if local is None or not outputs_match(local[0], reference[0], tp):
        return False
    traced = _global_trace(module, inputs, roles, {} if traces is None else traces)
    per_rank = trace_local(module, inputs, roles, names, tp)
    return traced is not None and per_rank is not None and not shapes_are_local(traced, per_rank, roles, tp)


def head_names(module: nn.Module, inputs, roles: dict[str, Role], candidates: list[str], tp: int,
               main: tuple, known: tuple[str, ...] = (), traces: dict | None = None) -> tuple[str, ...] | None:
    """The smallest set of ``candidates`` with which ``module`` runs at per-rank widths, keeps its
    main output's global shape, and has every intermediate shape the per-rank one; or None."""
    roles = {**roles, **argument_roles(inputs)}
    traces = {} if traces is None else traces
    # With no names the module was judged already; with an input seen at per-rank width, not yet.
    first = 0 if "" in roles and roles[""].width_view else 1
    for count in range(first, min(MAX_NAMES, len(candidates)) + 1):
        for names in itertools.combinations(candidates, count):
            if _fits(module, inputs, roles, known + names, tp, main, traces):
                return names
    return None


def _fits(module: nn.Module, inputs, roles: dict[str, Role], names: tuple[str, ...], tp: int, main: tuple,
          traces: dict) -> bool:
    """Whether ``module`` with ``names`` divided by tp runs at per-rank widths, keeps its main
    output's global shape ``main``, and has every intermediate shape the per-rank one."""
    result = run_local(module, inputs, roles, [], names, tp)
    if result is None or not outputs_match(_main(result[0]), main, tp):
        return False
    traced = _global_trace(module, inputs, roles, traces)
    local = trace_local(module, inputs, roles, names, tp)
    return traced is not None and local is not None and shapes_are_local(traced, local, roles, tp)


def localize(model: nn.Module, example_inputs, g: nx.DiGraph, flow: Flow, roles: dict[str, Role],
             tp: int, groups: LayerGroups | None = None) -> Localization:
    """For every fused Linear cut with fixed sizes: the attributes to divide, or why it cannot be.

    Args:
        model: the model that was traced (its traced FQNs are those of ``roles``).
        example_inputs: as given to ``synthesize``.
        g, flow, roles: the converged analysis.
        tp: the tp size to check the cuts at (any size that divides the parts behaves alike).
        groups: the layer groups of the trace: modules are run on the model collapsed the same way.
    Returns:
        A :class:`Localization`.
    """
    result = Localization()
    # Values made outside a module that meet its heads: placed among its call's arguments, and
    # sliced there in the per-rank runs below as the plan will slice them.
    result.entries, unplaced = resolve_entries(model, example_inputs, g, flow, groups)
    result.unlocal.update(unplaced)
    roles = with_entries(roles, result.entries)
    by_module: dict[str, list[str]] = {}
    for root, nodes in fixed_size_roots(g, flow).items():
        by_module.setdefault(cutting_module(g, root, nodes), []).append(root)
    captured = capture_inputs(model, example_inputs, {m for m in by_module if m}, groups, roles) if by_module else {}
    for fqn, roots in by_module.items():
        prefix = fqn + "." if fqn else ""
        inner = inner_roles(roles, fqn)
        fused = {module_of(g, r)[len(prefix):]: roles[module_of(g, r)].sizes for r in roots}
        values = set().union(*(part_numbers(g, flow, r) for r in roots))
        with collapsed(model, groups):
            module = model.get_submodule(fqn)
            candidates = candidate_names(module, values)
            names = None
            if fqn in captured:
                names = find_names(module, captured[fqn], inner, fused, candidates, tp)
                view = width_view_of(g, roles, fqn, captured[fqn]) if names is None else None
                if view is not None:
                    names = find_names(module, captured[fqn], with_width_view(inner, view), fused, candidates, tp)
                    if names is not None:
                        result.widths[fqn] = view
                if names is None:  # the last resort: a rewrite of its code that cuts per rank
                    inputs = captured[fqn]
                    rewrites = first_fix(fqn, module, inputs, inner, tp, {},
                                         lambda fixed: find_names(module, inputs, fixed, fused, [], tp) == ())
                    if rewrites:
                        result.rewrites[fqn], names = rewrites, ()
        if names is None:
            tried = ", ".join(candidates) or "none found"
            for root in roots:
                # A part split into fewer heads or groups than ranks (Mamba2's B/C with one group)
                # has no per-rank cut: say so rather than blame the attributes.
                narrow = flow.extent.get(root, 0) % tp and f"; its shard reaches a dim of only " \
                    f"{flow.extent[root]} (heads or groups), which tp={tp} does not divide"
                result.unlocal[root] = (
                    f"its output is cut with fixed sizes {sorted(set(flow.splits[root]))} in "
                    f"{fqn or 'the root'}, and no integer attributes there (tried: {tried}) divided by tp "
                    f"make the cuts per-rank (sizes from x.size() or constants?){narrow or ''}; kept whole")
        elif names:
            result.counts[fqn] = names
        log.info("localize %s: %s", fqn, names)
    localize_shapes(model, example_inputs, g, flow, roles, tp, result, groups)
    return result
