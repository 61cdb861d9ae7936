"""Helpers every style module shares: local values, the reductions of a partial sum, row orders of packed
parts, and the base class of styles that act on a module's own parameters."""

from __future__ import annotations


import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.overrides import TorchFunctionMode

# Torch functions that zero random elements: ``f(input, p, training, ...)``.
DROPOUTS = frozenset({"dropout", "dropout1d", "dropout2d", "dropout3d", "alpha_dropout", "feature_alpha_dropout",
                      "feature_dropout"})


def identity_dropout(name: str, args, kwargs) -> bool:
    """Whether a call ``name(*args, **kwargs)`` is a dropout that returns its input (``p == 0``, or not
    training): linear in a partial sum. A live one draws a mask per rank, which a partial sum cannot
    take (DTensor refuses it: no strategy keeps ``Partial()`` through ``bernoulli_``)."""
    if name not in DROPOUTS:
        return False
    named = dict(zip(("input", "p", "training"), args)) | dict(kwargs)
    return named.get("p", 0.5) == 0 or not named.get("training", named.get("train", True))


def is_partial(x) -> bool:
    return isinstance(x, DTensor) and any(p.is_partial() for p in x.placements)


class ReduceBeforeLiveDropout(TorchFunctionMode):
    """A ``Partial()`` DTensor that meets a live dropout is all-reduced first. A parallel block's
    branches may pass through dropout between their row (which leaves its output partial) and the
    add that joins them: in training with ``p > 0`` each branch then reduces on its own (the mask
    must apply to the whole sum); at ``p == 0`` or in eval the partial passes as it is."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        if name in DROPOUTS and args and is_partial(args[0]) and not identity_dropout(name, args, kwargs):
            args = (args[0].redistribute(placements=[Replicate()] * args[0].device_mesh.ndim), *args[1:])
        return func(*args, **kwargs)


def to_local(x):
    """Return the full local value of ``x``: a replicated plain tensor for any DTensor."""
    if isinstance(x, DTensor):
        return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim).to_local()
    return x


class WrapperStyle(ParallelStyle):
    """A style that adds hooks around another, ``style`` (optional), applied first; ``wrapped`` names
    it for code that finds a wrapper's parameter layout (absent: none)."""

    style: ParallelStyle | None = None

    @property
    def wrapped(self) -> ParallelStyle:
        if self.style is None:
            raise AttributeError("wrapped")
        return self.style

    def _apply_wrapped(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return module if self.style is None else self.style._apply(module, device_mesh)


def mode_during_forward(module: nn.Module, make_mode) -> None:
    """Enter a fresh ``make_mode()`` (a ``TorchFunctionMode`` or ``TorchDispatchMode``) for each
    forward of ``module``, inside the hooks registered before (a style's input hook runs first, so
    the mode sees the DTensors it made) and left before the hooks that handle the output, also when
    the forward raises (a mode left on the stack would outlive the module, and pop the wrong mode
    off the stack when an enclosing one, such as ``torch.device("meta")``, exits)."""
    modes = []

    def enter(mod, args):
        modes.append(make_mode())
        modes[-1].__enter__()

    def leave(mod, args, output):
        modes.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(enter)
    module.register_forward_hook(leave, prepend=True, always_call=True)


class LocalParamsStyle(ParallelStyle):
    """Base for styles whose module runs on plain local tensors with DTensor parameters.

    Parameters are distributed by :meth:`_placement`; during each forward they are swapped for
    ``param.to_local(grad_placements=...)`` views, so unmodified module code (indexing, F.linear,
    ``weight * x``) runs on plain tensors while gradients still flow to the DTensor parameters with
    the right placement. Subclasses may also transform inputs and outputs.
    """

    def _placement(self, name: str, param: torch.Tensor):
        raise NotImplementedError

    def _grad_placement(self, name: str, param: DTensor):
        return param.placements

    def sharded_param_dims(self, module: nn.Module) -> dict[str, int]:
        dims = {}
        for name, param in module.named_parameters(recurse=False):
            placement = self._placement(name, param)
            if isinstance(placement, Shard):
                dims[name] = placement.dim
        return dims

    def _distribute(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        for name, param in list(module.named_parameters(recurse=False)):
            dist = distribute_tensor(param, device_mesh, [self._placement(name, param)])
            module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))

    def _prepare_inputs(self, args, kwargs, device_mesh):
        return args, kwargs

    def _prepare_output(self, output, device_mesh):
        return output

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._distribute(module, device_mesh)
        saved: dict[str, nn.Parameter] = {}

        def pre_hook(mod, args, kwargs):
            for name, param in list(mod._parameters.items()):
                if isinstance(param, DTensor):
                    saved[name] = param
                    mod._parameters[name] = param.to_local(grad_placements=self._grad_placement(name, param))
            return self._prepare_inputs(args, kwargs, device_mesh)

        def post_hook(mod, args, kwargs, output):
            mod._parameters.update(saved)
            saved.clear()
            return self._prepare_output(output, device_mesh)

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        module.register_forward_hook(post_hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}()"


