"""Coverage sweep: every transformers causal-LM architecture, synthesized and verified, with the checker measured.

For each ``model_type`` in transformers' ``MODEL_FOR_CAUSAL_LM_MAPPING_NAMES`` and each case (tp 2
and 4, plain and sequence parallel) a worker process builds the tiny random model
(:func:`autotp.models.build_model`), then

- synthesizes a plan and verifies it (logits and every gradient against the unsharded model);
- verifies transformers' own plan (``autotp.get_plan(source="hf")``; plain cases only: it has no
  sequence-parallel variant);
- runs :func:`autotp.check_plan` on each plan it verified, so the static checker can be scored
  against the verifier (flagged / missed / false positive).

Every failure gets a reason class (:data:`REASONS`) derived from where it happened and the
exception or report, never from the model's name. Results go to ``benchmarks/results/coverage.json``
and ``benchmarks/results/COVERAGE.md`` (see :mod:`coverage_report`).

    python benchmarks/coverage.py                      # everything, 2 workers
    python benchmarks/coverage.py --only llama,qwen3 --tp 2 --workers 1
"""

from __future__ import annotations

import argparse
import json
import multiprocessing
import resource
import sys
import time
import traceback
import warnings
from dataclasses import dataclass, replace
from datetime import datetime, timezone
from multiprocessing.connection import wait
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"

# Reason classes: where the case stopped and what stopped it.
REASONS = {
    "config-unbuildable": "the tiny config or the model could not be built from it",
    "config-not-tiny": "the shrunk config is still large (a width or table the shrinker does not know)",
    "unsharded-forward-failed": "the unsharded tiny model fails on token ids alone",
    "not-a-language-model": "the traced forward looks up no token embedding",
    "export-failed": "torch.export could not trace the model",
    "indivisible": "a sharded extent is not divisible by tp",
    "synthesis-crashed": "the synthesizer raised an unexpected error",
    "plan-apply-failed": "the plan could not be applied (key or style rejected before running)",
    "sharded-run-crashed": "the sharded model raised during forward or backward",
    "verify-mismatch": "the sharded model ran but its logits or gradients differ",
    "timeout": "the case ran past its time limit and was killed",
    "memory-limit": "an allocation went past the worker's memory cap (the tiny model is not tiny)",
    "worker-died": "the worker process died (out of memory, segfault); the signal is recorded",
    "runtime-crashed": "the simulated runtime killed its isolated verification (a signal such as SIGABRT) "
                       "and the gloo re-check did not decide",
    "no-plan": "transformers ships no tp plan for this model",
}
# Why a model type is left out of the decoder-only text denominator (read from config and class).
EXCLUSIONS = {
    "encoder-decoder": "config.is_encoder_decoder: the causal LM is the decoder half of a seq2seq model",
    "multimodal": "the config has non-text sub-configs (vision, audio, ...): not a text-only model",
    "encoder-family": "config.is_decoder defaults to False: a bidirectional encoder with an LM head added",
    "non-text-input": "the model's main input is not input_ids",
}


# A shrunk model above this is a config the shrinker does not understand (verifying it would take
# minutes and gigabytes); the largest tiny families (per-layer vocab tables) stay under 2M.
MAX_TINY_PARAMS = 20_000_000
# Isolated verifications per plan when a case is re-run after its worker died (see run_pool).
RETRY_ISOLATED = 3


@dataclass(frozen=True)
class Case:
    """One unit of work: a model type at a tp size, plain or sequence parallel.

    ``isolated``: verify each plan that many times in a fresh child process (0: in the worker), so
    that a crash of the simulated runtime is recorded with its signal instead of killing the worker.
    """

    model_type: str
    tp: int
    sp: bool
    isolated: int = 0

    @property
    def key(self) -> str:
        return f"{self.model_type}/tp{self.tp}/{'sp' if self.sp else 'plain'}"


def architectures() -> list[str]:
    """Every model type transformers maps to a causal-LM class, sorted."""
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    return sorted(MODEL_FOR_CAUSAL_LM_MAPPING_NAMES)


def cases(types: list[str], tps=(2, 4), modes=(False, True), isolated: int = 0) -> list[Case]:
    return [Case(t, tp, sp, isolated) for t in types for tp in tps for sp in modes]


