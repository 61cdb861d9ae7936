"""The traced program as a ``networkx.DiGraph``: one node per exported fx node, edges along data flow.

Node attributes (all plain data, so tests can build graphs by hand with :func:`add_node`):

- ``op``: short op name (``"linear"``, ``"view"``, ``"scaled_dot_product_attention"``), or
  ``"placeholder"`` / ``"output"``; higher-order ops keep their Python name.
- ``kind``: ``"param"``, ``"buffer"``, ``"input"`` (placeholders), ``"call"`` or ``"output"``.
- ``param``: the FQN of the parameter or buffer a placeholder stands for.
- ``module``: FQN of the innermost module that ran the node (``""`` for the root).
- ``stack``: FQNs of every module the node ran in, outermost first.
- ``shape``: output shape as a tuple of ints, or ``None`` (tuples, scalars, no output).
- ``dtype``: the output's dtype (a tuple of them for a tuple output), where the trace recorded it;
  absent on nodes made by hand or by the graph's own rewrites.
- ``args`` / ``kwargs``: the call arguments, with graph nodes replaced by :class:`Ref`.

Edge ``u -> v`` means v reads u's output.

Long because the graph is built in one place with its normalization: products written as
``matmul`` / ``einsum`` / ``W @ x`` (and higher-order ops read through) become ``linear`` nodes here,
so the shard rules see one op per Linear.
"""

from __future__ import annotations

import functools
import operator
from typing import Any

import networkx as nx
import torch

from autotp.errors import TraceError
from autotp.synth.ops import TRANSPOSES, WEIGHT_CASTS
from autotp.synth.trace import VALUE_BRANCHES
from autotp.synth.ref import Ref, refs  # noqa: F401 (re-exported: the graph's node references)


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


def _plain(value, alias=None):
    """fx argument -> graph attribute: Nodes become Refs (or what ``alias`` maps their name to:
    the values a read-through region computes), containers are rebuilt, the rest kept."""
    if isinstance(value, torch.fx.Node):
        if alias and value.name in alias:
            return alias[value.name]
        return Ref(value.name)
    if isinstance(value, (list, tuple)):
        return type(value)(_plain(v, alias) for v in value) if not hasattr(value, "_fields") else value
    return value


def _value_shape(node: torch.fx.Node):
    val = node.meta.get("val")
    return tuple(val.shape) if isinstance(val, torch.Tensor) else None


def _value_dtype(node: torch.fx.Node):
    """The dtype of a node's tensor output, or of each tensor of a tuple output (None elsewhere)."""
    val = node.meta.get("val")
    if isinstance(val, torch.Tensor):
        return val.dtype
    if isinstance(val, (tuple, list)):
        return tuple(v.dtype if isinstance(v, torch.Tensor) else None for v in val)
    return None


def _module_stack(node: torch.fx.Node) -> tuple[str, ...]:
    stack = node.meta.get("nn_module_stack") or {}
    return tuple(fqn for fqn, _ in stack.values() if fqn)


# Higher-order ops that run a traced region once on their operands, changing only a mode
# (autocast, grad mode) or the way it is compiled: the region's body is read as inline code. The
# value is the position of the region (a ``get_attr`` of a GraphModule) among the op's arguments;
# the operands are the region's placeholders, the last arguments (``invoke_subgraph`` puts an
# identifier string between the two).
READ_THROUGH = {
    "wrap_with_autocast": 4,  # (device, dtype, enabled, cache_enabled, region, *operands)
    "wrap_with_set_grad_enabled": 1,  # (enabled, region, *operands)
    "invoke_subgraph": 0,  # (region, identifier, *operands)
}


