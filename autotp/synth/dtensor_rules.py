"""The fallback for ops outside autotp's rule table: DTensor's own sharding rules, asked on metadata.

An op that :data:`~autotp.synth.ops.RULES` does not describe used to stop the shard. torch ships a
sharding strategy for most aten ops; here that strategy is asked, on shapes alone (meta tensor
metadata, a device mesh with no process group), what the op does to the node's inputs: the sharded
ones ``Shard(dim)``, every other tensor ``Replicate()``. The op keeps the shard when the strategy
takes those placements as they are (no redistribution of any input, not even a local slice of a
replicated one, which autotp's plain per-rank tensors would not do) and returns each tensor output
``Shard``-ed. Each rank then runs the op on its local shard, as the plan's per-rank code does, and
gets the local shard of the global result. The overload asked is the one that takes the traced
arguments (as meta tensors) and returns the traced shape, ``.default`` first.

Refused (the shard stops, as before): ops with no strategy, ops whose size arguments DTensor rewrites
into per-rank sizes (``new_zeros``, ``expand``: the model's code passes global ones), a replicated
input whose gradient would stay a per-rank share (:meth:`~autotp.synth.flow.Flow.broadcast_grad_ok`),
outputs ``Replicate`` or ``Partial``, and any call the metadata cannot describe. Tensors are
described as float32 (the other inputs as int64 where float32 is refused: an index).
"""

from __future__ import annotations

import functools
import logging

import networkx as nx
import torch

from autotp.synth.ref import Ref

log = logging.getLogger(__name__)


@functools.cache
def _mesh(size: int):
    """A 1-D mesh of ``size`` ranks for sharding propagation only: no process group behind it."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(size), _init_backend=False, _rank=0)


def _spec(mesh, shape, placement, dtype):
    from torch.distributed.tensor._dtensor_spec import DTensorSpec, TensorMeta

    meta = torch.empty(shape, device="meta", dtype=dtype)
    return DTensorSpec(mesh, (placement,), TensorMeta(meta.shape, meta.stride(), meta.dtype))


def _overloads(op: str) -> list:
    packet = getattr(torch.ops.aten, op, None)
    if packet is None:
        return []
    names = sorted(packet.overloads(), key=lambda n: n != "default")
    return [getattr(packet, n) for n in names if not n.startswith("out")]


def _runs_as_traced(overload, args, kwargs, shape) -> bool:
    """Whether ``overload`` takes these arguments (tensors as meta) and returns the traced shape."""
    try:
        out = overload(*args, **kwargs)
    except Exception:
        return False
    first = out[0] if isinstance(out, (tuple, list)) and out else out
    return shape is None or (isinstance(first, torch.Tensor) and tuple(first.shape) == tuple(shape))


def _propagate(overload, args, kwargs):
    from torch.distributed.tensor import DTensor
    from torch.distributed.tensor._op_schema import OpSchema

    propagator = DTensor._op_dispatcher.sharding_propagator
    if overload in propagator.op_to_shape_and_stride_idx:
        return None  # its size arguments are made per-rank by DTensor, not by the model's code
    # Not the cached entry point: its cache key leaves out some non-tensor arguments (a dim).
    return propagator.propagate_op_sharding_non_cached(OpSchema(overload, tuple(args), kwargs))


def _shard_dims(spec) -> tuple[int, ...] | None:
    """Each output tensor's sharded dim, or None if one is not ``Shard``-ed (or not a tensor)."""
    from torch.distributed.tensor import Shard

    specs = spec if isinstance(spec, (tuple, list)) else (spec,)
    dims = []
    for s in specs:
        if s is None or len(s.placements) != 1 or not isinstance(s.placements[0], Shard):
            return None
        dims.append(s.placements[0].dim)
    return tuple(dims)


def dtensor_rule(g: nx.DiGraph, name: str, dims: dict[str, int], ctx, tp: int = 2) -> tuple[int, ...] | None:
    """The sharded dim of each tensor output of node ``name`` by DTensor's strategy for its op,
    when that strategy keeps ``dims`` (sharded input -> dim) as they are; else None."""
    from torch.distributed.tensor import Replicate, Shard

    data = g.nodes[name]
    overloads = _overloads(data["op"])
    if not overloads:
        return None
    mesh = _mesh(tp)
    refs = [a for a in (*data["args"], *data["kwargs"].values()) if isinstance(a, Ref)]
    if any(not isinstance(a, Ref) and isinstance(a, (list, tuple)) and any(isinstance(x, Ref) for x in a)
           for a in (*data["args"], *data["kwargs"].values())):
        return None  # a list of tensors (cat-like): described by the table, or refused
    for ref in refs:
        if ref.name not in dims and not ctx.broadcast_grad_ok(ref.name):
            return None  # its gradient would be each rank's share
    for other_dtype in (torch.float32, torch.int64):
        def convert(a, other_dtype=other_dtype):
            if not isinstance(a, Ref):
                return a
            shape = g.nodes[a.name]["shape"]
            if shape is None:
                raise ValueError(f"{a.name} has no single tensor shape")
            if a.name in dims:
                return _spec(mesh, shape, Shard(dims[a.name]), torch.float32)
            return _spec(mesh, shape, Replicate(), other_dtype)

        def meta(a, other_dtype=other_dtype):
            if not isinstance(a, Ref):
                return a
            return torch.empty(g.nodes[a.name]["shape"], device="meta",
                               dtype=torch.float32 if a.name in dims else other_dtype)

        try:
            args = [convert(a) for a in data["args"]]
            kwargs = {k: convert(v) for k, v in data["kwargs"].items()}
            found = [o for o in overloads if _runs_as_traced(o, [meta(a) for a in data["args"]],
                                                               {k: meta(v) for k, v in data["kwargs"].items()},
                                                               data["shape"])]
            if not found:
                continue
            out = _propagate(found[0], args, kwargs)
        except Exception as error:  # no strategy, or a call the metadata cannot describe
            log.debug("dtensor rule for %s (%s): %s", name, data["op"], error)
            continue
        if out is None or out.needs_redistribute or out.redistribute_schema is not None:
            return None
        return _shard_dims(out.output_spec)
    return None
