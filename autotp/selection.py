"""Choose the plan for a model, and say where it came from.

Order: an explicit ``tp_shard_plan`` (a dict, a registered name, or a dotted import path to a dict
or a function); the handwritten registry; transformers' own plan, translated; the synthesizer.

Selection falls through: each source autotp picks on its own is checked for the model and the tp
size before it is chosen (divisibility, tied weights sharded two ways, and every
:func:`autotp.check_plan` finding). A rejected source is logged with its reason and the next one is
tried; :class:`PlanChoice` keeps the skipped sources. The chosen plan is never one the checker
rejects; when every source is rejected, :class:`~autotp.errors.NoPlanError` lists why.
"""

from __future__ import annotations

import importlib
import logging
import re
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from torch import nn

import handwritten_plans
from autotp import hf_plans
from autotp.apply import check_divisible, check_tied_styles
from autotp.check import check_plan
from autotp.errors import AutoTPError, NoPlanError, PlanError
from autotp.hf_plans import as_styles
from autotp.plan import Plan
from autotp.self_check import check_value_branches
from autotp.synth.api import analyse_model
from autotp.synth.build import build_plan

SOURCES = ("custom", "handwritten", "hf", "synthesized")

log = logging.getLogger(__name__)

# Plans users can select by name (``tp_shard_plan="llama"``), in addition to import paths.
_NAMED_PLANS: dict[str, Callable[..., Plan]] = {}


def register_plan(name: str, function: Callable[..., Plan]) -> None:
    """Make ``function(model, sequence_parallel=...)`` selectable as ``tp_shard_plan=name``."""
    _NAMED_PLANS[name] = function


@dataclass
class PlanChoice:
    """The plan :func:`get_plan` chose, its source (one of :data:`SOURCES`), and the sources it
    skipped before it as ``(source, reason)`` pairs."""

    plan: Plan
    source: str
    detail: str = ""
    skipped: list[tuple[str, str]] = field(default_factory=list)
    analysis: object = None  # the synthesizer's Analysis when it wrote the plan (for ``explain``)


def import_object(path: str):
    """Import ``package.module.attr`` (or ``package.module:attr``).

    Raises:
        PlanError: the module or the attribute does not exist.
    """
    module_path, sep, attr = path.replace(":", ".").rpartition(".")
    if not sep:
        raise PlanError(f"tp_shard_plan {path!r} is neither a registered plan name nor a dotted import path.")
    try:
        module = importlib.import_module(module_path)
    except ImportError as error:
        raise PlanError(f"tp_shard_plan {path!r}: cannot import module {module_path!r} ({error}).") from error
    if not hasattr(module, attr):
        raise PlanError(f"tp_shard_plan {path!r}: module {module_path!r} has no attribute {attr!r}.")
    return getattr(module, attr)


def load_plan_file(spec: str, model: nn.Module, *, sequence_parallel: bool = False) -> Plan:
    """The plan ``NAME`` defined in a Python file, from ``"path/to/plans.py:NAME"``.

    ``NAME`` may be a plan dict (of styles, or of transformers' style strings) or a function
    ``f(model, sequence_parallel=...)`` returning one.

    Raises:
        PlanError: the file, the name, or the plan is missing or malformed.
    """
    import importlib.util
    from pathlib import Path

    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise PlanError(f"--plan {spec!r}: expected FILE.py:NAME, e.g. my_plans.py:PLAN.")
    if not Path(path).is_file():
        raise PlanError(f"--plan {spec!r}: no such file: {path!r}.")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        raise PlanError(f"--plan {spec!r}: importing {path!r} failed: {type(error).__name__}: {error}") from error
    if not hasattr(module, name):
        raise PlanError(f"--plan {spec!r}: {path!r} defines no {name!r}.")
    target = getattr(module, name)
    if callable(target):
        try:
            plan = target(model, sequence_parallel=sequence_parallel)
        except AutoTPError:
            raise
        except Exception as error:  # a user's function: say which one failed and on what model
            raise PlanError(
                f"--plan {spec!r}: {name}({type(model).__name__}, sequence_parallel={sequence_parallel}) "
                f"failed: {type(error).__name__}: {error}. A plan function should compute sizes from "
                "the model it gets (module.out_features, model.config), not hard-code them."
            ) from error
    else:
        plan = target
    if not isinstance(plan, dict):
        raise PlanError(f"--plan {spec!r}: {name!r} is a {type(plan).__name__}, not a plan dict.")
    try:
        return as_styles(model, plan)
    except PlanError as error:
        raise PlanError(f"--plan {spec!r}: {error}") from None


