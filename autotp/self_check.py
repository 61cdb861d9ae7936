"""The self-check: a synthesized plan is verified numerically before anyone shards with it.

:func:`self_check` picks what to verify the plan on, cheapest first that is still evidence:

1. the model itself, when it is materialised on the CPU and small (a deep copy; fp32 if it is not);
2. a tiny random copy built from its transformers config (:func:`autotp.models.build_model`, as
   ``autotp verify`` does), with the real model's kv heads per rank kept, so the same plan applies;
3. nothing, with a warning that says why (a meta or large model without a transformers config).

The check compares logits and every gradient with the unsharded model on simulated ranks
(:func:`autotp.verify`). Under a real process group (``parallelize`` inside torchrun) it runs in a
child interpreter (``isolated=True``), which leaves the caller's process group untouched.
Measured cost (docs/guarantees.md, "Self-check"): 2-5 s on a tiny model in process, ~15-20 s isolated.
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from autotp.copying import deep_copy
from autotp.errors import TraceError
from autotp.plan import Plan
from autotp.synth.api import plan_with_analysis
from autotp.verifier import DEFAULT_TOLERANCE, VerifyReport, require_ok, verify

if TYPE_CHECKING:
    from autotp.synth.stages import Analysis

log = logging.getLogger(__name__)

# A CPU model up to this size is verified itself (seconds); a larger one through a tiny copy.
SELF_CHECK_MAX_PARAMS = 20_000_000


def self_check(model: nn.Module, plan: Plan, *, tp_size: int, sequence_parallel: bool = False,
               loss_parallel: bool = True, example_inputs=None,
               tolerance: float = DEFAULT_TOLERANCE) -> VerifyReport | None:
    """Verify the synthesized ``plan`` for ``model`` at ``tp_size`` before it is used.

    Args:
        model: the model the plan was synthesized for (any device, meta included); not modified.
        plan: the synthesized plan.
        tp_size: the tp size to check at.
        sequence_parallel: the plan is the sequence-parallel variant (used to re-synthesize for a
            tiny copy whose structure differs, see :func:`_check_on_tiny_copy`).
        loss_parallel: as passed to ``synthesize`` (same use).
        example_inputs: inputs for a model without a transformers config (a tuple or a dict).
        tolerance: max abs difference counted as equal.

    Returns:
        The :class:`~autotp.verifier.VerifyReport` it verified, or None when no check was possible
        (logged as a warning with the reason).

    Raises:
        VerificationError: the plan is numerically wrong (naming the first differing parameter),
            the sharded model raised, or the verification worker crashed.
    """
    isolated = dist.is_available() and dist.is_initialized()  # keep a real process group untouched
    what = f"{type(model).__name__}'s synthesized plan"
    if _verifiable_itself(model):
        subject = model if _is_fp32_cpu(model) else deep_copy(model).float().cpu()
        inputs = None if _has_vocab(model) else example_inputs
        if inputs is None and not _has_vocab(model):
            log.warning("%s: could not self-check the synthesized plan: no config.vocab_size to draw token ids "
                        "from and no example_inputs; pass example_inputs, or run autotp.verify", what)
            return None
        report = verify(subject, plan, tp_size=tp_size, example_inputs=inputs, tolerance=tolerance, isolated=isolated)
        log.info("self-check of %s on the model itself at tp=%d: %s", what, tp_size, "ok" if report.ok else "FAILED")
        return require_ok(report, what=what)
    if _transformers_config(model) is not None:
        return _check_on_tiny_copy(model, plan, tp_size=tp_size, sequence_parallel=sequence_parallel,
                                   loss_parallel=loss_parallel, tolerance=tolerance, isolated=isolated)
    where = ("on the meta device" if _on_meta(model)
             else f"too large to verify itself (> {SELF_CHECK_MAX_PARAMS:,} parameters)")
    log.warning("%s: could not self-check the synthesized plan: the model is %s and has no transformers config "
                "to build a tiny copy from; verify it with autotp.verify on a small materialised instance", what, where)
    return None


def _check_on_tiny_copy(model: nn.Module, plan: Plan, *, tp_size: int, sequence_parallel: bool,
                        loss_parallel: bool, tolerance: float, isolated: bool) -> VerifyReport | None:
    """Verify ``plan`` on a tiny copy of ``model``; if it does not fit the copy (different layer or
    head layout), verify the plan the synthesizer writes for the copy instead, and say so."""
    from autotp.models import build_model  # local: imports transformers

    what = f"{type(model).__name__}'s synthesized plan"
    config = _transformers_config(model)
    try:
        tiny = build_model(config, tiny=True, tp=_tiny_heads_for(config, tp_size), device="cpu")
    except Exception as error:  # the shrinker does not know this config: the check is skipped, loudly
        log.warning("%s: could not self-check: building a tiny copy from its config failed (%s: %s)",
                    what, type(error).__name__, error)
        return None
    refused = None
    try:
        report = verify(tiny, plan, tp_size=tp_size, tolerance=tolerance, isolated=isolated)
    except Exception as error:  # noqa: BLE001  the plan's keys or sizes do not fit the copy
        report, refused = None, error
    reason = str(refused) if refused is not None else (report.error if report.crash is None else None)
    if reason is not None:
        tiny_plan, tiny_analysis = plan_with_analysis(tiny, sequence_parallel=sequence_parallel,
                                                      loss_parallel=loss_parallel, tp_size=tp_size)
        check_value_branches(tiny, tiny_analysis, tiny_plan, loss_parallel=loss_parallel)
        if _same_plan(tiny_plan, plan):
            if refused is not None:
                raise refused
            return require_ok(report, what=what)
        log.warning("%s does not fit its tiny copy (%s); checked the plan synthesized for the copy instead",
                    what, reason[:200])
        report = verify(tiny, tiny_plan, tp_size=tp_size, tolerance=tolerance, isolated=isolated)
    log.info("self-check of %s on a tiny copy at tp=%d: %s", what, tp_size, "ok" if report.ok else "FAILED")
    return require_ok(report, what=what)


def _tiny_heads_for(config, tp_size: int) -> int:
    """The ``tp`` to shrink with: the real kv-head count when it is below ``tp_size`` (so kv heads
    are replicated in the copy as in the model), else ``tp_size``."""
    text = config.get_text_config() if hasattr(config, "get_text_config") else config
    kv = getattr(text, "num_key_value_heads", None)
    return kv if isinstance(kv, int) and 0 < kv < tp_size and tp_size % kv == 0 else tp_size


def _same_plan(a: Plan, b: Plan) -> bool:
    """Whether two plans are the same data (keys and style reprs)."""
    return {k: repr(v) for k, v in a.items()} == {k: repr(v) for k, v in b.items()}


def _transformers_config(model: nn.Module):
    config = getattr(model, "config", None)
    return config if hasattr(config, "model_type") and hasattr(config, "to_dict") else None


def _has_vocab(model: nn.Module) -> bool:
    config = _transformers_config(model)
    text = config.get_text_config() if config is not None and hasattr(config, "get_text_config") else config
    return isinstance(getattr(text, "vocab_size", None), int)


def _on_meta(model: nn.Module) -> bool:
    return any(t.is_meta for t in [*model.parameters(), *model.buffers()])


def _verifiable_itself(model: nn.Module) -> bool:
    """Materialised and small: verified itself (moved to a CPU fp32 copy when it is not one)."""
    return not _on_meta(model) and sum(p.numel() for p in model.parameters()) <= SELF_CHECK_MAX_PARAMS


def _is_fp32_cpu(model: nn.Module) -> bool:
    return all(p.dtype == torch.float32 and p.device.type == "cpu" for p in model.parameters())


def check_value_branches(model: nn.Module, analysis: Analysis, plan: dict[str, ParallelStyle], *,
                         loss_parallel: bool = True) -> VerifyReport | None:
    """Verify ``plan`` numerically when its trace followed value-dependent branches through a
    module with parameters (:func:`~autotp.synth.trace.export_model`), whatever ``verify`` says.

    Such a trace holds the branches its example inputs took (the experts their tokens picked), not
    the others. The self-check runs the plan on inputs of its own, against the unsharded model.

    Returns:
        The self-check's report, or None when the trace took no value-dependent branch (nothing
        was checked).

    Raises:
        VerificationError: the plan differs from the unsharded model.
        TraceError: the plan could not be checked (no inputs to check it on); it is not handed out.
    """
    if analysis.graph.graph.get("value_branches"):
        return self_check_synthesized(model, analysis, plan, loss_parallel=loss_parallel)
    return None


def self_check_synthesized(model: nn.Module, analysis: Analysis, plan: dict[str, ParallelStyle], *,
                           loss_parallel: bool = True) -> VerifyReport | None:
    """Verify a synthesized ``plan`` (:func:`self_check`) before it is handed out, at the analysis'
    ``tp_size`` (2 if None), sequence-parallel mode and example inputs.

    Raises:
        VerificationError: the plan differs from the unsharded model.
        TraceError: the plan has value-dependent branches and could not be checked (no inputs to
            check it on); it is not handed out. Without such branches an unchecked plan gets a
            warning (from :func:`self_check`) instead.
    """
    where = analysis.graph.graph.get("value_branches")
    if where:
        log.info("%s branches on tensor values: checking the plan traced on these inputs' branches", where)
    report = self_check(model, plan, tp_size=analysis.tp_size or 2, sequence_parallel=analysis.sequence_parallel,
                        loss_parallel=loss_parallel, example_inputs=analysis.example_inputs)
    if report is None and where:
        raise TraceError(
            f"{type(model).__name__}: {where} branches on tensor values, so its trace follows only the "
            "branches the example inputs took, and the plan made from it could not be checked on other "
            "inputs. Pass example_inputs (or use a model with a transformers config) so that "
            f"synthesize can check it, or write the plan by hand and leave {where} replicated."
        )
    return report
