"""Deep copies of models whose plain attributes hold closures over the model.

``copy.deepcopy`` copies a function as itself. A model that keeps a lambda or a nested function as
a plain attribute (x-transformers' tied head ``self.to_logits = lambda t: t @ self.token_emb.weight.t()``,
a closure over a raw output weight) then has a copy whose head still reads the original's
parameters: a sharded copy computes its logits from the unsharded weight, and the backward of a
verification run writes gradients into the user's model. :func:`deep_copy` gives such a function
the copied objects in place of the originals it closes over.
"""

from __future__ import annotations

import copy
import types

from torch import nn


def deep_copy(module: nn.Module, memo: dict | None = None) -> nn.Module:
    """``copy.deepcopy(module, memo)``, with the functions held as module attributes rebound to the copy.

    A function (a lambda or a nested ``def``) kept in a module's ``__dict__`` whose closure or
    defaults hold objects that were copied (the module, a parameter, a submodule) is replaced, in
    the copy, by the same code closing over their copies. Objects not copied are shared, as
    ``deepcopy`` shares the function itself.

    >>> class Tied(nn.Module):
    ...     def __init__(self):
    ...         super().__init__()
    ...         self.embed = nn.Embedding(4, 2)
    ...         self.head = lambda h: h @ self.embed.weight.t()
    >>> model = Tied()
    >>> twin = deep_copy(model)
    >>> twin.head.__closure__[0].cell_contents is twin
    True
    """
    memo = {} if memo is None else memo
    out = copy.deepcopy(module, memo)
    for sub in out.modules():
        for name, value in list(vars(sub).items()):
            if isinstance(value, types.FunctionType):
                sub.__dict__[name] = _rebound(value, memo, set())
    return out


def _rebound(fn: types.FunctionType, memo: dict, seen: set[int]) -> types.FunctionType:
    """``fn`` closing over (and defaulting to) the copies in ``memo`` of what it holds; ``fn`` itself
    if it holds nothing copied. A function it closes over is rebound the same way."""
    if id(fn) in seen:
        return fn
    seen.add(id(fn))

    changed = False

    def swap(value):
        nonlocal changed
        new = _rebound(value, memo, seen) if isinstance(value, types.FunctionType) else memo.get(id(value), value)
        changed = changed or new is not value
        return new

    cells = []
    for cell in fn.__closure__ or ():
        try:
            contents = cell.cell_contents
        except ValueError:  # a cell not filled yet (a name assigned after the def)
            cells.append(cell)
            continue
        new = swap(contents)
        cells.append(cell if new is contents else types.CellType(new))
    defaults = tuple(swap(v) for v in fn.__defaults__) if fn.__defaults__ else fn.__defaults__
    if not changed:
        return fn
    closure = tuple(cells) if fn.__closure__ else None
    rebound = types.FunctionType(fn.__code__, fn.__globals__, fn.__name__, defaults, closure)
    rebound.__kwdefaults__ = fn.__kwdefaults__
    rebound.__qualname__, rebound.__doc__, rebound.__module__ = fn.__qualname__, fn.__doc__, fn.__module__
    rebound.__dict__.update(fn.__dict__)
    return rebound
