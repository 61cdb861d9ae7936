"""``parallelize`` decides its plan once per job: an on-disk cache, and one rank deciding for its tp group.

Each test has its own cache directory (``AUTOTP_CACHE_DIR``, set by ``conftest.py``).
"""

from __future__ import annotations

import copy
import os
from pathlib import Path

import pytest
import torch

import autotp
from autotp import _simulate, decision
from autotp.errors import VerificationError
from autotp.models import build_model
from autotp.plan import describe_plan
from gloo_launch import run_on_ranks


def _counting_get_plan(monkeypatch) -> list:
    """Replace the selection ``parallelize`` calls with a counting wrapper; the list of calls."""
    calls, real = [], decision.get_plan

    def counted(*args, **kwargs):
        calls.append(kwargs.get("tp_size"))
        return real(*args, **kwargs)

    monkeypatch.setattr(decision, "get_plan", counted)
    return calls


def _entries() -> list[Path]:
    root = decision.cache_dir()
    return sorted(root.glob("plan-*.pkl")) if root.is_dir() else []


def _sharded_plan(model) -> dict:
    """Each sharded parameter's placements: what the plan did to the model."""
    return {n: str(p.placements) for n, p in model.named_parameters() if hasattr(p, "placements")}


def test_parallelize_decides_once_then_reads_the_cache(monkeypatch):
    """Would catch a cache that is never written or read (selection runs every time), one read for
    another tp size, one that ``cache=False`` still touches, or a broken entry that breaks parallelize."""
    calls = _counting_get_plan(monkeypatch)
    model = build_model("llama", tiny=True, tp=2, device="cpu")
    with _simulate.simulated_mesh(2) as mesh:
        cold = _sharded_plan(autotp.parallelize(copy.deepcopy(model), mesh))
        assert calls == [2] and len(_entries()) == 1
        warm = _sharded_plan(autotp.parallelize(copy.deepcopy(model), mesh))
        assert calls == [2] and warm == cold and any(warm.values())
        autotp.parallelize(copy.deepcopy(model), mesh, cache=False)
        assert calls == [2, 2] and len(_entries()) == 1
    entry, = _entries()
    entry.write_bytes(b"not a pickle")
    with _simulate.simulated_mesh(2) as mesh:
        assert _sharded_plan(autotp.parallelize(copy.deepcopy(model), mesh)) == cold
    assert calls == [2, 2, 2] and entry.read_bytes() != b"not a pickle"


def test_cache_key_changes_with_what_changes_the_plan(monkeypatch):
    meta = build_model("llama", tiny=True, tp=2)
    key = lambda model=meta, tp=2, sp=False, check=True, inputs=None: decision.cache_key(  # noqa: E731
        model, tp, sequence_parallel=sp, verify_synthesized=check, example_inputs=inputs)
    base = key()
    assert key(model=build_model("llama", tiny=True, tp=2, device="cpu", seed=3)) == base  # weights: not read
    ids = torch.zeros(2, 8, dtype=torch.long)
    others = [key(tp=4), key(sp=True), key(check=False), key(inputs=(ids,)),
              key(model=build_model("qwen3", tiny=True, tp=2)), key(model=build_model("llama", tiny=True, tp=4))]
    assert base not in others and len(set(others)) == len(others)
    assert key(inputs=(ids,)) != key(inputs=(torch.zeros(2, 9, dtype=torch.long),))
    monkeypatch.setattr(decision, "code_fingerprint", lambda: "another version of autotp")
    assert key() != base


def test_a_synthesized_plan_failing_its_self_check_gives_way_to_the_next_plan(monkeypatch):
    """OLMo2: the synthesized plan wins selection (fewer parameters per rank than transformers');
    when its self-check fails, parallelize shards with transformers' plan instead, and says why."""
    def failing(model, plan, **kwargs):
        raise VerificationError("made to fail by the test")

    monkeypatch.setattr(decision, "self_check", failing)
    model = build_model("olmo2", tiny=True, tp=2, device="cpu")
    with _simulate.simulated_mesh(2) as mesh:
        choice = decision.decide_plan(model, mesh, cache=False)
    assert choice.source == "hf" and "self-check" in choice.why and ("synthesized", "self-check: made to fail by "
                                                                     "the test") in choice.skipped
    hf = autotp.get_plan(model, source="hf", tp_size=2)
    assert describe_plan(choice.plan) == describe_plan(hf.plan)


def _decide_on_rank(cache_root: str) -> tuple[int, dict, str]:
    """On each gloo rank: parallelize a tiny Qwen3 over all ranks; how often this rank ran selection."""
    os.environ["AUTOTP_CACHE_DIR"] = f"{cache_root}/{torch.distributed.get_rank()}"
    from torch.distributed.device_mesh import init_device_mesh

    calls, real = [], decision.get_plan
    decision.get_plan = lambda *a, **k: calls.append(1) or real(*a, **k)
    model = build_model("qwen3", tiny=True, tp=2, device="cpu")
    mesh = init_device_mesh("cpu", (torch.distributed.get_world_size(),))
    autotp.parallelize(model, mesh, verify_synthesized=False)
    return len(calls), _sharded_plan(model), type(model).__name__


@pytest.mark.slow
def test_one_rank_decides_for_its_tp_group(tmp_path):
    """Two gloo processes: the first runs selection and the other receives the plan (no selection,
    nothing written to its cache), and both shard alike."""
    results = run_on_ranks(_decide_on_rank, 2, str(tmp_path), what="decide_plan ranks")
    assert [results[r][0] for r in (0, 1)] == [1, 0]
    assert results[0][1] == results[1][1] and results[0][1]
    assert list((tmp_path / "1").glob("*.pkl")) == [] and len(list((tmp_path / "0").glob("*.pkl"))) == 1
