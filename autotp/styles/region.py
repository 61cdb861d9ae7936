"""A module run on DTensors: its own code, global shapes, DTensor's redistributions."""

from __future__ import annotations

import weakref

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor.experimental import implicit_replication
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_leaves, tree_map

from autotp.errors import PlanError
from autotp.plan import sharded_param_dims
from autotp.styles.base import WrapperStyle, identity_dropout, is_partial


class DTensorRegion(WrapperStyle):
    """Run a module's forward on DTensors, with some of its Linears' weights sharded.

    Where a module's code cannot run on per-rank tensors (it sums its heads' scores by a ``matmul``
    over the heads before a top-k, it reshapes by a literal group count), it can still run on
    DTensors: every shape it sees is the global one, and DTensor inserts the one communication its
    ops need (a ``Partial()`` sum all-reduced where a top-k or a mask meets it: before any function
    not linear in it, as a Megatron row reduces). Parameters named in
    ``params`` are sharded on the given dim (``"wq.weight": 0`` a column, ``"wo.weight": 1`` a
    row), every other parameter of the module and its children is a ``Replicate()`` DTensor.

    Inputs that arrive as plain tensors become ``Replicate()`` DTensors (their gradient, partial
    where sharded code read them, is all-reduced on the way back: ``DTensor.from_local``'s
    backward); inputs that arrive as DTensors are taken as they are; plain tensors made inside the
    forward or read from buffers (``torch.arange``, a per-channel curve) become ``Replicate()``
    DTensors where a function reads them beside a DTensor, so that autograd saves DTensors for the
    backward, which runs outside the module and could not mix the two. Outputs go back as plain tensors:
    ``Replicate()`` as is, ``Partial()`` all-reduced; a ``Shard``-ed output (attention weights
    nobody reads) stays a DTensor, so that code reading it gets the right values or a clear error,
    never a shard taken for the whole. With ``partial_outputs`` a ``Partial()`` output stays a
    ``Partial()`` DTensor: one branch of a parallel block, added to the other branch's partial sum
    before one reduction (as :class:`~autotp.styles.Rowwise` with ``output_layouts=Partial()`` leaves a row's); its whole outputs then
    stay ``Replicate()`` DTensors. Each parameter's gradient comes back in the parameter's
    placement (DTensor's gradient accumulation redistributes a replicated weight's partial one).

    Keyword Args:
        params: parameter name (relative to the module, dotted) -> sharded dim.
        replicated_outputs (bool): hand whole outputs on as ``Replicate()`` DTensors, not plain tensors
            (under sequence parallel, for the sequence-sharded stream to meet). Default: False.
        partial_outputs (bool): hand ``Partial()`` outputs on unreduced, as ``Partial()`` DTensors.
            Default: False.
        style (ParallelStyle, optional): the module's own style, applied first (a gather of its
            sequence-sharded inputs at entry): its input hooks run before this style's, its output
            hooks after.

    Example::
        >>> plan = {"model.layers.*.self_attn.indexer": DTensorRegion(params={"wq_b.weight": 0, "proj.weight": 0})}
    """

    def __init__(self, *, params: dict[str, int], replicated_outputs: bool = False, partial_outputs: bool = False,
                 style: ParallelStyle | None = None):
        super().__init__()
        self.params = dict(params)
        self.replicated_outputs = replicated_outputs
        self.partial_outputs = partial_outputs
        self.style = style

    def sharded_param_dims(self, module: nn.Module) -> dict[str, int]:
        # Dotted names are descendants' parameters, which this style places (memory, divisibility).

        inner = sharded_param_dims(module, self.style) if self.style is not None else {}
        return {**inner, **self.params}

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        module = self._apply_wrapped(module, device_mesh)
        unknown = set(self.params) - {name for name, _ in module.named_parameters()}
        if unknown:
            raise PlanError(f"{type(module).__name__}: DTensorRegion names parameters it does not have: "
                            f"{sorted(unknown)}; name them relative to the module the plan key selects.")
        for name, param in list(module.named_parameters()):
            if isinstance(param, DTensor):
                continue  # a child's own style placed it
            owner_name, _, leaf = name.rpartition(".")
            owner = module.get_submodule(owner_name) if owner_name else module
            placement = Shard(self.params[name]) if name in self.params else Replicate()
            owner.register_parameter(leaf, nn.Parameter(distribute_tensor(param.detach(), device_mesh, [placement]),
                                                        requires_grad=param.requires_grad))
        contexts = []

        def wrap(x):
            if isinstance(x, torch.Tensor) and not isinstance(x, DTensor):
                return DTensor.from_local(x, device_mesh, [Replicate()], run_check=False)
            return x

        def enter(mod, args, kwargs):
            contexts.append((implicit_replication(), _ReduceBeforeNonlinear()))
            for context in contexts[-1]:
                context.__enter__()
            return tree_map(wrap, args), tree_map(wrap, kwargs)

        def leave(mod, args, kwargs, output):
            for context in reversed(contexts.pop()):
                context.__exit__(None, None, None)
            # A branch of a parallel block meets the other's DTensor: its whole outputs stay DTensors too.
            convert = _replicated if self.replicated_outputs or self.partial_outputs else _plain
            return tree_map(lambda x: x if self.partial_outputs and is_partial(x) else convert(x), output)

        module.register_forward_pre_hook(enter, with_kwargs=True)
        module.register_forward_hook(leave, with_kwargs=True, prepend=True, always_call=True)
        return module

    def __repr__(self) -> str:
        inner = ", replicated_outputs=True" if self.replicated_outputs else ""
        inner += ", partial_outputs=True" if self.partial_outputs else ""
        inner += f", style={self.style!r}" if self.style is not None else ""
        return f"{self.__class__.__name__}(params={self.params!r}{inner})"


