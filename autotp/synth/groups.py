"""Parts of a packed projection with fewer groups than tp: each rank holds a copy of its group.

A packed column Linear's part may be split into ``G`` groups that are broadcast to the heads
(Mamba2's B and C with ``n_groups`` groups, ``repeat_interleave(heads // G)``; the k / v part of a
fused qkv with one kv head). With ``tp % G == 0`` and ``G < tp`` a contiguous split would cut a
group in pieces: rank r instead holds group ``r * G // tp``, the one its ``heads / tp`` heads read,
as :mod:`autotp.synth.kvheads` does for a separate k / v projection. On its way to the repeat a
group may pass through ops that keep each group's values its own (rope on litgpt's k). A fused
qkv viewed groups first, each group ``[q | k | v]`` (:mod:`autotp.synth.groups_first`), is one
grouped part with pieces: each rank a share of its group's query heads and its k and v whole.

That layout is the sharding of an equivalent model in which the part has ``tp`` groups, copies
of the originals: expand the part's rows of the Linear (and of every parameter packed like it,
a depthwise conv's weight) to ``tp / G`` copies of each group and set the integer attributes that
size the part (``n_groups``, ``conv_dim``) to their expanded values. This pass finds the parts
from the graph, builds that model, checks that the module cutting the parts gives the same output on
the inputs it gets in the model (the smallest set of attributes that does), and analyses it: its
parts now divide over tp, and every rule of the uniform analysis (cuts, per-rank counts, shape
proofs, sequence parallel) applies unchanged. The plan does the same expansion on the user's
model (:class:`~autotp.styles.GroupCopies`) before each module's usual style, and sums the
copies' gradients, so they stay identical: ``dL/dW = E^T dL/dE(W)`` for the expansion ``E``. A
Linear's copies are by default gathered instead (``gather=True``: its rows sharded, the expanded
output made per rank by an all-gather and a cut, the same ``E`` applied to activations).

Default-deny: a part whose expansion is not proven equivalent (no set of attributes found that
gives the same output), or whose expanded model does not shard the projection, leaves the
analysis as it was (the projection whole).

Long because finding the parts, building and proving the expanded model, and checking its
analysis are one decision: each step's refusal must leave the original analysis in place.
"""

from __future__ import annotations

import itertools
import logging
from dataclasses import replace

import networkx as nx
import torch
from torch import nn

from autotp.copying import deep_copy
from autotp.errors import AutoTPError
from autotp.logits import model_logits
from autotp.styles.group_copies import Copies, expand_module, expanded_width
from autotp.synth.propagation import propagate
from autotp.synth.queries import is_linear, module_of
from autotp.synth.shard import Shard
from autotp.synth.graph import Ref, refs
from autotp.synth.groups_first import GroupedPart, groups_first_parts
from autotp.synth.local_run import capture_inputs
from autotp.synth.localize import candidate_names, cutting_module
from autotp.synth.ops import ELEMENTWISE, PASSTHROUGH, VIEW_LIKE
from autotp.synth.queries import reading_module
from autotp.synth.trace import LayerGroups, example_args

log = logging.getLogger(__name__)

# How many attributes one expansion may set together (falcon-h1: n_groups, conv_dim and
# groups_time_state_size).
MAX_ATTRIBUTES = 4


def _group_dim(g: nx.DiGraph, view: str) -> tuple[int, int] | None:
    """``(dim, groups)`` when view ``view`` splits its input's last dim ``W`` into ``(groups, W / groups)``
    at ``dim``, keeping the dims before it."""
    data = g.nodes[view]
    source = data["args"][0]
    in_shape, out_shape = g.nodes[source.name]["shape"], data["shape"]
    if not in_shape or not out_shape or len(out_shape) != len(in_shape) + 1:
        return None
    dim = len(in_shape) - 1
    if tuple(out_shape[:dim]) != tuple(in_shape[:dim]) or out_shape[dim] * out_shape[dim + 1] != in_shape[dim]:
        return None
    return dim, out_shape[dim]