def classify(model_type: str) -> tuple[str, str]:
    """``("decoder-text", "")`` or ``(exclusion class, detail)`` from the config and model class alone."""
    import transformers
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    try:
        config = AutoConfig.for_model(model_type)
    except Exception as error:  # unbuildable: counted in the denominator, as a failure
        return "decoder-text", f"config not inspectable ({type(error).__name__})"
    if getattr(config, "is_encoder_decoder", False):
        return "encoder-decoder", EXCLUSIONS["encoder-decoder"]
    others = sorted(k for k in (getattr(config, "sub_configs", None) or {}) if k != "text_config")
    if others:
        return "multimodal", f"sub-configs {', '.join(others)}"
    if getattr(config, "is_decoder", None) is False:
        return "encoder-family", EXCLUSIONS["encoder-family"]
    cls = getattr(transformers, MODEL_FOR_CAUSAL_LM_MAPPING_NAMES[model_type], None)
    main_input = getattr(cls, "main_input_name", "input_ids")
    if main_input != "input_ids":
        return "non-text-input", f"main input {main_input}"
    return "decoder-text", ""


# ----------------------------------------------------------------------------------------------
# One case, in a worker


def _message(error: BaseException) -> str:
    from autotp.errors import one_line

    return one_line(error)


_OUT_OF_MEMORY = ("MemoryError", "can't allocate memory", "std::bad_alloc")


def _reason(default: str, error: BaseException | str) -> str:
    """``default``, unless the error is an allocation past the worker's memory cap."""
    text = error if isinstance(error, str) else _message(error)
    return "memory-limit" if any(s in text for s in _OUT_OF_MEMORY) else default


def _synthesis_reason(error: BaseException) -> str:
    """The reason class of an exception from ``synthesize``: its type, and for TraceError which check."""
    from autotp.errors import MeshError, TraceError

    text = str(error)
    if isinstance(error, TraceError):
        if "no embedding lookup" in text:
            return "not-a-language-model"
        return "export-failed"
    if isinstance(error, MeshError):
        return "indivisible"
    return _reason("synthesis-crashed", error)


def _layers(model) -> int:
    config = model.config.get_text_config() if hasattr(model.config, "get_text_config") else model.config
    return int(getattr(config, "num_hidden_layers", 0) or 0)


def check_and_verify(model, plan, tp: int, *, isolated: int = 0) -> dict:
    """Verify ``plan`` numerically and run the static checker on it; one dict for the table.

    ``isolated`` > 0 runs the verification that many times in fresh child processes (see
    :func:`verify_isolated_runs`); otherwise once in this process.
    """
    from autotp import verify
    from autotp.check import check_plan

    out: dict = {}
    try:
        findings = check_plan(model, plan, tp_size=tp)
        out["check"] = {"flagged": bool(findings), "findings": [f"{f.kind}: {f.module}" for f in findings][:8]}
    except Exception as error:  # the checker is what is measured here: its crash is a result
        out["check"] = {"flagged": None, "error": _message(error)}
    try:
        if isolated:
            report = verify_isolated_runs(model, plan, tp, isolated, out)
        else:
            report = verify(model, plan, tp_size=tp)
    except Exception as error:  # raised before the sharded run: the reference backward, or applying
        stage = "unsharded-forward-failed" if _raised_in(error, "reference_run") else "plan-apply-failed"
        out.update(status="failed", reason=_reason(stage, error), error=_message(error))
        return out
    if report.crash is not None:
        out.update(status="failed", reason="runtime-crashed", signal=report.crash, error=report.error)
        return out
    if report.error is not None:
        out.update(status="failed", reason=_reason("sharded-run-crashed", report.error), error=report.error)
        return out
    name, worst = report.worst_grad
    out.update(param_fraction=round(max(report.param_fraction), 4), collectives=dict(report.collectives),
               collectives_backward=dict(report.collectives_backward),
               comm_volume=report.comm_volume, comm_volume_backward=report.comm_volume_backward,
               grads_not_local_size=list(report.grads_not_local_size),
               logits_diff=max(report.logits_max_abs_diff), grad_diff=worst)
    if report.float64 is not None:  # fp32 differences above tolerance, decided in float64
        out["float64_recheck"] = {"ok": report.float64.ok, "logits_diff": max(report.float64.logits_max_abs_diff),
                                  "grad_diff": report.float64.worst_grad[1]}
    if report.exact_casts is not None:  # the model casts to bf16 / fp16 inside: decided with them exact
        logits, grads = report.exact_casts.deciding_diffs()
        out["exact_casts_recheck"] = {"casts": dict(report.low_precision_casts), "ok": report.exact_casts.ok,
                                      "logits_diff": logits, "grad_diff": grads}
    out["verdict"] = report.verdict
    if report.ok:
        out["status"] = "verified"
        out.update(per_token_comm(model, plan, tp, report))
    else:
        out.update(status="failed", reason="verify-mismatch", error=f"worst gradient {name} {worst:.2e}, "
                   f"logits {max(report.logits_max_abs_diff):.2e}")
    return out


