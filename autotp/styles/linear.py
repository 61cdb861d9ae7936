"""Linear styles torch lacks: fused projections cut part by part (and rows whose input holds such parts),
weights stored (in, out), and a row whose partial output is reduced together with another's."""

from __future__ import annotations

import copy
import weakref
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from autotp._simulate import mesh_coordinate
from autotp.errors import PlanError
from autotp.plan import sharded_param_dims
from autotp.styles.base import (DROPOUTS, ReduceBeforeLiveDropout, WrapperStyle, is_partial, mode_during_forward,
                                packed_row_order, permute_rows, reduce_feature_grads)
from autotp.styles.declared import Shards, torch_shards
from autotp.styles.group_copies import Copies, _cut_groups, _groups_whole, copy_index, expand_module, expanded_width
from autotp.styles.params import HeadParams


def _sizes(sizes) -> tuple[int, ...] | None:
    return tuple(int(s) for s in sizes) if sizes else None


class Colwise(ColwiseParallel):
    """torch's :class:`ColwiseParallel` with the two layouts LLM checkpoints add: a fused output cut
    part by part, and a weight stored ``(in, out)``.

    ``sizes``: the output is a concatenation of parts (a fused ``[q | k | v]`` or ``[gate | up]``).
    Plain ``ColwiseParallel`` would hand rank 0 all of q and rank 1 the rest of q plus k and v, and
    the split after it would mix parts with no error. Here the rows (and bias) are first permuted
    by :func:`packed_row_order`, then sharded ``Shard(0)``: each rank holds ``size / tp`` rows of
    every part. Parts may be unequal (GQA: ``sizes=(heads * d, kv * d, kv * d)``). The parameter
    keeps the permuted order; its ``_autotp_to_layout`` attribute maps an unsharded tensor to that
    order, for checkpoint conversion and for :func:`autotp.verify`.

    ``weight_in_out``: a Linear-like module whose weight is stored ``(in, out)`` (transformers'
    ``Conv1D``: ``addmm(bias, x, weight)``): the weight is sharded on dim 1, the bias on dim 0. The
    module runs on DTensors (its code reshapes with global sizes, ``view(..., self.nf)``); the
    output is turned local after it returns.

    Keyword Args:
        sizes (tuple[int, ...] | None): widths of the output's parts, summing to its features.
        weight_in_out (bool): the weight is stored ``(in, out)``. Default: False.
        input_layouts, output_layouts, use_local_output: as for :class:`ColwiseParallel`.

    Example::
        >>> plan = {"model.layers.*.mlp.gate_up_proj": Colwise(sizes=(8192, 8192)),
        ...         "transformer.h.*.mlp.c_fc": Colwise(weight_in_out=True)}
    """

    def __init__(self, *, sizes: tuple[int, ...] | None = None, weight_in_out: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.sizes = _sizes(sizes)
        self.weight_in_out = weight_in_out

    def _partition_linear_fn(self, name, module, device_mesh):
        if self.sizes is None:
            return super()._partition_linear_fn(name, module, device_mesh)
        self._partition_fn(name, module, device_mesh)

    def _partition_fn(self, name, module, device_mesh):
        """Each parameter sharded on its output-feature dim (an ``(in, out)`` weight: dim 1), part by part."""
        order = packed_row_order(self.sizes, device_mesh.size()) if self.sizes else None
        for pname, param in list(module.named_parameters(recurse=False)):
            dim = param.ndim - 1 if self.weight_in_out else 0
            with torch.no_grad():
                value = param if order is None else param.index_select(dim, order.to(param.device))
            dist = distribute_tensor(value, device_mesh, [Shard(dim)], src_data_rank=self.src_data_rank)
            new = nn.Parameter(dist, requires_grad=param.requires_grad)
            if order is not None:
                new._autotp_to_layout = partial(permute_rows, dim=dim, order=order)
            module.register_parameter(pname, new)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not self.weight_in_out:
            return super()._apply(module, device_mesh)
        return distribute_module(
            module, device_mesh, self._partition_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )

    def sharded_param_dims(self, module: nn.Module) -> dict[str, int] | None:
        if self.weight_in_out:  # the output features are the weight's last dim
            return {n: p.ndim - 1 for n, p in module.named_parameters(recurse=False)}
        return None  # as ColwiseParallel's layouts say

    def __repr__(self) -> str:
        return _with_options(super().__repr__(), sizes=self.sizes, weight_in_out=self.weight_in_out)

    def declares(self) -> Shards:
        return torch_shards(self, weight_in_out=self.weight_in_out)


class Rowwise(RowwiseParallel):
    """torch's :class:`RowwiseParallel` with the options LLM plans need: input features in parts, a
    partial output, spans of the output whose gradient is reduced, a weight stored ``(in, out)``.

    ``sizes``: the input features are parts side by side, each rank holding its share of every
    part (an attention that views its fused qkv as a fixed number of groups, ``reshape(b, t, G,
    -1)``, is sharded within each group, so after the merge back its heads are ``G`` blocks with a
    slice of each on every rank). The weight's columns are permuted by :func:`packed_row_order`
    before the usual ``Shard(1)``; plain ``RowwiseParallel`` would multiply them by the wrong
    columns with no error.

    ``output_layouts=Partial()``: the output stays a partial sum (one branch of a parallel block),
    for the caller to add to the other branch before one reduction: a ``Partial()`` DTensor, or
    with ``use_local_output=True`` the plain per-rank partial sum (code that adds it up in plain
    tensors, :class:`~autotp.styles.PartialSumBlock`). Its gradient is taken ``Replicate()``: when
    the sum is reduce-scattered onto the ``Shard(1)`` stream (SP), the gradient comes back
    sequence-sharded and is all-gathered once here; the branches that the add joins share that one
    gather (by the gradient's identity), mirroring the block's one reduce-scatter.

    ``reduce_grad_features``: ``(start, stop)`` spans of the (whole, reduced) output whose gradient
    is all-reduced on the way back: they are broadcast along a sharded dim downstream (the same
    state projection for every channel of a channel-sharded scan), so each rank's gradient of them
    is its own channels' share.

    ``weight_in_out``: the weight is stored ``(in, out)`` (transformers' ``Conv1D``): sharded on
    dim 0, the contracted input features; the bias kept whole.

    Keyword Args:
        sizes (tuple[int, ...] | None): widths of the input's parts, summing to ``in_features``.
        reduce_grad_features (tuple[tuple[int, int], ...]): output spans whose gradient is all-reduced.
        weight_in_out (bool): the weight is stored ``(in, out)``. Default: False.
        input_layouts, output_layouts, use_local_output: as for :class:`RowwiseParallel`.

    Example::
        >>> from torch.distributed.tensor import Partial
        >>> plan = {"layers.*.attn.out_proj": Rowwise(sizes=(1024, 1024, 1024, 1024)),
        ...         "model.layers.*.mlp.fc2": Rowwise(output_layouts=Partial(), use_local_output=False),
        ...         "backbone.layers.*.mixer.x_proj": Rowwise(reduce_grad_features=((8, 24),))}
    """

    def __init__(self, *, sizes: tuple[int, ...] | None = None, reduce_grad_features: tuple[tuple[int, int], ...] = (),
                 weight_in_out: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.sizes = _sizes(sizes)
        self.reduce_grad_features = tuple((int(a), int(b)) for a, b in reduce_grad_features)
        self.weight_in_out = weight_in_out

    @property
    def partial_output(self) -> bool:
        """The output stays this rank's partial sum (``output_layouts=Partial()``)."""
        return tuple(self.output_layouts) == (Partial(),)

    def _partition_linear_fn(self, name, module, device_mesh):
        order = packed_row_order(self.sizes, device_mesh.size()) if self.sizes else None
        if order is not None:
            weight = module.weight
            with torch.no_grad():
                permuted = weight.index_select(1, order.to(weight.device))
            module.register_parameter("weight", nn.Parameter(permuted, requires_grad=weight.requires_grad))
        super()._partition_linear_fn(name, module, device_mesh)
        if order is not None:
            module.weight._autotp_to_layout = partial(permute_rows, dim=1, order=order)

    def _partition_in_out_fn(self, name, module, device_mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if param.ndim == 2 else Replicate()
            dist = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))

    def _prepare_output_fn(self, output_layouts, use_local_output, mod, outputs, device_mesh):
        if tuple(output_layouts) != (Partial(),):
            return RowwiseParallel._prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh)
        local = outputs.to_local(grad_placements=(Replicate(),))
        return local if use_local_output else _PartialFromLocal.apply(local, device_mesh)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.weight_in_out:
            self.desired_input_layouts = (Shard(-1),)
            module = distribute_module(
                module, device_mesh, self._partition_in_out_fn,
                partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
                partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
            )
        else:
            module = super()._apply(module, device_mesh)
        if self.reduce_grad_features:
            spans = self.reduce_grad_features
            module.register_forward_hook(lambda mod, args, out: reduce_feature_grads(out, spans, device_mesh))
        return module

    def sharded_param_dims(self, module: nn.Module) -> dict[str, int] | None:
        if self.weight_in_out:  # the contracted input features are the weight's first dim
            return {n: 0 for n, p in module.named_parameters(recurse=False) if p.ndim == 2}
        return None  # as RowwiseParallel's layouts say

    def __repr__(self) -> str:
        return _with_options(super().__repr__(), sizes=self.sizes, reduce_grad_features=self.reduce_grad_features,
                             weight_in_out=self.weight_in_out)

    def declares(self) -> Shards:
        return torch_shards(self, weight_in_out=self.weight_in_out)