def _broadcast_to_heads(g: nx.DiGraph, name: str, dim: int) -> bool:
    """Whether ``name``'s dim ``dim`` (its groups) reaches a ``repeat_interleave`` of that dim by a
    fixed count (each group to its heads) and nothing else, through ops that keep each group's
    values its own (:func:`_per_group_dim`: casts, transposes, slices and joins of other dims,
    pointwise ops with operands broadcast over the groups, as rope is)."""
    region, todo, ends = {name: dim}, [name], 0
    while todo:
        node = todo.pop()
        readers = [s for s in g.successors(node) if g.nodes[s]["op"] not in ("_assert_tensor_metadata", "sym_size")]
        if not readers:
            return False
        for succ in readers:
            data = g.nodes[succ]
            if data["kind"] != "call":
                return False
            ndim = len(data["shape"] or ())
            if data["op"] == "repeat_interleave":
                at = data["args"][2] if len(data["args"]) > 2 else data["kwargs"].get("dim")
                if not isinstance(data["args"][1], int) or at is None or at % ndim != region[node]:
                    return False
                ends += 1
                continue
            out = _per_group_dim(g, succ, region, others=False)  # its other operands may join later
            if out is None or region.get(succ, out) != out:
                return False
            if succ not in region:
                region[succ] = out
                todo.append(succ)
    return ends > 0 and all(_per_group_dim(g, n, region) == d for n, d in region.items() if n != name)


def _per_group_dim(g: nx.DiGraph, name: str, region: dict[str, int], *, others: bool = True) -> int | None:
    """Where op ``name`` keeps the groups of its operands in ``region`` (node -> their groups dim),
    when each group's output is computed from that group alone: None if it mixes them (a view, a
    reduction, a cut of the groups) or, with ``others``, reads another tensor that varies along them."""
    data = g.nodes[name]
    op, args, ndim = data["op"], data["args"], len(data["shape"] or ())
    first = args[0] if args else None
    if op in PASSTHROUGH | {"transpose", "slice"}:
        if not isinstance(first, Ref) or first.name not in region:
            return None
        dim = region[first.name]
        if op == "transpose":
            a, b = (x % ndim for x in args[1:3])
            return b if dim == a else a if dim == b else dim
        return None if op == "slice" and (args[1] if len(args) > 1 else 0) % ndim == dim else dim
    if op == "cat":
        at = args[1] if len(args) > 1 else data["kwargs"].get("dim", 0)
        dims = {region.get(t.name) if isinstance(t, Ref) else None for t in first} - ({None} if not others else set())
        return dims.pop() if len(dims) == 1 and None not in dims and at % ndim not in dims else None
    if op not in ELEMENTWISE:
        return None
    dims = set()
    for ref in refs(args, data["kwargs"]):
        shape = g.nodes[ref.name]["shape"] or ()
        if ref.name in region:
            dims.add(region[ref.name] + ndim - len(shape))
    if len(dims) != 1:
        return None
    dim = dims.pop()
    for ref in refs(args, data["kwargs"]):
        shape = g.nodes[ref.name]["shape"] or ()
        at = dim - (ndim - len(shape))
        if others and ref.name not in region and at >= 0 and shape[at] != 1:
            return None  # a tensor varying along the groups: each group would read all of them
    return dim


def _all_candidates(g: nx.DiGraph, whole: set[str] = frozenset()):
    """The shards of every Linear but ``whole``, each followed as far as it goes."""
    return propagate(g, {n for n in g.nodes if is_linear(g, n)} - set(whole))


