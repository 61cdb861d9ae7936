"""Parameters that meet a sharded activation: shard them with it, or reduce their gradient over tp.

A parameter combined with a head-sharded tensor inside the region between a column and a row
Linear (a per-head scale, a softmax sink, a gate bias, a differential-attention lambda vector)
gets, on each rank, the gradient of that rank's heads only. Two sound outcomes:

- its extent along the sharded dim is the sharded extent (``scale.view(1, -1, 1, 1) * y`` with
  ``scale`` of size heads): it is sharded on that dim with the heads, each rank holding the
  entries its heads read, so its local gradient is exact;
- otherwise (a vector over ``head_dim`` shared by every head, a scalar) it stays replicated and
  its gradient, a per-rank partial sum over the heads each rank holds, is all-reduced.

:func:`param_dim` is what the shard rules ask (can this operand be sharded along?), and
:func:`param_roles` gives the owning module its role once the analysis has converged.

A replicated *activation* broadcast across the heads is the same case one step removed: a rope key
shared by every head (MLA's ``k_rot``, cut from a down-projection kept whole and expanded to the
heads before it is concatenated to them) gets, on each rank, the gradient of that rank's heads only.
:func:`broadcast_source` finds the Linear and the span of its output features it comes from, when
nothing else reads that span; :func:`broadcast_roles` has the Linear all-reduce the gradient of that
span (:class:`~autotp.styles.Boundary` with ``inputs="whole"`` and ``reduce_grad_features``), one small collective
of ``tokens x rope width`` per layer.

Long because the three ways a replicated operand can meet a shard soundly (a parameter sharded with
it, a constant made at the per-rank size, a broadcast span whose gradient is reduced) share the
walks that find what an operand is computed from.
"""

from __future__ import annotations

import math

import networkx as nx

from autotp.synth.graph import Ref, made_from_params, refs
from autotp.synth.ops import CONSTANT_FACTORIES, SPLITS
from autotp.synth.ops import ELEMENTWISE, PASSTHROUGH, SINKS, VIEW_LIKE
from autotp.synth.queries import _grad_inputs, upstream_linears
from autotp.synth.stages import drop_check

# One-tensor ops through which a parameter's dims can be followed back from a consumer.
SINGLE_INPUT = PASSTHROUGH | VIEW_LIKE | ELEMENTWISE | {"unsqueeze", "squeeze", "expand", "transpose", "permute", "t", "slice",
                                                        "narrow"}


def readers(g: nx.DiGraph, name: str) -> int:
    """How many nodes read ``name``'s value (metadata asserts of the trace do not count)."""
    return sum(1 for succ in g.successors(name) if g.nodes[succ]["op"] not in SINKS)