def _with_options(text: str, **options) -> str:
    """``Name(a=1)`` with the options that are set appended: ``Name(a=1, sizes=(4, 4))``."""
    extra = ", ".join(f"{name}={value!r}" for name, value in options.items() if value)
    if not extra:
        return text
    return text[:-1] + ("" if text.endswith("()") else ", ") + extra + ")"



# Sequence-sharded gradients already all-gathered, by the gradient's id while it lives (a weak
# reference tells a reused id apart): two branches of a parallel block get the same one from the
# add that joins them. Not a WeakKeyDictionary: it compares tensor keys with ``==``.
_GATHERED: dict[int, tuple[weakref.ref, torch.Tensor]] = {}


class _PartialFromLocal(torch.autograd.Function):
    """``DTensor.from_local(local, mesh, (Partial(),))`` whose backward gathers a given gradient once."""

    @staticmethod
    def forward(ctx, local, device_mesh):
        return DTensor.from_local(local, device_mesh, (Partial(),), run_check=False)

    @staticmethod
    def backward(ctx, grad):
        if not isinstance(grad, DTensor):
            return grad, None
        if not any(p.is_shard() for p in grad.placements):  # as from_local's backward: kept as is
            return grad.to_local(), None
        key = id(grad)
        held = _GATHERED.get(key)
        if held is not None and held[0]() is grad:
            return held[1], None
        whole = grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim).to_local()
        _GATHERED[key] = (weakref.ref(grad, lambda _, key=key: _GATHERED.pop(key, None)), whole)
        return whole, None


