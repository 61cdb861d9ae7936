"""Prove a plan correct numerically: shard the model over simulated ranks and compare with the original.

:func:`verify` runs the unsharded model and a sharded copy on the same inputs, then compares, per
rank: the logits; after a cross-entropy backward, every parameter gradient (each rank's local shard
against the matching slice of the reference gradient); the fraction of parameters each rank holds;
and the collectives one forward issues. A plan that drops an all-reduce, splits a fused projection
contiguously, or leaves a partial gradient unreduced fails here, although it runs without error.
A model that computes in bf16 / fp16 inside is judged with those casts made exact, so that the
report says whether a difference is low-precision rounding or a wrong plan.

Long because a report is only trusted when every part (reference run, sharded run, gradient
slices, collectives, float64 and exact-casts re-runs) is done the same way for every plan: they
stay together.
"""

from __future__ import annotations

import contextlib
import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
import warnings
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import DTensor, Shard
from torch.utils._python_dispatch import TorchDispatchMode

from autotp import _simulate
from autotp.apply import apply_plan
from autotp.casts import LowPrecisionCasts, casts_text
from autotp.copying import deep_copy
from autotp.errors import AutoTPError, VerificationError, one_line
from autotp.hf_plans import as_styles
from autotp.logits import model_logits
from autotp.plan import Plan

log = logging.getLogger(__name__)

DEFAULT_TOLERANCE = 1e-5
# A float32 run just above the tolerance is re-run in float64 with this one: a correct plan agrees to
# ~1e-13 there (the fp32 difference was rounding), a wrong one by the same O(1e-2) or more.
FLOAT64_TOLERANCE = 1e-9
# Only differences up to this many tolerances are re-checked: above it the plan is plainly wrong.
RECHECK_FACTOR = 100.0


def allowed(tolerance: float, scale: float) -> float:
    """The largest difference counted as equal for a tensor whose reference peaks at ``scale``.

    ``tolerance`` is absolute up to magnitude 1 and relative above it: fp32 rounding grows with the
    values, so a gradient that peaks at 100 differs from its own float64 value by ~1e-5 already.
    """
    return tolerance * max(1.0, scale)


