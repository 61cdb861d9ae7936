"""Layouts at the edges of the sharded regions: :class:`Boundary`, one style for every conversion of a
module's inputs and outputs (one gather or one ``Replicate()`` DTensor shared by several column
projections, whole modules inside a DTensor stream, reductions, slices and copies of outputs), and
the styles that act at a region's edge in ways no conversion names (partial sums added up inside a
block, per-head values cut at entry).
"""

from __future__ import annotations

import inspect
import weakref
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard
from torch.distributed.tensor.parallel import SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.utils._pytree import tree_leaves

from autotp.errors import PlanError
from autotp.styles.declared import Shards
from autotp.styles.embedding import VocabParallelEmbedding  # noqa: F401 (doctest)
from autotp.styles.norms import ReplicatedWithGradAllReduce
from autotp.styles.base import (ReduceBeforeLiveDropout, WrapperStyle, all_reduce_backward, all_reduce_forward,
                                scale_grad, mode_during_forward, reduce_feature_grads, to_local)


# The wrapper each value a ``Boundary(inputs="reduce_grad")`` module took was handed on as, keyed by the autograd
# output the value copies: ``(id(node), output index)`` after stepping back through ``clone()``s, so a
# value and its clones share one wrapper. An entry lives as long as the value that made it (which
# keeps the node alive, so its id is not reused meanwhile).
_REDUCED: dict[tuple[int, int], tuple[DeviceMesh, torch.Tensor, int]] = {}


def _copied_output(value: torch.Tensor) -> tuple[torch.autograd.graph.Node, int]:
    """The autograd output whose value ``value`` holds: its own, or, for a ``clone()``, the cloned
    value's (a clone is the identity in forward and in backward)."""
    node, index = value.grad_fn, value.output_nr
    while node is not None and node.name() == "CloneBackward0":
        node, index = node.next_functions[0]
    return node, index


def reduced_once(value: torch.Tensor, device_mesh: DeviceMesh) -> torch.Tensor:
    """``value`` with its gradient all-reduced, the same wrapper for every call that takes this
    tensor or a clone of it (so their partial gradients are summed first). A leaf (a checkpoint's
    recomputed input, a user's tensor kept across steps) gets a wrapper of its own per call, and so
    does a value whose wrapper was written in place since (its values may differ now)."""
    node, index = _copied_output(value)
    if node is None:
        return all_reduce_backward(value, device_mesh)
    key = (id(node), index)
    hit = _REDUCED.get(key)
    if hit is not None and hit[0] is device_mesh and hit[1]._version == hit[2]:
        return hit[1]
    wrapped = all_reduce_backward(value, device_mesh)
    _REDUCED[key] = (device_mesh, wrapped, wrapped._version)
    weakref.finalize(value, _REDUCED.pop, key, None)
    return wrapped


class PartialSumBlock(ParallelStyle):
    """A module that adds up row Linears' partial sums and returns them: reduced once, at its output.

    A MoE written as a loop over ``nn.Linear`` experts scales each expert's output by its routing
    weight and adds it into one result (``out.index_add_(0, idx, w[idx, k, None] * expert(x[idx]))``).
    With the experts' down projections leaving their per-rank partial sums
    (:class:`~autotp.styles.Rowwise` with ``output_layouts=Partial()``) that result is a partial sum
    too, reduced here once: an all-reduce, or under sequence parallel a reduce-scatter onto the
    ``Shard(1)`` stream, where each expert would reduce its own tokens (``top_k`` times the bytes).

    The backward mirrors it. Every gradient inside the module is then a per-rank partial sum (the
    routing weights' from the partial expert outputs, whatever the router computes from them, the
    column Linears' input gradients, left unreduced here for the ``columns`` listed): the module's
    floating inputs have their gradient reduced once at entry (a sequence-sharded input is gathered
    whole and its gradient reduce-scattered), and the parameters of modules kept whole inside it
    are :class:`~autotp.styles.ReplicatedWithGradAllReduce`.

    Keyword Args:
        columns (tuple[str, ...]): column-parallel Linears inside the module (relative names).
        sequence_parallel (bool): the stream is sequence-sharded (``Shard(1)``). Default: False.

    Example::
        >>> from torch.distributed.tensor import Partial
        >>> from autotp.styles import Rowwise
        >>> plan = {"layers.*.moe": PartialSumBlock(columns=("experts.0.w1", "experts.0.w3")),
        ...         "layers.*.moe.experts.0.w2": Rowwise(output_layouts=Partial())}
    """

    def __init__(self, *, columns: tuple[str, ...] = (), sequence_parallel: bool = False):
        super().__init__()
        self.columns, self.sequence_parallel = tuple(columns), sequence_parallel

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        shared = share_column_inputs(module, self.columns, device_mesh, partial_grad=True)

        def take(value):
            if isinstance(value, DTensor):
                if value.placements != (Replicate(),):
                    value = value.redistribute(placements=[Replicate()])
                return value.to_local(grad_placements=[Partial()])
            if isinstance(value, torch.Tensor) and value.is_floating_point():
                return all_reduce_backward(value, device_mesh)
            return value

        def enter(mod, args, kwargs):
            shared.clear()
            return tuple(take(a) for a in args), {k: take(v) for k, v in kwargs.items()}

        def reduce(out):
            partial_sum = DTensor.from_local(out, device_mesh, [Partial()], run_check=False)
            if self.sequence_parallel:
                return partial_sum.redistribute(placements=[Shard(1)])
            return partial_sum.redistribute(placements=[Replicate()]).to_local()

        def leave(mod, args, out):
            shared.clear()
            if isinstance(out, torch.Tensor) and not isinstance(out, DTensor):
                return reduce(out)
            # ``(hidden, router_logits)``: the partial sum first; the rest every rank computed whole
            # (from the whole input), each rank handing back a share of their gradient.
            first = out[0] if isinstance(out, (tuple, list)) and out else None
            if not isinstance(first, torch.Tensor) or isinstance(first, DTensor) or any(
                    isinstance(v, DTensor) for v in out[1:]):
                raise PlanError(f"{type(mod).__name__}: PartialSumBlock expects its per-rank partial sum as the "
                                f"output (a plain tensor, or the first of a tuple), and got {type(out).__name__}")
            items = [reduce(first), *(scale_grad(v, 1.0 / device_mesh.size()) for v in out[1:])]
            return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)  # a namedtuple too

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave)
        return module

    def __repr__(self) -> str:
        flag = ", sequence_parallel=True" if self.sequence_parallel else ""
        return f"{self.__class__.__name__}(columns={self.columns!r}{flag})"


