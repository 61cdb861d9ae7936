"""Norms and per-head parameters that meet a sharded activation: gradients all-reduced, or statistics
reduced over a sharded width."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves

from autotp.styles.base import LocalParamsStyle, mode_during_forward
from autotp.styles.declared import Shards


class ReplicatedWithGradAllReduce(LocalParamsStyle):
    """Keep a module's parameters replicated and all-reduce their gradients.

    For a module between a column- and a row-parallel Linear that sees only this rank's part of
    the activation: each rank's parameter gradient is a partial sum over its shard, and plain
    replicated parameters would drift apart after one optimizer step, silently. A per-head norm
    (Qwen3's ``q_norm`` / ``k_norm``) on heads a column projection sharded is one: it reduces over
    ``head_dim`` only, so its local result is exact, and its weight's gradient sums over this
    rank's heads only.

    With ``dtensor=True`` the module's own parameters (not its children's) become ``Replicate()``
    DTensors and stay so during its forward (no hooks): for a module that applies them to a DTensor
    stream (a norm inside a block run on a ``Replicate()`` stream, an input scale on the
    sequence-sharded stream of a model that also holds the layers), where DTensor itself reduces
    their gradients, while the children keep their own styles.

    Keyword Args:
        dtensor (bool): keep the parameters DTensors in the forward. Default: False.

    Example::
        >>> plan = {"model.layers.*.mlp.gate_norm": ReplicatedWithGradAllReduce(),
        ...         "model.layers.*.self_attn.q_norm": ReplicatedWithGradAllReduce(),
        ...         "model": ReplicatedWithGradAllReduce(dtensor=True)}
    """

    def __init__(self, *, dtensor: bool = False):
        super().__init__()
        self.dtensor = dtensor

    def _placement(self, name, param):
        return Replicate()

    def _grad_placement(self, name, param):
        return [Partial()]

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not self.dtensor:
            return super()._apply(module, device_mesh)
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                dist = DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)
                module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({'dtensor=True' if self.dtensor else ''})"

    def declares(self) -> Shards:
        # With DTensor parameters the module computes on DTensors, which reduce the gradients themselves.
        return Shards() if self.dtensor else Shards(grads_reduced=("*",))


class WidthShardedNorm(ParallelStyle):
    """A norm over a width that a column-parallel projection sharded (OLMo2 ``q_norm``).

    ``RMSNorm(q_proj(x))`` normalises over all heads together. With ``q_proj`` column-parallel,
    each rank holds a slice of that width. The norm runs on DTensors: the input is
    ``Shard(shard_dim)``, the weight ``Shard(0)`` like its input, the mean of squares becomes a
    partial sum that DTensor all-reduces (a ``(batch, seq, 1)`` statistic), and the result is exact
    and stays sharded (returned local).

    In backward that statistic's gradient is a partial sum as well (each rank sums ``grad * x`` over
    its own slice of the width). Left to DTensor, the partial gradient is broadcast back over the
    width first and reduce-scattered there: a collective the size of the activation per norm, where
    the forward paid one of the statistic's size. Each statistic is therefore made whole right
    where it is computed, with its gradient all-reduced at the same small size
    (:class:`_ReduceStatistics`): the backward then costs what the forward does.

    Keyword Args:
        shard_dim (int): the sharded (normalised) dimension of the input. Default: -1.

    Example::
        >>> plan = {"model.layers.*.self_attn.q_norm": WidthShardedNorm()}
    """

    def __init__(self, *, shard_dim: int = -1):
        super().__init__()
        self.shard_dim = shard_dim

    def sharded_param_dims(self, module: nn.Module) -> dict[str, int]:
        return {name: 0 for name, _ in module.named_parameters(recurse=False)}

    def _partition_fn(self, name, module, device_mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            dist = distribute_tensor(param, device_mesh, [Shard(0)])
            module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))

    @staticmethod
    def _prepare_input_fn(shard_dim, mod, inputs, device_mesh):
        # A gated norm takes the gate as a second input, sharded like x (same local shape): it is
        # made a DTensor alike, so ``x * silu(gate)`` runs on DTensors too.
        x = inputs[0]
        local = x.to_local() if isinstance(x, DTensor) else x
        out = []
        for value in inputs:
            if isinstance(value, DTensor) or not isinstance(value, torch.Tensor) or value.shape != local.shape:
                out.append(value)
            else:
                out.append(DTensor.from_local(value, device_mesh, [Shard(shard_dim % value.ndim)], run_check=False))
        return tuple(out)

    @staticmethod
    def _prepare_output_fn(shard_dim, mod, outputs, device_mesh):
        if not isinstance(outputs, DTensor):
            return outputs
        # The output is the input's layout (a grouped norm's views may have made DTensor gather it).
        wanted = [Shard(shard_dim % outputs.ndim)]
        if list(outputs.placements) != wanted:
            outputs = outputs.redistribute(placements=wanted)
        return outputs.to_local()

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = distribute_module(
            module,
            device_mesh,
            self._partition_fn,
            partial(self._prepare_input_fn, self.shard_dim),
            partial(self._prepare_output_fn, self.shard_dim),
        )
        # Inside distribute_module's hooks: the mode sees the DTensors its input hook made.
        mode_during_forward(module, _ReduceStatistics)
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(shard_dim={self.shard_dim})"

    def declares(self) -> Shards:
        return Shards(width_norm=True)


class _ReduceStatistics(TorchFunctionMode):
    """Reduce each partial statistic of a width-sharded norm where it is made, in both directions.

    A call on DTensors that returns a ``Partial()`` DTensor smaller than its largest input (a sum
    or mean over the sharded width) is redistributed to ``Replicate()`` at once (the all-reduce
    DTensor would issue at its next use anyway) and passed through :class:`_AllReduceGrad`, so
    that its gradient, partial over the width, is all-reduced at the statistic's size.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        if not (isinstance(out, DTensor) and any(p.is_partial() for p in out.placements)):
            return out
        largest = max((t.numel() for t in tree_leaves((args, kwargs)) if isinstance(t, torch.Tensor)), default=0)
        if out.numel() >= largest:
            return out
        return _AllReduceGrad.apply(out.redistribute(placements=[Replicate()] * out.device_mesh.ndim))


class _AllReduceGrad(torch.autograd.Function):
    """Identity on a replicated DTensor; its gradient, if partial, is all-reduced."""

    @staticmethod
    def forward(ctx, x):
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor) and any(p.is_partial() for p in grad.placements):
            grad = grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim)
        return grad
