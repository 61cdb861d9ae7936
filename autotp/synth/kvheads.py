"""tp larger than the kv heads: replicate each kv head to the ranks whose query heads read it.

With ``kv_heads < tp`` (a multiple of it), a column split would cut kv heads in pieces. Each rank
instead holds the one kv head its ``heads / tp`` query heads read
(:class:`~autotp.styles.ReplicatedKVColwise`), and the attention's grouped-query ratio becomes the
per-rank ``heads / tp`` (:class:`~autotp.styles.ShardCounts` with ``query_heads``). Which attributes hold that ratio
(and, in code that sizes its views by them, the kv and query head counts) is found as
:mod:`autotp.synth.localize` finds head counts: integer attributes of the attention module equal
to ``heads / kv_heads``, ``kv_heads`` or ``heads``, confirmed by running the module alone at
per-rank shapes (:func:`kv_counts`).
"""

from __future__ import annotations

import itertools
import logging

import networkx as nx
from torch import nn

from autotp.errors import MeshError
from autotp.kv import check_kv_replication
from autotp.synth.fixpoint import wider_attention
from autotp.synth.flow import Flow
from autotp.synth.queries import module_of
from autotp.synth.shard import Shard
from autotp.synth.graph import refs
from autotp.synth.local_run import capture_inputs, inner_roles, run_local
from autotp.synth.localize import cutting_module, is_count
from autotp.synth.roles import Role, kind_of
from autotp.synth.trace import LayerGroups, collapsed

log = logging.getLogger(__name__)


def kv_roots(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], tp: int) -> dict[str, tuple[int, str]]:
    """Column roots with fewer heads than ``tp`` and than the attention they feed (k/v of grouped-query
    attention): root -> (kv heads, attention node)."""
    found = {}
    for root in sorted(flow.roots, key=lambda n: g.nodes[n]["order"]):
        extent = flow.extent.get(root, 0)
        if not extent or extent >= tp or kind_of(roles, module_of(g, root)) != "column":
            continue
        attention = wider_attention(flow, root)
        if attention is not None and _query_elsewhere(g, flow, root, attention):
            found[root] = (extent, attention)
    return found


def _query_elsewhere(g: nx.DiGraph, flow: Flow, root: str, attention: str) -> bool:
    """Whether an operand of ``attention`` is sharded from candidates other than ``root`` (the
    query projection): a root whose shard is every operand there (a fused qkv viewed groups first,
    ``(b, t, groups, q_per_kv + 2, hd)``) makes its own query heads, and holding one of its groups
    per rank would hold that group's query heads on several ranks."""
    return any(isinstance(flow.state.get(ref.name), Shard) and root not in flow.state[ref.name].origins
               for ref in refs(g.nodes[attention]["args"]))


# Per-rank values of the attention's counts when each rank holds one kv head and heads / tp query
# heads: the grouped-query ratio and the query heads become heads / tp, the kv heads 1.
KV_COUNT_KINDS = ("ratio", "kv", "heads")
# How many attributes one search sets together.
MAX_KV_COUNTS = 3


def kv_counts(module: nn.Module, inputs, roles: dict[str, Role], heads: int, kv: int,
              tp: int) -> tuple[tuple[str, str], ...] | None:
    """The integer attributes of ``module`` that must take their per-rank values (``(name, kind)``,
    a kind of :data:`KV_COUNT_KINDS`) for it to run at per-rank shapes with its global output
    shapes: the fewest that do, a lone grouped-query ratio (``num_key_value_groups``) first; ``()``
    if it runs so with none changed (grouped-query repeat from shapes), None if no set does.

    An attribute equal to the ratio, the kv heads or the query heads is a candidate for each of
    those it equals (``n_rep`` and ``n_kv_heads`` are both 2 with 4 heads over 2 kv heads), so the
    search tries each reading, up to :data:`MAX_KV_COUNTS` attributes at once.
    """
    reference = run_local(module, inputs, roles, [], (), 1)
    if reference is None:
        return None
    globals_ = {"ratio": heads // kv, "kv": kv, "heads": heads}
    locals_ = {"ratio": heads // tp, "kv": 1, "heads": heads // tp}
    readings = [(name, kind) for name, value in sorted(vars(module).items()) if is_count(value)
                for kind in KV_COUNT_KINDS if value == globals_[kind] and locals_[kind] != value]
    names = sorted({name for name, _ in readings})
    for count in range(0, min(MAX_KV_COUNTS, len(names)) + 1):
        for chosen in itertools.combinations(names, count):
            for kinds in itertools.product(*([k for n, k in readings if n == name] for name in chosen)):
                assign = {name: locals_[kind] for name, kind in zip(chosen, kinds)}
                result = run_local(module, inputs, roles, [], (), tp, assign)
                if result is not None and result[0] == reference[0]:
                    return tuple(zip(chosen, kinds))
    return None


def replicate_kv(model: nn.Module, example_inputs, g: nx.DiGraph, flow: Flow, roles: dict[str, Role],
                 tp: int, groups: LayerGroups | None = None) -> tuple[dict[str, Role], set[str]]:
    """Roles for k/v projections with fewer heads than ``tp`` and for their attention modules.

    Returns:
        ``(new roles by traced FQN, the kv root nodes handled)``.
    Raises:
        MeshError: tp is not a multiple of the kv heads, the query heads do not divide over tp, or
            no attribute of the attention holds the grouped-query ratio.
    """
    found = kv_roots(g, flow, roles, tp)
    out: dict[str, Role] = {}
    attention: dict[str, tuple[int, int]] = {}
    for root, (kv, node) in found.items():
        owner = module_of(g, root)
        heads = g.nodes[node]["shape"][flow.state[node].dim] if isinstance(flow.state.get(node), Shard) else 0
        width = g.nodes[root]["shape"][-1]
        check_kv_replication(owner, kv, heads, tp)
        out[owner] = Role("kv_column", f"{kv} kv heads < tp={tp}: each rank holds the kv head its query "
                          "heads read; the copies' gradients are summed", roles[owner].evidence,
                          kv_heads=kv, head_dim=width // kv)
        attention[cutting_module(g, root, [node])] = (heads, kv)
    if attention:
        out.update(_ratio_roles(model, example_inputs, roles, out, attention, tp, groups))
    return out, set(found)


def _ratio_roles(model, example_inputs, roles, kv_roles, attention, tp, groups) -> dict[str, Role]:
    captured = capture_inputs(model, example_inputs, set(attention), groups, {**roles, **kv_roles})
    out = {}
    for fqn, (heads, kv) in attention.items():
        inner = inner_roles({**roles, **kv_roles}, fqn)
        with collapsed(model, groups):
            module = model.get_submodule(fqn)
            counts = None
            if fqn in captured:
                counts = kv_counts(module, captured[fqn], inner, heads, kv, tp)
        if counts is None:
            raise MeshError(module=fqn, found=f"tp={tp} exceeds its {kv} kv heads and no integer attributes set to "
                            f"their per-rank values (the grouped-query ratio heads / kv_heads = {heads // kv}, the "
                            f"kv heads {kv}, the query heads {heads}) let it run at per-rank shapes",
                            fix=f"use tp <= {kv} or write the plan by hand with ShardCounts(query_heads=...)")
        if not counts:
            continue
        said = ", ".join(f"{name} ({kind}) becomes {1 if kind == 'kv' else heads // tp}" for name, kind in counts)
        out[fqn] = Role("kv_head_counts", f"tp={tp} > {kv} kv heads: {said} per rank", (fqn,),
                        kv_counts=tuple(counts), heads=heads)
    return out