@dataclass
class VerifyReport:
    """What :func:`verify` measured; ``ok`` when everything is within ``tolerance``."""

    tp_size: int
    tolerance: float
    logits_max_abs_diff: list[float]
    grad_max_abs_diff: dict[str, float] = field(default_factory=dict)
    param_fraction: list[float] = field(default_factory=list)
    collectives: dict[str, int] = field(default_factory=dict)
    # Collectives of the backward pass (of the plan; the verifier's own loss adds none).
    collectives_backward: dict[str, int] = field(default_factory=dict)
    # Bytes of the tensors the forward's and the backward's collectives reduce or gather (twice the
    # input of an all-reduce): a ring moves (W-1)/W of this per rank. Issue 13's measure.
    comm_volume: int = 0
    comm_volume_backward: int = 0
    # Parameters whose local gradient has another shape than their local shard (a sharded parameter
    # with a full-size gradient); redistributed before comparing, as an optimizer would.
    grads_not_local_size: list[str] = field(default_factory=list)
    error: str | None = None
    # Peak |value| of the reference logits and of each reference gradient (see :func:`allowed`).
    logits_scale: float = 0.0
    grad_scale: dict[str, float] = field(default_factory=dict)
    # Set when the fp32 differences were above tolerance and the float64 re-run decided.
    float64: VerifyReport | None = None
    # How an isolated verification's worker died ("SIGABRT", "exit code 1", "timeout after 600 s").
    crash: str | None = None
    # When the run was above tolerance and the model casts to bf16 / fp16 inside: those casts per
    # dtype ({"bfloat16": 10}), and the same check with them made exact, which decides.
    low_precision_casts: dict[str, int] = field(default_factory=dict)
    exact_casts: VerifyReport | None = None
    # Why the float64 re-run could not run (the unsharded model raised in float64), when it could not.
    float64_skipped: str | None = None

    @property
    def worst_grad(self) -> tuple[str, float]:
        """The gradient furthest from its reference, relative to what :func:`allowed` lets it differ."""
        if not self.grad_max_abs_diff:
            return ("-", 0.0)
        return max(self.grad_max_abs_diff.items(), key=lambda kv: kv[1] / self._allowed(kv[0]))

    def _allowed(self, name: str) -> float:
        return allowed(self.tolerance, self.grad_scale.get(name, 0.0))

    @property
    def verdict(self) -> str:
        """``"exact"``: agrees within tolerance (or its float64 re-run does: fp32 rounding);
        ``"rounding"``: differs, but only by the model's own low-precision casts (it agrees once they
        are made exact, ``exact_casts``); ``"mismatch"``: differs or the sharded model raised."""
        if self.error is not None:
            return "mismatch"
        if self.exact_casts is not None:
            return "rounding" if self.exact_casts.ok else "mismatch"
        if self.float64 is not None:
            return "exact" if self.float64.ok else "mismatch"
        return "exact" if self.within(1.0) else "mismatch"

    @property
    def ok(self) -> bool:
        """The plan is right: the verdict is ``"exact"`` or ``"rounding"``."""
        return self.verdict != "mismatch"

    def first_mismatch(self) -> tuple[str, float, float] | None:
        """``(name, difference, allowed)`` of the first parameter whose gradient differs (in the
        model's parameter order), else ``("logits", ...)`` if only the logits do; None when ok or
        when the run raised (see ``error``). A re-run with casts made exact or in float64, when
        there is one, decides."""
        if self.exact_casts is not None:
            return self.exact_casts.first_mismatch()
        if self.float64 is not None:
            return self.float64.first_mismatch()
        if self.error is not None:
            return None
        for name, diff in self.grad_max_abs_diff.items():
            if diff > self._allowed(name):
                return name, diff, self._allowed(name)
        logits, bound = max(self.logits_max_abs_diff), allowed(self.tolerance, self.logits_scale)
        return ("logits", logits, bound) if logits > bound else None

    def within(self, factor: float) -> bool:
        """Whether every difference is within ``factor`` tolerances (and nothing raised)."""
        if self.error is not None:
            return False
        name, worst = self.worst_grad
        return (max(self.logits_max_abs_diff) <= factor * allowed(self.tolerance, self.logits_scale)
                and (name == "-" or worst <= factor * self._allowed(name)))

    def __str__(self) -> str:
        name, worst = self.worst_grad
        if self.crash is not None:
            return f"tp={self.tp_size}  FAILED: {self.error}"
        if self.error is not None:
            return f"tp={self.tp_size}  FAILED: the sharded model raised {self.error}"
        comms = ", ".join(f"{k}={v}" for k, v in sorted(self.collectives.items())) or "none"
        fractions = ", ".join(f"{f:.3f}" for f in self.param_fraction)
        lines = [
            f"tp={self.tp_size}  {self.headline()} (tolerance {self.tolerance:g} x max(1, |reference|))",
            f"  logits max |diff| per rank: {', '.join(f'{d:.2e}' for d in self.logits_max_abs_diff)}",
            f"  grads  max |diff|: {worst:.2e} ({name}, reference peaks at {self.grad_scale.get(name, 0.0):.2g}; "
            f"{len(self.grad_max_abs_diff)} parameters)",
            f"  parameter fraction per rank: {fractions}",
            f"  collectives in one forward: {comms} ({self.comm_volume} bytes)",
        ]
        if self.collectives_backward:
            back = ", ".join(f"{k}={v}" for k, v in sorted(self.collectives_backward.items()))
            lines.append(f"  collectives in its backward: {back} ({self.comm_volume_backward} bytes)")
        if self.float64 is not None:
            f64_name, f64_worst = self.float64.worst_grad
            lines.append(f"  above tolerance in float32; re-run in float64 (tolerance {self.float64.tolerance:g}): "
                         f"logits {max(self.float64.logits_max_abs_diff):.2e}, grads {f64_worst:.2e} ({f64_name}) "
                         f"-> {'rounding, the plan is exact' if self.float64.ok else 'the plan is wrong'}")
        if self.float64_skipped is not None:
            lines.append(f"  above tolerance in float32; no float64 re-run (the unsharded model raised "
                         f"{self.float64_skipped}): the float32 run decides")
        if self.exact_casts is not None:
            lines.append(self._exact_casts_line())
            if self.exact_casts.float64_skipped is not None:
                lines.append(f"  (no float64 re-run of it: the unsharded model raised "
                             f"{self.exact_casts.float64_skipped})")
        return "\n".join(lines)

    def headline(self) -> str:
        """``"OK"``, ``"MISMATCH"``, or ``"OK (low-precision rounding: ...)"`` for a ``"rounding"`` verdict."""
        if self.verdict != "rounding":
            return "OK" if self.ok else "MISMATCH"
        logits, grads = self.exact_casts.deciding_diffs()
        return (f"OK (low-precision rounding: with its {casts_text(self.low_precision_casts)} made exact it agrees "
                f"to {max(logits, grads):.1e})")

    def deciding_diffs(self) -> tuple[float, float]:
        """The logits' and the worst gradient's difference in the run that decided (float64 if re-run)."""
        run = self.float64 if self.float64 is not None else self
        return max(run.logits_max_abs_diff), run.worst_grad[1]

    def _exact_casts_line(self) -> str:
        exact = self.exact_casts
        decided = exact.float64 if exact.float64 is not None else exact
        where = "float64, " if exact.float64 is not None else ""
        name, grads = decided.worst_grad
        return (f"  above tolerance with {casts_text(self.low_precision_casts)} in the model; re-run with them made "
                f"exact ({where}tolerance {decided.tolerance:g}): logits {max(decided.logits_max_abs_diff):.2e}, "
                f"grads {grads:.2e} ({name}) -> "
                f"{'low-precision rounding, the plan is exact' if exact.ok else 'the plan is wrong'}")


