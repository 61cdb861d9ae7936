"""Text the ``autotp`` command prints: plan tables, and warnings summarized one line per kind.

Nothing here imports torch or transformers at module level (``autotp --help`` imports this module).
"""

from __future__ import annotations

import contextlib
import re
import sys
import warnings

# --- quiet runs: warnings summarized, transformers' token-id complaints and torch's tracebacks dropped


@contextlib.contextmanager
def summarized_warnings():
    """Collect the warnings raised inside, then print one line per kind to stderr.

    torch's ``parallelize_module`` warns once per unresolved plan key with the whole module's repr
    (dozens of lines for one MoE model); the kinds, their counts and the first names quoted in them
    are what a user needs.
    """
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")  # count each one: "default" shows a repeated text once
        try:
            yield
        finally:
            for line in summarize_warnings(caught):
                print(f"autotp: warning: {line}", file=sys.stderr)


def summarize_warnings(caught) -> list[str]:
    """One line per kind of warning: its first line with quoted names elided, the count, and the
    distinct names quoted in it.

    >>> class W:
    ...     def __init__(self, text): self.message, self.category = text, UserWarning
    >>> summarize_warnings([W("key 'a' not resolved in X(\\n  ...)"), W("key 'b' not resolved in X(")])
    ["UserWarning (2x): key '...' not resolved in X( ['a', 'b']"]
    """
    kinds: dict[tuple[str, str], list] = {}  # (category, elided first line) -> [count, names]
    for w in caught:
        lines = str(w.message).strip().splitlines()
        first = lines[0] if lines else ""
        kind = kinds.setdefault((w.category.__name__, re.sub(r"'[^']*'", "'...'", first)[:160]), [0, []])
        kind[0] += 1
        kind[1] += re.findall(r"'([^']*)'", first)
    out = []
    for (category, text), (count, names) in kinds.items():
        unique = list(dict.fromkeys(names))
        shown = f" {unique[:6] + ['...'] if len(unique) > 6 else unique}" if unique else ""
        out.append(f"{category} ({count}x): {text}{shown}")
    return out


class _TokenIdFilter:
    """Drop transformers' complaint that a default config's token ids lie outside its vocabulary:
    the ids change no shape and the tiny model clamps them."""

    def filter(self, record) -> bool:
        return "_token_id must be" not in record.getMessage()


@contextlib.contextmanager
def quiet_transformers():
    """Filter :class:`_TokenIdFilter`'s messages from transformers' log handlers while inside."""
    import logging

    if "transformers" not in sys.modules:  # nothing logs before it is imported: import it lazily here
        try:
            import transformers.utils.logging as hf_logging

            hf_logging.get_logger("transformers")  # installs the library's handler
        except ImportError:  # pragma: no cover
            yield
            return
    handlers = logging.getLogger("transformers").handlers
    token_filter = _TokenIdFilter()
    for handler in handlers:
        handler.addFilter(token_filter)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(token_filter)


class _TracebackFilter:
    """Drop log records that carry a traceback (``log.exception``): torch logs the whole traceback
    of a failed meta kernel (``failed while attempting to run meta for aten.mm``) before raising the
    error that the command reports in one line."""

    def filter(self, record) -> bool:
        return record.exc_info is None


@contextlib.contextmanager
def quiet_torch_tracebacks(enabled: bool = True):
    """Filter :class:`_TracebackFilter`'s records from torch's log handlers while inside (imports
    torch, which installs them: call it only where the command needs torch anyway)."""
    import logging

    if not enabled:
        yield
        return
    import torch  # noqa: F401  (installs torch's log handlers)

    loggers = [logging.getLogger(name) for name in list(logging.Logger.manager.loggerDict)
               if name == "torch" or name.startswith("torch.")]
    handlers = {id(h): h for logger in loggers for h in logger.handlers}.values()
    traceback_filter = _TracebackFilter()
    for handler in handlers:
        handler.addFilter(traceback_filter)
    try:
        yield
    finally:
        for handler in handlers:
            handler.removeFilter(traceback_filter)


# --- plan tables ---------------------------------------------------------------------------------


# Option names read into the input / output / local columns; the rest go to "options".
_INPUT = ("input_layouts", "input_kwarg_layouts", "sequence_sharding")
_DESIRED_INPUT = ("desired_input_layouts", "desired_input_kwarg_layouts")
_OUTPUT = ("output_layouts", "sequence_sharding")
_DESIRED_OUTPUT = ("desired_output_layouts",)
_SHOWN = {*_INPUT, *_DESIRED_INPUT, *_OUTPUT, *_DESIRED_OUTPUT, "use_local_output", "style", "with_kwargs"}