class JoinPartialSums(WrapperStyle):
    """A module whose code adds its branches' ``Partial()`` sums to the ``Shard(1)`` stream
    (a sequence-parallel parallel block): the sum is reduce-scattered there, and in backward the
    gradient is all-gathered once, before it splits into the branches.

    DTensor reduce-scatters ``residual + (attn * a + mixer * b)`` correctly on its own, but its add
    hands the gradient back to the partial operand still ``Shard(1)``: each branch scaled by its own
    constant then holds a different sequence-sharded gradient, and each
    :class:`Rowwise` with ``output_layouts=Partial()`` all-gathers its own (two all-gathers per layer where the forward
    made one reduce-scatter). While this module's forward runs, an add or subtraction of a
    ``Partial()`` DTensor and a sharded one redistributes the partial operand explicitly first, so
    that the redistribution's backward gathers the gradient whole (``Replicate()``) once; the scaled
    branches then take it as it is. A ``Partial()`` DTensor that meets a live dropout (training,
    ``p > 0``) is all-reduced before it: the mask applies to the whole sum.

    Keyword Args:
        style (ParallelStyle, optional): the module's own style, applied first.

    Example::
        >>> plan = {"model.layers.*": JoinPartialSums(),
        ...         "model.layers.*.self_attn.o_proj": Rowwise(output_layouts=Partial(), use_local_output=False),
        ...         "model.layers.*.mamba.out_proj": Rowwise(output_layouts=Partial(), use_local_output=False)}
    """

    def __init__(self, *, style: ParallelStyle | None = None):
        super().__init__()
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = self._apply_wrapped(module, device_mesh)
        mode_during_forward(module, _ScatterPartialsAtJoins)
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({f'style={self.style!r}' if self.style is not None else ''})"


