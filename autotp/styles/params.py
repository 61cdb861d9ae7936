"""A style for a module's own parameters that meet a head-sharded activation.

:class:`~autotp.styles.ReplicatedWithGradAllReduce` covers a norm whose weight is read by every head. The same
risk holds for any parameter read inside the head-sharded region: a per-head scale, a softmax
sink, a gate bias, a differential-attention lambda vector. On each rank such a parameter's
gradient covers only that rank's heads. :class:`HeadParams` makes every one of them exact:

- per-head parameters (an extent equal to the heads) are ``Shard(dim)``: rank r holds the entries
  of its heads, so the local gradient is the whole gradient of those entries;
- parameters every head reads (a vector over ``head_dim``, a scalar) stay ``Replicate()``, and
  their gradient, a partial sum over this rank's heads, is all-reduced (``Partial()``);
- the module's other parameters are left alone (replicated, their gradient already whole).

It may also divide integer attributes (head counts) by tp, as :class:`~autotp.styles.ShardCounts`
does, for a module that both reshapes into heads with a fixed count and owns such parameters; and
shard raw weight parameters its code multiplies like Linears' (``columns`` / ``rows``, see
:mod:`autotp.styles.raw_linear`).
"""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.utils._pytree import tree_map

from autotp.errors import PlanError
from autotp.styles.attention import ShardCounts
from autotp.styles.base import LocalParamsStyle, all_reduce_backward, packed_row_order, permute_rows, to_local
from autotp.styles.declared import Shards
from autotp.styles.raw_linear import add_products, missing_weights

__all__ = ["HeadParams"]