def share_column_inputs(module: nn.Module, columns: tuple[str, ...], device_mesh: DeviceMesh, *,
                        partial_grad: bool) -> dict:
    """Pre-hooks on ``module``'s ``columns``: the first to read a plain tensor wraps it as a
    ``Replicate()`` DTensor (its backward all-reduces, or with ``partial_grad`` hands back this rank's
    partial sum), and the others reading the same tensor get that DTensor. Returns the dict of
    wrapped tensors, which the caller clears at each call of ``module``."""
    shared: dict[int, tuple[torch.Tensor, DTensor]] = {}  # id -> (tensor, its DTensor), one call's

    def wrap(mod, args):
        value = args[0] if args else None
        if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
            return None
        hit = shared.get(id(value))
        if hit is None or hit[0] is not value:
            dtensor = (_ReplicatedWithPartialGrad.apply(value, device_mesh) if partial_grad else
                       DTensor.from_local(value, device_mesh, (Replicate(),), run_check=False))
            hit = shared[id(value)] = (value, dtensor)
        return (hit[1], *args[1:])

    for name in columns:
        module.get_submodule(name).register_forward_pre_hook(wrap, prepend=True)
    return shared


class _ReplicatedWithPartialGrad(torch.autograd.Function):
    """``DTensor.from_local(local, mesh, (Replicate(),))`` whose backward returns this rank's partial
    sum of the gradient, unreduced (a whole gradient is split into equal shares)."""

    @staticmethod
    def forward(ctx, local, device_mesh):
        return DTensor.from_local(local, device_mesh, (Replicate(),), run_check=False)

    @staticmethod
    def backward(ctx, grad):
        if isinstance(grad, DTensor):
            grad = grad.redistribute(placements=[Partial()] * grad.device_mesh.ndim).to_local()
        return grad, None


def _owned(out):
    if isinstance(out, torch.Tensor) and not isinstance(out, DTensor):
        return out.clone()
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) and not isinstance(out[0], DTensor):
        return (out[0].clone(), *out[1:])
    return out