_JOINS = frozenset({"add", "__add__", "__radd__", "__iadd__", "sub", "__sub__", "__rsub__", "__isub__"})


class _ScatterPartialsAtJoins(ReduceBeforeLiveDropout):
    """``partial + sharded`` as ``partial.redistribute(sharded's placements) + sharded``; a partial
    meeting a live dropout all-reduced first."""

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if getattr(func, "__name__", "") in DROPOUTS:
            return super().__torch_function__(func, types, args, kwargs)
        if getattr(func, "__name__", "") in _JOINS and len(args) >= 2:
            a, b = args[0], args[1]
            if _is_partial(a) and _is_sharded(b) and not func.__name__.startswith("__i"):  # not in place
                args = (a.redistribute(placements=b.placements), *args[1:])
            elif _is_partial(b) and _is_sharded(a):
                args = (a, b.redistribute(placements=a.placements), *args[2:])
        return func(*args, **kwargs)


_is_partial = is_partial


def _is_sharded(x) -> bool:
    return isinstance(x, DTensor) and any(p.is_shard() for p in x.placements) and not _is_partial(x)


def copy_rows(tensor: torch.Tensor, *, index: torch.Tensor) -> torch.Tensor:
    """Rows ``index`` of ``tensor`` (dim 0): a layout where some rows are held several times."""
    return tensor.index_select(0, index.to(tensor.device))


def sum_row_copies(grad: torch.Tensor, *, index: torch.Tensor, rows: int, placements) -> torch.Tensor:
    """Give every copy of a row the sum of all copies' gradients (``index``: the original row of each
    row of the parameter's layout; ``rows``: how many original rows). A copy's gradient covers
    only the heads of the ranks that hold it; the original row's gradient is their sum."""
    if isinstance(grad, DTensor) and tuple(grad.placements) == (Shard(0),) == tuple(placements):
        return _sum_copy_shards(grad, index, rows)
    if not isinstance(grad, DTensor):
        full = grad
    else:
        full = grad.redistribute(placements=[Replicate()] * grad.device_mesh.ndim).to_local()
    index = index.to(full.device)
    summed = full.new_zeros(rows, *full.shape[1:]).index_add_(0, index, full).index_select(0, index)
    if not isinstance(grad, DTensor):
        return summed
    whole = DTensor.from_local(summed, grad.device_mesh, [Replicate()] * grad.device_mesh.ndim, run_check=False)
    return whole.redistribute(placements=list(placements))


