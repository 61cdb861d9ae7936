"""ParallelStyles that torch does not ship but LLM plans need.

Each style is a small class in the manner of ``torch.distributed.tensor.parallel.style``: keyword-only
options, static ``_prepare_input_fn`` / ``_prepare_output_fn``, and a comment on the shard algebra.

- :class:`VocabParallelEmbedding`: vocab-sharded embedding, looked up on the local shard (local-size gradient).
- :class:`RotaryEmbedParallel`: a rotary module whose output is a tuple ``(cos, sin)``.
- :class:`SequenceParallelAllGather`: a sequence-parallel norm that all-gathers its output once, so
  that every column-parallel consumer (q, k, v or gate, up) shares one all-gather.
- :class:`ReplicatedWithGradAllReduce` / :class:`HeadShardedNorm`: replicated parameters whose
  gradients are partial (a per-head norm such as Qwen3's QK-norm on head-sharded tensors).
- :class:`WidthShardedNorm`: a norm over a width that is sharded (OLMo2 QK-norm), kept exact by
  reducing its statistic across ranks.
- :class:`PackedColwiseParallel`: a column-parallel Linear whose output is split into parts
  (fused ``qkv_proj`` / ``gate_up_proj``), sharded part by part.
- :class:`ShardCounts`: divide a module's head counts by tp, for code that sizes slices from them.
- :class:`ReplicatedKVColwise`, :class:`KVHeadCounts`: tp larger than the number of kv heads; each
  rank holds the one kv head its query heads read, copies' gradients summed.
- :class:`ExpertsParallel`, :class:`AllReduceOutput`, :class:`GradAllReduceOutputSlice`: MoE experts
  (3-D parameters) sharded on their FFN dim, and the reductions around them and around MLA.
"""

from __future__ import annotations

import copy
import inspect
from functools import partial

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Partial, Replicate, Shard, distribute_module, distribute_tensor
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

__all__ = [
    "KVHeadCounts",
    "ReplicatedKVColwise",
    "AllReduceOutput",
    "ExpertsParallel",
    "GradAllReduceOutputSlice",
    "ReplicatedWithGradAllReduce",
    "HeadShardedNorm",
    "OwnedOutput",
    "PackedColwiseParallel",
    "PartialRowwiseParallel",
    "ColwiseParallelInOut",
    "RowwiseParallelInOut",
    "ReplicatedOutput",
    "ReplicatedModule",
    "ReplicatedParams",
    "ReplicatedStream",
    "RotaryEmbedParallel",
    "SequenceParallelAllGather",
    "ShardCounts",
    "VocabParallelEmbedding",
    "WidthShardedNorm",
    "packed_row_order",
]