def per_token_comm(model, plan, tp: int, report) -> dict:
    """Collective bytes per token, forward and backward, and the bytes that do not grow with tokens.

    The plan is verified again at twice the batch: the volumes' difference over the tokens added is
    what each token costs (activations and their gradients); the rest of the first run's volume is
    fixed per step (a weight gradient all-reduced: copies of grouped B/C channels, replicated norms),
    which a 32-token tiny model weighs far above what it weighs at training token counts.
    """
    from autotp import verify
    from autotp.verifier import default_inputs

    ids = default_inputs(model, tp)["input_ids"]  # what the first verification ran on
    tokens = ids.numel()
    try:
        again = verify(model, plan, tp_size=tp, example_inputs=default_inputs(model, tp, batch=2 * ids.shape[0]))
    except Exception as error:  # recorded, not fatal: the first verification decided the row
        return {"per_token_error": _message(error)}
    if not again.ok:
        return {"per_token_error": str(again).splitlines()[0]}
    forward = (again.comm_volume - report.comm_volume) / tokens
    backward = (again.comm_volume_backward - report.comm_volume_backward) / tokens
    return {"comm_per_token": {"forward": forward, "backward": backward,
                               "forward_fixed": round(report.comm_volume - forward * tokens),
                               "backward_fixed": round(report.comm_volume_backward - backward * tokens)}}


def _run_label(report) -> str:
    """One isolated run in a word: verified, mismatch, raised, or the signal that killed it."""
    if report.crash is not None:
        return f"crashed ({report.crash})"
    if report.error is not None:
        return "raised"
    return "verified" if report.ok else "mismatch"


def verify_isolated_runs(model, plan, tp: int, runs: int, out: dict):
    """Verify ``plan`` ``runs`` times in fresh child processes; the report that decides the row.

    Each run's outcome goes to ``out["isolated_runs"]``. When every run agrees, that is the answer.
    When one crashed (the simulated runtime's heap, not the plan, is in doubt), the plan is checked
    once more on ``tp`` real gloo processes, which use no simulated runtime
    (:func:`autotp.verify_multiprocess`); its report decides, recorded as ``verified_on: gloo``.
    Without a decision the crashed report is returned, and the row says ``runtime-crashed``.
    """
    from autotp import verify, verify_multiprocess
    from autotp.errors import VerificationError

    reports = [verify(model, plan, tp_size=tp, isolated=True) for _ in range(runs)]
    out["isolated_runs"] = [_run_label(r) for r in reports]
    crashed = [r for r in reports if r.crash is not None]
    if not crashed:
        return next((r for r in reports if not r.ok), reports[0])
    try:
        gloo = verify_multiprocess(model, plan, procs=tp)
    except VerificationError as error:  # a gloo worker died too: the crash stands
        out["gloo"] = _message(error)
        return crashed[0]
    out["verified_on"] = "gloo"
    out["gloo"] = "verified" if gloo.ok else ("raised" if gloo.error else "mismatch")
    return gloo


def _raised_in(error: BaseException, function: str) -> bool:
    """Whether ``function`` was on the stack where ``error`` was raised."""
    return any(frame.name == function for frame in traceback.extract_tb(error.__traceback__))


# Roles of modules whose weights stay whole on every rank (a whole module between a norm and column
# Linears runs its backward on partial gradients, but holds all of its weights).
_KEPT_WHOLE = frozenset({"replicate", "partial_grad_module"})