def all_reduce_backward(x: torch.Tensor, device_mesh: DeviceMesh) -> torch.Tensor:
    """Identity forward; all-reduce of the gradient in backward.

    For a replicated activation consumed by sharded computation: each rank's gradient with respect
    to it covers only its shard, so the full gradient is the sum over ranks.
    """
    if isinstance(x, DTensor) or not x.is_floating_point():
        return x
    return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False).to_local(grad_placements=[Partial()])


class _ScaleGrad(torch.autograd.Function):
    @staticmethod
    def forward(ctx, x, scale):
        ctx.scale = scale
        return x.clone()  # not a view: callers may write routing weights in place (small tensors)

    @staticmethod
    def backward(ctx, grad):
        return grad * ctx.scale, None


def scale_grad(value, scale: float):
    """Identity forward; the gradient times ``scale`` (a plain floating tensor; anything else as it is).

    With ``scale = 1 / tp``: for a value every rank computes whole inside a module whose input
    gradient is all-reduced at entry (a router's logits handed out beside a partial sum), the
    gradient arriving there is the same on every rank, so each rank passes back its share and the
    all-reduce restores it once.
    """
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.is_floating_point():
        return _ScaleGrad.apply(value, scale)
    return value


def reduce_feature_grads(value, spans: tuple[tuple[int, int], ...], device_mesh: DeviceMesh):
    """``value`` unchanged, with the gradient of each ``(start, stop)`` span of its last dim all-reduced
    (spans that touch are reduced together: one collective)."""
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or not value.is_floating_point():
        return value
    merged: list[list[int]] = []
    for start, stop in sorted(spans):
        if merged and start <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], stop)
        else:
            merged.append([start, stop])
    pieces, at = [], 0
    for start, stop in merged:
        pieces += [value[..., at:start], all_reduce_backward(value[..., start:stop], device_mesh)]
        at = stop
    pieces.append(value[..., at:])
    return torch.cat([p for p in pieces if p.shape[-1]], dim=-1)


def all_reduce_forward(x: torch.Tensor, device_mesh: DeviceMesh) -> torch.Tensor:
    """Sum a per-rank partial result over ranks (gradient passes through unchanged)."""
    if isinstance(x, DTensor):
        return x.redistribute(placements=[Replicate()]).to_local()
    return DTensor.from_local(x, device_mesh, [Partial()], run_check=False).redistribute(placements=[Replicate()]).to_local()


def packed_row_order(sizes: tuple[int, ...], tp_size: int) -> torch.Tensor:
    """Row permutation that makes a contiguous ``Shard(0)`` give each rank a slice of every part.

    A fused weight stacks parts ``[q | k | v]`` along its rows. Reordered as
    ``[q_0 k_0 v_0 | q_1 k_1 v_1 | ...]`` (``x_r`` = rank r's contiguous slice of part x), the r-th
    contiguous chunk is exactly rank r's slice of each part, in order, so the local output can be
    split with local sizes.

    >>> packed_row_order((4, 2), 2).tolist()
    [0, 1, 4, 2, 3, 5]
    """
    starts = torch.tensor([0, *sizes]).cumsum(0)[:-1].tolist()
    order = []
    for rank in range(tp_size):
        for start, size in zip(starts, sizes):
            step = size // tp_size
            order.extend(range(start + rank * step, start + (rank + 1) * step))
    return torch.tensor(order)


def permute_rows(tensor: torch.Tensor, *, dim: int, order: torch.Tensor) -> torch.Tensor:
    return tensor.index_select(dim, order)
