"""Sequence parallel: which modules see the residual stream sharded on the sequence dim.

Between blocks the residual stream is replicated under plain TP; under sequence parallel it stays a
DTensor sharded on dim 1. It starts at the embeddings and at every row Linear (which reduce-scatter
instead of all-reduce) and flows through pointwise ops and norms until a Linear reads it.

Long because sequence parallelism touches every boundary of the stream (norms, rotary, rows,
the head, MoE blocks, modules kept whole): one pass, each boundary a function.
"""

from __future__ import annotations

from dataclasses import replace

import networkx as nx

from autotp.synth.flow import Flow

from autotp.synth.queries import is_linear, linear_weight, module_of, param_source

from autotp.synth.shard import Shard
from autotp.synth.assign import reads_model_input
from autotp.synth.graph import common_module, param_modules, refs
from autotp.synth.queries import module_outputs, reading_module
from autotp.synth.ops import DISPATCH, LINEAR_CARRY, MASKING, PRODUCTS, SUMS, WEIGHT_PRODUCTS
from autotp.synth.ops import ATTENTION, CONVOLUTIONS, ELEMENTWISE, MATMULS, PASSTHROUGH, RESHAPES, SINKS
from autotp.synth.roles import Kind, Role, kind_of

# Linear roles that take a replicated input and can share one all-gather before them.
_GATHERING = frozenset({"column", "packed_column", "kv_column"})
# Roles of Linears kept whole on every rank: their input gradient is whole and the same on every rank.
_WHOLE_READERS = frozenset({"replicate", "broadcast_source"})
# Hops from a parameter-free module's output to a sharded op for it to count as a position table.
_ROTARY_HOPS = 4


def inner_rows(g: nx.DiGraph, flow: Flow) -> set[str]:
    """Row Linears whose reduced output meets another activation in an attention or matmul, or
    meets a sharded value, before any Linear: a projection inside attention (MLA's ``q_b_proj``
    after a sharded ``q_a_proj``), a scan's step and state projections, not a return to the
    residual stream. They all-reduce as under plain TP. Only ops inside the module that runs the
    row count: what its output meets after leaving it is the stream's (a hyper-connection's per-
    position ``comb @ streams``), and a Linear's output leaves its module reduced like any row's."""
    found = set(flow.scatters)  # left sharded on the heads, it meets them
    for row in set(flow.rows) - found:
        seen, todo = {row}, [row]
        parent = module_of(g, row).rpartition(".")[0]
        while todo and row not in found:
            for succ in g.successors(todo.pop()):
                data = g.nodes[succ]
                if succ in seen or data["kind"] != "call" or is_linear(g, succ):
                    continue
                if parent and parent not in data["stack"]:
                    continue  # out of the module that runs it: back in the stream (mixed per position there)
                if flow.sharded(succ) or data["op"] in ATTENTION | MATMULS and not any(
                        param_source(g, r.name) for r in refs(data["args"], data["kwargs"])):
                    found.add(row)
                    break
                seen.add(succ)
                todo.append(succ)
    return found


def _holds_sharded(module: str, roles: dict[str, Role]) -> bool:
    return any(m.startswith(module + ".") and r.kind != "replicate" for m, r in roles.items())


def _own_params_on(g: nx.DiGraph, module: str, region: set[str]) -> bool:
    """Whether a parameter of ``module`` itself (not of a child) is read, past casts, by the stream."""
    return any(g.nodes[p]["param"].rpartition(".")[0] == module and _readers_past_casts(g, p) & region
               for p in g.nodes if g.nodes[p]["kind"] == "param")


def residual_region(g: nx.DiGraph, flow: Flow, blocks: set[str] = frozenset(), returns: list[str] = ()) -> set[str]:
    """Nodes carrying the sequence-sharded residual stream: reachable from the rows that return to
    the stream (not :func:`inner_rows`, nor rows inside the MoE ``blocks``, whose partial sums meet
    the experts' inside the block), from ``returns`` (outputs reduced as a row's are:
    :func:`attention_returns`) and from :func:`stream_embeddings`."""
    stream_rows = {r for r in set(flow.rows) - inner_rows(g, flow) if not _in_block(g, r, blocks)}
    starts = sorted(stream_rows) + [r for r in returns if r not in stream_rows]
    for block in sorted(blocks):  # a MoE block's output returns to the stream as a row's does
        starts += [r for r in module_outputs(g, block)[1]
                   if g.nodes[r]["kind"] == "call" and not is_linear(g, r) and r not in starts]
    from_rows = _downstream(g, flow, starts)
    # A table looked up inside a block gathered whole at entry starts no stream: the block's code
    # runs on the whole sequence, and its output, sliced back, is where the stream starts.
    embeddings = [e for e in stream_embeddings(g, flow, from_rows) if not _in_block(g, e, blocks)]
    return from_rows | _downstream(g, flow, embeddings)


def attention_returns(g: nx.DiGraph, roles: dict[str, Role]) -> list[str]:
    """Outputs of ``multihead_attention`` modules computed from their ``out_proj``: reduced as a
    row's output is (reduce-scattered under SP); their attention weights are returned whole."""
    found = []
    for module in sorted(m for m, r in roles.items() if r.kind == "multihead_attention"):
        weights = [n for n, d in g.nodes(data=True) if d["kind"] == "param" and d["param"] == f"{module}.out_proj.weight"]
        reached = set().union(*(nx.descendants(g, w) for w in weights))
        found += [n for n in module_outputs(g, module)[0] if n in reached]
    return found


def stream_embeddings(g: nx.DiGraph, flow: Flow, from_rows: set[str]) -> list[str]:
    """Token-embedding lookups whose output meets what the rows return: the residual stream's
    start. Another table looked up by the token ids (Gemma4's per-layer inputs) feeds Linears
    first and stays replicated. Without rows, every token embedding counts. A Linear kept whole
    between a lookup and the rows (an input projection from narrower embeddings, ``project_in``)
    starts the stream in its place; :func:`root_whole_linears` then moves the start to the layers."""
    lookups = [n for n, d in g.nodes(data=True) if d["op"] == "embedding" and reads_model_input(g, d["args"][1].name)]
    found = [n for n in lookups if not from_rows or _downstream(g, flow, [n]) & from_rows]
    if found or not from_rows:
        return found
    # No lookup reaches the rows directly (another table's values fed to the layers, Gemma4's
    # per-layer inputs, do not count once one does).
    return sorted({s for n in lookups for r in _downstream(g, flow, [n]) for s in g.successors(r)
                   if is_linear(g, s) and s not in flow.roots and s not in flow.rows
                   and _downstream(g, flow, [s]) & from_rows})


