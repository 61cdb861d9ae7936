"""Reduce each shared input's gradient once: column Linears that read one tensor, and parallel blocks.

Under TP every column-parallel Linear turns its replicated input into a ``Replicate()`` DTensor
itself; in backward ``x @ W_shard^T`` gives a ``Partial()`` input gradient, which each Linear
all-reduces on its own: q, k and v pay three all-reduces where the forward paid none, and gate
and up two more. If the tensor they read is already a ``Replicate()`` DTensor, autograd sums the
``Partial()`` gradients first (a sum of partial sums is a partial sum) and the one conversion back
reduces it once: one all-reduce per branch (one reduce-scatter under SP), as Megatron does.

This pass finds, from the graph:

- :func:`shared_inputs` (plain TP): modules (norms) whose output is read only by column Linears,
  or by column Linears and modules kept whole beside them (a Mamba mixer next to attention). The
  module returns a ``Replicate()`` DTensor (``Boundary(outputs="replicate")``); the whole
  modules take it local (``Boundary(inputs="whole")``).
- :func:`shared_entries` (plain TP): column Linears that read one tensor entering their module
  with no norm before them (OLMo2's q/k/v read the residual stream): the module shares one
  ``Replicate()`` DTensor of it among them (``Boundary(inputs="replicate", columns=...)``).
- :func:`dtensor_gathers` (SP): all-gathering norms and module-entry gathers whose readers are
  all column Linears keep the gathered value a DTensor, so the backward reduce-scatters once.
- :func:`expert_inputs`: an MoE block's input (a norm's output) read by the grouped experts, the
  router, column Linears (a shared expert) and modules kept whole. The norm returns a DTensor
  (plain: ``Replicate()``; SP: the all-gather kept a DTensor), the experts take it with a
  ``Partial()`` gradient, and the router runs its backward on the experts' partial gradient of
  the routing weights (:class:`~autotp.styles.PartialGradRouter`): one reduction of the block
  input's gradient per layer, and none of the routing weights'. Where no norm can return the
  DTensor (the residual reads its output too, or no norm precedes the block), the block makes it at
  entry (``Boundary(inputs="replicate", outputs="local")``; under SP its own gather keeps a DTensor).
- :func:`parallel_blocks`: two row Linears whose outputs are added before anything else reads
  them (attention and MLP side by side: GPT-J, Phi, Cohere) leave their outputs ``Partial()`` and
  the sum is reduced once per layer. Under plain TP the decoder layer then runs on a
  ``Replicate()`` DTensor stream (``Boundary(inputs="replicate", outputs="local", stream=0)``),
  with its norms' parameters replicated DTensors; not where another row's reduced, plain output returns to that
  stream (a sequential MLP after the branches): there each branch reduces its own output.

Long because the three shared-input patterns (a norm read by several columns, a module entry,
a MoE block's input) and parallel blocks share their reader tests.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import networkx as nx

from autotp.synth.flow import Flow

from autotp.synth.queries import is_linear, module_of
from autotp.synth.graph import common_module, made_from_params, param_modules, refs
from autotp.synth.ops import RESHAPES, SELECTIONS, SELECTIONS_WITH_VALUES, SINKS
from autotp.synth.ops import ELEMENTWISE, PASSTHROUGH
from autotp.synth.roles import Role, kind_of
from autotp.synth.sequence import (attention_returns, dispatch_blocks, expert_blocks, inner_rows, module_outputs, outermost,
                                   residual_region, routed_blocks)
from autotp.synth.stages import Analysis, post_pass

log = logging.getLogger(__name__)

# Linear roles whose input is replicated and whose input gradient comes back Partial().
COLUMN_KINDS = frozenset({"column", "packed_column", "kv_column"})
# Roles a module can have and still be a plain, replicated producer of the shared input.
_PLAIN_PRODUCER = frozenset({"replicate"})
# Ops between a row's output and the add that joins the branches: scaling, dropout, casts.
_CARRY = PASSTHROUGH | ELEMENTWISE | frozenset({"dropout", "native_dropout"})



def has_sharded(roles: dict[str, Role], module: str) -> bool:
    return any((m == module or m.startswith(module + ".")) and r.kind != "replicate" for m, r in roles.items())


def column_reader(g: nx.DiGraph, roles: dict[str, Role], reader: str, *, seq_input_ok: bool = False) -> bool:
    """Whether ``reader`` is a column Linear (one that gathers the stream itself only if allowed)."""
    if not (g.nodes[reader]["kind"] == "call" and is_linear(g, reader)):
        return False
    role = roles.get(module_of(g, reader))
    return role is not None and role.kind in COLUMN_KINDS and (seq_input_ok or not role.seq_input)


def _whole_reader(g: nx.DiGraph, roles: dict[str, Role], reader: str, output_stack: tuple[str, ...]) -> str | None:
    """The module kept whole that ``reader`` runs in, below where the shared value was made."""
    outer = [m for m in g.nodes[reader]["stack"] if m not in output_stack]
    if not outer:
        return None
    module = outer[0]
    role = roles.get(module)
    if (role is not None and role.kind != "replicate") or has_sharded(roles, module):
        return None
    return module


def _readers_ok(g: nx.DiGraph, roles: dict[str, Role], readers: list[str], stack: tuple[str, ...],
                columns: list[str], wholes: set[str], depth: int = 3) -> bool:
    """Whether every reader is a column Linear, a module kept whole, or a scaling / cast of one
    tensor (``x * multiplier``) whose own readers are; collects the columns and whole modules."""
    for reader in readers:
        data = g.nodes[reader]
        if column_reader(g, roles, reader):
            columns.append(module_of(g, reader))
            continue
        whole = _whole_reader(g, roles, reader, stack)
        if whole is not None:
            wholes.add(whole)
            continue
        tensors = [r.name for r in refs(data["args"], data["kwargs"]) if g.nodes[r.name]["shape"]]
        carries = data["kind"] == "call" and data["op"] in _CARRY and len(tensors) == 1
        if not (carries and depth and _readers_ok(g, roles, list(g.successors(reader)), stack, columns, wholes,
                                                  depth - 1)):
            return False
    return True


def plain_producer(g: nx.DiGraph, roles: dict[str, Role], module: str, param_owners: set[str]) -> bool:
    """Whether ``module`` is a replicated leaf with parameters and no Linear (a norm)."""
    role = roles.get(module)
    if not module or (role is not None and role.kind not in _PLAIN_PRODUCER) or has_sharded(roles, module):
        return False
    if any(m.startswith(module + ".") for m in param_owners):
        return False  # holds other parametrised modules: a block, not a norm
    # A Linear kept whole mixes features; its own output is not this pattern.
    return not any(g.nodes[n]["kind"] == "call" and is_linear(g, n) for n in g.nodes if module in g.nodes[n]["stack"])


def shared_inputs(g: nx.DiGraph, roles: dict[str, Role]) -> dict[str, Role]:
    """Plain TP: modules whose output only column Linears (and whole modules) read.

    Args:
        g: the dataflow graph.
        roles: the roles so far (columns and rows assigned).

    Returns:
        New roles: ``shared_input`` for each such module, ``whole_module`` for whole readers.
    """
    param_owners = param_modules(g)
    found: dict[str, Role] = {}
    for module in sorted(param_owners):
        if not plain_producer(g, roles, module, param_owners):
            continue
        outputs, readers = module_outputs(g, module)
        if len(outputs) != 1 or not readers:
            continue
        stack = g.nodes[outputs[0]]["stack"]
        columns, wholes = [], set()
        if not _readers_ok(g, roles, readers, stack, columns, wholes):
            continue
        if columns:
            found[module] = Role("shared_input", "its output is read by column Linears "
                                 f"({', '.join(sorted(set(columns)))}): one Replicate() DTensor, so their "
                                 "input gradients are summed and all-reduced once", (module, *sorted(set(columns))))
            for whole in sorted(wholes):
                found[whole] = Role("whole_module", f"kept whole and reads {module}'s replicated DTensor output: "
                                    "runs on its local value", (module, whole))
    return found


def shared_entries(g: nx.DiGraph, roles: dict[str, Role]) -> dict[str, Role]:
    """Plain TP: column Linears that read one tensor that is not a shared norm's output.

    OLMo2's q/k/v read the residual stream as it enters their module (the residual add reads it
    too, so its producer keeps it plain); a linear-attention mixer's projections read its input
    after a padding mask multiplies it, inside the mixer. The sharing scope is the innermost
    module holding those Linears, or the nearest module above it without a role of its own (a
    mixer whose own parameters have a style); the tensor is shared for one call of that scope.
    Sharing is by identity (``Boundary(inputs="replicate", columns=...)``), so it never changes
    values: only the number of reductions of the input gradient.
    """
    found: dict[str, Role] = {}
    covered = {f"{m}.{c}" for m, r in roles.items() for c in shared_columns(r)}
    for name, data in g.nodes(data=True):
        if data["kind"] != "call" or not data["shape"]:
            continue
        readers = [s for s in g.successors(name) if column_reader(g, roles, s) and module_of(g, s) not in covered]
        if len(readers) < 2:
            continue
        stacks = [g.nodes[r]["stack"] for r in readers]
        owners = sorted({module_of(g, r) for r in readers})
        module = sharing_scope(common_module(stacks), stacks[0], roles, found)
        if not module or len(owners) < 2 or not all(o.startswith(module + ".") for o in owners):
            continue
        columns = tuple(o[len(module) + 1:] for o in owners)
        found[module] = shared_entry(roles, module, columns, f"its column Linears ({', '.join(columns)}) read one "
                                     "tensor that no shared norm hands them: they share one Replicate() DTensor of "
                                     "it, so their input gradients are summed and all-reduced once", (name, *owners))
    return found


def shared_entry(roles: dict[str, Role], scope: str, columns: tuple[str, ...], reason: str,
                 evidence: tuple[str, ...], *, partial_grad: bool = False) -> Role:
    """The role that shares ``columns``' input at ``scope``: a ``shared_entry``, or the scope's own
    ``shard_counts`` or ``reduced_inputs`` role with the columns added (one style divides its head
    counts, or reduces its inputs' gradients, and shares)."""
    current = roles.get(scope)
    if current is not None and current.kind in ("shard_counts", "reduced_inputs"):
        return replace(current, shared_columns=columns, partial_grad=partial_grad, evidence=evidence,
                       reason=f"{current.reason}; {reason}")
    return Role("shared_entry", reason, evidence, names=columns, partial_grad=partial_grad)


def shared_columns(role: Role) -> tuple[str, ...]:
    """The column Linears (relative names) whose input ``role``'s module shares."""
    return role.names if role.kind == "shared_entry" else role.shared_columns


def sharing_scope(module: str, stack: tuple[str, ...], roles: dict[str, Role], found: dict[str, Role]) -> str:
    """``module``, or the nearest module above it in ``stack`` that has no role (its pre-hooks can
    then hold the shared value) or whose role only divides its head counts; empty where there is
    none or it shares another tensor already."""
    above = [m for m in stack if module == m or module.startswith(m + ".")]
    for candidate in reversed(above):
        if candidate in found:
            return ""
        if candidate not in roles or (roles[candidate].kind == "shard_counts" and not roles[candidate].shared_columns):
            return candidate  # no style of its own, or one that only divides its attributes
    return ""


def expert_inputs(g: nx.DiGraph, roles: dict[str, Role], *, sequence_parallel: bool,
                  groups=None, stream: set[str] = frozenset()) -> dict[str, Role]:
    """MoE blocks whose input gradient can be reduced once: the block takes its input as a DTensor.

    The block's only input, inside the block (through reshapes), may be read only by the grouped
    experts, column Linears and modules kept whole. A module kept whole whose outputs the experts
    read is a router: it runs its backward on the experts' partial gradients. The experts must read
    nothing from outside but the block input and router outputs (any other gradient handed back to
    them would be left partial). The DTensor comes from the norm before the block where that norm's
    only output is the block's input (its other readers column Linears, which share it); otherwise
    (the residual reads the norm's output too, or no norm precedes the block) the block makes it
    itself at entry (:func:`_entry_dtensor`).

    Args:
        stream: under SP, the nodes of the sequence-sharded residual stream (a block whose input
            is among them gathers it at entry and can keep the gathered DTensor).

    Returns:
        New roles: the norm (``shared_input``, or its gather kept a DTensor under SP) or the block
        (``replicated_entry``, or its gather kept a DTensor under SP), the experts
        (``partial_grad_inputs``), ``router`` and ``whole_module`` roles.
    """
    param_owners = param_modules(g)
    found: dict[str, Role] = {}
    for block in sorted(expert_blocks(roles, groups)):
        if not _reduces_once_at_entry(roles.get(block), sequence_parallel):
            continue
        inside = {n for n, d in g.nodes(data=True) if block in d["stack"]}
        entries = {p for n in inside for p in g.predecessors(n)
                   if p not in inside and g.nodes[p]["kind"] == "call" and g.nodes[p]["shape"]}
        if len(entries) != 1:
            continue
        entry = entries.pop()
        experts = {m for m, r in roles.items() if r.kind == "experts" and m.startswith(block + ".")}
        parts = _block_readers(g, roles, block, entry, experts)
        if parts is None:
            continue
        chain, wholes = parts
        routers = {m for m in wholes if any(experts & set(g.nodes[r]["stack"]) for r in module_outputs(g, m)[1])}
        fed = {p for n in inside if experts & set(g.nodes[n]["stack"]) for p in g.predecessors(n)
               if g.nodes[p]["kind"] == "call" and not experts & set(g.nodes[p]["stack"])}
        if not all(p in chain or any(m in g.nodes[p]["stack"] for m in routers) for p in fed):
            continue  # the experts read something else from the block: its gradient would stay partial
        if any(_reads_other_state(g, roles, router) for router in routers):
            continue  # the router style covers the parameters of the module and its children only
        producer = _dtensor_producer(g, roles, entry, inside, sequence_parallel, param_owners)
        if producer is None and not _entry_dtensor(g, roles, block, entry, inside, sequence_parallel, stream):
            continue
        if producer is not None:
            found[producer] = _producer_role(roles, producer, block, sequence_parallel)
        if sequence_parallel and (producer is None or kind_of(roles, block) == "seq_gather"):
            # the block passes on the DTensor its own gather, or its norm's, makes (one gathered
            # whole would otherwise hand its inside a plain copy)
            found[block] = replace(roles[block], dtensor_output=True, reason=roles[block].reason + "; keeps its "
                                   "input a gathered DTensor, so the experts', router's and shared expert's input "
                                   "gradients are reduce-scattered once")
        elif producer is None:
            found[block] = Role("replicated_entry", "MoE block whose input no norm hands over as a DTensor (the "
                                "residual reads it too, or no norm precedes it): its input is wrapped as a "
                                "Replicate() DTensor at entry, so the experts', router's and shared expert's input "
                                "gradients are summed and all-reduced once", (entry, block))
        source = producer or block
        for module in sorted(experts):
            found[module] = replace(roles[module], partial_grad_inputs=True, reason=roles[module].reason +
                                    "; takes the block input's DTensor and the router's weights with partial "
                                    "gradients, reduced once with the block input's")
        for module in sorted(wholes):
            kept = roles[module].reason if module in roles else "kept whole"
            found[module] = (Role("router", f"{kept}; its outputs route tokens to {', '.join(sorted(experts))}: "
                                  "runs its backward on their partial gradients (weight gradient left Partial())",
                                  (source, module, *sorted(experts))) if module in routers else
                             Role("whole_module", f"kept whole and reads the DTensor {source} hands the block: "
                                  "runs on its local value", (source, module)))
    return found


def _dtensor_producer(g: nx.DiGraph, roles: dict[str, Role], entry: str, inside: set[str], sequence_parallel: bool,
                      param_owners: set[str]) -> str | None:
    """The norm whose only output is the block input ``entry`` and can be returned as a DTensor
    (its other readers column Linears beside the block, which take the DTensor too), or None."""
    producer = g.nodes[entry]["stack"][-1] if g.nodes[entry]["stack"] else ""
    if not producer:
        return None
    outputs, readers = module_outputs(g, producer)
    if outputs != [entry] or not all(r in inside or column_reader(g, roles, r) for r in readers):
        return None
    if sequence_parallel:
        role = roles.get(producer)
        return producer if role is not None and role.kind == "seq_norm_gather" and not role.seq_output else None
    return producer if plain_producer(g, roles, producer, param_owners) else None


def _producer_role(roles: dict[str, Role], producer: str, block: str, sequence_parallel: bool) -> Role:
    if not sequence_parallel:
        return Role("shared_input", f"its output is the MoE block {block}'s input: a Replicate() DTensor, so the "
                    "experts', router's and shared expert's input gradients are summed and reduced once",
                    (producer, block))
    role = roles[producer]
    return replace(role, dtensor_output=True, reason=role.reason + f"; its all-gather kept a DTensor for the MoE "
                   f"block {block}, whose input gradient is then reduce-scattered once")


def _entry_dtensor(g: nx.DiGraph, roles: dict[str, Role], block: str, entry: str, inside: set[str],
                   sequence_parallel: bool, stream: set[str]) -> bool:
    """Whether ``block`` can make its input ``entry`` a DTensor itself.

    SP: the input is the sequence-sharded stream, which the block gathers at entry anyway (it
    keeps the gathered DTensor, whose backward reduce-scatters the summed gradient once). Plain TP:
    the block's code reads no tensor from outside but ``entry`` (no padding mask), so every
    floating argument it is handed is that one value, wrapped as a ``Replicate()`` DTensor.
    """
    if sequence_parallel:  # not a norm's output gathered to a plain tensor before the block
        producer = g.nodes[entry]["stack"][-1] if g.nodes[entry]["stack"] else ""
        return entry in stream and kind_of(roles, producer) != "seq_norm_gather"
    outside = {p for n in inside for p in g.predecessors(n) if p not in inside and g.nodes[p]["shape"]
               and g.nodes[p]["kind"] not in ("param", "buffer")}
    return outside == {entry}


def _reduces_once_at_entry(role: Role | None, sequence_parallel: bool) -> bool:
    """Whether a MoE block with this role can take its input as the norm's DTensor: plain TP, one
    with no role; SP, one that reduce-scatters the experts' partial sums (``moe_block``) or one
    gathered whole at entry whose output is sliced back (``seq_gather``: its experts reduce inside,
    but their input gradients, the router's and a shared expert's can still be summed first)."""
    if not sequence_parallel:
        return role is None
    if role is None:
        return False
    return role.kind == "moe_block" or (role.kind == "seq_gather" and role.seq_output and not role.all_outputs)


def _reads_other_state(g: nx.DiGraph, roles: dict[str, Role], module: str) -> bool:
    """Whether code inside ``module`` reads a parameter or buffer that is neither ``module``'s own
    nor a child's kept whole (a router's ``gate`` Linear): another module's (a routing bias of the
    block), or a child with a role of its own. The router style gives the parameters of the module
    and its children their ``Partial()`` gradient; another module's would keep a per-rank partial
    gradient no one reduces."""
    for name, data in g.nodes(data=True):
        if module not in data["stack"]:
            continue
        for p in g.predecessors(name):
            source = g.nodes[p]
            if source["kind"] not in ("param", "buffer"):
                continue
            owner = source["param"].rpartition(".")[0]
            if owner == module or owner.startswith(module + ".") and kind_of(roles, owner) in (None, "replicate"):
                continue
            if source["kind"] == "param" and not selects_only(g, p):
                return True
    return False




def selects_only(g: nx.DiGraph, name: str, depth: int = 6) -> bool:
    """Whether ``name``'s value reaches the rest of the program only as selected indices (a routing
    bias added to the scores before ``topk``, whose values are dropped): it gets no gradient.

    >>> from autotp.synth.graph import Ref, add_node
    >>> g = nx.DiGraph()
    >>> for n, op, args in [("x", "placeholder", ()), ("b", "placeholder", ()), ("s", "add", (Ref("x"), Ref("b"))),
    ...                     ("t", "topk", (Ref("s"), 2)), ("i", "getitem", (Ref("t"), 1))]:
    ...     _ = add_node(g, n, op, args=args)
    >>> selects_only(g, "b"), selects_only(g, "x")
    (True, True)
    >>> _ = add_node(g, "v", "getitem", args=(Ref("t"), 0))
    >>> _ = add_node(g, "w", "mul", args=(Ref("v"), 2.0))
    >>> selects_only(g, "b")
    False
    """
    if depth == 0:
        return False
    readers = list(g.successors(name))
    if not readers:
        return False  # a module output (or unused): be safe
    for reader in readers:
        data = g.nodes[reader]
        if data["op"] in SELECTIONS:
            continue
        if data["op"] in SELECTIONS_WITH_VALUES:
            items = list(g.successors(reader))
            if items and all(g.nodes[i]["op"] == "getitem" and (data_index(g, i) == 1 or not list(g.successors(i)))
                             for i in items):  # the values unused (exported as a dead getitem)
                continue
            return False
        if data["kind"] != "call" or data["op"] not in _CARRY or not selects_only(g, reader, depth - 1):
            return False
    return True


def data_index(g: nx.DiGraph, name: str):
    """The index a ``getitem`` node takes."""
    args = g.nodes[name]["args"]
    return args[1] if len(args) > 1 else None


def _block_readers(g: nx.DiGraph, roles: dict[str, Role], block: str, entry: str,
                   experts: set[str]) -> tuple[set[str], set[str]] | None:
    """The block input's reshapes inside ``block`` and the modules kept whole that read it, or None
    where anything but those, the experts and column Linears reads it inside the block."""
    chain, wholes, todo = {entry}, set(), [entry]
    while todo:
        node = todo.pop()
        for reader in g.successors(node):
            data = g.nodes[reader]
            if column_reader(g, roles, reader):
                continue  # takes the DTensor, inside the block (a shared expert) or beside it
            if block not in data["stack"] and node == entry:
                continue  # reads the value before the block (the residual): checked by the caller
            if block not in data["stack"]:
                return None  # leaves the block as a DTensor
            if experts & set(data["stack"]):
                continue
            below = [m for m in data["stack"] if m.startswith(block + ".")]
            if below:
                module = below[0]
                role = roles.get(module)
                if role is not None and (role.kind != "replicate" or role.seq_input or role.seq_output
                                         or role.seq_join):
                    return None  # sharded, or a layout change of its own at a sequence edge
                if has_sharded(roles, module):
                    return None
                wholes.add(module)
                continue
            tensors = [r.name for r in refs(data["args"], data["kwargs"]) if g.nodes[r.name]["shape"]]
            if not (data["kind"] == "call" and data["op"] in _CARRY | RESHAPES and len(tensors) == 1) or reader in chain:
                return None
            chain.add(reader)
            todo.append(reader)
    return chain, wholes


def dtensor_gathers(g: nx.DiGraph, roles: dict[str, Role]) -> dict[str, Role]:
    """SP: gathering norms and entry gathers whose readers are all column Linears keep a DTensor.

    A norm's readers inside an MoE block (router and experts) count as gathering for the norm,
    but a router kept whole cannot take a DTensor: those stay plain.
    """
    blocks = expert_blocks(roles)
    found = {}
    for module, role in roles.items():
        if role.kind not in ("seq_norm_gather", "seq_gather") or role.seq_output:
            continue
        if role.kind == "seq_norm_gather":
            _, readers = module_outputs(g, module)
        elif len(role.evidence) == 2 and role.evidence[1] == module and role.evidence[0] in g:
            # shared_gathers' evidence: (the stream node, the module); its readers inside the module
            readers = [s for s in g.successors(role.evidence[0]) if module in g.nodes[s]["stack"]]
        else:  # the module's own column Linears read the gathered stream
            readers = [n for n in _entry_readers(g, module) if is_linear(g, n)]
        if readers and all(column_reader(g, roles, r, seq_input_ok=True) and not (blocks & set(g.nodes[r]["stack"]))
                           for r in readers):
            found[module] = replace(role, dtensor_output=True)
    return found


def partial_gathers(g: nx.DiGraph, roles: dict[str, Role]) -> dict[str, Role]:
    """SP: gathering norms whose plain output reaches column Linears only through values they cannot
    hand a DTensor (a padding mask multiplies it first): the columns hand their input gradients
    back as partial sums and the norm's all-gather reduce-scatters their sum once.

    Every path from the norm's output must end in a column Linear, through casts, reshapes and
    elementwise ops whose other operands no parameter reaches (a partial gradient stays partial
    through any op whose forward values every rank shares; an operand with a gradient of its own
    would get a partial one). The columns share a scope (:func:`sharing_scope`) where their
    wrappers are installed; a norm whose columns find none keeps its plain gather.

    Returns:
        New roles: the norm with ``partial_grad``, and one ``shared_entry`` with ``partial_grad``
        per norm.
    """
    found: dict[str, Role] = {}
    for module, role in sorted(roles.items()):
        if role.kind != "seq_norm_gather" or role.seq_output or role.dtensor_output:
            continue
        outputs, _ = module_outputs(g, module)
        readers = _partial_readers(g, roles, outputs[0]) if len(outputs) == 1 else None
        if not readers:
            continue
        stacks = [g.nodes[r]["stack"] for r in readers]
        owners = sorted({module_of(g, r) for r in readers})
        scope = sharing_scope(common_module(stacks), stacks[0], roles, found)
        if not scope or not all(o.startswith(scope + ".") for o in owners):
            continue
        columns = tuple(o[len(scope) + 1:] for o in owners)
        found[scope] = shared_entry(roles, scope, columns, f"its column Linears ({', '.join(columns)}) read "
                                    f"{module}'s gathered output through values that cannot be DTensors (a padding "
                                    "mask): each hands its input gradient back as a partial sum, reduce-scattered "
                                    "once by the gather", (outputs[0], *owners), partial_grad=True)
        found[module] = replace(role, partial_grad=True, reason=role.reason + f"; its readers ({', '.join(owners)}) "
                                "return partial input gradients: the all-gather's backward reduce-scatters their sum")
    return found


def _partial_readers(g: nx.DiGraph, roles: dict[str, Role], start: str, limit: int = 64) -> list[str] | None:
    """The column Linear nodes every path from ``start`` ends in, or None where a path ends elsewhere
    or passes an op whose other operands carry a gradient of their own (:func:`partial_gathers`)."""
    columns, todo, seen = [], [start], {start}
    while todo:
        node = todo.pop()
        for reader in g.successors(node):
            if reader in seen:
                continue
            seen.add(reader)
            data = g.nodes[reader]
            if data["op"] in SINKS:
                continue
            if column_reader(g, roles, reader):
                columns.append(reader)
                continue
            if data["kind"] != "call" or data["op"] not in _CARRY | RESHAPES or len(seen) > limit:
                return None
            others = [r.name for r in refs(data["args"], data["kwargs"]) if r.name != node and g.nodes[r.name]["shape"]]
            if any(made_from_params(g, other) for other in others):
                return None
            todo.append(reader)
    return columns


def _upstream(g: nx.DiGraph, name: str, limit: int = 4) -> list[str]:
    """``name`` and the nodes it comes from through single-input scalings, casts and reshapes."""
    chain = [name]
    for _ in range(limit):
        data = g.nodes[chain[-1]]
        tensors = [r.name for r in refs(data["args"], data["kwargs"]) if g.nodes[r.name]["shape"]]
        if data["kind"] != "call" or data["op"] not in _CARRY | RESHAPES or len(tensors) != 1:
            break
        chain.append(tensors[0])
    return chain


def _entry_readers(g: nx.DiGraph, module: str) -> list[str]:
    """Nodes of ``module`` that read an activation from outside it (parameters aside)."""
    return [n for n in g.nodes if module in g.nodes[n]["stack"] and g.nodes[n]["kind"] == "call"
            and any(module not in g.nodes[r.name]["stack"] and g.nodes[r.name]["kind"] == "call"
                    and g.nodes[r.name]["shape"] for r in refs(g.nodes[n]["args"], g.nodes[n]["kwargs"]))]


def _carried(g: nx.DiGraph, start: str, limit: int = 4) -> list[str]:
    """``start`` and the nodes its value reaches through single-input scalings, casts and dropout."""
    chain, name = [start], start
    for _ in range(limit):
        succs = list(g.successors(name))
        if len(succs) != 1:
            break
        data = g.nodes[succs[0]]
        tensors = [r.name for r in refs(data["args"], data["kwargs"]) if g.nodes[r.name]["shape"]]
        if data["kind"] != "call" or data["op"] not in _CARRY or len(tensors) != 1:
            break
        name = succs[0]
        chain.append(name)
    return chain


def parallel_blocks(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], *, sequence_parallel: bool) -> dict[str, Role]:
    """Row Linears whose outputs are added to each other before anything else reads them.

    Returns:
        The rows with ``partial_output`` set; under plain TP also the layer (``stream_block``) and
        the parametrised modules on its stream before the columns (``stream_params``).
    """
    rows = [n for n, d in g.nodes(data=True) if d["kind"] == "call" and is_linear(g, n)
            and kind_of(roles, module_of(g, n)) == "row"]
    blocks = expert_blocks(roles)
    inner = inner_rows(g, flow)
    ends, carried = {}, set()
    for row in rows:
        if row in inner or blocks & set(g.nodes[row]["stack"]):
            continue
        chain = _carried(g, row)
        ends[row] = chain[-1]
        if len(chain) > 1:
            carried.add(row)  # scaled, cast or dropped out before the add: its own gradient tensor
    found: dict[str, Role] = {}
    for row, end in ends.items():
        for add in g.successors(end):
            data = g.nodes[add]
            if data["kind"] != "call" or data["op"] != "add":
                continue
            operands = [r.name for r in refs(data["args"])]
            others = [r for r, e in ends.items() if r != row and e in operands]
            if len(operands) != 2 or len(others) != 1:
                continue
            pair = sorted((row, others[0]))
            modules = [module_of(g, r) for r in pair]
            if any(roles[m].weight_in_out or roles[m].owned_output for m in modules):
                continue
            if any(roles[m].seq_output is False and sequence_parallel for m in modules):
                continue
            layer = common_module([g.nodes[r]["stack"] for r in pair])
            if not layer:
                continue
            # Under SP, branches whose outputs pass through an op before the add get different
            # sequence-sharded gradients, each gathered on its own, unless the join redistributes.
            join = layer if sequence_parallel and carried & set(pair) else None
            for module in modules:
                found[module] = replace(roles[module], partial_output=True, partial_join=join,
                                        reason=roles[module].reason + "; its partial sum is added to "
                                        f"{[m for m in modules if m != module][0]}'s before one reduction")
            if not sequence_parallel:
                stream = _stream_norms(g, roles, layer)
                if stream is None or _plain_returns(g, roles, layer, set(rows) - inner, modules):
                    # cannot make the stream a DTensor here: keep separate reductions
                    for module in modules:
                        found.pop(module)
                    continue
                found[layer] = Role("stream_block", "a parallel block: runs on a Replicate() DTensor stream so "
                                    "that its branches' partial sums are reduced once, at the residual add",
                                    (layer, *modules))
                for norm in stream:
                    found[norm] = Role("stream_params", "applies its parameters to the block's Replicate() "
                                       "DTensor stream: replicated DTensors", (layer, norm))
    return found


