"""Choose the plan for a model, and say where it came from.

An explicit ``tp_shard_plan`` (a dict, a registered name, or a dotted import path to a dict or a
function) is used as given. Otherwise every source is asked for a plan: the handwritten registry,
transformers' own plan (translated), and the synthesizer. Each plan is checked for the model and the
tp size (divisibility, tied weights sharded two ways, and every :func:`autotp.check_plan` finding);
a rejected source is logged with its reason. Among the plans that pass, the one with the fewest
parameters per rank wins, then the one with the fewest collective bytes per step
(:mod:`autotp.cost`, a static estimate); a tie goes to the handwritten plan, then transformers'.
:class:`PlanChoice` keeps every source considered, the runners-up (in rank order, for a caller
whose own check rejects the winner: ``parallelize``'s self-check) and a line saying why the winner
won. When every source is rejected, :class:`~autotp.errors.NoPlanError` lists why.

The synthesizer runs first, whatever wins: its trace is the graph the checker reads for the other
sources' plans, so a selection costs one trace and one synthesis.
"""

from __future__ import annotations

import functools
import importlib
import logging
from collections.abc import Callable
from dataclasses import dataclass, field, replace

from torch import nn

import handwritten_plans
from autotp import hf_plans
from autotp.apply import check_divisible, check_tied_styles
from autotp.check import check_plan
from autotp.cost import PlanCost, plan_cost
from autotp.errors import AutoTPError, NoPlanError, PlanError, TraceError
from autotp.hf_plans import as_styles
from autotp.plan import Plan
from autotp.self_check import check_value_branches
from autotp.synth.api import analyse_model
from autotp.synth.build import build_plan
from autotp.synth.local_run import shared_traces

SOURCES = ("custom", "handwritten", "hf", "synthesized")
# Two plans whose parameters per rank differ by at most this share of the model's hold the same:
# the next criterion decides (a bias or a norm more or less is not worth more collectives).
PARAM_TOLERANCE = 0.005
# A plan must move at least this share fewer collective bytes than another to win on them alone.
COMM_TOLERANCE = 0.05

log = logging.getLogger(__name__)

# Plans users can select by name (``tp_shard_plan="llama"``), in addition to import paths.
_NAMED_PLANS: dict[str, Callable[..., Plan]] = {}


def register_plan(name: str, function: Callable[..., Plan]) -> None:
    """Make ``function(model, sequence_parallel=...)`` selectable as ``tp_shard_plan=name``."""
    _NAMED_PLANS[name] = function


@dataclass(frozen=True)
class Considered:
    """One source :func:`get_plan` asked: its parameters per rank over the model's and estimated
    collective bytes per token (None: it gave no plan that passed), and its verdict (``"chosen"``,
    ``"passes"``, or why it was rejected)."""

    source: str
    fraction: float | None
    collective_bytes: int | None
    verdict: str


@dataclass
class PlanChoice:
    """The plan :func:`get_plan` chose, its source (one of :data:`SOURCES`), the sources it
    rejected as ``(source, reason)`` pairs, every source it considered, why the winner won, and the
    plans that passed behind it, best first."""

    plan: Plan
    source: str
    detail: str = ""
    skipped: list[tuple[str, str]] = field(default_factory=list)
    analysis: object = None  # the synthesizer's Analysis when it wrote the plan (for ``explain``)
    cost: PlanCost | None = None
    considered: list[Considered] = field(default_factory=list)
    why: str = ""
    runners_up: list[PlanChoice] = field(default_factory=list)
    self_checked: bool = False  # verified numerically at this tp already (a value-branching trace's plan)


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