def _downstream(g: nx.DiGraph, flow: Flow, starts: list[str]) -> set[str]:
    """``starts`` and what their values reach without passing a Linear or a TP shard."""
    region, todo = set(starts), list(starts)
    while todo:
        for succ in g.successors(todo.pop()):
            data = g.nodes[succ]
            if succ in region or data["kind"] != "call" or is_linear(g, succ):
                continue
            if isinstance(flow.state.get(succ), (Shard, tuple)):
                continue
            region.add(succ)
            todo.append(succ)
    return region


def module_inputs(g: nx.DiGraph, module: str) -> set[str]:
    """Tensors computed outside ``module`` that its nodes read (parameters and constants aside)."""
    found = set()
    for name, data in g.nodes(data=True):
        if module not in data["stack"]:
            continue
        for ref in refs(data["args"], data["kwargs"]):
            outside = g.nodes[ref.name]
            if module not in outside["stack"] and outside["kind"] in ("call", "input") and outside["shape"]:
                found.add(ref.name)
    return found


def is_raw_row(g: nx.DiGraph, name: str, role: Role) -> bool:
    """Whether Linear node ``name`` multiplies by a raw parameter its module's role shards as a row."""
    return reading_module(g, linear_weight(g, name))[1] in role.rows


def expert_blocks(roles: dict[str, Role], groups=None) -> set[str]:
    """Modules that hold grouped experts (the MoE block: router, experts, the combine around them).

    The block is the module below the decoder layer on the experts' path: transformers nests
    ``layers.0.mlp.experts`` (block ``mlp``), torchtitan ``layers.0.moe.routed_experts.inner_experts``
    with the router beside ``routed_experts`` (block ``moe``, where the tokens are dispatched). Without
    layer groups, or with the experts directly in the layer, it is the experts' parent.

    >>> from autotp.synth.trace import LayerGroups
    >>> roles = {"layers.0.moe.routed.inner": Role("experts", "")}
    >>> sorted(expert_blocks(roles, LayerGroups({"layers": [[0]]})))
    ['layers.0.moe']
    """
    found = set()
    for fqn, role in roles.items():
        if role.kind != "experts":
            continue
        block = fqn.rpartition(".")[0]
        for prefix in (groups.groups if groups is not None else ()):
            key, _, rest = fqn[len(prefix) + 1:].partition(".") if fqn.startswith(prefix + ".") else ("", "", "")
            child = rest.partition(".")[0]
            if child and f"{prefix}.{key}.{child}" != fqn:
                block = f"{prefix}.{key}.{child}"
        found.add(block)
    return found


# Hops from such a pick to the column Linear that reads the rows.
_DISPATCH_HOPS = 3


def dispatch_blocks(g: nx.DiGraph, roles: dict[str, Role]) -> set[str]:
    """Modules whose own code picks rows by index and hands them to column Linears inside it (a MoE
    block over a list of expert modules): the pick needs every token, so under sequence parallel
    the block is gathered whole at entry like a block of grouped experts."""
    found = set()
    for name, data in g.nodes(data=True):
        block = data["module"]
        if data["kind"] != "call" or data["op"] not in DISPATCH or not block or block in found:
            continue
        frontier = [name]
        for _ in range(_DISPATCH_HOPS):
            frontier = [s for n in frontier for s in g.successors(n) if block in g.nodes[s]["stack"]]
            if any(is_linear(g, s) and kind_of(roles, module_of(g, s)) in _GATHERING and module_of(g, s) != block
                   for s in frontier):
                found.add(block)
                break
    return found


def routed_blocks(g: nx.DiGraph, roles: dict[str, Role]) -> set[str]:
    """Modules whose own code scales their input, or a copy of it, by the output of a child kept
    whole that runs a Linear (routing weights from a router: ``x.repeat(k, 1) * scores``) and
    that hold column Linears elsewhere (a shared expert): under sequence parallel the scaled
    tensor would be a sequence-sharded DTensor meeting the router's plain output, so the block is
    gathered whole at entry, like a block of grouped experts."""
    found = set()
    for name, data in g.nodes(data=True):
        block = data["module"]
        if data["kind"] != "call" or data["op"] not in ("mul", "div") or not block or block in found:
            continue
        children = []
        for ref in refs(data["args"], data["kwargs"]):
            source = ref.name
            # Back through the block's own single-tensor ops (a transpose, a reshape, a cast).
            while not any(m.startswith(block + ".") for m in g.nodes[source]["stack"]):
                inputs = _tensor_inputs(g, source) if g.nodes[source]["kind"] == "call" else []
                if len(inputs) != 1 or block not in g.nodes[inputs[0]]["stack"]:
                    break
                source = inputs[0]
            inner = [m for m in g.nodes[source]["stack"] if m.startswith(block + ".")]
            if inner:
                children.append(inner[0])
        # The other operand must carry the block's input (the stream), not a constant scale.
        others = [r.name for r in refs(data["args"], data["kwargs"]) if g.nodes[r.name]["shape"]]
        carried = [o for o in others if any(block not in g.nodes[a]["stack"] and g.nodes[a]["kind"] in ("call", "input")
                                            for a in nx.ancestors(g, o) | {o})]
        for child in children:
            if not any(not any(child in g.nodes[a]["stack"] for a in nx.ancestors(g, o) | {o}) for o in carried):
                continue
            child_linears = [n for n, d in g.nodes(data=True) if d["kind"] == "call" and child in d["stack"]
                             and _weight_matmul(g, n)]
            if not child_linears or any(kind_of(roles, module_of(g, n)) != "replicate" for n in child_linears):
                continue
            if any(kind_of(roles, m) in _GATHERING and m.startswith(block + ".") and not m.startswith(child + ".")
                   for m in roles):
                found.add(block)
                break
    return found


def masked_blocks(g: nx.DiGraph, flow: Flow, region: set[str]) -> set[str]:
    """Modules whose own code combines the sequence-sharded stream with a tensor computed from the
    model's inputs alone (a padding mask zeroing padded positions at a mixer's entry): a
    ``Shard(1)`` DTensor cannot meet that plain tensor, so such a module is gathered whole at
    entry (its output sliced back)."""
    found = set()
    for name in region:
        data = g.nodes[name]
        if data["kind"] != "call" or data["op"] not in MASKING or not data["module"]:
            continue
        for ref in refs(data["args"], data["kwargs"]):
            if ref.name in region or flow.sharded(ref.name) or not g.nodes[ref.name]["shape"]:
                continue
            behind = nx.ancestors(g, ref.name) | {ref.name}
            kinds = {g.nodes[n]["kind"] for n in behind}
            if "input" in kinds and "param" not in kinds and not any(
                    g.nodes[n]["kind"] == "call" and (is_linear(g, n) or g.nodes[n]["op"] == "embedding")
                    for n in behind):
                found.add(data["module"])
                break
    return found


