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
from autotp.synth.groups import group_copies
from autotp.synth.pipeline import Analysis, run
from autotp.synth.trace import LayerGroups, restored_module_state

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
        analysis = run(model, example_inputs=example_inputs, sequence_parallel=sequence_parallel, tp_size=tp_size)
        return group_copies(analysis, run)


def synthesize(model: nn.Module, *, example_inputs=None, sequence_parallel: bool = False,
               loss_parallel: bool = True, tp_size: int | None = None,
               verify: bool = False, gather_copies: bool = True) -> dict[str, ParallelStyle]:
    """Write a tensor-parallel plan for ``model`` from its traced graph.

    Keyword Args:
        example_inputs: a tuple of positional inputs, or a dict of keyword inputs; made from the
            config (``input_ids`` of shape (2, 11)) for transformers models when omitted.
        sequence_parallel: keep the residual stream sharded on the sequence between blocks.
        loss_parallel: leave the head's logits vocab-sharded (``Shard(-1)`` DTensor).
        tp_size: if given, check that every sharded extent divides evenly; k/v projections with
            fewer heads than ``tp_size`` (a multiple of them) get one kv head per rank.
        verify: check the plan numerically before returning it (:func:`autotp.self_check.self_check`:
            logits and every gradient at ``tp_size`` (2 if None) on simulated ranks, on the model
            itself or on a tiny copy built from its config). Off by default: it costs 2-5 s on a
            tiny model, several times the synthesis; ``autotp.parallelize`` turns it on.
        gather_copies: parts with fewer groups than ranks (the one kv head of a fused multi-query
            qkv, B and C of a state-space mixer with ``n_groups < tp``) come from a Linear whose
            rows are sharded like its other parts; each forward all-gathers the part and each rank
            cuts its group, and the backward reduce-scatters the part's gradient: the same bytes each
            way. False: every rank holds a whole copy of its group's rows and the copies' weight
            gradients are all-reduced in the backward (no forward communication: the serving choice).

    Returns:
        ``{fnmatch key: ParallelStyle}`` for ``parallelize_module``, keys relative to ``model``.

    Raises:
        VerificationError: (``verify=True``) the plan differs from the unsharded model; the
            message names the first differing parameter and the difference against the tolerance.

    Example::
        >>> plan = synthesize(model)  # doctest: +SKIP
        >>> plan["model.layers.*.self_attn.o_proj"]  # doctest: +SKIP
        RowwiseParallel(...)
    """
    analysis = analyse_model(model, example_inputs=example_inputs, sequence_parallel=sequence_parallel,
                             tp_size=tp_size)
    plan = build_plan(analysis.roles, analysis.groups, loss_parallel=loss_parallel, copies=analysis.copies,
                      gather_copies=gather_copies)
    if verify:
        from autotp.self_check import self_check

        self_check(model, plan, tp_size=tp_size or 2, sequence_parallel=sequence_parallel,
                   loss_parallel=loss_parallel, example_inputs=example_inputs)
    else:
        check_value_branches(model, analysis, plan, loss_parallel=loss_parallel)
    return plan


def check_value_branches(model: nn.Module, analysis: Analysis, plan: dict[str, ParallelStyle], *,
                         loss_parallel: bool = True):
    """Verify ``plan`` numerically when its trace followed value-dependent branches through a
    module with parameters (:func:`~autotp.synth.trace.export_model`), whatever ``verify`` says.

    Such a trace holds the branches its example inputs took (the experts their tokens picked), not
    the others. The self-check runs the plan on inputs of its own, against the unsharded model.

    Returns:
        The self-check's :class:`~autotp.verifier.VerifyReport`, or None when the trace took no
        value-dependent branch (nothing was checked).

    Raises:
        VerificationError: the plan differs from the unsharded model.
        TraceError: the plan could not be checked (no inputs to check it on); it is not handed out.
    """
    where = analysis.graph.graph.get("value_branches")
    if not where:
        return None
    from autotp.errors import TraceError
    from autotp.self_check import self_check

    log.info("%s branches on tensor values: checking the plan traced on these inputs' branches", where)
    report = self_check(model, plan, tp_size=analysis.tp_size or 2, sequence_parallel=analysis.sequence_parallel,
                        loss_parallel=loss_parallel, example_inputs=analysis.example_inputs)
    if report is None:
        raise TraceError(
            f"{type(model).__name__}: {where} branches on tensor values, so its trace follows only the "
            "branches the example inputs took, and the plan made from it could not be checked on other "
            "inputs. Pass example_inputs (or use a model with a transformers config) so that "
            f"synthesize(verify=True) can check it, or write the plan by hand and leave {where} replicated."
        )
    return report


def explain(model: nn.Module | None = None, *, example_inputs=None, sequence_parallel: bool = False,
            loss_parallel: bool = True, tp_size: int | None = None,
            analysis: Analysis | None = None) -> list[ExplainRecord]:
    """Why the plan :func:`synthesize` writes (same arguments) looks as it does.

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