def _custom_plan(model: nn.Module, tp_shard_plan, sequence_parallel: bool) -> tuple[Plan, str]:
    if isinstance(tp_shard_plan, dict):
        return as_styles(model, tp_shard_plan), "dict"
    if not isinstance(tp_shard_plan, str):
        raise PlanError(
            f"tp_shard_plan must be a dict, a registered name or an import path, got {type(tp_shard_plan).__name__}."
        )
    target = _NAMED_PLANS.get(tp_shard_plan) or import_object(tp_shard_plan)
    if callable(target):
        target = target(model, sequence_parallel=sequence_parallel)
    if not isinstance(target, dict):
        raise PlanError(f"tp_shard_plan {tp_shard_plan!r} gave a {type(target).__name__}, not a plan dict.")
    return as_styles(model, target), tp_shard_plan


def rejection(model: nn.Module, plan: Plan, *, tp_size: int | None, analysis=None) -> str | None:
    """Why ``plan`` must not be chosen for ``model`` at ``tp_size``, or ``None`` if it may be.

    Runs :func:`autotp.check_plan` (keys, divisibility, tied weights sharded two ways, then the
    dataflow graph: one trace, a few seconds on meta). Without ``tp_size`` divisibility is not
    judged (tp=1).

    Returns:
        ``"check: N finding(s): <first finding>"``, or ``None``.
    """
    return _rejection_text(check_plan(model, plan, tp_size=tp_size or 1, analysis=analysis))


def _rejection_text(findings: list) -> str | None:
    if not findings:
        return None
    kinds = sorted({f.kind for f in findings})
    return f"check: {len(findings)} finding(s) ({', '.join(kinds)}): {findings[0]}"


def _cheap_rejection(model: nn.Module, plan: Plan, tp_size: int | None) -> None:
    """Refuse an explicit plan whose keys, tied weights or sizes cannot work (no trace).

    Raises:
        PlanError, MeshError: as :func:`autotp.apply.apply_plan` would, before any sharding.
    """
    check_tied_styles(model, plan)
    if tp_size is not None:
        check_divisible(model, tp_size, plan)


def _candidates(model: nn.Module, sources: tuple[str, ...], sequence_parallel: bool, tp_size: int | None,
                *, reraise: bool = False, errors: dict | None = None):
    """Yield a :class:`PlanChoice` per source (``plan`` None: the source has none, ``detail`` says
    why), built lazily; a synthesized choice carries its :class:`~autotp.synth.Analysis`.

    A source that has no plan for the model, or whose construction raises an :class:`AutoTPError`
    (a transformers style autotp cannot translate, a synthesized plan tp does not divide), yields
    ``None`` with the reason (and the error goes in ``errors[source]`` when given); with ``reraise``
    that error propagates instead.
    """
    name = handwritten_plans.class_qualname(type(model))
    for source in sources:
        try:
            if source == "handwritten":
                plan = handwritten_plans.plan_for(model, sequence_parallel=sequence_parallel)
                yield PlanChoice(plan, source, name if plan is not None else f"no handwritten plan for {name}")
            elif source == "hf" and sequence_parallel:
                yield PlanChoice(None, source, "transformers plans have no sequence-parallel variant; "
                                 "use source='synthesized'")
            elif source == "hf":
                plan = hf_plans.hf_plan(model)
                yield PlanChoice(plan, source, "base_model_tp_plan + _tp_plan" if plan is not None
                                 else f"{type(model).__name__} ships no transformers tp plan")
            else:
                analysis = analyse_model(model, sequence_parallel=sequence_parallel, tp_size=tp_size)
                plan = build_plan(analysis.roles, analysis.groups, copies=analysis.copies)
                check_value_branches(model, analysis, plan)
                yield PlanChoice(plan, source, "graph analysis", analysis=analysis)
        except AutoTPError as error:
            if reraise:
                raise
            if errors is not None:
                errors[source] = error
            yield PlanChoice(None, source, str(error))


