"""A norm's output read by column projections of several kinds and by routers: its gradient reduced once.

Routed attention computes its queries with experts columns (``ExpertsParallel(side="columns")``) on
the tokens picked from the normed input (``x[token]``), its keys and values with a column Linear on
the same input, and routes with a Linear kept whole. The routed pick is no op a ``Replicate()``
DTensor can run (``index`` with a plain index tensor), so the norm cannot hand the block a DTensor
(:func:`~autotp.synth.shared.expert_inputs`): each column would all-reduce its own input gradient.

Every reader's input gradient can be made this rank's share of the whole instead, and the norm's
backward all-reduces their sum once (``Boundary(output_grad="partial")``; under sequence
parallel its all-gather reduce-scatters it, ``Boundary(outputs="gather", output_grad="partial")``):

- a column Linear hands back its ``Partial()`` input gradient unreduced (``Boundary(inputs="replicate", input_grad="partial")``);
- experts columns do the same with their plain inputs (``ExpertsParallel(partial_grad_plain=True)``);
- a module kept whole gets a full gradient at its outputs: it runs its backward on that gradient
  divided by tp (``PartialGradRouter(partial_grad_plain=True)``: its input gradient a share of the
  whole, its weight gradients ``Partial()``). That holds only where no output of it reaches one of
  the readers above (whose gradients are partial), and where it reads nothing else that carries a
  gradient (that one would get a share only).

The paths from the norm to those readers may pass reshapes, casts and scalings by values without a
gradient, and row picks (``x[index]``, whose index carries none): each is linear in the value, so a
share of the gradient stays a share. Anything else on a path keeps the plain plan.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import networkx as nx

from autotp.synth.queries import module_of
from autotp.synth.graph import Ref, made_from_params, param_modules, refs
from autotp.synth.ops import NO_VALUES, RESHAPES, SELECTIONS, SELECTIONS_WITH_VALUES, SINKS
from autotp.synth.roles import Role, kind_of
from autotp.synth.sequence import module_inputs, module_outputs
from autotp.synth.shared import (_CARRY, _reads_other_state, column_reader, data_index, has_sharded, plain_producer,
                                 shared_input_roles)
from autotp.synth.stages import Analysis, post_pass

log = logging.getLogger(__name__)

# Row picks: linear in the picked tensor (argument 0); their index arguments carry no gradient.
_PICKS = frozenset({"index", "index_select"})
# Most nodes a walk from one norm visits before it gives up (a whole block behind the norm).
_LIMIT = 96


def partial_input_roles(g: nx.DiGraph, roles: dict[str, Role], *, sequence_parallel: bool) -> dict[str, Role]:
    """Norms whose output's readers all hand back shares of its gradient (module docstring).

    Only where the walk meets experts columns: column Linears and modules kept whole without them
    are :func:`~autotp.synth.shared.shared_inputs`' (one DTensor, no wrapper per reader).

    Returns:
        New roles: the norm (``partial_grad``), its column Linears and experts columns
        (``partial_grad``), the modules kept whole (``router`` with ``partial_grad``).
    """
    param_owners = param_modules(g)
    found: dict[str, Role] = {}
    for norm in sorted({d["stack"][-1] for _, d in g.nodes(data=True) if d["stack"]}):
        role = roles.get(norm)
        if sequence_parallel:
            if role is None or role.kind != "seq_norm_gather" or role.seq_output or role.dtensor_output \
                    or role.partial_grad:
                continue
        elif not plain_producer(g, roles, norm, param_owners):
            continue
        outputs, _ = module_outputs(g, norm)
        readers = _readers(g, roles, outputs[0], norm) if len(outputs) == 1 else None
        if readers is None or not readers[1]:
            continue
        columns, experts, wholes = readers
        if any(m in found for m in (*columns, *experts, *wholes)):
            continue  # another norm's readers too
        what = ", ".join(sorted({*columns, *experts, *wholes}))
        note = f"reads {norm}'s output, whose gradient it hands back as this rank's share, all-reduced once there"
        for module in columns | experts:
            found[module] = replace(roles[module], partial_grad=True, reason=f"{roles[module].reason}; {note}")
        for module in wholes:
            kept = roles[module].reason if module in roles else "kept whole"
            found[module] = Role("router", f"{kept}; {note}: runs its backward on its outputs' gradients divided "
                                 "by tp (weight gradient left Partial())", (norm, module), partial_grad=True)
        if sequence_parallel:
            found[norm] = replace(role, partial_grad=True, reason=f"{role.reason}; its readers ({what}) hand back "
                                  "shares of its gradient: the all-gather's backward reduce-scatters their sum")
        else:
            found[norm] = Role("shared_input", f"its output is read by {what}, each handing back its share of "
                               "the gradient: a plain output whose gradient is all-reduced once", (norm,),
                               partial_grad=True)
    return found


def _readers(g: nx.DiGraph, roles: dict[str, Role], start: str,
             norm: str) -> tuple[set[str], set[str], set[str]] | None:
    """``(column Linears, experts columns, modules kept whole)`` every path from ``start`` ends in, or
    None where a path ends elsewhere (module docstring)."""
    columns, experts, wholes, todo, seen = set(), set(), set(), [start], {start}
    while todo:
        node = todo.pop()
        for reader in g.successors(node):
            data = g.nodes[reader]
            if reader in seen or data["op"] in SINKS | NO_VALUES:
                continue  # a new tensor shaped like the value (zeros_like) reads none of its values
            seen.add(reader)
            if len(seen) > _LIMIT:
                return None
            if column_reader(g, roles, reader):
                columns.add(module_of(g, reader))
                continue
            taker = _taker(g, roles, node, reader)
            if taker is False:
                return None
            if taker is not None:
                (experts if kind_of(roles, taker) == "experts" else wholes).add(taker)
                continue
            if data["kind"] != "call" or data["op"] not in _CARRY | RESHAPES | _PICKS:
                log.debug("partial inputs: %s reaches %s (%s)", norm, reader, data["op"])
                return None
            if data["op"] in _PICKS:
                first = data["args"][0] if data["args"] else None
                if not isinstance(first, Ref) or first.name != node:
                    return None  # the value is the index: it gets no gradient to share
            elif any(made_from_params(g, r.name) for r in refs(data["args"], data["kwargs"])
                     if r.name != node and g.nodes[r.name]["shape"]):
                return None  # another operand with a gradient of its own would get a share only
            todo.append(reader)
    if not _closed(g, roles, seen, experts, wholes):
        return None
    return columns, experts, wholes


def _taker(g: nx.DiGraph, roles: dict[str, Role], node: str, reader: str) -> str | None | bool:
    """The module that takes ``node``'s value as its input at ``reader``: experts columns, or a module
    kept whole (no sharded child); None where ``reader`` runs in the code around them (modules whose
    role divides counts only or gathers sequence-sharded DTensors at entry, blocks holding sharded
    children); False for any other module."""
    source = set(g.nodes[node]["stack"])
    for module in g.nodes[reader]["stack"]:
        if module in source:
            continue
        role = roles.get(module)
        if role is not None and role.kind == "experts":
            return module if role.experts_side == "columns" and not role.partial_grad_inputs \
                and not role.seq_output and not role.partial_grad else False
        if role is not None and role.kind == "shard_counts" and _counts_only(role):
            continue
        if role is not None and role.kind == "seq_gather" and not role.shared_columns:
            continue  # gathers sequence-sharded DTensors at entry; the norm's plain value passes as it is
        if role is None and has_sharded(roles, module):
            continue  # a block (the MoE layer): its code runs on the value, its children take it
        if (role is None or role.kind == "replicate") and not has_sharded(roles, module) and not _role_io(role):
            return module
        return False
    return None


def _role_io(role: Role | None) -> bool:
    """Whether a ``replicate`` role changes its module's inputs or outputs (a sequence edge)."""
    return role is not None and bool(role.seq_input or role.seq_output or role.seq_join)


