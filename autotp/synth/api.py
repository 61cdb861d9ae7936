"""``synthesize`` and ``explain``: the public entry points of plan synthesis (the pipeline behind
them is :mod:`autotp.synth.pipeline`)."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass

from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from autotp.plan import key_matches
from autotp.synth.build import build_plan
from autotp.synth.pipeline import run
from autotp.synth.stages import Analysis
from autotp.synth.trace import LayerGroups, restored_module_state
from autotp.synth.whole_attention import warn_whole_attentions

log = logging.getLogger(__name__)


@dataclass(frozen=True)
class ExplainRecord:
    """Why one plan key (or one replicated module) got its style."""

    key: str
    role: str
    style: str
    reason: str
    evidence: tuple[str, ...]

    def __str__(self) -> str:
        path = " -> ".join(self.evidence)
        return f"{self.key}: {self.role} -> {self.style}; {self.reason}" + (f" [{path}]" if path else "")


def analyse_model(model: nn.Module, *, example_inputs=None, sequence_parallel: bool = False,
                  tp_size: int | None = None) -> Analysis:
    """Trace, build the graph, propagate shards and assign roles (no styles yet).

    The model is left as it was: state a module writes while traced is restored
    (:func:`~autotp.synth.trace.restored_module_state`).
    """
    with restored_module_state(model):
        return run(model, example_inputs=example_inputs, sequence_parallel=sequence_parallel, tp_size=tp_size)


def plan_with_analysis(model: nn.Module, *, example_inputs=None, sequence_parallel: bool = False,
                       loss_parallel: bool = True, tp_size: int | None = None,
                       gather_copies: bool = True) -> tuple[dict[str, ParallelStyle], Analysis]:
    """The plan :func:`autotp.synthesize` writes (same arguments), before any numerical check, and
    the :class:`Analysis` it was built from (the check of value-dependent branches reads it)."""
    analysis = analyse_model(model, example_inputs=example_inputs, sequence_parallel=sequence_parallel,
                             tp_size=tp_size)
    plan = build_plan(analysis.roles, analysis.groups, loss_parallel=loss_parallel, copies=analysis.copies,
                      gather_copies=gather_copies)
    warn_whole_attentions(analysis.graph, analysis.roles, analysis.groups)
    return plan, analysis


def explain(model: nn.Module | None = None, *, example_inputs=None, sequence_parallel: bool = False,
            loss_parallel: bool = True, tp_size: int | None = None,
            analysis: Analysis | None = None) -> list[ExplainRecord]:
    """Why the plan :func:`~autotp.synthesize` writes (same arguments) looks as it does.

    One record per plan key, in the plan's order, with that key's style; then one per module left
    whole (folded to ``layers.*``; where only some layers leave it whole the reason says in how many).

    Keyword Args:
        analysis: an :class:`Analysis` already made (``get_plan`` keeps the one behind a
            synthesized choice), so the model is not traced again; ``model`` may then be None.
    """
    if analysis is None:
        analysis = analyse_model(model, example_inputs=example_inputs, sequence_parallel=sequence_parallel,
                                 tp_size=tp_size)
    plan = build_plan(analysis.roles, analysis.groups, loss_parallel=loss_parallel, copies=analysis.copies)
    return describe(analysis, plan)


def describe(analysis: Analysis, plan: dict[str, ParallelStyle]) -> list[ExplainRecord]:
    """Records for ``plan`` (built from ``analysis``): its keys, then the modules it leaves whole."""
    originals = {fqn: role for traced, role in analysis.roles.items() for fqn in analysis.groups.original(traced)}
    records = []
    for key, style in plan.items():
        fqn = next(f for f in originals if key_matches(key, f))
        role = originals[fqn]
        fold = "*" in key
        records.append(ExplainRecord(key, role.kind, repr(style), _fold(role.reason, analysis.groups, fold),
                                     tuple(_fold(e, analysis.groups, fold) for e in role.evidence)))
    whole: dict[tuple[str, str], list[str]] = {}
    for fqn, role in originals.items():
        if not any(key_matches(key, fqn) for key in plan):
            whole.setdefault((_fold(fqn, analysis.groups, True), role.kind), []).append(fqn)
    for (pattern, kind), fqns in whole.items():
        role = originals[fqns[0]]
        entries = _entries(analysis.groups, pattern)
        every = "*" not in pattern or len(fqns) == entries
        where = "" if every else f"in {len(fqns)} of {entries} layers: "
        records.append(ExplainRecord(pattern, kind, "replicated", where + _fold(role.reason, analysis.groups, every),
                                     tuple(_fold(e, analysis.groups, every) for e in role.evidence)))
    return records


def _fold(text: str, groups: LayerGroups, fold: bool) -> str:
    """``text`` with stack entries (``layers.3.``) written ``layers.*.`` when ``fold``."""
    if not fold:
        return text
    for prefix in groups.groups:
        text = re.sub(rf"(?<![\w.]){re.escape(prefix)}\.[^.\s]+(?=\.|\b)", f"{prefix}.*", text)
    return text


def _entries(groups: LayerGroups, pattern: str) -> int:
    prefix = next((p for p in groups.groups if pattern.startswith(p + ".*")), None)
    return sum(len(group) for group in groups.groups[prefix]) if prefix else 1