class VocabParallelEmbedding(RowwiseParallel):
    """Shard an embedding table over the vocabulary; each rank looks up only the rows it holds.

    ``weight`` is ``Shard(0)``: rank r holds rows ``[r * c, r * c + local)`` with ``c = ceil(V / tp)``
    (torch's ``Shard(0)`` split). During the module's forward the weight is swapped for its local
    shard (``to_local(grad_placements=(Shard(0),))``) and the module's own lookup (its
    ``F.embedding`` / ``torch.embedding`` call on that weight) runs on the shard: ids shifted by the
    rank's offset, ids the rank does not own looked up as row 0 and their output rows zeroed. Each
    rank's output is then a partial sum of the full lookup, reduced on the spot: all-reduce to
    ``Replicate()``, or reduce-scatter to ``Shard(1)`` when ``output_layouts`` says so (sequence
    parallel). Because the lookup's backward only ever sees the local table, the weight's gradient
    is ``Shard(0)`` with the local size on every rank: no full-size gradient is materialised (torch's
    DTensor embedding backward, and stock ``RowwiseParallel``, return a ``Replicate()`` full table).

    What the module does after the lookup (a scale, a norm) runs on the reduced rows: plain tensors
    when replicated, a ``Shard(1)`` DTensor under sequence parallel. Where the module has parameters
    besides ``weight`` (its own or its children's), the rows are all-reduced first and only cut to
    ``output_layouts`` on the way out, so those parameters see whole rows on every rank. A module that unwraps a DTensor weight
    itself (torchtitan's ``Embedding``: ``weight.to_local() if isinstance(weight, DTensor)``) sees a
    plain weight and takes its plain path, whose lookup is the one run on the shard. ``padding_idx``
    is honoured (no gradient to that row); ``scale_grad_by_freq`` and ``sparse`` are not supported.

    Keyword Args:
        input_layouts, output_layouts, use_local_output: as for :class:`RowwiseParallel`.

    Raises:
        PlanError: the module is not an ``nn.Embedding``, its forward never looked up its weight
            with ``F.embedding``, or it asks for ``scale_grad_by_freq`` / ``sparse`` gradients.

    Example::
        >>> plan = {"model.embed_tokens": VocabParallelEmbedding(input_layouts=Replicate())}
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        if not isinstance(module, nn.Embedding):
            return super()._apply(module, device_mesh)  # raises: RowwiseParallel's own message
        _require_plain_lookup(module)
        for name, param in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if name == "weight" else Replicate()
            dist = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))
        lookup = _ShardLookup(module, device_mesh, input_layout=self.input_layouts[0],
                              output_layouts=tuple(self.output_layouts), use_local_output=self.use_local_output)
        module.register_forward_pre_hook(lookup.enter, with_kwargs=True)
        module.register_forward_hook(lookup.leave, always_call=True)
        return module


def _require_plain_lookup(module: nn.Embedding) -> None:
    """Raise if ``module`` asks for a lookup gradient the shard cannot give."""
    from autotp.errors import PlanError

    if getattr(module, "scale_grad_by_freq", False) or getattr(module, "sparse", False):
        raise PlanError(
            f"{type(module).__name__}: VocabParallelEmbedding found scale_grad_by_freq="
            f"{module.scale_grad_by_freq}, sparse={module.sparse}; a vocab-sharded lookup needs both False "
            "(frequencies and sparse rows span ranks). Leave this embedding replicated (no plan key)."
        )


def _shard_offset(weight: DTensor, device_mesh: DeviceMesh) -> torch.Tensor:
    """First vocabulary row this rank holds: ``rank * ceil(V / tp)``, torch's ``Shard(0)`` split."""
    from autotp._simulate import mesh_coordinate

    rows, ranks = weight.shape[0], device_mesh.size()
    return -(-rows // ranks) * mesh_coordinate(device_mesh)


class _ShardLookup(torch.overrides.TorchFunctionMode):
    """The forward hooks of :class:`VocabParallelEmbedding` on one module, and the torch-function
    mode, active only during that module's forward, that runs its embedding lookup on the shard."""

    def __init__(self, module: nn.Module, device_mesh: DeviceMesh, *, input_layout, output_layouts,
                 use_local_output: bool):
        super().__init__()
        self.mesh = device_mesh
        self.input_layout, self.output_layouts, self.use_local_output = input_layout, output_layouts, use_local_output
        # Parameters besides the table, or children with parameters: they must see whole rows.
        others = [n for n, _ in module.named_parameters() if n != "weight"]
        self.reduce_to = (Replicate(),) if others else output_layouts
        self.saved: dict[str, nn.Parameter] = {}
        self.local_weight = None
        self.reduced: DTensor | None = None

    def enter(self, mod, args, kwargs):
        """Pre-hook: plain replicated ids, local parameters, lookups redirected to the shard."""
        for name, param in list(mod._parameters.items()):
            if isinstance(param, DTensor):
                self.saved[name] = param
                grad = (Shard(0),) if name == "weight" else (Replicate(),)
                mod._parameters[name] = param.to_local(grad_placements=grad)
        self.local_weight, self.reduced = mod._parameters["weight"], None
        self.__enter__()
        return tuple(self._ids(a) for a in args), {k: self._ids(v) for k, v in kwargs.items()}

    def _ids(self, x):
        # Every integer tensor becomes the whole ids as a plain tensor: the module may compute
        # its ids from a mask, or take them by keyword.
        if not isinstance(x, torch.Tensor) or x.is_floating_point():
            return x
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, self.mesh, (self.input_layout,), run_check=False)
        return x.redistribute(placements=(Replicate(),)).to_local()

    def leave(self, mod, args, output):
        """Post-hook: parameters restored; the output cut to ``output_layouts``, a DTensor unless
        ``use_local_output``."""
        from autotp.errors import PlanError

        self.__exit__(None, None, None)
        mod._parameters.update(self.saved)
        self.saved.clear()
        looked_up, self.reduced, self.local_weight = self.reduced is not None, None, None
        if output is None:  # the forward raised (an always-call hook): its error is the one to see
            return output
        if not looked_up:
            raise PlanError(
                f"{type(mod).__name__}: VocabParallelEmbedding found a forward that never looks up its "
                "weight with F.embedding (it indexes or transforms the table itself), so the vocab-sharded "
                "lookup cannot run. Leave this embedding replicated (no plan key for it)."
            )
        if isinstance(output, DTensor):
            if tuple(output.placements) != self.output_layouts:
                output = output.redistribute(placements=self.output_layouts)
            return output.to_local() if self.use_local_output else output
        if not isinstance(output, torch.Tensor):
            return output
        return self._laid_out(output)

    def _laid_out(self, output: torch.Tensor):
        """``output``, computed from rows all-reduced to ``Replicate()`` (a module with other
        parameters), cut to ``output_layouts``: a local chunk, no communication forward."""
        out = DTensor.from_local(output, self.mesh, (Replicate(),), run_check=False)
        if tuple(out.placements) != self.output_layouts:
            out = out.redistribute(placements=self.output_layouts)
        return out.to_local() if self.use_local_output else out

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if func is torch.nn.functional.embedding:
            bound = inspect.signature(torch.nn.functional.embedding).bind(*args, **kwargs)
        elif func is torch.embedding:
            bound = inspect.signature(_aten_embedding).bind(*args, **kwargs)
            if bound.arguments.get("padding_idx", -1) == -1:
                bound.arguments["padding_idx"] = None
        else:
            return func(*args, **kwargs)
        bound.apply_defaults()
        if bound.arguments["weight"] is not self.local_weight:
            return func(*args, **kwargs)
        return self._lookup(**bound.arguments)

    def _lookup(self, input, weight, padding_idx=None, max_norm=None, norm_type=2.0, **_):
        """The shard's part of ``F.embedding(input, full_weight)``, reduced to ``self.reduce_to``."""
        table = self.saved["weight"]
        offset = _shard_offset(table, self.mesh).to(input.device)
        # Rows [offset, offset + local) live here: other ids read row 0, and their rows are zeroed below.
        foreign = (input < offset) | (input >= offset + weight.shape[0])
        local_ids = (input - offset).masked_fill(foreign, 0)
        rows = torch.nn.functional.embedding(local_ids, weight, None, max_norm, norm_type)
        rows = rows.masked_fill(foreign.unsqueeze(-1), 0)
        if padding_idx is not None:  # F.embedding sends no gradient to the padding row
            pad = (input == padding_idx % table.shape[0]).unsqueeze(-1)
            rows = torch.where(pad, rows.detach(), rows)
        partial_sum = DTensor.from_local(rows, self.mesh, (Partial(),), run_check=False)
        self.reduced = partial_sum.redistribute(placements=self.reduce_to)
        if any(isinstance(p, Shard) for p in self.reduce_to):
            # Sequence-sharded rows stay a DTensor for the rest of the module (a scale is fine on
            # it): a plain local shard of an uneven sequence could not be wrapped back exactly.
            return self.reduced
        return self.reduced.to_local()


