"""Trace a model once per distinct block type with ``torch.export`` (non-strict, default IR).

Repeated blocks (the entries of an ``nn.ModuleList``, ``nn.ModuleDict`` or ``nn.Sequential``) are grouped by structure: class plus parameter
and buffer shapes. Only one representative per group is traced, so tracing cost does not grow with
depth; :class:`LayerGroups` maps the traced FQNs back to every layer they stand for.

Long because layer grouping, export with its retries, and the module-state guard around it are
one concern: getting a program from a model that torch.export accepts.
"""

from __future__ import annotations

import contextlib
import copy
import io
import itertools
import logging
import sys
from dataclasses import dataclass, field

import torch
from torch import nn
from torch._subclasses.fake_tensor import FakeTensorMode
from torch.utils import _pytree as pytree

from autotp.errors import TraceError, one_line
from autotp.synth.validate import failing_module

log = logging.getLogger(__name__)

EXAMPLE_BATCH = 2
# An odd length, so that no sequence dimension coincides with a head or hidden size in the traces.
EXAMPLE_SEQ = 11


@dataclass
class LayerGroups:
    """For each collapsed layer stack's FQN, the entries each traced entry stands for.

    An entry is named by its position in an ``nn.ModuleList`` or ``nn.Sequential`` (an ``int``) or
    by its key in an ``nn.ModuleDict`` (a ``str``: torchtitan keys its layers ``"0"``, ``"1"``...).
    A collapsed list renumbers its entries, so the i-th group stands behind traced index ``i``; a
    collapsed dict keeps its keys, so a group stands behind the key of its first entry.
    """

    groups: dict[str, list[list[int | str]]] = field(default_factory=dict)

    def group_of(self, prefix: str, key: str) -> list[int | str] | None:
        """The entries that traced entry ``key`` of stack ``prefix`` stands for (None if unknown).

        >>> LayerGroups({"layers": [["a", "c"], ["b"]]}).group_of("layers", "b")
        ['b']
        """
        groups = self.groups.get(prefix, [])
        if groups and isinstance(groups[0][0], str):
            return next((g for g in groups if g[0] == key), None)
        if key.isdigit() and int(key) < len(groups):
            return groups[int(key)]
        return None

    def original(self, fqn: str) -> list[str]:
        """Original FQNs that traced module ``fqn`` stands for (itself if it is not in a block).

        >>> LayerGroups({"layers": [[0, 2], [1]]}).original("layers.0.attn")
        ['layers.0.attn', 'layers.2.attn']
        >>> LayerGroups({"layers": [["0", "2"], ["1"]]}).original("layers.1")
        ['layers.1']
        """
        for prefix in self.groups:
            head = prefix + "."
            if fqn.startswith(head):
                key, _, rest = fqn[len(head):].partition(".")
                group = self.group_of(prefix, key)
                if group is not None:
                    tail = "." + rest if rest else ""
                    return [f"{head}{entry}{tail}" for entry in group]
        return [fqn]


def block_signature(module: nn.Module | None) -> tuple:
    """What makes two blocks interchangeable for planning: class, every parameter/buffer shape, and
    where the block's optional slots are empty.

    A container may hold ``None`` for a slot a layer leaves out (a per-layer norm that is off, an
    absent residual combiner). ``named_modules`` skips such slots, so they are listed apart: two
    layers are interchangeable only if their empty slots are at the same places. An empty entry
    itself is interchangeable with another empty entry only.

    >>> block_signature(None)
    ('NoneType',)
    >>> a = nn.ModuleList([None, nn.Linear(2, 2)])
    >>> block_signature(a) == block_signature(nn.ModuleList([nn.Linear(2, 2), None]))
    False
    """
    if module is None:
        return ("NoneType",)
    params = tuple((n, tuple(p.shape)) for n, p in module.named_parameters())
    buffers = tuple((n, tuple(b.shape)) for n, b in module.named_buffers())
    modules = tuple((n, type(m).__name__) for n, m in module.named_modules())
    return (type(module).__name__, params, buffers, modules, tuple(empty_slots(module)))