def plan_rows(plan) -> list[list[str]]:
    """One table row per plan key: pattern, style, input and output layouts, local output, options.

    A layout change reads ``from -> to``; placements are abbreviated (``R``, ``S(-1)``, ``P``).

    >>> from torch.distributed.tensor.parallel import ColwiseParallel
    >>> plan_rows({"model.layers.*.mlp.up_proj": ColwiseParallel()})
    [['model.layers.*.mlp.up_proj', 'ColwiseParallel', 'R', 'S(-1)', 'yes', '']]
    """
    from autotp.emit import _parameters
    from autotp.plan import _plain, base_style, describe_style

    def set_options(desc: dict, style) -> list[str]:
        # key=value for each option of desc (style's description) off its default, leaving out
        # those the layout columns show
        defaults = {p.name: _plain(p.default) for p in _parameters(type(style)) if p.default is not p.empty}
        return [f"{k}={_short(v)}" for k, v in desc.items()
                if k not in _SHOWN and v is not None and (k not in defaults or defaults[k] != v)]

    rows = []
    for key, style in plan.items():
        # describe_style leaves out desired_input_layouts (RowwiseParallel rewrites it when
        # applied), but for PrepareModuleInput it is the point of the style: read it here.
        base = base_style(style)  # a wrapper (Boundary(style=...)) shows the layouts of the style it wraps
        desc = {**describe_style(base), **{k: _as_data(getattr(base, k, None)) for k in _DESIRED_INPUT}}
        if base is not style:
            desc["style"] = f"{type(style).__name__}({desc['style']})"
        local = desc.get("use_local_output")
        options = ", ".join(set_options(desc, base))
        if base is not style:  # the wrapper's own options first (Boundary(outputs=gather) around SequenceParallel)
            outer = {k: v for k, v in describe_style(style).items() if k not in ("style", "wrapped")}
            options = ", ".join([*set_options(outer, style), *([options] if options else [])])
        rows.append([
            key,
            desc["style"],
            _layout_change(desc, _INPUT, _DESIRED_INPUT),
            _layout_change(desc, _OUTPUT, _DESIRED_OUTPUT),
            "" if local is None else ("yes" if local else "no"),
            options,
        ])
    return rows


def _as_data(value):
    """Placements (or tuples / dicts of them) as their reprs, like ``describe_style`` gives them."""
    if isinstance(value, (tuple, list)):
        return [_as_data(v) for v in value]
    if isinstance(value, dict):
        return {k: _as_data(v) for k, v in value.items()}
    return value if value is None else repr(value)


def _layout_change(desc: dict, current: tuple[str, ...], desired: tuple[str, ...]) -> str:
    before = next((desc[k] for k in current if desc.get(k)), None)
    after = next((desc[k] for k in desired if desc.get(k)), None)
    if before is None:
        return "" if after is None else _short(after)
    return _short(before) if after is None or after == before else f"{_short(before)} -> {_short(after)}"


def _short(value) -> str:
    """Abbreviate placements: ``['Shard(dim=1)', None]`` -> ``S(1),-``."""
    if isinstance(value, dict):
        return ",".join(f"{k}:{_short(v)}" for k, v in value.items())
    if isinstance(value, list):
        return ",".join(_short(v) for v in value)
    if value is None:
        return "-"
    text = str(value)
    text = re.sub(r"Shard\(dim=(-?\d+)\)", r"S(\1)", text)
    text = text.replace("Replicate()", "R")
    return re.sub(r"Partial\([^)]*\)", "P", text)


def format_table(header: list[str], rows: list[list[str]]) -> str:
    """Left-aligned columns separated by `` | ``, with a rule under the header.

    >>> print(format_table(["a", "bb"], [["xyz", "1"]]))
    a   | bb
    ----+---
    xyz | 1
    """
    widths = [max(len(str(r[i])) for r in [header, *rows]) for i in range(len(header))]
    line = lambda cells: " | ".join(str(c).ljust(w) for c, w in zip(cells, widths)).rstrip()  # noqa: E731
    rule = "-+-".join("-" * w for w in widths)
    return "\n".join([line(header), rule, *(line(r) for r in rows)])
