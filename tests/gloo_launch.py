"""Run a job on spawned gloo processes for the multi-process tests, and collect each rank's result."""

from __future__ import annotations

import os
import queue
import socket
import time
import traceback

import pytest
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank_main(job, rank, world, port, args, results):
    os.environ.update(MASTER_ADDR="127.0.0.1", MASTER_PORT=str(port))
    dist.init_process_group("gloo", rank=rank, world_size=world)
    try:
        results.put((rank, job(*args), None))
    except Exception:
        results.put((rank, None, traceback.format_exc(limit=-6)))
    finally:
        dist.destroy_process_group()


def run_on_ranks(job, world: int, *args, timeout: float = 300.0, what: str = "workers") -> dict:
    """``job(*args)`` on ``world`` spawned gloo processes (127.0.0.1); ``{rank: its return value}``.

    ``job`` must be a module-level function (spawn pickles it by name). The test fails with the
    rank's traceback if a job raises, and with the exit codes if a process dies or time runs out.
    """
    context = mp.get_context("spawn")  # fork deadlocks on torch's thread pools
    results = context.Queue()
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    workers = [context.Process(target=_rank_main, args=(job, rank, world, port, args, results))
               for rank in range(world)]
    for worker in workers:
        worker.start()
    outcomes, deadline = {}, time.monotonic() + timeout
    try:
        while len(outcomes) < world:
            try:
                rank, result, error = results.get(timeout=1.0)
            except queue.Empty:
                dead = [w.exitcode for w in workers if w.exitcode not in (None, 0)]
                if dead or time.monotonic() > deadline:
                    pytest.fail(f"{what}: exit codes {dead}, or over {timeout:.0f} s")
                continue
            if error:
                pytest.fail(f"rank {rank} failed:\n{error}")
            outcomes[rank] = result
    finally:
        for worker in workers:
            worker.join(timeout=5)
            if worker.is_alive():
                worker.kill()
    return outcomes