# Containers that can hold a stack of layers. A ModuleList is a stack whenever it has two entries
# (kept as before: expert lists inside a block are found as the block's, not as stacks). A
# ModuleDict (torchtitan and olmo-core key layers by their index, so that pipeline stages keep
# FQNs) or a Sequential is one if two of its entries are the same block, or if it numbers its
# entries and every entry is a block (a dense layer, then MoE layers). A ModuleDict of unrelated
# parts (nanoGPT's ``transformer = ModuleDict(wte=..., h=..., ln_f=...)``) or a Sequential MLP
# (Linear, GELU, Linear) is not.
_STACK_TYPES = (nn.ModuleList, nn.ModuleDict, nn.Sequential)


def stack_entries(stack: nn.Module) -> list[tuple[int | str, nn.Module | None]]:
    """``(name, entry)`` of a layer stack: dict keys for a ModuleDict, positions otherwise.

    An empty slot is listed too, as ``None``: positions must stay those the forward indexes by.
    """
    if isinstance(stack, nn.ModuleDict):
        return list(stack.items())
    return list(enumerate(stack))


def is_layer_stack(module: nn.Module) -> bool:
    """Whether ``module`` is a container of layers (see ``_STACK_TYPES``).

    >>> block = lambda: nn.Sequential(nn.Linear(2, 2))
    >>> is_layer_stack(nn.ModuleDict({"0": block(), "1": nn.Sequential(nn.Linear(2, 4))}))
    True
    >>> is_layer_stack(nn.ModuleDict({"wte": nn.Embedding(4, 2), "h": nn.ModuleList([block()])}))
    False
    """
    if not isinstance(module, _STACK_TYPES) or len(module) < 2:
        return False
    if isinstance(module, nn.ModuleList):
        return True
    entries = dict(stack_entries(module))
    # An empty slot (``None``) is no block: it holds nothing to run.
    is_block = {key: entry is not None and next(entry.children(), None) is not None
                for key, entry in entries.items()}
    if any(len(group) > 1 and is_block[group[0]] for group in group_entries(module)):
        return True
    return all(str(key).isdigit() for key in entries) and all(is_block.values())


def repeated_lists(model: nn.Module) -> dict[str, nn.Module]:
    """Outermost layer stacks (``ModuleList``, ``ModuleDict``, ``Sequential``; see ``_STACK_TYPES``), by FQN."""
    found: dict[str, nn.Module] = {}
    for name, module in model.named_modules():
        # The root cannot be swapped for a collapsed copy of itself: only stacks below it count.
        if name and is_layer_stack(module) and not any(name.startswith(outer + ".") for outer in found):
            found[name] = module
    return found


def group_entries(entries: nn.Module) -> list[list[int | str]]:
    """Names (positions, or dict keys) of structurally identical entries, in order of first appearance.

    >>> group_entries(nn.ModuleDict({"a": nn.Linear(2, 2), "b": nn.ReLU(), "c": nn.Linear(2, 2)}))
    [['a', 'c'], ['b']]
    """
    groups: dict[tuple, list[int | str]] = {}
    for name, entry in stack_entries(entries):
        groups.setdefault(block_signature(entry), []).append(name)
    return list(groups.values())


