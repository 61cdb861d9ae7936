"""Shards carried from one module into another: what a layer hands the next, already per rank.

Residual attention hands each layer's pre-softmax scores ``(b, heads, n, n)`` to the next layer,
which adds them to its own; a value residual hands the first layer's values ``(b, heads, n, d)``
to every later layer. With both layers' heads sharded alike, each rank hands on its own heads'
share and the next layer reads it as it is: nothing to communicate, nothing to slice. The analysis
follows such a value as any shard (the graph holds every layer that reads it: layers called with
different arguments are traced apart, :func:`autotp.synth.trace.call_signatures`).

The shape proof runs the receiving module alone on the inputs it got in a fake forward, which
hold every head. :func:`carried_arguments` finds the arguments of its call that carry a shard
into it, and :func:`per_rank_call` narrows them to one rank's share for the per-rank runs (only
there: the global run keeps them whole), as the plan will hand them over. A submodule of the
model handed in as an argument and called by the module's code (a relative-bias module every
attention calls) is replaced in both runs by a meta copy, with its per-rank parameters in the
per-rank run (:func:`module_arguments`).
"""

from __future__ import annotations

import networkx as nx
import torch

from autotp.synth.shard import Shard
from autotp.synth.entries import keys_of_shape
from autotp.synth.params import chain_dims, value_refs


class ShardedCall(tuple):
    """``(args, kwargs)`` of a captured call, with ``carried``: ``(position or keyword, dim)`` of
    the arguments that hold a shard made outside the module (:func:`carried_arguments`), and
    ``modules``: ``(position or keyword, {name: Role})`` of the arguments that are modules of the
    model with roles of their own (a relative-bias module handed to every attention, which calls it)."""

    carried: tuple = ()
    modules: tuple = ()


def carried_arguments(g: nx.DiGraph, flow, module: str, call) -> tuple:
    """``((position or keyword, dim), ...)``: the arguments of ``module``'s call ``call`` that
    carry a shard into it: values made outside ``module`` (another layer's scores or values) whose
    shard its code reads. A value placed by its shape, which must be that of one argument alone;
    one that cannot be placed, or holds a shard of joined pieces or folded heads, is left out (the
    proof then sees it whole, and fails where its code needs the share)."""
    if not module or call is None:
        return ()
    found: dict = {}
    tables = chain_dims(g, flow.param_shards)  # per-head values looked up outside (a shared bias table)
    for name, data in g.nodes(data=True):
        if module not in data["stack"]:
            continue
        for ref in value_refs(data):
            source = g.nodes[ref.name]
            state = flow.state.get(ref.name)
            if module in source["stack"] or source["kind"] != "call" or not source["shape"]:
                continue
            if isinstance(state, Shard) and not (state.pieces or state.fold):
                dim = state.dim
            elif ref.name in tables:
                dim = tables[ref.name]
            else:
                continue
            keys = keys_of_shape(call, tuple(source["shape"]))
            if len(keys) == 1:
                found.setdefault(keys[0], dim % len(source["shape"]))
    return tuple(sorted(found.items(), key=str))


def module_arguments(model, roles: dict, call) -> tuple:
    """``((position or keyword, {relative name: Role}), ...)``: the arguments of ``call`` that are
    submodules of ``model`` whose parameters the plan shards (the module code calls them: their
    per-rank copies stand in for them in the per-rank runs)."""
    if call is None or model is None:
        return ()
    args, kwargs = call
    names = {id(m): n for n, m in model.named_modules()}
    found = []
    for key, value in [*enumerate(args), *kwargs.items()]:
        if not isinstance(value, torch.nn.Module) or id(value) not in names:
            continue
        fqn = names[id(value)]
        inner = {(n[len(fqn) + 1:] if fqn else n): r for n, r in roles.items() if fqn == "" or n.startswith(fqn + ".")}
        if inner:
            found.append((key, inner))
    return tuple(found)


def with_carried(call, carried: tuple, modules: tuple = ()):
    """``call`` marked with the arguments it carries shards in (a :class:`ShardedCall`)."""
    if not carried and not modules:
        return call
    marked = ShardedCall(call)
    marked.carried, marked.modules = carried, modules
    return marked