def region_blocks(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], *, sequence_parallel: bool) -> dict[str, Role]:
    """Parallel blocks one of whose branches is a DTensor region (its code cannot run on per-rank
    tensors) ending in a ``Partial()`` sum: the region hands it on unreduced and the row Linear of the
    other branch keeps its own partial, so that their sum is reduced once per layer
    (:func:`parallel_blocks` pairs rows; regions are planned after it, on what stayed whole).

    Plain TP: the layer runs on a ``Replicate()`` DTensor stream (``stream_block``) and the norms
    on it, the branches' shared input included, get DTensor parameters. Sequence parallel: the sum
    is reduce-scattered once onto the stream, explicitly at the join (``partial_join``: the
    region's DTensor ops would otherwise gather the sequence-sharded gradient on their own), and a
    norm read only by the region and column Linears gathers once, handing both a ``Replicate()``
    DTensor (the region's own gather passes it through).

    Returns:
        Changed roles: the region and the row with ``partial_output``, and the layer and its norms.
    """
    inner = inner_rows(g, flow)
    rows = {n: module_of(g, n) for n, d in g.nodes(data=True)
            if d["kind"] == "call" and is_linear(g, n) and kind_of(roles, module_of(g, n)) == "row"
            and not roles[module_of(g, n)].partial_output and n not in inner}
    regions = {r.region_partial[0]: m for m, r in roles.items()
               if r.region and len(r.region_partial) == 1 and not r.partial_output and not r.seq_output}
    chains = {n: _carried(g, n) for n in (*rows, *regions)}
    found: dict[str, Role] = {}
    for source, module in regions.items():
        for add in g.successors(chains[source][-1]):
            data = g.nodes[add]
            operands = [r.name for r in refs(data["args"])]
            others = [r for r in rows if chains[r][-1] in operands]
            if data["kind"] != "call" or data["op"] != "add" or len(operands) != 2 or len(others) != 1:
                continue
            row = rows[others[0]]
            if roles[row].weight_in_out or roles[row].owned_output or roles[row].seq_output != sequence_parallel:
                continue
            layer = common_module([g.nodes[source]["stack"], g.nodes[others[0]]["stack"]])
            if not layer or layer in roles or layer in found:
                continue
            if sequence_parallel:
                changed = _sequence_region_block(g, roles, module, row, layer)
            else:
                changed = _stream_region_block(g, roles, module, row, layer, set(rows))
            found.update(changed or {})
    return found