def lockstep_groups(stacks: dict[str, nn.Module], calls: dict[str, dict] | None = None
                    ) -> dict[str, list[list[int | str]]]:
    """:func:`group_entries` for each stack, with stacks of one length grouped together: entry ``i``
    of one goes with entry ``i`` of the others.

    A forward often reads two stacks in step (``zip(self.blocks, self.input_norms)``, or
    ``self.input_norms[i]`` for block ``i``). Collapsed each on its own, they would keep different
    entries, and the trace would pair the kept block with the wrong norm: an optional norm list
    ``[None, norm, norm]`` beside three alike blocks kept ``[None, norm]`` for one block, so the
    norms were never traced and never planned. Grouped in step, both keep the same positions.

    ``calls`` (:func:`call_signatures`) splits entries of one structure
    that the forward calls with different arguments (``prev_attn=None`` for the first layer, the
    previous layer's scores for the others): each runs code the other does not.

    >>> blocks = nn.ModuleList([nn.Linear(2, 2) for _ in range(3)])
    >>> norms = nn.ModuleList([None, nn.LayerNorm(2), nn.LayerNorm(2)])
    >>> lockstep_groups({"blocks": blocks, "norms": norms})
    {'blocks': [[0], [1, 2]], 'norms': [[0], [1, 2]]}
    """
    by_length: dict[int, list[str]] = {}
    for name, stack in stacks.items():
        by_length.setdefault(len(stack), []).append(name)
    out: dict[str, list[list[int | str]]] = {}
    for length, names in by_length.items():
        entries = {name: stack_entries(stacks[name]) for name in names}
        positions: dict[tuple, list[int]] = {}
        for i in range(length):
            key = tuple((block_signature(entries[name][i][1]),
                         (calls or {}).get(name, {}).get(entries[name][i][0])) for name in names)
            positions.setdefault(key, []).append(i)
        for name in names:
            out[name] = [[entries[name][i][0] for i in group] for group in positions.values()]
    return out


def _kept(stack: nn.Module, keep: list[int | str]) -> nn.Module:
    """A shallow copy of ``stack`` (same class, so a custom ``forward`` still runs) holding only the
    entries named in ``keep``: under their keys for a ModuleDict, renumbered from 0 otherwise."""
    entries = dict(stack_entries(stack))
    copy_ = copy.copy(stack)
    names = keep if isinstance(stack, nn.ModuleDict) else range(len(keep))
    copy_._modules = dict(zip((str(n) for n in names), (entries[k] for k in keep)))
    return copy_


def _per_layer_config_lists(model: nn.Module, length: int) -> list[tuple[object, str, list]]:
    """Config lists with one entry per layer (``layer_types``), which must shrink with the layers."""
    found = []
    for module in model.modules():
        config = getattr(module, "config", None)
        if config is None or not hasattr(config, "__dict__"):
            continue
        for key, value in vars(config).items():
            if isinstance(value, list) and len(value) == length:
                found.append((config, key, value))
    return found


@contextlib.contextmanager
def collapsed(model: nn.Module, like: LayerGroups | None = None, calls: dict[str, dict] | None = None):
    """Temporarily keep one entry per structural group in every layer stack (:func:`repeated_lists`;
    stacks of one length are grouped in step, :func:`lockstep_groups`).

    Args:
        like: collapse exactly as this :class:`LayerGroups` says (the one :func:`trace` returned,
            empty when the model had to be traced whole), so that traced FQNs name the same modules.
        calls: the layers' call signatures (:func:`lockstep_groups`), when ``like`` is None.

    Yields:
        :class:`LayerGroups` for the FQNs of the collapsed model.
    """
    layer_groups, restore = LayerGroups(), []
    stacks = repeated_lists(model)
    grouped = lockstep_groups(stacks, calls) if like is None else like.groups
    try:
        for name, entries in stacks.items():
            groups = grouped.get(name)
            if groups is None:
                continue
            if len(groups) == len(entries):  # nothing to drop; still a stack of layers (a dense, a MoE)
                layer_groups.groups[name] = groups
                continue
            keep = [g[0] for g in groups]
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, _kept(entries, keep))
            restore.append(lambda p=parent, a=attr, e=entries: setattr(p, a, e))
            for config, key, value in _per_layer_config_lists(model, len(entries)):
                setattr(config, key, [value[i] for i in keep])
                restore.append(lambda c=config, k=key, v=value: setattr(c, k, v))
            layer_groups.groups[name] = groups
        yield layer_groups
    finally:
        for undo in reversed(restore):
            undo()


def _device(model: nn.Module) -> torch.device:
    for p in model.parameters():
        return p.device
    return torch.device("cpu")


