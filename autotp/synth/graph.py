"""The traced program as a ``networkx.DiGraph``: one node per exported fx node, edges along data flow.

Node attributes (all plain data, so tests can build graphs by hand with :func:`add_node`):

- ``op``: short op name (``"linear"``, ``"view"``, ``"scaled_dot_product_attention"``), or
  ``"placeholder"`` / ``"output"``; higher-order ops keep their Python name.
- ``kind``: ``"param"``, ``"buffer"``, ``"input"`` (placeholders), ``"call"`` or ``"output"``.
- ``param``: the FQN of the parameter or buffer a placeholder stands for.
- ``module``: FQN of the innermost module that ran the node (``""`` for the root).
- ``stack``: FQNs of every module the node ran in, outermost first.
- ``shape``: output shape as a tuple of ints, or ``None`` (tuples, scalars, no output).
- ``args`` / ``kwargs``: the call arguments, with graph nodes replaced by :class:`Ref`.

Edge ``u -> v`` means v reads u's output.
"""

from __future__ import annotations

from typing import Any, NamedTuple

import networkx as nx
import torch


class Ref(NamedTuple):
    """A reference to another graph node inside ``args`` / ``kwargs``."""

    name: str


def op_name(target: Any) -> str:
    """Short name of an fx call target: ``aten.linear.default`` -> ``"linear"``."""
    name = getattr(target, "_opname", None)  # OpOverload
    if name is None:
        name = getattr(target, "__name__", str(target))
    return name


def add_node(g: nx.DiGraph, name: str, op: str, args=(), *, kwargs=None, shape=None, module="", stack=None,
             kind="call", param=None) -> str:
    """Add one node (and its input edges) to ``g``; used by :func:`build_graph` and by tests.

    >>> g = nx.DiGraph()
    >>> _ = add_node(g, "x", "placeholder", kind="input", shape=(2, 4))
    >>> _ = add_node(g, "y", "relu", (Ref("x"),), shape=(2, 4))
    >>> list(g.predecessors("y"))
    ['x']
    """
    kwargs = kwargs or {}
    stack = tuple(stack) if stack is not None else ((module,) if module else ())
    g.add_node(name, op=op, args=tuple(args), kwargs=dict(kwargs), shape=_shape(shape), module=module,
               stack=stack, kind=kind, param=param, order=g.number_of_nodes())
    for ref in refs(args, kwargs):
        g.add_edge(ref.name, name)
    return name


def _shape(shape):
    return tuple(_size(s) for s in shape) if shape is not None else None


# A size the trace could not know (tokens routed to an expert, ``nonzero``): never a head or a
# feature count, so no analysis step can mistake it for one.
UNKNOWN_SIZE = -1


def _size(size) -> int:
    try:
        return int(size)
    except Exception:  # a data-dependent SymInt: torch raises its own guard error types
        return UNKNOWN_SIZE


def refs(args, kwargs=None):
    """Every :class:`Ref` in ``args`` and ``kwargs``, in argument order (lists included)."""
    found = []
    for value in list(args) + list((kwargs or {}).values()):
        if isinstance(value, Ref):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, Ref))
    return found


def _plain(value):
    """fx argument -> graph attribute: Nodes become Refs, containers are rebuilt, the rest kept."""
    if isinstance(value, torch.fx.Node):
        return Ref(value.name)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v) for v in value) if not hasattr(value, "_fields") else value
    return value


def _value_shape(node: torch.fx.Node):
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _module_stack(node: torch.fx.Node) -> tuple[str, ...]:
    stack = node.meta.get("nn_module_stack") or {}
    return tuple(fqn for fqn, _ in stack.values() if fqn)