def _aten_embedding(weight, input, padding_idx=-1, scale_grad_by_freq=False, sparse=False):
    """Signature of ``torch.embedding`` (``aten.embedding``), whose -1 means no padding row."""


def _to_local(x):
    """Return the full local value of ``x``: a replicated plain tensor for any DTensor."""
    if isinstance(x, DTensor):
        return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim).to_local()
    return x


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
            return type(outputs)(_to_local(o) for o in outputs)
        return _to_local(outputs)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_pre_hook(self._prepare_input_fn, with_kwargs=True)
        module.register_forward_hook(self._prepare_output_fn)
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}()"


class SequenceParallelAllGather(SequenceParallel):
    """A sequence-parallel norm whose output is all-gathered once, for column-parallel consumers.

    The norm runs on the ``Shard(sequence_dim)`` input with replicated weights (their gradients are
    partial sums and get all-reduced, as in :class:`SequenceParallel`). Its output is redistributed
    to ``Replicate()``, so q/k/v (or gate/up) projections that read it share one all-gather.

    With ``use_local_output=False`` the output stays a ``Replicate()`` DTensor: each column
    projection's input gradient comes back ``Partial()``, autograd sums them as DTensors, and the
    all-gather's backward reduce-scatters the sum once. With a plain tensor each projection would
    all-reduce its own input gradient (3 for q/k/v where 1 reduce-scatter suffices). Only use it
    where every reader of the output accepts a DTensor (torch's Linear styles do).

    Keyword Args:
        sequence_dim (int): the sequence dimension of the input. Default: 1.
        use_local_output (bool): return a plain tensor instead of the ``Replicate()`` DTensor.
            Default: True.

    Example::
        >>> plan = {"model.layers.*.input_layernorm": SequenceParallelAllGather(use_local_output=False)}
    """

    def __init__(self, *, sequence_dim: int = 1, use_local_output: bool = True):
        super().__init__(sequence_dim=sequence_dim, use_local_output=use_local_output)

    @staticmethod
    def _prepare_output_fn(use_local_output, mod, outputs, device_mesh):
        if isinstance(outputs, DTensor):
            outputs = outputs.redistribute(placements=[Replicate()])
            return outputs.to_local() if use_local_output else outputs
        return outputs

    def __repr__(self) -> str:
        flag = "" if self.use_local_output else "use_local_output=False"
        return f"{self.__class__.__name__}({flag})"


class ReplicatedOutput(ParallelStyle):
    """Return a module's (replicated) output as a ``Replicate()`` DTensor, so that the column
    projections reading it reduce their input gradient once.

    Under plain TP a norm's output feeds several column-parallel Linears (q, k, v; gate, up; or
    both branches of a parallel block). Each ``ColwiseParallel`` turns a plain input into a
    ``Replicate()`` DTensor itself, and in backward all-reduces the ``Partial()`` input gradient
    it gets from ``x @ W_shard^T``: one all-reduce per projection. Wrapping the output here instead
    lets autograd sum the projections' ``Partial()`` gradients as DTensors (addition is linear, so
    a sum of partial sums is a partial sum), and ``from_local``'s backward all-reduces that sum
    once. The forward costs nothing: the value is already the same on every rank.

    The module's own parameters stay plain tensors. Only use it where every reader of the output
    accepts a DTensor (torch's Linear styles do; a replicated Linear with plain weights does not).

    Example::
        >>> plan = {"model.layers.*.input_layernorm": ReplicatedOutput()}
    """

    @staticmethod
    def _prepare_output_fn(mod, inputs, outputs, device_mesh):
        if isinstance(outputs, torch.Tensor) and not isinstance(outputs, DTensor):
            return DTensor.from_local(outputs, device_mesh, (Replicate(),), run_check=False)
        return outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(partial(self._prepare_output_fn, device_mesh=device_mesh))
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}()"