def hf_example_inputs(model: nn.Module) -> tuple[tuple, dict] | None:
    """``input_ids`` of shape (2, 11) and a full attention mask for a transformers model, else None."""
    config = getattr(model, "config", None)
    if config is None:
        return None
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    vocab = getattr(text, "vocab_size", None)
    if vocab is None:
        return None
    ids = torch.randint(0, vocab, (EXAMPLE_BATCH, EXAMPLE_SEQ), device=_device(model))
    # An explicit mask: without one, transformers probes position ids for packed sequences with a
    # data-dependent branch (sliding-window masks) that torch.export cannot trace. One row is
    # left-padded, so that the code a padded batch runs is traced too (a mixer that zeroes the
    # padded positions of its input: a shared DTensor there would meet the plain mask).
    mask = torch.ones_like(ids)
    mask[0, 0] = 0
    return (), {"input_ids": ids, "attention_mask": mask, "use_cache": False}


def _split_inputs(example_inputs) -> tuple[tuple, dict]:
    if isinstance(example_inputs, dict):
        return (), dict(example_inputs)
    if isinstance(example_inputs, torch.Tensor):
        return (example_inputs,), {}
    return tuple(example_inputs), {}


def example_args(model: nn.Module, example_inputs=None) -> tuple[tuple, dict]:
    """``(args, kwargs)`` for one forward: ``example_inputs`` split, or made from the config.

    Raises:
        TraceError: no inputs given and none can be made.
    """
    if example_inputs is not None:
        return _split_inputs(example_inputs)
    made = hf_example_inputs(model)
    if made is None:
        raise TraceError(
            f"{type(model).__name__}: no example inputs given and the model has no transformers "
            "config to make input_ids from. Pass example_inputs=(tensor, ...) or a kwargs dict."
        )
    return made


# Loggers that warn about each data-dependent guard export meets; the TraceError raised below
# already names the module and the way out.
_EXPORT_LOGGERS = ("torch.fx.experimental.symbolic_shapes",)


@contextlib.contextmanager
def _quiet(names: tuple[str, ...]):
    """Silence ``names`` below ERROR, and hold back what is printed to stderr meanwhile: on a failed
    export torch prints the whole partial graph there. Passed on only if the block succeeds."""
    loggers = [logging.getLogger(n) for n in names]
    levels = [lg.level for lg in loggers]
    for lg in loggers:
        lg.setLevel(logging.ERROR)
    held = io.StringIO()
    try:
        with contextlib.redirect_stderr(held):
            yield
        sys.stderr.write(held.getvalue())
    finally:
        for lg, level in zip(loggers, levels):
            lg.setLevel(level)


@contextlib.contextmanager
def restored_module_state(model: nn.Module):
    """Within the block, tracing may write fake tensors into module attributes; on exit they go.

    A module that saves state in its forward (a recurrent block's ``self.recurrent_states = h``)
    keeps the fake tensor ``torch.export`` ran it on. Left there, it drags the trace's fake mode into
    the user's later real runs (copies of such a model corrupted memory under simulated ranks). Each
    attribute holding a fake tensor on exit gets back the value it had before, or is removed if it
    did not exist. Parameters, buffers and submodules are not plain attributes and are not touched.
    A fake tensor kept in a mapping attribute (a cache of rotary tables) is dropped from it: the
    module builds it again on its next call.
    """
    before = {module: dict(vars(module)) for module in model.modules()}
    try:
        yield
    finally:
        drop_fake_state(model, before)


def drop_fake_state(model: nn.Module, saved: dict | None = None) -> None:
    """Remove the fake tensors tracing left in ``model``'s plain attributes and in mappings they
    hold; an attribute in ``saved`` (module -> its ``vars`` before) gets its old value back."""
    from collections.abc import MutableMapping

    from torch._subclasses.fake_tensor import FakeTensor

    for module in model.modules():
        old = (saved or {}).get(module, {})
        for name, value in list(vars(module).items()):
            if isinstance(value, MutableMapping) and not isinstance(value, nn.Module):
                for key in [k for k, v in list(value.items()) if isinstance(v, FakeTensor)]:
                    del value[key]
            if not isinstance(value, FakeTensor):
                continue
            if name in old and not isinstance(old[name], FakeTensor):
                module.__dict__[name] = old[name]
            else:
                del module.__dict__[name]