def gathers_before_masks(g: nx.DiGraph, region: set[str], roles: dict[str, Role], masked: set[str]) -> dict[str, Role]:
    """For each module of :func:`masked_blocks`: the norm whose output it reads all-gathers it to a
    plain tensor (the module's own style, if any, stays: a sharded mixer's per-head parameters),
    or, where no norm feeds it and it has no role, the module gathers at entry itself."""
    found = {}
    for module in sorted(masked):
        # Its stream input may be a MoE block's output, which the region starts after (the block
        # reduce-scatters it): the module reads the stream all the same.
        entering = sorted(module_inputs(g, module) & region) or [None]
        for node in entering:
            producer = g.nodes[node]["module"] if node is not None else None
            role = roles.get(producer)
            if role is not None and role.kind in ("seq_norm", "seq_norm_gather"):
                found[producer] = Role("seq_norm_gather", f"norm on the sequence-sharded stream read by {module}, "
                                       "whose code masks it with a plain tensor: all-gathered once to a plain "
                                       "tensor", (*role.evidence, module))
            elif module not in roles and module not in found:
                found[module] = Role("seq_gather", "its own code masks the stream with a tensor made from the "
                                     "model's inputs (a padding mask): gathered whole at entry, the whole output "
                                     "sliced back", (node or module, module), seq_output=True)
    return found


def partial_blocks(g: nx.DiGraph, roles: dict[str, Role], blocks: set[str],
                   inner: set[str] = frozenset()) -> dict[str, set[str]]:
    """MoE blocks whose experts' partial sums may leave the block unreduced, with the rows of
    their shared experts (:func:`shared_expert_rows`) whose partial sums join them.

    Nothing inside may hold parameters but the experts, replicated Linears (the router) and a
    shared expert's column and row Linears whose partial sum is added to the experts' as the
    block's output. A norm after the combine, or a shared expert scaled by a learned gate, would
    meet a partial sum (wrong values, or a gate weight's gradient left partial), so such blocks
    reduce inside instead.

    Returns:
        block -> the shared-expert row Linear nodes (empty without a shared expert).
    """
    owners = param_modules(g)
    linear_owners = {module_of(g, n) for n in g.nodes if g.nodes[n]["kind"] == "call" and is_linear(g, n)}
    simple = {}
    for block in blocks:
        inside = [m for m in owners if m.startswith(block + ".")]
        kinds = {m: kind_of(roles, m, Kind.REPLICATE) for m in inside}
        if any(k in _GATHERING or k == "row" for k in kinds.values()):
            rows = shared_expert_rows(g, roles, block, inner)
            if rows is None or {module_of(g, r) for r in rows} != {m for m, k in kinds.items() if k == "row"}:
                continue
        else:
            rows = set()
        if _scaled_outside_experts(g, roles, block) or _whole_term_added(g, roles, block, rows):
            continue
        if all(k in ("experts", "row") or k in _GATHERING or (k == "replicate" and m in linear_owners)
               for m, k in kinds.items()):
            simple[block] = rows
    return simple


def _scaled_outside_experts(g: nx.DiGraph, roles: dict[str, Role], block: str) -> bool:
    """Whether the experts' output is multiplied, in ``block``'s code outside the experts module,
    by a value computed from the model's inputs or parameters (the routing weights, applied in the
    combine as torchtitan does: ``routed_output * scores``).

    Left a per-rank partial sum there, that value's gradient would be partial too, and nothing
    reduces it (the experts' style reduces only the gradients of the experts' own inputs): the
    router's weight gradient came out 65% off under SP before this check. Such a block reduces the
    experts' output inside instead. Products by constants (a scale, a buffer) are fine.
    """
    experts = [m for m, r in roles.items() if r.kind == "experts" and m.startswith(block + ".")]
    todo = [n for m in experts for n in module_outputs(g, m)[0]]
    seen = set(todo)
    while todo:
        name = todo.pop()
        for succ in g.successors(name):
            data = g.nodes[succ]
            if succ in seen or data["kind"] != "call" or block not in data["stack"]:
                continue
            if data["op"] in PRODUCTS and any(_computed(g, other) for other in _tensor_inputs(g, succ)
                                               if other != name):
                return True
            seen.add(succ)
            todo.append(succ)
    return False


def _whole_term_added(g: nx.DiGraph, roles: dict[str, Role], block: str, rows: set[str]) -> bool:
    """Whether ``block``'s code adds to the experts' partial sum a term that is whole on every rank
    (a shared expert kept replicated, the block's input, a bias): left unreduced, the block's one
    reduction would count that term once per rank. Every operand of a sum the partial values reach
    in the block's own code must itself carry them (the experts' output, a sharded shared
    expert's row)."""
    experts = [m for m, r in roles.items() if r.kind == "experts" and m.startswith(block + ".")]
    seeds = {n for m in experts for n in module_outputs(g, m)[0]} | set(rows)
    carried, todo = set(seeds), list(seeds)
    while todo:
        for succ in g.successors(todo.pop()):
            data = g.nodes[succ]
            if succ in carried or data["kind"] != "call" or block not in data["stack"] or is_linear(g, succ):
                continue
            if any(m in data["stack"] for m in experts):
                continue
            carried.add(succ)
            todo.append(succ)
    return any(g.nodes[n]["op"] in SUMS and any(t not in carried for t in _tensor_inputs(g, n))
               for n in carried - seeds)


def _computed(g: nx.DiGraph, name: str) -> bool:
    """Whether node ``name`` depends on a model input or a parameter (it may carry a gradient)."""
    return any(g.nodes[n]["kind"] in ("input", "param") for n in nx.ancestors(g, name) | {name})


def _tensor_inputs(g: nx.DiGraph, name: str) -> list[str]:
    data = g.nodes[name]
    return [r.name for r in refs(data["args"], data["kwargs"]) if g.nodes[r.name]["shape"]]


def _carry_forward(g: nx.DiGraph, start: str, limit: int = 6) -> tuple[str, str | None]:
    """From ``start`` along its only reader while that reader is a :data:`LINEAR_CARRY` op of
    this one tensor: ``(the last such node, the reader after it or None)``."""
    name = start
    for _ in range(limit):
        succs = list(g.successors(name))
        if len(succs) != 1:
            return name, None
        data = g.nodes[succs[0]]
        if data["kind"] != "call":
            return name, None
        if data["op"] not in LINEAR_CARRY or _tensor_inputs(g, succs[0]) != [name]:
            return name, succs[0]
        name = succs[0]
    return name, None


def _carried_back(g: nx.DiGraph, name: str, limit: int = 6) -> list[str]:
    """``name`` and the nodes it comes from through :data:`LINEAR_CARRY` ops of one tensor."""
    chain = [name]
    for _ in range(limit):
        data = g.nodes[chain[-1]]
        inputs = _tensor_inputs(g, chain[-1])
        if data["kind"] != "call" or data["op"] not in LINEAR_CARRY or len(inputs) != 1:
            break
        chain.append(inputs[0])
    return chain