class ReplicatedModule(ParallelStyle):
    """A module kept whole on every rank, in a plan that hands it DTensors: it runs on plain tensors.

    Where a norm returns its output as a ``Replicate()`` DTensor for the column projections of a
    branch (:class:`ReplicatedOutput`, :class:`SequenceParallelAllGather`), a module beside them
    that is not sharded (a Mamba mixer or linear-attention block kept whole) reads the same DTensor
    and would mix it with its plain weights. Its DTensor inputs are made whole and local at entry:
    ``to_local()`` of a replica is free, and its gradient comes back ``Replicate()`` (every rank
    computes the same one), which autograd adds to the projections' ``Partial()`` gradients with no
    extra collective. Sequence-sharded inputs are all-gathered.

    Keyword Args:
        output_layouts (Placement, optional): return the (first) output as a DTensor with this
            placement, taken from the replicated value: ``Shard(1)`` slices it back to this rank's
            positions for a sequence-sharded residual stream. Default: a plain tensor.

    Example::
        >>> plan = {"model.layers.*.mamba": ReplicatedModule()}
    """

    def __init__(self, *, output_layouts: Placement | None = None):
        super().__init__()
        self.output_layouts = output_layouts

    @staticmethod
    def _whole(value):
        return _to_local(value) if isinstance(value, DTensor) else value

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def pre_hook(mod, args, kwargs):
            return tuple(self._whole(a) for a in args), {k: self._whole(v) for k, v in kwargs.items()}

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        if self.output_layouts is not None:
            def to_layout(value):
                if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                    whole = DTensor.from_local(value, device_mesh, (Replicate(),), run_check=False)
                    return whole.redistribute(placements=(self.output_layouts,))
                return value

            def hook(mod, args, out):
                if type(out) in (tuple, list) and out:
                    return type(out)([to_layout(out[0]), *out[1:]])
                return to_layout(out)

            module.register_forward_hook(hook)
        return module

    def __repr__(self) -> str:
        extra = f"output_layouts={self.output_layouts}" if self.output_layouts is not None else ""
        return f"{self.__class__.__name__}({extra})"


class ReplicatedStream(ParallelStyle):
    """Run a block on the residual stream as a ``Replicate()`` DTensor, so that partial sums from
    several row-parallel branches are added before one reduction (a parallel block).

    A parallel block computes ``x + attn(norm(x)) + mlp(norm(x))``. With each row projection
    all-reducing its own output that is two all-reduces per layer in each direction. If instead
    both rows return ``Partial()`` DTensors (``RowwiseParallel(output_layouts=Partial(),
    use_local_output=False)``), their sum is still a partial sum, and adding the replicated
    residual reduces it once; in backward the column projections' ``Partial()`` input gradients
    are likewise summed before the norm reduces them once. For that the residual must be a DTensor
    inside the block: the stream input is wrapped as ``Replicate()`` at entry (free: every rank
    holds it) and the output is made replicated and local at exit. The norm on the stream needs
    DTensor parameters (:class:`ReplicatedParams`). Under sequence parallel the stream is already a
    ``Shard(1)`` DTensor and this style is not needed.

    Keyword Args:
        stream (int | str): the positional index or keyword name of the residual-stream input.
            Default: 0.

    Example::
        >>> plan = {"model.layers.*": ReplicatedStream(),
        ...         "model.layers.*.input_layernorm": ReplicatedParams(),
        ...         "model.layers.*.mlp.fc2": RowwiseParallel(output_layouts=Partial(), use_local_output=False)}
    """

    def __init__(self, *, stream: int | str = 0):
        super().__init__()
        self.stream = stream

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def wrap(value):
            if isinstance(value, torch.Tensor) and not isinstance(value, DTensor):
                return DTensor.from_local(value, device_mesh, (Replicate(),), run_check=False)
            return value

        def pre_hook(mod, args, kwargs):
            if isinstance(self.stream, int) and self.stream < len(args):
                args = (*args[: self.stream], wrap(args[self.stream]), *args[self.stream + 1:])
            elif isinstance(self.stream, str) and self.stream in kwargs:
                kwargs = {**kwargs, self.stream: wrap(kwargs[self.stream])}
            else:
                from autotp.errors import PlanError

                raise PlanError(
                    f"{type(mod).__name__}: ReplicatedStream(stream={self.stream!r}) found no such input "
                    f"(positional: {len(args)}, keywords: {sorted(kwargs)}); name the residual-stream input "
                    "by its position or keyword."
                )
            return args, kwargs

        def hook(mod, args, kwargs, out):
            if type(out) in (tuple, list) and out:
                return type(out)([_to_local(out[0]), *out[1:]])
            return _to_local(out)

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        module.register_forward_hook(hook, with_kwargs=True)
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(stream={self.stream!r})"


