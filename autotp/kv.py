"""tp larger than the number of kv heads: rewrite a plan so each rank holds the kv head it reads.

transformers, DeepSpeed AutoTP and torchtitan refuse ``tp > num_key_value_heads``. Here the k and
v projections become :class:`~autotp.styles.ReplicatedKVColwise` (each rank computes the kv head
its query heads read: by default from sharded rows gathered each forward, the backward
reduce-scattering as many bytes; with ``gather=False`` from a copy of the head's rows, the copies'
gradients summed) and the attention module gets :class:`~autotp.styles.ShardCounts` (``query_heads``) so its
grouped-query repeat is the local one.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

from autotp.errors import MeshError, working_tp_sizes
from autotp.plan import Plan, describe_style, resolve
from autotp.styles import ReplicatedKVColwise, ShardCounts


def config_head_dim(config) -> int | None:
    """``config.head_dim``, or hidden / heads; None where the config has no single value (Gemma4's
    head size differs between layer types and reading it raises)."""
    try:
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    except Exception:  # transformers raises its own error types for per-layer attributes
        return None


def check_kv_replication(where: str, kv_heads: int, heads: int, tp: int) -> None:
    """The one rule for repeating kv heads over ranks (``tp`` > ``kv_heads``), for handwritten,
    transformers' and synthesized plans alike: each kv head goes to ``tp / kv_heads`` ranks, and
    each rank keeps ``heads / tp`` query heads.

    Raises:
        MeshError: ``tp`` is not a multiple of ``kv_heads``, or does not divide ``heads``.
    """
    if tp % kv_heads:
        raise MeshError(module=where, found=f"{kv_heads} kv heads cannot be shared evenly by tp={tp} ranks",
                        fix=f"use tp a divisor or a multiple of {kv_heads}")
    if not heads or heads % tp:
        raise MeshError(module=where, found=f"{heads} query heads cannot be split over tp={tp}",
                        fix=f"use tp in {working_tp_sizes([heads])}" if heads else "keep tp a divisor of the kv heads",
                        tp_sizes=working_tp_sizes([heads]) if heads else ())


def replicate_kv_heads(model: nn.Module, plan: Plan, tp_size: int, *, gather: bool = True) -> Plan:
    """Return ``plan`` rewritten for ``tp_size`` > kv heads (unchanged when tp divides the kv heads).

    ``gather``: the k/v rows are sharded and each rank's head gathered per forward, the backward
    reduce-scattering as many bytes (:class:`~autotp.styles.ReplicatedKVColwise` ``gather=True``);
    False: each rank holds a copy of its head, the copies' gradients summed in the backward (no
    forward collective: the serving choice).

    The head size is read per attention module (its ``head_dim``), falling back to the config's,
    so models whose layer types differ in head size are rewritten layer by layer; a Linear under a
    module without a head size (an MLP, where the config has no single one) is not a k/v projection.

    Raises:
        MeshError: tp is not a multiple of the kv heads, or does not divide the query heads.
    """
    config = model.config.get_text_config()
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    if kv % tp_size == 0:
        return plan
    check_kv_replication(type(model).__name__, kv, heads, tp_size)
    modules = dict(model.named_modules())
    default_head_dim = config_head_dim(config)
    resolved = resolve(model, plan)
    kv_styles: dict[str, ReplicatedKVColwise] = {}
    counts: dict[str, ShardCounts] = {}
    for fqn, (key, style) in resolved.items():
        module, parent = modules[fqn], modules[fqn.rsplit(".", 1)[0]]
        head_dim = getattr(parent, "head_dim", None) or default_head_dim
        groups = getattr(parent, "num_key_value_groups", None)
        local_kv = heads // groups if isinstance(groups, int) and groups > 0 and heads % groups == 0 else kv
        is_kv = (head_dim is not None and type(style) is ColwiseParallel and isinstance(module, nn.Linear)
                 and module.out_features == local_kv * head_dim and local_kv % tp_size != 0)
        if is_kv:
            check_kv_replication(fqn, local_kv, heads, tp_size)
            kv_styles[fqn] = ReplicatedKVColwise(kv_heads=local_kv, head_dim=head_dim, gather=gather)
            counts[key.rsplit(".", 1)[0]] = ShardCounts(query_heads=heads)
    # An attention module with a style of its own keeps it, applied after the counts are set.
    counts = {key: style if plan.get(key) is None or getattr(plan[key], "query_heads", None) is not None else
              ShardCounts(query_heads=style.query_heads, base=plan[key]) for key, style in counts.items()}
    return {**_rewrite_keys(plan, resolved, kv_styles), **counts}


def _rewrite_keys(plan: Plan, resolved: dict, new_styles: dict) -> Plan:
    """``plan`` with ``new_styles`` (by module FQN) in place: a key keeps its pattern when every
    module it matches gets one same style, else it is split into one key per module (layer types
    whose heads differ in size, like Gemma4's sliding and full attention)."""
    by_key: dict[str, list[str]] = {}
    for fqn, (key, _) in resolved.items():
        by_key.setdefault(key, []).append(fqn)
    out = {}
    for key, style in plan.items():
        fqns = by_key.get(key, [])
        changed = [new_styles[f] for f in fqns if f in new_styles]
        if not changed:
            out[key] = style
        elif len(changed) == len(fqns) and len({repr(describe_style(s)) for s in changed}) == 1:
            out[key] = changed[0]
        else:
            out.update({fqn: new_styles.get(fqn, style) for fqn in fqns})
    return out