def shared_expert_rows(g: nx.DiGraph, roles: dict[str, Role], block: str,
                       inner: set[str] = frozenset()) -> set[str] | None:
    """Row Linears of MoE ``block`` whose partial sums can be added to the experts' unreduced.

    Each row's output must reach, through scalings by constants, casts and reshapes only (and
    read by nothing else), an ``add`` in the block's own code whose other operand is the grouped
    experts' output (so reshaped); that sum, so carried, must be the block's output. A sum of
    partial sums is a partial sum: the block reduces it once (DeepSeek's and GLM-4.5's
    ``experts(x).view(shape) + shared_experts(x)``). A shared expert scaled by a learned gate
    (Qwen2-MoE's ``sigmoid(gate(x)) * shared``) multiplies by a second tensor and is refused: the
    gate's gradient would read a partial sum.

    Returns:
        The row Linear nodes, or None where a row of the block does anything else.
    """
    experts = {m for m, r in roles.items() if r.kind == "experts" and m.startswith(block + ".")}
    expert_outputs = {n for m in experts for n in module_outputs(g, m)[0]}
    block_outputs = set(module_outputs(g, block)[0])
    rows = {n for n, d in g.nodes(data=True) if d["kind"] == "call" and block in d["stack"] and is_linear(g, n)
            and kind_of(roles, module_of(g, n)) == "row"}
    if not rows or not expert_outputs or rows & inner:
        return None
    for row in rows:
        last, add = _carry_forward(g, row)
        if add is None or g.nodes[add]["op"] != "add" or g.nodes[add]["module"] != block:
            return None
        operands = _tensor_inputs(g, add)
        if len(operands) != 2 or len(set(operands)) != 2 or last not in operands:
            return None
        if not expert_outputs & set(_carried_back(g, operands[1 - operands.index(last)])):
            return None
        if _carry_forward(g, add)[0] not in block_outputs:
            return None
    return rows


def _in_block(g: nx.DiGraph, name: str, blocks: set[str]) -> bool:
    return bool(blocks & set(g.nodes[name]["stack"]))


def replicated_blocks(g: nx.DiGraph, region: set[str], roles: dict[str, Role],
                      blocks: set[str] = frozenset()) -> dict[str, Role]:
    """Outermost modules that run Linears, all kept whole, and read the stream themselves.

    Modules inside a MoE ``blocks`` entry are not among them: the block takes whole tokens at
    entry (its dispatch indexes every token), so its router reads them whole already.

    A module kept replicated (Qwen3.5's linear attention: conv1d, gated delta rule) must see the
    whole sequence: its inputs are gathered once at entry; its output is wrapped where it meets the
    stream again (:func:`joining_modules`). Without this, its own ops (a padding-mask multiply)
    would mix the ``Shard(1)`` DTensor with plain tensors.
    """
    linear_modules: dict[str, list[str]] = {}
    computing = {d["module"] for n, d in g.nodes(data=True)
                 if d["kind"] == "call" and not _weight_matmul(g, n) and d["op"] not in SINKS | PASSTHROUGH}
    for name in g.nodes:
        if g.nodes[name]["kind"] == "call" and _weight_matmul(g, name):
            # A Linear's own module is the Linear; a raw-weight product (``einsum`` on a parameter,
            # ``F.linear`` on one in a module that computes more) runs in the module that holds the
            # weight, which counts too.
            stack = g.nodes[name]["stack"]
            own = is_linear(g, name) and g.nodes[name]["module"] not in computing
            for module in stack[:-1] if own else stack:
                linear_modules.setdefault(module, []).append(module_of(g, name))
    found = {}
    # Modules the stream starts in (the body holding the token embedding) are not entered by it.
    starts = {m for n in region if g.nodes[n]["op"] == "embedding" for m in g.nodes[n]["stack"]}
    for name in sorted(region, key=lambda n: g.nodes[n]["order"]):
        if _weight_matmul(g, name):
            continue
        for module in g.nodes[name]["stack"]:
            owners = linear_modules.get(module)
            # A module that runs raw weights itself has the role its kept-whole product gave it.
            taken = module in roles and kind_of(roles, module) != "replicate"
            if not owners or taken or module in starts or any(module.startswith(f + ".") for f in found):
                continue
            if any(module.startswith(b + ".") for b in blocks):
                continue
            if all(kind_of(roles, o, Kind.REPLICATE) == "replicate" for o in owners):
                # A whole decoder block (GPT-2's Conv1D layers) returns the stream itself: its
                # output is sliced back to the sequence shard; every stream-shaped output where
                # the stream reads several (a hyper-connection's branch input and weights).
                returns = sliced_outputs(g, region, module)
                if module in roles and not returns:
                    # Raw weights of its own, its outputs not the stream (a router feeding experts):
                    # it keeps its role, its input gathered by the final pass.
                    continue
                found[module] = Role("seq_gather", "kept whole (its Linears cannot be sharded) and reads the "
                                     "sequence-sharded stream: gathered once at entry"
                                     + ("; its output is the stream, sliced back" if len(returns) == 1 else "")
                                     + ("; its per-position outputs are read by the stream, each sliced back"
                                        if len(returns) > 1 else ""),
                                     (name, module), seq_output=bool(returns), all_outputs=len(returns) > 1)
                break
    return found


def sliced_outputs(g: nx.DiGraph, region: set[str], module: str) -> set[str]:
    """The outputs of a whole ``module`` gathered at entry that are sliced back to the sequence
    shard: the stream's, and every other per-position one (a hyper-connection's ``(post, comb, x)``,
    where ``post`` and ``comb`` come from a weight on a normed copy of the stream, so the region
    does not reach them): all meet the stream outside."""
    outputs = module_outputs(g, module)[0]
    returns = set(outputs) & region
    leading = {tuple(g.nodes[n]["shape"][:2]) for n in returns if g.nodes[n]["shape"]}
    return returns | {n for n in outputs if g.nodes[n]["shape"] and tuple(g.nodes[n]["shape"][:2]) in leading}


def _weight_matmul(g: nx.DiGraph, name: str) -> bool:
    """A Linear (``(in, out)`` products included, see ``graph._products_as_linear``), or another
    product with a parameter operand (a batched one) that analysis does not read as a Linear, or a
    convolution by a parameter (it mixes neighbouring positions: never a per-position norm)."""
    data = g.nodes[name]
    if is_linear(g, name):
        return True
    return data["op"] in WEIGHT_PRODUCTS | CONVOLUTIONS.keys() and any(param_source(g, r.name) for r in refs(data["args"]))