class PartialRowwiseParallel(RowwiseParallel):
    """A row-parallel Linear whose output stays a ``Partial()`` DTensor (one branch of a parallel
    block), for the caller to add to the other branch before one reduction.

    Its gradient is taken ``Replicate()``: when the sum is reduce-scattered onto the ``Shard(1)``
    stream (SP), the gradient comes back sequence-sharded and is all-gathered once here, instead of
    once for the input gradient and again for the weight gradient inside the Linear's backward.

    Example::
        >>> plan = {"model.layers.*.mlp.fc2": PartialRowwiseParallel()}
    """

    def __init__(self):
        super().__init__(output_layouts=Partial(), use_local_output=False)

    @staticmethod
    def _prepare_output_fn(output_layouts, use_local_output, mod, outputs, device_mesh):
        local = outputs.to_local(grad_placements=(Replicate(),))
        return DTensor.from_local(local, device_mesh, (Partial(),), run_check=False)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}()"


class _LocalParamsStyle(ParallelStyle):
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


def all_reduce_forward(x: torch.Tensor, device_mesh: DeviceMesh) -> torch.Tensor:
    """Sum a per-rank partial result over ranks (gradient passes through unchanged)."""
    if isinstance(x, DTensor):
        return x.redistribute(placements=[Replicate()]).to_local()
    return DTensor.from_local(x, device_mesh, [Partial()], run_check=False).redistribute(placements=[Replicate()]).to_local()


class ReplicatedWithGradAllReduce(_LocalParamsStyle):
    """Keep a module's parameters replicated and all-reduce their gradients.

    For a module between a column- and a row-parallel Linear that sees only this rank's part of
    the activation: each rank's parameter gradient is a partial sum over its shard, and plain
    replicated parameters would drift apart after one optimizer step, silently.

    Example::
        >>> plan = {"model.layers.*.mlp.gate_norm": ReplicatedWithGradAllReduce()}
    """

    def _placement(self, name, param):
        return Replicate()

    def _grad_placement(self, name, param):
        return [Partial()]


class HeadShardedNorm(ReplicatedWithGradAllReduce):
    """A per-head norm (Qwen3 ``q_norm`` / ``k_norm``) on a tensor whose heads are sharded.

    The input ``(..., heads / tp, head_dim)`` comes from a column-parallel projection; the norm
    reduces over ``head_dim`` only, so the local result is exact. The weight (over ``head_dim``)
    stays replicated; each rank's gradient sums over its own heads only, so it is all-reduced.

    Example::
        >>> plan = {"model.layers.*.self_attn.q_norm": HeadShardedNorm()}
    """


class WidthShardedNorm(ParallelStyle):
    """A norm over a width that a column-parallel projection sharded (OLMo2 ``q_norm``).

    ``RMSNorm(q_proj(x))`` normalises over all heads together. With ``q_proj`` column-parallel,
    each rank holds a slice of that width. The norm runs on DTensors: the input is
    ``Shard(shard_dim)``, the weight ``Shard(0)`` like its input, the mean of squares becomes a
    partial sum that DTensor all-reduces (a ``(batch, seq, 1)`` statistic), and the result is exact
    and stays sharded (returned local).

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
        x = inputs[0]
        if not isinstance(x, DTensor):
            x = DTensor.from_local(x, device_mesh, [Shard(shard_dim % x.ndim)], run_check=False)
        return (x, *inputs[1:])

    @staticmethod
    def _prepare_output_fn(mod, outputs, device_mesh):
        return outputs.to_local() if isinstance(outputs, DTensor) else outputs

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module,
            device_mesh,
            self._partition_fn,
            partial(self._prepare_input_fn, self.shard_dim),
            self._prepare_output_fn,
        )

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(shard_dim={self.shard_dim})"


class ExpertsParallel(_LocalParamsStyle):
    """Shard every expert of a grouped-experts module on its FFN dimension (transformers 5 MoE).

    transformers 5 stores experts as 3-D parameters: ``gate_up_proj`` (experts, 2 * ffn, hidden)
    and ``down_proj`` (experts, hidden, ffn). Each rank keeps ``ffn / tp`` of every expert: the
    fused gate/up rows part by part (dim 1, :func:`packed_row_order`), the down projection's input
    columns (dim 2). Each rank runs the routing on the replicated tokens with its slice of every
    expert and produces a partial sum, all-reduced once after the module: one all-reduce per MoE
    layer, as for a dense MLP. The router stays replicated; the gradients of the hidden states and
    of the routing weights are partial and are all-reduced in backward.

    Keyword Args:
        shard_dims (dict[str, int]): parameter name -> sharded dim.
        packed (dict[str, int]): parameter name -> number of equal parts fused along its sharded dim.

    Example::
        >>> plan = {"model.layers.*.mlp.experts": ExpertsParallel()}
    """

    def __init__(self, *, shard_dims: dict[str, int] | None = None, packed: dict[str, int] | None = None):
        super().__init__()
        self.shard_dims = dict(shard_dims or {"gate_up_proj": 1, "down_proj": 2})
        self.packed = dict(packed if packed is not None else {"gate_up_proj": 2})

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
                new._autotp_to_layout = partial(_permute_rows, dim=dim, order=order)
            module.register_parameter(name, new)

    def _prepare_inputs(self, args, kwargs, device_mesh):
        args = tuple(all_reduce_backward(a, device_mesh) if isinstance(a, torch.Tensor) else a for a in args)
        kwargs = {k: all_reduce_backward(v, device_mesh) if isinstance(v, torch.Tensor) else v for k, v in kwargs.items()}
        return args, kwargs

    def _prepare_output(self, output, device_mesh):
        return all_reduce_forward(output, device_mesh)

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(shard_dims={self.shard_dims}, packed={self.packed})"


class ReplicatedParams(ParallelStyle):
    """Make a module's own parameters (not its children's) replicated DTensors; no hooks.

    For a module that applies parameters of its own to the sequence-sharded stream (an input
    scale or bias on a model that also holds the layers): DTensor reduces their gradients over
    the sequence shards, as ``SequenceParallel`` does for a norm's weight, while the children keep
    their own styles.

    Example::
        >>> plan = {"model": ReplicatedParams()}
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        for name, param in list(module.named_parameters(recurse=False)):
            if not isinstance(param, DTensor):
                dist = DTensor.from_local(param, device_mesh, [Replicate()], run_check=False)
                module.register_parameter(name, nn.Parameter(dist, requires_grad=param.requires_grad))
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}()"