class ShardedInputs(WrapperStyle):
    """A module takes some of its call's arguments as this rank's slice along one dim (its heads).

    A per-head bias made once outside the sharded region (ALiBi's slopes times the distances,
    ``(heads, t, t)``, built at the model's root and handed to every layer's attention) holds every
    head; the module's heads are sharded, so it needs the rows of its own heads only. Each listed
    argument (by position, or by keyword) is replicated on every rank and is cut here to the
    rank's contiguous block on ``dim``: as a ``Replicate()`` DTensor redistributed to
    ``Shard(dim)``, so a bias with a gradient of its own gets it whole again (an all-gather in
    backward); a constant one costs nothing. Then ``style``, if given, is applied as usual.

    Where the heads are merged with the batch into ``dim`` (``(b * heads, 1, t)`` for a batched
    matmul's rows), the argument is given as ``(key, dim, heads, inner)``: ``dim`` is viewed as
    ``(-1, heads, inner)``, cut on the heads, and merged back.

    An argument that is missing from a call, or whose size on ``dim`` tp does not divide, raises:
    the module would otherwise broadcast the whole bias against its own heads.

    Keyword Args:
        inputs (tuple[tuple, ...]): ``(position or keyword, dim)`` or ``(position or keyword, dim,
            heads, inner)`` per argument.
        style (ParallelStyle, optional): the module's own style. Default: None.

    Example::
        >>> plan = {"layers.*.attn": ShardedInputs(inputs=((1, 0),))}  # attn(x, bias): bias (heads, t, t)
    """

    def __init__(self, *, inputs: tuple, style: ParallelStyle | None = None):
        super().__init__()
        self.inputs = tuple((key, *(int(d) for d in rest)) for key, *rest in inputs)
        if any(len(entry) not in (2, 4) for entry in self.inputs):
            raise PlanError(f"ShardedInputs: each input is (key, dim) or (key, dim, heads, inner), got {inputs!r}")
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = self._apply_wrapped(module, device_mesh)
        inputs = self.inputs

        def pre_hook(mod, args, kwargs):
            args = list(args)
            for key, dim, *fold in inputs:
                holder, present = (args, key < len(args)) if isinstance(key, int) else (kwargs, key in kwargs)
                value = holder[key] if present else None
                if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
                    raise PlanError(f"{type(mod).__name__}: ShardedInputs expects a plain tensor as argument {key!r} "
                                    f"of each call, to cut it to this rank's heads on dim {dim}, and got "
                                    f"{type(value).__name__}; synthesize the plan on inputs that call it the same way")
                heads = fold[0] if fold else value.shape[dim]
                if heads % device_mesh.size() or (fold and value.shape[dim] % (fold[0] * fold[1])):
                    raise PlanError(f"{type(mod).__name__}: argument {key!r} has {value.shape[dim]} entries on dim {dim}, "
                                    f"not {'rows of ' + str(fold[0]) + ' heads' if fold else 'heads'} that "
                                    f"tp={device_mesh.size()} divides")
                cut = value.unflatten(dim, (-1, *fold)) if fold else value
                whole = DTensor.from_local(cut, device_mesh, [Replicate()], run_check=False)
                cut = whole.redistribute(placements=[Shard(dim + 1 if fold else dim)]).to_local()
                holder[key] = cut.flatten(dim, dim + 2) if fold else cut
            return tuple(args), kwargs

        module.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=True)
        return module

    def __repr__(self) -> str:
        extra = f", style={self.style!r}" if self.style is not None else ""
        return f"{self.__class__.__name__}(inputs={self.inputs!r}{extra})"

    def declares(self) -> Shards:
        return Shards(slices_entries=True)


_INPUTS = (None, "replicate", "gather", "slice", "whole", "reduce_grad")
_OUTPUTS = (None, "replicate", "local", "sum", "shard", "shard_all", "sum_shard", "gather", "slice")
_GRADS = ("whole", "partial")


