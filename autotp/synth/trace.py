"""Trace a model once per distinct block type with ``torch.export`` (non-strict, default IR).

Repeated blocks (the entries of an ``nn.ModuleList``) are grouped by structure: class plus parameter
and buffer shapes. Only one representative per group is traced, so tracing cost does not grow with
depth; :class:`LayerGroups` maps the traced FQNs back to every layer they stand for.
"""

from __future__ import annotations

import contextlib
import io
import itertools
import logging
import sys
from dataclasses import dataclass, field

import torch
from torch import nn

from autotp.errors import TraceError, one_line

log = logging.getLogger(__name__)

EXAMPLE_BATCH = 2
# An odd length, so that no sequence dimension coincides with a head or hidden size in the traces.
EXAMPLE_SEQ = 11


@dataclass
class LayerGroups:
    """For each collapsed ``ModuleList`` FQN, the original indices each traced entry stands for."""

    groups: dict[str, list[list[int]]] = field(default_factory=dict)

    def original(self, fqn: str) -> list[str]:
        """Original FQNs that traced module ``fqn`` stands for (itself if it is not in a block).

        >>> LayerGroups({"layers": [[0, 2], [1]]}).original("layers.0.attn")
        ['layers.0.attn', 'layers.2.attn']
        """
        for prefix, groups in self.groups.items():
            head = prefix + "."
            if fqn.startswith(head):
                index, _, rest = fqn[len(head):].partition(".")
                if index.isdigit():
                    tail = "." + rest if rest else ""
                    return [f"{head}{i}{tail}" for i in groups[int(index)]]
        return [fqn]


def block_signature(module: nn.Module) -> tuple:
    """What makes two blocks interchangeable for planning: class and every parameter/buffer shape."""
    params = tuple((n, tuple(p.shape)) for n, p in module.named_parameters())
    buffers = tuple((n, tuple(b.shape)) for n, b in module.named_buffers())
    modules = tuple((n, type(m).__name__) for n, m in module.named_modules())
    return (type(module).__name__, params, buffers, modules)


def repeated_lists(model: nn.Module) -> dict[str, nn.ModuleList]:
    """Outermost ``ModuleList``s with more than one entry (decoder layers), by FQN."""
    found: dict[str, nn.ModuleList] = {}
    for name, module in model.named_modules():
        if isinstance(module, nn.ModuleList) and len(module) > 1:
            if not any(name.startswith(outer + ".") for outer in found):
                found[name] = module
    return found


def group_entries(entries: nn.ModuleList) -> list[list[int]]:
    """Indices of structurally identical entries, groups in order of first appearance."""
    groups: dict[tuple, list[int]] = {}
    for index, entry in enumerate(entries):
        groups.setdefault(block_signature(entry), []).append(index)
    return list(groups.values())


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
def collapsed(model: nn.Module, like: LayerGroups | None = None):
    """Temporarily keep one entry per structural group in every repeated ``ModuleList``.

    Args:
        like: collapse exactly as this :class:`LayerGroups` says (the one :func:`trace` returned,
            empty when the model had to be traced whole), so that traced FQNs name the same modules.

    Yields:
        :class:`LayerGroups` for the FQNs of the collapsed model.
    """
    layer_groups, restore = LayerGroups(), []
    try:
        for name, entries in repeated_lists(model).items():
            groups = group_entries(entries) if like is None else like.groups.get(name)
            if groups is None:
                continue
            if len(groups) == len(entries):
                continue
            keep = [g[0] for g in groups]
            parent_name, _, attr = name.rpartition(".")
            parent = model.get_submodule(parent_name)
            setattr(parent, attr, nn.ModuleList([entries[i] for i in keep]))
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
    # An explicit all-ones mask: without one, transformers probes position ids for packed
    # sequences with a data-dependent branch (sliding-window masks) that torch.export cannot trace.
    return (), {"input_ids": ids, "attention_mask": torch.ones_like(ids), "use_cache": False}


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


