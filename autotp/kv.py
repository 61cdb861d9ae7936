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


def _attention_shape(config) -> tuple[int, int, int]:
    heads, kv = config.num_attention_heads, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // heads
    return heads, kv, head_dim


def replicate_kv_heads(model: nn.Module, plan: Plan, tp_size: int) -> Plan:
    """Return ``plan`` rewritten for ``tp_size`` > kv heads (unchanged when tp divides the kv heads).

    Raises:
        MeshError: tp is not a multiple of the kv heads, or does not divide the query heads.
    """
    config = model.config.get_text_config()
    heads, kv, head_dim = _attention_shape(config)
    if kv % tp_size == 0:
        return plan
    if tp_size % kv or heads % tp_size:
        raise MeshError(
            f"{type(model).__name__}: tp={tp_size} with {heads} query heads and {kv} kv heads: "
            f"replicating kv heads needs tp to be a multiple of {kv} and to divide {heads}."
        )
    modules = dict(model.named_modules())
    kv_width = kv * head_dim
    rewritten = dict(plan)
    for fqn, (key, style) in resolve(model, plan).items():
        module = modules[fqn]
        is_kv = type(style) is ColwiseParallel and isinstance(module, nn.Linear) and module.out_features == kv_width
        if is_kv and key in rewritten:
            rewritten[key] = ReplicatedKVColwise(kv_heads=kv, head_dim=head_dim)
            parent_key = key.rsplit(".", 1)[0]
            rewritten[parent_key] = KVHeadCounts(heads=heads)
    return rewritten