def build_graph(program: torch.export.ExportedProgram) -> nx.DiGraph:
    """Turn an exported program into the analysis graph (see the module docstring).

    Regions of the higher-order ops in :data:`READ_THROUGH` are inlined: their nodes are added
    under the op's name as prefix, and the ``getitem`` users of the op's result stand for the
    region's outputs.

    Args:
        program: the result of ``torch.export.export``.
    Returns:
        A DiGraph whose nodes are in program order (``order`` attribute).
    Raises:
        TraceError: the program calls a higher-order op (a region of code run under control of
            the op: ``cond``, ``flex_attention``...) that the graph cannot read through.
    """
    signature = program.graph_signature
    sources = {**{k: ("param", v) for k, v in signature.inputs_to_parameters.items()},
               **{k: ("buffer", v) for k, v in signature.inputs_to_buffers.items()}}
    g = nx.DiGraph()
    # The module whose value-dependent branches the program follows for its inputs only, if any.
    g.graph["value_branches"] = program.graph_module.meta.get(VALUE_BRANCHES)
    _add_nodes(g, program.graph_module, program.graph, sources=sources, alias={}, prefix="")
    _products_as_linear(g)
    return g


def _add_nodes(g: nx.DiGraph, owner: torch.fx.GraphModule, graph: torch.fx.Graph, *, sources: dict,
               alias: dict, prefix: str) -> None:
    """Add the nodes of ``graph`` to ``g`` in program order, reading through :data:`READ_THROUGH`
    regions. ``prefix`` is set for a region (a subgraph of ``owner``): its nodes are named
    ``prefix + name``, and its placeholders and output are its caller's business.

    ``alias`` maps fx node names to what stands for them in ``g``: a region's placeholders map to
    the operands of its call, ``getitem(op, i)`` to the region's i-th output, other nodes to their
    own (prefixed) name.
    """
    regions: dict[str, list] = {}  # a read-through op's name -> the values of its region's outputs
    for node in graph.nodes:
        if node.op == "placeholder" and not prefix:
            kind, param = sources.get(node.name, ("input", None))
            add_node(g, node.name, "placeholder", kind=kind, param=param, shape=_value_shape(node))
            g.nodes[node.name]["dtype"] = _value_dtype(node)
        elif node.op == "output" and not prefix:
            add_node(g, node.name, "output", _plain(node.args, alias), kind="output")
        elif node.op == "get_attr":
            _add_constant(g, owner, node, prefix, alias)
        elif node.op != "call_function":
            continue
        elif node.target is operator.getitem and isinstance(node.args[0], torch.fx.Node) \
                and node.args[0].name in regions:
            alias[node.name] = regions[node.args[0].name][node.args[1]]
        elif isinstance(node.target, torch._ops.HigherOrderOperator):
            regions[node.name] = _read_through(g, owner, node, sources=sources, alias=alias, prefix=prefix)
        else:
            stack = _module_stack(node)
            alias[node.name] = Ref(prefix + node.name)
            add_node(g, prefix + node.name, op_name(node.target), _plain(node.args, alias),
                     kwargs=_plain(node.kwargs, alias), shape=_value_shape(node),
                     module=stack[-1] if stack else "", stack=stack)
            g.nodes[prefix + node.name]["dtype"] = _value_dtype(node)


def _add_constant(g: nx.DiGraph, owner: torch.fx.GraphModule, node: torch.fx.Node, prefix: str,
                  alias: dict) -> None:
    """A ``get_attr`` of a tensor becomes a buffer node; one of a region is left to its op."""
    value = functools.reduce(getattr, node.target.split("."), owner)
    if isinstance(value, torch.Tensor):
        alias[node.name] = Ref(prefix + node.name)
        add_node(g, prefix + node.name, "placeholder", kind="buffer", param=node.target, shape=tuple(value.shape))


def _read_through(g: nx.DiGraph, owner: torch.fx.GraphModule, node: torch.fx.Node, *, sources: dict,
                  alias: dict, prefix: str) -> list:
    """Inline the region of higher-order op ``node``; return what stands for each of its outputs.

    Raises:
        TraceError: the op is not in :data:`READ_THROUGH`.
    """
    name = op_name(node.target)
    if name not in READ_THROUGH:
        stack = _module_stack(node)
        raise TraceError(
            f"{stack[-1] if stack else '<root>'}: the traced forward calls the higher-order op {name!r}, "
            f"which the graph builder cannot read through (it reads {', '.join(sorted(READ_THROUGH))}). "
            "Write the plan by hand for this model, or keep the code that calls it out of the traced forward."
        )
    at = READ_THROUGH[name]
    region = functools.reduce(getattr, node.args[at].target.split("."), owner)
    placeholders = [n for n in region.graph.nodes if n.op == "placeholder"]
    operands = node.args[len(node.args) - len(placeholders):] if placeholders else ()
    inner_alias = {p.name: _plain(v, alias) for p, v in zip(placeholders, operands)}
    _add_nodes(g, region, region.graph, sources=sources, alias=inner_alias, prefix=f"{prefix}{node.name}.")
    output = next(n for n in region.graph.nodes if n.op == "output")
    values = output.args[0] if isinstance(output.args[0], (list, tuple)) else (output.args[0],)
    return [_plain(v, inner_alias) for v in values]