def export_model(model: nn.Module, example_inputs=None) -> torch.export.ExportedProgram:
    """``torch.export.export(strict=False)`` with good errors; inputs from the config if not given.

    A branch or a loop on a tensor's value (dynamic-NTK rotary embeddings test ``position_ids.max()``;
    an MoE loops over the experts its tokens picked and skips those none picked) cannot be traced
    on fake tensors. For a materialised model the export is retried with real values propagated:
    the graph follows the branches these inputs take, with shapes specialised to them. A branch in
    a module without parameters can change the values it computes (position tables) but not which
    parameters run or how. One in a module with parameters could skip a Linear, or use it
    differently, on other inputs than the ones traced: the program then names that module in
    ``graph_module.meta[VALUE_BRANCHES]``, and the plan made from it is checked numerically before
    it is handed out (:func:`autotp.synth.api.check_value_branches`).

    A module that stores tensors on itself while traced (a rotary cache of sin/cos tables kept in
    a dict) is given its state back after each export (:func:`drop_fake_state`): the next export, or
    a copy of the module, would otherwise meet the fake tensors of this one.

    Raises:
        TraceError: no inputs could be made, or export failed.
    """
    args, kwargs = example_args(model, example_inputs)
    try:
        return _export(model, args, kwargs, real_values=False)
    except Exception as error:  # export raises many unrelated types; all mean "cannot trace"
        if data_dependent(error) and not on_meta(model):
            log.info("export met a data-dependent branch; retrying with real values: %s", error)
            try:
                with _value_guards(model) as decided:
                    program = _export(model, args, kwargs, real_values=True)
            except Exception:  # report the first failure: it names the branch
                pass
            else:
                decided.append(failing_module_name(model, error))
                holding = sorted({fqn for fqn in decided if not _parameter_free_module(model, fqn)})
                if holding:
                    program.graph_module.meta[VALUE_BRANCHES] = ", ".join(holding)
                return program
        raise _trace_error(model, error) from error


@contextlib.contextmanager
def _value_guards(model: nn.Module):
    """Collect the FQN of the module running each time a guard is decided by a real value.

    Export logs each such decision (``propagate_real_tensors evaluate_expr(...)``) as a warning from
    inside the forward that asked, so the stack then names the module. The records are kept from
    the user: the decisions are reported as the program's :data:`VALUE_BRANCHES` instead.
    """
    names = {id(module): name for name, module in model.named_modules()}
    decided: list[str] = []

    class _Record(logging.Handler):
        def emit(self, record):
            if str(record.msg).startswith("propagate_real_tensors"):
                decided.append(_running_module(names) or type(model).__name__)

    logger = logging.getLogger(_EXPORT_LOGGERS[0])
    handler, level, propagate = _Record(), logger.level, logger.propagate
    logger.addHandler(handler)
    logger.setLevel(logging.WARNING)
    logger.propagate = False
    try:
        yield decided
    finally:
        logger.removeHandler(handler)
        logger.setLevel(level)
        logger.propagate = propagate


def _running_module(names: dict[int, str]) -> str | None:
    """FQN of the innermost module in ``names`` whose code is on the current stack (as
    :func:`~autotp.synth.validate.failing_module` reads a traceback)."""
    frame = sys._getframe(1)
    while frame is not None:
        owner = frame.f_locals.get("self")
        if id(owner) in names and not frame.f_code.co_name.startswith("_"):
            return names[id(owner)] or "<root>"
        frame = frame.f_back
    return None


def _parameter_free_module(model: nn.Module, fqn: str) -> bool:
    """Whether the module ``fqn`` of ``model`` (``<root>`` for the model) holds no parameters; a name
    that is no module (the model's class, where none was found) counts as holding some."""
    if fqn == "<root>":
        module = model
    else:
        try:
            module = model.get_submodule(fqn)
        except AttributeError:
            return False
    return next(module.parameters(), None) is None