# Functional-collective namespaces DTensor issues its communication through. ``wait_tensor`` only
# completes an async collective, so it is not counted.
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd"})
_NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd"})


class CollectiveCounter(TorchDispatchMode):
    """Count the collectives dispatched while active, by op name (``all_reduce``: 2, ...).

    ``CommDebugMode`` counts the same ops but also tracks modules with hooks that fail on some
    transformers models (Gemma3's per-layer-type rotary); the counts are all verify needs.
    """

    def __init__(self):
        super().__init__()
        self.counts: Counter[str] = Counter()
        # Bytes of the whole tensor each collective reduces or gathers, the volume a ring moves
        # (W-1)/W of: twice the input for an all-reduce (a reduce-scatter then an all-gather), the
        # input for a reduce-scatter, the output for an all-gather.
        self.volume = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            # Let DTensor run first and desugar into collectives, which then come back here.
            return NotImplemented
        name = func._schema.name.split("::")[-1]
        if func.namespace in _COLLECTIVE_NAMESPACES and name not in _NOT_COLLECTIVES:
            self.counts[name] += 1
            self.volume += _volume(name, args)
        return func(*args, **(kwargs or {}))


def _volume(name: str, args) -> int:
    tensors = args[0] if isinstance(args[0], (list, tuple)) else [args[0]]
    nbytes = sum(t.numel() * t.element_size() for t in tensors if isinstance(t, torch.Tensor))
    if name.startswith("all_reduce"):
        return 2 * nbytes
    if name.startswith("all_gather"):
        return nbytes * int(args[1])  # (input, group_size, group_name)
    return nbytes


def renamed_inputs(example_inputs, inputs, where: str):
    """``example_inputs``, or the same thing passed under its former name ``inputs`` (with a
    DeprecationWarning): one keyword name across autotp's entry points.

    Raises:
        AutoTPError: both names were given.
    """
    if inputs is None:
        return example_inputs
    if example_inputs is not None:
        raise AutoTPError(f"{where}: got both example_inputs= and inputs=; pass example_inputs= only "
                          "(inputs= is its former name).")
    warnings.warn(f"{where}(inputs=...) is deprecated; pass example_inputs=... (the keyword synthesize, "
                  "check_plan, get_plan and parallelize take).", DeprecationWarning, stacklevel=3)
    return inputs


def default_inputs(model: nn.Module, tp_size: int, *, batch: int = 2, seed: int = 0) -> dict:
    """Token ids for a transformers-style model, with a sequence length divisible by ``tp_size``."""
    config = getattr(model, "config", None)
    config = getattr(config, "text_config", None) or config
    vocab = getattr(config, "vocab_size", None)
    if vocab is None:
        raise VerificationError(
            f"{type(model).__name__}: no config.vocab_size to draw token ids from; pass example_inputs= "
            "(a dict of keyword arguments or a tuple of positional ones)."
        )
    seq = max(16, 2 * tp_size)
    generator = torch.Generator().manual_seed(seed)
    return {"input_ids": torch.randint(0, vocab, (batch, seq), generator=generator)}


