"""Graph queries the analysis and the idioms share: which nodes are Linear-like and which
parameter each multiplies by, which module reads a parameter, what a value is computed from, what a
module returns.

They read the graph alone (no propagation state), so they sit below :mod:`autotp.synth.fixpoint`
and every module it calls; ``analysis`` re-exports them under their old names.
"""

from __future__ import annotations

from dataclasses import dataclass

import networkx as nx

from autotp.synth.graph import Ref, common_module, refs
from autotp.synth.ops import (ELEMENTWISE, EXPERT_PRODUCTS, FIRST_VALUE_ONLY, GRADLESS_ARGS, GROUPED_MATMULS,
                              NO_VALUES, PASSTHROUGH, SELECTING_PRODUCTS, SINKS, STACKED_MATMULS)


# Ops a selected weight may go through between ``W[e]`` and the product (``W[e].T``).
_WEIGHT_VIEWS = PASSTHROUGH | {"transpose", "t", "numpy_T"}


def selected_weight(g: nx.DiGraph, name: str) -> tuple[str, bool] | None:
    """``(3-D parameter, transposed)`` when node ``name`` is one expert's weight ``P[e]`` (``select``
    of dim 0 by a constant), possibly transposed, and ``P`` is read only so, by products; else None.

    Read only so, because the parameter is sharded for its products: a reader of the whole (a norm
    of it) would get a shard.
    """
    swapped = False
    while g.nodes[name]["kind"] == "call" and g.nodes[name]["op"] in _WEIGHT_VIEWS:
        data = g.nodes[name]
        if data["op"] == "transpose" and sorted(x % 2 for x in data["args"][1:3]) != [0, 1]:
            return None
        swapped ^= data["op"] in ("transpose", "t", "numpy_T")
        name = data["args"][0].name
    data = g.nodes[name]
    if data["kind"] != "call" or data["op"] != "select" or data["args"][1:2] != (0,) \
            or not isinstance(data["args"][2], int):
        return None
    param = data["args"][0]
    if not isinstance(param, Ref) or g.nodes[param.name]["kind"] != "param" or len(g.nodes[param.name]["shape"]) != 3:
        return None
    return (param.name, swapped) if _read_by_products(g, param.name) else None


def _read_by_products(g: nx.DiGraph, param: str) -> bool:
    """Whether every reader of ``param`` is ``param[e]`` that only products read as their weight."""
    for select in _readers(g, param):
        data = g.nodes[select]
        if data["op"] != "select" or data["args"][1:2] != (0,):
            return False
        todo = [select]
        while todo:
            node = todo.pop()
            for user in _readers(g, node):
                data = g.nodes[user]
                if data["op"] in _WEIGHT_VIEWS:
                    todo.append(user)
                elif data["op"] not in EXPERT_PRODUCTS or data["args"][1:2] != (Ref(node),):
                    return False
    return True


def _readers(g: nx.DiGraph, name: str) -> list[str]:
    return [s for s in g.successors(name) if g.nodes[s]["op"] not in SINKS]


def reading_module(g: nx.DiGraph, param: str) -> tuple[str, str]:
    """``(module, name relative to it)`` of the module whose forward reads placeholder ``param``.

    Usually its owner. A child's parameter read in its parent's own code (``F.conv1d(x,
    self.conv1d.weight)``, the child's forward never called) belongs to the innermost module
    around every read: a style's forward hooks must run there to hand it over as a local tensor.
    """
    fqn = g.nodes[param]["param"]
    owner, _, name = fqn.rpartition(".")
    stacks = [g.nodes[s]["stack"] for s in g.successors(param) if g.nodes[s]["op"] not in SINKS]
    if not stacks or all(owner in stack for stack in stacks) or not owner:
        return owner, name
    module = common_module(stacks)
    return module, fqn[len(module) + 1:] if module else fqn


def _value_inputs(g: nx.DiGraph, name: str) -> list[str]:
    """The nodes whose values ``name`` is computed from (not those lending a dtype or shape)."""
    data = g.nodes[name]
    if data["kind"] != "call":
        return list(g.predecessors(name))
    if data["op"] in NO_VALUES:
        return []
    inputs = refs(data["args"], data["kwargs"])
    if data["op"] in FIRST_VALUE_ONLY:
        inputs = inputs[:1]
    return [r.name for r in inputs]


