"""A block whose own code reduces its sharded width to per-token statistics, all-reduced."""

from __future__ import annotations

import math

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.overrides import TorchFunctionMode

from autotp.styles.base import WrapperStyle, mode_during_forward
from autotp.styles.declared import Shards
from autotp.styles.norms import _AllReduceGrad

# Sum-based statistics the block's code may take over its sharded width (``autotp.synth.ops.STATISTICS``).
_SUMS = frozenset({"mean", "sum", "nanmean", "nansum"})
_SPREADS = frozenset({"var", "std", "var_mean", "std_mean"})


class ShardedStatistics(WrapperStyle):
    """Run a block's own code on DTensors so that its statistics over a sharded width are exact.

    A block between column and row Linears that reduces its sharded activation to one value per
    token (``cutoff = g.mean(-1, keepdim=True) + k * g.std(-1, keepdim=True)`` on an MLP's gate)
    would read only this rank's slice of the width. Its column Linears hand their output on as
    ``Shard(-1)`` DTensors (``ColwiseParallel(use_local_output=False)``, set by the plan), its row
    Linears take them as they are, and while the block's forward runs each mean or sum over the
    sharded width (a ``Partial()`` DTensor) is all-reduced where it is made, a ``(b, t, 1)``
    tensor, with its gradient (partial over the width: each rank's slice contributes) all-reduced
    at the same size. A variance or standard deviation is taken in two passes, mean first, then the
    mean square of the deviations: two such all-reduces, and the same values as one rank computes.

    Keyword Args:
        style (ParallelStyle, optional): the block's own style, applied first (its shared input).

    Example::
        >>> from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
        >>> plan = {"model.layers.*.mlp": ShardedStatistics(),
        ...         "model.layers.*.mlp.gate_proj": ColwiseParallel(use_local_output=False),
        ...         "model.layers.*.mlp.up_proj": ColwiseParallel(use_local_output=False),
        ...         "model.layers.*.mlp.down_proj": RowwiseParallel()}
    """

    def __init__(self, *, style: ParallelStyle | None = None):
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = self._apply_wrapped(module, device_mesh)
        mode_during_forward(module, _WholeStatistics)
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(style={self.style!r})"

    def declares(self) -> Shards:
        return Shards(statistics=True)


class _WholeStatistics(TorchFunctionMode):
    """Make each sum-based statistic of a sharded DTensor whole where it is made (both directions).

    Only the statistics are touched: a Linear's ``Partial()`` output is its style's to reduce (a
    reduce-scatter under sequence parallel), so this mode does not look at it.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if not args or not isinstance(args[0], DTensor) or not _sharded(args[0]):
            return func(*args, **kwargs)
        if name in _SUMS:
            return _whole(func(*args, **kwargs))
        if name in _SPREADS:
            return _spread(name, args[0], *_spread_options(args[1:], kwargs))
        return func(*args, **kwargs)


def _sharded(x: DTensor) -> bool:
    return any(p.is_shard() for p in x.placements)


def _whole(out):
    """A partial statistic all-reduced, its gradient all-reduced at the same size."""
    if isinstance(out, DTensor) and any(p.is_partial() for p in out.placements):
        return _AllReduceGrad.apply(out.redistribute(placements=[Replicate()] * out.device_mesh.ndim))
    return out


def _spread_options(rest: tuple, kwargs: dict) -> tuple:
    """``(dim, correction, keepdim)`` of a ``var`` / ``std`` call in any of its spellings:
    ``x.std(dim, unbiased, keepdim)``, ``x.std(unbiased)``, ``x.std(dim, correction=0, keepdim=True)``."""
    rest, kwargs = list(rest), dict(kwargs)
    dim, unbiased, correction = kwargs.pop("dim", None), kwargs.pop("unbiased", None), kwargs.pop("correction", None)
    keepdim = kwargs.pop("keepdim", False)
    if rest and isinstance(rest[0], bool):
        unbiased = rest.pop(0)
    elif rest:
        dim = rest.pop(0)
    if rest and isinstance(rest[0], bool) and len(rest) > 1:  # (dim, unbiased, keepdim)
        unbiased = rest.pop(0)
    if rest:
        keepdim = rest.pop(0)
    if correction is None:
        correction = 1 if unbiased is None or unbiased else 0
    return dim, correction, keepdim


def _spread(name: str, x: DTensor, dim, correction, keepdim: bool):
    """``var`` / ``std`` (``_mean``) of ``x`` over ``dim``, in two exact passes over the shards."""
    dims = list(range(x.ndim)) if dim is None else [dim] if isinstance(dim, int) else list(dim)
    dims = sorted(d % x.ndim for d in dims)
    count = math.prod(x.shape[d] for d in dims)
    mean = _whole(x.mean(dims, keepdim=True))
    deviation = x - mean
    var = _whole((deviation * deviation).sum(dims, keepdim=keepdim)) / max(count - correction, 0)
    value = var.sqrt() if name.startswith("std") else var
    if not name.endswith("_mean"):
        return value
    return value, mean if keepdim else mean.squeeze(tuple(dims))