class Boundary(WrapperStyle):
    """Convert a module's inputs and outputs between plain tensors and DTensors at the edge of a
    sharded region, choosing how gradients cross the edge each way.

    Every place a plan changes layout between regions is one of a few conversions; each side is
    chosen by name:

    ``inputs`` (the module's floating arguments, positional or keyword, at entry):

    - ``"replicate"``: plain ones become ``Replicate()`` DTensors (free: every rank holds the
      value), so the column Linears inside that read them return ``Partial()`` input gradients
      which autograd sums as DTensors before one all-reduce. With ``input_grad="partial"`` that
      sum is handed back unreduced, as this rank's partial sum, for a value reduced once further
      back (where it was gathered). With ``stream`` only that argument (a position or a keyword:
      the residual stream of a parallel block) is taken so and must be present, the output is
      made plain with ``outputs="local"``, and a branch's ``Partial()`` sum that meets a live
      dropout inside is all-reduced before it (:class:`~autotp.styles.base.ReduceBeforeLiveDropout`):
      rows returning ``Partial()`` DTensors add up before one reduction. With ``columns`` the
      conversion happens at those column children's entry instead (q, k, v reading the stream as
      their module gets it, with no norm before them): the first to read a plain tensor during one
      call wraps it, and the others reading the same tensor share that DTensor, so their gradients
      are summed before one reduction; a column reading another tensor gets its own.
    - ``"gather"``: ``Shard(sequence_dim)`` DTensors are all-gathered once (one tensor passed several
      times, ``attn(h, h, h)``, once), handed on plain, or as ``Replicate()`` DTensors with
      ``local_inputs=False`` (every reader a column Linear: the gather's backward then
      reduce-scatters their summed gradients once).
    - ``"slice"``: the stream input (the first positional tensor, else ``forward``'s first
      parameter by keyword), if it arrives plain, becomes this rank's ``Shard(sequence_dim)`` slice
      (a stream combined with plain tensors at the root starts sharding at its first block); a
      DTensor passes.
    - ``"whole"``: DTensors are made whole and plain (a module kept whole, a Mamba mixer beside
      sharded projections): ``to_local()`` of a replica is free and its gradient comes back
      ``Replicate()``; sequence-sharded ones are all-gathered.
    - ``"reduce_grad"``: plain floating inputs that carry a gradient stay plain, and the gradient
      the module hands back for them, this rank's partial sum (every read ends in column Linears
      handing theirs back unreduced, the module's own parameters' gradients left ``Partial()`` by
      ``style=ReplicatedWithGradAllReduce()``), is all-reduced at entry. An input several calls
      share (the same tensor handed to every layer, or a ``clone()`` of it) is wrapped once per
      autograd graph, so every call's partial gradient is added before that one all-reduce (Zamba's
      shared block reading ``concat(hidden, embeddings)``: the embeddings' half is reduced once per
      step, not once per layer). A value without a gradient, or seen outside autograd, passes.
      Applied once to a module that two plan keys match; a module that hands an input back as its
      output is refused (the caller's own gradient would be reduced too).

    ``outputs`` (the module's output, or the first element of a tuple):

    - ``"replicate"``: a plain output becomes a ``Replicate()`` DTensor, so the column projections
      reading it (q, k, v after a norm) reduce their input gradients once, summed as DTensors.
    - ``"local"``: a DTensor output is made replicated and plain.
    - ``"sum"``: the per-rank partial output is all-reduced (shared experts run on shards).
    - ``"shard"``: the output is the residual stream (a block kept whole under sequence parallel):
      handed on as this rank's ``Shard(sequence_dim)`` slice of the whole-sequence result (a
      transformers ``ModelOutput``: its first field); ``"shard_all"``: every output whose batch
      and sequence sizes are the stream's (a hyper-connection's branch input and its weights).
    - ``"sum_shard"``: the output is this rank's partial sum (experts with ``partial_output``),
      reduce-scattered onto the ``Shard(sequence_dim)`` stream; children's ``Partial()`` DTensor
      outputs are taken local, so the block's own code adds them into the one reduce-scatter.
    - ``"gather"``: a sequence-sharded DTensor output (a norm under ``style=SequenceParallel()``)
      is made ``Replicate()`` once, so the column projections reading it (q, k, v or gate, up)
      share one all-gather; handed on plain, or as the DTensor with ``local_outputs=False`` (the
      columns' ``Partial()`` input gradients are then summed as DTensors and the gather's backward
      reduce-scatters them once; every reader must take a DTensor), or plain with
      ``output_grad="partial"`` (its gradient taken as this rank's partial sum and
      reduce-scattered: readers that cannot take a DTensor but whose every path ends in columns
      handing back partial gradients).
    - ``"slice"``: a plain output computed whole on every rank is handed on as this rank's
      ``Shard(sequence_dim)`` positions; its backward all-gathers the gradient. With
      ``output_grad="partial"`` the cut is an ``index_select`` whose backward scatters into zeros
      (no communication): for a module computed from inputs without gradient (a learned position
      table looked up by positions) whose own parameters' gradients are left ``Partial()``
      (``style=ReplicatedWithGradAllReduce()``, required; a child's parameters are refused).

    ``output_grad="partial"`` (alone): a plain output's gradient is this rank's partial sum (its
    readers run their backward on partial gradients, down to column Linears that hand theirs back
    unreduced) and is all-reduced on the way back. ``reduce_grad_features``: only ``(start, stop)``
    spans of the output's last dim have their gradient all-reduced (of a tuple, the first element
    with a gradient): spans read through a broadcast by sharded computation (a rope key cut from
    a Linear and expanded to every head). ``copy_output``: hand the caller a copy of a plain
    output, for code that writes it in place (``x *= scale`` after an embedding), which a
    ``to_local()`` view cannot take.

    Keyword Args:
        inputs (str | None): ``"replicate"``, ``"gather"``, ``"slice"``, ``"whole"``, ``"reduce_grad"``
            or None. Default: None.
        outputs (str | None): ``"replicate"``, ``"local"``, ``"sum"``, ``"shard"``, ``"shard_all"``,
            ``"sum_shard"``, ``"gather"``, ``"slice"`` or None. Default: None.
        input_grad (str): ``"whole"`` or ``"partial"`` (with ``inputs="replicate"``). Default: ``"whole"``.
        output_grad (str): ``"whole"`` or ``"partial"`` (alone, or with ``outputs="gather"`` / ``"slice"``).
            Default: ``"whole"``.
        local_inputs (bool): with ``inputs="gather"``, hand the gathered inputs on plain. Default: True.
        local_outputs (bool): with ``outputs="gather"``, hand the gathered output on plain. Default: True.
        stream (int | str | None): with ``inputs="replicate"``, the one argument taken so. Default: None.
        columns (tuple[str, ...]): with ``inputs="replicate"``, the column children at whose entry
            the conversion happens, shared. Default: ().
        reduce_grad_features (tuple[tuple[int, int], ...]): output spans whose gradient is all-reduced.
        copy_output (bool): return a copy of a plain output. Default: False.
        sequence_dim (int): the sequence dim of the stream. Default: 1.
        style (ParallelStyle, optional): the module's own style, applied first.

    Example::
        >>> from torch.distributed.tensor.parallel import SequenceParallel
        >>> plan = {"model.layers.*.input_layernorm": Boundary(outputs="replicate"),
        ...         "model.layers.*.post_attention_layernorm": Boundary(outputs="gather", style=SequenceParallel()),
        ...         "model.layers.*.self_attn": Boundary(inputs="gather"),
        ...         "model.layers.*.mamba": Boundary(inputs="whole"),
        ...         "transformer.wte": Boundary(copy_output=True, style=VocabParallelEmbedding())}
    """

    def __init__(self, *, inputs: str | None = None, outputs: str | None = None, input_grad: str = "whole",
                 output_grad: str = "whole", local_inputs: bool = True, local_outputs: bool = True,
                 stream: int | str | None = None, columns: tuple[str, ...] = (),
                 reduce_grad_features: tuple[tuple[int, int], ...] = (), copy_output: bool = False,
                 sequence_dim: int = 1, style: ParallelStyle | None = None):
        super().__init__()
        for name, value, allowed in (("inputs", inputs, _INPUTS), ("outputs", outputs, _OUTPUTS),
                                     ("input_grad", input_grad, _GRADS), ("output_grad", output_grad, _GRADS)):
            if value not in allowed:
                raise PlanError(f"Boundary: {name}={value!r}; use one of {', '.join(map(repr, allowed))}")
        if input_grad == "partial" and inputs != "replicate":
            raise PlanError(f"Boundary(input_grad='partial') with inputs={inputs!r}: only inputs taken as "
                            "'replicate' hand back a partial gradient; set inputs='replicate'")
        if output_grad == "partial" and outputs not in (None, "gather", "slice"):
            raise PlanError(f"Boundary(output_grad='partial') with outputs={outputs!r}: a plain output's "
                            "gradient is what gets reduced; drop outputs (or use 'gather' / 'slice')")
        if (stream is not None or columns) and inputs != "replicate":
            raise PlanError(f"Boundary(stream=..., columns=...) with inputs={inputs!r}: they say where inputs "
                            "are taken as 'replicate'; set inputs='replicate'")
        if stream is not None and (columns or input_grad == "partial"):
            raise PlanError("Boundary(stream=...) takes the stream as a Replicate() DTensor with its whole "
                            "gradient, at the module's entry; drop columns and input_grad")
        if outputs == "gather" and isinstance(style, SequenceParallel) and style.use_local_output:
            raise PlanError("Boundary(outputs='gather', style=SequenceParallel(use_local_output=True)): the "
                            "norm's output must stay a Shard() DTensor to be gathered; use SequenceParallel()")
        if outputs in ("shard", "shard_all", "sum_shard") and inputs != "gather":
            raise PlanError(f"Boundary(outputs={outputs!r}) needs inputs='gather': the module runs on the whole "
                            "sequence and hands back this rank's slice")
        self.inputs, self.outputs = inputs, outputs
        self.input_grad, self.output_grad = input_grad, output_grad
        self.local_inputs, self.local_outputs = local_inputs, local_outputs
        self.stream, self.columns = stream, tuple(columns)
        self.reduce_grad_features = tuple((int(a), int(b)) for a, b in reduce_grad_features)
        self.copy_output = copy_output
        self.sequence_dim = sequence_dim
        self.style = style

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if self.inputs == "reduce_grad":
            if getattr(module, "_autotp_reduced_inputs", False):
                return module  # one module object under two plan keys (a block shared by several layers)
            module._autotp_reduced_inputs = True
        if self.outputs == "slice" and self.output_grad == "partial":
            _check_own_partial_params(module, self.style)
        module = self._apply_wrapped(module, device_mesh)
        prepend = self.style is not None  # before the wrapped style's own input hook
        dim = self.sequence_dim
        if self.inputs == "replicate" and self.columns:
            shared = share_column_inputs(module, self.columns, device_mesh, partial_grad=self.input_grad == "partial")
            module.register_forward_pre_hook(lambda mod, args: shared.clear())
            module.register_forward_hook(lambda mod, args, out: shared.clear())
        elif self.inputs == "replicate" and self.stream is not None:
            _replicate_stream(module, self.stream, device_mesh, prepend)
        elif self.inputs == "replicate":
            wrap = _replicated_with_partial_grad if self.input_grad == "partial" else _as_replicated
            _on_floating_inputs(module, partial(wrap, device_mesh=device_mesh), prepend)
        elif self.inputs == "reduce_grad":
            _reduce_input_grads(module, device_mesh)
        elif self.inputs == "gather":
            _gather_inputs(module, dim, self.local_inputs, self.outputs in ("shard", "shard_all"), prepend)
        elif self.inputs == "slice":
            _slice_stream_input(module, dim, device_mesh, prepend)
        elif self.inputs == "whole":
            def whole(mod, args, kwargs):
                return tuple(to_local(a) for a in args), {k: to_local(v) for k, v in kwargs.items()}
            module.register_forward_pre_hook(whole, with_kwargs=True, prepend=prepend)
        if self.reduce_grad_features:
            spans = self.reduce_grad_features

            def reduce_hook(mod, args, out):
                if type(out) not in (tuple, list):
                    return reduce_feature_grads(out, spans, device_mesh)
                # The output with a gradient (a mask handed out beside it has none); else the first.
                at = next((i for i, v in enumerate(out) if isinstance(v, torch.Tensor) and v.requires_grad), 0)
                return type(out)([*out[:at], reduce_feature_grads(out[at], spans, device_mesh), *out[at + 1:]])
            module.register_forward_hook(reduce_hook)
        if self.outputs in ("shard", "shard_all"):
            _slice_back_outputs(module, dim, device_mesh, every=self.outputs == "shard_all")
        elif self.outputs == "sum_shard":
            _reduce_scatter_output(module, dim, device_mesh)
        elif self.outputs == "gather":
            grad = "partial" if self.output_grad == "partial" else self.local_outputs
            module.register_forward_hook(lambda mod, args, out: _on_first_output(
                out, partial(_gathered, local=grad), device_mesh))
        elif self.outputs == "slice":
            cut = _own_positions if self.output_grad == "partial" else _sliced
            module.register_forward_hook(lambda mod, args, out: _on_first_output(
                out, partial(cut, sequence_dim=dim), device_mesh))
        elif self.outputs is not None or self.output_grad == "partial":
            convert = {"replicate": _as_replicated, "local": _local, "sum": _summed, None: _reduced_grad}[self.outputs]
            module.register_forward_hook(lambda mod, args, out: _on_first_output(out, convert, device_mesh))
        if self.copy_output:
            module.register_forward_hook(lambda mod, args, out: _owned(out))  # after every other hook
        return module

    @property
    def shares_output(self) -> bool:
        """The output's readers reduce their input gradients once, here: handed a ``Replicate()``
        DTensor, or a plain output whose partial gradient this style all-reduces."""
        return self.outputs == "replicate" or (self.output_grad == "partial" and self.outputs is None)

    def __repr__(self) -> str:
        options = ", ".join(f"{p.name}={getattr(self, p.name)!r}"
                            for p in inspect.signature(Boundary.__init__).parameters.values()
                            if p.default is not p.empty and getattr(self, p.name) != p.default)
        return f"{self.__class__.__name__}({options})"


