"""Tensors made outside a module that meet its heads: sliced to this rank's heads where they enter.

A per-head bias built once at the model's root and handed to every layer (ALiBi's slopes times the
distances, ``(heads, t, t)``), or any replicated value with a dim of the heads' size that reaches an
attention's heads from outside the module holding it, holds every head. With the heads sharded,
each rank needs its own heads' slice of it. The analysis follows the value back from where it meets
the shard, through one-tensor ops inside that module ``M``, to the value ``E`` that enters ``M``
(:func:`entry_source`); ``M`` then takes ``E`` sliced on that dim at its entry
(:class:`~autotp.styles.ShardedInputs`): exact, since ``E`` is the same on every rank, and free,
since ``E`` is made from no parameter (a value with a gradient of its own, such as per-layer inputs
looked up in a learned table, would need its gradient all-gathered back in every backward: those
stay whole, as before).

Sound only if every read of ``E`` inside ``M`` meets the heads on the same dim
(:func:`stray_entry_reads`), and if the argument of ``M``'s call that carries ``E`` is known: it is
found once, on the inputs ``M`` gets in a fake forward (:func:`~autotp.synth.localize.resolve_entries`), by its shape,
which must be that of no other argument. Anything else keeps the heads' Linears whole.
"""

from __future__ import annotations

from dataclasses import replace

import networkx as nx

from autotp.synth.graph import Ref, made_from_params
from autotp.synth.ops import SINKS
from autotp.synth.params import SINGLE_INPUT, source_dim, value_refs
from autotp.synth.roles import Role
from autotp.synth.stages import Analysis, drop_check, post_pass, role_kind


# The role kind this idiom assigns (stages.role_kind): what it means and its style.
ENTRY_SHARD = role_kind(
    "entry_shard",
    "module that takes a value made outside it (a per-head bias built at the root) sliced to its heads "
    "on entry",
    lambda role, lp: None)  # the ShardedInputs wrapper alone (build.style_for)


def entry_source(g: nx.DiGraph, name: str, dim: int, deciding: str, *,
                 at_root: bool = False) -> tuple[str, str, int] | None:
    """``(E, M, dim of E)``: the value ``name``'s dim ``dim`` comes from, followed back through
    one-tensor ops inside ``M`` (the innermost module of node ``deciding``) to the first value made
    outside ``M``; None where the chain breaks inside ``M`` or ends at a parameter.

    ``at_root``: ``g`` is a module exported alone (the shape proof), whose own code runs at the
    root of the graph (``M`` is ``""``): the chain ends at one of its inputs. In a model's graph
    nothing made at the root can be sliced at an entry.
    """
    stack = g.nodes[deciding]["stack"]
    module = stack[-1] if stack else ""
    if not module and not at_root:
        return None
    while _inside(g, name, module):
        data = g.nodes[name]
        inputs = value_refs(data)
        if data["op"] not in SINGLE_INPUT or len(inputs) != 1 or not isinstance(data["args"][0], Ref):
            return None
        dim = source_dim(g, name, dim)
        if dim is None:
            return None
        name = inputs[0].name
    source = g.nodes[name]
    if source["kind"] in ("param", "buffer") or not source["shape"] or (not module and source["kind"] != "input"):
        return None
    if made_from_params(g, name):
        return None  # a value with a gradient of its own: its slice's backward would all-gather it
    return name, module, dim


def _inside(g: nx.DiGraph, name: str, module: str) -> bool:
    data = g.nodes[name]
    if not module:
        return data["kind"] == "call"
    return module in data["stack"]


@drop_check(order=50)
def stray_entry_reads(flow) -> dict[str, str]:
    """Candidates whose shard met a value sliced at a module's entry that some op inside the module
    reads whole (or on another dim): every read inside ``M`` of the value and of the chains from it
    to the operands that met the heads must be one of those meetings or the next link of a chain.

    Returns:
        For each such candidate, why it is dropped.
    """
    g, bad = flow.g, {}
    for key in flow.entry_shards:
        source, module = key
        uses = flow.entry_uses.get(key, set())
        operands = {operand for operand, _ in uses}
        below = nx.descendants(g, source)
        chain = set().union(*({o} | (nx.ancestors(g, o) & below) for o in operands)) if operands else set()
        stray = [(node, succ) for node in chain | {source} for succ in g.successors(node)
                 if _inside(g, succ, module) and g.nodes[succ]["op"] not in SINKS and succ not in chain
                 and (node, succ) not in uses]
        if not stray:
            continue
        _, succ = min(stray, key=lambda pair: g.nodes[pair[1]]["order"])
        reason = (f"a value made outside {module or 'the module'} meets the heads there and would be sliced to "
                  f"them on entry, but {g.nodes[succ]['op']} in it reads the value whole")
        for origin in flow.entry_origins.get(key, ()):
            bad.setdefault(origin, reason)
    return bad


def keys_of_shape(call, shape: tuple) -> list:
    if call is None:
        return []
    args, kwargs = call
    keys = [i for i, a in enumerate(args) if getattr(a, "shape", None) is not None and tuple(a.shape) == shape]
    return keys + [k for k, v in kwargs.items() if getattr(v, "shape", None) is not None and tuple(v.shape) == shape]


def with_entries(roles: dict[str, Role], entries: dict[str, tuple]) -> dict[str, Role]:
    """``roles`` with each module of ``entries`` taking those arguments sliced to its heads: its
    role gains ``entry_inputs``, or it gets an ``entry_shard`` role of its own."""
    from dataclasses import replace

    out = dict(roles)
    for module, inputs in entries.items():
        role = out.get(module)
        what = ", ".join(f"argument {k}" if isinstance(k, int) else f"keyword {k!r}" for k, *_ in inputs)
        note = f"takes {what} (made outside it, holding every head) sliced to its own heads on entry"
        if role is None:
            out[module] = Role("entry_shard", note, (module,), entry_inputs=inputs)
        else:
            out[module] = replace(role, entry_inputs=inputs, reason=f"{role.reason}; {note}")
    return out


@post_pass(order=110)
def sliced_entries(a: Analysis) -> Analysis:
    """Modules that take a value made outside them (a per-head bias built at the root) sliced to
    their heads on entry; after the passes that give those modules roles of their own."""
    return replace(a, roles=with_entries(a.roles, a.entries))