def rejection(model: nn.Module, plan: Plan, *, tp_size: int | None, analysis=None,
              example_inputs=None) -> str | None:
    """Why ``plan`` must not be chosen for ``model`` at ``tp_size``, or ``None`` if it may be.

    Runs :func:`autotp.check_plan` (keys, divisibility, tied weights sharded two ways, then the
    dataflow graph: one trace, a few seconds on meta). Without ``tp_size`` divisibility is not
    judged (tp=1).

    Returns:
        ``"check: N finding(s): <first finding>"``, or ``None``.
    """
    return _rejection_text(check_plan(model, plan, tp_size=tp_size or 1, analysis=analysis,
                                      example_inputs=example_inputs))


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
                *, reraise: bool = False, errors: dict | None = None, example_inputs=None):
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
                analysis = analyse_model(model, example_inputs=example_inputs, sequence_parallel=sequence_parallel,
                                         tp_size=tp_size)
                plan = build_plan(analysis.roles, analysis.groups, copies=analysis.copies)
                checked = check_value_branches(model, analysis, plan) is not None
                yield PlanChoice(plan, source, "graph analysis", analysis=analysis, self_checked=checked)
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
    example_inputs=None,
) -> PlanChoice:
    """The plan for ``model`` and where it came from.

    Args:
        model: the model (any device, meta included).
        sequence_parallel: ask for the sequence-parallel variant.
        tp_shard_plan: an explicit plan: a dict (of styles, or of transformers' style strings,
            translated by :func:`autotp.hf_plans.as_styles`), a registered name, or a dotted import
            path to a dict or to a function ``f(model, sequence_parallel=...)``. It is used as given: only
            its tied weights and (with ``tp_size``) its sizes are checked, without a trace.
        source: ``"auto"`` (every source; the best plan that passes the checker, as the module
            docstring says), or one of ``"handwritten"``, ``"hf"``, ``"synthesized"`` to insist on one.
        tp_size: the tp size the plan is for, when known: candidates are checked and costed for it,
            and a synthesized plan replicates kv heads where there are fewer than ``tp_size``.
        check: check each candidate with :func:`autotp.check_plan` and leave out those with
            findings. Default: on for ``source="auto"``, off when a source is insisted on (then it
            is returned unchecked, for comparison and benchmarks).
        example_inputs: a tuple of positional inputs, or a dict of keyword inputs, to trace the
            model with (as for :func:`autotp.synthesize`); needed for a model without a
            transformers config, made from the config otherwise.

    Returns:
        The :class:`PlanChoice`: the winner, every source considered, and why it won.

    Raises:
        PlanError: ``tp_shard_plan`` cannot be resolved, or the insisted-on source has no plan.
        NoPlanError: every source was rejected (``skipped`` lists them with their reasons), or a
            model without a transformers config has no plan of its own and no ``example_inputs``.
        MeshError: an explicit plan shards a size ``tp_size`` does not divide.
    """
    if tp_shard_plan is not None:
        plan, detail = _custom_plan(model, tp_shard_plan, sequence_parallel)
        _cheap_rejection(model, plan, tp_size)
        return PlanChoice(plan, "custom", detail)
    if source not in ("auto", *SOURCES[1:]):
        raise PlanError(f"unknown plan source {source!r}; use one of auto, handwritten, hf, synthesized.")
    if source != "auto":
        return _insisted(model, source, sequence_parallel, tp_size, check=bool(check), example_inputs=example_inputs)

    check = True if check is None else check
    skipped: list[tuple[str, str]] = []
    obstacles: list = []  # the first Finding or AutoTPError of each rejected source, in order
    errors: dict[str, AutoTPError] = {}
    passed: list[PlanChoice] = []
    graph = None  # the synthesizer's analysis: the graph every source's plan is checked on
    # Findings per plan, by its keys and styles: a plan two sources write alike is checked once.
    checked: dict[frozenset, list] = {}
    # No module changes until the choice is made: the shape proofs' exports are made once and shared
    # by the synthesizer and the checker of every source.
    with shared_traces():
        # Synthesized first (its trace serves the other checks); ties are broken in SOURCES order.
        for choice in _candidates(model, ("synthesized", "handwritten", "hf"), sequence_parallel, tp_size,
                                  errors=errors, example_inputs=example_inputs):
            graph = choice.analysis if choice.analysis is not None else graph
            reason = choice.detail if choice.plan is None else None
            if choice.plan is not None and check:
                same = frozenset((key, repr(style)) for key, style in choice.plan.items())
                if same not in checked:
                    checked[same] = check_plan(model, choice.plan, tp_size=tp_size or 1, analysis=graph,
                                               example_inputs=example_inputs)
                findings = checked[same]
                reason = _rejection_text(findings)
                obstacles += [(choice.source, f) for f in findings[:1]]
            if reason is None:
                passed.append(choice)
                continue
            obstacles += [(choice.source, errors[choice.source])] if choice.source in errors else []
            log.info("plan source %s rejected for %s: %s", choice.source, type(model).__name__, reason)
            skipped.append((choice.source, reason))
    skipped.sort(key=lambda item: SOURCES.index(item[0]))
    obstacles = [o for _, o in sorted(obstacles, key=lambda item: SOURCES.index(item[0]))]  # stable sort
    if not passed:
        if example_inputs is None and isinstance(errors.get("synthesized"), TraceError) and not _has_vocab(model):
            raise _needs_inputs(model, skipped)
        raise _no_plan(model, tp_size, skipped, obstacles)
    return _ranked(model, passed, skipped, tp_size or 1)


