"""Attention attributes: rotary tables, head counts divided by tp, and kv heads repeated over ranks
when tp exceeds them."""

from __future__ import annotations

import copy
from collections.abc import Mapping, MutableMapping
import math
import sys
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.overrides import TorchFunctionMode

from autotp._simulate import mesh_coordinate
from autotp.errors import MeshError, PlanError
from autotp.plan import sharded_param_dims
from autotp.styles.base import WrapperStyle, mode_during_forward, to_local
from autotp.styles.declared import Shards, torch_shards
from autotp.styles.group_copies import _cut_groups


class RotaryEmbedParallel(ParallelStyle):
    """Make a rotary-embedding module return plain, full-sequence tensors under sequence parallel.

    The rotary module gets the (sequence-sharded) hidden states only for their dtype and device, and
    the position ids for the values; its output is a tuple ``(cos, sin)``, which the stock
    ``SequenceParallel`` cannot handle. Inputs are turned local (the hidden states are not read, so
    their shard is enough), and every tensor of the output tuple is returned local and whole: the
    attention consumes cos/sin after its input has been all-gathered over the sequence.

    Example::
        >>> plan = {"model.rotary_emb": RotaryEmbedParallel()}
    """

    @staticmethod
    def _prepare_input_fn(mod, inputs, kwargs):
        inputs = tuple(x.to_local() if isinstance(x, DTensor) else x for x in inputs)
        kwargs = {k: (v.to_local() if isinstance(v, DTensor) else v) for k, v in kwargs.items()}
        return inputs, kwargs

    @staticmethod
    def _prepare_output_fn(mod, inputs, outputs):
        if isinstance(outputs, (tuple, list)):
            return type(outputs)(to_local(o) for o in outputs)
        return to_local(outputs)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(self._prepare_input_fn, with_kwargs=True)
        module.register_forward_hook(self._prepare_output_fn)
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}()"