def _counts_only(role: Role) -> bool:
    """Whether a ``shard_counts`` role only divides attributes (no wrapper of its inputs)."""
    return not (role.shared_columns or role.width_view or role.statistics or role.entry_inputs or role.partial_grad)


def _closed(g: nx.DiGraph, roles: dict[str, Role], seen: set[str], experts: set[str], wholes: set[str]) -> bool:
    """Whether the experts and the modules kept whole read nothing with a gradient but the walk's
    values, and no output of a module kept whole reaches the walk or the experts as more than an
    index (its gradient would be a share, not the whole it divides by tp)."""
    for module in experts | wholes:
        if any(g.nodes[i]["shape"] and made_from_params(g, i) for i in module_inputs(g, module) - seen):
            return False
    for module in wholes:
        if _reads_other_state(g, roles, module):
            return False
        reached = _value_reach(g, module_outputs(g, module)[0])
        if reached & seen or any(experts & set(g.nodes[n]["stack"]) for n in reached):
            return False
    return True


def _value_reach(g: nx.DiGraph, starts: list[str]) -> set[str]:
    """Nodes that ``starts``' values reach as values: not through Python numbers (``item``: sizes),
    the indices of a top-k or sort, an argsort, or the index argument of a row pick (none of which
    carries a gradient back)."""
    reached, todo = set(), [s for s in starts if g.nodes[s]["shape"] is not None]
    while todo:
        node = todo.pop()
        for reader in g.successors(node):
            data = g.nodes[reader]
            if reader in reached or data["op"] in SELECTIONS or data["shape"] is None:
                continue
            if data["op"] in _PICKS and not (isinstance(data["args"][0], Ref) and data["args"][0].name == node):
                continue
            if data["op"] == "getitem" and g.nodes[node]["op"] in SELECTIONS_WITH_VALUES and data_index(g, reader) == 1:
                continue
            reached.add(reader)
            todo.append(reader)
    return reached


@post_pass(order=60)
def shared_inputs(a: Analysis) -> Analysis:
    """Inputs shared by several column projections (and parallel blocks) are reduced once; where
    experts columns or routers read them too, each reader hands back its share of the gradient."""
    roles = shared_input_roles(a.graph, a.flow, a.roles, sequence_parallel=a.sequence_parallel, groups=a.groups)
    return replace(a, roles={**roles, **partial_input_roles(a.graph, roles, sequence_parallel=a.sequence_parallel)})