def grouped_parts(g: nx.DiGraph, tp: int, whole: set[str] = frozenset()) -> list[GroupedPart]:
    """Parts of packed column candidates viewed into fewer groups than ``tp`` (a divisor of it)
    that are broadcast to the heads by ``repeat_interleave`` and read nowhere else."""
    flow = _all_candidates(g, whole)
    found = set()
    for name, data in g.nodes(data=True):
        if data["kind"] != "call" or data["op"] not in VIEW_LIKE or not isinstance(data["args"][0], Ref):
            continue
        state = flow.state.get(data["args"][0].name)
        split = _group_dim(g, name)
        if not isinstance(state, Shard) or state.span is None or len(state.origins) != 1 or split is None:
            continue
        (root,), (dim, groups) = state.origins, split
        width = g.nodes[root]["shape"][-1]
        if state.dim != dim or groups >= tp or tp % groups or state.span == (0, width):
            continue
        if _broadcast_to_heads(g, name, dim):
            found.add(GroupedPart(root, *state.span, groups, cuts=(name,)))
    return sorted(found, key=lambda p: (g.nodes[p.root]["order"], p.start))


def _param_rows(g: nx.DiGraph, flow, parts: list[GroupedPart]) -> dict[str, tuple[int, tuple]]:
    """Parameter / buffer placeholder -> its rows' grouped parts, for the roots' own weight and
    bias and for every parameter sharded on dim 0 with one of their parts (a depthwise conv)
    before the view into groups: one met after it is met per head, not per group (rope's cos
    and sin multiply the head dim of a one-group part, a size-1 view that keeps its features)."""
    by_root: dict[str, list[GroupedPart]] = {}
    for part in parts:
        by_root.setdefault(part.root, []).append(part)
    found = {}
    for root, mine in by_root.items():
        width = g.nodes[root]["shape"][-1]
        spec = (0, width, tuple(p.spec() for p in mine))
        for ref in g.nodes[root]["args"][1:3]:
            if isinstance(ref, Ref) and g.nodes[ref.name]["kind"] == "param":
                found[ref.name] = spec
    for param, meetings in flow.param_spans.items():
        dim = flow.param_shards.get(param)
        for origins, span, pieces in meetings:
            if span is None or pieces or dim is None or not origins <= set(by_root):
                continue
            inside = tuple((p.start - span[0], p.end - span[0], p.groups) for p in parts
                           if p.root in origins and span[0] <= p.start and p.end <= span[1] and not p.pieces)
            if inside and _before_views(g, flow.param_uses.get(param, ()), parts):
                found[param] = (dim, span[1] - span[0], inside)
    return found


def _before_views(g: nx.DiGraph, uses, parts: list[GroupedPart]) -> bool:
    """Whether a node of ``uses`` (``(operand, node)``) comes before a view of ``parts`` into groups."""
    views = [p.cuts[0] for p in parts if p.cuts]
    return any(nx.has_path(g, node, view) for _, node in uses for view in views)


def _local_path(g: nx.DiGraph, node: str, module: str) -> str | None:
    fqn = g.nodes[node]["param"]
    return fqn[len(module) + 1:] if module and fqn.startswith(module + ".") else (fqn if not module else None)


def _attribute_values(g: nx.DiGraph, flow, parts: list[GroupedPart], tp: int) -> dict[int, int]:
    """Global numbers the grouped parts change -> their expanded values: a group count becomes
    ``tp``, and a width holding grouped parts (the part, a range cut around it) grows by their copies."""
    values = {}
    for part in parts:
        values[part.groups] = tp
    for root in {p.root for p in parts}:
        for start, end in set(flow.splits.get(root, ())) | {(p.start, p.end) for p in parts}:
            grown = sum(expanded_width(p.spec(), tp) - (p.end - p.start) for p in parts
                        if p.root == root and start <= p.start and p.end <= end)
            if grown:
                values.setdefault(end - start, end - start + grown)
    return values


