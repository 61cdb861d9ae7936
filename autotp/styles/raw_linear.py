"""A style for raw ``nn.Parameter`` weights that a module's own code uses as Linears.

``x @ self.wq.T``, ``F.linear(x, self.wk)``, ``x @ self.w_in_out`` or ``torch.einsum("btd,fd->btf",
x, self.w)`` are Linears in all but name: ``ColwiseParallel`` / ``RowwiseParallel`` cannot be applied
to the module that owns them (it is no ``nn.Linear``), and one module may own column and row weights
at once (an attention with ``wq``, ``wk``, ``wv`` and ``wo``). :class:`LinearParams` shards each weight
the way its Linear style would, runs the module on local tensors, and adds the two reductions those
styles add, exactly where each product happens:

- a column weight (output features sharded) reads a replicated input: each rank's input gradient
  covers only its features, so the input is all-reduced in backward (``ColwiseParallel``'s
  ``Replicate`` input layout does the same);
- a row weight (input features sharded) gives a partial sum, all-reduced in forward before its bias
  (added once) and before anything else reads it (``RowwiseParallel``'s ``Partial`` output).

The products are found by a ``TorchFunctionMode`` active during the module's forward: a call that
reads one of the weights (or a transpose, view or cast of it) is a product when it is one of
:data:`_PRODUCTS`; other calls on a weight are followed, so that ``self.wq.T`` stays a column weight.
"""

from __future__ import annotations

from dataclasses import replace

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from autotp.errors import PlanError
from autotp.styles.base import all_reduce_backward, all_reduce_forward, to_local
from autotp.styles.declared import Shards
from autotp.styles.params import HeadParams

__all__ = ["LinearParams"]

# Calls that multiply an activation by a weight.
_PRODUCTS = frozenset({F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
                       torch.mm, torch.Tensor.mm, torch.einsum, torch.bmm, torch.Tensor.bmm})

# Calls on a weight that return the same matrix (a transpose, a view, a cast: ``self.w.T``,
# ``self.w.type_as(x)``), by name (``Tensor.T`` is a property: its getter is ``__get__``).
_SAME_WEIGHT = frozenset({"t", "transpose", "permute", "__get__", "to", "type_as", "float", "half", "bfloat16",
                          "contiguous", "clone", "detach", "view", "reshape", "numpy_T"})


class _Products(TorchFunctionMode):
    """Adds the reductions of :class:`LinearParams` around every product by one of its weights."""

    def __init__(self, kinds: dict[int, str], own: set[int], mesh: DeviceMesh):
        super().__init__()
        self.kinds, self.own, self.mesh, self.keep = kinds, own, mesh, []

    def _kind(self, value) -> str | None:
        return self.kinds.get(id(value)) if isinstance(value, torch.Tensor) else None

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        found = set()
        tree_map(lambda v: found.add(self._kind(v)), (args, kwargs))
        found.discard(None)
        if not found:
            return func(*args, **kwargs)
        if func not in _PRODUCTS:
            out = func(*args, **kwargs)
            kind = self._kind(args[0]) if args else None
            if kind is not None and getattr(func, "__name__", "") in _SAME_WEIGHT and isinstance(out, torch.Tensor):
                self.kinds[id(out)] = kind
                self.keep.append(out)  # keep it alive: its id must not be reused during the forward
            return out
        if found == {"column"}:
            # The replicated input's gradient is partial on each rank: all-reduce it in backward.
            wrap = lambda v: all_reduce_backward(v, self.mesh) if isinstance(v, torch.Tensor) and v.is_floating_point() \
                and self._kind(v) is None and id(v) not in self.own else v  # noqa: E731
            return func(*tree_map(wrap, args), **tree_map(wrap, kwargs))
        if found == {"row"}:
            bias = kwargs.pop("bias", None) if func is F.linear else None
            if func is F.linear and len(args) > 2:
                args, bias = args[:2], args[2]
            out = all_reduce_forward(func(*args, **kwargs), self.mesh)
            return out if bias is None else out + bias

        raise PlanError(f"{getattr(func, '__name__', func)} multiplies a column weight by a row weight of the "
                        "same LinearParams module; shard at most one of them")