def _replicated(model, sp: bool, tp: int) -> list[dict]:
    """Modules with weights (parameters of 2 dims or more) the synthesizer kept whole, with its reason."""
    from autotp import explain

    owners = {n for n, m in model.named_modules() if any(p.ndim >= 2 for p in m.parameters(recurse=False))}
    return [{"module": r.key, "reason": r.reason[:200]} for r in explain(model, sequence_parallel=sp, tp_size=tp)
            if r.role in _KEPT_WHOLE and any(_key_covers(r.key, o) for o in owners)]


def _key_covers(key: str, fqn: str) -> bool:
    from fnmatch import fnmatchcase

    return fnmatchcase(fqn, key)


def run_case(case: Case) -> dict:
    """Build, synthesize, verify, check (and transformers' plan in plain cases); never raises."""
    import torch

    from autotp import get_plan
    from autotp.errors import PlanError
    from autotp.verifier import call_model, default_inputs

    warnings.simplefilter("ignore")
    start = time.perf_counter()
    result: dict = {"model_type": case.model_type, "tp": case.tp, "sp": case.sp}
    result["class"], result["class_detail"] = classify(case.model_type)
    # The shrunk config first. A family whose code splits heads into a fixed number of groups
    # (CodeGen's 4) fails on token ids alone with so few: 2x and 4x the heads are tried next. One
    # that needs two layers of a kind (Zamba ties a shared block across its hybrid layers) cannot be
    # built from one of each: the layer pattern is repeated once.
    variants, tried = [(case.tp, 1)], 0
    while tried < len(variants):
        heads_for, repeat = variants[tried]
        tried += 1
        try:
            model = _tiny_model(case.model_type, heads_for, repeat)
        except _NotTiny as error:
            result["synth"] = {"status": "failed", "reason": "config-not-tiny", "error": str(error)}
            break
        except Exception as error:
            if repeat == 1:  # a failed retry keeps the first error: it says what the shrunk config lacks
                result["synth"] = {"status": "failed", "reason": _reason("config-unbuildable", error),
                                   "error": _message(error)}
            if repeat == 1 and heads_for == case.tp:
                variants.append((case.tp, 2))
            continue
        result["model_class"] = type(model).__name__
        result["layers"] = _layers(model)
        try:
            with torch.no_grad():
                call_model(model, default_inputs(model, case.tp))
        except Exception as error:
            result["synth"] = {"status": "failed", "reason": _reason("unsharded-forward-failed", error),
                               "error": _message(error)}
            if heads_for == case.tp:
                variants += [(2 * case.tp, repeat), (4 * case.tp, repeat)]
            continue
        result.pop("synth", None)
        if heads_for != case.tp:
            result["shrunk_heads_for_tp"] = heads_for  # the table notes both
        if repeat != 1:
            result["layer_pattern_repeated"] = repeat
        break
    if "synth" in result:
        return _done(result, start)
    from test_synth_matrix import megatron_fraction

    result["megatron_fraction"] = round(megatron_fraction(model, case.tp), 4)
    result["synth"] = _synth_case(model, case)
    if not case.sp:
        try:
            choice = get_plan(model, source="hf")
            result["hf"] = check_and_verify(model, choice.plan, case.tp, isolated=case.isolated)
        except PlanError as error:
            result["hf"] = {"status": "none", "reason": "no-plan", "error": _message(error)}
        except Exception as error:
            result["hf"] = {"status": "failed", "reason": "plan-apply-failed", "error": _message(error)}
    return _done(result, start)


class _NotTiny(Exception):
    pass


def _layer_indices(value, n: int) -> bool:
    """Whether a config value is a list of layer indices (Zamba2's ``hybrid_layer_ids``), fewer than
    the ``n`` layers: repeated with the layers, each copy offset by ``n``."""
    return (isinstance(value, list) and 0 < len(value) < n and all(type(i) is int and 0 <= i < n for i in value)
            and value == sorted(set(value)))