def _sum_copy_shards(grad: DTensor, index: torch.Tensor, rows: int) -> DTensor:
    """:func:`sum_row_copies` of a ``Shard(0)`` gradient: each rank adds its rows that are copies
    into a buffer with one slot per copied original row (and one slot for the rest), one
    all-reduce sums the copies, and each rank takes its copies' sums back. Only the copied rows
    travel (a few groups' rows), not the whole weight."""
    mesh, local = grad.device_mesh, grad.to_local()
    copied = (torch.bincount(index, minlength=rows) > 1).nonzero().flatten()
    slot = torch.full((rows,), len(copied), dtype=torch.long)
    slot[copied] = torch.arange(len(copied))
    per_rank = slot[index].view(mesh.size(), -1).to(local.device)
    mine = per_rank.index_select(0, mesh_coordinate(mesh).reshape(1).to(local.device)).squeeze(0)
    buffer = local.new_zeros(len(copied) + 1, *local.shape[1:]).index_add_(0, mine, local)
    summed = DTensor.from_local(buffer, mesh, [Partial()], run_check=False).redistribute(
        placements=[Replicate()]).to_local()
    own = (mine == len(copied)).view(-1, *[1] * (local.ndim - 1))
    out = torch.where(own, local, summed.index_select(0, mine))
    return DTensor.from_local(out, mesh, [Shard(0)], run_check=False)


def _part(part) -> tuple:
    """A grouped part ``(start, end, groups[, ((width, divided), ...)])`` with plain ints."""
    start, end, groups, *pieces = part
    return (int(start), int(end), int(groups), *(tuple((int(w), int(d)) for w, d in p) for p in pieces))