def _owner(module: nn.Module, name: str) -> nn.Module | None:
    """The module holding parameter ``name`` of ``module`` (dotted: a child's), or None."""
    path, _, leaf = name.rpartition(".")
    try:
        owner = module.get_submodule(path) if path else module
    except AttributeError:
        return None
    return owner if leaf in owner._parameters else None


class LinearParams(HeadParams):
    """Shard raw parameters a module uses as Linear weights; reduce around their products.

    Its other options are :class:`~autotp.styles.HeadParams`'s (per-head parameters beside
    the weights, head counts divided by tp).

    Keyword Args:
        shard_dims (dict[str, int]): parameter name -> its sharded dim: the output-features dim of a
            column weight (0 for ``(out, in)``, 1 for ``(in, out)``), the input-features dim of a
            row weight, dim 0 of a column's bias (or of another parameter sharded with the features).
        columns (tuple[str, ...]): the column weights among them.
        rows (tuple[str, ...]): the row weights among them.
        seq_output (bool): the (reduced, whole) output goes back to a sequence-sharded stream: each
            rank keeps its ``Shard(1)`` slice. A sequence-sharded input is gathered whole in any case,
            and Linears inside the module then read it whole and all-reduce (the synthesizer gives
            them no sequence layouts).

    A dotted name (``"up.weight"``) is a child's parameter this module's own code multiplies by
    (``self.up.weight @ x``, the child's forward never called), handed over as for HeadParams.

    Example::
        >>> plan = {"layers.*.attn": LinearParams(shard_dims={"wq": 0, "wo": 1}, columns=("wq",), rows=("wo",))}
    """

    def __init__(self, *, shard_dims: dict[str, int], columns: tuple[str, ...] = (), rows: tuple[str, ...] = (),
                 seq_output: bool = False, **head_params):
        super().__init__(shard_dims=shard_dims, **head_params)
        self.columns, self.rows, self.seq_output = tuple(columns), tuple(rows), seq_output

    def _prepare_inputs(self, args, kwargs, device_mesh):
        # A sequence-sharded stream is gathered whole: the module's code reads every position.
        local = lambda v: to_local(v) if isinstance(v, DTensor) else v  # noqa: E731
        return tree_map(local, args), tree_map(local, kwargs)

    def _prepare_output(self, output, device_mesh):
        # Back to the sequence-sharded stream: each rank keeps its positions of the reduced output.
        if not self.seq_output or not isinstance(output, torch.Tensor) or isinstance(output, DTensor):
            return output
        return DTensor.from_local(output, device_mesh, [Replicate()], run_check=False).redistribute(
            placements=[Shard(1)])

    def _apply(self, module: nn.Module, device_mesh: DeviceMesh) -> nn.Module:
        missing = {n for n in set(self.shard_dims) | set(self.columns) | set(self.rows) if _owner(module, n) is None}
        if missing:
            raise PlanError(f"{type(module).__name__}: LinearParams names {sorted(missing)}, which the module does "
                            f"not own (it has {sorted(module._parameters)}); fix the names")
        super()._apply(module, device_mesh)  # its pre-hook, run first, swaps in the local tensors
        modes = []

        def pre_hook(mod, args, kwargs):
            local = lambda name: _owner(mod, name)._parameters[name.rpartition(".")[2]]  # noqa: E731
            kinds = {id(local(n)): "column" for n in self.columns}
            kinds.update({id(local(n)): "row" for n in self.rows})
            own = {id(p) for p in mod._parameters.values() if p is not None} | {id(local(n)) for n in self.shard_dims}
            modes.append(_Products(kinds, own, device_mesh))
            modes[-1].__enter__()

        def post_hook(mod, args, kwargs, output):
            modes.pop().__exit__(None, None, None)

        module.register_forward_pre_hook(pre_hook, with_kwargs=True)
        module.register_forward_hook(post_hook, with_kwargs=True, always_call=True)
        return module

    def __repr__(self) -> str:
        return f"{super().__repr__()[:-1]}, columns={self.columns!r}, rows={self.rows!r}, seq_output={self.seq_output})"

    def declares(self) -> Shards:
        """Per-head parameters, and the raw weights it multiplies like a Linear's, by role."""
        return replace(super().declares(), raw_linear=(self.columns, self.rows))