def _replicate_stream(module: nn.Module, stream: int | str, device_mesh: DeviceMesh, prepend: bool) -> None:
    """``inputs="replicate"`` with ``stream``: that argument (by position or keyword) a ``Replicate()``
    DTensor; a partial sum meeting a live dropout reduced first, while the module runs."""
    wrap = partial(_as_replicated, device_mesh=device_mesh)

    def pre_hook(mod, args, kwargs):
        if isinstance(stream, int) and stream < len(args):
            args = (*args[:stream], wrap(args[stream]), *args[stream + 1:])
        elif isinstance(stream, str) and stream in kwargs:
            kwargs = {**kwargs, stream: wrap(kwargs[stream])}
        else:
            raise PlanError(f"{type(mod).__name__}: Boundary(stream={stream!r}) found no such input "
                            f"(positional: {len(args)}, keywords: {sorted(kwargs)}); name the residual-stream "
                            "input by its position or keyword.")
        return args, kwargs

    module.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=prepend)
    mode_during_forward(module, ReduceBeforeLiveDropout)  # a branch's partial sum meeting a live dropout


def _reduce_input_grads(module: nn.Module, device_mesh: DeviceMesh) -> None:
    """``inputs="reduce_grad"``: each plain floating input with a gradient wrapped so that its
    gradient is all-reduced, once per autograd graph (:func:`reduced_once`)."""
    taken: list[torch.Tensor] = []

    def take(value):
        if (not isinstance(value, torch.Tensor) or isinstance(value, DTensor) or not value.is_floating_point()
                or not value.requires_grad or not torch.is_grad_enabled()):
            return value
        taken.append(reduced_once(value, device_mesh))
        return taken[-1]

    def pre_hook(mod, args, kwargs):
        taken.clear()
        return tuple(take(a) for a in args), {k: take(v) for k, v in kwargs.items()}

    def returned_input(mod, args, kwargs, output):
        # The wrapper's gradient is reduced as a partial sum: the caller's own (whole) gradient
        # must not reach it, as it would through an input handed back as the output.
        if any(leaf is wrapped for leaf in tree_leaves(output) for wrapped in taken):
            raise PlanError(f"{type(mod).__name__} returns one of its inputs as it took it, so "
                            "Boundary(inputs='reduce_grad') would all-reduce the caller's gradient of it too; keep "
                            "this module's inputs whole (no reduce_grad on it) or put the style on a module that "
                            "computes its output")
        taken.clear()

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    module.register_forward_hook(returned_input, with_kwargs=True)