def sequence_norms(g: nx.DiGraph, region: set[str], roles: dict[str, Role], groups=None) -> dict[str, Role]:
    """Parametrised modules on the residual stream (norms): gather ones feed only column Linears
    or MoE blocks (whose router and experts both need every token)."""
    owners = param_modules(g)
    # A module that multiplies by a weight matrix mixes features: it is a Linear (kept whole, or
    # sharded), never a norm.
    products = {d["module"] for n, d in g.nodes(data=True) if d["op"] in WEIGHT_PRODUCTS or _weight_matmul(g, n)}
    mixers = owners & products  # mixes by weights of its own: a hyper-connection's stream weights
    owners -= products
    blocks = expert_blocks(roles, groups)
    # The stream is sharded from a token embedding module's output on: a norm inside that module
    # (an embedding that normalises its rows) still sees every position.
    tables = {module_of(g, n) for n in region if g.nodes[n]["op"] == "embedding"}
    found = {}
    for name in sorted(region, key=lambda n: g.nodes[n]["order"]):
        for module in g.nodes[name]["stack"]:
            if module in roles or module in found:
                continue
            if module in mixers and _holds_sharded(module, roles) and _own_params_on(g, module, region):
                # Weights of its own that mix or weigh the stream around sharded children (several
                # residual streams ``(s, b, n, d)`` read and written by learned weights): replicated
                # DTensors, so that the products run on the sequence-sharded stream DTensor.
                found[module] = Role("seq_params", "mixes the sequence-sharded stream by weights of its own "
                                     "around sharded children; they are replicated DTensors", ("residual", module))
                continue
            if module not in owners:
                # A parameter-free norm (``LayerNorm(d, elementwise_affine=False)``) needs no style,
                # unless the model's own code multiplies its output by a weight: it hands on a plain tensor.
                if not any(o.startswith(module + ".") for o in owners) and not any(
                        module.startswith(m + ".") for m in found) and _root_product(g, module_outputs(g, module)[1]):
                    found[module] = Role("seq_norm_gather", "parameter-free norm on the sequence-sharded residual "
                                         "stream whose output the model's own code multiplies by a weight it holds "
                                         "whole: all-gathered to a plain tensor", ("residual", module))
                continue
            if any(module.startswith(t + ".") for t in tables):
                continue
            if any(module.startswith(m + ".") for m, r in roles.items() if r.kind == "seq_gather"):
                continue  # inside a module that gathers at entry: it sees the whole sequence
            if any(module.startswith(m + ".") for m, r in found.items() if r.kind != "seq_params"):
                continue  # inside a module this makes sequence parallel: its style covers the subtree
            if any(m.startswith(module + ".") and r.kind != "replicate" for m, r in roles.items()):
                # Holds sharded modules, so not a norm; parameters of its own on the stream (an
                # input scale) become replicated DTensors, its children keep their styles.
                if any(g.nodes[p]["param"].rpartition(".")[0] == module and _readers_past_casts(g, p) & region
                       for p in g.nodes if g.nodes[p]["kind"] == "param"):
                    found[module] = Role("seq_params", "applies parameters of its own to the sequence-sharded "
                                         "stream; they are replicated DTensors", ("residual", module))
                continue
            if any(g.nodes[n]["op"] in ATTENTION and module in g.nodes[n]["stack"] for n in region):
                # Attention over the stream's own positions or streams (a learned query attending
                # over a layer's block states, ``sdpa(query, stacked, stacked)`` on ``(b, t, n, d)``):
                # DTensor runs it with the sequence as the heads' dim and unbinds or differentiates
                # it wrongly, so the module runs whole on plain tensors.
                found[module] = Role("seq_gather", "runs attention on the sequence-sharded stream with parameters "
                                     "of its own: gathered whole at entry, every per-position output sliced back",
                                     ("residual", module), seq_output=True, all_outputs=True)
                continue
            if len(module_inputs(g, module)) > 1:
                # Several stream tensors in (a residual scaled and added inside): torch's
                # SequenceParallel keeps only the first input; they arrive as sharded DTensors,
                # so only its parameters need to become replicated DTensors.
                found[module] = Role("seq_params", "applies its parameters to several sequence-sharded "
                                     "stream inputs; they are replicated DTensors", ("residual", module))
                continue
            _, readers = module_outputs(g, module)
            consumers = {"column" if _in_block(g, r, blocks) else
                         kind_of(roles, module_of(g, r), Kind.REPLICATE) if is_linear(g, r)
                         else "other" for r in readers}
            readers_text = ", ".join(sorted({module_of(g, r) or "the root" for r in readers}))
            if _root_product(g, readers):
                found[module] = Role("seq_norm_gather", "norm on the sequence-sharded residual stream whose output the "
                                     "model's own code multiplies by a weight it holds whole (a head on a tied "
                                     "embedding, F.linear(x, embed.weight)): all-gathered to a plain tensor",
                                     ("residual", module, readers_text))
            elif len({module_of(g, r) for r in readers}) > 1 and consumers <= _WHOLE_READERS:
                # Several Linears kept whole (MLA's q and kv down-projections) would each gather the
                # stream: one gather here, to a plain tensor whose gradient every reader gives whole.
                found[module] = Role("seq_norm_gather", "norm on the sequence-sharded residual stream read by "
                                     "several Linears kept whole: all-gathered once to a plain tensor",
                                     ("residual", module, readers_text))
            elif consumers and consumers <= _GATHERING:
                found[module] = Role("seq_norm_gather", "norm on the sequence-sharded residual stream, read only "
                                     "by column Linears: all-gathered once", ("residual", module, readers_text))
            else:
                found[module] = Role("seq_norm", "norm on the sequence-sharded residual stream; its output "
                                     "stays sharded", ("residual", module, readers_text))
    return found


def _root_product(g: nx.DiGraph, readers) -> bool:
    """Whether code outside every module (the model's own forward) multiplies what ``readers`` read,
    through ops of its own, by a weight: no style sits between that code and the value, so it must
    get a plain whole tensor (a sequence-sharded DTensor would meet the plain weight)."""
    seen, todo = set(), [r for r in readers if not g.nodes[r]["stack"]]
    while todo:
        name = todo.pop()
        if name in seen or g.nodes[name]["kind"] != "call" or g.nodes[name]["stack"]:
            continue
        seen.add(name)
        if g.nodes[name]["op"] in WEIGHT_PRODUCTS or _weight_matmul(g, name):
            return True
        todo.extend(g.successors(name))
    return False


def _readers_past_casts(g: nx.DiGraph, name: str) -> set[str]:
    """The readers of ``name``, and of the values made from it alone: casts and copies
    (``z.to(dtype).expand_as(stream)``), an element picked (``self.lambdas[0] * x``), a function of it."""
    found, todo = set(), [name]
    while todo:
        current = todo.pop()
        for succ in g.successors(current):
            if succ not in found:
                found.add(succ)
                if g.nodes[succ]["kind"] == "call" and (g.nodes[succ]["op"] in PASSTHROUGH
                                                        or _tensor_inputs(g, succ) == [current]):
                    todo.append(succ)
    return found


