"""Run one module alone on meta tensors at per-rank shapes, to confirm what the graph cannot show.

Synthesis sees constants in the traced graph, not the attributes they came from. To check a guess
(divide these head counts; set this grouped-query ratio), the module is copied to meta with its
Linears at their per-rank widths, run on the inputs it got in a fake forward of the model, and
either its cuts of a fused output are recorded (:func:`run_local`) or it is re-traced and compared
op for op with the global trace (:func:`trace_local`, :func:`shapes_are_local`). Nothing is
allocated: meta tensors have shapes only.
"""

from __future__ import annotations

import contextlib
import contextvars
import copy
import functools
import logging
from collections.abc import MutableMapping
from dataclasses import replace

import networkx as nx
import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensor
from torch.utils import _pytree as pytree
from torch.utils._python_dispatch import TorchDispatchMode

from autotp.copying import deep_copy
from autotp.styles.attention import count_holder, sync_einops_lengths, width_view
from autotp.synth.propagation import propagate_packed
from autotp.synth.queries import is_linear, linear_weight, module_of, raw_weight, weight_of
from autotp.synth.shard import Shard
from autotp.synth.copies import local_point
from autotp.synth.graph import build_graph
from autotp.synth.head_loops import later_iterations
from autotp.synth.ops import FIXED_SIZE_CUTS
from autotp.synth.ops import ELEMENTWISE, PASSTHROUGH, REORDERS, VIEW_LIKE
from autotp.synth.params import chain_dims
from autotp.synth.queries import reading_module
from autotp.synth.roles import WEIGHT_DIMS, Role, kind_of
from autotp.synth.trace import LayerGroups, _export, _fake_forward, collapsed, data_dependent
from autotp.synth.trace import example_args, on_meta

log = logging.getLogger(__name__)


def _to_meta(value):
    return _rebuilt(value, lambda t, inside: torch.empty(t.shape, dtype=t.dtype, device="meta"))


def _snapshot(value):
    """``value`` as it is now: containers and state objects (a kv cache) copied, their tensors
    shared. A module's inputs are captured before it runs; the forward goes on and may update a
    cache it was handed, which the module must not meet again when it is run alone."""
    return _rebuilt(value, lambda t, inside: t)


def _rebuilt(value, tensor, depth: int = 0, memo: dict | None = None, inside: bool = False):
    """``value`` with ``tensor(t, inside)`` applied to every tensor ``t`` in it (``inside``: held by
    a plain object's attributes): containers, and plain objects with attributes (a cache and its
    layers), rebuilt down to a depth of 8; modules and functions shared."""
    memo = {} if memo is None else memo
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, torch.Tensor):
        result = tensor(value, inside)
    elif depth > 8 or isinstance(value, (nn.Module, type)) or callable(value):
        return value
    elif isinstance(value, (tuple, list)):
        result = type(value)(_rebuilt(v, tensor, depth + 1, memo, inside) for v in value)
    elif isinstance(value, dict):
        result = {k: _rebuilt(v, tensor, depth + 1, memo, inside) for k, v in value.items()}
    elif getattr(value, "__dict__", None):
        result = copy.copy(value)
        memo[id(value)] = result
        for name, item in vars(value).items():
            result.__dict__[name] = _rebuilt(item, tensor, depth + 1, memo, True)
    else:
        return value
    memo[id(value)] = result
    return result


class Captured(dict):
    """FQN -> ``(args, kwargs)`` as meta tensors; ``failed`` holds the error that stopped the fake
    forward, if one did (modules after it were never reached, which proves nothing about them);
    ``stateful`` the modules handed a state object that already held values when they were called
    (keys and values an earlier layer stored for this one to share): their per-rank sizes depend on
    how that layer was sharded, which a run of the module alone cannot show."""

    failed: str | None = None
    stateful: frozenset = frozenset()
    real: dict = {}  # FQN -> (args, kwargs) with their values, where the forward had to read values


def inner_roles(roles: dict[str, Role], fqn: str) -> dict[str, Role]:
    """The roles of ``fqn`` and of the modules inside it, by name relative to it (``""``: itself),
    that change a shape when it runs alone at per-rank widths."""
    prefix = fqn + "." if fqn else ""
    found = {m[len(prefix):]: r for m, r in roles.items() if m.startswith(prefix) and r.kind != "replicate"}
    if fqn in roles and (roles[fqn].kind in ("head_params", "linear_params") or roles[fqn].entry_inputs
                         or roles[fqn].width_view or roles[fqn].rewrites):
        found[""] = roles[fqn]  # its per-head parameters (or raw Linear weights, or sliced inputs) are per-rank too
    return found