def _check_own_partial_params(module: nn.Module, style: ParallelStyle | None) -> None:
    """``outputs="slice"`` with a partial gradient leaves every parameter's gradient partial: they
    must be the module's own, under a style that reduces them."""
    children = [name for name, _ in module.named_parameters() if "." in name]
    if children:
        raise PlanError(f"{type(module).__name__}: Boundary(outputs='slice', output_grad='partial') leaves the "
                        f"gradients of the module's parameters partial, but {children[0]} belongs to a child; apply "
                        "it to the child that holds the parameters, or keep this module whole "
                        "(Boundary(outputs='replicate'))")
    if dict(module.named_parameters(recurse=False)) and not isinstance(style, ReplicatedWithGradAllReduce):
        raise PlanError(f"{type(module).__name__}: Boundary(outputs='slice', output_grad='partial') leaves its "
                        "parameters' gradients partial; add style=ReplicatedWithGradAllReduce() to reduce them")


def _on_floating_inputs(module: nn.Module, wrap, prepend: bool) -> None:
    """``wrap`` every plain floating argument of each call of ``module``."""
    def take(value):
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.is_floating_point():
            return wrap(value)
        return value

    def pre_hook(mod, args, kwargs):
        return tuple(take(a) for a in args), {k: take(v) for k, v in kwargs.items()}
    module.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=prepend)