def get_plan(
    model: nn.Module,
    *,
    sequence_parallel: bool = False,
    tp_shard_plan=None,
    source: str = "auto",
    tp_size: int | None = None,
    check: bool | None = None,
) -> PlanChoice:
    """The plan for ``model`` and where it came from.

    Args:
        model: the model (any device, meta included).
        sequence_parallel: ask for the sequence-parallel variant.
        tp_shard_plan: an explicit plan: a dict (of styles, or of transformers' style strings,
            translated by :func:`autotp.hf_plans.as_styles`), a registered name, or a dotted import
            path to a dict or to a function ``f(model, sequence_parallel=...)``. It is used as given: only
            its tied weights and (with ``tp_size``) its sizes are checked, without a trace.
        source: ``"auto"`` (the order above, falling through rejected sources), or one of
            ``"handwritten"``, ``"hf"``, ``"synthesized"`` to insist on one source.
        tp_size: the tp size the plan is for, when known: candidates are checked for it, and a
            synthesized plan replicates kv heads where there are fewer than ``tp_size``.
        check: check each candidate with :func:`autotp.check_plan` and fall through to the next
            source when it has findings. Default: on for ``source="auto"``, off when a source is
            insisted on (then it is returned unchecked, for comparison and benchmarks).

    Returns:
        The :class:`PlanChoice`, with the sources skipped before it and why.

    Raises:
        PlanError: ``tp_shard_plan`` cannot be resolved, or the insisted-on source has no plan.
        NoPlanError: every source was rejected (``skipped`` lists them with their reasons).
        MeshError: an explicit plan shards a size ``tp_size`` does not divide.
    """
    if tp_shard_plan is not None:
        plan, detail = _custom_plan(model, tp_shard_plan, sequence_parallel)
        _cheap_rejection(model, plan, tp_size)
        return PlanChoice(plan, "custom", detail)
    if source not in ("auto", *SOURCES[1:]):
        raise PlanError(f"unknown plan source {source!r}; use one of auto, handwritten, hf, synthesized.")
    if source != "auto":
        return _insisted(model, source, sequence_parallel, tp_size, check=bool(check))

    check = True if check is None else check
    skipped: list[tuple[str, str]] = []
    obstacles: list = []  # the first Finding or AutoTPError of each rejected source, in order
    errors: dict[str, AutoTPError] = {}
    for choice in _candidates(model, SOURCES[1:], sequence_parallel, tp_size, errors=errors):
        reason = choice.detail if choice.plan is None else None
        if choice.plan is not None and check:
            findings = check_plan(model, choice.plan, tp_size=tp_size or 1, analysis=choice.analysis)
            reason = _rejection_text(findings)
            obstacles += findings[:1]
        if reason is None:
            return replace(choice, skipped=skipped)
        obstacles += [errors[choice.source]] if choice.source in errors else []
        log.info("plan source %s skipped for %s: %s", choice.source, type(model).__name__, reason)
        skipped.append((choice.source, reason))
    raise _no_plan(model, tp_size, skipped, obstacles)


# Characters "module: found; fix" of a NoPlanError may take: one terminal line with a prefix.
_SHORT_LINE = 180
# The tp sizes a fix suggests, as autotp.errors.working_tp_sizes writes them: "use tp in (1, 2, 4)".
_TP_SIZES = re.compile(r"use tp in \(([\d, ]+)\)")
# Config attributes that every plan source splits over tp: query heads and the widths of the MLP and
# the vocabulary (each must divide by tp), and kv heads (divide by tp, or be repeated over it: the
# synthesizer replicates kv heads when tp is a multiple of their count).
_SPLIT = ("num_attention_heads", "n_head", "num_heads", "intermediate_size", "moe_intermediate_size", "vocab_size")
_KV_HEADS = ("num_key_value_heads",)