def _tiny_model(model_type: str, tp: int, repeat: int = 1, dropout: float | None = None):
    """The shrunk model of ``model_type`` with heads for ``tp`` ranks, on cpu, without a KV cache;
    with ``repeat`` > 1 its layers (and every per-layer list) repeated that many times; with
    ``dropout``, every dropout probability of its config set to that value."""
    from transformers import AutoConfig

    from autotp.models import build_model, load_config, shrink_config

    config = shrink_config(load_config(model_type), tp=tp)
    if repeat > 1:
        options = config.to_dict()
        n, key = config.num_hidden_layers, config.attribute_map.get("num_hidden_layers", "num_hidden_layers")
        options = {k: v * repeat if isinstance(v, list) and len(v) == n else
                   [i + r * n for r in range(repeat) for i in v] if _layer_indices(v, n) else v
                   for k, v in options.items()}
        options[key] = n * repeat
        options.pop("model_type", None)
        config = AutoConfig.for_model(model_type, **options)
    for part in (config, config.get_text_config()):
        part.use_cache = False  # a KV cache plays no part in a plan; pure-SSM stacks fail with one
        if dropout is not None:
            for key, value in list(vars(part).items()):
                if ("dropout" in key or "pdrop" in key) and isinstance(value, float):
                    setattr(part, key, dropout)
    size = sum(p.numel() for p in build_model(config).parameters())  # meta: milliseconds
    if size > MAX_TINY_PARAMS:
        raise _NotTiny(f"the shrunk config still has {size / 1e6:.0f}M parameters (limit "
                       f"{MAX_TINY_PARAMS / 1e6:.0f}M): a width or table the shrinker does not know")
    return build_model(config, device="cpu")


def _synth_case(model, case: Case) -> dict:
    from autotp import synthesize

    try:
        plan = synthesize(model, sequence_parallel=case.sp, tp_size=case.tp, verify=False)
    except Exception as error:
        return {"status": "failed", "reason": _synthesis_reason(error), "error": _message(error)}
    out = check_and_verify(model, plan, case.tp, isolated=case.isolated)
    if out["status"] == "verified":
        try:
            out["replicated"] = _replicated(model, case.sp, case.tp)
        except Exception as error:  # explain re-runs synthesis: cannot fail where synthesize did not
            out["replicated_error"] = _message(error)
    return out


def _done(result: dict, start: float) -> dict:
    result["seconds"] = round(time.perf_counter() - start, 2)
    return result


# ----------------------------------------------------------------------------------------------
# The pool: long-lived spawned workers, one case at a time each, killed past the time limit


def _worker(conn, memory_gib: float) -> None:
    """Import once, say ``"ready"``, then run cases from ``conn`` until it sends ``None``."""
    import logging

    import torch
    from transformers.utils import logging as hf_logging

    torch.set_num_threads(1)
    if memory_gib:  # a tiny model that is not tiny (an unshrunk table) must not starve the machine
        limit = int(memory_gib * 2**30)
        resource.setrlimit(resource.RLIMIT_AS, (limit, limit))
    sys.path[:0] = [str(ROOT), str(ROOT / "tests")]
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)
    hf_logging.set_verbosity_error()
    import autotp.synth  # noqa: F401  (imported before the clock of the first case starts)

    conn.send("ready")
    while True:
        try:
            case = conn.recv()
        except EOFError:  # the sweep was killed: nothing more will come
            return
        if case is None:
            return
        try:
            result = run_case(case)
        except BaseException as error:  # run_case catches per stage; this is a bug in the sweep
            result = {"model_type": case.model_type, "tp": case.tp, "sp": case.sp,
                      "sweep_error": _message(error), "traceback": traceback.format_exc()[-2000:]}
        conn.send(result)


class _Slot:
    """A worker process, its pipe, and the case it runs (with its deadline); idle until ready."""

    def __init__(self, ctx, memory_gib: float):
        self.conn, child = ctx.Pipe()
        # Not daemonic: a daemonic process may not start processes, and an isolated case falls back
        # to gloo processes. The worker still ends with the sweep (its recv() sees EOF).
        self.process = ctx.Process(target=_worker, args=(child, memory_gib), daemon=False)
        self.process.start()
        child.close()
        self.ready = False
        self.case: Case | None = None
        self.deadline = float("inf")

    def assign(self, pending: list[Case], timeout: float) -> None:
        self.case = pending.pop() if pending else None
        if self.case is not None:
            self.conn.send(self.case)
            self.deadline = time.monotonic() + timeout

    def stop(self) -> None:
        self.process.kill()
        self.process.join()


