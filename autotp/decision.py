"""The plan ``parallelize`` shards with, decided once per job.

Deciding costs one synthesis (selection traces the model once and checks every source's plan on
that graph) and, when the synthesized plan wins, one self-check. Two things keep a job from paying
it more than once:

- **One rank decides.** Under a real process group the first rank of the tp group decides and
  broadcasts the plan (plans are data: they pickle) or its error to the others, which would
  otherwise each repeat the same work (and, for the self-check, each start a child interpreter).
- **An on-disk cache** under ``$AUTOTP_CACHE_DIR`` (default ``~/.cache/autotp``) keeps the decided
  plan, keyed by the model's structure (module classes, parameter names, shapes and dtypes, and its
  config when it has one), the tp size, the options that change the plan (sequence parallelism,
  whether a synthesized plan is self-checked, the example inputs' shapes), and the code: autotp's
  version and a hash of its source, the handwritten plans', torch's and transformers' versions. A
  later job (or a rerun) reads the plan instead of deciding again. ``cache=False`` skips it. An
  entry is only written for a plan that passed every check; a cache that cannot be read or written
  is skipped with a log line, never an error. The entries are pickles: point ``AUTOTP_CACHE_DIR``
  only at a directory you own.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import pickle
import tempfile
from dataclasses import replace
from importlib.metadata import PackageNotFoundError, version
from pathlib import Path

import torch
import torch.distributed as dist
from torch import nn
from torch.distributed.device_mesh import DeviceMesh

from autotp._simulate import outside_simulation
from autotp.check_cache import source_hash
from autotp.errors import AutoTPError, VerificationError
from autotp.selection import PlanChoice, get_plan
from autotp.self_check import self_check

log = logging.getLogger(__name__)

CACHE_ENV = "AUTOTP_CACHE_DIR"
# Bump when the entry's layout changes: old entries are then never read.
_FORMAT = 1


def decide_plan(model: nn.Module, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False, tp_shard_plan=None,
                verify_synthesized: bool = True, example_inputs=None, cache: bool = True) -> PlanChoice:
    """The plan to shard ``model`` over ``tp_mesh`` with: :func:`autotp.get_plan`'s choice, and for
    a synthesized winner its self-check, falling back to the next plan that passed selection when
    the self-check fails; decided by one rank of the tp group and cached on disk (module docstring).

    Args:
        model: the model (any device, meta included); not modified.
        tp_mesh: the 1-D tp mesh the model will be sharded over.
        sequence_parallel, tp_shard_plan, example_inputs: as for :func:`autotp.get_plan`.
        verify_synthesized: self-check a synthesized plan before it is used.
        cache: read and write the on-disk cache.

    Returns:
        The :class:`~autotp.selection.PlanChoice` (without the synthesizer's analysis when it
        came from the cache or from another rank).

    Raises:
        NoPlanError, PlanError, MeshError: as :func:`autotp.get_plan` (on every rank).
        VerificationError: the synthesized plan failed its self-check and no other plan passed.
    """
    tp_size = tp_mesh.size()
    if tp_shard_plan is not None:  # the user's plan: used as given, nothing to decide or cache
        return get_plan(model, sequence_parallel=sequence_parallel, tp_shard_plan=tp_shard_plan, tp_size=tp_size)
    decide = functools.partial(_decide_cached, model, tp_size, sequence_parallel=sequence_parallel,
                               verify_synthesized=verify_synthesized, example_inputs=example_inputs, cache=cache)
    group = _real_group(tp_mesh)
    if group is not None:
        return _decided_by_one_rank(decide, group)
    with outside_simulation():  # under simulated ranks: decided once, on plain tensors
        return decide()


def _decide_cached(model: nn.Module, tp_size: int, *, sequence_parallel: bool, verify_synthesized: bool,
                   example_inputs, cache: bool) -> PlanChoice:
    key = cache_key(model, tp_size, sequence_parallel=sequence_parallel, verify_synthesized=verify_synthesized,
                    example_inputs=example_inputs) if cache else None
    cached = _read(key) if key is not None else None
    if cached is not None:
        log.info("plan for %s at tp=%d read from the cache (%s): %s", type(model).__name__, tp_size,
                 cached.source, cached.why or cached.detail)
        return cached
    choice = _decide(model, tp_size, sequence_parallel=sequence_parallel, verify_synthesized=verify_synthesized,
                     example_inputs=example_inputs)
    if key is not None:
        _write(key, choice)
    return choice


def _decide(model: nn.Module, tp_size: int, *, sequence_parallel: bool, verify_synthesized: bool,
            example_inputs) -> PlanChoice:
    """Selection, then the self-check of a synthesized winner; a winner that fails it gives way to
    the next plan that passed selection (logged), and the error is raised when none is left."""
    choice = get_plan(model, sequence_parallel=sequence_parallel, tp_size=tp_size, example_inputs=example_inputs)
    failure = None
    for candidate in [choice, *choice.runners_up]:
        if not verify_synthesized or candidate.source != "synthesized" or candidate.self_checked:
            return _as_winner(choice, candidate, failure)
        try:
            self_check(model, candidate.plan, tp_size=tp_size, sequence_parallel=sequence_parallel,
                       example_inputs=example_inputs)
        except VerificationError as error:
            log.warning("the synthesized plan for %s failed its self-check at tp=%d; trying the next source: %s",
                        type(model).__name__, tp_size, error)
            failure = error
            continue
        return _as_winner(choice, candidate, failure)
    raise failure


def _as_winner(choice: PlanChoice, candidate: PlanChoice, failure: Exception | None) -> PlanChoice:
    if candidate is choice:
        return choice
    why = f"{choice.why}; the synthesized plan failed its self-check ({failure}), so: {candidate.source}"
    return replace(candidate, skipped=[*choice.skipped, ("synthesized", f"self-check: {failure}")],
                   considered=choice.considered, why=why, runners_up=[])


# --- one rank decides ------------------------------------------------------------------------------


def _real_group(tp_mesh: DeviceMesh):
    """The tp mesh's process group when a real one (not the simulator's ``fake`` one) joins more
    than one process; else None."""
    if not (dist.is_available() and dist.is_initialized()) or dist.get_backend() == "fake":
        return None
    group = tp_mesh.get_group()
    return group if dist.get_world_size(group) > 1 else None


def _decided_by_one_rank(decide, group) -> PlanChoice:
    """``decide()`` on the group's first rank, its result (or its error) broadcast to the others."""
    leader = dist.get_global_rank(group, 0)
    payload = [None]
    if dist.get_rank() == leader:
        try:
            payload[0] = ("ok", _portable(decide()))
        except Exception as error:  # every rank raises it: the others must not wait on a broadcast forever
            payload[0] = ("error", _pickled(error), f"{type(error).__name__}: {error}")
            dist.broadcast_object_list(payload, src=leader, group=group)
            raise
    dist.broadcast_object_list(payload, src=leader, group=group)
    kind, *rest = payload[0]
    if kind == "ok":
        return rest[0]
    raise _error_from(*rest)