class GroupCopies(ParallelStyle):
    """Hold a copy of one group per rank for parts with fewer groups than tp, then apply ``base``.

    A part of a packed output split into ``G`` groups broadcast to the heads (B and C of a
    state-space mixer with ``n_groups < tp``; one kv head in a fused qkv) cannot be cut over tp
    ranks. It is expanded to ``tp`` groups, group j a copy of group ``j * G // tp``: the rows of
    the named parameters and buffers (dim 0) and the integer attributes that size the part are
    set to their expanded values, and ``base`` (the style of the expanded model, e.g.
    :class:`Colwise` or :class:`~autotp.styles.HeadParams`) shards the result, so
    rank r holds exactly the group its heads read. The copies' gradients are summed by a hook
    (:func:`sum_row_copies`), so they stay identical after an optimizer step.

    Keyword Args:
        base (ParallelStyle | None): the style applied after the expansion (None: none).
        rows (dict[str, tuple]): parameter / buffer path -> ``(dim, width, ((start, end, groups), ...))``,
            the grouped parts along its ``dim`` (0 for a parameter; see :func:`autotp.styles.group_copies.copy_index`).
            A part ``(start, end, groups, ((width, divided), ...))`` tiles each group with pieces:
            the ``tp / groups`` ranks sharing a group each hold a share of its divided pieces (its
            query heads) and the others whole (its k and v, a fused qkv viewed groups first).
        values (dict[str, int]): attribute path -> its value in the expanded module (before
            ``base`` divides counts by tp).
        gather (bool): for a Linear under a column ``base`` whose grouped parts hold whole groups:
            shard their rows like the other parts, and each forward all-gather the parts' outputs
            (or their weight rows, when the batch holds more tokens than the input width) for rank
            r to cut its group, the backward reduce-scattering as many bytes, instead of holding
            copies whose gradients are summed. For parameters that a :class:`~autotp.styles.HeadParams`
            base shards packed on dim 0 (a depthwise conv's weight and bias over a mixer's ``[x | B | C]``
            channels): shard their grouped rows like the other parts, and each forward all-gather
            those rows for rank r to cut its group, the backward reduce-scattering their gradient.
            Where tp does not cut a grouped part evenly, the copies are held. Default: False (no
            forward collective: the serving choice).

    Example::
        >>> plan = {"layers.*.mixer.in_proj": GroupCopies(base=Colwise(sizes=(64, 64, 8, 8, 8)),
        ...                                               rows={"weight": (0, 140, ((132, 136, 1), (136, 140, 1)))})}
    """

    def __init__(self, *, base: ParallelStyle | None, rows: dict | None = None, values: dict | None = None,
                 gather: bool = False):
        super().__init__()
        self.base = base
        self.rows = {k: (int(d), int(w), tuple(_part(p) for p in parts)) for k, (d, w, parts) in (rows or {}).items()}
        self.values = dict(values or {})
        self.gather = bool(gather)

    def sharded_param_dims(self, module: nn.Module) -> dict[str, int]:
        return sharded_param_dims(module, self.base) if self.base is not None else {}

    def _gathered(self, tp: int) -> tuple[tuple[int, ...], dict[int, int]] | None:
        """:func:`gathered_sizes` where ``gather`` applies at ``tp`` (it cuts every grouped part
        evenly); None where the rows are copied."""
        found = gathered_sizes(self) if self.gather else None
        if found is None or any(found[0][index] % tp for index in found[1]):
            return None
        return found

    def _gathered_params(self, tp: int) -> dict[str, tuple[tuple[int, ...], dict[int, int]]] | None:
        """:func:`gathered_param_sizes` where ``gather`` applies at ``tp`` (every part of every
        parameter cut evenly); None where the rows are copied."""
        found = gathered_param_sizes(self) if self.gather else None
        if found is None or any(size % tp for sizes, _ in found.values() for size in sizes):
            return None
        return found

    def expanded_sizes(self, tp: int) -> dict[str, int]:
        """The size of each copied parameter's dim 0 once expanded at ``tp`` (its per-rank share
        is that over tp): each grouped part of ``G`` groups becomes ``tp`` groups.

        >>> GroupCopies(base=None, rows={"weight": (0, 20, ((16, 20, 1),))}).expanded_sizes(4)
        {'weight': 32}
        """
        if self._gathered(tp) is not None or self._gathered_params(tp) is not None:  # sharded, not copied
            return {}
        return {path: width + sum(expanded_width(part, tp) - (part[1] - part[0]) for part in parts)
                for path, (_, width, parts) in self.rows.items()}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        if self.gather and gathered_sizes(self) is None and gathered_param_sizes(self) is None:
            raise PlanError(f"{type(module).__name__}: GroupCopies(gather=True) takes a column style "
                            "(ColwiseParallel or Colwise, local output sharded on its last dim) "
                            "over a Linear's whole-group parts, each one part of the packed output, or "
                            "HeadParams sharding the named parameters packed on dim 0; got "
                            f"base={self.base!r}, rows={self.rows}: use gather=False (copies with summed gradients)")
        found = self._gathered(tp)
        if found is not None:
            return _gather_groups(module, device_mesh, *found, self.base)
        found_params = {path: sizes for path, sizes in (self._gathered_params(tp) or {}).items()
                        if _is_parameter(module, path)}
        if found_params:
            return _gather_param_groups(module, device_mesh, found_params, self.base,
                                        Copies({k: v for k, v in self.rows.items() if k not in found_params},
                                               dict(self.values)))
        expand_module(module, Copies(dict(self.rows), dict(self.values)), tp)
        if self.base is not None:
            module = self.base._apply(module, device_mesh)
        for path, (dim, width, parts) in self.rows.items():
            owner_path, _, leaf = path.rpartition(".")
            param = module.get_submodule(owner_path)._parameters.get(leaf)
            if param is None:
                continue  # a buffer: no gradient
            if dim != 0:
                raise PlanError(f"{type(module).__name__}.{path}: GroupCopies sums the copies of a parameter's "
                                f"rows (dim 0), not of its dim {dim}; keep this module whole")
            index = copy_index(width, parts, tp)
            inner = getattr(param, "_autotp_to_layout", None)
            if inner is not None:  # the base's own row order, applied to the expanded rows
                if inner.func is not permute_rows or inner.keywords.get("dim") != 0:
                    raise PlanError(f"{type(module).__name__}.{path}: its style stores rows as {inner!r}, which "
                                    "GroupCopies cannot compose with its copies; keep this module whole")
                index = inner(index)
            param._autotp_to_layout = partial(copy_rows, index=index)
            placements = param.placements if isinstance(param, DTensor) else ()
            param.register_hook(partial(sum_row_copies, index=index, rows=width, placements=placements))
        return module

    def __repr__(self) -> str:
        gather = ", gather=True" if self.gather else ""
        return f"{self.__class__.__name__}(base={self.base!r}, rows={self.rows}, values={self.values}{gather})"

    def declares(self) -> Shards:
        return Shards(copies=self)