def _failed(case: Case, reason: str, detail: str, signal: str | None = None) -> dict:
    """The record of a case whose worker was killed or died: both plans failed for ``reason``."""
    kind, detail_class = classify(case.model_type)
    failure = {"status": "failed", "reason": reason, "error": detail, **({"signal": signal} if signal else {})}
    out = {"model_type": case.model_type, "tp": case.tp, "sp": case.sp, "class": kind,
           "class_detail": detail_class, "synth": failure}
    if not case.sp:
        out["hf"] = dict(failure)
    return out


def run_pool(todo: list[Case], *, workers: int = 2, timeout: float = 120.0, memory_gib: float = 6.0,
             progress: bool = True) -> list[dict]:
    """Run ``todo`` on ``workers`` spawned processes; a case past ``timeout`` seconds is killed.

    Each worker's address space is capped at ``memory_gib`` (0: no cap); an allocation past it
    raises ``MemoryError`` inside the case, which records it as ``memory-limit``.

    The clock of a case starts when it is sent to a worker that has finished its imports. A killed
    or dead worker is replaced by a fresh one; a case whose worker died runs once more in a fresh
    one (a death can come from an earlier case's damage) with its verifications isolated
    (:data:`RETRY_ISOLATED` child processes each, so a crash of the simulated runtime is recorded
    with its signal and decided on gloo), and a second death is recorded.

    Raises:
        RuntimeError: a worker died before it was ready (its imports fail).
    """
    from tqdm import tqdm

    ctx = multiprocessing.get_context("spawn")
    pending = list(reversed(todo))
    slots = [_Slot(ctx, memory_gib) for _ in range(max(1, min(workers, len(todo))))]
    results: list[dict] = []
    retried: set[str] = set()
    bar = tqdm(total=len(todo), disable=not progress, unit="case", dynamic_ncols=True)
    while pending or any(s.case for s in slots):
        ready = wait([s.conn for s in slots if s.case or not s.ready], timeout=1.0)
        for i, slot in enumerate(slots):
            if not slot.ready:
                if slot.conn in ready:
                    try:
                        slot.conn.recv()
                    except EOFError:
                        raise RuntimeError(f"a coverage worker died while importing (exit code "
                                           f"{slot.process.exitcode})") from None
                    slot.ready = True
                    slot.assign(pending, timeout)
                continue
            outcome = _outcome(slot, ready, timeout)
            if outcome is None:
                continue
            died = outcome.get("synth", {}).get("reason") == "worker-died"
            if died and slot.case.key not in retried:
                # A worker can die of an earlier case's damage (a corrupted heap): run it once more
                # in a fresh process before recording the death.
                retried.add(slot.case.key)
                pending.append(replace(slot.case, isolated=max(slot.case.isolated, RETRY_ISOLATED)))
                slot.stop()
                slots[i] = _Slot(ctx, memory_gib)
                continue
            if slot.case.key in retried:
                outcome["retried_after_worker_death"] = True
            results.append(outcome)
            bar.set_postfix_str(slot.case.key, refresh=False)
            bar.update()
            if outcome.get("synth", {}).get("reason") in ("timeout", "worker-died"):
                slot.stop()
                slots[i] = _Slot(ctx, memory_gib)
            else:
                slot.assign(pending, timeout)
    for slot in slots:
        if slot.ready:
            slot.conn.send(None)
        slot.process.join(timeout=5)
        if slot.process.is_alive():
            slot.stop()
    bar.close()
    return results