def call_model(model: nn.Module, inputs) -> torch.Tensor:
    out = model(**inputs) if isinstance(inputs, dict) else model(*inputs)
    return model_logits(out, model)


def _loss(logits: torch.Tensor) -> torch.Tensor:
    """A cross-entropy on fixed labels: every logit gets a distinct gradient."""
    flat = logits.float().reshape(-1, logits.shape[-1])
    labels = torch.arange(flat.shape[0]) * 7 % flat.shape[-1]
    return F.cross_entropy(flat, labels)


def check_materialised(model: nn.Module) -> None:
    for name, tensor in [*model.named_parameters(), *model.named_buffers()]:
        if tensor.is_meta:
            raise VerificationError(
                f"{name} is on the meta device: verify needs real values to compare. Build the model "
                "on cpu (e.g. autotp.models.build_model(name, tiny=True, device='cpu')) or call "
                "model.to_empty(device='cpu') and initialise it."
            )


def _reference_slice(ref: torch.Tensor, param, rank: int, tp_size: int) -> torch.Tensor:
    """The part of the unsharded tensor ``ref`` that ``rank`` should hold for sharded ``param``."""
    if not isinstance(param, DTensor):
        return ref
    to_layout = getattr(param, "_autotp_to_layout", None)  # styles that reorder or repeat rows
    if to_layout is not None:
        ref = to_layout(ref)
    for placement in param.placements:
        if isinstance(placement, Shard):
            ref = torch.chunk(ref, tp_size, dim=placement.dim)[rank]
    return ref


def _local(t: torch.Tensor) -> torch.Tensor:
    return t.to_local() if isinstance(t, DTensor) else t


def trace_leftovers(model: nn.Module) -> dict[str, torch.Tensor]:
    """Module attributes holding a fake tensor: state a module wrote during a trace (a recurrent
    block's ``recurrent_states`` saved in forward), left behind when ``torch.export`` returned.

    Copied along with the model, such a tensor drags its fake mode into real runs: deep copies made
    under the simulated runtime then corrupt memory (measured on a recurrent block at tp=4: of 7
    runs, 1 raised and 2 killed the process; 0 of 28 once it was dropped).
    """
    from torch._subclasses.fake_tensor import FakeTensor

    return {f"{fqn}.{name}" if fqn else name: value for fqn, module in model.named_modules()
            for name, value in vars(module).items() if isinstance(value, FakeTensor)}


def clean_copy(model: nn.Module) -> nn.Module:
    """A deep copy of ``model`` whose :func:`trace_leftovers` are None (the model is not modified)."""
    leftovers = trace_leftovers(model)
    if leftovers:
        log.warning("%s: dropping fake tensors a trace left in module state (%s) from the verified copies",
                    type(model).__name__, ", ".join(sorted(leftovers)))
    try:
        return deep_copy(model, memo={id(value): None for value in leftovers.values()})
    except RuntimeError as error:  # a non-leaf tensor held as module state (legacy weight_norm)
        if "deepcopy" not in str(error):
            raise
        raise VerificationError(
            f"{type(model).__name__}: cannot be copied for verification ({one_line(error)}). Each rank shards a "
            "copy of the model: make it deep-copyable (legacy torch.nn.utils.weight_norm: use "
            "torch.nn.utils.parametrizations.weight_norm, or remove_weight_norm before sharding)."
        ) from error


def reference_run(model: nn.Module, inputs, backward: bool):
    """Logits and (after the verify loss's backward) parameters of an unsharded copy of ``model``."""
    reference = clean_copy(model).eval()
    reference.zero_grad(set_to_none=True)
    ref_logits = call_model(reference, inputs)
    if backward:
        _loss(ref_logits).backward()
    return ref_logits.detach(), dict(reference.named_parameters())


