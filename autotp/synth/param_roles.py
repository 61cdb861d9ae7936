"""Roles for modules whose own parameters meet a sharded activation (:func:`param_roles`) or
broadcast one (:func:`broadcast_roles`): given once the analysis has converged, from its
:class:`~autotp.synth.flow.Flow` (so above it; the per-node parameter rules the propagation
uses stay in :mod:`autotp.synth.params`)."""

from __future__ import annotations

from dataclasses import replace

import networkx as nx

from autotp.errors import PlanError
from autotp.synth.fixpoint import packed_params
from autotp.synth.graph import refs
from autotp.synth.queries import is_linear, module_of, reading_module
from autotp.synth.roles import Role


def _meets_shard(g: nx.DiGraph, flow, param: str, module: str) -> bool:
    """Whether ``param`` flows, inside ``module``, into an op that combines it with a sharded value
    (its gradient is then partial). A Linear's output starts its own shard, whose input gradient
    its column style reduces: the walk does not go through Linears."""
    seen, todo = {param}, [param]
    while todo:
        for succ in g.successors(todo.pop()):
            if succ in seen or module not in g.nodes[succ]["stack"] or is_linear(g, succ):
                continue
            if flow.sharded(succ) or succ in flow.per_head:  # one head's value in a per-head loop too
                return True
            seen.add(succ)
            todo.append(succ)
    return False


def param_roles(g: nx.DiGraph, flow, roles: dict[str, Role]) -> dict[str, Role]:
    """``head_params`` roles for modules whose own parameters meet a sharded activation.

    A module that already has a role keeps it, unless one of its parameters must be sharded with
    the heads (a norm style would keep it whole, and the per-rank run would then fail or mix heads).
    A Linear's own weight and bias are its Linear role's business and never counted here.

    Args:
        g: the analysis graph.
        flow: the converged propagation (its ``param_shards``: parameter placeholder -> dim).
        roles: the roles assigned so far, by module.
    Returns:
        New roles by module FQN.
    """
    # A table looked up per head (:func:`~autotp.synth.params.table_lookup`) is sharded with the
    # heads like any other.
    per_head_tables = {r.name for n, d in g.nodes(data=True) if d["op"] == "embedding"
                       for r in refs(d["args"][:1])} & set(flow.param_shards)
    linear_params = {r.name for n, d in g.nodes(data=True) if d["op"] in ("linear", "embedding")
                     for r in refs(d["args"])} - per_head_tables
    sharded: dict[str, dict[str, int]] = {}
    reduced: dict[str, list[str]] = {}
    packed, packings = packed_params(flow), {}
    for name, data in sorted(g.nodes(data=True), key=lambda item: item[1]["order"]):
        if data["kind"] not in ("param", "buffer") or name in linear_params:
            continue
        if data["kind"] == "buffer" and name not in flow.param_shards:
            continue  # a buffer has no gradient: only one sharded with the heads concerns us
        if name in flow.param_shards:  # read once: by the module whose code reads it
            module, pname = reading_module(g, name)
            sharded.setdefault(module, {})[pname] = flow.param_shards[name]
            if name in packed:
                packings.setdefault(module, {})[pname] = packed[name]
            continue
        module, _, pname = data["param"].rpartition(".")
        if module in flow.mixers:
            continue  # whole on every rank with whole gradients (head_mixers.py)
        if _meets_shard(g, flow, name, module):
            reduced.setdefault(module, []).append(pname)
    out = {}
    for module in sorted(set(sharded) | set(reduced)):
        current = roles.get(module)
        if current is not None and module not in sharded and current.kind != "replicate":
            continue  # a norm style (or a Linear's) already covers it
        if current is not None and current.kind == "width_norm":
            continue  # its style shards the weight with the width and all-reduces the statistic
        dims = tuple(sorted(sharded.get(module, {}).items()))
        grads = tuple(reduced.get(module, ()))
        parts = [f"{', '.join(n for n, _ in dims)} sharded with the heads" if dims else "",
                 f"{', '.join(grads)} replicated, gradient all-reduced" if grads else ""]
        out[module] = Role("head_params", "its own parameters meet a sharded activation: "
                           + "; ".join(p for p in parts if p), (module,), param_dims=dims, grad_reduced=grads,
                           param_packed=tuple(sorted(packings.get(module, {}).items())))
    return out


def broadcast_roles(g: nx.DiGraph, flow, roles: dict[str, Role]) -> dict[str, Role]:
    """``broadcast_source`` roles: a Linear kept whole whose output span is broadcast across the heads.

    Args:
        flow: the converged propagation (its ``broadcasts``: Linear node -> spans).
        roles: the roles assigned so far; the Linear's module must have none but ``replicate``.
    Raises:
        PlanError: the module has another role (the span's gradient would not be reduced).
    """
    out = {}
    for linear, spans in sorted(flow.broadcasts.items()):
        module = flow.broadcast_modules.get(linear) or module_of(g, linear)
        current = roles.get(module)
        spans = tuple(sorted(spans))
        if current is not None and current.kind == "row" and not current.partial_output:
            # A row's output is whole after its all-reduce; the broadcast spans' gradient is reduced
            # on the way back, like a whole Linear's.
            features = ", ".join(f"{a}:{b}" for a, b in spans)
            out[module] = replace(current, grad_spans=spans, reason=f"{current.reason}; its output features "
                                  f"[{features}] are broadcast along the sharded dim, so their gradient is "
                                  "all-reduced after it")
            continue
        if current is not None and current.kind != "replicate":
            raise PlanError(f"{module}: its output features {sorted(spans)} are broadcast across sharded "
                                 f"heads, but it is also {current.kind} ({current.reason}); the broadcast "
                                 "part's gradient would not be reduced. Keep it out of the plan or report this.")
        features = ", ".join(f"{a}:{b}" for a, b in spans)
        out[module] = Role("broadcast_source", f"kept whole; its output features [{features}] are broadcast along "
                           "the sharded dim (the same for every head), so their gradient is all-reduced after it",
                           (module,), grad_spans=spans)
    return out
