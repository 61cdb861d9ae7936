"""tp larger than the kv heads: replicate each kv head to the ranks whose query heads read it.

With ``kv_heads < tp`` (a multiple of it), a column split would cut kv heads in pieces. Each rank
instead holds the one kv head its ``heads / tp`` query heads read
(:class:`~autotp.styles.ReplicatedKVColwise`), and the attention's grouped-query ratio becomes the
per-rank ``heads / tp`` (:class:`~autotp.styles.KVHeadCounts`). Which attribute holds that ratio is
found as :mod:`autotp.synth.localize` finds head counts: integer attributes of the attention module
equal to ``heads / kv_heads``, confirmed by running the module alone at per-rank shapes.
"""

from __future__ import annotations

import logging

import networkx as nx
from torch import nn

from autotp.errors import MeshError
from autotp.kv import check_kv_replication
from autotp.synth.analysis import Flow, Shard, module_of, wider_attention
from autotp.synth.local_run import capture_inputs, run_local
from autotp.synth.localize import is_count, cutting_module, inner_roles
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
        if attention is not None:
            found[root] = (extent, attention)
    return found


def ratio_attribute(module: nn.Module, inputs, roles: dict[str, Role], ratio: int, local_ratio: int,
                    tp: int) -> str | None:
    """The integer attribute of ``module`` equal to ``ratio`` that, set to ``local_ratio``, lets the
    module run at per-rank shapes with its global output shapes; ``""`` if it runs so with none
    changed (grouped-query repeat from shapes), None if neither."""
    reference = run_local(module, inputs, roles, [], (), 1)
    if reference is None:
        return None
    for name in sorted(n for n, v in vars(module).items() if is_count(v) and v == ratio):
        result = run_local(module, inputs, roles, [], (), tp, {name: local_ratio})
        if result is not None and result[0] == reference[0]:
            return name
    bare = run_local(module, inputs, roles, [], (), tp)
    # No attribute, yet the module runs at per-rank shapes: it repeats kv heads from the shapes
    # (``enable_gqa=True``), and nothing needs setting.
    return "" if bare is not None and bare[0] == reference[0] else None


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
    captured = capture_inputs(model, example_inputs, set(attention), groups)
    out = {}
    for fqn, (heads, kv) in attention.items():
        inner = inner_roles({**roles, **kv_roles}, fqn)
        with collapsed(model, groups):
            module = model.get_submodule(fqn)
            name = None
            if fqn in captured:
                name = ratio_attribute(module, captured[fqn], inner, heads // kv, heads // tp, tp)
        if name is None:
            raise MeshError(module=fqn, found=f"tp={tp} exceeds its {kv} kv heads and no integer attribute "
                            f"equal to heads / kv_heads = {heads // kv} sets its grouped-query ratio",
                            fix=f"use tp <= {kv} or write the plan by hand with KVHeadCounts")
        if not name:
            continue
        out[fqn] = Role("kv_head_counts", f"tp={tp} > {kv} kv heads: {name} becomes the per-rank ratio "
                        f"heads / tp = {heads // tp}", (fqn,), names=(name,), heads=heads)
    return out