# Key of ``graph_module.meta`` naming the module with parameters whose value-dependent branches the
# program follows for its example inputs only (see :func:`export_model`).
VALUE_BRANCHES = "autotp_value_branches"


def failing_module_name(model: nn.Module, error: BaseException) -> str:
    """FQN of the module running when ``error`` was raised, or the model's class if none is known."""
    return failing_module(model, error) or type(model).__name__


@contextlib.contextmanager
def _real_parameter_values():
    """Parameters fakified with their own values when export propagates real values.

    torch 2.13 gives each fake tensor the value of the tensor it stands for through
    ``meta_utils._safe_copy`` / ``_safe_clone``, which take only an exact ``torch.Tensor``: an
    ``nn.Parameter`` is skipped and its fake keeps uninitialised memory as its "real" value. A
    router computing its scores from such a weight then picks experts at random (LongCat-Flash's
    router, whose ``weight.type(torch.float32)`` scores sent every token to two zero-compute
    experts), and the graph follows branches no real input takes. A parameter's ``.data`` (a plain
    tensor, read without dispatch) is passed in its place.
    """
    from torch._subclasses import meta_utils

    copy_, clone = getattr(meta_utils, "_safe_copy", None), getattr(meta_utils, "_safe_clone", None)
    if copy_ is None or clone is None:  # another torch: nothing to mend here
        yield
        return

    def plain(src):
        return src.data if isinstance(src, nn.Parameter) else src

    meta_utils._safe_copy = lambda dst, src: copy_(dst, plain(src))
    meta_utils._safe_clone = lambda src: clone(plain(src))
    try:
        yield
    finally:
        meta_utils._safe_copy, meta_utils._safe_clone = copy_, clone


class _NonzeroTuples(torch.overrides.TorchFunctionMode):
    """``torch.where(c)`` and ``nonzero(as_tuple=True)`` as ``c.nonzero().unbind(1)`` (the same
    tensors). Traced with real values, torch 2.13's own decomposition of those two loses the
    unbacked size of its result (``PendingUnbackedSymbolNotFound``); the spelled-out form keeps it.
    """

    def __torch_function__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        tensor = args[0] if args else kwargs.get("condition", kwargs.get("input"))
        tuples = ((func is torch.where and len(args) + len(kwargs) == 1)
                  or (func in (torch.nonzero, torch.Tensor.nonzero) and kwargs.get("as_tuple")))
        if tuples and isinstance(tensor, torch.Tensor) and tensor.dim() > 0:
            return tensor.nonzero().unbind(1)
        return func(*args, **kwargs)


def _export(model: nn.Module, args: tuple, kwargs: dict, *, real_values: bool) -> torch.export.ExportedProgram:
    import torch._functorch.config as functorch_config

    before = {module: dict(vars(module)) for module in model.modules()}
    rewrites = _NonzeroTuples() if real_values else contextlib.nullcontext()
    params = _real_parameter_values() if real_values else contextlib.nullcontext()
    try:
        # With real values, the loggers are left to :func:`_value_guards`, which reads and keeps them.
        with torch.no_grad(), _quiet(() if real_values else _EXPORT_LOGGERS), rewrites, params, \
                functorch_config.patch(fake_tensor_propagate_real_tensors=real_values):
            return torch.export.export(model, args, kwargs, strict=False)
    finally:
        drop_fake_state(model, before)


def data_dependent(error: BaseException) -> bool:
    """Whether ``error`` is a branch or read on a tensor's value that fake tensors cannot decide."""
    from torch._subclasses.fake_tensor import DataDependentOutputException, DynamicOutputShapeException
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    # DynamicOutputShapeException: an op whose output size is a value (``nonzero``) met on fake
    # tensors without a shape environment (the capture forward of :mod:`~autotp.synth.local_run`).
    kinds = (GuardOnDataDependentSymNode, DataDependentOutputException, DynamicOutputShapeException)
    return (isinstance(error, kinds)
            or "data-dependent" in str(error))


