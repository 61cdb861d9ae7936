"""Grouped experts: 3-D expert parameters sharded on their FFN dim, the output reduced after the module."""

from __future__ import annotations

from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor

from autotp._simulate import mesh_coordinate
from autotp.errors import PlanError
from autotp.styles.base import (LocalParamsStyle, all_reduce_backward, all_reduce_forward, packed_row_order, permute_rows,
                                scale_grad)
from autotp.styles.declared import Shards


class ExpertsParallel(LocalParamsStyle):
    """Shard every expert of a grouped-experts module on its FFN dimension (transformers 5 MoE).

    transformers 5 stores experts as 3-D parameters: ``gate_up_proj`` (experts, 2 * ffn, hidden)
    and ``down_proj`` (experts, hidden, ffn). Each rank keeps ``ffn / tp`` of every expert: the
    fused gate/up rows part by part (dim 1, :func:`packed_row_order`), the down projection's input
    columns (dim 2). Each rank runs the routing on the replicated tokens with its slice of every
    expert and produces a partial sum, all-reduced once after the module: one all-reduce per MoE
    layer, as for a dense MLP. The router stays replicated; the gradients of the hidden states and
    of the routing weights are partial and are all-reduced in backward.

    With ``partial_grad_inputs=True`` the block's input arrives as a ``Replicate()`` DTensor (its
    norm returns one) and the routing weights from a :class:`PartialGradRouter`: both input
    gradients are left per-rank partial sums, added to the router's and any shared expert's before
    the norm reduces the block input's gradient once, where the default reduces hidden states and
    routing weights separately (two all-reduces per layer in backward where the forward has one).

    A per-expert bias added after the down projection (``down_bias[e]``) is added to each rank's
    partial sum, so the reduction would count it tp times: the parameters named in ``once`` are
    added by rank 0 only (zero elsewhere), their gradient ``Partial()``, as Megatron adds a row's
    bias once after the reduction.

    Terms whole on every rank may be added to that partial sum too: zero-compute (identity) experts
    add the routed tokens times their routing weight, computed alike by every rank. The output on
    rank r is then ``P_r + W``, ``P_r`` linear in the down projection, ``W`` free of it, and the
    all-reduce would count ``W`` tp times. With ``scale_rows`` the named parameters are multiplied
    by tp on each rank and the output divided by tp: ``(tp * P_r + W) / tp = P_r + W / tp``, summed
    over ranks ``sum(P_r) + W``. ``W``'s gradient is ``1 / tp`` of the full one on each rank, which the
    inputs' reduction in backward adds up; the rows' own gradient is unchanged (times tp, divided
    by tp). A per-expert bias is such a term too, so ``once`` is not needed (and refused) with it.
    Exact in floating point for a power-of-two tp; a float16 down projection's output must stay
    below ``65504 / tp``.

    A module may hold one side of the pair only (ScatterMoE-style code keeps the stacked up
    projection and the stacked down projection in two modules, with the activation between them in
    the parent): with ``side="columns"`` its output is this rank's FFN features, handed on local
    (not reduced); with ``side="rows"`` its inputs are this rank's FFN features, taken as they are
    (their gradients are this rank's too: nothing to reduce), and its output is the partial sum.

    Keyword Args:
        shard_dims (dict[str, int]): parameter name -> sharded dim.
        packed (dict[str, int]): parameter name -> number of equal parts fused along its sharded dim.
        partial_grad_inputs (bool): DTensor inputs are taken local with ``Partial()`` gradients, and
            plain floating inputs come from a :class:`PartialGradRouter`. Default: False.
        once (tuple[str, ...]): replicated parameters added to the per-rank partial sum, added by
            one rank only. Default: none.
        scale_rows (tuple[str, ...]): row parameters (read only by products whose outputs reach the
            output linearly) multiplied by tp while the output is divided by tp, so terms whole on
            every rank count once. Default: none.
        side (str): ``"both"`` (the module holds columns and rows), ``"columns"`` or ``"rows"``.
            Default: ``"both"``.
        partial_grad_plain (bool): with ``side="columns"``, plain floating inputs are handed back
            their gradient unreduced, as this rank's partial sum: a value reduced once further back
            (``Boundary(output_grad="partial")``) with every other reader's share. Default: False.
        partial_output (bool): leave the output this rank's partial sum, for the block to reduce:
            under sequence parallel a reduce-scatter onto the ``Shard(1)`` stream moves half the
            bytes of an all-reduce followed by a slice. The inputs' gradients are still reduced.
            Default: False.

    Example::
        >>> plan = {"model.layers.*.mlp.experts": ExpertsParallel()}
        >>> loop = ExpertsParallel(shard_dims={"gate_up": 2, "gate_up_bias": 1, "down": 1}, packed={},
        ...                        once=("down_bias",))
        >>> identity_experts = ExpertsParallel(scale_rows=("down_proj",))
    """

    def __init__(self, *, shard_dims: dict[str, int] | None = None, packed: dict[str, int] | None = None,
                 partial_grad_inputs: bool = False, once: tuple[str, ...] = (), scale_rows: tuple[str, ...] = (),
                 side: str = "both", partial_grad_plain: bool = False, partial_output: bool = False):
        super().__init__()
        self.partial_output = partial_output
        if partial_grad_plain and (side != "columns" or partial_grad_inputs):
            raise PlanError(f"ExpertsParallel(partial_grad_plain=True) with side={side!r}, partial_grad_inputs="
                            f"{partial_grad_inputs}: only a module of columns (side='columns') hands its plain "
                            "inputs' partial gradients back unreduced; drop partial_grad_plain")
        self.partial_grad_plain = partial_grad_plain
        if side not in ("both", "columns", "rows"):
            raise PlanError(f"ExpertsParallel: side={side!r}; use 'both', 'columns' or 'rows'")
        if side == "columns" and (once or scale_rows):
            raise PlanError(f"ExpertsParallel(side='columns') with once={tuple(once)} / scale_rows={tuple(scale_rows)}: "
                            "a module of columns makes no partial sum; drop them, or use side='both'")
        if side == "rows" and partial_grad_inputs:
            raise PlanError("ExpertsParallel(side='rows', partial_grad_inputs=True): a module of rows takes this "
                            "rank's features, whose gradients are not partial sums; drop partial_grad_inputs")
        self.side = side
        self.shard_dims = dict(shard_dims or {"gate_up_proj": 1, "down_proj": 2})
        self.packed = dict(packed if packed is not None else {"gate_up_proj": 2})
        self.partial_grad_inputs = partial_grad_inputs
        self.once = tuple(once)
        self.scale_rows = tuple(scale_rows)
        if set(self.once) & set(self.shard_dims):
            raise PlanError(f"ExpertsParallel: {sorted(set(self.once) & set(self.shard_dims))} are both sharded "
                            "(shard_dims) and added once to the partial sum (once); a parameter added to the "
                            "partial sum is replicated: drop it from one of them")
        if self.once and self.scale_rows:
            raise PlanError(f"ExpertsParallel: once={self.once} with scale_rows={self.scale_rows}; scaling the rows "
                            "already counts every whole addend once, per-expert biases included (added by one rank "
                            "they would count 1/tp): drop once")
        if set(self.scale_rows) - set(self.shard_dims):
            raise PlanError(f"ExpertsParallel: scale_rows names {sorted(set(self.scale_rows) - set(self.shard_dims))}, "
                            f"which are not sharded (shard_dims: {sorted(self.shard_dims)}); name the row "
                            "parameters (the down projections) whose products make the partial sum")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        missing = [name for name in self.once if not isinstance(getattr(module, name, None), nn.Parameter)]
        if missing:
            raise PlanError(f"{type(module).__name__}: ExpertsParallel(once={self.once}) names {missing}, which "
                            "are not parameters of the module; name its own per-expert biases added after the "
                            "down projection")
        super()._apply(module, device_mesh)
        if self.once:
            once = self.once

            def added_once(mod, args, kwargs):
                # Runs after the base pre-hook swapped in local values: rank 0 keeps them, the others
                # add zeros (and get a zero gradient; the Partial() sum is rank 0's).

                for name in once:
                    value = mod._parameters[name]
                    first = (mesh_coordinate(device_mesh) == 0).to(device=value.device, dtype=value.dtype)
                    mod._parameters[name] = value * first
                return args, kwargs

            module.register_forward_pre_hook(added_once, with_kwargs=True)
        if self.scale_rows:
            scale_rows, tp = self.scale_rows, device_mesh.size()

            def rows_times_tp(mod, args, kwargs):
                # After the base pre-hook: the local shards, multiplied with autograd (their
                # gradient times tp, undone by the output's division).
                for name in scale_rows:
                    mod._parameters[name] = mod._parameters[name] * tp
                return args, kwargs

            module.register_forward_pre_hook(rows_times_tp, with_kwargs=True)
        return module

    def _scaled_output(self, output, device_mesh):
        """The per-rank output divided by tp where the rows were multiplied by tp."""
        if not self.scale_rows:
            return output
        if not isinstance(output, torch.Tensor):
            raise PlanError(f"ExpertsParallel(scale_rows={self.scale_rows}) needs one tensor output to divide by tp; "
                            f"the module returned {type(output).__name__}")
        return output / device_mesh.size()

    def _placement(self, name, param):
        return Shard(self.shard_dims[name]) if name in self.shard_dims else Replicate()

    def _grad_placement(self, name, param):
        # A replicated parameter (e.g. a bias added by every rank) gets a partial gradient.
        return [Partial()] if name not in self.shard_dims else param.placements

    def _distribute(self, module, device_mesh):
        tp = device_mesh.size()
        for name, param in list(module.named_parameters(recurse=False)):
            value = param
            parts = self.packed.get(name)
            if parts:
                dim = self.shard_dims[name]
                with torch.no_grad():
                    value = param.index_select(dim, packed_row_order((param.shape[dim] // parts,) * parts, tp))
            dist = distribute_tensor(value, device_mesh, [self._placement(name, param)])
            new = nn.Parameter(dist, requires_grad=param.requires_grad)
            if parts:
                dim = self.shard_dims[name]
                order = packed_row_order((param.shape[dim] // parts,) * parts, tp)
                new._autotp_to_layout = partial(permute_rows, dim=dim, order=order)
            module.register_parameter(name, new)

    def _prepare_inputs(self, args, kwargs, device_mesh):
        if self.side == "rows" or self.partial_grad_plain:
            # rows: this rank's features, their gradients this rank's; partial_grad_plain: the
            # columns' partial input gradients, reduced once where the value was made
            return args, kwargs
        if self.partial_grad_inputs:
            if not any(isinstance(v, DTensor) for v in (*args, *kwargs.values())):
                raise PlanError(
                    "ExpertsParallel(partial_grad_inputs=True) got no DTensor input: the MoE block's input "
                    "must arrive as the Replicate() DTensor its norm returns (Boundary(outputs='replicate'), or "
                    "Boundary(outputs='gather', local_outputs=False, style=SequenceParallel())); else drop "
                    "partial_grad_inputs.")
            # From a PartialGradRouter, which divides its outputs' gradients by tp: times tp here
            # keeps this partial sum whole, while a full gradient from elsewhere counts once.
            take = partial(_partial_grad_input, scale=float(device_mesh.size()))
        else:
            take = partial(all_reduce_backward, device_mesh=device_mesh)
        args = tuple(take(a) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: take(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return args, kwargs

    def _prepare_output(self, output, device_mesh):
        if self.side == "columns":
            return output  # this rank's FFN features, for the rows of another module
        output = self._scaled_output(output, device_mesh)
        return output if self.partial_output else all_reduce_forward(output, device_mesh)

    def __repr__(self) -> str:
        extra = ", partial_grad_inputs=True" if self.partial_grad_inputs else ""
        extra += f", side={self.side!r}" if self.side != "both" else ""
        extra += ", partial_grad_plain=True" if self.partial_grad_plain else ""
        extra += f", once={self.once}" if self.once else ""
        extra += f", scale_rows={self.scale_rows}" if self.scale_rows else ""
        extra += ", partial_output=True" if self.partial_output else ""
        return f"{self.__class__.__name__}(shard_dims={self.shard_dims}, packed={self.packed}{extra})"

    def declares(self) -> Shards:
        return Shards(experts=dict(self.shard_dims), experts_packed=dict(self.packed))


class PartialGradRouter(LocalParamsStyle):
    """A router kept whole that runs its backward on the experts' partial gradients.

    The routing weights' gradient from experts sharded on their FFN dim is a per-rank partial sum
    (each rank's slice of every expert's output). A backward is linear in its incoming gradient, so
    the router can run it on that partial sum as is: its input gradient is then partial too, and is
    added to the experts' before the block input's single reduction; its weight gradient is left
    ``Partial()`` (reduced where gradients are synchronised, as a sequence-parallel norm's). That
    saves the all-reduce of the routing weights' gradient per layer.

    A gradient reaching the router's outputs from elsewhere (an auxiliary loss on the router
    logits) is the same full value on every rank; outputs' gradients are divided by tp so that it
    counts once in the sum over ranks, and :class:`ExpertsParallel` with ``partial_grad_inputs``
    multiplies its own by tp. DTensor inputs (the norm's ``Replicate()`` output) are taken local
    with ``Partial()`` gradients; plain floating inputs all-reduce theirs.

    With ``partial_grad_plain`` plain floating inputs are taken as they are: their gradient, a share
    of the whole (the outputs' gradients divided by tp), is added to other readers' shares and
    reduced once where the value was made (``Boundary(output_grad="partial")``). Right only
    where the outputs' gradients are whole on every rank (no output reaches a reader that hands
    back a partial gradient).

    Keyword Args:
        partial_grad_plain (bool): leave plain inputs' gradients unreduced shares. Default: False.

    Example::
        >>> from autotp.styles import Boundary
        >>> plan = {"model.layers.*.post_attention_layernorm": Boundary(outputs="replicate"),
        ...         "model.layers.*.mlp.gate": PartialGradRouter(),
        ...         "model.layers.*.mlp.experts": ExpertsParallel(partial_grad_inputs=True)}
    """

    def __init__(self, *, partial_grad_plain: bool = False):
        super().__init__()
        self.partial_grad_plain = partial_grad_plain

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({'partial_grad_plain=True' if self.partial_grad_plain else ''})"

    def _placement(self, name, param):
        return Replicate()

    def _grad_placement(self, name, param):
        return [Partial()]

    def _distribute(self, module: nn.Module, device_mesh: DeviceMesh) -> None:
        # Every parameter the router's code reads, its children's too (a ``gate`` Linear inside
        # the router): each gets a Partial() gradient, or it would keep a per-rank partial sum
        # that nothing reduces. A child another style already distributed is not the router's.
        for prefix, sub in module.named_modules():
            for name, param in list(sub.named_parameters(recurse=False)):
                if isinstance(param, DTensor):
                    raise PlanError(f"{type(module).__name__}: PartialGradRouter gives every parameter of the "
                                    f"router a Partial() gradient, but {prefix + '.' if prefix else ''}{name} is "
                                    "already distributed by another style; keep the router's children out of "
                                    "the plan")
                dist = distribute_tensor(param, device_mesh, [Replicate()])
                sub.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self._distribute(module, device_mesh)
        saved: list[tuple[nn.Module, str, DTensor]] = []

        def pre_hook(mod, args, kwargs):
            for sub in mod.modules():
                for name, param in list(sub._parameters.items()):
                    if isinstance(param, DTensor):
                        saved.append((sub, name, param))
                        sub._parameters[name] = param.to_local(grad_placements=[Partial()])
            return self._prepare_inputs(args, kwargs, device_mesh)

        def post_hook(mod, args, kwargs, output):
            for sub, name, param in saved:
                sub._parameters[name] = param
            saved.clear()
            return self._prepare_output(output, device_mesh)

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        module.register_forward_hook(post_hook, with_kwargs=True)
        return module

    def _prepare_inputs(self, args, kwargs, device_mesh):
        take = partial(_partial_grad_input, scale=1.0 if self.partial_grad_plain else None, device_mesh=device_mesh)
        args = tuple(take(a) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: take(v) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return args, kwargs

    def _prepare_output(self, output, device_mesh):
        scale = 1.0 / device_mesh.size()
        if isinstance(output, (tuple, list)):
            return type(output)(scale_grad(o, scale) for o in output)
        return scale_grad(output, scale)


def _partial_grad_input(value, *, scale, device_mesh=None):
    """A DTensor taken local with a ``Partial()`` gradient; a plain floating tensor's gradient
    multiplied by ``scale``, or all-reduced where ``scale`` is None."""
    if isinstance(value, DTensor):
        if value.placements != (Replicate(),):  # not when replicated: its backward would all-reduce
            value = value.redistribute(placements=[Replicate()])
        return value.to_local(grad_placements=[Partial()])
    if scale is None:
        return all_reduce_backward(value, device_mesh)
    return scale_grad(value, scale)
