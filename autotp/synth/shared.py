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
  module returns a ``Replicate()`` DTensor (:class:`~autotp.styles.ReplicatedOutput`); the whole
  modules take it local (:class:`~autotp.styles.ReplicatedModule`).
- :func:`dtensor_gathers` (SP): all-gathering norms and module-entry gathers whose readers are
  all column Linears keep the gathered value a DTensor, so the backward reduce-scatters once.
- :func:`parallel_blocks`: two row Linears whose outputs are added before anything else reads
  them (attention and MLP side by side: GPT-J, Phi, Cohere) leave their outputs ``Partial()`` and
  the sum is reduced once per layer. Under plain TP the decoder layer then runs on a
  ``Replicate()`` DTensor stream (:class:`~autotp.styles.ReplicatedStream`), with its norms'
  parameters replicated DTensors.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import networkx as nx

from autotp.synth.analysis import Flow, is_linear
from autotp.synth.graph import common_module, refs
from autotp.synth.ops import ELEMENTWISE, PASSTHROUGH
from autotp.synth.roles import Role
from autotp.synth.sequence import expert_blocks, inner_rows, module_outputs

log = logging.getLogger(__name__)

# Linear roles whose input is replicated and whose input gradient comes back Partial().
COLUMN_KINDS = frozenset({"column", "packed_column", "kv_column"})
# Roles a module can have and still be a plain, replicated producer of the shared input.
_PLAIN_PRODUCER = frozenset({"replicate"})
# Ops between a row's output and the add that joins the branches: scaling, dropout, casts.
_CARRY = PASSTHROUGH | ELEMENTWISE | frozenset({"dropout", "native_dropout"})


def _owner(g: nx.DiGraph, name: str) -> str:
    from autotp.synth.assign import _owner as owner

    return owner(g, name)


def _has_sharded(roles: dict[str, Role], module: str) -> bool:
    return any((m == module or m.startswith(module + ".")) and r.kind != "replicate" for m, r in roles.items())


def _column_reader(g: nx.DiGraph, roles: dict[str, Role], reader: str, *, seq_input_ok: bool = False) -> bool:
    """Whether ``reader`` is a column Linear (one that gathers the stream itself only if allowed)."""
    if not (g.nodes[reader]["kind"] == "call" and is_linear(g, reader)):
        return False
    role = roles.get(_owner(g, reader))
    return role is not None and role.kind in COLUMN_KINDS and (seq_input_ok or not role.seq_input)


def _whole_reader(g: nx.DiGraph, roles: dict[str, Role], reader: str, output_stack: tuple[str, ...]) -> str | None:
    """The module kept whole that ``reader`` runs in, below where the shared value was made."""
    outer = [m for m in g.nodes[reader]["stack"] if m not in output_stack]
    if not outer:
        return None
    module = outer[0]
    role = roles.get(module)
    if (role is not None and role.kind != "replicate") or _has_sharded(roles, module):
        return None
    return module


def _readers_ok(g: nx.DiGraph, roles: dict[str, Role], readers: list[str], stack: tuple[str, ...],
                columns: list[str], wholes: set[str], depth: int = 3) -> bool:
    """Whether every reader is a column Linear, a module kept whole, or a scaling / cast of one
    tensor (``x * multiplier``) whose own readers are; collects the columns and whole modules."""
    for reader in readers:
        data = g.nodes[reader]
        if _column_reader(g, roles, reader):
            columns.append(_owner(g, reader))
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


def shared_inputs(g: nx.DiGraph, roles: dict[str, Role]) -> dict[str, Role]:
    """Plain TP: modules whose output only column Linears (and whole modules) read.

    Args:
        g: the dataflow graph.
        roles: the roles so far (columns and rows assigned).

    Returns:
        New roles: ``shared_input`` for each such module, ``whole_module`` for whole readers.
    """
    param_owners = {d["param"].rpartition(".")[0] for _, d in g.nodes(data=True) if d["kind"] == "param"}
    found: dict[str, Role] = {}
    for module in sorted(param_owners):
        role = roles.get(module)
        if not module or (role is not None and role.kind not in _PLAIN_PRODUCER) or _has_sharded(roles, module):
            continue
        if any(m.startswith(module + ".") for m in param_owners):
            continue  # holds other parametrised modules: a block, not a norm
        if any(g.nodes[n]["kind"] == "call" and is_linear(g, n) for n in g.nodes if module in g.nodes[n]["stack"]):
            continue  # a Linear kept whole mixes features; its own output is not this pattern
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
        else:  # the module's own column Linears read the gathered stream
            readers = [n for n in g.nodes if module in g.nodes[n]["stack"] and g.nodes[n]["kind"] == "call"
                       and is_linear(g, n) and any(module not in g.nodes[r.name]["stack"]
                                                   for r in refs(g.nodes[n]["args"]))]
        if readers and all(_column_reader(g, roles, r, seq_input_ok=True) and not (blocks & set(g.nodes[r]["stack"]))
                           for r in readers):
            found[module] = replace(role, dtensor_output=True)
    return found


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
            and roles.get(_owner(g, n), Role("", "")).kind == "row"]
    blocks = expert_blocks(roles)
    inner = inner_rows(g, flow)
    ends = {}
    for row in rows:
        if row in inner or blocks & set(g.nodes[row]["stack"]):
            continue
        ends[row] = _carried(g, row)[-1]
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
            modules = [_owner(g, r) for r in pair]
            if any(roles[m].weight_in_out or roles[m].owned_output for m in modules):
                continue
            if any(roles[m].seq_output is False and sequence_parallel for m in modules):
                continue
            layer = common_module([g.nodes[r]["stack"] for r in pair])
            if not layer:
                continue
            for module in modules:
                found[module] = replace(roles[module], partial_output=True,
                                        reason=roles[module].reason + "; its partial sum is added to "
                                        f"{[m for m in modules if m != module][0]}'s before one reduction")
            if not sequence_parallel:
                stream = _stream_norms(g, roles, layer)
                if stream is None:  # cannot make the stream a DTensor here: keep separate reductions
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


def _stream_norms(g: nx.DiGraph, roles: dict[str, Role], layer: str) -> list[str] | None:
    """Parametrised modules of ``layer`` that act on its stream before the column Linears: these
    see the DTensor stream and need DTensor parameters. ``None`` where the layer holds another
    parametrised module kept whole (it would meet the DTensor stream with plain weights)."""
    param_owners = {d["param"].rpartition(".")[0] for _, d in g.nodes(data=True) if d["kind"] == "param"}
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


def shared_input_roles(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], *,
                       sequence_parallel: bool) -> dict[str, Role]:
    """The pass: roles updated so that each shared input's gradient is reduced once.

    Args:
        g: the dataflow graph.
        flow: the shard propagation (its rows).
        roles: every module's role after sequence-parallel roles (if any).
        sequence_parallel: whether the residual stream is sequence-sharded.

    Returns:
        A new roles dict.
    """
    out = dict(roles)
    blocks = parallel_blocks(g, flow, out, sequence_parallel=sequence_parallel)
    out.update(blocks)
    if sequence_parallel:
        changed = dtensor_gathers(g, out)
    else:
        stream = {m for m, r in blocks.items() if r.kind == "stream_block"}
        changed = {m: r for m, r in shared_inputs(g, out).items()
                   if not any(m.startswith(s + ".") for s in stream)}
        for module, role in blocks.items():  # the norms of a stream block hand on DTensors already
            if role.kind == "stream_params":
                changed.pop(module, None)
    out.update(changed)
    log.info("shared inputs: %d modules changed (%d parallel-block roles)", len(changed), len(blocks))
    return out