def _matrix_param(g: nx.DiGraph, ref) -> bool:
    """Whether ``ref`` is a 2-D parameter, possibly cast."""
    name = ref.name if isinstance(ref, Ref) else None
    while name is not None and g.nodes[name]["kind"] == "call" and g.nodes[name]["op"] in WEIGHT_CASTS:
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
    for name, data in list(g.nodes(data=True)):
        args = data["args"]
        if data["op"] == "addmm" and len(args) == 3 and not data["kwargs"] and _matrix_param(g, args[2]):
            data.update(op="linear", args=(args[1], args[2], args[0]), weight_in_out=True)
        elif data["op"] in ("mm", "matmul") and len(args) == 2 and _matrix_param(g, args[1]) \
                and not _matrix_param(g, args[0]):
            data.update(op="linear", args=(args[0], args[1]), weight_in_out=True)
        elif data["op"] in ("mm", "matmul") and len(args) == 2 and _transposed_param(g, args[1]) \
                and not _matrix_param(g, args[0]):
            _read_as_linear(g, name, args[0], _transposed_param(g, args[1]), in_out=False)
        elif data["op"] == "einsum" and (found := _einsum_product(g, data)) is not None:
            _read_as_linear(g, name, found[0], found[1], in_out=found[2])
        elif data["op"] in ("mm", "matmul") and len(args) == 2 and _matrix_param(g, args[0]) \
                and not _matrix_param(g, args[1]) and len(g.nodes[args[1].name]["shape"] or ()) >= 2:
            _left_product_as_linear(g, name)




def _transposed_param(g: nx.DiGraph, ref):
    """``W.T`` (``t``, ``transpose(0, 1)``, ``permute(1, 0)``) of a 2-D parameter: the Ref of ``W``."""
    data = g.nodes[ref.name] if isinstance(ref, Ref) else None
    if data is None or data["op"] not in TRANSPOSES or not data["args"] or not _matrix_param(g, data["args"][0]):
        return None
    if data["op"] == "transpose":
        swaps = sorted(d % 2 for d in data["args"][1:3]) == [0, 1]
    elif data["op"] == "permute":
        swaps = [d % 2 for d in data["args"][1]] == [1, 0]
    else:
        swaps = True
    return data["args"][0] if swaps else None


def _einsum_product(g: nx.DiGraph, data):
    """``einsum("...d,fd->...f", x, W)`` (or ``"df"``: W stored (in, out)) with W a 2-D parameter:
    ``(x, W, in_out)``, the Linear it is; None for any other equation."""
    equation, operands = data["args"][0], data["args"][1] if len(data["args"]) == 2 else data["args"][1:]
    inputs, _, out = equation.replace(" ", "").partition("->")
    if len(operands) != 2 or "." in equation or not _matrix_param(g, operands[1]) or _matrix_param(g, operands[0]):
        return None
    x, w = inputs.split(",") if inputs.count(",") == 1 else ("", "")
    if len(w) != 2 or len(set(x + w)) != len(x) + 1 or not x or x[-1] not in w:
        return None
    other = w.replace(x[-1], "")
    if out != x[:-1] + other:
        return None
    return operands[0], operands[1], w[0] == x[-1]