def verify(
    model: nn.Module,
    plan: Plan,
    *,
    tp_size: int = 2,
    example_inputs=None,
    backward: bool = True,
    tolerance: float = DEFAULT_TOLERANCE,
    isolated: bool = False,
    timeout: float = 600.0,
    inputs=None,
) -> VerifyReport:
    """Check ``plan`` on ``model`` against the unsharded model, with ``tp_size`` simulated ranks.

    Args:
        model: a materialised model (fp32 recommended); it is not modified.
        plan: the plan to check (styles, or transformers' style strings: see :func:`autotp.hf_plans.as_styles`).
        tp_size: number of simulated ranks (2, 4, 8...).
        example_inputs: keyword (dict) or positional (tuple) arguments for one forward (the keyword
            ``synthesize``, ``check_plan``, ``get_plan`` and ``parallelize`` take too); by default
            token ids drawn from ``model.config.vocab_size``.
        backward: also compare parameter gradients after a cross-entropy backward.
        tolerance: max abs difference counted as equal.
        isolated: run the check in a fresh child interpreter (:func:`verify_isolated`): a crash of
            the simulated runtime (a corrupted heap, a segfault) becomes a failed report whose
            ``crash`` names the signal, instead of killing this process. Costs a few seconds of start.
        timeout: seconds an isolated check may run before it is killed and reported as timed out.
        inputs: the former name of ``example_inputs``; still accepted, with a DeprecationWarning.

    Returns:
        A :class:`VerifyReport`. Its ``verdict``: ``"exact"`` when the sharded model agrees within
        ``tolerance`` (a float32 run just above it is re-run in float64, where rounding vanishes);
        ``"rounding"`` when it differs only by the model's own casts to bf16 / fp16 (the difference
        goes when they are made exact, :mod:`autotp.casts`: ``report.exact_casts``), which counts as
        ok and is said in the report's first line; ``"mismatch"`` otherwise.

    Raises:
        VerificationError: the model is on meta, no inputs can be made, or (isolated) the model
            or plan cannot be sent to the child.
    """
    inputs = renamed_inputs(example_inputs, inputs, "verify")
    check_materialised(model)
    plan = as_styles(model, plan)
    if inputs is None:
        inputs = default_inputs(model, tp_size)
    if isolated:
        return verify_isolated(model, plan, timeout=timeout, tp_size=tp_size, inputs=inputs, backward=backward,
                               tolerance=tolerance)
    report = _verify_once(model, plan, tp_size, inputs, backward, tolerance)
    if report.ok or report.error is not None:
        return report
    exact_dtype = _exact_dtype(model)
    casts = low_precision_casts(model, inputs, backward) if exact_dtype is not None else {}
    if casts:
        # Rounding of bf16 / fp16 partial results survives a float64 re-run: the casts decide.
        report.low_precision_casts = casts
        report.exact_casts = _decide(model, plan, tp_size, inputs, backward, tolerance, exact_dtype)
    else:
        _recheck_in_float64(report, model, plan, tp_size, inputs, backward, None)
    return report


def low_precision_casts(model: nn.Module, inputs, backward: bool = True) -> dict[str, int]:
    """The casts to bf16 / fp16 one forward (and backward) of an unsharded copy of ``model`` makes,
    per dtype (``{"bfloat16": 10}``); empty when it computes at its own precision throughout."""
    with LowPrecisionCasts() as watch:
        reference_run(model, inputs, backward)
    return dict(watch.counts)


def _decide(model, plan, tp_size, inputs, backward, tolerance, exact_dtype) -> VerifyReport:
    """The check with the model's low-precision casts made ``exact_dtype``; re-run in float64 (casts
    made float64) when just above tolerance, as for a model without casts."""
    report = _verify_once(model, plan, tp_size, inputs, backward, tolerance, exact_dtype=exact_dtype)
    if not report.ok and report.error is None:
        _recheck_in_float64(report, model, plan, tp_size, inputs, backward, torch.float64)
    return report


def _recheck_in_float64(report, model, plan, tp_size, inputs, backward, exact_dtype) -> None:
    """Set ``report.float64`` when a float32 run is above tolerance but within RECHECK_FACTOR of it."""
    if not (report.within(RECHECK_FACTOR) and _is_float32(model)):
        return
    try:
        report.float64 = _verify_once(clean_copy(model).double(), plan, tp_size, _double(inputs), backward,
                                      FLOAT64_TOLERANCE, exact_dtype=exact_dtype)
    except RuntimeError as error:  # the unsharded model cannot run in float64 (torch._grouped_mm has no kernel)
        report.float64_skipped = one_line(error)
        log.warning("%s: no float64 re-run, the unsharded model raised %s; the float32 run decides",
                    type(model).__name__, report.float64_skipped)


