"""torch's own ``nn.MultiheadAttention``: sharded by heads as one module, where the graph allows it.

Its input projection is a raw parameter (``in_proj_weight``) cut into q / k / v inside
``F.multi_head_attention_forward``, whose head size comes from the input's width: the shard rules
keep it whole (a ``select`` of the packed parts). A module of that exact class has a known forward,
so it gets a style of its own (:class:`~autotp.styles.MultiheadAttentionParallel`: its packed
projection sharded part by part, ``out_proj`` row-parallel, a per-rank forward) wherever the
converged analysis left it whole, its inputs replicated, and tp divides its heads.
"""

from __future__ import annotations

from dataclasses import replace

import networkx as nx
from torch import nn

from autotp.errors import working_tp_sizes
from autotp import styles
from autotp.synth.flow import Flow
from autotp.synth.shard import Shard
from autotp.synth.roles import Role
from autotp.synth.sequence import module_inputs
from autotp.synth.stages import Analysis, post_pass, role_kind


# The role kind this idiom assigns (stages.role_kind): what it means and its style.
MULTIHEAD_ATTENTION = role_kind(
    "multihead_attention",
    "torch's nn.MultiheadAttention sharded by heads: packed q/k/v projection column-parallel part by "
    "part, out_proj row-parallel, a per-rank forward",
    lambda role, lp: styles.MultiheadAttentionParallel(sequence_parallel=role.seq_output))


def multihead_attention_roles(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], model: nn.Module,
                              tp_size: int | None) -> dict[str, Role]:
    """Roles for the traced ``nn.MultiheadAttention`` modules of ``model``: sharded by heads, or
    kept whole with the reason. Roles of their children (``out_proj``) are dropped where they are
    sharded: the module's style owns its parameters.

    Args:
        g: the traced graph. flow: its converged shard propagation. roles: the roles so far.
        model: the model (its modules' classes and head counts). tp_size: None: not checked.

    Returns:
        All roles, updated.
    """
    out = dict(roles)
    ran = {m for _, d in g.nodes(data=True) for m in d["stack"]}
    for fqn, module in model.named_modules():
        if type(module) is not nn.MultiheadAttention or fqn not in ran:
            continue
        reason = _whole_reason(g, flow, roles, fqn, module, tp_size)
        if reason is not None:
            previous = roles.get(fqn)
            text = f"{previous.reason}; " if previous is not None and previous.kind == "replicate" else ""
            out[fqn] = Role("replicate", f"{text}nn.MultiheadAttention kept whole: {reason}", (fqn,))
            continue
        for child in [m for m in out if m.startswith(fqn + ".")]:
            del out[child]
        per_rank = f" ({module.num_heads // tp_size} of {module.num_heads} per rank)" if tp_size else ""
        out[fqn] = Role("multihead_attention", f"nn.MultiheadAttention on replicated inputs: its packed q/k/v "
                        f"projection sharded by heads{per_rank}, out_proj row-parallel, its forward run on the "
                        "rank's heads", (fqn,))
    return out


def _whole_reason(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], fqn: str, module: nn.MultiheadAttention,
                  tp_size: int | None) -> str | None:
    """Why ``module`` (at ``fqn``) must stay whole, or None where it can be sharded by heads."""
    inside = [m for m, r in roles.items() if (m == fqn or m.startswith(fqn + ".")) and r.kind != "replicate"]
    if inside:
        return f"the analysis gave {inside[0]} a role of its own ({roles[inside[0]].kind})"
    sharded = sorted(n for n in module_inputs(g, fqn) if isinstance(flow.state.get(n), (Shard, tuple)))
    if sharded:
        return f"its input {sharded[0]} arrives sharded, not replicated"
    if tp_size and module.num_heads % tp_size:
        return (f"its {module.num_heads} heads do not split over tp={tp_size} (tp in "
                f"{working_tp_sizes([module.num_heads])} would)")
    return None


@post_pass(order=40)
def torch_attention(a: Analysis) -> Analysis:
    """torch's ``nn.MultiheadAttention`` modules the analysis left whole on replicated inputs are
    sharded by heads as one module (:mod:`autotp.synth.torch_attention`)."""
    if a.model is None:
        return a
    return replace(a, roles=multihead_attention_roles(a.graph, a.flow, a.roles, a.model, a.tp_size))
