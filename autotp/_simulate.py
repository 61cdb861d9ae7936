"""Simulate W tensor-parallel ranks in one process with real numerics.

This is the only module that touches torch's private ``LocalTensorMode`` and the ``"fake"``
process group: every tensor created under it holds one value per rank, and collectives are
computed across those values. If torch moves the API, only this file changes.
"""

from __future__ import annotations

import contextlib
import sys
from collections.abc import Iterator

import torch
import torch.distributed as dist
from torch.distributed.device_mesh import DeviceMesh, init_device_mesh

from autotp.errors import VerificationError


@contextlib.contextmanager
def simulated_mesh(tp_size: int) -> Iterator[DeviceMesh]:
    """A 1-D ``DeviceMesh`` of ``tp_size`` simulated ranks, active for the ``with`` block.

    Raises:
        VerificationError: a real process group is already initialised in this process.
    """
    from torch.distributed._local_tensor import LocalTensorMode
    from torch.testing._internal.distributed.fake_pg import FakeStore

    if dist.is_initialized():
        raise VerificationError(
            f"cannot simulate {tp_size} ranks: this process already has a "
            f"{dist.get_backend()} process group. Run verify before init_process_group, "
            "or use autotp.verify_multiprocess."
        )
    excepthook = sys.excepthook  # init_process_group wraps it to prefix "[rank0]:" on every line
    dist.init_process_group("fake", rank=0, world_size=tp_size, store=FakeStore())
    try:
        with LocalTensorMode(frozenset(range(tp_size))):
            yield init_device_mesh("cpu", (tp_size,))
    finally:
        dist.destroy_process_group()
        sys.excepthook = excepthook


@contextlib.contextmanager
def outside_simulation() -> Iterator[None]:
    """Suspend the simulated ranks (their ``LocalTensorMode``) for the ``with`` block; nothing
    outside :func:`simulated_mesh`.

    For work that is the same on every rank and holds no per-rank value: choosing a plan (tracing,
    synthesis, checks) runs once on plain tensors instead of once per simulated rank (measured 3-10x
    faster), and the random example inputs a trace makes are one tensor, not one per rank.
    """
    from torch.distributed._local_tensor import maybe_disable_local_tensor_mode

    with maybe_disable_local_tensor_mode():
        yield


def per_rank(t: torch.Tensor, tp_size: int) -> list[torch.Tensor]:
    """The value each simulated rank holds for ``t`` (the same tensor for all if not per-rank)."""
    from torch.distributed._local_tensor import LocalTensor

    if isinstance(t, LocalTensor):
        return [t._local_tensors[r] for r in range(tp_size)]
    return [t] * tp_size


def mesh_coordinate(device_mesh: DeviceMesh) -> torch.Tensor:
    """This rank's index on the 1-D ``device_mesh`` as a 0-dim int64 tensor.

    Under simulation each rank holds its own index (a per-rank tensor), where
    ``device_mesh.get_local_rank()`` would be a symbolic int that some dispatch modes cannot read;
    in a real process group it is the plain local rank.
    """
    from torch.distributed._local_tensor import enabled_local_tensor_mode

    mode = enabled_local_tensor_mode()
    if mode is None:
        return torch.tensor(device_mesh.get_local_rank())
    ranks = device_mesh.mesh.flatten().tolist()
    return mode.rank_map(lambda rank: torch.tensor(ranks.index(rank) if rank in ranks else 0))