# Torch functions linear in a ``Partial()`` operand (and reads of metadata): a partial sum passes
# through them; before any other function it is all-reduced, where a Megatron row reduces. DTensor
# alone would be right too, but might reduce-scatter a sum onto the batch for a ``topk`` and hand
# the module's output on sharded. (``autotp.synth.regions.PARTIAL_LINEAR`` is the same list in aten
# names, for the metadata run that plans the region.)
_PARTIAL_LINEAR = frozenset({
    "__add__", "__radd__", "__iadd__", "add", "__sub__", "__rsub__", "sub", "__mul__", "__rmul__", "mul",
    "__truediv__", "div", "__neg__", "neg", "view", "reshape", "unsqueeze", "squeeze", "expand", "expand_as",
    "transpose", "permute", "t", "matmul", "__matmul__", "bmm", "mm", "sum", "mean", "clone", "contiguous", "float",
    "double", "half", "bfloat16", "to", "type_as", "flatten", "__getitem__", "split", "chunk", "cat", "stack",
    "linear", "einsum", "__get__", "size", "dim", "numel", "stride", "is_contiguous", "redistribute", "to_local",
    "full_tensor", "__format__", "__repr__",
})


class _ReduceBeforeNonlinear(TorchFunctionMode):
    """All-reduce each ``Partial()`` operand of a function not linear in it, once: a partial sum the
    code reads again (``x.topk(...)``, then ``torch.full_like(x, ...)``) reuses its reduced value.
    A plain tensor read beside a DTensor is made a ``Replicate()`` one: ``implicit_replication``
    would do so at dispatch, but autograd would save the plain tensor, and the backward (outside
    the mode) would meet it mixed with DTensor gradients."""

    def __init__(self):
        super().__init__()
        self.reduced: dict[int, tuple[weakref.ref, DTensor]] = {}

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        name = getattr(func, "__name__", "")
        mesh = next((x.device_mesh for x in tree_leaves((args, kwargs)) if isinstance(x, DTensor)), None)
        if mesh is not None:
            args, kwargs = tree_map(lambda x: _replicate_plain(x, mesh), (args, kwargs))
        if name not in _PARTIAL_LINEAR and not identity_dropout(name, args, kwargs):
            args, kwargs = tree_map(self._whole, args), tree_map(self._whole, kwargs)
        elif name == "reshape" and args and isinstance(args[0], DTensor) and not args[0].to_local().is_contiguous():
            # DTensor turns a reshape its sharding allows into a view of the local tensor, which a
            # transposed shard cannot take: copy it contiguous first, as reshape itself would.
            args = (args[0].contiguous() if args[0].is_contiguous() is False else torch.clone(
                args[0], memory_format=torch.contiguous_format), *args[1:])
        return func(*args, **kwargs)

    def _whole(self, x):
        if not isinstance(x, DTensor) or not any(p.is_partial() for p in x.placements):
            return x
        held = self.reduced.get(id(x))
        if held is not None and held[0]() is x:
            return held[1]
        whole = x.redistribute(placements=[Replicate()] * x.device_mesh.ndim)
        self.reduced[id(x)] = (weakref.ref(x), whole)
        return whole


def _replicate_plain(x, mesh: DeviceMesh):
    if not isinstance(x, torch.Tensor) or isinstance(x, DTensor):
        return x
    return DTensor.from_local(x, mesh, [Replicate()] * mesh.ndim, run_check=False)


def _plain(x):
    """An output of the region: a plain tensor where the value is whole on every rank."""
    if not isinstance(x, DTensor) or any(p.is_shard() for p in x.placements):
        return x
    return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim).to_local()


def _replicated(x):
    """An output of the region as a ``Replicate()`` DTensor where the value is whole on every rank."""
    if not isinstance(x, DTensor) or any(p.is_shard() for p in x.placements):
        return x
    return x.redistribute(placements=[Replicate()] * x.device_mesh.ndim)