def plan_copies(model: nn.Module, example_inputs, g: nx.DiGraph, parts: list[GroupedPart], tp: int,
                groups: LayerGroups, whole: set[str] = frozenset()) -> dict[str, Copies]:
    """The expansion of the grouped parts, by traced module FQN, each module that cuts parts
    proven alone (:func:`_prove`); parts whose proof fails are left out (their projection whole)."""
    flow = propagate(g, {n for n in g.nodes if is_linear(g, n)} - set(whole))
    by_module: dict[str, list[GroupedPart]] = {}
    for part in parts:
        cuts = [*flow.split_nodes.get(part.root, []), *part.cuts]
        by_module.setdefault(cutting_module(g, part.root, cuts), []).append(part)
    out: dict[str, Copies] = {}
    for fqn, mine in sorted(by_module.items()):
        found = _prove(model, example_inputs, g, flow, fqn, mine, tp, groups)
        if found is None:
            log.info("group copies: %s not proven; its parts stay whole", fqn)
            continue
        for key, spec in found.items():
            out.setdefault(key, Copies()).rows.update(spec.rows)
            out[key].values.update(spec.values)
    return out


def _prove(model, example_inputs, g, flow, fqn: str, parts: list[GroupedPart], tp: int,
           groups: LayerGroups) -> dict[str, Copies] | None:
    """The smallest set of integer attributes of ``fqn`` (and its children) for which that module,
    with its grouped parts expanded, gives the same output on the inputs it gets in the model; None
    if no set does, if what it expands lies outside it, or if a parameter would be copied along a
    dim other than 0 (:class:`~autotp.styles.GroupCopies` sums a parameter's copied rows only)."""
    copies: dict[str, Copies] = {}
    for param, spec in _param_rows(g, flow, parts).items():
        if g.nodes[param]["kind"] == "param" and spec[0] != 0:
            return None
        owner, leaf = reading_module(g, param)  # the module whose style shards it (a conv weight read by its parent)
        copies.setdefault(owner, Copies()).rows[leaf] = spec
    if fqn and not all((c + ".").startswith(fqn + ".") for c in copies):
        return None
    values = _attribute_values(g, flow, parts, tp)
    target = model.get_submodule(_first(groups, fqn)) if fqn else model
    candidates = candidate_names(target, set(values))
    if fqn and any(p.is_meta for p in target.parameters()):
        # A model on meta (a real size, planned without weights) has no values to compare: the
        # module alone is made real with random weights, on random inputs of the shapes it gets.
        target, inputs = _materialized(target), _random_like(capture_inputs(model, example_inputs, {fqn}, groups).get(fqn))
    else:
        inputs = _captured(model, target, example_inputs)
    if inputs is None or target is None:
        return None
    with torch.no_grad():
        reference = model_logits(target(*inputs[0], **inputs[1]))
    prefix = fqn + "." if fqn else ""
    trials = 0
    for count in range(min(MAX_ATTRIBUTES, len(candidates)) + 1):
        for chosen in itertools.combinations(candidates, count):
            trials += 1
            if trials > MAX_TRIALS:
                log.info("group copies: no proof within %d trials", MAX_TRIALS)
                return None
            local = {key[len(prefix):] if key != fqn else "": Copies(dict(c.rows), {}) for key, c in copies.items()}
            local.setdefault("", Copies()).values.update({name: values[_get(target, name)] for name in chosen})
            if _same_output(target, local, tp, inputs, reference):
                log.info("group copies at tp=%d in %s: attributes %s", tp, fqn, chosen)
                return {(prefix + key if key else fqn): c for key, c in local.items() if c.rows or c.values}
    return None


# How many attribute sets one proof may try (each runs the module once).
MAX_TRIALS = 400


def _captured(model: nn.Module, target: nn.Module, example_inputs):
    """The real inputs ``target`` gets in one forward of ``model`` (its first call)."""
    found = []
    handle = target.register_forward_pre_hook(lambda m, a, k: found.append((a, k)) if not found else None,
                                              with_kwargs=True)
    args, kwargs = example_args(model, example_inputs)
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception as error:  # noqa: BLE001 - cannot capture: cannot prove
        log.debug("group copies: forward failed: %s", error)
        return None
    finally:
        handle.remove()
    return found[0] if found else None