def _no_plan(model: nn.Module, tp_size: int | None, skipped: list, obstacles: list) -> NoPlanError:
    """The :class:`NoPlanError` for every source rejected: its message lists each reason; its parts
    (``module``, ``found``, ``fix``) make one short line with one list of tp sizes to try."""
    at = f" at tp={tp_size}" if tp_size else ""
    message = (f"{type(model).__name__}: no plan source gives a plan the checker accepts{at}: "
               + "; ".join(f"{name}: {reason.rstrip('.')}" for name, reason in skipped)
               + ". Try another tp size, or pass your own plan (tp_shard_plan= / --plan FILE.py:NAME).")
    fixes = [getattr(o, "fix", None) or "" for o in obstacles]
    sized = [o for o, fix in zip(obstacles, fixes) if _TP_SIZES.search(fix)]
    first = (sized or obstacles or [None])[0]
    cause = _short_cause(model, first) if first is not None else (skipped[0][1] if skipped else "")
    sizes = suggested_tp_sizes(model, fixes)
    listed = f"({', '.join(map(str, sizes))})"
    fix = f"use tp in {listed} or your own plan" if sizes else "pass your own plan"
    found = f"no plan source passes the checker{at}: "
    room = _SHORT_LINE - len(f"{type(model).__name__}: {found}; {fix}")
    cause = cause if len(cause) <= room else cause[:max(room - 3, 0)] + "..."
    return NoPlanError(message, skipped=skipped, tp_sizes=sizes, module=type(model).__name__,
                       found=found + cause, fix=fix)


def _short_cause(model: nn.Module, obstacle) -> str:
    """``obstacle``'s problem (a Finding's, or an AutoTPError's ``found``) without its parenthesized
    detail, after the module it is about when that is not the model itself."""
    problem = getattr(obstacle, "problem", None) or getattr(obstacle, "found", None) or str(obstacle)
    module = getattr(obstacle, "module", None)
    problem = problem.split(" (", 1)[0].split("; ", 1)[0]
    return problem if module in (None, type(model).__name__) else f"{module}: {problem}"


def suggested_tp_sizes(model: nn.Module, fixes: list[str]) -> tuple[int, ...]:
    """The tp sizes that some fix in ``fixes`` names ("use tp in (...)"), less those the model's
    config cannot be split over (each source names the sizes that clear its first obstacle only);
    ``()`` if no fix names any.

    >>> from types import SimpleNamespace
    >>> model = SimpleNamespace(config=SimpleNamespace(num_attention_heads=12, num_key_value_heads=4))
    >>> suggested_tp_sizes(model, ["use tp in (1, 29)", "use tp in (1, 2, 3, 4, 6, 12)"])
    (1, 2, 4, 12)
    """
    lists = [match.group(1) for fix in fixes for match in _TP_SIZES.finditer(fix)]
    named = {int(t) for listed in lists for t in listed.split(",") if t.strip()}
    config = getattr(model, "config", None)
    configs = [c for c in (config, getattr(config, "text_config", None), getattr(config, "language_config", None))
               if c is not None]
    split, kv = _counts(configs, _SPLIT), _counts(configs, _KV_HEADS)
    fits = lambda t: all(n % t == 0 for n in split) and all(n % t == 0 or t % n == 0 for n in kv)  # noqa: E731
    return tuple(sorted(t for t in named if fits(t)))


def _counts(configs: list, names: tuple[str, ...]) -> list[int]:
    return [n for c in configs for a in names if isinstance(n := getattr(c, a, None), int) and n > 0]


def _insisted(model: nn.Module, source: str, sequence_parallel: bool, tp_size: int | None, *,
              check: bool) -> PlanChoice:
    """The plan of the one source the caller insisted on; raise instead of falling through.

    Raises:
        PlanError: the source has no plan for the model, or (with ``check``) the checker rejects it.
    """
    choice, = _candidates(model, (source,), sequence_parallel, tp_size, reraise=True)
    reason = choice.detail if choice.plan is None else None
    if choice.plan is not None and check:
        reason = rejection(model, choice.plan, tp_size=tp_size, analysis=choice.analysis)
    if reason is not None:
        raise PlanError(f"{reason.rstrip('.')}." if choice.plan is None else f"{source} plan rejected: {reason}")
    return choice