def _sequence_region_block(g: nx.DiGraph, roles: dict[str, Role], region: str, row: str,
                           join: str) -> dict[str, Role]:
    note = "; its partial sum is added to {}'s and reduce-scattered once onto the stream (a parallel block)"
    found = {region: replace(roles[region], partial_output=True, partial_join=join,
                             reason=roles[region].reason + note.format(row)),
             row: replace(roles[row], partial_output=True, partial_join=join, reason=roles[row].reason + note.format(region))}
    for norm, role in roles.items():
        if role.kind != "seq_norm" or role.seq_output:
            continue
        outputs, readers = module_outputs(g, norm)
        inside = [r for r in readers if region in g.nodes[r]["stack"]]
        others = [r for r in readers if r not in inside]
        if len(outputs) != 1 or not inside or not all(column_reader(g, roles, r, seq_input_ok=True) for r in others):
            continue
        found[norm] = replace(role, kind="seq_norm_gather", dtensor_output=True, reason=role.reason + "; read by "
                              f"the DTensor region {region} and column Linears: all-gathered once, a Replicate() DTensor")
        for reader in others:
            column = module_of(g, reader)
            found[column] = replace(roles[column], seq_input=False)
    return found


def _stream_region_block(g: nx.DiGraph, roles: dict[str, Role], region: str, row: str, layer: str,
                         rows: set[str]) -> dict[str, Role] | None:
    norms = _stream_norms(g, {m: r for m, r in roles.items() if r.kind != "shared_input"}, layer)
    if norms is None:
        return None
    norms = [n for n in norms if not n.startswith(region + ".")]  # the region's own become DTensors there
    shared = [m for m, r in roles.items() if r.kind == "shared_input" and m.startswith(layer + ".")]
    if not set(shared) <= set(norms) or _plain_returns(g, roles, layer, rows, [region, row]):
        return None  # a shared input other than a norm, or a plain return, would meet the DTensor stream
    note = "; its partial sum is added to {}'s before one reduction (a parallel block)"
    found = {region: replace(roles[region], partial_output=True, reason=roles[region].reason + note.format(row)),
             row: replace(roles[row], partial_output=True, reason=roles[row].reason + note.format(region)),
             layer: Role("stream_block", "a parallel block: runs on a Replicate() DTensor stream so that its branches' "
                         "partial sums (one a DTensor region's) are reduced once, at the residual add", (layer, region, row))}
    for norm in norms:
        found[norm] = Role("stream_params", "applies its parameters to the block's Replicate() DTensor stream: "
                           "replicated DTensors", (layer, norm))
    return found