class ModuleArgument:
    """A module of the model handed to a module as an argument (one relative-position module at the
    root that every layer's attention calls: ``sim + rel_pos(n, n)``). Run alone, the module proven
    calls a meta copy of it, attached as its child ``name``, at per-rank shapes under ``roles`` (its
    own and its children's, relative to it: per-head slopes, the head-producing Linear of a
    distance MLP), as the plan runs it; the model's own copy holds real tensors, which a meta run
    cannot mix with, and its shards would not be seen."""

    __slots__ = ("module", "name", "roles")

    def __init__(self, module: nn.Module, name: str, roles: dict[str, Role]):
        self.module, self.name, self.roles = module, name, roles


def _module_arguments(inputs: tuple[tuple, dict], model: nn.Module, roles: dict[str, Role]) -> tuple[tuple, dict]:
    """``inputs`` with each module of ``model`` among the arguments as a :class:`ModuleArgument`."""
    names = {id(m): name for name, m in model.named_modules()}

    def wrap(value, key):
        if isinstance(value, nn.Module) and id(value) in names:
            return ModuleArgument(value, f"_autotp_argument_{key}", inner_roles(roles, names[id(value)]))
        return value

    args, kwargs = inputs
    return tuple(wrap(a, i) for i, a in enumerate(args)), {k: wrap(v, k) for k, v in kwargs.items()}


def _arguments(inputs) -> list[ModuleArgument]:
    if not (isinstance(inputs, tuple) and len(inputs) == 2 and isinstance(inputs[1], dict)):
        return []
    return [v for v in (*inputs[0], *inputs[1].values()) if isinstance(v, ModuleArgument)]


def argument_roles(inputs) -> dict[str, Role]:
    """The roles of the modules among ``inputs`` (:class:`ModuleArgument`), by the names their
    copies take as children of the module run alone."""
    return {f"{arg.name}.{rel}" if rel else arg.name: role
            for arg in _arguments(inputs) for rel, role in arg.roles.items()}


def _attached(local: nn.Module, inputs: tuple[tuple, dict], real: bool) -> tuple[tuple, dict]:
    """``inputs`` with each :class:`ModuleArgument` a copy (meta, or holding values with ``real``)
    attached to ``local`` as its child of the argument's name, so that roles shrink it with the rest."""
    def copy_of(value):
        if isinstance(value, ModuleArgument):
            local.add_module(value.name, _module_copy(value.module, real))
            return local.get_submodule(value.name)
        return value

    args, kwargs = inputs
    return tuple(copy_of(a) for a in args), {k: copy_of(v) for k, v in kwargs.items()}


def capture_inputs(model: nn.Module, example_inputs, fqns: set[str],
                   groups: LayerGroups | None, roles: dict[str, Role] | None = None) -> Captured:
    """The inputs each module in ``fqns`` (FQNs traced with ``groups``) gets, as meta tensors, from
    one fake forward. With ``roles``, modules of the model among them are :class:`ModuleArgument`
    (for :func:`run_local` and :func:`trace_local`, which run a per-rank copy of them)."""
    captured: dict[str, tuple[tuple, dict]] = {}
    args, kwargs = example_args(model, example_inputs)
    with collapsed(model, groups):
        handles = []
        for fqn in fqns:
            def hook(mod, a, k, fqn=fqn):
                captured.setdefault(fqn, _snapshot((a, k)))
            handles.append(model.get_submodule(fqn).register_forward_pre_hook(hook, with_kwargs=True))
        fake_log = logging.getLogger("torch._subclasses.fake_tensor")
        level = fake_log.level
        fake_log.setLevel(logging.CRITICAL)  # a kernel without a fake impl logs before it raises
        try:
            failed = _fake_forward(model, args, kwargs, real_values=False)
            real = failed is not None and data_dependent(failed) and not on_meta(model)
            if real:
                # A value read (``lengths.max().item()``): the branch these inputs take, as export's
                # retry does; the shapes the proof compares are those of the traced graph's branch.
                captured.clear()
                failed = _fake_forward(model, args, kwargs, real_values=True)
        finally:
            fake_log.setLevel(level)
            for handle in handles:
                handle.remove()
    # Fake tensors belong to the fake mode: keep only their shapes, as plain meta tensors.
    result = Captured({fqn: (_to_meta(a), _to_meta(k)) for fqn, (a, k) in captured.items()})
    if roles is not None:
        with collapsed(model, groups):
            for fqn in result:
                result[fqn] = _module_arguments(result[fqn], model, roles)
    result.stateful = frozenset(fqn for fqn, inputs in captured.items() if _filled_state(inputs))
    if real:  # a module that reads values itself is run on them (:func:`run_local`)
        result.real = {fqn: _rebuilt(inputs, lambda t, inside: t.detach().clone()) for fqn, inputs in captured.items()}
        if roles is not None:
            with collapsed(model, groups):
                result.real = {fqn: _module_arguments(v, model, roles) for fqn, v in result.real.items()}
    if failed is not None:
        result.failed = f"{type(failed).__name__}: {str(failed).splitlines()[0] if str(failed) else ''}"[:200]
    return result


