"""tp larger than the number of kv heads: rewrite a plan so each rank holds the kv head it reads.

transformers, DeepSpeed AutoTP and torchtitan refuse ``tp > num_key_value_heads``. Here the k and
v projections become :class:`~autotp.styles.ReplicatedKVColwise` (each kv head repeated over the
``tp / kv_heads`` ranks whose query heads read it, copies' gradients summed) and the attention
module gets :class:`~autotp.styles.KVHeadCounts` so its grouped-query repeat is the local one.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

from autotp.errors import MeshError
from autotp.plan import Plan, resolve
from autotp.styles import KVHeadCounts, ReplicatedKVColwise


def config_head_dim(config) -> int | None:
    """``config.head_dim``, or hidden / heads; None where the config has no single value (Gemma4's
    head size differs between layer types and reading it raises)."""
    try:
        return getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    except Exception:  # transformers raises its own error types for per-layer attributes
        return None


def replicate_kv_heads(model: nn.Module, plan: Plan, tp_size: int) -> Plan:
    """Return ``plan`` rewritten for ``tp_size`` > kv heads (unchanged when tp divides the kv heads).

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
    if tp_size % kv or heads % tp_size:
        raise MeshError(
            f"{type(model).__name__}: tp={tp_size} with {heads} query heads and {kv} kv heads: "
            f"replicating kv heads needs tp to be a multiple of {kv} and to divide {heads}."
        )
    modules = dict(model.named_modules())
    default_head_dim = config_head_dim(config)
    rewritten = dict(plan)
    for fqn, (key, style) in resolve(model, plan).items():
        module = modules[fqn]
        parent_key = key.rsplit(".", 1)[0]
        head_dim = getattr(modules[fqn.rsplit(".", 1)[0]], "head_dim", None) or default_head_dim
        is_kv = (head_dim is not None and type(style) is ColwiseParallel and isinstance(module, nn.Linear)
                 and module.out_features == kv * head_dim)
        if is_kv and key in rewritten:
            rewritten[key] = ReplicatedKVColwise(kv_heads=kv, head_dim=head_dim)
            rewritten[parent_key] = KVHeadCounts(heads=heads)
    return rewritten