def _read_as_linear(g: nx.DiGraph, name: str, x: Ref, weight: Ref, *, in_out: bool) -> None:
    """Make node ``name`` the Linear ``linear(x, weight)``, ``weight`` read through its casts to the
    parameter (``W.type_as(x)`` reads x only for its dtype); a transpose left unread is removed."""
    while g.nodes[weight.name]["kind"] == "call":
        weight = refs(g.nodes[weight.name]["args"])[0]
    old = [r.name for r in refs(g.nodes[name]["args"])]
    g.nodes[name].update(op="linear", args=(x, weight), kwargs={}, weight_in_out=in_out, raw_weight=True)
    for source in old:
        g.remove_edge(source, name)
    g.add_edge(x.name, name)
    g.add_edge(weight.name, name)
    while old:  # the chain of casts and transposes that led to the weight, now read by nothing
        source = old.pop()
        if source in g and g.out_degree(source) == 0 and g.nodes[source]["op"] in TRANSPOSES | WEIGHT_CASTS:
            old.extend(r.name for r in refs(g.nodes[source]["args"], g.nodes[source]["kwargs"]))
            g.remove_node(source)


def _left_product_as_linear(g: nx.DiGraph, name: str) -> None:
    """``W @ x`` with ``x`` of shape ``(..., in, n)``: features along dim -2, as in a channels-first
    layout. Rewritten as ``linear(x.mT, W).mT``: two transpose nodes around a Linear node, so that
    every analysis step reads the Linear with its features last. The node keeps its name (its
    readers are unchanged); the new nodes come just before it in program order.

    >>> g = nx.DiGraph()
    >>> _ = add_node(g, "w", "placeholder", kind="param", param="c.w", shape=(8, 4))
    >>> _ = add_node(g, "x", "placeholder", kind="input", shape=(2, 4, 6))
    >>> _ = add_node(g, "y", "matmul", (Ref("w"), Ref("x")), shape=(2, 8, 6))
    >>> _products_as_linear(g)
    >>> [(n, g.nodes[n]["op"], g.nodes[n]["shape"]) for n in sorted(g, key=lambda n: g.nodes[n]["order"])][2:]
    [('y.input_t', 'transpose', (2, 6, 4)), ('y.linear', 'linear', (2, 6, 8)), ('y', 'transpose', (2, 8, 6))]
    """
    data = g.nodes[name]
    weight, x = data["args"]
    shape = g.nodes[x.name]["shape"]
    where = {"module": data["module"], "stack": data["stack"]}
    t_in = add_node(g, f"{name}.input_t", "transpose", (x, -2, -1), shape=(*shape[:-2], shape[-1], shape[-2]), **where)
    linear = add_node(g, f"{name}.linear", "linear", (Ref(t_in), weight),
                      shape=(*shape[:-2], shape[-1], data["shape"][-2]), **where)
    g.nodes[t_in]["order"], g.nodes[linear]["order"] = data["order"] - 0.5, data["order"] - 0.25
    g.remove_edge(x.name, name)
    g.remove_edge(weight.name, name)
    data.update(op="transpose", args=(Ref(linear), -2, -1), kwargs={})
    g.add_edge(linear, name)
    _read_as_linear(g, linear, Ref(t_in), weight, in_out=False)


def param_modules(g: nx.DiGraph, kind: str = "param") -> set[str]:
    """FQNs of the modules that own a ``kind`` (``"param"`` or ``"buffer"``) placeholder of ``g``."""
    return {d["param"].rpartition(".")[0] for _, d in g.nodes(data=True) if d["kind"] == kind}


def made_from_params(g: nx.DiGraph, name: str) -> bool:
    """Whether node ``name`` is a parameter or computed from one: a value with a gradient of its own.

    >>> g = nx.DiGraph()
    >>> _ = add_node(g, "w", "placeholder", kind="param", param="m.w", shape=(4,))
    >>> _ = add_node(g, "ids", "placeholder", kind="input", shape=(4,))
    >>> _ = add_node(g, "s", "mul", (Ref("w"), 2.0), shape=(4,))
    >>> made_from_params(g, "s"), made_from_params(g, "ids")
    (True, False)
    """
    return any(g.nodes[n]["kind"] == "param" for n in (name, *nx.ancestors(g, name)))


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
