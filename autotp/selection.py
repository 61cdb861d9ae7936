"""Choose the plan for a model, and say where it came from.

Order: an explicit ``tp_shard_plan`` (a dict, a registered name, or a dotted import path to a dict
or a function); the handwritten registry; transformers' own plan, translated; the synthesizer.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

from torch import nn

from autotp.errors import PlanError
from autotp.plan import Plan

SOURCES = ("custom", "handwritten", "hf", "synthesized")

# Plans users can select by name (``tp_shard_plan="llama"``), in addition to import paths.
_NAMED_PLANS: dict[str, Callable[..., Plan]] = {}


def register_plan(name: str, function: Callable[..., Plan]) -> None:
    """Make ``function(model, sequence_parallel=...)`` selectable as ``tp_shard_plan=name``."""
    _NAMED_PLANS[name] = function


@dataclass
class PlanChoice:
    """The plan :func:`get_plan` chose and its source (one of :data:`SOURCES`)."""

    plan: Plan
    source: str
    detail: str = ""


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

    ``NAME`` may be a plan dict or a function ``f(model, sequence_parallel=...)`` returning one.

    Raises:
        PlanError: the file, the name, or the plan is missing or malformed.
    """
    import importlib.util
    from pathlib import Path

    path, sep, name = spec.rpartition(":")
    if not sep or not path.endswith(".py"):
        raise PlanError(f"--plan {spec!r}: expected FILE.py:NAME, e.g. my_plans.py:PLAN.")
    if not Path(path).is_file():
        raise PlanError(f"--plan {spec!r}: no file {path!r}.")
    module_spec = importlib.util.spec_from_file_location(Path(path).stem, path)
    module = importlib.util.module_from_spec(module_spec)
    try:
        module_spec.loader.exec_module(module)
    except Exception as error:
        raise PlanError(f"--plan {spec!r}: importing {path!r} failed: {type(error).__name__}: {error}") from error
    if not hasattr(module, name):
        raise PlanError(f"--plan {spec!r}: {path!r} defines no {name!r}.")
    target = getattr(module, name)
    plan = target(model, sequence_parallel=sequence_parallel) if callable(target) else target
    if not isinstance(plan, dict):
        raise PlanError(f"--plan {spec!r}: {name!r} is a {type(plan).__name__}, not a plan dict.")
    return plan


def _custom_plan(model: nn.Module, tp_shard_plan, sequence_parallel: bool) -> tuple[Plan, str]:
    if isinstance(tp_shard_plan, dict):
        return tp_shard_plan, "dict"
    if not isinstance(tp_shard_plan, str):
        raise PlanError(
            f"tp_shard_plan must be a dict, a registered name or an import path, got {type(tp_shard_plan).__name__}."
        )
    target = _NAMED_PLANS.get(tp_shard_plan) or import_object(tp_shard_plan)
    if callable(target):
        target = target(model, sequence_parallel=sequence_parallel)
    if not isinstance(target, dict):
        raise PlanError(f"tp_shard_plan {tp_shard_plan!r} gave a {type(target).__name__}, not a plan dict.")
    return target, tp_shard_plan


def get_plan(
    model: nn.Module,
    *,
    sequence_parallel: bool = False,
    tp_shard_plan=None,
    source: str = "auto",
    tp_size: int | None = None,
) -> PlanChoice:
    """The plan for ``model`` and where it came from.

    Args:
        model: the model (any device, meta included).
        sequence_parallel: ask for the sequence-parallel variant.
        tp_shard_plan: an explicit plan: a dict, a registered name, or a dotted import path to a
            dict or to a function ``f(model, sequence_parallel=...)``.
        source: ``"auto"`` (the order above), or one of ``"handwritten"``, ``"hf"``, ``"synthesized"``
            to insist on one source.
        tp_size: the tp size the plan is for, when known: a synthesized plan is then checked for
            it and replicates kv heads where there are fewer than ``tp_size``.

    Raises:
        PlanError: ``tp_shard_plan`` cannot be resolved, or the insisted-on source has no plan.
    """
    import handwritten_plans
    from autotp import hf_plans

    if tp_shard_plan is not None:
        plan, detail = _custom_plan(model, tp_shard_plan, sequence_parallel)
        return PlanChoice(plan, "custom", detail)
    if source not in ("auto", *SOURCES[1:]):
        raise PlanError(f"unknown plan source {source!r}; use one of auto, handwritten, hf, synthesized.")
    if source in ("auto", "handwritten"):
        plan = handwritten_plans.plan_for(model, sequence_parallel=sequence_parallel)
        if plan is not None:
            return PlanChoice(plan, "handwritten", handwritten_plans.class_qualname(type(model)))
        if source == "handwritten":
            raise PlanError(f"no handwritten plan for {handwritten_plans.class_qualname(type(model))}.")
    if source in ("auto", "hf") and not sequence_parallel:
        plan = hf_plans.hf_plan(model)
        if plan is not None:
            return PlanChoice(plan, "hf", "base_model_tp_plan + _tp_plan")
        if source == "hf":
            raise PlanError(f"{type(model).__name__} ships no transformers tp plan.")
    if source == "hf":
        raise PlanError("transformers plans have no sequence-parallel variant; use source='synthesized'.")
    from autotp.synth import synthesize

    plan = synthesize(model, sequence_parallel=sequence_parallel, tp_size=tp_size)
    return PlanChoice(plan, "synthesized", "graph analysis")