def _exact_dtype(model: nn.Module) -> torch.dtype | None:
    """The dtype a model's low-precision casts are made exact in: its own, when float32 or float64."""
    dtypes = {p.dtype for p in model.parameters()}
    return dtypes.pop() if len(dtypes) == 1 and dtypes <= {torch.float32, torch.float64} else None


def require_ok(report: VerifyReport, *, what: str) -> VerifyReport:
    """``report`` if it verified; else raise :class:`VerificationError` naming what differed.

    Args:
        report: a :class:`VerifyReport`.
        what: the subject, for the message (``"LlamaForCausalLM's synthesized plan"``).

    Raises:
        VerificationError: with ``parameter`` / ``difference`` / ``allowed`` of the first mismatch,
            or ``crash`` when the verification worker died.
    """
    if report.verdict == "rounding":
        log.info("%s at tp=%d: %s", what, report.tp_size, report.headline())
    if report.ok:
        return report
    fix = ("pass a handwritten plan (tp_shard_plan=...), or opt out of the check "
           "(verify_synthesized=False) only if another check covers it")
    if report.crash is not None:
        raise VerificationError(f"{what} could not be checked at tp={report.tp_size}: {report.error}; {fix}.",
                                crash=report.crash, report=report)
    if report.error is not None:
        raise VerificationError(f"{what} fails at tp={report.tp_size}: the sharded model raised {report.error}; "
                                f"{fix}.", report=report)
    name, diff, bound = report.first_mismatch()
    logits = max(report.logits_max_abs_diff)
    exact = (f" with its {casts_text(report.low_precision_casts)} made exact" if report.exact_casts is not None
             else "")
    raise VerificationError(
        f"{what} is numerically wrong at tp={report.tp_size}: {name} differs from the unsharded model by "
        f"{diff:.2e}{exact} (allowed {bound:.1e}; logits differ by {logits:.2e}); {fix}.",
        parameter=name, difference=diff, allowed=bound, report=report)


def _is_float32(model: nn.Module) -> bool:
    return all(p.dtype == torch.float32 for p in model.parameters())


def _double(inputs):
    if isinstance(inputs, torch.Tensor):
        return inputs.double() if inputs.is_floating_point() else inputs
    if isinstance(inputs, dict):
        return {k: _double(v) for k, v in inputs.items()}
    if isinstance(inputs, (tuple, list)):
        return type(inputs)(_double(v) for v in inputs)
    return inputs


def _verify_once(model, plan, tp_size, inputs, backward, tolerance, exact_dtype=None) -> VerifyReport:
    """One check; with ``exact_dtype``, the model's casts to bf16 / fp16 give that dtype instead,
    in the reference and in the sharded run alike."""
    casts = (lambda: LowPrecisionCasts(exact_dtype)) if exact_dtype is not None else contextlib.nullcontext
    with casts():
        ref_logits, ref_params = reference_run(model, inputs, backward)

    with _simulate.simulated_mesh(tp_size) as mesh:
        sharded = clean_copy(model).eval()
        sharded.zero_grad(set_to_none=True)
        apply_plan(sharded, mesh, plan)
        try:
            # Entered inside the simulator's mode: it sees each op of the sharded model once.
            with casts():
                return _run_sharded(sharded, inputs, ref_logits, ref_params, tp_size, backward, tolerance)
        except AutoTPError:
            raise
        except Exception as error:  # a wrong plan usually surfaces as a shape or placement error
            message = one_line(error)
            return VerifyReport(tp_size=tp_size, tolerance=tolerance, logits_max_abs_diff=[float("inf")], error=message)


def _run_sharded(sharded, inputs, ref_logits, ref_params, tp_size, backward, tolerance) -> VerifyReport:
    """Forward (counting collectives) and backward on the sharded model; compare with the reference."""
    simulated = lambda t: list(enumerate(_simulate.per_rank(t, tp_size)))  # noqa: E731
    logit_diffs, grad_diffs, held, counts = run_and_compare(sharded, inputs, ref_logits, ref_params, backward, simulated)
    return VerifyReport(
        tp_size=tp_size,
        tolerance=tolerance,
        logits_max_abs_diff=[logit_diffs[r] for r in range(tp_size)],
        grad_max_abs_diff=grad_diffs,
        param_fraction=[held[r] for r in range(tp_size)],
        **comm_fields(counts),
        **scales(ref_logits, ref_params),
    )