def _ranked(model: nn.Module, passed: list[PlanChoice], skipped: list[tuple[str, str]], tp_size: int) -> PlanChoice:
    """The best of ``passed`` (:func:`_better`), with every source considered and why it won."""
    costed = [replace(choice, cost=plan_cost(model, choice.plan, tp_size)) for choice in passed]
    costed.sort(key=lambda choice: SOURCES.index(choice.source))
    ordered = sorted(costed, key=functools.cmp_to_key(_compare))
    winner, rest = ordered[0], ordered[1:]
    why = _why(winner, costed)
    considered = [Considered(c.source, c.cost.fraction, c.cost.collective_bytes,
                             "chosen" if c is winner else "passes") for c in costed]
    considered += [Considered(name, None, None, reason) for name, reason in skipped]
    considered.sort(key=lambda c: SOURCES.index(c.source))
    log.info("plan for %s at tp=%d: %s", type(model).__name__, tp_size, why)
    return replace(winner, skipped=skipped, considered=considered, why=why, runners_up=rest)


def _compare(a: PlanChoice, b: PlanChoice) -> int:
    """Negative when ``a`` is the better plan: fewer parameters per rank (beyond
    :data:`PARAM_TOLERANCE` of the model), then fewer collective bytes (beyond
    :data:`COMM_TOLERANCE`), then the earlier source in :data:`SOURCES`."""
    if abs(a.cost.fraction - b.cost.fraction) > PARAM_TOLERANCE:
        return -1 if a.cost.fraction < b.cost.fraction else 1
    low, high = sorted((a.cost.collective_bytes, b.cost.collective_bytes))
    if high and (high - low) > COMM_TOLERANCE * high:
        return -1 if a.cost.collective_bytes < b.cost.collective_bytes else 1
    return SOURCES.index(a.source) - SOURCES.index(b.source)


def _why(winner: PlanChoice, costed: list[PlanChoice]) -> str:
    """``"handwritten 0.440, synthesized 0.310 params/rank: synthesized (fewer parameters per rank)"``."""
    params = ", ".join(f"{c.source} {c.cost.fraction:.3f}" for c in costed)
    if len(costed) == 1:
        return f"{params} params/rank: {winner.source} (the only source that passes)"
    others = [c for c in costed if c is not winner]
    if all(c.cost.fraction - winner.cost.fraction > PARAM_TOLERANCE for c in others):
        return f"{params} params/rank: {winner.source} (fewest parameters per rank)"
    comm = ", ".join(f"{c.source} {c.cost.collective_bytes / 1024:.1f}" for c in costed)
    level = [c for c in others if abs(c.cost.fraction - winner.cost.fraction) <= PARAM_TOLERANCE]
    if all(c.cost.collective_bytes - winner.cost.collective_bytes > COMM_TOLERANCE * c.cost.collective_bytes
           for c in level):
        return (f"{params} params/rank; {comm} KiB collectives/token (estimate): {winner.source} (as few parameters, "
                "fewest collective bytes)")
    return f"{params} params/rank; {comm} KiB collectives/token (estimate): {winner.source} (a tie, in source order)"