def _grad_inputs(g: nx.DiGraph, name: str) -> list[str]:
    """:func:`_value_inputs` less the arguments through which no gradient flows (a mask, an index:
    :data:`~autotp.synth.ops.GRADLESS_ARGS`)."""
    data = g.nodes[name]
    inputs = _value_inputs(g, name)
    if data["kind"] != "call" or data["op"] not in GRADLESS_ARGS:
        return inputs
    at, key = GRADLESS_ARGS[data["op"]]
    arg = data["args"][at] if len(data["args"]) > at else data["kwargs"].get(key)
    return [n for n in inputs if not (isinstance(arg, Ref) and n == arg.name)]


def _only_params_behind(g: nx.DiGraph, name: str) -> bool:
    """Whether ``name`` is computed from parameters, buffers and constants alone (no Linear, no
    model input behind it): their gradients are their modules' to reduce (``param_roles``)."""
    seen, todo = {name}, [name]
    while todo:
        for pred in _value_inputs(g, todo.pop()):
            data = g.nodes[pred]
            if pred in seen or data["op"] in SINKS:
                continue
            if data["kind"] == "input" or (data["kind"] == "call" and is_linear(g, pred)):
                return False
            seen.add(pred)
            todo.append(pred)
    return True


def upstream_linears(g: nx.DiGraph, name: str) -> tuple[set[str], set[str]] | None:
    """``(the Linear nodes nearest above name, the nodes between)``: the walk back stops at each
    Linear. None if a parameter enters on the way other than as a Linear's weight (its gradient
    would have to be reduced too). Buffers and inputs may enter (rope's cos and sin)."""
    seen, todo, linears = {name}, [name], set()
    while todo:
        for pred in _grad_inputs(g, todo.pop()):
            if pred in seen or pred in linears or g.nodes[pred]["op"] in SINKS:
                continue
            kind = g.nodes[pred]["kind"]
            if kind == "param":
                return None
            if kind == "call" and is_linear(g, pred):
                linears.add(pred)
            elif kind == "call":
                seen.add(pred)
                todo.append(pred)
    return linears, seen


def param_source(g: nx.DiGraph, name: str) -> str | None:
    """The parameter placeholder that ``name`` is a cast/pointwise function of, if any."""
    while True:
        data = g.nodes[name]
        if data["kind"] == "param":
            return name
        inputs = [r.name for r in refs(data["args"], data["kwargs"])]
        if data["kind"] != "call" or len(inputs) != 1 or data["op"] not in PASSTHROUGH | ELEMENTWISE:
            return None
        name = inputs[0]


@dataclass(frozen=True)
class Weight:
    """The parameter a Linear-like node multiplies by, and which of its dims are out / in features."""

    node: str
    out_dim: int
    in_dim: int


def weight_of(g: nx.DiGraph, name: str) -> Weight | None:
    """The parameter of a ``linear`` (2-D) or grouped matmul (3-D) node, or None."""
    data = g.nodes[name]
    args = data["args"]
    if len(args) < 2 or not isinstance(args[1], Ref):
        return None
    if data["op"] in SELECTING_PRODUCTS:  # one expert's weight ``P[e]`` in a per-expert loop
        found = selected_weight(g, args[1].name)
        if found is not None:  # P[e] is (in, out) for a matmul, (out, in) for F.linear
            swapped = found[1] ^ (data["op"] == "linear")
            return Weight(found[0], 1, 2) if swapped else Weight(found[0], 2, 1)
    if data["op"] == "linear":
        source = param_source(g, args[1].name)
        if not source or len(g.nodes[source]["shape"] or ()) != 2:
            return None
        return Weight(source, 1, 0) if data.get("weight_in_out") else Weight(source, 0, 1)
    if data["op"] in GROUPED_MATMULS | STACKED_MATMULS:
        node, swapped = args[1].name, False
        while g.nodes[node]["kind"] == "call" and g.nodes[node]["op"] in ("transpose", "t", *PASSTHROUGH):
            if g.nodes[node]["op"] != "transpose" or sorted(x % 3 for x in g.nodes[node]["args"][1:3]) == [1, 2]:
                swapped ^= g.nodes[node]["op"] == "transpose"
            node = g.nodes[node]["args"][0].name
        if g.nodes[node]["kind"] == "param" and len(g.nodes[node]["shape"]) == 3:
            return Weight(node, 1, 2) if swapped else Weight(node, 2, 1)
    return None


def _selects_expert(g: nx.DiGraph, name: str) -> bool:
    """Whether Linear-like node ``name`` multiplies by one expert's weight ``P[e]``."""
    args = g.nodes[name]["args"]
    return g.nodes[name]["op"] in SELECTING_PRODUCTS and isinstance(args[1], Ref) and selected_weight(g, args[1].name) is not None