def _filled_state(value) -> bool:
    """Whether ``value`` holds a plain object (not a container) with a non-empty tensor in it."""
    filled = []
    _rebuilt(value, lambda t, inside: filled.append(inside and t.numel() > 0) or t)
    return any(filled)


def _real_inputs(inputs) -> bool:
    """Whether ``inputs`` hold values (a module that reads them: :attr:`Captured.real`), not meta shapes."""
    found = []
    _rebuilt(inputs, lambda t, inside: found.append(not t.is_meta) or t)
    return any(found)


def _per_rank(param: torch.Tensor, shape: list) -> torch.Tensor:
    """A tensor of ``shape`` standing for ``param``'s per-rank shard: meta for a meta parameter, else
    the leading block of its values (rank 0's shard of an even split), so that code reading values
    (a router's top-k) sees numbers of the kind it was built for."""
    if param.is_meta:
        return torch.empty(shape, dtype=param.dtype, device="meta")
    block = param.detach()
    for dim, size in enumerate(shape):
        if size > block.shape[dim]:  # a share wider than the whole (copies of a part): repeated rows
            block = block.repeat_interleave(-(-size // block.shape[dim]), dim=dim)
        block = block.narrow(dim, 0, size)
    return block.clone()


def _module_copy(module: nn.Module, real: bool = False) -> nn.Module:
    """A copy of ``module`` on meta (parameters are not copied, only their shapes); with ``real``, a
    copy holding its parameters' values (detached), to run on the values of its inputs."""
    tensor = (lambda t: t.detach().clone()) if real else \
        (lambda t: torch.empty(t.shape, dtype=t.dtype, device="meta"))  # noqa: E731
    memo = {id(t): nn.Parameter(tensor(t), requires_grad=False) for t in module.parameters()}
    memo.update({id(t): tensor(t) for t in module.buffers()})
    # A fake tensor the model's own trace left in an attribute (a recurrent block's saved state,
    # restored only when analysis ends) is not copied: a deep copy of one corrupts memory when freed.
    memo.update({id(value): None for m in module.modules() for value in vars(m).values()
                 if isinstance(value, FakeTensor)})
    # Tensors held as plain attributes (a mask or table kept outside the buffers) go with the copy:
    # a meta run cannot mix them with meta tensors, and the module could not be judged.
    memo.update({id(value): tensor(value) for m in module.modules() for value in vars(m).values()
                 if type(value) is torch.Tensor and id(value) not in memo})
    return deep_copy(module, memo)


def _shrink(module: nn.Module, role: Role, tp: int) -> None:
    """Give ``module``'s parameters their per-rank shapes under ``role``."""
    dims = dict(role.param_dims) if role.kind in ("experts", "head_params", "linear_params") else None
    if _in_out(role):
        _shrink_in_out(module, role, tp)
        return
    # Dotted names: a child's parameter read by this module's own code (see HeadParams).
    owned = dict(module.named_parameters()) | dict(module.named_buffers())
    children = [n for n in (dims or {}) if ("." in n or n in module._buffers) and n in owned]
    for name, param in list(module.named_parameters(recurse=False)) + [(n, owned[n]) for n in children]:
        dim = dims.get(name) if dims is not None else WEIGHT_DIMS.get(role.kind)
        if role.scatter_heads:  # the output scattered onto the heads: this rank's outputs, its inputs
            shape = [size // tp for size in param.shape]
            setattr(module, name, nn.Parameter(_per_rank(param, shape), requires_grad=False))
            continue
        if dim is None or (role.kind == "row" and param.ndim < 2):
            continue
        shape = list(param.shape)
        # A replicated kv projection holds one head per rank, whatever tp is.
        shape[dim] = role.head_dim if role.kind == "kv_column" else shape[dim] // tp
        if role.copied:  # parts held whole on every rank: the expanded parts' share (autotp.synth.copies)
            shape[dim] = sum(role.sizes) // tp
        path, _, leaf = name.rpartition(".")
        local = _per_rank(param, shape)
        setattr(module.get_submodule(path), leaf,
                nn.Parameter(local, requires_grad=False) if isinstance(param, nn.Parameter) else local)


def _shrink_in_out(module: nn.Module, role: Role, tp: int) -> None:
    """Per-rank shapes for a weight stored ``(in, out)``, and a forward that multiplies by it.

    Under its style the module runs on DTensors, so its own reshapes with global sizes
    (``view(..., self.nf)``) hold and its output is this rank's features; the local copy gets that
    behaviour directly.
    """
    for name, param in list(module.named_parameters(recurse=False)):
        if role.kind == "row" and param.ndim < 2:
            continue  # a row's bias is added once, whole
        dim = 0 if role.kind == "row" else param.ndim - 1
        shape = list(param.shape)
        shape[dim] //= tp
        setattr(module, name, nn.Parameter(_per_rank(param, shape), requires_grad=False))

    def forward(x, *args, **kwargs):
        flat, bias = x.reshape(-1, x.shape[-1]), getattr(module, "bias", None)
        out = flat @ module.weight if bias is None else torch.addmm(bias, flat, module.weight)
        return out.view(*x.shape[:-1], module.weight.shape[1])

    module.forward = forward


def _local_copy(module: nn.Module, roles: dict[str, Role], names: tuple[str, ...], tp: int,
                real: bool = False, inputs: tuple[tuple, dict] | None = None):
    """A meta copy of ``module`` (with ``real``, a copy holding values) with per-rank parameter
    shapes and ``names`` divided by ``tp``; with ``inputs``, ``(copy, inputs)`` where the modules
    handed in (:class:`ModuleArgument`) are copies attached to it, shrunk under their roles too."""
    local = _module_copy(module, real)
    if inputs is not None:
        roles = {**roles, **argument_roles(inputs)}
        inputs = _attached(local, inputs, real)
    for name, role in roles.items():
        if tp > 1 or _in_out(role):  # at tp=1 too, so that both runs have the same ops
            _shrink(local.get_submodule(name), role, tp)
        if role.kind in ("width_norm", "head_mixer"):  # at tp=1 too: per rank, shaped like its input
            _as_width_norm(local.get_submodule(name))
        if role.entry_inputs:  # at tp=1 too, so that both traces hold the same ops
            _slice_entries(local.get_submodule(name), role.entry_inputs, tp)
        if role.width_view:  # at tp=1 too (LocalWidthInputs: the stand-in's ops in both traces)
            width_view(local.get_submodule(name), *role.width_view, tp)
        for rewrite in role.rewrites:  # at tp=1 too (a rewrite at tp=1 changes no size)
            rewrite.localize(local.get_submodule(name), tp)
    if tp > 1:
        _divide(local, names, tp)
    return local if inputs is None else (local, inputs)


def _slice_entries(module: nn.Module, inputs: tuple, tp: int) -> None:
    """``module`` takes these arguments (position or keyword, dim) as this rank's slice, as
    :class:`~autotp.styles.ShardedInputs` hands them over."""
    def hook(mod, args, kwargs):
        args = list(args)
        for key, dim, *fold in inputs:
            holder = args if isinstance(key, int) else kwargs
            if (key < len(args)) if isinstance(key, int) else key in kwargs:
                value = holder[key].unflatten(dim, (-1, *fold)) if fold else holder[key]
                at = dim + 1 if fold else dim
                value = value.narrow(at, 0, value.shape[at] // tp)
                holder[key] = value.flatten(dim, dim + 2) if fold else value
        return tuple(args), kwargs

    module.register_forward_pre_hook(hook, with_kwargs=True, prepend=True)


def _as_width_norm(module: nn.Module) -> None:
    """A width-sharded norm runs on DTensors with global sizes and returns its input's layout
    (:class:`~autotp.styles.WidthShardedNorm`): at per-rank shapes, its output is shaped like its
    input, whatever sizes its code reads (a gated norm's ``view(..., -1, self.group_size)``)."""
    module.forward = lambda x, *args, **kwargs: x * 1


def _in_out(role: Role) -> bool:
    return role.weight_in_out and role.kind in WEIGHT_DIMS


def _divide(module: nn.Module, names: tuple[str, ...], tp: int) -> None:
    """``names`` of ``module`` (a copy) divided by ``tp``, as :class:`~autotp.styles.ShardCounts` does."""
    for name in names:
        owner, attr = count_holder(module, name)
        if isinstance(owner, MutableMapping):
            owner[attr] //= tp
        else:
            setattr(owner, attr, getattr(owner, attr) // tp)
    sync_einops_lengths(module)


class _CutRecorder(TorchDispatchMode):
    """Records ``[start, end)`` of every cut along the last dim of the tensors in ``watched``."""

    def __init__(self):
        super().__init__()
        self.watched: dict[int, int] = {}  # id(tensor) -> index of the fused Linear
        self.cuts: dict[int, set] = {}

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        source = args[0] if args else None
        index = self.watched.get(id(source)) if isinstance(source, torch.Tensor) else None
        if index is not None:
            self._record(index, func._schema.name.split("::")[-1], source, args)
        return out

    def _record(self, index, op, source, args):
        width, last = source.shape[-1], source.ndim - 1
        dim = (args[1] if len(args) > 1 else 0) if op == "slice" else (args[2] if len(args) > 2 else 0)
        if op not in FIXED_SIZE_CUTS | {"chunk"} or dim % source.ndim != last:
            return
        if op == "slice":
            start = (args[2] or 0) if len(args) > 2 else 0
            end = min(args[3], width) if len(args) > 3 and args[3] is not None else width
            ranges = [(start % width if start < 0 else start, end % width if end < 0 else end)]
        else:
            sizes = args[1] if op == "split_with_sizes" else None
            if op == "split":
                sizes = [min(args[1], width - s) for s in range(0, width, args[1])]
            ranges = [(sum(sizes[:i]), sum(sizes[: i + 1])) for i in range(len(sizes))]
        self.cuts.setdefault(index, set()).update(ranges)


def outputs_match(local, reference, tp: int) -> bool:
    """Whether a module's output shapes at per-rank widths (``local``) pass for its global ones:
    equal, or for a main output still sharded (a module that cuts a fused output and returns the
    product of the parts, ``a * gelu(b)``, to a row outside it) one extent divided by ``tp``. The
    caller then holds every shape, that one included, to the propagated layout (``shapes_are_local``).

    >>> outputs_match((2, 11, 64), (2, 11, 64), 2), outputs_match((2, 11, 32), (2, 11, 64), 2)
    (True, True)
    >>> outputs_match((2, 11, 64), (2, 11, 128), 4), outputs_match(((2, 11, 32), (2, 11)), ((2, 11, 64), (2, 11)), 2)
    (False, False)
    """
    if local == reference:
        return True
    if not (isinstance(local, tuple) and isinstance(reference, tuple)) or len(local) != len(reference):
        return False
    if not all(isinstance(v, int) for v in local + reference):
        return False
    differ = [(a, b) for a, b in zip(local, reference) if a != b]
    return len(differ) == 1 and differ[0][0] * tp == differ[0][1]


def per_rank_call(inputs, args: tuple, kwargs: dict, tp: int) -> tuple[tuple, dict]:
    """``args`` / ``kwargs`` (a copy of ``inputs``) with every carried argument narrowed to rank 0's
    share at ``tp`` (a no-op at tp 1 or for an unmarked call)."""
    carried, modules = getattr(inputs, "carried", ()), getattr(inputs, "modules", ())
    if not modules and (tp == 1 or not carried):
        return args, kwargs
    args, kwargs = list(args), dict(kwargs)
    if modules:
        for key, inner in modules:  # at tp 1 too: both runs call a meta copy
            holder = args if isinstance(key, int) else kwargs
            holder[key] = _local_copy(holder[key], inner, (), tp)
    if tp == 1:
        return tuple(args), kwargs
    for key, dim in carried:
        holder = args if isinstance(key, int) else kwargs
        value = holder[key] if (isinstance(key, int) and key < len(args)) or key in kwargs else None
        if isinstance(value, torch.Tensor):
            holder[key] = value.narrow(dim, 0, value.shape[dim] // tp)
    return tuple(args), kwargs


def run_local(module: nn.Module, inputs: tuple[tuple, dict], roles: dict[str, Role], fused: list[str],
              names: tuple[str, ...], tp: int, assign: dict[str, int] | None = None):
    """Run a meta copy of ``module`` with per-rank widths and ``names`` divided by ``tp``.

    Args:
        roles: roles of ``module``'s submodules, by name relative to ``module``.
        fused: relative names of the fused Linears whose cuts are recorded.
        assign: attributes of ``module`` set to the given per-rank values.
    Returns:
        ``(output shapes, {fused index: set of cuts})``, or None if the forward fails.
    """
    real = _real_inputs(inputs)
    # A cache among the inputs is updated by the run: each run gets its own.
    local, (args, kwargs) = _local_copy(module, roles, names, tp, real, _snapshot(inputs))
    for name, value in (assign or {}).items():
        setattr(local, name, value)
    recorder = _CutRecorder()
    keep = []  # the watched outputs stay alive, so their ids are not reused

    def watch(index):
        def hook(mod, args, out):
            keep.append(out)
            recorder.watched[id(out)] = index
        return hook

    for index, name in enumerate(fused):
        local.get_submodule(name).register_forward_hook(watch(index))
    args, kwargs = per_rank_call(inputs, args, kwargs, tp)  # shards carried in from another module
    try:
        # Tensors the module makes without a device (``torch.full((t, t), -inf)``) are made on meta too.
        with torch.no_grad(), contextlib.nullcontext() if real else meta_device(), recorder:
            out = local(*args, **kwargs)
    except Exception as error:  # a wrong guess usually fails on a shape: that is the answer
        log.debug("local run of %s with %s divided failed: %s", type(module).__name__, names, error)
        return None
    return _shapes(out), recorder.cuts


@contextlib.contextmanager
def meta_device():
    """Run module code on the meta device: tensors it makes without a device are made there, and
    ``torch.autocast(device_type=x.device.type, ...)`` (a norm computing in float32, common in
    plain-PyTorch code) takes ``"meta"`` as ``"cpu"``: torch keeps no autocast state for meta and
    raises "unsupported scalarType", where any autocast is a no-op on meta tensors anyway."""
    autocast = torch.amp.autocast_mode.autocast
    original = autocast.__init__

    def init(self, device_type, *args, **kwargs):
        original(self, "cpu" if device_type == "meta" else device_type, *args, **kwargs)

    autocast.__init__ = init
    try:
        with torch.device("meta"):
            yield
    finally:
        autocast.__init__ = original


def _shapes(out):
    if isinstance(out, torch.Tensor):
        return tuple(out.shape)
    if isinstance(out, (tuple, list)):
        return tuple(_shapes(o) for o in out)
    return None

# Exports of modules alone kept for one block of work that changes no module (a selection: the
# synthesizer's shape proofs, then the checker's over each source's plan, export the same modules
# with the same roles); None outside such a block.
_SHARED_TRACES: contextvars.ContextVar[dict | None] = contextvars.ContextVar("autotp_shared_traces", default=None)


@contextlib.contextmanager
def shared_traces():
    """Within the block, :func:`trace_local` exports each module once per roles, divided names, tp
    and call (shapes of meta inputs; inputs holding values by identity). Only for work that changes
    no module in between: an export is the costly step of every shape proof."""
    if _SHARED_TRACES.get() is not None:
        yield
        return
    token = _SHARED_TRACES.set({})
    try:
        yield
    finally:
        _SHARED_TRACES.reset(token)


def _call_key(inputs) -> tuple:
    """What of a captured call decides an export: each leaf's shape and dtype (a tensor holding
    values, and any other object, by identity), and the arguments carried in."""
    def leaf(value):
        if isinstance(value, torch.Tensor):
            return ("tensor", tuple(value.shape), value.dtype, value.device.type,
                    None if value.device.type == "meta" else id(value))
        return value if value is None or isinstance(value, (int, float, bool, str)) else ("object", id(value))

    leaves, spec = pytree.tree_flatten(inputs)
    return (tuple(leaf(v) for v in leaves), str(spec), repr(getattr(inputs, "carried", ())),
            tuple(id(m) for m in getattr(inputs, "modules", ())))


def trace_local(module: nn.Module, inputs, roles: dict[str, Role], names: tuple[str, ...], tp: int):
    """The analysis graph of a meta copy of ``module`` at per-rank widths (``tp`` 1: global); of a
    copy holding values, exported down the branches its values take, where the inputs hold values.
    Inside :func:`shared_traces`, each distinct export is made once."""
    shared = _SHARED_TRACES.get()
    if shared is None:
        return _trace_local(module, inputs, roles, names, tp)
    # A role's reason and evidence do not change the copy (the checker's roles, read from a plan,
    # say other reasons than the synthesizer's).
    plain = sorted((name, repr(replace(role, reason="", evidence=()))) for name, role in roles.items())
    key = (id(module), tuple(plain), tuple(names), tp, _call_key(inputs))
    if key not in shared:  # the module and inputs kept alive with it, so that no id is reused
        shared[key] = (module, inputs, _trace_local(module, inputs, roles, names, tp))
    return shared[key][2]


def _trace_local(module: nn.Module, inputs, roles: dict[str, Role], names: tuple[str, ...], tp: int):
    real = _real_inputs(inputs)
    # Modules handed in (:class:`ModuleArgument`) join the copy as children, so that their
    # parameters and buffers are named in the trace, where the per-head ones meet the heads.
    local, (args, kwargs) = _local_copy(module, roles, names, tp, real, _snapshot(inputs))
    args, kwargs = per_rank_call(inputs, args, kwargs, tp)  # shards carried in from another module
    bound = {k: v for k, v in kwargs.items() if not _exportable(v)}
    if bound:  # a cache object: handed to the forward as it is, not as an input of the program
        local.forward = functools.partial(local.forward, **bound)
        kwargs = {k: v for k, v in kwargs.items() if k not in bound}
    try:
        if real:
            return build_graph(_export(local, args, kwargs, real_values=True))
        with torch.no_grad(), meta_device():
            graph = build_graph(torch.export.export(local, args, kwargs, strict=False))
        graph.graph["module_alone"] = True  # a module's parameters handed in come as inputs (table_lookup)
        return graph
    except Exception as error:  # cannot trace alone: cannot confirm
        log.debug("export of %s alone failed: %s", type(module).__name__, error)
        return None


def _exportable(value) -> bool:
    """Whether ``torch.export`` takes ``value`` as an input: a pytree of tensors and plain scalars."""
    leaves, _ = pytree.tree_flatten(value)
    return all(leaf is None or isinstance(leaf, (torch.Tensor, int, float, bool, str, torch.dtype, torch.device))
               for leaf in leaves)


def shapes_are_local(g: nx.DiGraph, local: nx.DiGraph, roles: dict[str, Role], tp: int) -> bool:
    """Whether graph ``local`` is ``g`` op for op, with each sharded dim divided by ``tp``.

    The sharded dims are those of :func:`~autotp.synth.propagation.propagate` on ``g`` started from
    the Linears that ``roles`` shards; every other dim must keep its global size (parameters are
    per-rank by construction and not compared).
    """
    flow, expected = per_rank_shapes(g, roles, tp)
    if flow is None:
        return False
    # Copies may vanish at per-rank shapes (``contiguous`` of a tensor with one head is a no-op);
    # a loop over the heads runs only the rank's own heads' iterations (head_loops.py).
    skipped = later_iterations(flow, tp)
    order = lambda graph: sorted(graph.nodes, key=lambda n: graph.nodes[n]["order"])  # noqa: E731
    nodes = [n for n in order(g) if g.nodes[n]["op"] not in PASSTHROUGH and n not in skipped]
    local_nodes = [n for n in order(local) if local.nodes[n]["op"] not in PASSTHROUGH]
    if [g.nodes[n]["op"] for n in nodes] != [local.nodes[n]["op"] for n in local_nodes]:
        return False
    # The same numbers where they are values, not sizes: a scale computed from a width the module
    # reads per rank (``C ** -0.5`` of an input seen at C / tp, ``self.n_embd ** -0.5`` of a divided
    # attribute) would change the math with every shape right.
    if any(_numbers(g.nodes[n]) != _numbers(local.nodes[m]) for n, m in zip(nodes, local_nodes)):
        return False
    spread: set[str] = set()  # replicated tensors repeated to the per-rank heads
    for name, local_name in zip(nodes, local_nodes):
        shape, local_shape = expected.get(name, g.nodes[name]["shape"]), local.nodes[local_name]["shape"]
        state = flow.state.get(name)
        if shape != local_shape and not isinstance(state, tuple) and g.nodes[name]["kind"] == "call":
            if not (_broadcast_to_heads(g, name, shape, local_shape, tp)
                    or _spread_view(g, name, shape, local_shape, tp, spread)):
                return False
            spread.add(name)
    return True


def per_rank_shapes(g: nx.DiGraph, roles: dict[str, Role], tp: int):
    """``(flow, {node: shape})``: the propagation on the module's global trace ``g`` from the
    Linears ``roles`` shards, and each node's shape at per-rank widths (its sharded dim divided by
    ``tp``, sharded parameters included; nodes with no sharded dim are not listed). ``(None, {})`` where a per-head input's
    slicing path cannot be read."""
    active = {n for n in g.nodes if is_linear(g, n) and (kind_of(roles, module_of(g, n)) in _STARTS
                                                          or _raw_column(g, n, roles) or _scatter(g, n, roles)
                                                          or _expert_column(g, n, roles))}
    copied = {n: frozenset(roles[module_of(g, n)].copied) for n in active if roles.get(module_of(g, n)) is not None
              and roles[module_of(g, n)].copied}
    packed = {n for n in active if kind_of(roles, module_of(g, n)) == "packed_column"}
    scattered = frozenset(n for n in active if _scatter(g, n, roles))
    flow = propagate_packed(g, active, packed, module_alone=True, copied=copied, head_scatters=scattered)
    # Per-head parameters, viewed to meet the heads, and constant tensors sized to meet them.
    factories = {node: dim for node, (dim, _) in flow.factory_shards.items()}
    entries, cuts = {}, {}  # inputs sliced at entry; the ops that slice merged heads
    for (node, _), dim in flow.entry_shards.items():
        if isinstance(dim, tuple):  # unflatten -> narrow -> flatten (_slice_entries) of the heads
            path = _slicing_ops(g, node)
            if path is None:
                return None, {}
            cuts.update({path[1]: dim[0] + 1, path[2]: dim[0]})
            entries[path[2]] = dim[0]
        else:
            entries[node] = dim
    experts = _expert_params(g, roles)
    params = {**flow.param_shards, **experts, **factories, **cuts,
              **chain_dims(g, {**flow.param_shards, **factories, **entries, **experts}), **flow.tree_dims}
    expected = {}
    for name in g.nodes:
        shape, state = g.nodes[name]["shape"], flow.state.get(name)
        dim = state.dim if isinstance(state, Shard) else params.get(name)
        if dim is not None and shape is not None:
            width = _held_width(g, flow, roles, state, tp)
            expected[name] = tuple((s // tp if width is None else width) if d == dim else s for d, s in enumerate(shape))
    return flow, expected


def _held_width(g: nx.DiGraph, flow, roles: dict[str, Role], state, tp: int) -> int | None:
    """The per-rank width of a shard over features that hold parts kept whole on every rank (the
    fused output before its cut, :mod:`autotp.synth.copies`); None for an ordinary shard."""
    if not isinstance(state, Shard) or state.span is None or len(state.origins) != 1:
        return None
    role = roles.get(module_of(g, next(iter(state.origins))))
    if role is None or not role.copied or not any(s < state.span[1] and state.span[0] < e for s, e in role.copied):
        return None
    return local_point(role, state.span[1], tp) - local_point(role, state.span[0], tp)


def _spread_view(g: nx.DiGraph, name: str, shape, local_shape, tp: int, spread: set[str]) -> bool:
    """A view of a tensor repeated to the per-rank heads (:func:`_broadcast_to_heads`) that merges
    its size-1 dim away (``k[:, :, None].expand(b, 1, n, t, d).reshape(b, n, t, d)``), or a
    transpose of one (``k.transpose(2, 3)`` for the scores): one dim differs, divided by tp."""
    data = g.nodes[name]
    source = data["args"][0] if data["op"] in VIEW_LIKE | REORDERS and data["args"] else None
    if getattr(source, "name", None) not in spread or local_shape is None or len(shape) != len(local_shape):
        return False
    differ = [(size, local_size) for size, local_size in zip(shape, local_shape) if size != local_size]
    return len(differ) == 1 and differ[0][1] * tp == differ[0][0]


def _numbers(data) -> list:
    """The numbers an op computes with: its float arguments (never sizes) and, of a pointwise op,
    its integers too (``x / 64``); NaN compared as a string."""
    found = []
    for value in (*data["args"], *data["kwargs"].values()):
        if isinstance(value, float):
            found.append("nan" if value != value else value)
        elif isinstance(value, int) and not isinstance(value, bool) and data["op"] in ELEMENTWISE:
            found.append(value)
    return found


def _slicing_ops(g: nx.DiGraph, node: str) -> list[str] | None:
    """The ``unflatten``, ``narrow``, ``flatten`` nodes by which :func:`_slice_entries` cuts input
    ``node``'s merged heads, or None."""
    path, at = [], node
    for op in ("unflatten", "narrow", "flatten"):
        found = [s for s in g.successors(at) if g.nodes[s]["op"] == op]
        if len(found) != 1:
            return None
        path.append(at := found[0])
    return path


def _broadcast_to_heads(g: nx.DiGraph, name: str, shape, local_shape, tp: int) -> bool:
    """A replicated tensor expanded along one dim to the per-rank heads (a shared rotary key
    ``k_rot.expand(*k_nope.shape[:-1], -1)``): only dims that were of size 1 before differ, each
    divided by tp."""
    data = g.nodes[name]
    source = data["args"][0] if data["op"] == "expand" and data["args"] else None
    source_shape = g.nodes[source.name]["shape"] if source is not None and hasattr(source, "name") else None
    if source_shape is None or local_shape is None or len(shape) != len(local_shape):
        return False
    offset = len(shape) - len(source_shape)
    for d, (size, local_size) in enumerate(zip(shape, local_shape)):
        if size != local_size and (local_size * tp != size or (d >= offset and source_shape[d - offset] != 1)):
            return False
    return True


# Roles whose Linear starts a shard in the module re-traced alone.
_STARTS = frozenset({"column", "packed_column", "head"})


def _scatter(g: nx.DiGraph, name: str, roles: dict[str, Role]) -> bool:
    """Whether ``name``'s module is a row whose output stays sharded on the heads (it starts that shard)."""
    role = roles.get(module_of(g, name))
    return role is not None and role.scatter_heads


def _expert_params(g: nx.DiGraph, roles: dict[str, Role]) -> dict[str, int]:
    """The 3-D parameters ``experts`` roles shard, and each expert's weight picked from them
    (``W[e]``) -> their sharded dim: per rank by construction, where the chains from them start."""
    found = {}
    for name, data in g.nodes(data=True):
        if data["kind"] != "param":
            continue
        module, pname = reading_module(g, name)
        role = roles.get(module)
        if role is not None and role.kind == "experts" and pname in dict(role.param_dims):
            dim = dict(role.param_dims)[pname]
            found[name] = dim
            found.update({s: dim - 1 for s in g.successors(name) if dim > 0 and g.nodes[s]["op"] == "select"
                          and g.nodes[s]["args"][1:2] == (0,)})  # one expert's weight, ``W[e]``
    return found


def _expert_column(g: nx.DiGraph, name: str, roles: dict[str, Role]) -> bool:
    """Whether ``name`` multiplies by one expert's weight (``W[e]``) that its module's ``experts``
    role shards on the output features (a column of the pair)."""
    role = roles.get(module_of(g, name))
    weight = weight_of(g, name) if role is not None and role.kind == "experts" else None
    if weight is None or len(g.nodes[weight.node]["shape"] or ()) != 3:
        return False
    return dict(role.param_dims).get(reading_module(g, weight.node)[1]) == weight.out_dim


def _raw_column(g: nx.DiGraph, name: str, roles: dict[str, Role]) -> bool:
    """Whether ``name`` multiplies by a raw parameter its module's ``linear_params`` role shards as a column."""
    role = roles.get(g.nodes[name]["module"])
    return role is not None and role.kind == "linear_params" and raw_weight(g, name) \
        and reading_module(g, linear_weight(g, name))[1] in role.columns