def rotary_modules(g: nx.DiGraph, flow: Flow, roles: dict[str, Role]) -> dict[str, Role]:
    """Parameter-free modules with buffers whose outputs soon meet a sharded tensor (cos/sin tables)."""
    buffer_owners = param_modules(g, "buffer")
    param_owners = param_modules(g)
    found = {}
    for module in sorted(buffer_owners - param_owners - set(roles)):
        if not module or any(p.startswith(module + ".") for p in param_owners):
            continue  # the root, or a module with parameters below it (a decoder layer's own scale buffer)
        outputs, _ = module_outputs(g, module)
        if _meets_shard(g, flow, outputs, module):
            found[module] = Role("rotary", "computes position tables that the sharded attention reads; "
                                 "its output must be whole and local", (module, "attention"))
    return found


def _meets_shard(g, flow, starts, module) -> bool:
    frontier = set(starts)
    for _ in range(_ROTARY_HOPS):
        nxt = set()
        for name in frontier:
            for succ in g.successors(name):
                if module in g.nodes[succ]["stack"]:
                    continue
                if any(isinstance(flow.state.get(r.name), Shard) for r in refs(g.nodes[succ]["args"])):
                    return True
                nxt.add(succ)
        frontier = nxt
    return False


def joining_modules(g: nx.DiGraph, flow: Flow, region: set[str], roles: dict[str, Role]) -> dict[str, Role]:
    """Replicated modules whose output an op of the residual stream reads directly.

    The stream is a ``Shard(1)`` DTensor; a plain tensor cannot meet it (nanoGPT's position
    embedding ``wte(idx) + wpe(pos)``, a Linear kept whole whose output is added back, Falcon-H1's
    replicated Mamba mixer whose output is scaled, then added). Wrapped as a ``Replicate()``
    DTensor, DTensor slices it locally, with no communication.
    """
    found = {}
    # Inside a module that gathers the stream at entry, every tensor is whole and plain.
    gathered = {m for m, r in roles.items() if r.kind == "seq_gather"}
    for name in region:
        stack = set(g.nodes[name]["stack"])
        if stack & gathered:
            continue
        for ref in refs(g.nodes[name]["args"], g.nodes[name]["kwargs"]):
            data = g.nodes[ref.name]
            if ref.name in region or data["kind"] != "call" or data["shape"] is None:
                continue
            if isinstance(flow.state.get(ref.name), (Shard, tuple)):  # a TP shard, not a replica
                continue
            outer = [m for m in data["stack"] if m not in stack]
            if not outer:  # scaled, cast or reshaped on the way, in the stream's own module: look behind that
                data = g.nodes[_behind_pointwise(g, ref.name, PASSTHROUGH | ELEMENTWISE | RESHAPES)]
                outer = [m for m in data["stack"] if m not in stack]
            if not outer:
                continue
            if any(kind_of(roles, m) == "seq_gather" and roles[m].seq_output for m in outer[:-1]):
                continue  # made inside a block gathered at entry, whose style slices its output back
            module = outer[-1]  # innermost: the module whose output this node is
            role = roles.get(module, Role("replicate", "runs whole on every rank"))
            if role.kind == "replicate" and not role.seq_output and not role.seq_input:
                cut = found[module].seq_cut if module in found else _own_positions_dim(g, module, region, name)
                if module in found and found[module].seq_cut != _own_positions_dim(g, module, region, name):
                    cut = None  # read by the stream at two different dims
                found[module] = replace(role, seq_join=True, seq_cut=cut)
            elif role.kind == "seq_gather" and not role.seq_output and not any(
                    m.startswith(module + ".") and r.kind != "replicate" for m, r in roles.items()):
                # Gathered at entry, it ran on the whole sequence (an MoE block whose experts stay
                # whole under sharded attention): its output, read as the stream, is sliced back.
                found[module] = replace(role, seq_output=True)
    return found


def _own_positions_dim(g: nx.DiGraph, module: str, region: set[str], reader: str) -> int | None:
    """The dim of ``module``'s output that lines up with the stream's sequence at ``reader``, where
    each rank may keep only its own positions of it (``Boundary(outputs="slice", output_grad="partial")``):
    the module's parameters are its own, nothing it reads carries a gradient (no parameter is behind
    its inputs: positions, ids, shapes), it has one output, read only by ops of the stream, and that
    output spans the whole sequence on that dim. None otherwise (the output is then handed on
    whole, a ``Replicate()`` DTensor whose gradient is gathered)."""
    owners = {g.nodes[n]["param"].rpartition(".")[0] for n in g.nodes if g.nodes[n]["kind"] == "param"
              and g.nodes[n]["param"].startswith(module + ".")}
    if owners - {module}:
        return None
    for name in module_inputs(g, module):
        if any(g.nodes[a]["kind"] == "param" for a in nx.ancestors(g, name)):
            return None
    outputs, readers = module_outputs(g, module)
    if len(outputs) != 1:
        return None
    readers = set(readers)
    while moved := {r for r in readers if r not in region and g.nodes[r]["op"] in PASSTHROUGH}:
        readers = (readers - moved) | {s for r in moved for s in g.successors(r)}  # a cast on the way
    readers = {r for r in readers if g.nodes[r]["op"] not in SINKS}
    if not readers or any(r not in region for r in readers):
        return None
    shape, stream = g.nodes[outputs[0]]["shape"], g.nodes[reader]["shape"]
    if not shape or not stream or len(stream) < 2:
        return None
    dim = 1 - (len(stream) - len(shape))
    if dim < 0 or shape[dim] != stream[1] or stream[1] < 2:
        return None
    return dim


def _behind_pointwise(g: nx.DiGraph, name: str, through: frozenset = PASSTHROUGH | ELEMENTWISE) -> str:
    """Follow ``name`` back through casts and pointwise ops of a single tensor input (a scale by a
    number, or by a parameter: a scale or bias vector), and any other ``through`` ops: the node
    whose value it carries."""
    while g.nodes[name]["kind"] == "call" and g.nodes[name]["op"] in through:
        tensors = [r.name for r in refs(g.nodes[name]["args"], g.nodes[name]["kwargs"])
                   if g.nodes[r.name]["shape"] and g.nodes[r.name]["kind"] != "param"]
        if len(tensors) != 1:
            break
        name = tensors[0]
    return name


def shared_gathers(g: nx.DiGraph, region: set[str], roles: dict[str, Role]) -> dict[str, Role]:
    """Modules whose several column Linears read one stream tensor directly: gather once at entry.

    The module is the innermost one holding all those Linears; every reader of the tensor inside
    it must be one of them (anything else there would get the gathered, replicated value), and it
    must have no role already.
    """
    found = {}
    gathered = {m for m, r in roles.items() if r.kind == "seq_norm_gather"}
    for name in region:
        if gathered & set(g.nodes[name]["stack"]):  # already gathered by its norm
            continue
        readers = [s for s in g.successors(name) if is_linear(g, s)]
        if len(readers) < 2 or any(kind_of(roles, module_of(g, r)) not in _GATHERING for r in readers):
            continue
        module = common_module([g.nodes[r]["stack"] for r in readers])
        if not module or module in roles or module in g.nodes[name]["stack"]:
            continue
        inside = [s for s in g.successors(name) if module in g.nodes[s]["stack"]]
        if set(inside) == set(readers):
            found[module] = Role("seq_gather", "its column Linears read the sequence-sharded stream with no "
                                 "norm before them: one all-gather at entry", (name, module))
    return found


