"""The coverage sweep on a fixed subset of architectures of different shapes (tp=2, plain).

``benchmarks/coverage.py`` runs every causal-LM type at tp 2 and 4, plain and SP; this runs the same
per-case logic in-process on seventeen shapes the synthesizer must handle (:data:`AT_BOUND`,
:data:`PARTLY_REPLICATED`). It would catch a synthesizer change that makes one of them fail or
replicate more than it did, a checker that starts flagging correct plans, or a sweep change that
mislabels an outcome or hangs on a slow case.
"""

import json
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT / "benchmarks"))

from coverage import Case, classify, run_case, run_pool  # noqa: E402
from coverage_report import confusion, summarize  # noqa: E402

# name -> the shape it stands for. At the Megatron bound: every Linear, expert and the vocab sharded.
AT_BOUND = {"llama": "dense GQA", "qwen3": "per-head QK norm", "olmo2": "width QK norm (all-reduced statistic)",
            "qwen3_moe": "MoE, grouped experts", "mixtral": "MoE, top-2", "cohere": "parallel block",
            "phi3": "fused qkv and gate_up (packed)", "gpt_neox": "fused qkv, interleaved heads",
            "stablelm": "head count from an attribute (localized)", "gemma2": "soft-capped sliding attention",
            "gemma3": "multimodal family (text model)", "ctrl": "embedding rows scaled in place (copied output)",
            "jamba": "hybrid Mamba + attention + MoE: a scan's state projections broadcast over sharded channels",
            "doge": "a per-head mask computed from a row Linear's output: the row reduce-scatters onto the heads",
            "zamba": "a Python loop over the Mamba heads; a block tied across two hybrid layers (pattern repeated)",
            "codegen": "heads split into 4 fixed groups (rebuilt with heads for 2x the ranks): runs on DTensors"}
# Verified, with parts kept whole for a recorded reason.
PARTLY_REPLICATED = {"deepseek_v3": "MLA: kv_a_proj_with_mqa is sliced"}
SUBSET = [*AT_BOUND, *PARTLY_REPLICATED]


@pytest.fixture(scope="module")
def results():
    return {name: run_case(Case(name, 2, False)) for name in SUBSET}


@pytest.mark.parametrize("name", SUBSET)
def test_synthesized_plan_verifies_at_tp2(results, name):
    synth = results[name]["synth"]
    assert synth["status"] == "verified", synth
    bound = results[name]["megatron_fraction"]
    if name in AT_BOUND:
        assert abs(synth["param_fraction"] - bound) <= 0.01, (synth["param_fraction"], bound)
    else:
        assert bound + 0.01 < synth["param_fraction"] < 0.95 and synth["replicated"], synth


def test_tiny_configs_are_rebuilt_only_as_far_as_needed(results):
    """More heads where the unsharded tiny model fails with tp's, a repeated layer pattern where the
    shrunk config cannot be built; neither for a family that needs none."""
    assert results["codegen"].get("shrunk_heads_for_tp") == 4 and "layer_pattern_repeated" not in results["codegen"]
    assert results["zamba"].get("layer_pattern_repeated") == 2 and "shrunk_heads_for_tp" not in results["zamba"]
    assert not any(k in results["llama"] for k in ("shrunk_heads_for_tp", "layer_pattern_repeated"))


@pytest.mark.parametrize("name", SUBSET)
def test_checker_accepts_the_verified_synthesized_plan(results, name):
    assert results[name]["synth"]["check"] == {"flagged": False, "findings": []}


def test_transformers_plans_are_labelled_from_the_verifier(results):
    labels = {name: r["hf"]["status"] for name, r in results.items()}
    assert labels["llama"] == "verified" and labels["qwen3_moe"] == "verified"
    assert labels["stablelm"] == "none"  # StableLM ships no tp plan
    assert all(r["hf"]["reason"] for r in results.values() if r["hf"]["status"] != "verified")