def _plain_returns(g: nx.DiGraph, roles: dict[str, Role], layer: str, returning: set[str],
                   branches: list[str]) -> list[str]:
    """Modules of ``layer`` besides the ``branches`` whose reduced output, a plain tensor under plain
    TP, returns to the residual stream: rows not inside a branch (``returning``, not
    :func:`~autotp.synth.sequence.inner_rows`) and grouped experts. In a stream block the stream is a
    DTensor, and adding a plain tensor to it raises: a sequential MLP after a parallel mixer and
    attention (``x = x + mixer(n(x)) + attn(n(x)); x = x + mlp(n2(x))``) keeps one reduction per
    branch."""
    rows = {module_of(g, r) for r in returning if layer in g.nodes[r]["stack"]}
    experts = {m for m, r in roles.items() if r.kind == "experts" and m.startswith(layer + ".")}
    return sorted((rows | experts) - set(branches))


def _stream_norms(g: nx.DiGraph, roles: dict[str, Role], layer: str) -> list[str] | None:
    """Parametrised modules of ``layer`` that act on its stream before the column Linears: these
    see the DTensor stream and need DTensor parameters. ``None`` where the layer holds another
    parametrised module kept whole (it would meet the DTensor stream with plain weights)."""
    param_owners = param_modules(g)
    inside = [m for m in param_owners if m.startswith(layer + ".")]
    norms = []
    for module in inside:
        role = roles.get(module)
        if role is not None and role.kind != "replicate":
            continue
        if any(m.startswith(module + ".") for m in param_owners):
            return None
        linear = any(g.nodes[n]["kind"] == "call" and is_linear(g, n) for n in g.nodes if module in g.nodes[n]["stack"])
        if linear:
            return None
        norms.append(module)
    return sorted(norms)