def _materialized(module: nn.Module) -> nn.Module | None:
    """A float32 CPU copy of meta ``module`` with random parameters and floating buffers (integer
    buffers zero); None if it cannot be made."""
    try:
        real = deep_copy(module).to_empty(device="cpu").float()
    except Exception as error:  # noqa: BLE001 - cannot materialise: cannot prove
        log.debug("group copies: cannot materialise %s: %s", type(module).__name__, error)
        return None
    generator = torch.Generator().manual_seed(0)
    with torch.no_grad():
        for tensor in list(real.parameters()) + list(real.buffers()):
            if tensor.is_floating_point():
                tensor.copy_(0.1 * torch.randn(tensor.shape, generator=generator))
            else:
                tensor.zero_()
    return real


def _random_like(call):
    """Real CPU inputs of the shapes of captured meta ``(args, kwargs)``: floats random, others
    zero; None if nothing was captured."""
    if call is None:
        return None
    generator = torch.Generator().manual_seed(1)

    def real(value):
        if isinstance(value, torch.Tensor):
            if value.is_floating_point():
                return torch.randn(value.shape, generator=generator)
            return torch.zeros(value.shape, dtype=value.dtype)
        if isinstance(value, (tuple, list)):
            return type(value)(real(v) for v in value)
        return value

    args, kwargs = call
    return real(tuple(args)), {k: real(v) for k, v in kwargs.items()}


def _same_output(target: nn.Module, local: dict[str, Copies], tp: int, inputs, reference) -> bool:
    try:
        trial = deep_copy(target)
        for path, spec in local.items():
            expand_module(trial.get_submodule(path), spec, tp)
        with torch.no_grad():
            output = model_logits(trial(*inputs[0], **inputs[1]))
    except Exception as error:  # noqa: BLE001 - a shape the attributes left inconsistent: not this set
        log.debug("group copies trial %s failed: %s", local, error)
        return False
    return output.shape == reference.shape and torch.allclose(output, reference, atol=1e-5, rtol=1e-4)


def _first(groups: LayerGroups, fqn: str) -> str:
    return groups.original(fqn)[0]


def _get(module: nn.Module, path: str):
    for part in path.split("."):
        module = getattr(module, part)
    return module


def expanded_model(model: nn.Module, copies: dict[str, Copies], groups: LayerGroups, tp: int) -> nn.Module:
    """A copy of ``model`` with every grouped part expanded to ``tp`` groups (by traced FQN)."""
    out = deep_copy(model)
    for fqn, spec in copies.items():
        for original in groups.original(fqn):
            expand_module(out.get_submodule(original), spec, tp)
    return out


def group_copies(analysis, run) -> object:
    """The analysis of the model with grouped parts expanded (see the module docstring), or
    ``analysis`` itself when there are none, the expansion is not proven, or it shards nothing more.

    Args:
        analysis: a :class:`~autotp.synth.stages.Analysis` made with a tp size.
        run: the pipeline without this stage (:func:`~autotp.synth.pipeline.run` with
            ``expand_groups=False``), to analyse the expanded model.
    """
    a, tp = analysis, analysis.tp_size
    if not tp or tp < 2:
        return a
    found = grouped_parts(a.graph, tp) + groups_first_parts(a.graph, tp, _all_candidates(a.graph))
    parts = [p for p in found if a.roles.get(module_of(a.graph, p.root)) is None
             or a.roles[module_of(a.graph, p.root)].kind == "replicate"]
    if not parts:
        return a
    copies = plan_copies(a.model, a.example_inputs, a.graph, parts, tp, a.groups)
    parts = [p for p in parts if module_of(a.graph, p.root) in copies]
    if not copies or not parts:
        log.info("group copies: no attributes make the expanded model equal; kept whole")
        return a
    expanded = expanded_model(a.model, copies, a.groups, tp)
    try:
        b = run(expanded, example_inputs=a.example_inputs, sequence_parallel=a.sequence_parallel, tp_size=tp)
    except AutoTPError as error:
        log.info("group copies: the expanded model cannot be sharded (%s); kept whole", error)
        return a
    roots = {module_of(a.graph, p.root) for p in parts}
    if any(b.roles.get(m) is None or b.roles[m].kind not in ("column", "packed_column") for m in roots):
        return a
    return replace(b, model=a.model, copies=copies)