def export_model(model: nn.Module, example_inputs=None) -> torch.export.ExportedProgram:
    """``torch.export.export(strict=False)`` with good errors; inputs from the config if not given.

    A branch on a tensor's value (dynamic-NTK rotary embeddings test ``position_ids.max()``) cannot
    be traced on fake tensors. When it sits in a module without parameters, the branch can change
    the values it computes (position tables) but not which parameters run or how, so for a
    materialised model the export is retried with real values propagated: the graph follows the
    branch these inputs take. A branch in a module with parameters could skip a Linear, or use it
    differently, on other inputs than the ones traced, so it stays an error.

    Raises:
        TraceError: no inputs could be made, or export failed.
    """
    args, kwargs = example_args(model, example_inputs)
    try:
        return _export(model, args, kwargs, real_values=False)
    except Exception as error:  # export raises many unrelated types; all mean "cannot trace"
        if _data_dependent(error) and not _on_meta(model) and _parameter_free(model, error):
            log.info("export met a data-dependent branch; retrying with real values: %s", error)
            try:
                return _export(model, args, kwargs, real_values=True)
            except Exception:  # report the first failure: it names the branch
                pass
        raise _trace_error(model, error) from error


def _export(model: nn.Module, args: tuple, kwargs: dict, *, real_values: bool) -> torch.export.ExportedProgram:
    import torch._functorch.config as functorch_config

    with torch.no_grad(), _quiet(_EXPORT_LOGGERS), \
            functorch_config.patch(fake_tensor_propagate_real_tensors=real_values):
        return torch.export.export(model, args, kwargs, strict=False)


def _data_dependent(error: BaseException) -> bool:
    from torch.fx.experimental.symbolic_shapes import GuardOnDataDependentSymNode

    return isinstance(error, GuardOnDataDependentSymNode) or "data-dependent" in str(error)


def _parameter_free(model: nn.Module, error: BaseException) -> bool:
    """Whether the innermost module running when ``error`` was raised holds no parameters."""
    from autotp.synth.validate import failing_module

    where = failing_module(model, error)
    if where is None:
        return False
    module = model if where == "<root>" else model.get_submodule(where)
    return next(module.parameters(), None) is None


def _on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in itertools.chain(model.parameters(), model.buffers()))


def _trace_error(model: nn.Module, error: BaseException) -> TraceError:
    from autotp.synth.validate import failing_module

    where = failing_module(model, error)
    inside = f" inside {where}" if where else ""
    hint = ""
    if _data_dependent(error) and _on_meta(model):
        hint = ("The forward branches on a tensor's value, which a meta-device model cannot decide: "
                "synthesize on a materialised model of the same config (e.g. built tiny on cpu), or ")
    return TraceError(
        f"{type(model).__name__}: torch.export.export(strict=False) failed{inside}: "
        f"{one_line(error, 10_000)}. "
        f"{hint}{'p' if hint else 'P'}ass example_inputs that the forward accepts (shapes that avoid the failing "
        f"branch), or write the plan by hand and leave {where or 'that module'} replicated (no plan key for it)."
    )


def trace(model: nn.Module, example_inputs=None) -> tuple[torch.export.ExportedProgram, LayerGroups]:
    """Export ``model`` with repeated blocks collapsed; retry uncollapsed if the forward needs them all.

    Returns:
        The exported program and the :class:`LayerGroups` mapping traced FQNs to the model's.
    """
    try:
        with collapsed(model) as groups:
            return export_model(model, example_inputs), groups
    except TraceError:
        if not repeated_lists(model):
            raise
    # Traced whole: every entry stands for itself (plan keys still fold into ``layers.*``).
    whole = LayerGroups({name: [[i] for i in range(len(entries))] for name, entries in repeated_lists(model).items()})
    return export_model(model, example_inputs), whole