def on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def empty_slots(model: nn.Module) -> list[str]:
    """FQNs of the empty slots (``None`` entries) of ``model``'s containers and module attributes.

    >>> empty_slots(nn.Sequential(nn.ModuleList([nn.Linear(2, 2), None])))
    ['0.1']
    """
    return [f"{name}.{slot}" if name else slot for name, module in model.named_modules()
            for slot, child in module._modules.items() if child is None]


def _trace_error(model: nn.Module, error: BaseException) -> TraceError:
    where = failing_module(model, error)
    inside = f" inside {where}" if where else ""
    hint = ""
    slots = empty_slots(model)
    if isinstance(error, TypeError) and "'NoneType'" in str(error) and slots:
        shown = ", ".join(slots[:6]) + (f" and {len(slots) - 6} more" if len(slots) > 6 else "")
        hint = (f"The model holds empty slots (None) at {shown}: skip them in the forward "
                "(`if norm is not None`), or put nn.Identity() there; or ")
    elif data_dependent(error) and on_meta(model):
        hint = ("The forward branches on a tensor's value, which a meta-device model cannot decide: "
                "synthesize on a materialised model of the same config (e.g. built tiny on cpu), or ")
    return TraceError(
        f"{type(model).__name__}: torch.export.export(strict=False) failed{inside}: "
        f"{one_line(error, 10_000)}. "
        f"{hint}{'p' if hint else 'P'}ass example_inputs that the forward accepts (shapes that avoid the failing "
        f"branch), or write the plan by hand and leave {where or 'that module'} replicated (no plan key for it)."
    )


# ------------------------------------------------- layers of one structure called differently
#
# Layers of one structure that their stack calls differently are traced apart.
#
# :func:`autotp.synth.trace.collapsed` traces one layer per structural group. That is right when every
# layer of a group runs the same code, and wrong when the stack hands some layers a value it hands
# others as ``None``: residual attention (layer ``i`` adds layer ``i - 1``'s pre-softmax scores), a
# value residual (later layers mix the first layer's values into theirs), anything a layer returns
# and the next receives. Traced from the first layer alone, the code that reads the handed-on value
# is never seen: the plan for the later layers is a guess (a Linear only they call is never planned,
# and a plan that crashed with "got mixed torch.Tensor and DTensor" was the result).
#
# :func:`call_signatures` runs the model once on fake tensors, each layer stack cut to the first
# entries of each structural group, and records, for every entry, which of its call's arguments are
# tensors, which are ``None`` and which are other objects (no values, no shapes: a layer index passed
# as an ``int`` does not split a group).
# :func:`autotp.synth.trace.lockstep_groups` groups entries by structure and call together.

def _leaf_kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if value is None:
        return "none"
    return type(value).__name__


def call_signature(args: tuple, kwargs: dict) -> tuple:
    """The structure of one call: the pytree spec, each leaf a tensor / ``None`` / a type name.

    >>> call_signature((torch.ones(1), None), {}) == call_signature((torch.zeros(2), None), {})
    True
    >>> call_signature((torch.ones(1), None), {}) == call_signature((torch.ones(1), torch.ones(1)), {})
    False
    """
    leaves, spec = pytree.tree_flatten((args, dict(sorted(kwargs.items()))))
    return str(spec), tuple(_leaf_kind(leaf) for leaf in leaves)


# Entries of each structural group run by the fake forward: the first layers are where calls differ
# (the first layer gets no previous scores, no first values); the rest are taken to be called as the
# last of these. A stack of 80 layers costs 3 per group, not 80.
SAMPLED = 3