def source_dim(g: nx.DiGraph, name: str, dim: int) -> int | None:
    """The dim of node ``name``'s (only tensor) input that its output dim ``dim`` comes from whole.

    >>> from autotp.synth.graph import add_node
    >>> g = nx.DiGraph()
    >>> _ = add_node(g, "p", "placeholder", kind="param", param="m.s", shape=(4,))
    >>> _ = add_node(g, "v", "view", (Ref("p"), [1, -1, 1, 1]), shape=(1, 4, 1, 1))
    >>> source_dim(g, "v", 1)
    0

    A dim split into (heads, head size), or merged with the dims inside it, is that dim too: a
    block of whole heads is a block of the source dim.

    >>> _ = add_node(g, "h", "view", (Ref("p"), [1, 2, 2]), shape=(1, 2, 2))
    >>> source_dim(g, "h", 1), source_dim(g, "h", 2)
    (0, None)
    """
    data = g.nodes[name]
    op, source = data["op"], data["args"][0]
    in_shape, out_shape = g.nodes[source.name]["shape"], data["shape"]
    if in_shape is None or out_shape is None:
        return None
    if op in VIEW_LIKE:
        # The dim that starts at the same offset and has the same size is the same dim.
        before = math.prod(out_shape[:dim])
        matches = [e for e in range(len(in_shape)) if math.prod(in_shape[:e]) == before
                   and in_shape[e] == out_shape[dim]]
        if not matches and out_shape[dim] > 1:
            size = out_shape[dim]
            matches = [e for e in range(len(in_shape)) if math.prod(in_shape[:e]) == before and in_shape[e] > 1
                       and (in_shape[e] % size == 0 or size % in_shape[e] == 0)]
        return matches[0] if matches else None
    if op == "unsqueeze":
        at = data["args"][1] % len(out_shape)
        return None if at == dim else dim - (at < dim)
    if op == "squeeze":
        # The dims of the input that are not squeezed away, in order (``w.squeeze(1)`` of a
        # depthwise conv weight (c, 1, k)).
        at = data["args"][1] if len(data["args"]) > 1 else list(range(len(in_shape)))
        at = {a % len(in_shape) for a in (at if isinstance(at, (list, tuple)) else [at])}
        kept = [d for d in range(len(in_shape)) if not (d in at and in_shape[d] == 1)]
        return kept[dim] if len(kept) == len(out_shape) else None
    if op in ("transpose", "t"):
        a, b = (x % len(out_shape) for x in data["args"][1:3]) if len(data["args"]) > 2 else (0, 1)
        return b if dim == a else a if dim == b else dim
    if op == "permute":
        return data["args"][1][dim] % len(out_shape)
    at = dim - (len(out_shape) - len(in_shape))  # expand, and broadcasting of one tensor
    if at < 0 or in_shape[at] != out_shape[dim]:
        return None
    return at


def value_refs(data) -> list[Ref]:
    """The inputs whose values an op reads: ``type_as(x, other)`` reads ``x`` and only the dtype of
    ``other`` (a norm's ``weight.type_as(hidden)``)."""
    if data["op"] == "type_as":
        return [data["args"][0]] if isinstance(data["args"][0], Ref) else []
    return refs(data["args"], data["kwargs"])


def param_dim(g: nx.DiGraph, name: str, dim: int) -> tuple[str, int] | None:
    """``(parameter placeholder, its dim)`` that dim ``dim`` of node ``name`` is, if ``name`` is a
    chain of one-tensor ops on a parameter or buffer; else None.

    The chain's links may have other readers (a decay read at every step of an unrolled scan):
    sharding the parameter changes every reader, so each must meet the heads on the same dim,
    which :func:`stray_param_reads` checks once the pass has seen them all.
    """
    found = _chain_source(g, name, dim)
    if found is None:
        return None
    source = g.nodes[found[0]]
    # A module traced alone gets the table of a module handed to it as an input (table_lookup).
    looked_up = source["kind"] == "input" and g.graph.get("module_alone") and any(
        g.nodes[s]["op"] == "embedding" for s in g.successors(found[0]))
    if source["kind"] not in ("param", "buffer") and not looked_up:
        return None
    return found


@drop_check(order=30)
def stray_param_reads(flow) -> dict[str, str]:
    """Candidates whose shard met a parameter (:meth:`~autotp.synth.flow.Flow.shard_param`)
    that some reader reads whole: every read on the chains from the parameter to the operands that
    met the heads must be one of those meetings or the next link of a chain.

    Returns:
        For each candidate that met such a parameter, why it is dropped.
    """
    g, bad = flow.g, {}
    for param, uses in flow.param_uses.items():
        operands = {operand for operand, _ in uses}
        below = nx.descendants(g, param) | {param}
        chain = set().union(*({o} | (nx.ancestors(g, o) & below) for o in operands))
        stray = [(node, succ) for node in chain for succ in g.successors(node)
                 if g.nodes[succ]["op"] not in SINKS and succ not in chain and (node, succ) not in uses]
        if not stray:
            continue
        _, succ = min(stray, key=lambda pair: g.nodes[pair[1]]["order"])
        reason = (f"{g.nodes[param]['param']} would be sharded with the heads where they meet it, but "
                  f"{g.nodes[succ]['op']} in {g.nodes[succ]['module'] or 'the root'} reads it whole")
        for _, met in uses:
            state = flow.state.get(met)
            for origin in getattr(state, "origins", ()):
                bad.setdefault(origin, reason)
    return bad