def gathered_sizes(style: GroupCopies) -> tuple[tuple[int, ...], dict[int, int]] | None:
    """``(sizes, {part index: groups})`` of a :class:`GroupCopies` around a column style whose
    copied parts can be sharded like the others and gathered instead (``gather=True``): the
    unexpanded widths of the packed parts, and which of them hold whole groups. None when the
    copies are not of that form: a base other than a column style with a local output sharded on
    its last dim, parts with pieces (a fused qkv viewed groups first), parameters other than a
    Linear's weight and bias, or a copied part that is not one part of the packed output.

    >>> from autotp.styles import Colwise
    >>> gathered_sizes(GroupCopies(base=Colwise(sizes=(64, 32, 32)),
    ...                            rows={"weight": (0, 80, ((64, 72, 1), (72, 80, 1)))}))
    ((64, 8, 8), {1: 1, 2: 1})
    """
    base = style.base
    if (not isinstance(base, ColwiseParallel) or not base.use_local_output
            or tuple(base.output_layouts) != (Shard(-1),)
            or not style.rows or set(style.rows) - {"weight", "bias"} or style.values):
        return None
    specs = set(style.rows.values())
    if len(specs) != 1:
        return None
    dim, width, parts = specs.pop()
    expanded = getattr(base, "sizes", None)
    if expanded is None:  # plain columns: the whole output is one grouped part
        whole = dim == 0 and len(parts) == 1 and len(parts[0]) == 3 and parts[0][:2] == (0, width)
        return ((width,), {0: parts[0][2]}) if whole and width % parts[0][2] == 0 else None
    return _unexpanded_sizes(tuple(expanded), dim, width, parts)


def gathered_param_sizes(style: GroupCopies) -> dict[str, tuple[tuple[int, ...], dict[int, int]]] | None:
    """``{parameter path: (sizes, {part index: groups})}`` of a :class:`GroupCopies` around a
    :class:`~autotp.styles.HeadParams` that shards every copied parameter on dim 0, packed like a
    Linear's parts (a depthwise conv's weight and bias over ``[x | B | C]``): each parameter's
    unexpanded part widths, and which of them hold whole groups. None when the copies are not of
    that form (a row-copied tensor not sharded packed on dim 0, parts with pieces, a copied part
    that is not one packed part). Tensors copied along another dim (buffers: only a parameter's
    dim 0 can be copied) are left out, and so is any buffer among the paths when the style is
    applied: they stay copies, expanded to the layout the gathered rows give.

    >>> from autotp.styles import HeadParams
    >>> gathered_param_sizes(GroupCopies(base=HeadParams(shard_dims={"conv.weight": 0}, packed={"conv.weight": (64, 32, 32)}),
    ...                                  rows={"conv.weight": (0, 80, ((64, 72, 1), (72, 80, 1)))}))
    {'conv.weight': ((64, 8, 8), {1: 1, 2: 1})}
    """
    base = style.base
    if not isinstance(base, HeadParams) or not style.rows:
        return None
    found = {}
    for path, (dim, width, parts) in style.rows.items():
        if dim != 0:
            continue
        expanded = base.packed.get(path)
        sizes = _unexpanded_sizes(expanded, dim, width, parts) if base.shard_dims.get(path) == 0 and expanded else None
        if sizes is None:
            return None
        found[path] = sizes
    return found or None


