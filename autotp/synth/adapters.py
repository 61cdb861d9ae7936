"""Low-rank adapters beside a Linear kept whole stay whole with it.

A LoRA-style wrapper computes ``base(x) + B(A(dropout(x))) * scaling``. Where the analysis keeps
``base`` whole (the module around it cannot run at per-rank shapes), the adapter pair ``A``
(column) and ``B`` (row) would still be sharded on its rank dimension: a reduction of ``B``'s
output per call that buys nothing (the adapter is a few rows), and under sequence parallelism a
row whose output, reduce-scattered onto the sequence, meets the whole ``base`` output inside the
module. The pattern is read from the graph: a row Linear whose output, through casts and scalings,
is added to the output of a Linear kept whole, the row reading a column Linear whose input is the
kept Linear's input (through casts and dropout).
"""

from __future__ import annotations

import logging
from dataclasses import replace

import networkx as nx

from autotp.synth.queries import is_linear, module_of
from autotp.synth.ops import PASSTHROUGH
from autotp.synth.ref import refs
from autotp.synth.roles import Role, kind_of
from autotp.synth.sequence import _behind_pointwise  # back through casts, copies and dropout
from autotp.synth.stages import Analysis, post_pass

log = logging.getLogger(__name__)

_SCALINGS = frozenset({"mul", "div", "mul_", "div_"})
_ADDS = frozenset({"add", "add_"})
_HOPS = 8


def _constant(g: nx.DiGraph, name: str) -> bool:
    """Whether ``name`` is no activation: a parameter, a buffer, a constant, or made from them only."""
    return not any(g.nodes[n]["kind"] == "input" for n in nx.ancestors(g, name) | {name})


def _added_to(g: nx.DiGraph, start: str) -> str | None:
    """The value ``start`` is added to, after casts and scalings by constants; None if it meets anything else."""
    name = start
    for _ in range(_HOPS):
        users = list(g.successors(name))
        if len(users) != 1:
            return None
        user = g.nodes[users[0]]
        others = [r.name for r in refs(user["args"], user["kwargs"]) if r.name != name]
        if user["op"] in _ADDS:
            return others[0] if len(others) == 1 else None
        if user["op"] not in PASSTHROUGH and not (user["op"] in _SCALINGS and all(_constant(g, o) for o in others)):
            return None
        name = users[0]
    return None


def whole_adapters(g: nx.DiGraph, roles: dict[str, Role]) -> dict[str, Role]:
    """Replicate roles for the column / row pairs of adapters beside a Linear kept whole."""
    found: dict[str, Role] = {}
    for row in (n for n in g.nodes if g.nodes[n]["kind"] == "call" and is_linear(g, n)):
        if kind_of(roles, module_of(g, row)) != "row":
            continue
        other = _added_to(g, row)
        base = _behind_pointwise(g, other, PASSTHROUGH) if other is not None else None
        if base is None or not is_linear(g, base) or kind_of(roles, module_of(g, base), "replicate") != "replicate":
            continue
        column = _behind_pointwise(g, refs(g.nodes[row]["args"])[0].name, PASSTHROUGH)
        if not is_linear(g, column) or kind_of(roles, module_of(g, column)) != "column":
            continue
        if _behind_pointwise(g, refs(g.nodes[column]["args"])[0].name, PASSTHROUGH) != _behind_pointwise(
                g, refs(g.nodes[base]["args"])[0].name, PASSTHROUGH):
            continue
        kept = module_of(g, base)
        for linear in (column, row):
            found[module_of(g, linear)] = Role(
                "replicate", f"a low-rank adapter beside {kept}, which is kept whole: kept whole with it "
                "(sharded, it would reduce its output for nothing)", (kept, module_of(g, column), module_of(g, row)))
    return found


@post_pass(order=10)
def adapters(a: Analysis) -> Analysis:
    """Low-rank adapters (LoRA) beside a Linear kept whole stay whole with it (:mod:`autotp.synth.adapters`)."""
    found = whole_adapters(a.graph, a.roles)
    if found:
        log.info("adapters: %d adapter Linears kept whole with their base", len(found))
    return replace(a, roles={**a.roles, **found})