class HeadParams(LocalParamsStyle):
    """Shard a module's per-head parameters with its heads; all-reduce the gradient of shared ones.

    The module runs on plain local tensors: during its forward each parameter is its local view
    (``to_local(grad_placements=...)``), so ``self.scale.view(1, -1, 1, 1)`` reads this rank's
    heads' entries. Only the module's own parameters are touched (``recurse=False``); its child
    Linears keep their own styles.

    A dotted name (``"conv1d.weight"``) is a child's parameter that this module's own code reads
    (``F.conv1d(x, self.conv1d.weight)``, the child's forward never called): it is handed over as
    a local tensor around this module's forward. A buffer named in ``shard_dims`` (a per-channel
    scale vector) is replaced by this rank's slice: it has no gradient to keep exact.

    Keyword Args:
        shard_dims (dict[str, int]): parameter (or buffer) name -> the dim that holds the heads.
        reduce (tuple[str, ...]): parameters kept whole whose gradient is all-reduced over tp.
        counts (tuple[str, ...]): integer attribute paths divided by tp (head counts).
        packed (dict[str, tuple[int, ...]]): parameter name -> widths of the parts along its sharded
            dim, when it is sharded with a packed Linear's parts (``Colwise``): its
            entries are permuted the same way, so each rank holds its share of every part.
        gather_inputs (bool): DTensor inputs (a sequence-sharded stream) are made whole plain tensors
            at entry, once, for a module whose own code reads the stream before its column Linears
            (a token shift mixed with per-channel weights). Default: False.
        partial_grad_inputs (bool): floating inputs are taken with this rank's partial gradient,
            reduced once at entry (all-reduce; a sequence-sharded input is gathered and its gradient
            reduce-scattered): for a module whose column Linears read values its code computes from
            the input with replicated pointwise ops (learned mixes of a token shift), the columns
            handing their input gradients back unreduced (:class:`~autotp.styles.Boundary` with
            ``columns`` and ``input_grad="partial"``) and the mixes' parameters in ``reduce``. Default: False.
        columns (tuple[str, ...]): raw weights the module's code multiplies as a column Linear's
            (``x @ self.wq.T``, ``F.linear(x, self.wk)``, einsum, bmm), sharded on their output
            features in ``shard_dims``; the input of each product has its gradient all-reduced.
            Default: ().
        rows (tuple[str, ...]): raw weights multiplied as a row Linear's, sharded on their input
            features; each product is all-reduced before its bias and any other reader. With
            ``columns`` or ``rows`` a sequence-sharded input is gathered whole (the code around raw
            weights reads every position). Default: ().
        seq_output (bool): the (reduced, whole) output goes back to a sequence-sharded stream:
            each rank keeps its ``Shard(1)`` slice. Default: False.

    Example::
        >>> plan = {"layers.*.attn": HeadParams(shard_dims={"sink": 0}, reduce=("lambda_q",)),
        ...         "layers.*.mix": HeadParams(shard_dims={"wq": 0, "wo": 1}, columns=("wq",), rows=("wo",))}
    """

    def __init__(self, *, shard_dims: dict[str, int] | None = None, reduce: tuple[str, ...] = (),
                 counts: tuple[str, ...] = (), packed: dict[str, tuple[int, ...]] | None = None,
                 gather_inputs: bool = False, partial_grad_inputs: bool = False, columns: tuple[str, ...] = (),
                 rows: tuple[str, ...] = (), seq_output: bool = False):
        super().__init__()
        self.shard_dims = dict(shard_dims or {})
        self.reduce = tuple(reduce)
        self.counts = tuple(counts)
        self.packed = {name: tuple(sizes) for name, sizes in (packed or {}).items()}
        self.gather_inputs = gather_inputs
        self.partial_grad_inputs = partial_grad_inputs
        self.columns, self.rows, self.seq_output = tuple(columns), tuple(rows), seq_output

    @property
    def raw_linear(self) -> bool:
        """The module multiplies raw weights of its own like Linears (``columns`` / ``rows``)."""
        return bool(self.columns or self.rows)

    def _prepare_inputs(self, args, kwargs, device_mesh):
        if self.partial_grad_inputs and not self.raw_linear:
            take = partial(_partial_grad_input, device_mesh=device_mesh)
        elif self.gather_inputs or self.raw_linear:
            # A sequence-sharded stream is gathered whole (the code around raw weights reads every position).
            take = lambda v: to_local(v) if isinstance(v, DTensor) else v  # noqa: E731
        else:
            return super()._prepare_inputs(args, kwargs, device_mesh)
        return tree_map(take, args), tree_map(take, kwargs)

    def _prepare_output(self, output, device_mesh):
        # Back to the sequence-sharded stream: each rank keeps its positions of the reduced output.
        if not self.seq_output or not isinstance(output, torch.Tensor) or isinstance(output, DTensor):
            return output
        return DTensor.from_local(output, device_mesh, [Replicate()], run_check=False).redistribute(
            placements=[Shard(1)])

    def _placement(self, name, param):
        # A per-head vector is cut like the heads it scales: contiguous blocks of heads per rank,
        # the same blocks the column-parallel projections give each rank.
        return Shard(self.shard_dims[name]) if name in self.shard_dims else Replicate()

    def _grad_placement(self, name, param):
        # Partial: each rank's gradient sums over its own heads only; the full gradient is their sum.
        return [Partial()] if name in self.reduce else param.placements

    def _children(self, module: nn.Module) -> list[tuple[nn.Module, str, str]]:
        """``(owning child, its parameter name, dotted name)`` for each dotted parameter name."""
        found = []
        for name in (*self.shard_dims, *self.reduce):
            path, _, leaf = name.rpartition(".")
            if path and leaf in module.get_submodule(path)._parameters:
                found.append((module.get_submodule(path), leaf, name))
        return found

    def sharded_param_dims(self, module: nn.Module) -> dict[str, int]:
        return {**super().sharded_param_dims(module),
                **{name: dim for name, dim in self.shard_dims.items() if "." in name and
                   name in dict(module.named_parameters())}}

    def _slice_buffers(self, module: nn.Module, device_mesh: DeviceMesh) -> set[str]:
        """Replace each sharded buffer by this rank's slice (permuted first if packed)."""
        found = set()
        for name, dim in self.shard_dims.items():
            path, _, leaf = name.rpartition(".")
            owner = module.get_submodule(path)
            if owner._buffers.get(leaf) is None:
                continue
            value = owner._buffers[leaf]
            if name in self.packed:
                value = permute_rows(value, dim=dim, order=packed_row_order(self.packed[name], device_mesh.size()))
            local = distribute_tensor(value, device_mesh, [Shard(dim)]).to_local()
            owner.register_buffer(leaf, local, persistent=leaf not in owner._non_persistent_buffers_set)
            found.add(name)
        return found

    def _distribute(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        owned = {n for n, _ in module.named_parameters()} | self._slice_buffers(module, device_mesh)
        for name in (*self.shard_dims, *self.reduce):
            if name not in owned or ("." not in name and name not in module._parameters | module._buffers):
                raise PlanError(f"{type(module).__name__}: HeadParams names parameter {name!r}, which the "
                                f"module does not own (it has {sorted(module._parameters)}); fix the names")
        own = [(module, name, name) for name in module._parameters if module._parameters[name] is not None]
        for owner, leaf, name in own + self._children(module):
            param = owner._parameters[leaf]
            layout = None
            if name in self.packed:
                order = packed_row_order(self.packed[name], device_mesh.size())
                layout = partial(permute_rows, dim=self.shard_dims[name], order=order)
                with torch.no_grad():
                    param = layout(param)
            dist = distribute_tensor(param, device_mesh, [self._placement(name, param)])
            new = nn.Parameter(dist, requires_grad=owner._parameters[leaf].requires_grad)
            if layout is not None:
                new._autotp_to_layout = layout
            owner.register_parameter(leaf, new)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        missing = missing_weights(module, {*self.shard_dims, *self.columns, *self.rows}) if self.raw_linear else ()
        if missing:
            raise PlanError(f"{type(module).__name__}: HeadParams names {sorted(missing)}, which the module does "
                            f"not own (it has {sorted(module._parameters)}); fix the names")
        if self.counts:
            ShardCounts(names=self.counts)._apply(module, device_mesh)
        super()._apply(module, device_mesh)
        children, saved = self._children(module), {}

        def pre_hook(mod, args, kwargs):
            for child, leaf, name in children:
                param = child._parameters[leaf]
                if isinstance(param, DTensor):
                    saved[name] = param
                    child._parameters[leaf] = param.to_local(grad_placements=self._grad_placement(name, param))

        def post_hook(mod, args, kwargs, output):
            for child, leaf, name in children:
                if name in saved:
                    child._parameters[leaf] = saved.pop(name)

        if children:
            module.register_forward_pre_hook(pre_hook, with_kwargs=True)
            module.register_forward_hook(post_hook, with_kwargs=True)
        if self.raw_linear:
            add_products(module, self, device_mesh)  # after the pre-hooks that swap in the local tensors
        return module

    def __repr__(self) -> str:
        options = [f"{k}={v!r}" for k, v in (("shard_dims", self.shard_dims), ("reduce", self.reduce),
                                              ("counts", self.counts), ("packed", self.packed),
                                              ("gather_inputs", self.gather_inputs),
                                              ("partial_grad_inputs", self.partial_grad_inputs),
                                              ("columns", self.columns), ("rows", self.rows),
                                              ("seq_output", self.seq_output)) if v]
        return f"{self.__class__.__name__}({', '.join(options)})"

    def declares(self) -> Shards:
        """Per-head parameters, and the raw weights it multiplies like a Linear's, by role."""
        return Shards(param_dims=dict(self.shard_dims), param_packed=dict(self.packed), grads_reduced=self.reduce,
                      counts=self.counts, raw_linear=(self.columns, self.rows) if self.raw_linear else None)


def _partial_grad_input(value, *, device_mesh: DeviceMesh):
    """``value`` whole and local, its gradient taken as this rank's partial sum: a DTensor is made
    ``Replicate()`` (gathered if sequence-sharded, so the backward reduce-scatters), a plain floating
    tensor's gradient is all-reduced."""
    if isinstance(value, DTensor):
        whole = value.redistribute(placements=[Replicate()] * value.device_mesh.ndim)
        return whole.to_local(grad_placements=[Partial()] * value.device_mesh.ndim)
    if isinstance(value, torch.Tensor):
        return all_reduce_backward(value, device_mesh)
    return value
