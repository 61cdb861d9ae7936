"""Verify a plan across real processes on the gloo backend (CPU), as an end-to-end check.

The simulated verifier (:func:`autotp.verify`) runs all ranks in one process; this one starts
``procs`` processes on 127.0.0.1 with a real process group, so that hooks, collectives and autograd
run exactly as in training. Each start costs seconds: use it for a final check, not a sweep.
"""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback

import torch.distributed as dist
import torch.multiprocessing as mp
from torch import nn
from torch.distributed.device_mesh import init_device_mesh

from autotp.apply import apply_plan
from autotp.errors import VerificationError
from autotp.hf_plans import as_styles
from autotp.plan import Plan
from autotp.verifier import (
    DEFAULT_TOLERANCE,
    VerifyReport,
    check_materialised,
    clean_copy,
    crash_name,
    comm_fields,
    default_inputs,
    reference_run,
    renamed_inputs,
    run_and_compare,
    scales,
)


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def _worker(rank, procs, port, model, plan, inputs, ref_logits, ref_tensors, backward, results):
    ref_params = {}
    for name, (value, grad) in ref_tensors.items():  # .grad does not survive pickling on its own
        value.grad = grad
        ref_params[name] = value
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=procs)
    try:
        mesh = init_device_mesh("cpu", (procs,))
        sharded = apply_plan(model.eval(), mesh, plan)  # the parent sent a clean copy
        own = lambda t: [(rank, t)]  # noqa: E731
        results.put((rank, run_and_compare(sharded, inputs, ref_logits, ref_params, backward, own), None))
    except Exception:
        results.put((rank, None, traceback.format_exc(limit=-3)))
    finally:
        dist.destroy_process_group()


def verify_multiprocess(
    model: nn.Module,
    plan: Plan,
    *,
    procs: int = 2,
    example_inputs=None,
    backward: bool = True,
    tolerance: float = DEFAULT_TOLERANCE,
    timeout: float = 300.0,
    inputs=None,
) -> VerifyReport:
    """Like :func:`autotp.verify`, with ``procs`` real gloo processes instead of simulated ranks.

    ``inputs`` is the former name of ``example_inputs`` (accepted, with a DeprecationWarning).

    Workers are spawned (a script calling this needs the ``if __name__ == "__main__":`` guard).

    Raises:
        VerificationError: a worker died without reporting, or ``timeout`` seconds passed.
    """
    inputs = renamed_inputs(example_inputs, inputs, "verify_multiprocess")
    check_materialised(model)
    plan = as_styles(model, plan)
    model = clean_copy(model)  # pickles without a trace's fake tensors; each worker shards its own
    inputs = default_inputs(model, procs) if inputs is None else inputs
    ref_logits, ref_params = reference_run(model, inputs, backward)
    ref_tensors = {
        name: (p.detach().clone(), None if p.grad is None else p.grad.detach().clone()) for name, p in ref_params.items()
    }
    # spawn, not fork: a fork taken while torch's thread pools hold locks deadlocks the child.
    context = mp.get_context("spawn")
    results = context.Queue()
    port = _free_port()
    workers = [
        context.Process(
            target=_worker,
            args=(rank, procs, port, model, plan, inputs, ref_logits, ref_tensors, backward, results),
        )
        for rank in range(procs)
    ]
    for worker in workers:
        worker.start()
    try:
        outcomes = _collect(results, workers, timeout)
    finally:
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
    errors = [error for _, _, error in outcomes if error]
    if errors:
        message = errors[0].strip().splitlines()[-1]
        return VerifyReport(procs, tolerance, [float("inf")], error=message)
    return _merge(procs, tolerance, {rank: result for rank, result, _ in outcomes}, scales(ref_logits, ref_params))


def _collect(results, workers, timeout: float) -> list:
    """One result per worker; fail fast if a worker dies without reporting."""
    deadline = time.monotonic() + timeout
    outcomes = []
    while len(outcomes) < len(workers):
        try:
            outcomes.append(results.get(timeout=1.0))
        except queue.Empty:
            dead = [w for w in workers if w.exitcode not in (None, 0)]
            if dead:
                how = crash_name(dead[0].exitcode)
                raise VerificationError(
                    f"a verification worker died ({how}) before reporting; run the same check with "
                    "autotp.verify (simulated ranks) to see the error.", crash=how
                ) from None
            if time.monotonic() > deadline:
                raise VerificationError(f"multi-process verification took more than {timeout:.0f} s") from None
    return outcomes


def _merge(procs: int, tolerance: float, results: dict, reference_scales: dict) -> VerifyReport:
    grads: dict[str, float] = {}
    for _, grad_diffs, _, _ in results.values():
        for name, diff in grad_diffs.items():
            grads[name] = max(grads.get(name, 0.0), diff)
    if len(results) != procs:
        raise VerificationError(f"expected results from {procs} processes, got {len(results)}")
    return VerifyReport(
        tp_size=procs,
        tolerance=tolerance,
        logits_max_abs_diff=[results[r][0][r] for r in range(procs)],
        grad_max_abs_diff=grads,
        param_fraction=[results[r][2][r] for r in range(procs)],
        **comm_fields(results[0][3]),
        **reference_scales,
    )