def gathered_params_modules(g: nx.DiGraph, region: set[str], roles: dict[str, Role],
                            gathered: set[str]) -> dict[str, Role]:
    """``head_params`` modules whose own code reads the sequence-sharded stream (a token shift
    mixed with per-channel weights before the column Linears): their style gathers it whole at
    entry, once, and the Linears inside read it whole. Stream values made in a ``gathered`` module
    (a norm that all-gathers its output) arrive whole already."""
    sharded = [n for n in region if not gathered & set(g.nodes[n]["stack"])]
    found = {}
    for module, role in roles.items():
        if role.kind != "head_params" or role.seq_input or module in gathered:
            continue
        if any(module in g.nodes[s]["stack"] and not is_linear(g, s) and g.nodes[s]["op"] not in SINKS
               for n in sharded for s in g.successors(n)):
            found[module] = replace(role, seq_input=True, reason=role.reason + "; its own code reads the "
                                    "sequence-sharded stream: gathered whole at entry")
    return found


def layer_of(stack, groups) -> str | None:
    """The entry of a collapsed layer stack that ``stack`` (a node's module stack) runs in, if any."""
    prefixes = set(groups.groups) if groups is not None else set()
    return next((m for m in stack if m.rpartition(".")[0] in prefixes), None)


def root_joins(g: nx.DiGraph, flow: Flow, region: set[str], groups) -> list[str]:
    """Stream nodes outside every layer that combine the stream with a plain tensor computed in
    the same code (``embeds + pos_table[positions]`` with a table that is no module, or a slice of a
    parameter of the model's own, ``self.pos[:, :t]``): a ``Shard(1)`` DTensor cannot meet it, and
    no module boundary is there to wrap it."""
    found = []
    for name in sorted(region, key=lambda n: g.nodes[n]["order"]):
        data = g.nodes[name]
        if layer_of(data["stack"], groups) is not None or data["op"] == "embedding":  # its ids are no join
            continue
        for ref in refs(data["args"], data["kwargs"]):
            src = g.nodes[ref.name]
            if ref.name in region or src["kind"] != "call" or not src["shape"] or flow.sharded(ref.name):
                continue
            behind = g.nodes[_behind_pointwise(g, ref.name)]
            if behind["kind"] != "call" or [m for m in behind["stack"] if m not in data["stack"]]:
                continue
            # Computed from a module's parameters (a norm's ``1 + weight``), it is a DTensor under
            # that module's style; the root's own parameters (a learned position table ``self.pos``)
            # get no style and stay plain.
            if not any(g.nodes[n]["kind"] == "param" and "." in g.nodes[n]["param"] for n in nx.ancestors(g, ref.name)):
                found.append(name)
                break
    return found


def root_whole_linears(g: nx.DiGraph, region: set[str], roles: dict[str, Role], groups) -> list[str]:
    """Linears kept whole on the stream outside every layer before the first one (an input projection
    from a narrower embedding, ``project_in(embed(ids))``): their output, the stream the first layer
    reads, is replicated, so the stream starts sharded at the layers' entry instead."""
    in_layers = [g.nodes[n]["order"] for n in region if layer_of(g.nodes[n]["stack"], groups) is not None]
    if not in_layers:
        return []
    first = min(in_layers)
    return sorted(n for n in region if g.nodes[n]["order"] < first and layer_of(g.nodes[n]["stack"], groups) is None
                  and is_linear(g, n) and kind_of(roles, module_of(g, n)) in (None, "replicate"))


def start_at_layers(g: nx.DiGraph, region: set[str], groups) -> tuple[set[str], dict[str, Role]]:
    """Move the stream's start from the embeddings to the first layers' entry (see
    :func:`root_joins`): the region without the nodes before those layers, and a ``seq_slice``
    role for each layer the stream enters from outside every layer."""
    entries: dict[str, str] = {}
    for name in region:
        layer = layer_of(g.nodes[name]["stack"], groups)
        if layer is None:
            continue
        for pred in g.predecessors(name):
            if pred in region and layer_of(g.nodes[pred]["stack"], groups) is None:
                entries.setdefault(layer, name)
    if not entries:
        return region, {}
    first = min(g.nodes[n]["order"] for n in entries.values())
    kept = {n for n in region if layer_of(g.nodes[n]["stack"], groups) is not None or g.nodes[n]["order"] > first}
    roles = {layer: Role("seq_slice", "the stream reaches it replicated (combined with plain tensors in the "
                         "model's own code before the first layer): sliced to this rank's positions at entry",
                         (node, layer)) for layer, node in entries.items()}
    return kept, roles


def outermost(modules: set[str]) -> set[str]:
    """``modules`` without those inside another of them: a block gathered whole at entry runs every
    module inside on the whole sequence, so one inside it must not gather (nor slice its output) again.

    >>> sorted(outermost({"model", "model.layers.0", "head"}))
    ['head', 'model']
    """
    return {m for m in modules if not any(m.startswith(o + ".") for o in modules)}


def time_major_tables(g: nx.DiGraph, flow: Flow, region: set[str]) -> list[str]:
    """Token-embedding lookups of the stream whose output is sequence-first: ``(t, b, d)`` for
    ``(b, t)`` token ids (XLNet transposes its ids before the lookup). The sequence-parallel styles
    shard dim 1, the batch there."""
    found = []
    for name in stream_embeddings(g, flow, region):
        shape = g.nodes[name]["shape"]
        ids = g.nodes[name]["args"][1].name
        for source in nx.ancestors(g, ids) | {ids}:
            given = g.nodes[source]["shape"]
            if g.nodes[source]["kind"] == "input" and given and len(given) == 2 and given[0] != given[1] \
                    and shape and tuple(shape[:2]) == (given[1], given[0]):
                found.append(name)
                break
    return found