class OwnedOutput(ParallelStyle):
    """Apply ``style``, then hand the caller a copy of the module's plain-tensor output.

    Styles with ``use_local_output=True`` return ``DTensor.to_local()``, which autograd treats as a
    view made inside a custom Function; code that then writes the output in place (``x *= scale``
    after an embedding, ``out.add_(routed)`` after a shared expert) fails with "Output 0 of
    _ToTorchTensor is a view and is being modified inplace". One copy of the activation avoids it;
    the synthesizer adds this wrapper only where the traced graph shows such a write.

    Example::
        >>> plan = {"transformer.w": OwnedOutput(VocabParallelEmbedding())}
    """

    def __init__(self, wrapped: ParallelStyle):
        super().__init__()
        self.wrapped = wrapped  # styles with a ``wrapped`` style shard parameters as that one does

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = self.wrapped._apply(module, device_mesh)
        module.register_forward_hook(lambda mod, args, out: _owned(out))  # runs after the style's hooks
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}({self.wrapped!r})"


def _owned(out):
    if isinstance(out, torch.Tensor) and not isinstance(out, DTensor):
        return out.clone()
    if isinstance(out, tuple) and out and isinstance(out[0], torch.Tensor) and not isinstance(out[0], DTensor):
        return (out[0].clone(), *out[1:])
    return out


class AllReduceOutput(ParallelStyle):
    """Sum a module's per-rank partial output over ranks (e.g. shared experts run on shards).

    Example::
        >>> plan = {"model.layers.*.mlp.shared_experts": AllReduceOutput()}
    """

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module.register_forward_hook(lambda mod, args, out: all_reduce_forward(out, device_mesh))
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}()"


class GradAllReduceOutputSlice(ParallelStyle):
    """All-reduce, in backward, the gradient of the last ``width`` features of a replicated output.

    MLA's ``kv_a_proj_with_mqa`` output splits into a part that feeds a column-parallel Linear
    (whose input gradient is already reduced) and a rotary part that reaches head-sharded attention
    directly, whose gradient is partial per rank.

    Keyword Args:
        width (int): features at the end of the output whose gradient is partial.
    """

    def __init__(self, *, width: int):
        super().__init__()
        self.width = width

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        def hook(mod, args, out):
            keep, rope = out.split([out.shape[-1] - self.width, self.width], dim=-1)
            return torch.cat([keep, all_reduce_backward(rope, device_mesh)], dim=-1)

        module.register_forward_hook(hook)
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(width={self.width})"


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


def _permute_rows(tensor: torch.Tensor, *, dim: int, order: torch.Tensor) -> torch.Tensor:
    return tensor.index_select(dim, order)


