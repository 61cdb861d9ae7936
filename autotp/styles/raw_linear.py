"""A style for raw ``nn.Parameter`` weights that a module's own code uses as Linears.

``x @ self.wq.T``, ``F.linear(x, self.wk)``, ``x @ self.w_in_out`` or ``torch.einsum("btd,fd->btf",
x, self.w)`` are Linears in all but name: ``ColwiseParallel`` / ``RowwiseParallel`` cannot be applied
to the module that owns them (it is no ``nn.Linear``), and one module may own column and row weights
at once (an attention with ``wq``, ``wk``, ``wv`` and ``wo``). :class:`~autotp.styles.HeadParams` with
``columns`` / ``rows`` shards each weight
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

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.overrides import TorchFunctionMode
from torch.utils._pytree import tree_map

from autotp.errors import PlanError
from autotp.styles.base import all_reduce_backward, all_reduce_forward

# Calls that multiply an activation by a weight.
_PRODUCTS = frozenset({F.linear, torch.matmul, torch.Tensor.matmul, torch.Tensor.__matmul__, torch.Tensor.__rmatmul__,
                       torch.mm, torch.Tensor.mm, torch.einsum, torch.bmm, torch.Tensor.bmm})

# Calls on a weight that return the same matrix (a transpose, a view, a cast: ``self.w.T``,
# ``self.w.type_as(x)``), by name (``Tensor.T`` is a property: its getter is ``__get__``).
_SAME_WEIGHT = frozenset({"t", "transpose", "permute", "__get__", "to", "type_as", "float", "half", "bfloat16",
                          "contiguous", "clone", "detach", "view", "reshape", "numpy_T"})


class _Products(TorchFunctionMode):
    """Adds the reductions of raw column / row weights (``HeadParams(columns=..., rows=...)``) around every product by one of its weights."""

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
                        "same HeadParams module; shard at most one of them")


def _owner(module: nn.Module, name: str) -> nn.Module | None:
    """The module holding parameter ``name`` of ``module`` (dotted: a child's), or None."""
    path, _, leaf = name.rpartition(".")
    try:
        owner = module.get_submodule(path) if path else module
    except AttributeError:
        return None
    return owner if leaf in owner._parameters else None


def add_products(module: nn.Module, style, device_mesh: DeviceMesh) -> None:
    """Hooks on ``module`` that enter :class:`_Products` for ``style``'s ``columns`` and ``rows``
    during each forward, after the style's own pre-hook has swapped in the local tensors."""
    modes = []

    def pre_hook(mod, args, kwargs):
        local = lambda name: _owner(mod, name)._parameters[name.rpartition(".")[2]]  # noqa: E731
        kinds = {id(local(n)): "column" for n in style.columns}
        kinds.update({id(local(n)): "row" for n in style.rows})
        own = {id(p) for p in mod._parameters.values() if p is not None} | {id(local(n)) for n in style.shard_dims}
        modes.append(_Products(kinds, own, device_mesh))
        modes[-1].__enter__()

    def post_hook(mod, args, kwargs, output):
        modes.pop().__exit__(None, None, None)

    module.register_forward_pre_hook(pre_hook, with_kwargs=True)
    module.register_forward_hook(post_hook, with_kwargs=True, always_call=True)


def missing_weights(module: nn.Module, names) -> set[str]:
    """The names among ``names`` that are no parameter of ``module`` (dotted: of a child)."""
    return {n for n in names if _owner(module, n) is None}
