"""A branch's whole front runs its backward on partial gradients, reduced once at the branch input.

Multi-head latent attention reads its block input through Linears kept whole: low-rank
down-projections, a norm on each latent, and a rope key cut from one of them and expanded to every
head. Only the up-projections (columns) and the attention after them are sharded. In backward each
column's input gradient is a per-rank partial sum, and so is the rope key's (each rank holds some
of the heads it was expanded to): the plan reduced each of them apart, the latents' widths summed
(``q_rank + kv_rank + rope``). Where that is wider than the block input, it is more than the
forward's one reduction of the branch output.

A backward is linear in its incoming gradient, and every rank runs the front forward on the same
values, so the front may run its backward on the partial sums as they are: its input gradient is
then a partial sum too, reduced once where the branch input was made (the norm: all-reduce under
plain TP, the all-gather's reduce-scatter under SP), and its parameters' gradients are partial sums,
left ``Partial()`` (:class:`~autotp.styles.ReplicatedWithGradAllReduce`) and reduced where gradients
are synchronised, as a sequence-parallel norm's are. Megatron-LM's MLA under SP defers its
down-projections' gradients the same way.

Under SP the branch input may also be the input of a module kept whole that all-gathers the
sequence-sharded stream at its own entry (a head's dense Linear, activation and norm before a tied
output projection, with no norm before it to gather): the module takes the gathered value with a
partial gradient, reduce-scattered at its entry (:class:`~autotp.styles.HeadParams` with
``partial_grad_inputs``), its own parameters' gradients left ``Partial()``. Where no module above
the columns can share their input (a head Linear at the model's root), each column takes its own
with a partial gradient (:class:`~autotp.styles.Boundary` with ``input_grad="partial"``): with nothing reduced there,
sharing it would save nothing.

A front may also start at a module's inputs (:func:`_input_fronts`, plain TP): a block that
normalises the concatenation of the stream and a value made once at the model's root (Zamba's
shared transformer) reduces each input at its entry (``Boundary(inputs="reduce_grad")``)
rather than the norm's output, twice the stream's width. Only where the root value is read by a
layer that stands for several: every layer adds its partial gradient into that value's one
reduction per step, the stream is reduced at its own width. Or where the root value is a copy of
a value that another module takes at its entry with a front of its own (:func:`_folds`: Zamba's
first layer normalises the embeddings themselves before its mixer's columns, and the shared block
reads a ``clone()`` of them): that module reduces at its input, not its norm's output (the same
width), and one all-reduce takes both partial gradients, so the block's copy costs nothing.

Sound only where (:func:`front`): every path from the branch input ends in a column Linear, or in a
broadcast span of a Linear of the front whose gradient the analysis would have all-reduced
(:meth:`~autotp.synth.flow.Flow.broadcast_from`); every op on the way is replicated and
in place of nothing, and its other operands are front values, parameters of modules wholly inside
the front, or values without a gradient (rope tables, masks). Anything else would add a whole
gradient to partial ones.

Taken only where it moves fewer bytes per token (:func:`cheaper`): one reduction of the branch
input against one all-reduce per column input and rope span (an all-reduce counts twice its
input, as a reduce-scatter's input counts once). At real widths (a 7168-wide input, latents of
1536 + 512 + 64) the latents are the cheaper cut and the plan keeps them.
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field, replace

import networkx as nx

from autotp.synth.flow import Flow

from autotp.synth.queries import is_linear, module_of
from autotp.synth.graph import common_module, made_from_params, param_modules
from autotp.synth.ops import FIRST_VALUE_ONLY, PASSTHROUGH, SINKS
from autotp.synth.params import value_refs
from autotp.synth.roles import Role, kind_of
from autotp.synth.shared import column_reader, plain_producer, shared_columns, shared_entry, sharing_scope
from autotp.synth.sequence import module_inputs, module_outputs
from autotp.synth.stages import Analysis, post_pass

log = logging.getLogger(__name__)

# Roles of modules kept whole that a front may hold: their styles are replaced by the front's.
_WHOLE = frozenset({"replicate", "broadcast_source", "shared_input", "whole_module"})
# Roles of modules around front ops that only change attributes, never values or layouts.
_PASSIVE = frozenset({"shard_counts", "kv_head_counts"})
# Roles that only lay out a module's own parameters: a module whose parameters the front does not
# read (a gate module holding a low-rank Linear of the front) may run front nodes.
_OWN_PARAMS = frozenset({"head_params"})
# The most nodes a front may have: an attention's low-rank side is a few dozen per layer.
_LIMIT = 512


@dataclass
class Front:
    """The replicated computation between a branch input and the sharded values it feeds.

    Attributes:
        start: the branch input (the norm's output node).
        nodes: the front's nodes, ``start`` included.
        columns: the column Linear modules that read front values.
        reads: each front value a column reads -> its elements (one reduction each today).
        spans: each broadcast span start in the front -> its elements (one all-reduce each today).
        owners: the modules whose parameters front nodes read.
        modules: every module that runs front nodes (owners, and modules without parameters).
    """

    start: str
    nodes: set[str]
    columns: set[str] = field(default_factory=set)
    reads: dict[str, int] = field(default_factory=dict)
    spans: dict[str, int] = field(default_factory=dict)
    owners: set[str] = field(default_factory=set)
    modules: set[str] = field(default_factory=set)
    starts: tuple[str, ...] = ()


def _numel(g: nx.DiGraph, name: str) -> int:
    return math.prod(g.nodes[name]["shape"] or (0,))


def _operands(data) -> list[str]:
    """The inputs whose values (and so gradients) an op reads: not those lending a shape or dtype."""
    found = value_refs(data)
    return [found[0].name] if data["op"] in FIRST_VALUE_ONLY and found else [r.name for r in found]


def _column(g: nx.DiGraph, roles: dict, reader: str) -> bool:
    """Whether ``reader`` is a column Linear that wraps its plain input itself: a column, or the
    head (vocab-sharded logits) where it does not gather the stream."""
    if column_reader(g, roles, reader):
        return True
    role = roles.get(module_of(g, reader)) if g.nodes[reader]["kind"] == "call" else None
    return role is not None and role.kind == "head" and not role.seq_input and is_linear(g, reader)


def _walk(g: nx.DiGraph, flow: Flow, roles: dict, starts: tuple[str, ...],
          within: str | None = None) -> tuple[Front, list[str]] | None:
    """Every node reached from ``starts`` before a column Linear or a sharded op; with the front
    values that sharded ops read. None where a path meets anything else. With ``within`` (the
    module that gathers the start at its entry, or whose inputs the starts are) only that module's
    reads of the starts are followed: the others read the sequence-sharded value, or the value as
    it was before the module took it."""
    front, meets, todo = Front(starts[0], set(starts), starts=starts), [], list(starts)
    while todo:
        node = todo.pop()
        for reader in g.successors(node):
            data = g.nodes[reader]
            if data["op"] in SINKS or reader in front.nodes:
                continue
            if (within is not None and within not in data["stack"]
                    and (node in starts or _alias_of(g, node, starts))):
                continue  # read outside ``within``, as it was before (a cast returning its input: the input)
            if _column(g, roles, reader):
                if data["args"][0].name != node:
                    return None  # read as a weight, not as the input
                front.columns.add(module_of(g, reader))
                front.reads[node] = _numel(g, node)
            elif flow.sharded(reader):
                meets.append(node)
            elif data["kind"] != "call" or data["op"].endswith("_") or len(front.nodes) > _LIMIT:
                return None  # an output, an in-place write, or no front of an attention's size
            else:
                front.nodes.add(reader)
                todo.append(reader)
    return front, meets


def _alias_of(g: nx.DiGraph, node: str, starts: tuple[str, ...]) -> bool:
    """Whether ``node`` is only a cast of a start (``x.to(float32)`` on a float32 ``x`` returns ``x``
    itself, so code outside the module reading the start shows in the graph as reading the cast)."""
    while g.nodes[node]["op"] in PASSTHROUGH:
        found = value_refs(g.nodes[node])
        if not found:
            return False
        node = found[0].name
        if node in starts:
            return True
    return False


def front(g: nx.DiGraph, flow: Flow, roles: dict, start: str, gather: str | None = None, *,
          inputs_of: str | None = None, within: str | None = None) -> Front | None:
    """The front that ``start`` feeds, if its backward can run on partial gradients (see the module
    docstring); None otherwise. ``gather``: the module kept whole that gathers ``start`` at entry.
    ``inputs_of``: the front is that module's (see :func:`_input_fronts`), from every input of it
    with a gradient; ``start`` is then ignored. ``within``: only that module's reads of ``start``
    (a module taking it at entry, :func:`_folds`); the front may go on past the module."""
    starts = (start,) if inputs_of is None else tuple(sorted(
        (n for n in module_inputs(g, inputs_of) if made_from_params(g, n)), key=lambda n: g.nodes[n]["order"]))
    if not starts:
        return None
    walked = _walk(g, flow, roles, starts, within or gather or inputs_of)
    if walked is None:
        return None
    found, meets = walked
    if inputs_of is not None and any(inputs_of not in g.nodes[n]["stack"] for n in found.nodes - set(starts)):
        return None  # the front leaves the module: readers outside it would get partial gradients
    outside = (set(g.nodes[start]["stack"]) | set(_ancestors(within or "")) if inputs_of is None
               else None)
    for name in found.nodes - set(starts):
        for operand in _operands(g.nodes[name]):
            if operand in found.nodes:
                continue
            if g.nodes[operand]["kind"] == "param":
                found.owners.add(g.nodes[operand]["param"].rpartition(".")[0])
            elif made_from_params(g, operand):
                return None  # a value with a gradient of its own would get a partial one
        found.modules.update(m for m in g.nodes[name]["stack"]
                             if (m not in outside if outside is not None else m.startswith(inputs_of + ".")))
    spans = {begin: _numel(g, begin) for (source, _), begin in flow.broadcast_starts.items()
             if source in found.nodes and begin in found.nodes}
    on_spans = set(spans).union(*(nx.descendants(g, s) for s in spans)) if spans else set()
    if any(node not in on_spans for node in meets):
        return None  # a front value meets the shard other than as a broadcast span
    found.spans = {s: n for s, n in spans.items() if any(m == s or nx.has_path(g, s, m) for m in meets)}
    return found if _modules_ok(g, roles, found, gather) else None


def _modules_ok(g: nx.DiGraph, roles: dict, found: Front, gather: str | None = None) -> bool:
    """Whether the modules that run front nodes keep values whole (a container of sharded children,
    the attention module, may only change attributes), the parameters' owners run front nodes
    only, and their parameters are read by front nodes only (one shared with another reader would
    mix a whole gradient into the partial ones). ``gather`` may gather its input (the front's start).
    The model itself may own none of those parameters: no plan key names the root."""
    if "" in found.owners:
        return False
    for module in found.modules | found.owners:
        role = roles.get(module)
        kinds = _WHOLE | _PASSIVE | (_OWN_PARAMS if module not in found.owners else frozenset())
        if role is not None and (role.kind not in kinds or (role.seq_input and module != gather)
                                 or role.seq_output or role.seq_join
                                 or role.entry_inputs or role.width_view or role.partial_grad_inputs):
            return False
    for owner in found.owners | ({gather} if gather else set()):  # the gatherer's parameters are Partial() too
        inside = [n for n, d in g.nodes(data=True) if owner in d["stack"] and d["kind"] == "call"
                  and d["op"] not in SINKS]
        params = [n for n, d in g.nodes(data=True) if d["kind"] == "param" and d["param"].rpartition(".")[0] == owner]
        if any(n not in found.nodes for n in inside):
            return False
        if any(s not in found.nodes and g.nodes[s]["op"] not in SINKS for p in params for s in g.successors(p)):
            return False
    return True


def cheaper(g: nx.DiGraph, found: Front, *, sequence_parallel: bool, shares: dict[str, int] | None = None,
            folded=(), or_equal: bool = False) -> bool:
    """Whether one reduction of the branch input moves fewer bytes than today's reductions of the
    front's column inputs and rope spans (each an all-reduce: twice its input). The branch input
    is all-reduced under plain TP (twice its size) and reduce-scattered under SP (once). A start
    in ``shares`` is reduced once for that many layers: its cost per layer is divided by it; one
    in ``folded`` is reduced with another module's input, at no cost of its own. With
    ``or_equal``: whether it moves no more."""
    today = 2 * (sum(found.reads.values()) + sum(found.spans.values()))
    once = sum(_numel(g, s) / (shares or {}).get(s, 1) for s in found.starts
               if s not in folded) * (1 if sequence_parallel else 2)
    return once <= today if or_equal else once < today


def partial_fronts(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], *,
                   sequence_parallel: bool, groups=None) -> dict[str, Role | None]:
    """Roles for each branch whose whole front is cheaper to reduce at its input (module docstring).

    Args:
        g: the dataflow graph.
        flow: the converged shard propagation (its broadcast spans).
        roles: every module's role after the shared-input and partial-sum passes.
        sequence_parallel: whether the residual stream is sequence-sharded.
        groups: the collapsed layer stacks (:class:`~autotp.synth.trace.LayerGroups`): a front
            whose modules stand for different numbers of the model's modules (a norm of a traced
            layer that stands for every layer, feeding a head outside the stack) is not taken, since
            its roles would reach layers whose norm feeds no such front.

    Returns:
        New roles: the module making the branch input (plain TP a ``shared_input`` norm, SP a
        ``seq_norm_gather`` norm, with ``partial_grad``; SP a module kept whole that gathers it at
        entry, ``head_params`` with ``partial_grad_inputs``), the front's parameter owners
        (``partial_grad_module``), its other modules with a style (``replicate``), and one
        ``shared_entry`` with ``partial_grad`` whose column Linears hand their input gradients back
        unreduced (where no module above them can share it, each column's own role with
        ``partial_grad``); None for each shared entry that shared some of those columns' input
        and is dropped.
    """
    found: dict[str, Role] = {}
    inputs, inputs_why = ({}, {}) if sequence_parallel else _input_fronts(g, flow, roles, groups)
    for entry, start in [(module, None) for module in inputs] + _entries(g, roles, sequence_parallel=sequence_parallel):
        if entry in found:
            continue  # inside a front found already
        gather = entry if start is not None and kind_of(roles, entry) == "replicate" else None
        branch = inputs[entry] if start is None else front(g, flow, roles, start, gather)
        if branch is None or not branch.columns or (
                start is not None and not cheaper(g, branch, sequence_parallel=sequence_parallel)):
            continue
        if (branch.modules | branch.owners | branch.columns) & found.keys():
            continue
        if groups is not None and len({len(groups.original(m)) for m in
                                       {entry, *branch.modules, *branch.owners, *branch.columns}}) > 1:
            continue  # the entry's role would reach copies of it that feed no such front
        scope, released = _scope(g, roles, branch, found)
        if not scope and not _unshared({**roles, **found}, branch):
            continue
        found.update(dict.fromkeys(released))  # their columns share the front's wrapper now
        columns = tuple(sorted(m[len(scope) + 1:] if scope else m for m in branch.columns))
        made = "inputs" if start is None else "input" if gather else "output"
        reason = (f"its {made} feed{'' if start is None else 's'} modules kept whole ({', '.join(sorted(branch.owners))}) "
                  f"before column Linears ({', '.join(columns)}): their partial input gradients are reduced once here, "
                  f"fewer bytes than one all-reduce per column input and rope span")
        if start is None:
            found[entry] = Role("reduced_inputs", f"{reason}; {inputs_why[entry]}", (entry,),
                                partial_params=entry in branch.owners)
        elif gather:
            found[entry] = _gathering_entry(g, roles, entry, branch, reason)
        else:
            found[entry] = (replace(roles[entry], partial_grad=True, reason=f"{roles[entry].reason}; {reason}")
                            if sequence_parallel else Role("shared_input", reason, (entry, *sorted(branch.columns)),
                                                           partial_grad=True))
        why = (f"read{'s' if len(columns) == 1 else ''} values computed whole from {entry}'s {made}: each hands its "
               f"input gradient back as a partial sum, reduced once at {entry}")
        if scope:
            found[scope] = shared_entry({**roles, **found}, scope, columns, f"its column Linears ({', '.join(columns)}) {why}",
                                        (branch.start, *sorted(branch.columns)), partial_grad=True)
        else:  # no module above the columns to share their input: each takes its own
            for column in sorted(branch.columns):
                found[column] = replace(roles[column], partial_grad=True, reason=f"{roles[column].reason}; {why}")
        for module in sorted(branch.modules | branch.owners):
            if module == entry:
                continue
            if module in branch.owners:
                found[module] = Role("partial_grad_module", f"kept whole between {entry} and column Linears: runs "
                                     "its backward on their partial gradients, its parameters' gradients left "
                                     "Partial()", (entry, module))
            elif kind_of(roles, module) in _WHOLE:
                found[module] = Role("replicate", f"kept whole between {entry} and column Linears", (entry, module))
    log.info("partial fronts: %d branches reduce their input gradient once", sum(
        1 for r in found.values() if r is not None and shared_columns(r)))
    return found


def _input_fronts(g: nx.DiGraph, flow: Flow, roles: dict[str, Role],
                  groups=None) -> tuple[dict[str, Front], dict[str, str]]:
    """Plain TP: modules kept whole whose inputs feed a front (a norm's ``shared_input`` inside them,
    reached through replicated ops), where reducing each input once at entry moves fewer bytes than
    reducing the norm's output; with why, per module. Only pays where an input is made once at the
    model's root and read by a layer that stands for several (every layer then adds its partial
    gradient to one reduction), or where it is a copy of a value that another module takes at its
    entry with a front of its own (:func:`_folds`: both reductions are one).

    Zamba's shared transformer normalises ``concat(stream, embeddings)``: the norm's output is twice
    the stream's width; at entry the stream costs its width and the embeddings their width once per
    step, whatever the number of layers running the block, and nothing where the first layer's norm
    reads the embeddings the block reads a clone of. The innermost such module of each norm.
    """
    found: dict[str, Front] = {}
    why: dict[str, str] = {}
    for norm, role in roles.items():
        if role is None or role.kind != "shared_input" or role.partial_grad:
            continue
        for module in reversed(_ancestors(norm)):
            if roles.get(module) is not None or module in found:
                break
            branch = front(g, flow, roles, "", inputs_of=module)
            if branch is None or not branch.columns:
                continue
            shares = _shares(g, groups, module, branch.starts)
            folds = _folds(g, flow, roles, branch, module, found)
            if (shares or folds) and cheaper(g, branch, sequence_parallel=False, shares=shares, folded=folds):
                found[module] = branch  # without a shared input, a norm's own front costs no more
                why[module] = "an input made once at the root is reduced once for every layer that reads it"
                for start, (reader, fold) in folds.items():
                    found[reader], why[reader] = fold, (
                        f"it takes {start}'s source at entry, as {module} takes a copy of it: one all-reduce serves "
                        "both, the copy's share at no cost of its own")
            break
    return found, why


# Ops whose output is a copy of their one operand, the identity in forward and backward.
_COPIES = frozenset({"clone"})


def _folds(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], branch: Front, module: str,
           taken: dict[str, Front]) -> dict[str, tuple[str, Front]]:
    """For each start of ``module``'s input front that is (a copy of) a value another module takes at
    its entry with a front of its own: that module, the innermost, and its front.

    Zamba's first layer normalises the embeddings before its mixer's in-projection; its shared
    block reads a clone of them. Reduced at the norm's entry instead of its output (the same width,
    so no dearer), the first layer's partial gradient and the block's meet in one all-reduce
    (:func:`~autotp.styles.boundaries.reduced_once` steps back through clones): the block's
    embeddings half costs nothing of its own. The module must have no role but a norm's
    ``shared_input`` and take nothing of the stream through ``module``."""
    found = {}
    for start in branch.starts:
        source = start
        while g.nodes[source]["op"] in _COPIES and len(_operands(g.nodes[source])) == 1:
            source = _operands(g.nodes[source])[0]
        inside = set(g.nodes[source]["stack"])
        for reader in sorted(g.successors(source), key=lambda n: g.nodes[n]["order"]):
            stack = [m for m in g.nodes[reader]["stack"] if m not in inside]
            if not stack or module in stack or any(m.startswith(module + ".") for m in stack):
                continue
            for candidate in reversed(stack):
                role = roles.get(candidate)
                if candidate in taken or (role is not None and (role.kind != "shared_input" or role.partial_grad)):
                    break
                own = front(g, flow, roles, source, within=candidate)
                if own is not None and own.columns and cheaper(g, own, sequence_parallel=False, or_equal=True):
                    found[start] = (candidate, own)
                    break
            if start in found:
                break
    return found


def _ancestors(module: str) -> list[str]:
    """The modules containing ``module``, outermost first, the root ("") aside.

    >>> _ancestors("model.layers.1.attn.norm")
    ['model', 'model.layers', 'model.layers.1', 'model.layers.1.attn']
    """
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _shares(g: nx.DiGraph, groups, module: str, starts: tuple[str, ...]) -> dict[str, int]:
    """For each start made outside every layer stack, read by ``module`` which stands for several
    layers: how many (that input's one reduction serves them all)."""
    if groups is None or len(groups.original(module)) < 2:
        return {}
    return {s: len(groups.original(module)) for s in starts
            if g.nodes[s]["module"] is not None and len(groups.original(g.nodes[s]["module"])) == 1}


def _entries(g: nx.DiGraph, roles: dict[str, Role], *, sequence_parallel: bool) -> list[tuple[str, str]]:
    """``(module, branch input)`` for each module that could make a branch input, in graph order (an
    outer branch before the fronts inside it): a norm's one output (SP, one all-gathered to a plain
    tensor; plain TP, a replicated norm or one handing columns a DTensor already), and under SP the
    one input with a gradient of a module kept whole that gathers the stream at its entry."""
    param_owners = param_modules(g)
    found = []
    for module in param_owners:
        role = roles.get(module)
        if sequence_parallel:
            ok = (role is not None and role.kind == "seq_norm_gather" and not role.seq_output
                  and not role.dtensor_output and not role.partial_grad)
        else:
            ok = (role is not None and role.kind == "shared_input" and not role.partial_grad) or \
                 plain_producer(g, roles, module, param_owners)
        outputs = module_outputs(g, module)[0] if ok else []
        if len(outputs) == 1:
            found.append((module, outputs[0]))
    for module, role in roles.items() if sequence_parallel else ():
        if (role.kind == "replicate" and role.seq_input and not (role.seq_output or role.seq_join or role.entry_inputs
                                                                 or role.width_view or role.owned_output)):
            inputs = [n for n in module_inputs(g, module) if made_from_params(g, n)]
            if len(inputs) == 1:
                found.append((module, inputs[0]))
    return sorted(found, key=lambda pair: g.nodes[pair[1]]["order"])


def _gathering_entry(g: nx.DiGraph, roles: dict[str, Role], entry: str, branch: Front, reason: str) -> Role:
    """The role of a module kept whole that gathers the branch input at entry: it takes the gathered
    value with a partial gradient (reduce-scattered there), its own parameters' gradients left
    ``Partial()`` (:class:`~autotp.styles.HeadParams` with ``partial_grad_inputs``)."""
    own = tuple(sorted({d["param"].rpartition(".")[2] for _, d in g.nodes(data=True)
                        if d["kind"] == "param" and d["param"].rpartition(".")[0] == entry}))
    return Role("head_params", f"{roles[entry].reason}; gathers the sequence-sharded stream at entry and {reason}",
                (branch.start, entry, *sorted(branch.columns)), grad_reduced=own, partial_grad_inputs=True,
                seq_input=True)


def _unshared(roles: dict[str, Role], branch: Front) -> bool:
    """Whether no module shares any of the branch's columns' input already (each column may then take
    its own with a partial gradient)."""
    return not any(f"{module}.{c}" in branch.columns for module, role in roles.items() if role is not None
                   for c in shared_columns(role))


def _scope(g: nx.DiGraph, roles: dict[str, Role], branch: Front, found: dict[str, Role]) -> tuple[str, set[str]]:
    """The module whose pre-hooks wrap the front's columns' inputs (:func:`~autotp.synth.shared.sharing_scope`),
    and the shared entries that shared some of those columns' input (a norm output they read
    directly) and are dropped for it; empty where there is none, or a shared entry covers one of
    them with other columns, or a front found already does."""
    released = set()
    for module, role in {**roles, **found}.items():
        if role is None:
            continue
        covered = {f"{module}.{c}" for c in shared_columns(role)}
        if not covered & branch.columns:
            continue
        if module in found or role.kind != "shared_entry" or role.partial_grad or not covered <= branch.columns:
            return "", set()
        released.add(module)
    kept = {m: r for m, r in roles.items() if m not in released}
    stacks = [g.nodes[n]["stack"] for n in g.nodes if g.nodes[n]["kind"] == "call"
              and g.nodes[n]["module"] in branch.columns]
    scope = sharing_scope(common_module(stacks), stacks[0], kept, found) if stacks else ""
    if not scope or scope in branch.owners or not all(c.startswith(scope + ".") for c in branch.columns):
        return "", set()
    return scope, released - {scope}


@post_pass(order=80)
def whole_fronts(a: Analysis) -> Analysis:
    """Modules kept whole between a norm and column Linears (MLA's low-rank down-projections) run
    their backward on the columns' partial gradients, reduced once at the norm, where that moves
    fewer bytes than reducing each column input and rope span."""
    found = partial_fronts(a.graph, a.flow, a.roles, sequence_parallel=a.sequence_parallel, groups=a.groups)
    roles = {m: r for m, r in {**a.roles, **found}.items() if r is not None}
    return replace(a, roles=roles)
