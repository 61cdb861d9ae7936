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
    return g


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