def factory_dim(g: nx.DiGraph, name: str, dim: int) -> tuple[str, int] | None:
    """``(factory node, its dim)`` that dim ``dim`` of node ``name`` is, if ``name`` is a chain of
    one-tensor ops on a constant tensor made from sizes alone (``torch.zeros(b, heads, dk, dv)``,
    a scan's initial state); else None.

    Such a tensor meets the heads' shard at its per-rank size only if the code sizes it from the
    per-rank shapes (``key.shape[1]``) or from attributes divided by tp: the shape proof
    (:mod:`autotp.synth.shape_proof`) runs the module at per-rank widths and requires exactly that,
    of it and of every other reader (one that needs it whole would get the wrong shape there).
    It has no gradient and the same values everywhere, so it may have several readers.
    """
    found = _chain_source(g, name, dim)
    if found is None:
        return None
    data = g.nodes[found[0]]
    if data["kind"] != "call" or data["op"] not in CONSTANT_FACTORIES or value_refs(data):
        return None
    return found


# Deepest pointwise tree :func:`tree_leaves` follows.
MAX_TREE_DEPTH = 6


def tree_leaves(g: nx.DiGraph, name: str, dim: int, nodes: dict[str, int],
                depth: int = MAX_TREE_DEPTH) -> list | None:
    """``[(chain, dim, parent, source), ...]``: the chains of one-tensor ops on a parameter, buffer or
    constant factory that node ``name``, a tree of pointwise ops over such chains only, is computed
    from, each with its dim that lines up with ``dim``, the tree node that reads it, and what the
    chain starts from (:func:`param_dim`, :func:`factory_dim`); None if ``name`` is no such tree (a
    single chain is not a tree: the callers try chains first). The tree's own nodes are written into
    ``nodes`` (node -> its dim that lines up), complete only where the result is not None. They may
    be read elsewhere: :func:`stray_tree_reads` checks those reads once the pass has seen them all.

    An operand broadcast along ``dim`` (size 1 or absent there) takes no part, unless it has a
    gradient (made from parameters): every rank would then hold a partial one.
    """
    data = g.nodes[name]
    inputs = value_refs(data)
    if depth == 0 or data["kind"] != "call" or not data["shape"]:
        return None
    if data["op"] not in ELEMENTWISE or len(inputs) < 2:
        if data["op"] not in SINGLE_INPUT or len(inputs) != 1 or not isinstance(data["args"][0], Ref):
            return None
        at = source_dim(g, name, dim)
        nodes[name] = dim
        return None if at is None else tree_leaves(g, inputs[0].name, at, nodes, depth - 1)
    nodes[name] = dim
    found = []
    for ref in inputs:
        shape = g.nodes[ref.name]["shape"]
        if shape is None:
            return None
        at = dim - (len(data["shape"]) - len(shape))
        if at < 0 or shape[at] == 1:
            if made_from_params(g, ref.name):
                return None
            continue
        if shape[at] != data["shape"][dim]:
            return None
        source = param_dim(g, ref.name, at) or factory_dim(g, ref.name, at)
        if source is not None:
            found.append((ref.name, at, name, source))
            continue
        below = tree_leaves(g, ref.name, at, nodes, depth - 1)
        if below is None:
            return None
        found += below
    return found or None


@drop_check(order=40)
def stray_tree_reads(flow) -> dict[str, str]:
    """Candidates whose shard met a pointwise tree over parameters and constants
    (:meth:`~autotp.synth.flow.Flow.shard_tree`) one of whose nodes some op reads whole: every
    reader of a tree node must be a node of a tree too or one of the meetings recorded for it."""
    g, bad = flow.g, {}
    for node in flow.tree_dims:
        met = {reader for reader, _ in flow.tree_uses.get(node, ())}
        stray = [s for s in g.successors(node) if g.nodes[s]["op"] not in SINKS and s not in flow.tree_dims
                 and s not in met]
        if not stray:
            continue
        succ = min(stray, key=lambda s: g.nodes[s]["order"])
        reason = (f"a value computed from parameters and constants would be made per rank where it meets the "
                  f"heads, but {g.nodes[succ]['op']} in {g.nodes[succ]['module'] or 'the root'} reads it whole")
        for origins in flow.tree_origins.get(node, ()):
            for origin in origins:
                bad.setdefault(origin, reason)
    return bad