def _replicated_with_partial_grad(value: torch.Tensor, device_mesh: DeviceMesh) -> DTensor:
    return _ReplicatedWithPartialGrad.apply(value, device_mesh)


def _on_first_output(out, convert, device_mesh):
    """``convert`` applied to ``out``, or to the first element of a tuple (a namedtuple too) or list."""
    if isinstance(out, (tuple, list)) and out:
        items = [convert(out[0], device_mesh), *out[1:]]
        return type(out)(*items) if hasattr(out, "_fields") else type(out)(items)
    return convert(out, device_mesh)


def _as_replicated(value, device_mesh):
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
        return DTensor.from_local(value, device_mesh, (Replicate(),), run_check=False)
    return value


def _gathered(value, device_mesh, *, local):
    """``outputs="gather"``: a DTensor made ``Replicate()``; ``local``: True (plain), False (the
    DTensor), ``"partial"`` (plain, its gradient this rank's partial sum)."""
    if not isinstance(value, DTensor):
        return value
    value = value.redistribute(placements=[Replicate()])
    if local == "partial":
        return value.to_local(grad_placements=[Partial()])
    return value.to_local() if local else value


def _sliced(value, device_mesh, *, sequence_dim):
    """``outputs="slice"``: a plain output cut to this rank's ``Shard(sequence_dim)`` positions."""
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    whole = DTensor.from_local(value, device_mesh, [Replicate()], run_check=False)
    return whole.redistribute(placements=[Shard(sequence_dim % value.ndim)])


def _own_positions(value, device_mesh, *, sequence_dim):
    """``outputs="slice"`` with a partial gradient: this rank's positions by ``index_select``,
    whose backward scatters into zeros (no communication)."""
    if not isinstance(value, torch.Tensor) or isinstance(value, DTensor):
        return value
    dim = sequence_dim % value.ndim
    positions = torch.arange(value.shape[dim], device=value.device)
    # This rank's positions, in DTensor's own Shard split (the stream's): a local cut.
    own = DTensor.from_local(positions, device_mesh, [Replicate()], run_check=False).redistribute(
        placements=[Shard(0)]).to_local()
    strides = [1] * value.ndim  # the whole output's, contiguous (an uneven split cannot infer it)
    for d in range(value.ndim - 2, -1, -1):
        strides[d] = strides[d + 1] * value.shape[d + 1]
    return DTensor.from_local(value.index_select(dim, own), device_mesh, [Shard(dim)], run_check=False,
                              shape=value.shape, stride=tuple(strides))


def _summed(value, device_mesh):
    return all_reduce_forward(value, device_mesh) if isinstance(value, torch.Tensor) else value


def _local(value, device_mesh):
    return to_local(value)


def _reduced_grad(value, device_mesh):
    if isinstance(value, torch.Tensor) and not isinstance(value, DTensor) and value.is_floating_point():
        return all_reduce_backward(value, device_mesh)
    return value


def _gather_inputs(module: nn.Module, sequence_dim: int, use_local_output: bool, whole: bool, prepend: bool) -> None:
    """``inputs="gather"``: each ``Shard(sequence_dim)`` DTensor argument all-gathered once per call.
    ``whole``: the module runs whole and its output is sliced back, so an input that arrives whole
    already (a ``Replicate()`` DTensor, a module's output wrapped to meet the stream) is made plain
    like the rest."""
    def gather(value):
        if isinstance(value, DTensor) and value.placements == (Shard(sequence_dim),):
            value = value.redistribute(placements=[Replicate()])
            # Kept a DTensor, the column Linears' Partial() input gradients are summed and the
            # all-gather's backward reduce-scatters them once.
            return value.to_local() if use_local_output else value
        if whole and isinstance(value, DTensor) and value.placements == (Replicate(),) and use_local_output:
            return value.to_local()
        return value

    def pre_hook(mod, args, kwargs):
        done: dict[int, object] = {}  # one tensor passed several times (attn(h, h, h)) is gathered once

        def once(value):
            if isinstance(value, DTensor):
                if id(value) not in done:
                    done[id(value)] = gather(value)
                return done[id(value)]
            return value
        return tuple(once(a) for a in args), {k: once(v) for k, v in kwargs.items()}
    module.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=prepend)