def _pickled(error: Exception) -> bytes:
    try:
        return pickle.dumps(error)
    except Exception:  # noqa: BLE001  an error holding something unpicklable: its text goes instead
        return b""


def _error_from(data: bytes, text: str) -> Exception:
    try:
        return pickle.loads(data)
    except Exception:  # noqa: BLE001  an error whose fields do not survive pickling: its text does
        return AutoTPError(f"the rank that chose the plan failed: {text}")


def _portable(choice: PlanChoice) -> PlanChoice:
    """``choice`` without the synthesizer's analysis (the model's graph: neither small nor needed to
    shard) and without the runners-up: what goes to other ranks and to the cache."""
    return replace(choice, analysis=None, runners_up=[])


# --- the on-disk cache -----------------------------------------------------------------------------


def cache_dir() -> Path:
    """``$AUTOTP_CACHE_DIR``, else ``~/.cache/autotp``."""
    return Path(os.environ.get(CACHE_ENV) or Path.home() / ".cache" / "autotp")


def cache_key(model: nn.Module, tp_size: int, *, sequence_parallel: bool, verify_synthesized: bool,
              example_inputs=None) -> str:
    """The hex digest every input of the decision goes into (module docstring)."""
    parts = {
        "format": _FORMAT,
        "code": code_fingerprint(),
        "model": model_fingerprint(model),
        "tp": tp_size,
        "sequence_parallel": sequence_parallel,
        "verify_synthesized": verify_synthesized,
        "example_inputs": _inputs_fingerprint(example_inputs),
    }
    return hashlib.sha256(json.dumps(parts, sort_keys=True, default=str).encode()).hexdigest()