def test_classes_come_from_the_config():
    assert classify("llama")[0] == "decoder-text"
    assert classify("whisper")[0] == "encoder-decoder"
    assert classify("gemma3")[0] == "multimodal"
    assert classify("bert")[0] == "encoder-family"


def test_summary_counts_the_subset(results):
    rows = list(results.values())
    headline = summarize(rows)["headline"]
    decoder = [r for r in rows if r["class"] == "decoder-text"]
    assert headline["decoder_text_types"] == len(decoder)
    assert headline["tp2_plain_verified_pct"] == 100.0
    assert confusion(rows)["all"]["unflagged_correct"] >= len(rows)


def test_pool_kills_a_case_past_its_time_limit():
    """One spawned worker; a limit no case can meet: recorded as a timeout, not a hang."""
    [row] = run_pool([Case("llama", 2, False)], workers=1, timeout=0.01, progress=False)
    assert row["synth"]["reason"] == "timeout" and row["hf"]["reason"] == "timeout"


def test_update_replaces_the_rerun_cases_and_records_the_run(tmp_path):
    """``--update`` keeps every other case of the sweep and names the rerun in the meta."""
    from coverage import _updated

    def case(name, tp, sp, fraction):
        return {"model_type": name, "tp": tp, "sp": sp, "synth": {"param_fraction": fraction}}

    path = tmp_path / "coverage.json"
    path.write_text(json.dumps({"meta": {"command": "first"}, "summary": {},
                                "cases": [case("a", 2, False, 0.9), case("b", 2, False, 0.6)]}))
    meta, cases = _updated(path, {"command": "again", "started_utc": "now", "wall_s": 1.0},
                           [case("a", 2, False, 0.5)])
    assert [(c["model_type"], c["synth"]["param_fraction"]) for c in cases] == [("a", 0.5), ("b", 0.6)]
    assert meta["command"] == "first" and meta["updates"][0]["command"] == "again"
    assert meta["updates"][0]["types"] == ["a"] and meta["updates"][0]["cases"] == 1


def test_per_token_bytes_come_from_a_second_run_at_twice_the_batch(results):
    """A dense decoder moves only activations: all of its bytes grow with tokens, none fixed. Zamba's
    shared block reads a 2h-wide concatenation of the stream and a clone of the embeddings; the
    embeddings' gradient share is reduced with the first layer's norm input, so its per-token
    backward equals its forward (one stream width more per token without that fold). Would catch a
    second run at the same batch (no slope) or fixed bytes taken for per-token ones."""
    llama = results["llama"]["synth"]
    per_token = llama["comm_per_token"]
    tokens = 2 * 16
    assert per_token["forward"] > 0 and per_token["forward_fixed"] == per_token["backward_fixed"] == 0, per_token
    assert per_token["forward"] * tokens == llama["comm_volume"] and per_token["backward"] == per_token["forward"]
    zamba = results["zamba"]["synth"]["comm_per_token"]
    assert zamba["backward"] == zamba["forward"] > 0 and zamba["backward_fixed"] == 0, zamba


def test_backward_above_section_lists_the_excess_or_says_there_is_none():
    """The report's table of near-bound cases whose backward moves more bytes than their forward:
    such a case is listed with its ratios; with none, a sentence says so instead of an empty table.
    Would catch an equal case listed, or the empty table left headless."""
    from coverage_report import _backward_above_section

    def case(name, backward):
        return {"model_type": name, "tp": 2, "sp": False, "class": "decoder-text", "megatron_fraction": 0.5,
                "synth": {"status": "verified", "param_fraction": 0.5, "comm_volume": 100,
                          "comm_volume_backward": backward,
                          "comm_per_token": {"forward": 2.0, "backward": backward / 50, "forward_fixed": 0,
                                             "backward_fixed": 0}}}

    listed = "\n".join(_backward_above_section([case("even", 100), case("above", 120)]))
    assert "| above | tp2 plain | 1.20 | 1.20 | 0 |" in listed and "| even |" not in listed, listed
    none = _backward_above_section([case("even", 100)])
    assert none[-1].startswith("None: in every near-bound case") and not none[-1].startswith("|"), none