def _slice_back_outputs(module: nn.Module, sequence_dim: int, device_mesh: DeviceMesh, *, every: bool) -> None:
    """``outputs="shard"``: the (first) output, the whole-sequence stream, handed on as this rank's
    ``Shard(sequence_dim)`` slice; ``every``: each output whose leading (batch, sequence) sizes are
    the gathered input's."""
    def slice_back(value):
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            value = DTensor.from_local(value, device_mesh, [Replicate()], run_check=False)
        if isinstance(value, DTensor) and value.placements == (Replicate(),):
            # A Replicate() DTensor too (an inner module's output wrapped to meet the stream).
            return value.redistribute(placements=[Shard(sequence_dim)])
        return value

    leading: list = []  # (batch, sequence) sizes of the gathered stream, per call

    def record(mod, args, kwargs):
        values = [v for v in (*args, *kwargs.values()) if isinstance(v, torch.Tensor)]
        if values:
            leading[:] = [tuple(values[0].shape[: sequence_dim + 1])]

    def per_position(value):
        return isinstance(value, torch.Tensor) and leading and tuple(value.shape[: sequence_dim + 1]) == leading[0]

    def hook(mod, args, out):
        if type(out) in (tuple, list) and out:  # (hidden, attentions...), as a tuple or a list
            if every:
                return type(out)([slice_back(v) if per_position(v) else v for v in out])
            return type(out)([slice_back(out[0]), *out[1:]])
        if isinstance(out, dict) and out:  # a transformers ModelOutput: its first field
            for key in list(out) if every else list(out)[:1]:
                if not every or per_position(out[key]):
                    out[key] = slice_back(out[key])
            return out
        return slice_back(out)

    if every:
        module.register_forward_pre_hook(record, with_kwargs=True, prepend=True)
    module.register_forward_hook(hook)


def _reduce_scatter_output(module: nn.Module, sequence_dim: int, device_mesh: DeviceMesh) -> None:
    """``outputs="sum_shard"``: the (first) output, this rank's partial sum of every token (experts
    sharded on their FFN dim), reduce-scattered onto the ``Shard(sequence_dim)`` stream; children's
    ``Partial()`` DTensor outputs (a shared expert's row) taken local, with ``Replicate()``
    gradients (the all-gathered one of the block's output), so the block's own code adds them into
    the partial sum and one reduce-scatter covers both."""
    def reduce_scatter(value):
        if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
            partial_sum = DTensor.from_local(value, device_mesh, [Partial()], run_check=False)
            return partial_sum.redistribute(placements=[Shard(sequence_dim)])
        return value

    def hook(mod, args, out):
        if type(out) in (tuple, list) and out:  # (hidden, router logits...): the first is the stream
            return type(out)([reduce_scatter(out[0]), *out[1:]])
        return reduce_scatter(out)

    module.register_forward_hook(hook)
    for child in module.children():
        child.register_forward_hook(_partial_outputs_local)


def _partial_outputs_local(module, args, output):
    """A child's ``Partial()`` DTensor outputs as local partial sums with ``Replicate()`` gradients."""
    def local(value):
        if isinstance(value, DTensor) and all(p.is_partial() for p in value.placements):
            return value.to_local(grad_placements=[Replicate()])
        return value

    if type(output) in (tuple, list):
        return type(output)(local(o) for o in output)
    return local(output)


def _slice_stream_input(module: nn.Module, sequence_dim: int, device_mesh: DeviceMesh, prepend: bool) -> None:
    """``inputs="slice"``: the stream input, if plain, cut to this rank's ``Shard(sequence_dim)``
    slice (no communication forward; its backward all-gathers the gradient)."""
    first = next(iter(inspect.signature(module.forward).parameters), None)

    def shard(value):
        if isinstance(value, torch.Tensor) and value.is_floating_point():
            return _sliced(value, device_mesh, sequence_dim=sequence_dim)
        return value

    def pre_hook(mod, args, kwargs):
        for i, arg in enumerate(args):
            if isinstance(arg, torch.Tensor):
                return (*args[:i], shard(arg), *args[i + 1:]), kwargs
        if first in kwargs:
            kwargs = {**kwargs, first: shard(kwargs[first])}
        return args, kwargs
    module.register_forward_pre_hook(pre_hook, with_kwargs=True, prepend=prepend)