class PackedColwiseParallel(ColwiseParallel):
    """Column-parallel Linear whose output is a concatenation of parts, sharded part by part.

    Plain ``ColwiseParallel`` on a fused ``[q | k | v]`` or ``[gate | up]`` weight hands rank 0 all
    of q and rank 1 the rest of q plus k and v: the split after it then mixes parts and the logits
    are wrong with no error. Here the weight rows (and bias) are first permuted by
    :func:`packed_row_order`, then sharded ``Shard(0)``: each rank holds ``size / tp`` rows of every
    part. Parts may be unequal (GQA: ``sizes=(heads * d, kv * d, kv * d)``). The parameter keeps the
    permuted order; its ``_autotp_to_layout`` attribute maps an unsharded tensor to that order, for checkpoint
    conversion and for :func:`autotp.verify`.

    Keyword Args:
        sizes (tuple[int, ...]): widths of the parts, summing to ``out_features``.
        input_layouts, output_layouts, use_local_output: as for :class:`ColwiseParallel`.

    Example::
        >>> plan = {"model.layers.*.mlp.gate_up_proj": PackedColwiseParallel(sizes=(8192, 8192))}
    """

    def __init__(self, *, sizes: tuple[int, ...], **kwargs):
        super().__init__(**kwargs)
        self.sizes = tuple(int(s) for s in sizes)

    def _partition_linear_fn(self, name, module, device_mesh):
        tp = device_mesh.size()
        order = packed_row_order(self.sizes, tp)
        for pname, param in list(module.named_parameters(recurse=False)):
            with torch.no_grad():
                permuted = param[order]
            dist = distribute_tensor(permuted, device_mesh, [Shard(0)], src_data_rank=self.src_data_rank)
            new = nn.Parameter(dist, requires_grad=param.requires_grad)
            new._autotp_to_layout = partial(_permute_rows, dim=0, order=order)
            module.register_parameter(pname, new)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", sizes={self.sizes})"