def _only_reader(g: nx.DiGraph, weight: str, name: str) -> bool:
    """Whether node ``name`` is the one reader of ``weight`` (through casts and transposes): a raw
    parameter read elsewhere too (a second product, a norm of it) would be read there as a shard."""
    while True:
        readers = [s for s in g.successors(weight) if g.nodes[s]["op"] not in SINKS]
        if readers == [name]:
            return True
        if len(readers) != 1 or g.nodes[readers[0]]["op"] not in PASSTHROUGH | {"t", "numpy_T", "transpose"}:
            return False
        weight = readers[0]


def raw_like(g: nx.DiGraph, name: str) -> bool:
    """:func:`raw_weight` but for the weight being read by this product alone."""
    weight = linear_weight(g, name)
    stacked = g.nodes[name]["op"] in STACKED_MATMULS
    if weight is not None and len(g.nodes[weight]["shape"]) == 3 and _selects_expert(g, name):
        return False  # ``x @ P[e]`` in a per-expert loop: grouped experts (``expert_roles``)
    if weight is None or len(g.nodes[weight]["shape"]) != (3 if stacked else 2):
        return False
    leaf = g.nodes[weight]["param"].rpartition(".")[2]
    return reading_module(g, weight)[0] == g.nodes[name]["module"] \
        and (leaf != "weight" or stacked or bool(g.nodes[name].get("raw_weight")))


def raw_weight(g: nx.DiGraph, name: str) -> bool:
    """Whether Linear-like node ``name`` multiplies by a raw parameter of the module whose code runs
    it (``x @ self.wq.T``, ``F.linear(x, self.wk)``, an einsum, a ``bmm`` by a stacked 3-D weight):
    no ``nn.Linear``'s weight, so
    the module gets :class:`~autotp.styles.HeadParams` (``columns`` / ``rows``) rather than a Linear style."""
    return raw_like(g, name) and _only_reader(g, linear_weight(g, name), name)


def linear_weight(g: nx.DiGraph, name: str) -> str | None:
    """The parameter placeholder a Linear-like node multiplies by, or None."""
    weight = weight_of(g, name)
    return weight.node if weight else None


def module_of(g: nx.DiGraph, name: str) -> str:
    """Module a Linear/Embedding node belongs to: the module that ran it (export names a tied
    parameter after one of its users only), or for a grouped matmul the owner of its 3-D weight."""
    data = g.nodes[name]
    weight = linear_weight(g, name) if is_linear(g, name) else None
    if weight is not None and (len(g.nodes[weight]["shape"]) == 3 or not data["module"]):
        return g.nodes[weight]["param"].rpartition(".")[0]
    return data["module"]


def is_linear(g: nx.DiGraph, name: str) -> bool:
    """A ``linear`` or grouped-matmul node whose weight is a parameter."""
    return g.nodes[name]["op"] in GROUPED_MATMULS | STACKED_MATMULS | {"linear"} and weight_of(g, name) is not None


def part_sizes(ranges, width: int) -> tuple[int, ...]:
    """The finest parts that the cuts ``ranges`` of a ``width``-feature output make.

    >>> part_sizes([(0, 8), (8, 20), (8, 12), (12, 16), (16, 20)], 20)
    (8, 4, 4, 4)
    """
    points = sorted({0, width} | {p for r in ranges for p in r})
    return tuple(b - a for a, b in zip(points, points[1:]))


def _input_alias(g: nx.DiGraph, name: str, module: str) -> bool:
    """Whether ``name`` is only a cast/copy of a value from outside ``module`` (``x.to(float32)``
    on a float32 ``x`` returns ``x`` itself, so the caller may keep using it)."""
    while g.nodes[name]["op"] in PASSTHROUGH:
        inputs = [r.name for r in refs(g.nodes[name]["args"])]
        if not inputs:
            return False
        name = inputs[0]
        if module not in g.nodes[name]["stack"]:
            return True
    return False


def module_outputs(g: nx.DiGraph, module: str) -> tuple[list[str], list[str]]:
    """Nodes of ``module`` read from outside it, and those outside readers (casts that return
    the module's own input are not its outputs)."""
    outputs, readers = [], []
    for name, data in g.nodes(data=True):
        if module not in data["stack"] or _input_alias(g, name, module):
            continue
        outside = [s for s in g.successors(name) if module not in g.nodes[s]["stack"]]
        if outside:
            outputs.append(name)
            readers.extend(outside)
    return outputs, readers