def _stream(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], groups) -> set[str]:
    """The nodes of the sequence-sharded residual stream (as :mod:`~autotp.synth.sequence` finds them)."""
    blocks = outermost(expert_blocks(roles, groups) | dispatch_blocks(g, roles) | routed_blocks(g, roles))
    return residual_region(g, flow, blocks, attention_returns(g, roles))


def shared_input_roles(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], *,
                       sequence_parallel: bool, groups=None) -> dict[str, Role]:
    """The pass: roles updated so that each shared input's gradient is reduced once.

    Args:
        g: the dataflow graph.
        flow: the shard propagation (its rows).
        roles: every module's role after sequence-parallel roles (if any).
        sequence_parallel: whether the residual stream is sequence-sharded.
        groups: the trace's layer groups (a MoE block is recognised across the layers it stands for).

    Returns:
        A new roles dict.
    """
    out = dict(roles)
    blocks = parallel_blocks(g, flow, out, sequence_parallel=sequence_parallel)
    out.update(blocks)
    if sequence_parallel:
        changed = dtensor_gathers(g, out)
        stream = _stream(g, flow, out, groups) if expert_blocks(out, groups) else set()
        changed.update(expert_inputs(g, out, sequence_parallel=True, groups=groups, stream=stream))
        changed.update(partial_gathers(g, {**out, **changed}))
        # Columns still reading a plain whole tensor (a gathered value scaled by a learned vector)
        # share one wrapper of it: one all-reduce of their summed gradient.
        dtensors = {m for m, r in {**out, **changed}.items() if r.dtensor_output}
        for module, role in shared_entries(g, {**out, **changed}).items():
            if any(dtensors & set(g.nodes[n]["stack"]) for n in _upstream(g, role.evidence[0])):
                continue  # a gathering norm hands them a DTensor already
            if any(owner.startswith(d + ".") for owner in role.evidence[1:] for d in dtensors):
                continue  # a module around them gathers its input to a DTensor at entry
            changed[module] = role
    else:
        stream = {m for m, r in blocks.items() if r.kind == "stream_block"}
        changed = {m: r for m, r in shared_inputs(g, out).items()
                   if not any(m.startswith(s + ".") for s in stream)}
        for module, role in blocks.items():  # the norms of a stream block hand on DTensors already
            if role.kind == "stream_params":
                changed.pop(module, None)
        changed.update(expert_inputs(g, out, sequence_parallel=False, groups=groups))
        # Already a DTensor where the value comes from a shared norm (maybe scaled) or a stream block.
        dtensors = {m for m, r in {**out, **changed}.items() if r.kind in ("shared_input", "stream_block",
                                                                           "stream_params")}
        for module, role in shared_entries(g, {**out, **changed}).items():
            if not any(dtensors & set(g.nodes[n]["stack"]) for n in _upstream(g, role.evidence[0])):
                changed[module] = role
    out.update(changed)
    log.info("shared inputs: %d modules changed (%d parallel-block roles)", len(changed), len(blocks))
    return out


@post_pass(order=130)
def region_parallel_blocks(a: Analysis) -> Analysis:
    """Parallel blocks with a DTensor region for a branch reduce the two branches' sum once
    (:func:`~autotp.synth.shared.region_blocks`); after the regions are planned."""
    return replace(a, roles={**a.roles, **region_blocks(a.graph, a.flow, a.roles, sequence_parallel=a.sequence_parallel)})