def comm_fields(counts: dict) -> dict:
    """:class:`VerifyReport`'s communication fields from :func:`run_and_compare`'s counts."""
    return {"collectives": counts["forward"], "collectives_backward": counts["backward"],
            "comm_volume": counts["volume"], "comm_volume_backward": counts["backward_volume"],
            "grads_not_local_size": counts["full_grads"]}


def scales(ref_logits: torch.Tensor, ref_params: dict) -> dict:
    """Peak magnitudes of the reference logits and gradients, as :class:`VerifyReport` fields."""
    return {
        "logits_scale": ref_logits.abs().max().item(),
        "grad_scale": {n: p.grad.abs().max().item() for n, p in ref_params.items()
                       if p.grad is not None and p.grad.numel()},
    }


def run_and_compare(sharded, inputs, ref_logits, ref_params, backward, rank_values):
    """One forward (collectives counted) and backward of ``sharded``, compared with the reference.

    ``rank_values(t)`` lists ``(rank, local value)`` for the ranks this process holds: every rank
    when simulated, its own one in a real process group.

    Returns:
        ``({rank: logits diff}, {param: grad diff}, {rank: parameter fraction}, communication)``;
        the communication holds the forward's and the backward's collective counts (``"forward"``,
        ``"backward"``) and volumes in bytes (``"volume"``, ``"backward_volume"``), and the
        parameters whose local gradient is not their local shard's size (``"full_grads"``).
    """
    with CollectiveCounter() as comm:
        logits = call_model(sharded, inputs)
    full = logits.full_tensor() if isinstance(logits, DTensor) else logits
    logit_diffs = {rank: (value - ref_logits).abs().max().item() for rank, value in rank_values(full.detach())}
    loss = _loss(full) if backward else None
    with CollectiveCounter() as back:
        # The backward of the logits' full_tensor() is a local slice: what is counted is the plan's.
        if loss is not None:
            loss.backward()
    grad_diffs, held, full_grads = _compare_params(sharded, ref_params, backward, rank_values)
    communication = {"forward": dict(comm.counts), "backward": dict(back.counts), "volume": comm.volume,
                     "backward_volume": back.volume, "full_grads": full_grads}
    return logit_diffs, grad_diffs, held, communication


def _compare_params(sharded: nn.Module, ref_params: dict, backward: bool, rank_values):
    """Per-parameter max gradient difference, the fraction of parameters each rank holds, and the
    parameters whose local gradient is larger than their local shard (a full-size gradient on every
    rank for a sharded parameter: memory the optimizer and FSDP2 must not see)."""
    grad_diffs: dict[str, float] = {}
    full_grads: list[str] = []
    held: Counter[int] = Counter()
    total = 0
    for name, param in sharded.named_parameters():
        ref = ref_params[name]
        total += ref.numel()
        for rank, value in rank_values(_local(param).detach()):
            held[rank] += value.numel()
        if not backward or ref.grad is None:
            continue
        grad = param.grad
        if grad is None:
            grad_diffs[name] = float("inf")
            continue
        if isinstance(grad, DTensor) and not isinstance(param, DTensor):
            # A plain parameter whose gradient came back a DTensor (it met DTensors in the forward
            # as an implicitly replicated scalar): no optimizer can step it; a failure, not a crash.
            log.warning("%s: a plain parameter whose gradient is a DTensor (%s)", name, grad.placements)
            grad_diffs[name] = float("inf")
            continue
        if _local(grad).shape != _local(param).shape:
            full_grads.append(name)
        if isinstance(grad, DTensor) and grad.placements != param.placements:
            # An optimizer step redistributes the gradient to the parameter's layout; do the same.
            grad = grad.redistribute(param.device_mesh, param.placements)
        worst = 0.0
        for rank, local_grad in rank_values(_local(grad)):
            expected = _reference_slice(ref.grad, param, rank, _tp_size(param))
            if expected.shape != local_grad.shape:
                worst = float("inf")
                break
            worst = max(worst, (local_grad - expected).abs().max().item())
        grad_diffs[name] = worst
    return grad_diffs, {rank: h / total for rank, h in held.items()}, full_grads


def _tp_size(param) -> int:
    return param.device_mesh.size() if isinstance(param, DTensor) else 1


# The isolated run: :func:`verify_isolated` starts ``python -m autotp.isolated``, the child's side.