def _chain_source(g: nx.DiGraph, name: str, dim: int) -> tuple[str, int] | None:
    """The node a chain of one-tensor ops ending at ``name`` starts from, with the dim ``dim``
    becomes there; None if the chain is not such."""
    while g.nodes[name]["kind"] == "call":
        data = g.nodes[name]
        inputs = value_refs(data)
        if not inputs and data["op"] in CONSTANT_FACTORIES:
            break
        looked_up = table_lookup(g, name, dim)
        if looked_up is not None:
            name, dim = looked_up, 1
            continue
        if data["op"] not in SINGLE_INPUT or len(inputs) != 1 or not isinstance(data["args"][0], Ref):
            return None
        source = inputs[0].name
        dim = source_dim(g, name, dim)
        if dim is None:
            return None
        name = source
    return name, dim


def table_lookup(g: nx.DiGraph, name: str, dim: int) -> str | None:
    """The table (parameter placeholder) that ``embedding`` node ``name`` looks rows up in, when
    ``dim`` is its output's last dim (the table's columns) and the indices carry no gradient (made
    from positions, not from parameters); else None.

    A table with one column per head (T5's relative position bias, ``Embedding(buckets, heads)``)
    is then a per-head parameter: cut on its columns with the heads, each rank looks up its own
    heads' biases, and the rows' gradients are each rank's own.
    """
    data = g.nodes[name]
    if data["op"] != "embedding" or len(data["args"]) < 2 or not data["shape"]:
        return None
    table, index = data["args"][:2]
    if not isinstance(table, Ref) or not isinstance(index, Ref) or dim % len(data["shape"]) != len(data["shape"]) - 1:
        return None
    # In a module traced alone, the table of a module handed to it as an argument is an input.
    kinds = ("param", "input", "buffer") if g.graph.get("module_alone") else ("param",)
    if g.nodes[table.name]["kind"] not in kinds or made_from_params(g, index.name):
        return None
    if g.nodes[index.name]["kind"] == "input" and not g.graph.get("module_alone"):
        return None  # ids the model is given (a token embedding): rows per token, not per head
    return table.name


def chain_dims(g: nx.DiGraph, param_shards: dict[str, int]) -> dict[str, int]:
    """For each node on the one-tensor chains from a sharded parameter to the ops that read it with
    the heads (``view``, ``expand`` of a sink): the dim that holds the parameter's sharded dim.

    At per-rank widths those nodes hold the per-rank entries, so the shape proof divides that dim.
    """
    found = {}
    for start, start_dim in param_shards.items():
        todo = [(start, start_dim)]
        while todo:
            node, dim = todo.pop()
            for succ in g.successors(node):
                data = g.nodes[succ]
                if data["op"] == "embedding" and data["shape"] and dim == 1 \
                        and table_lookup(g, succ, len(data["shape"]) - 1) == node:
                    found[succ] = len(data["shape"]) - 1  # rows looked up in a table cut on its columns
                    todo.append((succ, found[succ]))
                    continue
                if succ in found or data["op"] in SINKS or data["op"] not in SINGLE_INPUT \
                        or len(value_refs(data)) != 1 or not data["shape"]:
                    continue
                dims = [d for d in range(len(data["shape"])) if source_dim(g, succ, d) == dim]
                if len(dims) == 1:
                    found[succ] = dims[0]
                    todo.append((succ, dims[0]))
    return found