def _unexpanded_sizes(expanded: tuple[int, ...], dim: int, width: int, parts) -> tuple[tuple[int, ...], dict[int, int]] | None:
    """The widths of packed parts before the expansion (``expanded``: after it, each grouped part
    ``tp / G`` times wider, tp unknown here) and ``{part index: groups}`` of the grouped ones; None
    unless every grouped part (rows ``[start, end)`` of dim 0 of a tensor of ``width`` rows, whole
    groups) is exactly one packed part."""
    if dim != 0 or any(len(part) > 3 or (part[1] - part[0]) % part[2] for part in parts):
        return None
    tp_free = {part[0]: part for part in parts}
    sizes, grouped, at = [], {}, 0
    for size in expanded:
        part = tp_free.pop(at, None)
        if part is not None:
            groups = part[2]
            if size % ((part[1] - part[0]) // groups):
                return None
            sizes.append(part[1] - part[0])
            grouped[len(sizes) - 1] = groups
        else:
            if any(at < start < at + size for start in tp_free):
                return None
            sizes.append(size)
        at += sizes[-1]
    return (tuple(sizes), grouped) if not tp_free and at == width else None


def _gather_groups(module: nn.Module, device_mesh: DeviceMesh, sizes: tuple[int, ...], grouped: dict[int, int],
                   base: ColwiseParallel) -> nn.Module:
    """``GroupCopies(gather=True)``: every part of the Linear sharded by :class:`Colwise`
    (the grouped parts too, ``1/tp`` of their rows per rank), then each grouped part of the local
    output all-gathered and rank r's group ``r * G // tp`` cut from it. Rank r sees the output of
    the copies' layout; the gradient of the gathered part, each rank's heads' share, is
    reduce-scattered back onto the shards, so no weight gradient is summed."""
    packed = Colwise(sizes=sizes, input_layouts=base.input_layouts[0], output_layouts=Shard(-1),
                                   use_local_output=True)
    module = packed._apply(module, device_mesh)
    module.register_forward_hook(partial(_cut_groups, sizes=sizes, grouped=grouped, mesh=device_mesh))
    return module


def _is_parameter(module: nn.Module, path: str) -> bool:
    owner_path, _, leaf = path.rpartition(".")
    return module.get_submodule(owner_path)._parameters.get(leaf) is not None


def _gather_param_groups(module: nn.Module, device_mesh: DeviceMesh,
                         found: dict[str, tuple[tuple[int, ...], dict[int, int]]], base, copies) -> nn.Module:
    """``GroupCopies(gather=True)`` over a :class:`~autotp.styles.HeadParams`: the module's attributes
    set to their expanded values and its other copied tensors (``copies``: buffers) expanded, the
    ``found`` parameters sharded packed at their unexpanded widths (``1/tp`` of each grouped part's
    rows per rank), and in each forward, after the base hands them over as local tensors, each
    grouped part's rows all-gathered and rank r's group cut from them. The module's code sees the
    copies' layout; the backward reduce-scatters the gathered rows' gradient (each rank's heads'
    share) onto the shards, so no copies' gradients are summed."""
    expand_module(module, copies, device_mesh.size())
    unexpanded = copy.copy(base)
    unexpanded.packed = {**base.packed, **{path: sizes for path, (sizes, _) in found.items()}}
    module = unexpanded._apply(module, device_mesh)
    owned = [(module.get_submodule(path.rpartition(".")[0]), path.rpartition(".")[2], *found[path])
             for path in sorted(found)]

    def pre_hook(mod, args, kwargs):  # registered after the base's, which swaps in local tensors
        for owner, leaf, sizes, grouped in owned:
            local = owner._parameters[leaf]
            if isinstance(local, DTensor):
                raise PlanError(f"{type(mod).__name__}: GroupCopies(gather=True) expected {leaf!r} as a local "
                                f"tensor during the forward (its base, {base!r}, did not hand it over)")
            owner._parameters[leaf] = _groups_whole(local, sizes, grouped, 0, device_mesh)

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    return module