def unshardable_stream(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], groups=None) -> str | None:
    """Why the residual stream cannot be sequence-sharded anywhere, or None where it can.

    The model's own code (outside every layer) that combines the stream with a plain tensor before
    the first layer is handled by starting the stream at that layer (:func:`start_at_layers`). Such
    code between layers (XLM's root loop: ``tensor = norm(tensor + attn(tensor)) ...;
    tensor *= mask``, its layers being the norms and mixers themselves) meets the stream where no
    module boundary can hand it over sharded or whole: the stream stays replicated, as under plain
    TP, and the plan is the plain one.
    """
    blocks = expert_blocks(roles, groups) | dispatch_blocks(g, roles) | routed_blocks(g, roles)
    region = residual_region(g, flow, blocks, attention_returns(g, roles))
    for table in time_major_tables(g, flow, region):
        return (f"the token embedding's output ({table}) is sequence-first, (t, b, d): its dim 1 is the batch, "
                "which sequence-parallel styles would shard: the stream stays replicated (plain TP)")
    if not any(layer_of(g.nodes[n]["stack"], groups) for n in region):  # no layer stack (one block)
        whole = sorted((n for n in region if is_linear(g, n) and kind_of(roles, module_of(g, n)) in (None, "replicate")),
                       key=lambda n: g.nodes[n]["order"])
        if whole:
            return (f"{module_of(g, whole[0])} is kept whole on the stream and the model has no layer stack at "
                    "whose entry the stream could start sequence-sharded: it stays replicated (plain TP)")
    if not root_joins(g, flow, region, groups):
        return None
    region, _ = start_at_layers(g, region, groups)
    joins = root_joins(g, flow, region, groups)
    if not joins:
        return None
    return (f"the model's own code combines the stream with a plain tensor between its layers (at {joins[0]}), "
            "where no module boundary can keep it sequence-sharded: the stream stays replicated (plain TP)")


def sequence_parallel_roles(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], groups=None) -> dict[str, Role]:
    """Roles under sequence parallel: add seq norms and rotary, and mark sequence-sharded ends.
    ``groups``: the trace's layer groups (a MoE block is recognised across the layers it stands for)."""
    blocks = outermost(expert_blocks(roles, groups) | dispatch_blocks(g, roles) | routed_blocks(g, roles))
    returns = attention_returns(g, roles)
    masked = {m for m in masked_blocks(g, flow, residual_region(g, flow, blocks, returns))
              if not any(m == b or m.startswith(b + ".") for b in blocks)}
    partial = partial_blocks(g, roles, blocks, inner_rows(g, flow))
    region = residual_region(g, flow, blocks, returns)
    out = dict(roles)
    for module in [m for m, r in roles.items() if r.kind == "multihead_attention"]:  # reduce-scattered as a row is
        if any(module in g.nodes[n]["stack"] for n in returns):
            out[module] = replace(out[module], seq_output=True)
    if root_joins(g, flow, region, groups) or root_whole_linears(g, region, roles, groups):
        region, slicing = start_at_layers(g, region, groups)
        out.update(slicing)
    whole = replicated_blocks(g, region, out, blocks)
    out.update(whole)
    # What a whole block hands back sliced is sequence-sharded too, where the region did not reach it.
    region |= _downstream(g, flow, [s for m in whole for n in sliced_outputs(g, region, m) - region
                                    for s in g.successors(n) if m not in g.nodes[s]["stack"]])
    out.update(sequence_norms(g, region, out, groups))
    out.update(rotary_modules(g, flow, out))
    for block in blocks:
        if block in partial:
            shared = sorted({module_of(g, r) for r in partial[block]})
            out[block] = Role("moe_block", "holds grouped experts whose per-rank partial sums go back to the "
                              "sequence-sharded stream: reduce-scattered once"
                              + (f" with the shared expert's ({', '.join(shared)})" if shared else ""),
                              (block, *shared), seq_output=True)
            for row in shared:
                out[row] = replace(out[row], partial_output=True, reason=out[row].reason + "; its partial sum "
                                   f"is added to the experts' and reduce-scattered once with them by {block}")
        else:
            # Gathered at entry too: its dispatch indexes every token of a stream still sharded there.
            out[block] = Role("seq_gather", "holds experts and other modules that combine with their output (a "
                              "shared expert, a router, a norm): gathered whole at entry, each reduced inside, and "
                              "the whole output sliced back to the sequence-sharded stream", (block,), seq_output=True)
    out.update({m: replace(r, seq_output=True) for m, r in out.items()
                if r.kind == "experts" and any(m.startswith(block + ".") for block in partial)})
    gathered_masks = gathers_before_masks(g, region, out, masked)
    out.update(gathered_masks)
    # A masked module whose norm now gathers its input reads whole plain tensors: parameters of its
    # own that met the stream there stay plain too (as replicated DTensors they met the plain mask).
    fed = {module for norm, role in gathered_masks.items() if role.kind == "seq_norm_gather"
           for module in role.evidence[-1:]}
    for module in fed:
        if kind_of(out, module) == "seq_params":
            if module in roles:
                out[module] = roles[module]
            else:
                del out[module]
    out.update(joining_modules(g, flow, region, out))
    out.update(shared_gathers(g, region, out))
    # A module gathered at entry sees the whole sequence: norms and parameters inside it that an
    # earlier step made sequence parallel (before the block around them was gathered) stay whole.
    whole_inside = {m for m, r in out.items() if r.kind == "seq_gather"}
    for module in [m for m, r in out.items() if r.kind in ("seq_norm", "seq_norm_gather", "seq_params")
                   and any(m.startswith(w + ".") for w in whole_inside)]:
        if module in roles:
            out[module] = roles[module]
        else:
            del out[module]
    # Modules whose inputs are gathered whole at entry: the Linears inside read them whole.
    # (``HeadParams`` with raw weights gathers its module's inputs: the code around raw weights reads every position.)
    gathered = {m for m, r in out.items() if r.kind in ("seq_norm_gather", "seq_gather", "linear_params")} | masked
    out.update(found := gathered_params_modules(g, region, out, gathered))
    gathered |= set(found)
    raw_modules = {m for m, r in out.items() if r.kind == "linear_params"}  # reduce inside, slice their output
    inner = inner_rows(g, flow)
    for name, data in g.nodes(data=True):
        linear = data["kind"] == "call" and is_linear(g, name)
        owner = module_of(g, name) if linear or data["op"] == "embedding" else None
        role = out.get(owner)
        if data["op"] == "embedding":
            # Token embeddings start the (batch, seq, dim) residual stream; position tables and
            # per-layer input tables do not.
            if role is not None and name in region:
                out[owner] = replace(role, seq_output=True)
            continue
        if role is None:
            continue
        elif linear and role.kind == "linear_params" and is_raw_row(g, name, role):
            if name not in inner and not _in_block(g, name, blocks):  # raw weights: its module reduces
                out[owner] = replace(role, seq_output=True)
        elif linear and role.kind == "row":
            if name not in inner and not _in_block(g, name, blocks | raw_modules):  # a shared expert reduces inside
                out[owner] = replace(role, seq_output=True)
            elif name not in inner and not _in_block(g, name, blocks):  # the raw-weight module around it slices
                around = [m for m in g.nodes[name]["stack"] if m in raw_modules][-1]
                out[around] = replace(out[around], seq_output=True)
        elif linear and data["args"][0].name in region and not _in_block(g, name, blocks):
            src_stack = g.nodes[data["args"][0].name]["stack"]
            if not gathered & (set(src_stack) | set(data["stack"])):
                out[owner] = replace(role, seq_input=True)
    return out