class ShardCounts(ParallelStyle):
    """Divide a module's head counts by the tp size: counts held in integer attributes, or written
    as constants in its code.

    Attention code that slices a fused projection with sizes computed from its head counts
    (``qkv[..., : num_heads * head_dim]``) reads global counts while holding a local shard. After
    this style, the module sees per-rank counts, as gpt-fast's ``tp.py`` does by hand. A dotted name
    (``"config.num_attention_heads"``) changes a private shallow copy of the sub-object, so the
    model's shared config keeps the global numbers; a child module's (``"conv1d.groups"`` of a
    depthwise convolution over sharded channels) is set on the child.

    Code that writes the sizes themselves (``qkv.split(D, -1)``, ``view(b, t, 3, H, D // H)`` with
    module-level ``D, H``) has no attribute to divide: ``literals`` rewrites those calls instead.
    Each rule names a call by what it is given, so only calls on the shard are changed: a view or
    reshape (``"view"``) of a tensor whose ``in_dim`` holds ``in_size / tp`` (of ``in_rank`` dims)
    into ``len(shape)`` dims with ``size`` at place ``at`` gets ``size / tp`` there (and where its
    code inferred another dim from the per-rank width, that dim's global size back); a split
    (``"split"``) or slice (``"slice"``) along ``in_dim`` of such a tensor at the global cut points
    gets the per-rank ones. The rules are applied by a function mode during the module's forward,
    at the calls the code makes (``view``, ``reshape``, ``unflatten``, ``split``, ``narrow``,
    ``x[..., a:b]``).

    When tp exceeds the kv heads (``query_heads`` given), a rank holds ``heads / tp`` query heads
    and one kv head, so its local grouped-query ratio is ``heads / tp``, not the global ``heads /
    kv_heads``: code that repeats kv heads by the stored ratio (``num_key_value_groups`` in
    transformers) must see the local one, and code that sizes its views by the head counts
    (``view(b, t, self.n_kv_heads, hd)``) needs 1 kv head and ``heads / tp`` query heads.

    Keyword Args:
        names (tuple[str, ...]): attribute paths relative to the module. Default: ().
        literals (tuple): rules ``(op, in_rank, in_dim, in_size, at, size, shape)`` for sizes
            written in the code (a view's ``at``: the place in its shape, ``shape``: its global
            shape; a split's ``size``: its global split size; a slice's ``at, size``: its global
            start and end). Default: ().
        query_heads (int | None): the module's query heads, where its kv heads are repeated over
            the ranks (tp larger than the kv heads). Default: None.
        ratio (str | None): with ``query_heads``, the attribute holding the grouped-query ratio, set
            to ``heads / tp``. Default: ``"num_key_value_groups"``.
        kv_names (tuple[str, ...]): with ``query_heads``, attributes holding the kv head count, set to 1.
        head_names (tuple[str, ...]): with ``query_heads``, attributes holding the query head count,
            set to ``heads / tp``.
        base (ParallelStyle | None): the module's own style, applied after the division (a
            :class:`~autotp.styles.Boundary` (``inputs="gather"``) of a block gathered whole under sequence
            parallel, a :class:`~autotp.styles.HeadParams` sharding a per-head parameter). Default: None.

    Example::
        >>> plan = {"model.layers.*.self_attn": ShardCounts(names=("num_key_value_heads",)),
        ...         "model.layers.*.mixer": ShardCounts(query_heads=32)}  # tp 8 over 4 kv heads
    """

    def __init__(self, *, names: tuple[str, ...] = (), literals: tuple = (), query_heads: int | None = None,
                 ratio: str | None = "num_key_value_groups", kv_names: tuple[str, ...] = (),
                 head_names: tuple[str, ...] = (), base: ParallelStyle | None = None):
        super().__init__()
        self.names = tuple(names)
        self.literals = tuple(tuple(rule) for rule in literals)
        self.query_heads, self.ratio = query_heads, ratio
        self.kv_names, self.head_names = tuple(kv_names), tuple(head_names)
        self.base = base

    def localize(self, module: nn.Module, tp: int) -> None:
        """Rewrite the sizes ``literals`` names in ``module``'s code for ``tp`` ranks (the shape
        proof runs this on its per-rank copies; applying the style runs it on the module)."""
        if self.literals:
            mode_during_forward(module, partial(_LiteralSizes, self.literals, tp))

    def around(self, style: ParallelStyle | None) -> ShardCounts:
        """This rewrite around ``style``, the module's own (``None``: standing alone)."""
        return ShardCounts(names=self.names, literals=self.literals, query_heads=self.query_heads, ratio=self.ratio,
                           kv_names=self.kv_names, head_names=self.head_names, base=style)

    @property
    def wrapped(self) -> ParallelStyle:
        """The base style, for code that reads what a chain of styles declares (absent: none)."""
        if self.base is None:
            raise AttributeError("wrapped")
        return self.base

    def sharded_param_dims(self, module: nn.Module) -> dict[str, int]:
        return sharded_param_dims(module, self.base) if self.base is not None else {}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        if self.query_heads is not None:  # kv heads repeated over the ranks: the counts of one rank's heads
            for name in ((self.ratio,) if self.ratio else ()) + self.head_names:
                setattr(module, name, self.query_heads // tp)
            for name in self.kv_names:
                setattr(module, name, 1)
        copied: set[str] = set()
        for name in self.names:
            owner, attr = count_holder(module, name, copied)
            value = _read(owner, attr)
            if value % tp:
                raise MeshError(f"{type(module).__name__}.{name}={value} cannot be split over tp={tp}")
            _write(owner, attr, value // tp)
        sync_einops_lengths(module)
        self.localize(module, tp)
        return self.base._apply(module, device_mesh) if self.base is not None else module

    def __repr__(self) -> str:
        options = [f"names={self.names}"] if self.names or self.query_heads is None else []
        options += [f"literals={self.literals}"] if self.literals else []
        if self.query_heads is not None:
            options += [f"query_heads={self.query_heads}", f"ratio={self.ratio!r}"]
            options += [f"{k}={v!r}" for k, v in (("kv_names", self.kv_names), ("head_names", self.head_names)) if v]
        options += [f"base={self.base!r}"] if self.base is not None else []
        return f"{self.__class__.__name__}({', '.join(options)})"

    def declares(self) -> Shards:
        return Shards(counts=self.names or None, rewrites=(self,) if self.literals else None,
                      kv_counts=self.query_heads is not None)


class _LiteralSizes(TorchFunctionMode):
    """The calls :class:`ShardCounts`'s ``literals`` name, given their per-rank sizes: caught where
    the code makes them, before torch checks a shape against the per-rank input or clamps a slice
    (``x[..., :D]`` on a narrower tensor is the whole of it, with no slice op to catch later)."""

    def __init__(self, rules: tuple, tp: int):
        super().__init__()
        self.rules, self.tp = rules, tp

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        x = args[0] if args else None
        if isinstance(x, torch.Tensor) and len(args) > 1:
            if func in _VIEWS:
                shape = args[1:] if isinstance(args[1], int) else args[1]
                if all(isinstance(size, int) for size in shape):
                    args = (x, self._view(x, list(shape)))
            elif func in _UNFLATTENS and len(args) > 2:
                dim, sizes = args[1] % x.dim(), list(args[2])
                whole = self._view(x, [*x.shape[:dim], *sizes, *x.shape[dim + 1:]])
                args = (x, args[1], whole[dim:dim + len(sizes)], *args[3:])
            elif func in _SPLITS:
                dim = args[2] if len(args) > 2 else kwargs.pop("dim", 0)
                args = (x, self._split(x, args[1], dim), dim)
            elif func is torch.Tensor.__getitem__:
                args = (x, self._index(x, args[1]))
            elif func in _NARROWS and len(args) > 3:
                start, end = self._cut(x, args[1], args[2], args[2] + args[3])
                args = (x, args[1], start, end - start)
        return func(*args, **kwargs)

    def _on_shard(self, x: torch.Tensor, rule: tuple, dim: int | None = None) -> bool:
        _, in_rank, in_dim, in_size, *_ = rule
        return x.dim() == in_rank and (dim is None or dim % in_rank == in_dim) and x.shape[in_dim] * self.tp == in_size

    def _view(self, x: torch.Tensor, shape: list) -> list:
        for rule in self.rules:
            op, _, _, _, at, size, whole = rule
            if op == "view" and len(shape) == len(whole) and shape[at] == size and self._on_shard(x, rule):
                shape[at] = size // self.tp
                if -1 not in shape and math.prod(shape) != x.numel():  # a dim its code inferred per rank
                    for dim, extent in enumerate(shape):
                        if dim != at and extent * self.tp == whole[dim]:
                            shape[dim] = whole[dim]
                            break
                break
        return shape

    def _split(self, x: torch.Tensor, sizes, dim: int):
        for rule in self.rules:
            if rule[0] == "split" and self._on_shard(x, rule, dim):
                if isinstance(sizes, int):
                    return sizes // self.tp if sizes == rule[5] else sizes
                if sum(sizes) == rule[3]:  # the global parts of the whole dim
                    return [size // self.tp for size in sizes]
        return sizes

    def _cut(self, x: torch.Tensor, dim: int, start: int, end: int) -> tuple[int, int]:
        """A slice ``[start, end)`` along ``dim``, at its per-rank place if a rule names it by both
        ends (so a slice already per rank is not cut again)."""
        for rule in self.rules:
            if rule[0] == "slice" and (start, end) == rule[4:6] and self._on_shard(x, rule, dim):
                return start // self.tp, end if end > rule[3] else end // self.tp
        return start, end

    def _index(self, x: torch.Tensor, index):
        items = list(index) if isinstance(index, tuple) else [index]
        if not all(item is None or item is Ellipsis or isinstance(item, (int, slice)) for item in items):
            return index  # tensor or boolean indexing: not a cut
        consumed = sum(item is not None and item is not Ellipsis for item in items)
        dim = 0
        for i, item in enumerate(items):
            if item is Ellipsis:
                dim += x.dim() - consumed
            elif isinstance(item, slice):
                if item.step in (None, 1):
                    start, end = self._cut(x, dim, item.start or 0, sys.maxsize if item.stop is None else item.stop)
                    items[i] = slice(start, None if end == sys.maxsize else end, item.step)
                dim += 1
            elif item is not None:
                dim += 1
        return tuple(items) if isinstance(index, tuple) else items[0]


_VIEWS = frozenset({torch.Tensor.view, torch.Tensor.reshape, torch.reshape})
_UNFLATTENS = frozenset({torch.Tensor.unflatten, torch.unflatten})
_SPLITS = frozenset({torch.Tensor.split, torch.split, torch.Tensor.split_with_sizes})
_NARROWS = frozenset({torch.Tensor.narrow, torch.narrow})


def count_holder(module: nn.Module, name: str, copied: set[str] | None = None) -> tuple[object, str]:
    """The object holding the count named by dotted path ``name`` below ``module``, and its key.

    A path steps through attributes, and through the keys of a mapping: an einops layer keeps its
    lengths in a dict (``Rearrange("b t (h d) -> b h t d", h=8)`` holds ``axes_lengths["h"]``,
    named ``"axes_lengths.h"``). With ``copied`` (a set of the paths already copied), a plain
    object or mapping on the way (a config, possibly shared with other modules) is replaced by a
    shallow copy first, so that the change stays with this module; a child module is its own.

    >>> holder, key = count_holder(nn.Sequential(nn.Identity()), "0.training")
    >>> type(holder).__name__, key
    ('Identity', 'training')
    """
    *path, attr = name.split(".")
    owner = module
    for i, part in enumerate(path):
        child, child_path = _read(owner, part), ".".join(path[: i + 1])
        if copied is not None and child_path not in copied and not isinstance(child, nn.Module):
            child = copy.copy(child)
            _write(owner, part, child)
            copied.add(child_path)
        owner = child
    return owner, attr


def _read(owner, key: str):
    return owner[key] if isinstance(owner, Mapping) else getattr(owner, key)


def _write(owner, key: str, value) -> None:
    if isinstance(owner, MutableMapping):
        owner[key] = value
    else:
        setattr(owner, key, value)


def sync_einops_lengths(module: nn.Module) -> None:
    """Make the einops layers under ``module`` run with the lengths in their ``axes_lengths``.

    An einops layer (``einops.layers.torch.Rearrange`` / ``Reduce``) copies ``axes_lengths`` into
    the tuple ``_axes_lengths`` when built, and its forward reads only the tuple: a head count
    divided in the dict must be copied there too.
    """
    for layer in module.modules():
        lengths = getattr(layer, "axes_lengths", None)
        if type(layer).__module__.startswith("einops.") and isinstance(lengths, Mapping) \
                and isinstance(getattr(layer, "_axes_lengths", None), tuple):
            layer._axes_lengths = tuple(lengths.items())


class LocalWidthInputs(WrapperStyle):
    """A module whose code reads its widths from an input's size sees that input at its per-rank width.

    nanoGPT-style attention computes its sizes from its input, ``B, T, C = x.size()``, then
    ``view(B, T, self.n_head, C // self.n_head)`` and merges back with ``view(B, T, C)``. With the
    heads sharded, the rank holds ``C / tp`` features of each part, and no attribute can make
    ``C // n_head`` the head size: ``C`` is read from the replicated input. Here each listed argument
    is handed to the module's code as a size-only stand-in of width ``C / tp`` (a NaN scalar expanded
    to the per-rank shape: no memory, and any arithmetic on it shows as NaN rather than a plausible
    number), and the listed ``readers`` (the column Linears that read the argument directly, the
    only readers the synthesizer allows) get the real argument back when they are called with the
    stand-in. ``style`` (the module's :class:`ShardCounts`, dividing ``n_head``) is applied first.

    Keyword Args:
        inputs (tuple): positions or keywords of the arguments read for their width.
        readers (tuple[str, ...]): submodules (relative names) that read those arguments' values.
        style (ParallelStyle, optional): the module's own style. Default: None.

    Example::
        >>> plan = {"h.*.attn": LocalWidthInputs(inputs=(0,), readers=("c_attn",),
        ...                                       style=ShardCounts(names=("n_head", "n_embd")))}
    """

    def __init__(self, *, inputs: tuple, readers: tuple[str, ...], style: ParallelStyle | None = None):
        super().__init__()
        self.inputs, self.readers, self.style = tuple(inputs), tuple(readers), style
        if not self.inputs or not self.readers:
            raise PlanError(f"LocalWidthInputs: needs at least one input and one reader, got inputs={inputs!r}, "
                            f"readers={readers!r}")

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = self._apply_wrapped(module, device_mesh)
        width_view(module, self.inputs, self.readers, device_mesh.size(), guard=True)
        return module

    def __repr__(self) -> str:
        extra = f", style={self.style!r}" if self.style is not None else ""
        return f"{self.__class__.__name__}(inputs={self.inputs!r}, readers={self.readers!r}{extra})"

    def declares(self) -> Shards:
        return Shards(width_view=(self.inputs, self.readers))


def width_view(module: nn.Module, inputs: tuple, readers: tuple[str, ...], tp: int, *, guard: bool = False) -> None:
    """Hooks that give ``module``'s code the arguments ``inputs`` at width ``/ tp`` and its ``readers``
    the real ones (:class:`LocalWidthInputs`; the per-rank shape proof runs the same hooks).

    ``guard``: the stand-in holds NaN (a float argument), so a read the analysis did not foresee
    shows in the output; without it (meta runs) an empty scalar.
    """
    calls: list[dict[int, torch.Tensor]] = []  # per active call: id(stand-in) -> real argument

    def enter(mod, args, kwargs):
        args, swapped = list(args), {}
        for key in inputs:
            holder, present = (args, key < len(args)) if isinstance(key, int) else (kwargs, key in kwargs)
            value = holder[key] if present else None
            if not isinstance(value, torch.Tensor):
                continue
            width = value.shape[-1]
            if width % tp:
                raise PlanError(f"{type(mod).__name__}: argument {key!r} has width {width}, which tp={tp} does not "
                                "divide; its code reads the per-rank width from it")
            base = to_local(value)
            fill = float("nan") if guard and base.is_floating_point() else 0
            stand_in = base.new_full((), fill).expand(*value.shape[:-1], width // tp)
            swapped[id(stand_in)] = (stand_in, value)
            holder[key] = stand_in
        calls.append(swapped)
        return tuple(args), kwargs

    def leave(mod, args, output):
        if calls:
            calls.pop()

    def read(mod, args, kwargs):
        swapped = calls[-1] if calls else {}
        real = lambda v: swapped[id(v)][1] if id(v) in swapped and swapped[id(v)][0] is v else v  # noqa: E731
        return tuple(real(a) for a in args), {k: real(v) for k, v in kwargs.items()}

    def first_enter(mod, args, kwargs):
        # The readers' hooks go first among theirs, ahead of any other style's (a wrapper the module
        # above shares among the same Linears would otherwise take the stand-in): registered at the
        # first call, once every style of the plan is in place.
        if not installed:
            for name in readers:
                module.get_submodule(name).register_forward_pre_hook(read, with_kwargs=True, prepend=True)
            installed.append(True)
        return enter(mod, args, kwargs)

    installed: list[bool] = []
    module.register_forward_pre_hook(first_enter, with_kwargs=True)
    module.register_forward_hook(leave, always_call=True)


def expand_kv_rows(tensor: torch.Tensor, kv_heads: int, head_dim: int, tp_size: int) -> torch.Tensor:
    """Repeat each kv head's rows ``tp / kv_heads`` times: row block r is the head rank r reads.

    >>> expand_kv_rows(torch.arange(4.0), kv_heads=2, head_dim=2, tp_size=4).tolist()
    [0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 2.0, 3.0]
    """
    copies = tp_size // kv_heads
    rows = tensor.reshape(kv_heads, head_dim, *tensor.shape[1:])
    return rows.repeat_interleave(copies, dim=0).reshape(tp_size * head_dim, *tensor.shape[1:])


class ReplicatedKVColwise(ColwiseParallel):
    """Column-parallel k/v projection when tp exceeds the number of kv heads.

    With ``kv_heads < tp``, a contiguous split would cut a kv head in pieces. Instead each kv head
    is repeated ``tp / kv_heads`` times (the ranks whose query heads read it), and that expanded
    weight is sharded ``Shard(0)``: rank r holds exactly the ``head_dim`` rows of kv head
    ``r // (tp / kv_heads)``, computes only that head, and the attention's grouped-query repeat is
    local. Each copy's gradient covers only its rank's query heads; a gradient hook sums the copies
    of a head (an all-gather of the small k/v gradient) so every copy gets the full gradient and the
    copies stay identical after an optimizer step.

    With ``gather=True`` the rows are not copied: the projection is sharded ``Shard(0)`` as
    ``ColwiseParallel`` would (``1/tp`` of its rows per rank, a piece of a head), and each forward
    all-gathers the output, or the weight rows when the batch holds more tokens than the input
    width, and rank r cuts its head ``r * kv_heads // tp`` from it; the backward reduce-scatters the
    gradient of what was gathered (each rank's query heads' share), so it moves the forward's bytes
    and no weight gradient is summed (see :class:`~autotp.styles.GroupCopies`).

    Keyword Args:
        kv_heads (int): number of kv heads of the projection.
        head_dim (int): size of one head.
        gather (bool): shard the rows and gather per forward instead of copying them, where tp cuts
            the kv rows evenly. Default: False (no forward collective: the serving choice).

    Example::
        >>> plan = {"model.layers.*.self_attn.k_proj": ReplicatedKVColwise(kv_heads=2, head_dim=128)}
    """

    def __init__(self, *, kv_heads: int, head_dim: int, gather: bool = False, **kwargs):
        super().__init__(**kwargs)
        self.kv_heads = kv_heads
        self.head_dim = head_dim
        self.gather = bool(gather)

    def _gathers(self, device_mesh: DeviceMesh) -> bool:
        """``gather``, where tp cuts the kv rows evenly (else each rank holds a copy of its head)."""
        return self.gather and self.kv_heads * self.head_dim % device_mesh.size() == 0

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = super()._apply(module, device_mesh)
        if self._gathers(device_mesh):
            width = self.kv_heads * self.head_dim
            module.register_forward_hook(partial(_cut_groups, sizes=(width,), grouped={0: self.kv_heads},
                                                 mesh=device_mesh))
        return module

    def _partition_linear_fn(self, name, module, device_mesh):
        tp = device_mesh.size()
        if tp % self.kv_heads:
            raise MeshError(
                f"{type(module).__name__}: tp={tp} is not a multiple of kv_heads={self.kv_heads}; "
                "each kv head must be shared by the same number of ranks."
            )
        if self._gathers(device_mesh):
            return super()._partition_linear_fn(name, module, device_mesh)
        for pname, param in list(module.named_parameters(recurse=False)):
            with torch.no_grad():
                expanded = expand_kv_rows(param, self.kv_heads, self.head_dim, tp)
            new = nn.Parameter(distribute_tensor(expanded, device_mesh, [Shard(0)]), requires_grad=param.requires_grad)
            new._autotp_to_layout = partial(expand_kv_rows, kv_heads=self.kv_heads, head_dim=self.head_dim, tp_size=tp)
            new.register_hook(partial(sum_kv_copies, kv_heads=self.kv_heads, head_dim=self.head_dim))
            module.register_parameter(pname, new)

    def __repr__(self) -> str:
        gather = ", gather=True" if self.gather else ""
        return super().__repr__()[:-1] + f", kv_heads={self.kv_heads}, head_dim={self.head_dim}{gather})"

    def declares(self) -> Shards:
        """A k / v column whose ranks each hold one whole kv head."""
        return torch_shards(self, kv_repeat=(self.kv_heads, self.head_dim))


def sum_kv_copies(grad: DTensor, *, kv_heads: int, head_dim: int) -> DTensor:
    """Give every copy of a kv head the sum of all copies' gradients.

    The result is placed like the parameter (``Shard(0)``), not like ``grad``: depending on the
    sharding strategy DTensor picks for the projection's backward, ``grad`` may arrive ``Partial``,
    and a replicated tensor cannot be redistributed back to a pending sum.
    """
    tp = grad.device_mesh.size()
    if grad.placements == (Shard(0),):
        return _sum_kv_shards(grad, kv_heads, head_dim)
    full = grad.redistribute(placements=[Replicate()]).to_local()
    per_head = full.reshape(kv_heads, tp // kv_heads, head_dim, *full.shape[1:]).sum(dim=1)
    summed = expand_kv_rows(per_head.reshape(kv_heads * head_dim, *full.shape[1:]), kv_heads, head_dim, tp)
    return DTensor.from_local(summed, grad.device_mesh, [Replicate()], run_check=False).redistribute(
        placements=[Shard(0)]
    )


def _sum_kv_shards(grad: DTensor, kv_heads: int, head_dim: int) -> DTensor:
    """:func:`sum_kv_copies` of a ``Shard(0)`` gradient: each rank puts its rows in its head's slot of
    a ``(kv_heads * head_dim, ...)`` buffer, one all-reduce sums each head's copies, and each rank
    keeps its head's slot. Ring bytes ``2 (tp - 1) / tp * kv_heads`` head-widths, where all-gathering
    the expanded gradient costs ``tp - 1`` (never less, as ``tp >= 2 kv_heads``)."""
    mesh, local = grad.device_mesh, grad.to_local()
    head = (mesh_coordinate(mesh) // (mesh.size() // kv_heads)).reshape(1).to(local.device)
    slots = local.new_zeros(kv_heads, *local.shape).index_copy(0, head, local.unsqueeze(0))
    partial_sum = DTensor.from_local(slots, mesh, [Partial()], run_check=False)
    summed = partial_sum.redistribute(placements=[Replicate()]).to_local()
    return DTensor.from_local(summed.index_select(0, head).squeeze(0), mesh, [Shard(0)], run_check=False)