class ColwiseParallelInOut(ColwiseParallel):
    """:class:`ColwiseParallel` for a Linear-like module whose weight is stored ``(in, out)``
    (transformers' ``Conv1D``: ``addmm(bias, x, weight)``): the weight is sharded on dim 1, the bias
    on dim 0. With ``sizes`` the output is a concatenation of parts sharded part by part, as
    :class:`PackedColwiseParallel` does (GPT-2's fused ``c_attn``).

    The module runs on DTensors (its code reshapes with global sizes, ``view(..., self.nf)``); the
    output is turned local after it returns.

    Keyword Args:
        sizes (tuple[int, ...] | None): widths of the parts of a fused output, or None.
        input_layouts, output_layouts, use_local_output: as for :class:`ColwiseParallel`.

    Example::
        >>> plan = {"transformer.h.*.mlp.c_fc": ColwiseParallelInOut()}
    """

    def __init__(self, *, sizes: tuple[int, ...] | None = None, **kwargs):
        super().__init__(**kwargs)
        self.sizes = tuple(int(s) for s in sizes) if sizes else None

    def _partition_in_out_fn(self, name, module, device_mesh):
        order = packed_row_order(self.sizes, device_mesh.size()) if self.sizes else None
        for pname, param in list(module.named_parameters(recurse=False)):
            dim = param.ndim - 1  # the out features: weight (in, out) dim 1, bias (out,) dim 0
            with torch.no_grad():
                value = param if order is None else param.index_select(dim, order.to(param.device))
            dist = distribute_tensor(value, device_mesh, [Shard(dim)], src_data_rank=self.src_data_rank)
            new = nn.Parameter(dist, requires_grad=param.requires_grad)
            if order is not None:
                new._autotp_to_layout = partial(_permute_rows, dim=dim, order=order)
            module.register_parameter(pname, new)

    def sharded_param_dims(self, module: nn.Module) -> dict[str, int]:
        return {n: p.ndim - 1 for n, p in module.named_parameters(recurse=False)}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        return distribute_module(
            module, device_mesh, self._partition_in_out_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + (f", sizes={self.sizes})" if self.sizes else ")")


class RowwiseParallelInOut(RowwiseParallel):
    """:class:`RowwiseParallel` for a Linear-like module whose weight is stored ``(in, out)``: the
    weight is sharded on dim 0 (the contracted input features), the bias kept whole.

    Example::
        >>> plan = {"transformer.h.*.mlp.c_proj": RowwiseParallelInOut()}
    """

    def _partition_in_out_fn(self, name, module, device_mesh):
        for pname, param in list(module.named_parameters(recurse=False)):
            placement = Shard(0) if param.ndim == 2 else Replicate()
            dist = distribute_tensor(param, device_mesh, [placement], src_data_rank=self.src_data_rank)
            module.register_parameter(pname, nn.Parameter(dist, requires_grad=param.requires_grad))

    def sharded_param_dims(self, module: nn.Module) -> dict[str, int]:
        return {n: 0 for n, p in module.named_parameters(recurse=False) if p.ndim == 2}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        self.desired_input_layouts = (Shard(-1),)
        return distribute_module(
            module, device_mesh, self._partition_in_out_fn,
            partial(self._prepare_input_fn, self.input_layouts, self.desired_input_layouts),
            partial(self._prepare_output_fn, self.output_layouts, self.use_local_output),
        )


class ShardCounts(ParallelStyle):
    """Divide integer attributes of a module (head counts) by the tp size.

    Attention code that slices a fused projection with sizes computed from its head counts
    (``qkv[..., : num_heads * head_dim]``) reads global counts while holding a local shard. After
    this style, the module sees per-rank counts, as gpt-fast's ``tp.py`` does by hand. A dotted name
    (``"config.num_attention_heads"``) changes a private shallow copy of the sub-object, so the
    model's shared config keeps the global numbers.

    Keyword Args:
        names (tuple[str, ...]): attribute paths relative to the module.

    Example::
        >>> plan = {"model.layers.*.self_attn": ShardCounts(names=("num_key_value_heads",))}
    """

    def __init__(self, *, names: tuple[str, ...]):
        super().__init__()
        self.names = tuple(names)

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        tp = device_mesh.size()
        copied: set[str] = set()
        for name in self.names:
            *path, attr = name.split(".")
            owner = module
            for i, part in enumerate(path):
                child_path = ".".join(path[: i + 1])
                if child_path not in copied:
                    setattr(owner, part, copy.copy(getattr(owner, part)))
                    copied.add(child_path)
                owner = getattr(owner, part)
            value = getattr(owner, attr)
            if value % tp:
                from autotp.errors import MeshError

                raise MeshError(f"{type(module).__name__}.{name}={value} cannot be split over tp={tp}")
            setattr(owner, attr, value // tp)
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(names={self.names})"


def _expand_kv_rows(tensor: torch.Tensor, kv_heads: int, head_dim: int, tp_size: int) -> torch.Tensor:
    """Repeat each kv head's rows ``tp / kv_heads`` times: row block r is the head rank r reads.

    >>> _expand_kv_rows(torch.arange(4.0), kv_heads=2, head_dim=2, tp_size=4).tolist()
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

    Keyword Args:
        kv_heads (int): number of kv heads of the projection.
        head_dim (int): size of one head.

    Example::
        >>> plan = {"model.layers.*.self_attn.k_proj": ReplicatedKVColwise(kv_heads=2, head_dim=128)}
    """

    def __init__(self, *, kv_heads: int, head_dim: int, **kwargs):
        super().__init__(**kwargs)
        self.kv_heads = kv_heads
        self.head_dim = head_dim

    def _partition_linear_fn(self, name, module, device_mesh):
        tp = device_mesh.size()
        if tp % self.kv_heads:
            from autotp.errors import MeshError

            raise MeshError(
                f"{type(module).__name__}: tp={tp} is not a multiple of kv_heads={self.kv_heads}; "
                "each kv head must be shared by the same number of ranks."
            )
        for pname, param in list(module.named_parameters(recurse=False)):
            with torch.no_grad():
                expanded = _expand_kv_rows(param, self.kv_heads, self.head_dim, tp)
            new = nn.Parameter(distribute_tensor(expanded, device_mesh, [Shard(0)]), requires_grad=param.requires_grad)
            new._autotp_to_layout = partial(_expand_kv_rows, kv_heads=self.kv_heads, head_dim=self.head_dim, tp_size=tp)
            new.register_hook(partial(_sum_kv_copies, kv_heads=self.kv_heads, head_dim=self.head_dim))
            module.register_parameter(pname, new)

    def __repr__(self) -> str:
        return super().__repr__()[:-1] + f", kv_heads={self.kv_heads}, head_dim={self.head_dim})"


def _sum_kv_copies(grad: DTensor, *, kv_heads: int, head_dim: int) -> DTensor:
    """Give every copy of a kv head the sum of all copies' gradients.

    The result is placed like the parameter (``Shard(0)``), not like ``grad``: depending on the
    sharding strategy DTensor picks for the projection's backward, ``grad`` may arrive ``Partial``,
    and a replicated tensor cannot be redistributed back to a pending sum.
    """
    tp = grad.device_mesh.size()
    full = grad.redistribute(placements=[Replicate()]).to_local()
    per_head = full.reshape(kv_heads, tp // kv_heads, head_dim, *full.shape[1:]).sum(dim=1)
    summed = _expand_kv_rows(per_head.reshape(kv_heads * head_dim, *full.shape[1:]), kv_heads, head_dim, tp)
    return DTensor.from_local(summed, grad.device_mesh, [Replicate()], run_check=False).redistribute(
        placements=[Shard(0)]
    )


class KVHeadCounts(ParallelStyle):
    """Set an attention module's grouped-query ratio for the heads one rank holds.

    When tp exceeds the kv heads, a rank holds ``heads / tp`` query heads and one kv head, so its
    local ratio is ``heads / tp``, not the global ``heads / kv_heads``; code that repeats kv heads
    by the stored ratio (``num_key_value_groups`` in transformers) must see the local one.

    Keyword Args:
        heads (int): query heads of the module.
        attribute (str): the ratio attribute. Default: ``"num_key_value_groups"``.
    """

    def __init__(self, *, heads: int, attribute: str = "num_key_value_groups"):
        super().__init__()
        self.heads = heads
        self.attribute = attribute

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        setattr(module, self.attribute, self.heads // device_mesh.size())
        return module

    def __repr__(self) -> str:
        return f"{self.__class__.__name__}(heads={self.heads}, attribute={self.attribute!r})"