# Lines of the child's stderr kept in the report of a crash: the runtime's last words.
_STDERR_TAIL = 3


def crash_name(returncode: int) -> str:
    """``"SIGABRT"`` for a child killed by a signal (a negative return code), else ``"exit code N"``.

    >>> crash_name(-6), crash_name(3)
    ('SIGABRT', 'exit code 3')
    """
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def model_payload(model: nn.Module) -> tuple:
    """What the child needs to have ``model``: ``("model", model)`` when it pickles, else
    ``("config", config, dtype)`` to rebuild it from its transformers config (fresh weights:
    the check then compares the rebuilt model with its own unsharded copy).

    Raises:
        VerificationError: the model neither pickles nor has a transformers config.
    """
    try:
        model = clean_copy(model)  # without a trace's leftover fake tensors, which do not pickle
        pickle.dumps(model)
        return ("model", model)
    except Exception as error:  # local classes, lambdas in hooks, open handles
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "model_type"):
            raise VerificationError(
                f"{type(model).__name__}: an isolated verification sends the model to a child process by "
                f"pickle, which failed ({type(error).__name__}: {error}); define the class at module level "
                "(importable by the child), or call verify(..., isolated=False)."
            ) from error
        log.info("%s does not pickle (%s); the isolated check rebuilds it from its config",
                 type(model).__name__, type(error).__name__)
        dtype = next((p.dtype for p in model.parameters()), None)
        return ("config", config, dtype)


def verify_isolated(model: nn.Module, plan, *, timeout: float = 600.0, **options):
    """:func:`autotp.verify` in a fresh child interpreter; a crash or a hang is a failed report.

    Args:
        model: the model (pickled to the child; see :func:`model_payload`).
        plan: the plan; it must pickle (styles defined at module level do).
        timeout: seconds before the child is killed and the run reported as timed out.
        **options: the keyword arguments of :func:`autotp.verify` (``tp_size``, ``inputs``, ...).

    Returns:
        The child's :class:`~autotp.verifier.VerifyReport`, or a failed one whose ``crash`` names
        the signal (``"SIGABRT"``), the exit code or the timeout, and whose ``error`` quotes the
        child's last stderr lines.

    Raises:
        VerificationError: the model or the plan cannot be sent to the child.
    """
    try:
        payload = pickle.dumps({"model": model_payload(model), "plan": plan, "options": options})
    except VerificationError:
        raise
    except Exception as error:
        raise VerificationError(
            f"an isolated verification sends the plan to a child process by pickle, which failed "
            f"({type(error).__name__}: {error}); use styles defined at module level, or isolated=False."
        ) from error
    with tempfile.TemporaryDirectory(prefix="autotp-verify-") as tmp:
        source, result, errors = Path(tmp, "in.pkl"), Path(tmp, "out.pkl"), Path(tmp, "stderr.txt")
        source.write_bytes(payload)
        crash = _run_child(source, result, errors, timeout)
        if crash is None and result.is_file():
            kind, value = pickle.loads(result.read_bytes())
            if kind == "raised":  # as verify would have raised in this process
                raise value
            return value
        tail = _tail(errors)
    crash = crash or "exit without a report"
    tp_size = options.get("tp_size", 2)
    tolerance = options.get("tolerance", DEFAULT_TOLERANCE)
    message = f"the verification worker died ({crash})" + (f": {tail}" if tail else "")
    return VerifyReport(tp_size=tp_size, tolerance=tolerance, logits_max_abs_diff=[float("inf")],
                        error=message, crash=crash)


def _run_child(source: Path, result: Path, errors: Path, timeout: float) -> str | None:
    """Run the child on ``source``; None when it exited cleanly, else how it died."""
    env = dict(os.environ)
    # The child must import what the parent imported (test modules, a user's model classes).
    env["PYTHONPATH"] = os.pathsep.join(p for p in [*sys.path, env.get("PYTHONPATH", "")] if p)
    command = [sys.executable, "-m", "autotp.isolated", str(source), str(result)]
    with open(errors, "wb") as stderr:
        try:
            done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                                  env=env, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:  # run() has killed the child
            return f"timeout after {timeout:g} s"
    return None if done.returncode == 0 else crash_name(done.returncode)


def _tail(path: Path) -> str:
    """The last few non-empty lines of the child's output, joined with ' | '."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-_STDERR_TAIL:])[-600:]
