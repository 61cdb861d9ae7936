"""Say so when an attention is kept whole: never silently.

The analysis keeps Linears whole wherever it cannot prove a shard right (default-deny): the plan is
exact but an attention left whole holds every head on every rank, which for a model built from
attention blocks is most of the memory tensor parallelism was meant to save. Such a plan is handed
out with a :class:`~autotp.errors.WholeAttentionWarning` per attention module: its plan key, and
the reason its first projection was kept whole (the same reason ``explain`` gives).

An attention is the innermost module around a softmax or a fused attention kernel that calls
Linears (the kernel itself may run in a child holding none, a backend wrapping the fused kernel);
it is whole when none of those Linears is sharded and it runs on no DTensor region.
"""

from __future__ import annotations

import warnings

import networkx as nx

from autotp.errors import WholeAttentionWarning
from autotp.synth.queries import is_linear, module_of
from autotp.synth.ops import ATTENTION
from autotp.synth.roles import Role
from autotp.synth.trace import LayerGroups

_SCORES = ATTENTION | {"softmax", "_softmax", "_safe_softmax"}
_WHOLE = frozenset({"replicate", "gathered_column"})


def whole_attentions(g: nx.DiGraph, roles: dict[str, Role]) -> dict[str, str]:
    """``{attention module (traced FQN): why its first projection is whole}`` for every attention
    whose own Linears are all kept whole and which runs on no DTensor region."""
    found: dict[str, str] = {}
    stacks = [(n, d["stack"]) for n, d in g.nodes(data=True) if is_linear(g, n)]
    for name, data in sorted(g.nodes(data=True), key=lambda item: item[1]["order"]):
        if data["op"] not in _SCORES or not data["stack"]:
            continue
        # The innermost module around the kernel that calls Linears: the kernel may run in a child
        # of the attention that holds none (a backend module wrapping the fused kernel).
        module = next((m for m in reversed(data["stack"]) if any(m in stack for _, stack in stacks)), None)
        if module is None or module in found or any(getattr(roles.get(m), "region", None) for m in data["stack"]):
            continue
        linears = [n for n, stack in stacks if module in stack]
        kinds = [roles.get(module_of(g, n)) for n in linears]
        if not linears or any(r is not None and r.kind not in _WHOLE for r in kinds):
            continue
        first = next((r for r in kinds if r is not None), None)
        found[module] = first.reason if first is not None else "no shard of its projections could be followed"
    return found


def warn_whole_attentions(g: nx.DiGraph, roles: dict[str, Role], groups: LayerGroups) -> None:
    """One :class:`~autotp.errors.WholeAttentionWarning` per attention kept whole (by plan key)."""
    seen = set()
    for module, reason in whole_attentions(g, roles).items():
        originals = groups.original(module)
        key = originals[0] if len(originals) == 1 else _folded(module, groups)
        if key in seen:
            continue
        seen.add(key)
        warnings.warn(f"{key}: attention kept whole (every head on every rank): {reason}", WholeAttentionWarning,
                      stacklevel=3)


def _folded(module: str, groups: LayerGroups) -> str:
    """``layers.0.attn`` -> ``layers.*.attn`` for a module standing for several layers."""
    for prefix in groups.groups:
        if module.startswith(prefix + "."):
            _, _, tail = module[len(prefix) + 1:].partition(".")
            return f"{prefix}.*" + (f".{tail}" if tail else "")
    return module