@functools.cache
def code_fingerprint() -> str:
    """autotp's version, a hash of its source and of the handwritten plans', torch's and
    transformers' versions: a change to any of them makes every entry stale."""
    digest = hashlib.sha256(source_hash().encode())
    versions = [torch.__version__]
    for package in ("autotp", "transformers"):
        try:
            versions.append(version(package))
        except PackageNotFoundError:  # a checkout that was not installed: the source hash covers it
            versions.append(f"{package} not installed")
    digest.update(" ".join(versions).encode())
    return digest.hexdigest()


def model_fingerprint(model: nn.Module) -> str:
    """A hash of ``model``'s structure: its class, every module's name and class, every parameter's
    and buffer's name, shape and dtype, which parameters are tied, and its config when it has one.
    Weights' values are not read (a plan does not depend on them): a meta model and a loaded one
    with the same structure share entries."""
    digest = hashlib.sha256(f"{type(model).__module__}.{type(model).__qualname__}".encode())
    for name, module in model.named_modules():
        digest.update(f"{name}:{type(module).__module__}.{type(module).__qualname__};".encode())
    owners: dict[int, str] = {}
    for name, param in model.named_parameters(remove_duplicate=False):
        tied = owners.setdefault(id(param), name)
        digest.update(f"{name}:{tuple(param.shape)}:{param.dtype}:{tied};".encode())
    for name, buffer in model.named_buffers():
        digest.update(f"{name}:{tuple(buffer.shape)}:{buffer.dtype};".encode())
    config = getattr(model, "config", None)
    if hasattr(config, "to_json_string"):
        digest.update(config.to_json_string(use_diff=False).encode())
    return digest.hexdigest()


def _inputs_fingerprint(example_inputs) -> object:
    """The shapes and dtypes of the example inputs (they decide what is traced), not their values."""
    if isinstance(example_inputs, torch.Tensor):
        return ["tensor", list(example_inputs.shape), str(example_inputs.dtype)]
    if isinstance(example_inputs, dict):
        return {k: _inputs_fingerprint(v) for k, v in sorted(example_inputs.items())}
    if isinstance(example_inputs, (tuple, list)):
        return [_inputs_fingerprint(v) for v in example_inputs]
    return repr(example_inputs)


def _entry(key: str) -> Path:
    return cache_dir() / f"plan-{key[:40]}.pkl"


def _read(key: str) -> PlanChoice | None:
    path = _entry(key)
    if not path.is_file():
        return None
    try:
        stored_key, choice = pickle.loads(path.read_bytes())
    except Exception as error:  # noqa: BLE001  a stale or broken entry: decide again and overwrite it
        log.info("ignoring the unreadable plan cache entry %s (%s)", path, error)
        return None
    return choice if stored_key == key and isinstance(choice, PlanChoice) else None


def _write(key: str, choice: PlanChoice) -> None:
    path = _entry(key)
    try:
        data = pickle.dumps((key, _portable(choice)))
        path.parent.mkdir(parents=True, exist_ok=True)
        with tempfile.NamedTemporaryFile(dir=path.parent, delete=False, suffix=".tmp") as handle:
            handle.write(data)
        os.replace(handle.name, path)  # atomic: a concurrent reader sees the old entry or the new one
    except Exception as error:  # noqa: BLE001  an unpicklable plan or a read-only home: just not cached
        log.info("plan for %s not cached at %s (%s: %s)", choice.source, path, type(error).__name__, error)
