"""Column Linears that read learned mixes of their module's input: one reduction of its gradient, at entry.

A time-mixing layer computes each projection's input inside the module that owns the projections,
a token shift mixed with one learned per-channel weight per projection
(``x * mix_k + shift(x) * (1 - mix_k)``). Each column Linear then all-reduced its own input
gradient: three per layer for key, value and receptance, where the forward reduces the layer's
output once. The mixes are pointwise and linear in their incoming gradient, and every rank runs
them on the same values, so they may run their backward on the columns' partial sums as they are
(as :mod:`autotp.synth.fronts` lets whole modules between a norm and column Linears do): the
module's input gradient is then a partial sum, reduced once at its entry (an all-reduce; under
sequence parallel the entry's all-gather reduce-scatters it), and the mixes' parameter gradients
are partial sums, left ``Partial()`` as the module's other replicated parameters that meet the
shard are (``HeadParams(reduce=...)``), reduced where gradients are synchronised.

Sound only where (:func:`inner_front`): the module has one input with a gradient, and every path
from it inside the module ends in a column Linear of the module, through replicated, not in-place
ops (no Linear kept whole, nothing sharded); their other operands carry no gradient, or are
computed from the module's own parameters alone (``1 - mix``), and those parameters and values
are read by the front only. Anything else would add a whole gradient to partial ones.

Taken only where it moves fewer bytes (:func:`~autotp.synth.fronts.cheaper`'s count): one
reduction of the input against one all-reduce per distinct column input.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import networkx as nx

from autotp.synth.flow import Flow

from autotp.synth.queries import is_linear, module_of
from autotp.synth.fronts import Front, _numel, _operands
from autotp.synth.graph import made_from_params
from autotp.synth.ops import NO_VALUES, SINKS
from autotp.synth.roles import Role
from autotp.synth.sequence import module_inputs
from autotp.synth.shared import column_reader, shared_columns
from autotp.synth.stages import Analysis, post_pass

log = logging.getLogger(__name__)

# The most nodes a front may have: a few mixes per projection.
_LIMIT = 256


def inner_front(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], module: str) -> tuple[Front, set[str]] | None:
    """The front from ``module``'s one input with a gradient to its column Linears, and the module's
    parameters it reads (by name, relative); None where the backward cannot run on partial gradients
    (module docstring)."""
    inputs = [n for n in module_inputs(g, module) if made_from_params(g, n) and not _rescaled_param(g, n)]
    if len(inputs) != 1:
        return None
    start = inputs[0]
    found, todo = Front(start, {start}), [start]
    while todo:
        node = todo.pop()
        for reader in g.successors(node):
            data = g.nodes[reader]
            if data["op"] in SINKS | NO_VALUES or reader in found.nodes or node not in _operands(data):
                continue
            inside = module in data["stack"]
            if node == start and not inside:
                continue  # only the module's own reads are taken with a partial gradient
            if column_reader(g, roles, reader):
                if data["args"][0].name != node or not module_of(g, reader).startswith(module + "."):
                    return None
                found.columns.add(module_of(g, reader))
                found.reads[node] = _numel(g, node)
            elif (not inside or flow.sharded(reader) or data["kind"] != "call" or data["op"].endswith("_")
                  or is_linear(g, reader) or len(found.nodes) > _LIMIT):
                return None  # leaves the module, meets the shard, writes in place or mixes features
            else:
                found.nodes.add(reader)
                todo.append(reader)
    params = _own_operands(g, found, module)
    return None if params is None or not found.columns else (found, params)


def _rescaled_param(g: nx.DiGraph, name: str) -> bool:
    """Whether ``name`` is a parameter updated in place outside the module (a weight rescaled at
    eval time): the module reads it through its own attribute, not as an input of its call."""
    data = g.nodes[name]
    source = data["args"][0] if data["kind"] == "call" and data["op"].endswith("_") and data["args"] else None
    return getattr(source, "name", None) in g and g.nodes[source.name]["kind"] == "param"


def _own_operands(g: nx.DiGraph, found: Front, module: str) -> set[str] | None:
    """The parameters (relative names) of ``module`` that front ops read, directly or through values
    computed from them alone; None where an operand has a gradient from anything else, or such a
    parameter or value is read outside the front."""
    derived, params = set(), set()
    for name in found.nodes - {found.start}:
        for operand in _operands(g.nodes[name]):
            if operand in found.nodes or not made_from_params(g, operand):
                continue
            for source in {operand} | nx.ancestors(g, operand):
                data = g.nodes[source]
                if data["kind"] == "param":
                    if data["param"].rpartition(".")[0] != module:
                        return None  # another module's parameter
                    params.add(source)
                elif made_from_params(g, source):
                    if data["kind"] != "call" or module not in data["stack"] or source in found.nodes:
                        return None  # computed outside, or from the input
                    derived.add(source)
    reached = found.nodes | derived
    for name in params | derived:
        if any(s not in reached and g.nodes[s]["op"] not in SINKS for s in g.successors(name)):
            return None  # read whole elsewhere too: its gradient would mix whole and partial sums
    return {g.nodes[p]["param"].rpartition(".")[2] for p in params}


def _cheaper(g: nx.DiGraph, found: Front, *, sequence_parallel: bool) -> bool:
    """One reduction of the input (all-reduce: twice its size; under SP a reduce-scatter: once)
    against one all-reduce per distinct column input."""
    return _numel(g, found.start) * (1 if sequence_parallel else 2) < 2 * sum(found.reads.values())


def mixed_inputs(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], *, sequence_parallel: bool) -> dict[str, Role]:
    """Roles for each module whose column Linears read mixes of its input (module docstring).

    Args:
        g: the dataflow graph.
        flow: the converged shard propagation.
        roles: every module's role after the shared-input and front passes.
        sequence_parallel: whether the residual stream is sequence-sharded.

    Returns:
        A new roles dict: the module's ``head_params`` role (a new one under plain TP where it had
        none) with ``partial_grad_inputs``, its mixes' parameters in ``grad_reduced`` and its
        columns shared with ``partial_grad``; a ``shared_entry`` above it that shared some of the
        same columns' input is dropped (that value is a front value now).
    """
    out = dict(roles)
    changed = 0
    for module in _candidates(g, roles, sequence_parallel=sequence_parallel):
        walked = inner_front(g, flow, roles, module)
        if walked is None or not _cheaper(g, walked[0], sequence_parallel=sequence_parallel):
            continue
        branch, params = walked
        role = roles.get(module)
        if role is not None and params & {name for name, _ in role.param_dims}:
            continue
        released = _released(out, branch, module)
        if released is None:
            continue
        columns = tuple(sorted(c[len(module) + 1:] for c in branch.columns))
        reason = (f"its column Linears ({', '.join(columns)}) read values its code computes from its input with "
                  f"replicated pointwise ops and its parameters {', '.join(sorted(params))}: they hand their input "
                  "gradients back as partial sums, reduced once at entry, and those parameters' gradients are left "
                  "Partial()")
        base = role or Role("head_params", "", (module,))
        for scope, kept in released.items():
            if kept is None:
                del out[scope]
            else:
                out[scope] = kept
        changed += 1
        out[module] = replace(base, grad_reduced=tuple(sorted(set(base.grad_reduced) | params)),
                                partial_grad_inputs=True, shared_columns=columns, partial_grad=True,
                                evidence=(branch.start, *sorted(branch.columns)),
                                reason=f"{base.reason}; {reason}" if base.reason else reason)
    log.info("mixed inputs: %d modules reduce their input gradient once", changed)
    return out


def _candidates(g: nx.DiGraph, roles: dict[str, Role], *, sequence_parallel: bool) -> list[str]:
    """Modules whose style can take their input with a partial gradient: a ``head_params`` module
    (under SP, one that gathers the stream at entry), or under plain TP a module with column Linears
    and no role, in graph order."""
    columns = {module_of(g, n) for n in g.nodes if column_reader(g, roles, n)}
    owners = {c.rpartition(".")[0] for c in columns}
    found = []
    for module in sorted(owners):
        role = roles.get(module)
        if role is None:
            ok = not sequence_parallel
        else:
            ok = (role.kind == "head_params" and role.seq_input == sequence_parallel and not role.shared_columns
                  and not role.partial_grad_inputs and not role.entry_inputs and not role.width_view)
        if ok:
            found.append(module)
    return found


def _released(roles: dict[str, Role], branch: Front, module: str) -> dict[str, Role | None] | None:
    """Roles that share some of the branch's columns' input, without it: a ``shard_counts`` role
    keeps its counts, a ``shared_entry`` is dropped (None). None where one shares other columns
    too, or hands back a partial gradient already."""
    out = {}
    for scope, role in roles.items():
        names = {f"{scope}.{c}" for c in shared_columns(role)}
        if not names & branch.columns:
            continue
        if not names <= branch.columns or role.partial_grad or scope == module:
            return None
        if role.kind not in ("shard_counts", "shared_entry"):
            return None
        out[scope] = replace(role, shared_columns=()) if role.kind == "shard_counts" else None
    return out


@post_pass(order=90)
def mixed_column_inputs(a: Analysis) -> Analysis:
    """Modules whose column Linears read learned mixes of their input (a token shift) run the mixes'
    backward on the columns' partial gradients, reduced once at entry."""
    return replace(a, roles=mixed_inputs(a.graph, a.flow, a.roles, sequence_parallel=a.sequence_parallel))