def _outcome(slot: _Slot, ready: list, timeout: float) -> dict | None:
    """The result of ``slot``'s case if it finished, died or ran out of time; else ``None``."""
    if slot.case is None:
        return None
    if slot.conn in ready:
        try:
            return slot.conn.recv()
        except EOFError:
            from autotp.isolated import crash_name

            slot.process.join(timeout=5)
            code = slot.process.exitcode
            how = crash_name(code) if code is not None else "no exit code"
            signal = how if code is not None and code < 0 else None
            return _failed(slot.case, "worker-died", f"the worker died ({how})", signal=signal)
    if time.monotonic() > slot.deadline:
        return _failed(slot.case, "timeout", f"killed after {timeout:g} s")
    return None


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", help="comma-separated model types (default: all causal-LM types)")
    parser.add_argument("--tp", default="2,4", help="comma-separated tp sizes")
    parser.add_argument("--modes", default="plain,sp", help="plain, sp or both")
    parser.add_argument("--workers", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=120.0, help="seconds per case")
    parser.add_argument("--memory-gib", type=float, default=6.0, help="address-space cap per worker")
    parser.add_argument("--isolated", type=int, default=0, metavar="N",
                        help="verify each plan N times in fresh child processes: a crash of the simulated "
                             "runtime is recorded with its signal, and decided on gloo processes")
    parser.add_argument("--out", default=str(RESULTS / "coverage.json"))
    parser.add_argument("--md", default=None, help="markdown table (default: COVERAGE.md next to --out)")
    parser.add_argument("--update", action="store_true",
                        help="with --only: replace those types' cases in the existing --out file (its meta "
                             "lists each update with its command, time and commit) instead of writing anew")
    args = parser.parse_args(argv)
    if args.update and not args.only:
        parser.error("--update rewrites the cases of the types given with --only")
    types = architectures()
    if args.only:
        wanted = args.only.split(",")
        unknown = sorted(set(wanted) - set(types))
        if unknown:
            parser.error(f"not causal-LM model types in this transformers: {', '.join(unknown)}")
        types = [t for t in types if t in wanted]
    tps = tuple(int(t) for t in args.tp.split(","))
    names = ("plain", "sp") if args.modes == "both" else args.modes.split(",")
    modes = tuple({"plain": False, "sp": True}[m] for m in names)
    todo = cases(types, tps, modes, args.isolated)
    started = datetime.now(timezone.utc)
    t0 = time.perf_counter()
    results = run_pool(todo, workers=args.workers, timeout=args.timeout, memory_gib=args.memory_gib)
    wall = time.perf_counter() - t0
    sys.path.insert(0, str(Path(__file__).parent))
    from coverage_report import summarize, write_markdown

    order = {c.key: i for i, c in enumerate(todo)}
    results.sort(key=lambda r: order[Case(r["model_type"], r["tp"], r["sp"]).key])
    command = "python benchmarks/coverage.py " + " ".join(argv if argv is not None else sys.argv[1:])
    meta = _meta(command.strip(), started, wall, args)
    if args.update:
        meta, results = _updated(Path(args.out), meta, results)
    summary = summarize(results)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"meta": meta, "summary": summary, "cases": results}, indent=1) + "\n")
    md = Path(args.md) if args.md else out.with_name("COVERAGE.md")
    write_markdown(md, meta, summary, results)
    print(f"wrote {out} and {md} in {wall:.0f} s")
    print(json.dumps(summary["headline"], indent=1))


def _updated(path: Path, meta: dict, results: list[dict]) -> tuple[dict, list[dict]]:
    """The cases of the sweep in ``path`` with those of ``results`` put in their place, and its
    meta with this run recorded under ``updates``."""
    previous = json.loads(path.read_text())
    fresh = {(r["model_type"], r["tp"], r["sp"]): r for r in results}
    cases = [fresh.pop((r["model_type"], r["tp"], r["sp"]), r) for r in previous["cases"]]
    kept = previous["meta"]
    kept["updates"] = [*kept.get("updates", []), {**meta, "commit": _commit(), "cases": len(results),
                                                  "types": sorted({r["model_type"] for r in results})}]
    return kept, cases + list(fresh.values())


def _commit() -> str:
    import subprocess

    try:
        return subprocess.run(["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True,
                              cwd=Path(__file__).parent, check=True).stdout.strip()
    except (OSError, subprocess.CalledProcessError):
        return "unknown"


def _meta(command: str, started: datetime, wall: float, args) -> dict:
    import platform

    import torch
    import transformers

    return {"command": command, "started_utc": started.strftime("%Y-%m-%d %H:%M UTC"),
            "wall_s": round(wall, 1), "workers": args.workers, "timeout_s": args.timeout,
            "torch": torch.__version__, "transformers": transformers.__version__,
            "machine": f"{platform.machine()}, {multiprocessing.cpu_count()} cores"}


if __name__ == "__main__":
    main()
