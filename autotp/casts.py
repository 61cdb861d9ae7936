"""Find a model's casts to low precision, and run it with those casts made exact.

A float32 model that computes part of its forward in bfloat16 or float16 (experts that run their
matmuls in bf16, a ``torch.autocast`` region, ``x.half()`` before an attention kernel) differs from
itself sharded by the low-precision rounding of each rank's partial result: a correct plan sums
bf16-rounded partials in another order than the unsharded model rounds the whole, and the
difference is ~1e-3 relative, a hundred times the verifier's tolerance. A float64 re-run does not
remove it (the casts still round to bf16), so without this module the verifier cannot tell such
rounding from a wrong plan.

:class:`LowPrecisionCasts` watches the ops that produce a low-precision floating tensor from a
dtype argument (``aten._to_copy``, what ``Tensor.to`` / ``.bfloat16()`` / ``.half()`` / autocast
become at dispatch, and factories such as ``torch.zeros(..., dtype=torch.bfloat16)``), counts them
and, when asked, replaces the dtype with the model's own: the model then runs the same code at its
own precision, where a correct plan agrees to fp32 rounding and a wrong one does not.

It is a ``TorchDispatchMode``: below autograd (a cast made exact gets an exact backward) and below
DTensor's desugaring, so the same mode works on the unsharded reference and on the sharded model
under the simulator's ``LocalTensorMode`` (entered inside it, it sees each DTensor op once).
"""

from __future__ import annotations

from collections import Counter

import torch
from torch.utils._python_dispatch import TorchDispatchMode

LOW_PRECISION = frozenset({torch.bfloat16, torch.float16})
# Ops whose dtype argument reinterprets bits (``x.view(torch.bfloat16)``): not a rounding, never changed.
_BITCASTS = frozenset({"view.dtype"})


class LowPrecisionCasts(TorchDispatchMode):
    """Count the ops that make a bf16 / fp16 tensor from a dtype argument; with ``exact_dtype``,
    give them that dtype instead (the model's float32 or float64).

    ``counts`` maps a dtype's short name to how many such ops ran (``{"bfloat16": 12}``), once per
    op as the model asks for it (an op on a DTensor counts once, not once per rank).
    """

    def __init__(self, exact_dtype: torch.dtype | None = None):
        super().__init__()
        self.exact_dtype = exact_dtype
        self.counts: Counter[str] = Counter()

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **kwargs)
        low = kwargs.get("dtype")
        if low in LOW_PRECISION and _overload_name(func) not in _BITCASTS:
            self.counts[_short(low)] += 1
            if self.exact_dtype is not None:
                kwargs = {**kwargs, "dtype": self.exact_dtype}
        return func(*args, **kwargs)



def casts_text(counts: dict[str, int]) -> str:
    """How many casts of each dtype, in words.

    >>> casts_text({"bfloat16": 10})
    '10 bfloat16 casts'
    >>> casts_text({"float16": 1, "bfloat16": 2})
    '2 bfloat16 and 1 float16 casts'
    """
    if not counts:
        return "no low-precision casts"
    parts = [f"{n} {name}" for name, n in sorted(counts.items())]
    return f"{' and '.join(parts)} cast{'s' if sum(counts.values()) != 1 else ''}"


def _overload_name(func) -> str:
    schema = func._schema
    name = schema.name.split("::")[-1]
    return f"{name}.{schema.overload_name}" if schema.overload_name else name


def _short(dtype: torch.dtype) -> str:
    return str(dtype).removeprefix("torch.")
