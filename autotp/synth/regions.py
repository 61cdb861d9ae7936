"""Modules run on DTensors: where per-rank code cannot hold the shard, DTensor's own algebra can.

Some modules' code cannot run on per-rank tensors however their counts are divided: a scorer that
sums its heads' scores with a ``matmul`` over the heads before a ``topk`` (a partial sum with no
module boundary to reduce it at), an attention that reshapes by a literal group count. Run on
DTensors, the same code sees global shapes, and DTensor inserts the communication its ops need.
:class:`~autotp.styles.DTensorRegion` does that for one module.

Which of the module's Linears to shard is decided here, on metadata: the module's traced ops are
run one by one through DTensor's own dispatch on meta tensors (a device mesh with no process group),
with the module's inputs ``Replicate()``, each Linear reading a replicated value sharded as a column
(``Shard(0)`` weight) and each reading its last dim sharded as a row (``Shard(1)``). Every
redistribution DTensor asks for is recorded instead of run. Allowed: a ``Partial()`` sum all-reduced
(the one collective a Megatron pair needs), a replicated value sliced locally. Anything else (an
all-gather of a shard, an all-to-all) means the shard does not belong there: the Linears whose shard
reached that op are ruled out together (sets of Linears are tried, the most weight first, at most
32 runs). Every output the rest of the model reads must come out whole (``Replicate()``, or
``Partial()``: all-reduced at the module's output). The backward is run too, from whole gradients
at those outputs: every op in it needs a strategy, and partial gradients may only be all-reduced
(DTensor's own backward strategies would otherwise reduce-scatter and gather them where Megatron's
layout all-reduces once). A fused attention kernel on sharded values is refused: whether DTensor
has a strategy for its backward depends on the device (none on cpu).

Only modules that the analysis left entirely whole, strictly inside a repeated block, with every
parameter they read their own, and whose ancestors' roles hand them plain whole inputs (no role,
divided counts, or a gather of the sequence at entry), and where no per-rank value enters or lives
inside it; under sequence parallel the gathers of its whole Linears move to its entry
(:func:`_sequence_edges`). What the region changes is invisible outside it: its outputs and its
inputs' gradients are whole plain tensors, as they were.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import logging
import math
import threading
from dataclasses import dataclass, replace

import networkx as nx
import torch
from torch import nn

from autotp.styles.base import identity_dropout
from autotp.synth.queries import is_linear, linear_weight, module_of
from autotp.synth.dtensor_rules import _overloads, _runs_as_traced
from autotp.synth.graph import Ref, refs
from autotp.synth.ops import ATTENTION, SINKS
from autotp.synth.roles import Role
from autotp.synth.sequence import module_outputs
from autotp.synth.stages import Analysis, post_pass, role_kind


# The role kinds this idiom assigns (stages.role_kind): what each means and its style.
DTENSOR_REGION = role_kind(
    "dtensor_region",
    "module whose code cannot run on per-rank tensors, run on DTensors with some of its Linears sharded: "
    "DTensor all-reduces the partial sums its ops need",
    lambda role, lp: None)  # the DTensorRegion wrapper alone (build.style_for)
REGION_MEMBER = role_kind(
    "region_member",
    "Linear sharded by the DTensor region around it (no style of its own)",
    lambda role, lp: None)  # placed by the DTensorRegion around it

log = logging.getLogger(__name__)

# Roles an enclosing module may have for a region inside it: they leave its inputs whole and plain.
_SAFE_ABOVE = frozenset({"shard_counts", "kv_head_counts", "seq_gather"})
# Roles the region's own module may have: a gather at entry is kept (it runs first); a module kept
# whole that reads a shared input's Replicate() DTensor takes it as it is, as DTensor code does.
_SAFE_SELF = frozenset({"replicate", "seq_gather", "whole_module"})


@dataclass(frozen=True)
class Region:
    """A module to run on DTensors: ``params`` (relative name -> sharded dim), the all-reduces its
    forward makes (``reductions``), the Linears it shards (traced FQNs), and its output nodes that
    leave as ``Partial()`` sums (``partial``: all-reduced at its output, unless a parallel block
    adds them to another branch's first)."""

    module: str
    params: tuple[tuple[str, int], ...]
    linears: tuple[str, ...]
    reductions: int
    partial: tuple[str, ...] = ()


class _Refused(Exception):
    def __init__(self, culprits: frozenset[str], why: str):
        super().__init__(why)
        self.culprits, self.why = culprits, why


def dtensor_regions(g: nx.DiGraph, flow, roles: dict[str, Role], model: nn.Module, groups, tp_size: int | None, *,
                    sequence_parallel: bool = False) -> dict[str, Role]:
    """Roles for the modules run as DTensor regions (the module's, and its sharded Linears').

    Under sequence parallel, the sequence pass has already made every whole module's inputs whole: a
    gather at its entry or at an enclosing module's, at a norm before it, or at a whole Linear inside it
    that reads the stream. The last becomes one gather at the region's entry, and a whole module at the
    region's output that hands the stream its value keeps doing so (:func:`_sequence_edges`); a module
    with any other sequence edge inside it is left as it is."""
    out = dict(roles)
    taken: list[str] = []
    for module in _candidates(g, roles, model, groups):
        if any(module.startswith(t + ".") for t in taken):
            continue
        if _meets_shards(g, flow, module):
            continue  # a per-rank value inside or entering it: not the whole value the region takes
        edges = _sequence_edges(g, roles, module) if sequence_parallel else _Edges()
        if edges is None:
            continue
        region = plan_region(g, module, tp_size or 2)
        if region is None:
            continue
        taken.append(module)
        own = roles.get(module)
        reason = (f"its code cannot run on per-rank tensors; run on DTensors, {len(region.linears)} Linear(s) sharded "
                  f"and {region.reductions} partial sum(s) all-reduced inside it")
        if own is not None and own.kind == "seq_gather":
            out[module] = replace(own, region=region.params, region_partial=region.partial,
                                  reason=own.reason + "; " + reason)
        elif edges.gather or edges.reshard:
            out[module] = Role("seq_gather", reason + "; its sequence-sharded inputs gathered once at entry"
                               + ("; its output is the stream, sliced back" if edges.reshard else ""),
                               (module, *region.linears), seq_output=edges.reshard, region=region.params,
                               seq_join=edges.join, region_partial=region.partial)
        else:
            out[module] = Role("dtensor_region", reason, (module, *region.linears), region=region.params,
                               seq_join=edges.join, region_partial=region.partial)
        for inner in [m for m in out if m.startswith(module + ".")]:
            out[inner] = Role("replicate", f"runs whole inside the DTensor region {module}", (module,))
        for linear in region.linears:
            out[linear] = Role("region_member", f"sharded by the DTensor region {module}", (module,))
        log.info("dtensor region %s: %s", module, dict(region.params))
    return out


_SEQUENCE_FLAGS = ("seq_input", "seq_output", "seq_join", "seq_cut")


def _meets_shards(g: nx.DiGraph, flow, module: str) -> bool:
    """Whether a value inside ``module``, or one it reads, is per-rank in the analysis' flow."""
    for name, data in g.nodes(data=True):
        if module in data["stack"] and (flow.sharded(name) or any(
                flow.sharded(r.name) for r in refs(data["args"], data["kwargs"]))):
            return True
    return False


@dataclass(frozen=True)
class _Edges:
    """Where a region meets the sequence-sharded stream: its inputs gathered at entry, its output
    sliced back to the stream, or handed on as a ``Replicate()`` DTensor for the stream to meet."""

    gather: bool = False
    reshard: bool = False
    join: bool = False


def _sequence_edges(g: nx.DiGraph, roles: dict[str, Role], module: str) -> _Edges | None:
    """How ``module``, run as one region, meets the sequence-sharded stream, from the edges the sequence
    pass gave the whole Linears and modules inside it (None: an edge a region cannot take over).

    A whole Linear inside that gathers its input becomes one gather at the region's entry; one whose
    output is the region's output and is sliced back (or handed on as a ``Replicate()`` DTensor for
    the stream to meet) makes the region's output so. Anything else is left as the pass made it."""
    own = roles.get(module)
    if own is not None and own.kind != "seq_gather" and any(getattr(own, f) for f in _SEQUENCE_FLAGS):
        return None
    outputs = set(module_outputs(g, module)[0])
    gather = reshard = join = False
    for inner, role in roles.items():
        if not inner.startswith(module + ".") or not any(getattr(role, f) for f in _SEQUENCE_FLAGS):
            continue
        at_output = set(module_outputs(g, inner)[0]) <= outputs
        if role.seq_cut is not None or (role.seq_output or role.seq_join) and not at_output:
            return None
        gather |= role.seq_input
        reshard |= role.seq_output
        join |= role.seq_join and not role.seq_input
        if role.seq_join and role.seq_input:
            gather = reshard = True  # a whole Linear between two points of the stream
    if reshard and join or own is not None and own.seq_output and join:
        return None
    return _Edges(gather, reshard, join)


def _candidates(g: nx.DiGraph, roles: dict[str, Role], model: nn.Module, groups) -> list[str]:
    """Modules strictly inside a repeated block, all of whose Linears are whole (outermost first)."""
    modules = {m for _, d in g.nodes(data=True) if d["kind"] == "call" for m in d["stack"]}
    blocks = {f"{prefix}.{key}" for prefix, entries in groups.groups.items() for key in _keys(entries)}
    linears: dict[str, list[str]] = {}
    for name in g.nodes:
        if g.nodes[name]["kind"] == "call" and is_linear(g, name):
            owner = module_of(g, name)
            for m in g.nodes[name]["stack"]:
                if m != owner:
                    linears.setdefault(m, []).append(owner)
    found = []
    for module in sorted(modules, key=lambda m: (m.count("."), m)):
        if not any(module.startswith(b + ".") for b in blocks) or module not in linears:
            continue
        if roles.get(module) is not None and roles[module].kind not in _SAFE_SELF:
            continue
        if roles.get(module) is not None and any(getattr(roles[module], f) for f in ("entry_inputs", "width_view")):
            continue
        inside = [r for m, r in roles.items() if m.startswith(module + ".")]
        if any(r.kind != "replicate" for r in inside):
            continue
        above = [roles[a] for a in _ancestors(module) if a in roles]
        if any(r.kind not in _SAFE_ABOVE for r in above):
            continue
        if not all(isinstance(_submodule(model, lin), nn.Linear) for lin in linears[module]):
            continue
        found.append(module)
    return found


def _keys(entries) -> list[str]:
    return [str(i) if not isinstance(e[0], str) else e[0] for i, e in enumerate(entries)]


def _ancestors(module: str) -> list[str]:
    parts = module.split(".")
    return [".".join(parts[:i]) for i in range(1, len(parts))]


def _submodule(model: nn.Module, fqn: str):
    try:
        return model.get_submodule(fqn)
    except AttributeError:
        return None


def plan_region(g: nx.DiGraph, module: str, tp: int) -> Region | None:
    """The Linears of ``module`` to shard when it runs on DTensors, or None (see the module docstring).

    Sets of its Linears are tried, the most weight first (at most :data:`_TRIES` runs): the first
    set whose run DTensor completes with only allowed redistributions is taken. A run refused at an
    op rules out, as a set to try, every set holding all the Linears whose shard reached that op.
    """
    sizes = _linear_sizes(g, module)
    names = sorted(sizes)
    # Every subset for a few Linears; for many, those that keep at most two of them whole.
    smallest = 1 if len(names) <= _EVERY_SUBSET else max(len(names) - 2, 1)
    subsets = sorted((frozenset(c) for r in range(len(names), smallest - 1, -1) for c in itertools.combinations(names, r)),
                     key=lambda c: (-sum(sizes[n] for n in c), sorted(c)))
    ruled_out: list[frozenset] = []
    for tries, keep in enumerate(subsets):
        if tries >= _TRIES:
            break
        if any(bad <= keep for bad in ruled_out):
            continue
        try:
            chosen, reductions, partial = _run(g, module, tp, set(names) - keep)
        except _Refused as refused:
            log.debug("dtensor region %s, sharding %s: %s", module, sorted(keep), refused.why)
            if not refused.culprits:
                return None  # the module cannot run on DTensors at all
            ruled_out.append(refused.culprits & keep)
            continue
        if not chosen:
            return None
        params = tuple(sorted((f"{lin[len(module) + 1:]}.{p}", d) for lin, dims in chosen.items() for p, d in dims))
        return Region(module, params, tuple(sorted(chosen)), reductions, partial)
    return None


# Metadata runs one module may take while its sets of Linears to shard are tried, and the most
# Linears whose every subset is a candidate.
_TRIES = 32
_EVERY_SUBSET = 8


def _linear_sizes(g: nx.DiGraph, module: str) -> dict[str, int]:
    """The Linears run inside ``module`` (traced FQNs) and their weights' sizes."""
    found = {}
    for name, data in g.nodes(data=True):
        if data["kind"] == "call" and module in data["stack"] and is_linear(g, name):
            weight = linear_weight(g, name)
            found[module_of(g, name)] = math.prod(g.nodes[weight]["shape"])
    return found


_MESH_NAME = ("autotp_metadata_run",)


@functools.cache
def _mesh(tp: int):
    """A 1-D mesh of ``tp`` ranks with no process group. DTensor's dispatch caches shardings by mesh
    (the redistributions they name included): its dim name makes it equal to no mesh a real run uses."""
    from torch.distributed.device_mesh import DeviceMesh

    return DeviceMesh("cpu", torch.arange(tp), mesh_dim_names=_MESH_NAME, _init_backend=False, _rank=0)


_RECORDING = threading.local()


@contextlib.contextmanager
def _recorded_redistributions(log_to: list):
    """DTensor's redistributions on the metadata mesh recorded in ``log_to`` as ``(current, target)``
    specs and answered with an empty tensor of the target's local shape: no process group is asked.
    Any other mesh's (another thread's real run) go to DTensor's own function, as they would."""
    from torch.distributed.tensor import _api, _dispatch, _redistribute
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    originals = [(m, m.redistribute_local_tensor) for m in (_api, _dispatch, _redistribute)]

    def wrap(original):
        def redistribute_local_tensor(local, current, target, **kwargs):
            log = getattr(_RECORDING, "log", None)
            if log is None or current.mesh.mesh_dim_names != _MESH_NAME:
                return original(local, current, target, **kwargs)
            log.append((current, target))
            shape, _ = compute_local_shape_and_global_offset(target.shape, target.mesh, target.placements)
            return torch.empty(shape, dtype=local.dtype, device=local.device)
        return redistribute_local_tensor

    outer = getattr(_RECORDING, "log", None)
    _RECORDING.log = log_to
    for m, fn in originals:
        m.redistribute_local_tensor = wrap(fn)
    try:
        yield
    finally:
        for m, fn in originals:
            m.redistribute_local_tensor = fn
        _RECORDING.log = outer


def _run(g: nx.DiGraph, module: str, tp: int, whole: set[str]):
    """One metadata run of ``module``'s ops on DTensors; raises :class:`_Refused` with the Linears to
    keep whole when DTensor asks for a redistribution other than an all-reduce or a local slice."""
    from torch.distributed.tensor import DTensor, Replicate, Shard
    from torch.distributed.tensor.experimental import implicit_replication

    mesh = _mesh(tp)
    nodes = sorted((n for n, d in g.nodes(data=True) if d["kind"] == "call" and module in d["stack"]),
                   key=lambda n: g.nodes[n]["order"])
    values: dict[str, object] = {}
    sources: dict[str, frozenset] = {}
    chosen: dict[str, tuple] = {}
    reductions, partial = 0, []

    def value(ref: Ref):
        if ref.name in values:
            return values[ref.name]
        data = g.nodes[ref.name]
        if data["kind"] == "param" and not data["param"].startswith(module + "."):
            raise _Refused(frozenset(), f"reads {data['param']}, a parameter of another module")
        if data["shape"] is None:
            raise _Refused(frozenset(), f"reads {ref.name}, which has no single tensor shape")
        meta = torch.empty(data["shape"], dtype=data.get("dtype") or torch.float32, device="meta")
        if meta.is_floating_point() and data["kind"] in ("call", "input", "param"):
            meta.requires_grad_(True)  # the backward is run too (see below)
        values[ref.name] = DTensor.from_local(meta, mesh, [Replicate()], run_check=False)
        return values[ref.name]

    def convert(a):
        if isinstance(a, Ref):
            return value(a)
        if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
            return type(a)(convert(x) for x in a)
        if isinstance(a, torch.device):
            return torch.device("meta")  # tensors the code makes (``torch.full``) as metadata too
        return a

    leaving: list = []
    with implicit_replication():
        for name in nodes:
            data = g.nodes[name]
            if data["op"] in SINKS:
                continue  # the trace's own checks and size reads: nothing runs at run time
            inputs = [r.name for r in refs(data["args"], data["kwargs"])]
            reached = frozenset().union(*(sources.get(i, frozenset()) for i in inputs))
            if data["op"] == "getitem":
                base = values.get(data["args"][0].name) if isinstance(data["args"][0], Ref) else None
                if base is None:
                    raise _Refused(reached, f"{name}: getitem of something the run did not make")
                values[name], sources[name] = base[data["args"][1]], reached
                continue
            if data["op"] in ATTENTION and reached:
                # Fused attention kernels: whether DTensor has a strategy for their backward depends
                # on the device the plan runs on (none on cpu), which a metadata run cannot see.
                raise _Refused(reached, f"{name}: a fused attention kernel on sharded values")
            # A dropout counts as linear where it can never be live: p == 0 (the trace runs in eval).
            if data["op"] not in PARTIAL_LINEAR and not _zero_dropout(data["op"], data["args"], data["kwargs"]):
                reductions += _reduce_partials(values, inputs)
            args, kwargs = convert(data["args"]), {k: convert(v) for k, v in data["kwargs"].items()}
            if data["op"] == "linear" and is_linear(g, name):
                args, reached = _place_linear(g, name, module, args, whole, chosen, mesh, reached)
            overload = _overload(g, name, args, kwargs)
            if overload is None:
                raise _Refused(reached, f"{name}: no aten overload of {data['op']} takes the traced arguments")
            moved: list = []
            try:
                with _recorded_redistributions(moved):
                    out = overload(*args, **kwargs)
            except _Refused:
                raise
            except Exception as error:  # no sharding strategy, or a call DTensor cannot take
                raise _Refused(reached, f"{name} ({data['op']}): {type(error).__name__}: {error}") from None
            for current, target in moved:
                if current.placements == target.placements:
                    continue
                if all(c.is_partial() and t.is_replicate() for c, t in zip(current.placements, target.placements)):
                    reductions += 1
                elif all(c.is_replicate() for c in current.placements):
                    continue  # a local slice of a replicated value, or its share of a partial sum
                else:
                    raise _Refused(reached, f"{name} ({data['op']}) moves {current.placements} to {target.placements}")
            values[name], sources[name] = out, reached
        for name in nodes:  # the values the rest of the model reads leave whole
            outside = [s for s in g.successors(name) if module not in g.nodes[s]["stack"]]
            out = values.get(name)
            if not outside or not isinstance(out, DTensor):
                continue
            placement = out.placements[0]
            if placement.is_partial():
                reductions += 1
                partial.append(name)
            elif isinstance(placement, Shard):
                raise _Refused(sources.get(name, frozenset()), f"{name} leaves the module sharded")
            if out.requires_grad:
                leaving.append(out)
        _backward(leaving, frozenset(chosen))
    return chosen, reductions, tuple(partial)


def _backward(outputs: list, chosen: frozenset[str]) -> None:
    """The backward of the metadata run, from whole gradients at the outputs: every op it runs must
    have a DTensor strategy, and it may move partial gradients only by all-reducing them (DTensor's
    own backward strategies may otherwise reduce-scatter and gather them where Megatron's layout
    all-reduces once). Refusals name every sharded Linear: the set is tried smaller."""
    from torch.distributed.tensor import DTensor, Replicate

    if not outputs:
        return
    grads = [DTensor.from_local(torch.empty(o.to_local().shape, dtype=o.dtype, device="meta"), o.device_mesh,
                                [Replicate()], run_check=False) for o in outputs]
    moved: list = []
    try:
        with _recorded_redistributions(moved):
            torch.autograd.backward(outputs, grads)
    except _Refused:
        raise
    except Exception as error:  # an op whose backward has no strategy (attention kernels on cpu)
        raise _Refused(chosen, f"backward: {type(error).__name__}: {str(error).splitlines()[0]}") from None
    for current, target in moved:
        if current.placements == target.placements or all(c.is_replicate() for c in current.placements):
            continue
        if not all(c.is_partial() and t.is_replicate() for c, t in zip(current.placements, target.placements)):
            raise _Refused(chosen, f"backward moves {current.placements} to {target.placements}")


# Aten ops linear in a ``Partial()`` operand: a partial sum passes through them as DTensor decides;
# before any other op it is all-reduced (where a Megatron row reduces), as
# :class:`~autotp.styles.DTensorRegion` does at run time (DTensor alone might reduce-scatter it
# onto the batch for a ``topk`` and leave the module's output sharded).
PARTIAL_LINEAR = frozenset({
    "add", "sub", "mul", "div", "neg", "view", "reshape", "_unsafe_view", "unsqueeze", "squeeze", "expand",
    "transpose", "permute", "t", "matmul", "bmm", "mm", "sum", "mean", "clone", "contiguous", "_to_copy", "to",
    "type_as", "flatten", "slice", "select", "split", "split_with_sizes", "cat", "stack", "alias", "linear",
})


def _zero_dropout(op: str, args, kwargs) -> bool:
    return identity_dropout(op, (*args[:2], True), kwargs)


def _reduce_partials(values: dict, inputs: list[str]) -> int:
    """All-reduce each ``Partial()`` value among ``inputs`` in ``values`` (later readers see it whole,
    as the region's style hands them the one reduced tensor); the number reduced."""
    from torch.distributed.tensor import DTensor, Replicate

    count = 0
    for name in dict.fromkeys(inputs):
        value = values.get(name)
        if isinstance(value, DTensor) and any(p.is_partial() for p in value.placements):
            with _recorded_redistributions([]):
                values[name] = value.redistribute(placements=[Replicate()] * value.device_mesh.ndim)
            count += 1
    return count


def _place_linear(g, name, module, args, whole, chosen, mesh, reached):
    """The weight (and bias) of Linear node ``name`` as DTensors: a column where its input is
    replicated, a row where its input's last dim is sharded, whole otherwise or when in ``whole``."""
    from torch.distributed.tensor import DTensor, Replicate, Shard

    owner = module_of(g, name)
    weight = linear_weight(g, name)
    if owner in whole or g.nodes[weight]["param"] != f"{owner}.weight" or g.nodes[name].get("weight_in_out"):
        return args, reached
    x = args[0]
    placement = x.placements[0] if isinstance(x, DTensor) else Replicate()
    if placement.is_replicate():
        dims = (("weight", 0), ("bias", 0))
    elif isinstance(placement, Shard) and placement.dim % x.ndim == x.ndim - 1:
        dims = (("weight", 1),)
    else:
        return args, reached
    dims = tuple(d for d in dims if d[0] == "weight" or len(args) > 2)
    if chosen.get(owner, dims) != dims:  # called twice, its input sharded differently: one layout only
        raise _Refused(reached | {owner}, f"{owner} is called on inputs that need two layouts of its weight")
    chosen[owner] = dims

    def placed(a, dim):
        local = a.to_local() if isinstance(a, DTensor) else a
        from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

        shape, _ = compute_local_shape_and_global_offset(local.shape, mesh, [Shard(dim)])
        return DTensor.from_local(torch.empty(shape, dtype=local.dtype, device="meta"), mesh, [Shard(dim)],
                                  run_check=False, shape=local.shape, stride=local.stride())

    new = list(args)
    new[1] = placed(args[1], dims[0][1])
    if len(args) > 2 and args[2] is not None and dims[0][1] == 0:
        new[2] = placed(args[2], 0)
    return tuple(new), reached | {owner}


def _overload(g, name, args, kwargs):
    """The aten overload of node ``name`` that takes these arguments and returns the traced shape."""
    def meta(a):
        if isinstance(a, torch.Tensor):
            return torch.empty(a.shape, dtype=a.dtype, device="meta")
        if isinstance(a, (list, tuple)) and not hasattr(a, "_fields"):
            return type(a)(meta(x) for x in a)
        return a

    data = g.nodes[name]
    for overload in _overloads(data["op"]):
        if _runs_as_traced(overload, [meta(a) for a in args], {k: meta(v) for k, v in kwargs.items()}, data["shape"]):
            return overload
    return None


@post_pass(order=120)
def dtensor_region_modules(a: Analysis) -> Analysis:
    """Modules left whole whose code can run on DTensors with some of their Linears sharded
    (:mod:`autotp.synth.regions`); after every pass that gives roles, so only what stayed whole."""
    if a.model is None:
        return a
    return replace(a, roles=dtensor_regions(a.graph, a.flow, a.roles, a.model, a.groups, a.tp_size,
                                                    sequence_parallel=a.sequence_parallel))