def call_signatures(model: nn.Module, example_inputs, stacks: dict[str, nn.Module]) -> dict[str, dict]:
    """For each stack in ``stacks`` (FQN -> container), ``{entry key: call signature}``, from one
    fake forward of the model with each structural group cut to its first :data:`SAMPLED` entries
    (first call of each); entries after those get the signature of the last one run. Empty when the
    forward cannot run on fake tensors: grouping then falls back to structure alone."""
    structural = lockstep_groups(stacks)
    found: dict[str, dict] = {name: {} for name in stacks}
    handles = []
    for name, stack in stacks.items():
        entries = dict(stack_entries(stack))
        for group in structural.get(name, []):
            for key in group[:SAMPLED]:
                if entries[key] is None:
                    continue

                def hook(module, args, kwargs, name=name, key=key):
                    found[name].setdefault(key, call_signature(args, kwargs))

                handles.append(entries[key].register_forward_pre_hook(hook, with_kwargs=True))
    order = {name: {key: i for i, (key, _) in enumerate(stack_entries(stack))} for name, stack in stacks.items()}
    # One group per sampled entry: collapsed() keeps the first entry of each group.
    sampled = LayerGroups({name: [[k] for k in sorted((k for g in groups for k in g[:SAMPLED]), key=order[name].get)]
                           for name, groups in structural.items()})
    try:
        args, kwargs = example_args(model, example_inputs)
        with collapsed(model, sampled), restored_module_state(model):  # no fake rotary cache left behind
            failed = _fake_forward(model, args, kwargs, real_values=False)
    except Exception as error:  # no inputs: the trace reports that itself
        failed = error
    finally:
        for handle in handles:
            handle.remove()
    if failed is not None:
        log.debug("call signatures of layer stacks unknown (%s): grouping by structure alone", failed)
        return {}
    for name, groups in structural.items():
        for group in groups:
            last = next((found[name][k] for k in reversed(group[:SAMPLED]) if k in found[name]), None)
            for key in group[SAMPLED:]:
                found[name][key] = last
    return found


@contextlib.contextmanager
def _as_traced():
    """Run model code down the branches ``torch.export`` took: it reports compiling while it traces
    (transformers picks, for instance, a grouped matmul that fake tensors accept only in bf16 when
    not compiling), and the graph the proof checks is the traced one."""
    before = torch.compiler._is_compiling_flag
    torch.compiler._is_compiling_flag = True
    try:
        yield
    finally:
        torch.compiler._is_compiling_flag = before


def _fake_forward(model: nn.Module, args: tuple, kwargs: dict, *, real_values: bool) -> Exception | None:
    """One forward of ``model`` on fake tensors, or on the real inputs if ``real_values``; the error
    that stopped it, if any."""
    try:
        with torch.no_grad(), _as_traced():
            if real_values:
                model(*args, **kwargs)
                return None
            with FakeTensorMode(allow_non_fake_inputs=True) as mode:
                # Inputs as fake tensors too: model code that skips value checks while tracing
                # (``torch.all(mask == 1)``) recognises them, where a real input would be read.
                fake = lambda t: mode.from_tensor(t) if isinstance(t, torch.Tensor) else t  # noqa: E731
                model(*[fake(a) for a in args], **{k: fake(v) for k, v in kwargs.items()})
    except Exception as error:  # the modules it reached are judged; the others cannot be
        log.debug("fake forward for localization failed: %s", error)
        return error
    return None


def trace(model: nn.Module, example_inputs=None) -> tuple[torch.export.ExportedProgram, LayerGroups]:
    """Export ``model`` with repeated blocks collapsed; retry uncollapsed if the forward needs them all.

    Returns:
        The exported program and the :class:`LayerGroups` mapping traced FQNs to the model's.
    """
    stacks = repeated_lists(model)
    calls = call_signatures(model, example_inputs, stacks) if stacks else {}
    try:
        with collapsed(model, calls=calls) as groups:
            return export_model(model, example_inputs), groups
    except TraceError:
        if not repeated_lists(model):
            raise
    # Traced whole: every entry stands for itself (plan keys still fold into ``layers.*``).
    whole = LayerGroups({name: [[key] for key, _ in stack_entries(entries)]
                         for name, entries in repeated_lists(model).items()})
    return export_model(model, example_inputs), whole