def broadcast_source(g: nx.DiGraph, name: str) -> tuple[str, tuple[int, int], str] | None:
    """``(Linear node, (start, stop), first node of the span)``: the output features of the one
    Linear that replicated tensor ``name`` (broadcast along the sharded dim where it meets the
    shard) is computed from, if its gradient can be made whole by all-reducing that span of the
    Linear's output gradient; else None.

    Here: the span is the Linear's whole output or one part of its only reader, a ``split`` along
    its features, and no parameter enters on the way to ``name`` (its gradient would be partial
    too); buffers and inputs may (rope's cos and sin). That every gradient reaching the span is a
    per-rank share, as ``name``'s is, is checked once the propagation is done, over all the
    places the span meets the shard (:func:`~autotp.synth.fixpoint.broadcast_leaks`).

    >>> from autotp.synth.graph import add_node
    >>> g = nx.DiGraph()
    >>> _ = add_node(g, "w", "placeholder", kind="param", param="a.wkv.weight", shape=(12, 8))
    >>> _ = add_node(g, "x", "placeholder", kind="input", shape=(2, 8))
    >>> _ = add_node(g, "kv", "linear", (Ref("x"), Ref("w")), shape=(2, 12), module="a.wkv")
    >>> _ = add_node(g, "s", "split_with_sizes", (Ref("kv"), [8, 4], -1), shape=None)
    >>> _ = add_node(g, "k", "getitem", (Ref("s"), 0), shape=(2, 8))
    >>> _ = add_node(g, "r", "getitem", (Ref("s"), 1), shape=(2, 4))
    >>> _ = add_node(g, "u", "unsqueeze", (Ref("r"), 1), shape=(2, 1, 4))
    >>> _ = add_node(g, "e", "expand", (Ref("u"), [-1, 4, -1]), shape=(2, 4, 4))
    >>> broadcast_source(g, "e")
    ('kv', (8, 12), 'r')
    >>> _ = add_node(g, "o", "add", (Ref("kv"), 1.0), shape=(2, 12))  # the whole output read too
    >>> broadcast_source(g, "e") is None
    True
    """
    found = upstream_linears(g, name)
    if found is None:
        return None  # a parameter's gradient on the way would be partial and not reduced
    linears, above = found
    if len(linears) != 1:
        return None
    (linear,) = linears
    width = g.nodes[linear]["shape"][-1]
    taken = [s for s in g.successors(linear) if s in above]
    span, start = (0, width), linear
    if any(g.nodes[s]["op"] in SPLITS for s in taken):
        if len(taken) != 1 or readers(g, linear) != 1:
            return None
        split = g.nodes[taken[0]]
        args = split["args"]
        at = args[2] if len(args) > 2 else split["kwargs"].get("dim", 0)
        if at % len(g.nodes[linear]["shape"]) != len(g.nodes[linear]["shape"]) - 1:
            return None
        sizes = args[1] if isinstance(args[1], (list, tuple)) else [args[1]] * -(-width // args[1])
        picked = [s for s in g.successors(taken[0]) if s in above]
        if len(picked) != 1 or g.nodes[picked[0]]["op"] != "getitem":
            return None
        index = g.nodes[picked[0]]["args"][1]
        begin = sum(sizes[:index])
        span, start = (begin, min(begin + sizes[index], width)), picked[0]
    return linear, span, start


def module_output_sources(g: nx.DiGraph, name: str) -> list[tuple[str, tuple[int, int], str, str]] | None:
    """``[(node, (0, width), node, module)]``: the outputs of the modules that replicated tensor
    ``name`` (broadcast along the sharded dim where it meets the shard) is computed from by ops of
    the reading module alone, with no parameter entering on the way; else None. Several when the
    way joins outputs of several modules (keys cut from a norm, joined to compressed ones).

    For a broadcast operand with parameters behind it (a norm's weight over a row's output): all-
    reducing the gradient of that module's whole output makes every gradient behind it whole, the
    parameters' included. Nothing in the module may be sharded (checked by the caller, which knows
    the shards). The way from that output to ``name`` may
    branch and join (a rotary embedding: ``x * cos + rotate(x) * sin``) as long as every other
    value entering it carries no gradient (computed from inputs and buffers only: cos, sin); that
    no other reader of the way would count the reduced gradient twice is checked after the
    propagation (:func:`~autotp.synth.fixpoint.broadcast_leaks`).

    >>> from autotp.synth.graph import add_node
    >>> g = nx.DiGraph()
    >>> _ = add_node(g, "w", "placeholder", kind="param", param="m.norm.weight", shape=(4,))
    >>> _ = add_node(g, "x", "placeholder", kind="input", shape=(2, 4))
    >>> _ = add_node(g, "n", "mul", (Ref("x"), Ref("w")), shape=(2, 4), module="m.norm", stack=("m", "m.norm"))
    >>> _ = add_node(g, "u", "unsqueeze", (Ref("n"), 1), shape=(2, 1, 4), module="m", stack=("m",))
    >>> module_output_sources(g, "u")
    [('n', (0, 4), 'n', 'm.norm')]
    >>> _ = add_node(g, "c", "placeholder", kind="buffer", param="m.cos", shape=(2, 4))
    >>> _ = add_node(g, "a", "mul", (Ref("n"), Ref("c")), shape=(2, 4), module="m", stack=("m",))
    >>> _ = add_node(g, "b", "neg", (Ref("n"),), shape=(2, 4), module="m", stack=("m",))
    >>> _ = add_node(g, "r", "add", (Ref("a"), Ref("b")), shape=(2, 4), module="m", stack=("m",))
    >>> module_output_sources(g, "r")  # two ways from the norm's output, joined with a buffer's values
    [('n', (0, 4), 'n', 'm.norm')]
    >>> _ = add_node(g, "j", "add", (Ref("r"), Ref("w")), shape=(2, 4), module="m", stack=("m",))
    >>> module_output_sources(g, "j") is None  # a parameter enters: its gradient would stay partial
    True
    """
    stack, memo = g.nodes[name]["stack"], {}
    sources, seen, todo = set(), {name}, [name]
    while todo:
        data = g.nodes[todo.pop()]
        inputs = [r.name for r in refs(data["args"], data["kwargs"])]
        if data["kind"] != "call" or data["stack"] != stack or any(g.nodes[i]["kind"] == "param" for i in inputs):
            return None
        for prev in inputs:
            pdata = g.nodes[prev]
            if prev in seen or pdata["op"] in SINKS or not carries_grad(g, prev, memo):
                continue  # no gradient of its own: cos and sin, a mask
            seen.add(prev)
            if pdata["kind"] == "call" and any(m not in stack for m in pdata["stack"]):
                sources.add(prev)  # the output of a module inside the reading one
            else:
                todo.append(prev)
    found = []
    for prev in sorted(sources):
        shape = g.nodes[prev]["shape"]
        if not shape:
            return None
        left = [m for m in g.nodes[prev]["stack"] if m not in stack]
        found.append((prev, (0, shape[-1]), prev, left[0]))
    return found or None


def carries_grad(g: nx.DiGraph, name: str, memo: dict) -> bool:
    """Whether a gradient reaches the parameters through node ``name``: it is a parameter, or an op
    that reads the values of one where a gradient flows (a fresh ``new_zeros(x, ...)`` does not, nor
    the index of a ``scatter``). ``memo`` caches the answers of one graph."""
    def inputs(node):
        data = g.nodes[node]
        if data["kind"] != "call" or data["op"] in SINKS:
            return []
        return _grad_inputs(g, node)  # not a fresh tensor's shape source, not an index, not a mask

    stack = [(name, iter(inputs(name)))] if name not in memo else []
    entered = {name}
    while stack:  # post-order, iteratively: a traced model's graph is deep
        node, rest = stack[-1]
        nxt = next((i for i in rest if i not in memo and i not in entered), None)
        if nxt is not None:
            entered.add(nxt)
            stack.append((nxt, iter(inputs(nxt))))
            continue
        stack.pop()
        data = g.nodes[node]
        memo[node] = data["kind"] == "param" or any(memo.get(i, False) for i in inputs(node))
    return memo[name]