def _has_vocab(model: nn.Module) -> bool:
    """Whether token ids can be made for ``model`` from its (text) config's ``vocab_size``."""
    config = getattr(model, "config", None)
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    return isinstance(getattr(text, "vocab_size", None), int)


def _needs_inputs(model: nn.Module, skipped: list[tuple[str, str]]) -> NoPlanError:
    """The one-line :class:`NoPlanError` for a model without a transformers config, no plan of its
    own, and no ``example_inputs`` to synthesize one from."""
    name = type(model).__name__
    found = ("no handwritten or transformers plan, and no example inputs to trace it with (no transformers "
             "config to make input_ids from)")
    fix = "pass example_inputs=(tensor, ...) or a dict of keyword inputs, or your own plan (tp_shard_plan=)"
    return NoPlanError("", module=name, found=found, fix=fix, skipped=skipped)


# Characters "module: found; fix" of a NoPlanError may take: one terminal line with a prefix.
_SHORT_LINE = 180
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
    sized = [o for o in obstacles if getattr(o, "tp_sizes", ())]
    first = (sized or obstacles or [None])[0]
    cause = _short_cause(model, first) if first is not None else (skipped[0][1] if skipped else "")
    sizes = suggested_tp_sizes(model, [o.tp_sizes for o in sized])
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


def suggested_tp_sizes(model: nn.Module, size_lists: list[tuple[int, ...]]) -> tuple[int, ...]:
    """The tp sizes that some obstacle's ``tp_sizes`` names, less those the model's config cannot be
    split over (each source names the sizes that clear its first obstacle only); ``()`` if none
    names any.

    >>> from types import SimpleNamespace
    >>> model = SimpleNamespace(config=SimpleNamespace(num_attention_heads=12, num_key_value_heads=4))
    >>> suggested_tp_sizes(model, [(1, 29), (1, 2, 3, 4, 6, 12)])
    (1, 2, 4, 12)
    """
    named = {t for sizes in size_lists for t in sizes}
    config = getattr(model, "config", None)
    configs = [c for c in (config, getattr(config, "text_config", None), getattr(config, "language_config", None))
               if c is not None]
    split, kv = _counts(configs, _SPLIT), _counts(configs, _KV_HEADS)
    fits = lambda t: all(n % t == 0 for n in split) and all(n % t == 0 or t % n == 0 for n in kv)  # noqa: E731
    return tuple(sorted(t for t in named if fits(t)))


def _counts(configs: list, names: tuple[str, ...]) -> list[int]:
    return [n for c in configs for a in names if isinstance(n := getattr(c, a, None), int) and n > 0]


def _insisted(model: nn.Module, source: str, sequence_parallel: bool, tp_size: int | None, *,
              check: bool, example_inputs=None) -> PlanChoice:
    """The plan of the one source the caller insisted on; raise instead of falling through.

    Raises:
        PlanError: the source has no plan for the model, or (with ``check``) the checker rejects it.
    """
    choice, = _candidates(model, (source,), sequence_parallel, tp_size, reraise=True, example_inputs=example_inputs)
    reason = choice.detail if choice.plan is None else None
    if choice.plan is not None and check:
        reason = rejection(model, choice.plan, tp_size=tp_size, analysis=choice.analysis, example_inputs=example_inputs)
    if reason is not None:
        raise PlanError(f"{reason.rstrip('.')}." if choice.plan is None else f"{source} plan rejected: {reason}")
    return choice