def build_graph(program: torch.export.ExportedProgram) -> nx.DiGraph:
    """Turn an exported program into the analysis graph (see the module docstring).

    Args:
        program: the result of ``torch.export.export``.
    Returns:
        A DiGraph whose nodes are in program order (``order`` attribute).
    """
    signature = program.graph_signature
    sources = {**{k: ("param", v) for k, v in signature.inputs_to_parameters.items()},
               **{k: ("buffer", v) for k, v in signature.inputs_to_buffers.items()}}
    g = nx.DiGraph()
    for node in program.graph.nodes:
        if node.op == "placeholder":
            kind, param = sources.get(node.name, ("input", None))
            add_node(g, node.name, "placeholder", kind=kind, param=param, shape=_value_shape(node))
        elif node.op == "output":
            add_node(g, node.name, "output", _plain(node.args), kind="output")
        elif node.op == "call_function":
            stack = _module_stack(node)
            add_node(g, node.name, op_name(node.target), _plain(node.args), kwargs=_plain(node.kwargs),
                     shape=_value_shape(node), module=stack[-1] if stack else "", stack=stack)
    _products_as_linear(g)
    return g


# Ops a weight may pass through on its way to a product and stay the same matrix.
_WEIGHT_CASTS = frozenset({"to", "_to_copy", "alias", "detach", "type_as", "clone", "contiguous", "lift_fresh_copy"})


def _matrix_param(g: nx.DiGraph, ref) -> bool:
    """Whether ``ref`` is a 2-D parameter, possibly cast."""
    name = ref.name if isinstance(ref, Ref) else None
    while name is not None and g.nodes[name]["kind"] == "call" and g.nodes[name]["op"] in _WEIGHT_CASTS:
        inputs = refs(g.nodes[name]["args"])
        name = inputs[0].name if inputs else None
    return name is not None and g.nodes[name]["kind"] == "param" and len(g.nodes[name]["shape"] or ()) == 2


def _products_as_linear(g: nx.DiGraph) -> None:
    """Rewrite products by a weight stored ``(in, out)`` as ``linear(x, W, b)`` nodes marked
    ``weight_in_out`` (transformers' ``Conv1D``: ``addmm(b, x, W)``; ``x @ W`` without a bias),
    so that every analysis step reads them as the Linear they are: input first, weight second.

    >>> g = nx.DiGraph()
    >>> for n in ("b", "w"):
    ...     _ = add_node(g, n, "placeholder", kind="param", param=f"c.{n}", shape=(8,) if n == "b" else (4, 8))
    >>> _ = add_node(g, "x", "placeholder", kind="input", shape=(6, 4))
    >>> _ = add_node(g, "y", "addmm", (Ref("b"), Ref("x"), Ref("w")), shape=(6, 8))
    >>> _products_as_linear(g)
    >>> g.nodes["y"]["op"], g.nodes["y"]["args"][0], g.nodes["y"]["weight_in_out"]
    ('linear', Ref(name='x'), True)
    """
    for name, data in g.nodes(data=True):
        args = data["args"]
        if data["op"] == "addmm" and len(args) == 3 and not data["kwargs"] and _matrix_param(g, args[2]):
            data.update(op="linear", args=(args[1], args[2], args[0]), weight_in_out=True)
        elif data["op"] in ("mm", "matmul") and len(args) == 2 and _matrix_param(g, args[1]) \
                and not _matrix_param(g, args[0]):
            data.update(op="linear", args=(args[0], args[1]), weight_in_out=True)


def producer_module(g: nx.DiGraph, name: str) -> str:
    """Module that produced node ``name``'s value; for parameters, the module owning the parameter."""
    data = g.nodes[name]
    if data["kind"] in ("param", "buffer"):
        return data["param"].rpartition(".")[0]
    return data["module"]


def common_module(stacks) -> str:
    """The innermost module every one of ``stacks`` (module FQNs, outermost first) runs inside.

    >>> common_module([("layers.0", "layers.0.attn"), ("layers.0", "layers.0.mlp")])
    'layers.0'
    """
    common = ""
    for level in zip(*stacks):
        if len(set(level)) > 1:
            break
        common = level[0]
    return common
