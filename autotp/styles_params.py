"""A style for a module's own parameters that meet a head-sharded activation.

:class:`~autotp.styles.HeadShardedNorm` covers a norm whose weight is read by every head. The same
risk holds for any parameter read inside the head-sharded region: a per-head scale, a softmax
sink, a gate bias, a differential-attention lambda vector. On each rank such a parameter's
gradient covers only that rank's heads. :class:`HeadParams` makes every one of them exact:

- per-head parameters (an extent equal to the heads) are ``Shard(dim)``: rank r holds the entries
  of its heads, so the local gradient is the whole gradient of those entries;
- parameters every head reads (a vector over ``head_dim``, a scalar) stay ``Replicate()``, and
  their gradient, a partial sum over this rank's heads, is all-reduced (``Partial()``);
- the module's other parameters are left alone (replicated, their gradient already whole).

It may also divide integer attributes (head counts) by tp, as :class:`~autotp.styles.ShardCounts`
does, for a module that both reshapes into heads with a fixed count and owns such parameters.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import Partial, Replicate, Shard

from autotp.styles import ShardCounts, _LocalParamsStyle

__all__ = ["HeadParams"]


class HeadParams(_LocalParamsStyle):
    """Shard a module's per-head parameters with its heads; all-reduce the gradient of shared ones.

    The module runs on plain local tensors: during its forward each parameter is its local view
    (``to_local(grad_placements=...)``), so ``self.scale.view(1, -1, 1, 1)`` reads this rank's
    heads' entries. Only the module's own parameters are touched (``recurse=False``); its child
    Linears keep their own styles.

    Keyword Args:
        shard_dims (dict[str, int]): parameter name -> the dim that holds the heads.
        reduce (tuple[str, ...]): parameters kept whole whose gradient is all-reduced over tp.
        counts (tuple[str, ...]): integer attribute paths divided by tp (head counts).

    Example::
        >>> plan = {"layers.*.attn": HeadParams(shard_dims={"sink": 0}, reduce=("lambda_q",))}
    """

    def __init__(self, *, shard_dims: dict[str, int] | None = None, reduce: tuple[str, ...] = (),
                 counts: tuple[str, ...] = ()):
        super().__init__()
        self.shard_dims = dict(shard_dims or {})
        self.reduce = tuple(reduce)
        self.counts = tuple(counts)

    def _placement(self, name, param):
        # A per-head vector is cut like the heads it scales: contiguous blocks of heads per rank,
        # the same blocks the column-parallel projections give each rank.
        return Shard(self.shard_dims[name]) if name in self.shard_dims else Replicate()

    def _grad_placement(self, name, param):
        # Partial: each rank's gradient sums over its own heads only; the full gradient is their sum.
        return [Partial()] if name in self.reduce else param.placements

    def _distribute(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for name in (*self.shard_dims, *self.reduce):
            if name not in module._parameters:
                from autotp.errors import PlanError

                raise PlanError(f"{type(module).__name__}: HeadParams names parameter {name!r}, which the "
                                f"module does not own (it has {sorted(module._parameters)}); fix the names")
        super()._distribute(module, device_mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.counts:
            ShardCounts(names=self.counts)._apply(module, device_mesh)
        return super()._apply(module, device_mesh)

    def __repr__(self) -> str:
        options = [f"{k}={v!r}" for k, v in (("shard_dims", self.shard_dims), ("reduce", self.reduce),
                                              ("counts", self.counts)) if v]
        return f"{self.__class__.__name__}({', '.join(options)})"
