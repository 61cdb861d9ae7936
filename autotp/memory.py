"""Parameter memory per tensor-parallel rank, read off a plan without sharding anything.

Works on a meta model: only shapes and dtypes are used, so a 70B model is accounted in
milliseconds. Which dimension a style shards comes from :func:`autotp.plan.sharded_param_dims`,
the same table :mod:`autotp.apply` checks divisibility with.
"""

from __future__ import annotations

import math

import torch
from torch import nn

from autotp.hf_plans import as_styles
from autotp.plan import Plan, resolve, sharded_param_dims


def param_bytes_per_rank(model: nn.Module, plan: Plan, tp_size: int) -> tuple[int, int]:
    """Bytes of parameters one rank holds under ``plan`` at ``tp_size``, and the unsharded total.

    A parameter sharded on a dimension of size ``n`` costs ``ceil(n / tp_size)`` slices on the
    largest rank (DTensor gives the remainder to the first ranks); every other parameter is
    replicated. Tied parameters count once.

    Args:
        model: the model, typically on the meta device.
        plan: ``{fnmatch pattern: ParallelStyle}``, matched like ``parallelize_module`` does
            (transformers' style strings are translated first).
        tp_size: the tensor-parallel degree.

    Returns:
        ``(per_rank_bytes, total_bytes)``.

    Raises:
        PlanError: a plan key matches no module, or two keys give one module different styles.

    >>> from torch.distributed.tensor.parallel import ColwiseParallel
    >>> two = nn.Sequential(nn.Linear(4, 8, bias=False), nn.Linear(8, 4, bias=False))
    >>> param_bytes_per_rank(two, {"0": ColwiseParallel()}, 2)
    (192, 256)
    """

    plan = as_styles(model, plan)
    shard_dims = _shard_dims_by_param(model, plan)
    expanded = _expanded_sizes(model, plan, tp_size)
    per_rank = total = 0
    for param in model.parameters():  # yields each tied parameter once
        nbytes = param.numel() * param.element_size()
        total += nbytes
        dim = shard_dims.get(id(param))
        if dim is None or param.numel() == 0:
            per_rank += nbytes
        else:
            size = param.shape[dim]
            per_rank += nbytes // size * math.ceil(expanded.get(id(param), size) / tp_size)
    return per_rank, total


def _expanded_sizes(model: nn.Module, plan: Plan, tp_size: int) -> dict[int, int]:
    """``{id(parameter): size of its dim 0 after expansion}`` for the parameters a
    :class:`~autotp.styles.GroupCopies` copies per group before it shards them."""
    modules = dict(model.named_modules())
    found = {}
    for fqn, (_, style) in resolve(model, plan).items():
        sizes = getattr(style, "expanded_sizes", None)
        params = dict(modules[fqn].named_parameters())
        for path, size in (sizes(tp_size) if sizes is not None else {}).items():
            if path in params:
                found[id(params[path])] = size
    return found


def _shard_dims_by_param(model: nn.Module, plan: Plan) -> dict[int, int]:
    """``{id(parameter): sharded dim}`` for every parameter the plan shards."""
    modules = dict(model.named_modules())
    dims: dict[int, int] = {}
    for fqn, (_, style) in resolve(model, plan).items():
        module = modules[fqn]
        for pname, dim in sharded_param_dims(module, style).items():
            param = dict(module.named_parameters()).get(pname)  # dotted: a child's, read by this module
            if isinstance(param, torch.Tensor):
                dims.setdefault(id(param), dim % param.ndim)
    return dims


def format_bytes(n: int) -> str:
    """Bytes in binary units, as a person reads them.

    >>> format_bytes(3 * 2**30 // 2)
    '1.50 GiB'
    """
    for unit, size in (("TiB", 2**40), ("GiB", 2**30), ("MiB", 2**20), ("KiB", 2**10)):
        if n >= size:
            return f"{n / size:.2f} {unit}"
    return f"{n} B"
