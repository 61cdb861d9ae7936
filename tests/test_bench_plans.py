"""The plan benchmark's meters (benchmarks/bench_plans.py), on a tiny Llama at tp=2.

The benchmark measures real-size models on the meta device; these tests run the same functions on
a tiny config, and once on real CPU values, so that a meter reading wrong shapes, counting the
wrong collectives or missing saved tensors fails here rather than producing a plausible chart.
"""

from __future__ import annotations

import sys
from pathlib import Path

import pytest
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "benchmarks"))
import bench_plans  # noqa: E402
from _plans_common import layer_kinds, measure, plan_from, ring_bytes, with_layers  # noqa: E402

from autotp.models import build_model, load_config, shrink_config  # noqa: E402

pytestmark = pytest.mark.filterwarnings("ignore:Parallelize plan key")

TP = 2
SEQ = 16


@pytest.fixture(scope="module")
def tiny_llama_models():
    """What :func:`bench_plans.measure_family` builds, for a tiny Llama config."""
    config = shrink_config(load_config("llama"), tp=TP)
    models = {"full": build_model(config, dtype=torch.bfloat16), "kinds": len(layer_kinds(config))}
    for copies in bench_plans.DEPTHS:
        models[copies] = build_model(with_layers(config, copies), dtype=torch.bfloat16)
    return models


@pytest.fixture(scope="module")
def rows(tiny_llama_models):
    return {(source, sp): bench_plans.measure_variant(tiny_llama_models, "llama", source, sp, TP, batch=1, seq=SEQ)
            for source, sp in bench_plans.VARIANTS}


def test_every_llama_variant_is_measured(rows):
    assert {key: row["status"] for key, row in rows.items()} == {key: "ok" for key in rows}


def test_plain_tp_layer_issues_two_forward_all_reduces(rows, tiny_llama_models):
    """o_proj and down_proj: a per-layer count taken from the wrong depth difference would not be 2."""
    forward = rows["handwritten", False]["per_layer"]["forward"]
    assert forward["collectives"] == {"all_reduce": 2}
    hidden = tiny_llama_models[2].config.hidden_size
    assert forward["payload_bytes_per_token"] == 2 * hidden * 2  # two bf16 [tokens, hidden] all-reduces


def test_sp_layer_trades_all_reduces_for_gathers_and_scatters(rows):
    forward = rows["handwritten", True]["per_layer"]["forward"]["collectives"]
    assert forward == {"all_gather_into_tensor": 2, "reduce_scatter_tensor": 2}


def test_synthesized_llama_costs_what_handwritten_costs(rows):
    """The two plans are equal for Llama, so every measured figure must be too."""
    for sp in (False, True):
        hand, synth = rows["handwritten", sp], rows["synthesized", sp]
        assert synth["equal_to_handwritten"] is True
        for key in ("per_layer", "param_bytes_per_rank", "activation_bytes_per_rank_per_layer"):
            assert synth[key] == hand[key], key


def test_sequence_parallel_saves_fewer_activation_bytes_per_rank(rows):
    plain = rows["handwritten", False]["activation_bytes_per_rank_per_layer"]
    sp = rows["handwritten", True]["activation_bytes_per_rank_per_layer"]
    assert 0 < sp < plain


def test_meta_measurement_matches_a_run_on_real_values(tiny_llama_models):
    """Shapes-only (meta) runs must issue the same collectives, of the same sizes, as real ones."""
    meta = tiny_llama_models[2]
    cpu = build_model(meta.config, device="cpu", dtype=next(meta.parameters()).dtype)
    for sp in (False, True):
        plan = plan_from(meta, "handwritten", tp=TP, sequence_parallel=sp)
        on_meta = measure(meta, plan, TP, batch=1, seq=SEQ, activations=True)
        on_cpu = measure(cpu, plan, TP, batch=1, seq=SEQ, activations=True)
        assert on_meta == on_cpu


def test_ring_bytes_follow_the_ring_algorithms():
    assert ring_bytes("all_reduce", 800, 8) == 1400
    assert ring_bytes("reduce_scatter_tensor", 800, 8) == 700
    assert ring_bytes("all_gather_into_tensor", 100, 8) == 700
    with pytest.raises(ValueError):
        ring_bytes("mystery_collective", 1, 2)


def test_ratios_compare_only_measured_pairs():
    ok = {"family": "f", "tp": 2, "sequence_parallel": False, "status": "ok", "ring_bytes_per_layer_per_token": 10,
          "param_bytes_per_rank": 4, "activation_bytes_per_rank_per_layer": 8}
    failed = {**ok, "source": "hf", "status": "failed"}
    ratio_rows = bench_plans.ratios([{**ok, "source": "handwritten"},
                                     {**ok, "source": "synthesized", "ring_bytes_per_layer_per_token": 15}, failed])
    assert ratio_rows == [{"family": "f", "tp": 2, "sequence_parallel": False, "ratio": "synthesized/handwritten",
                           "comm": 1.5, "param": 1.0, "act": 1.0}]


def test_a_failed_run_leaves_no_saved_tensor_hooks_behind(tiny_llama_models):
    """A plan that raises mid-forward must not leave the activation meter hooked into later runs."""
    model = tiny_llama_models[2]
    plan = plan_from(model, "handwritten", tp=TP, sequence_parallel=False)
    layer = model.model.layers[0].mlp
    original = layer.forward
    layer.forward = lambda *a, **k: (_ for _ in ()).throw(RuntimeError("plan broke mid-layer"))
    try:
        with pytest.raises(RuntimeError, match="mid-layer"):
            measure(model, plan, TP, batch=1, seq=SEQ, activations=True)
    finally:
        layer.forward = original
    # A hook left behind reads 2 ranks off the tensors a 1-rank run holds, and raises KeyError.
    measure(model, plan, 1, batch=1, seq=SEQ, activations=False)


def test_merge_replaces_measured_rows_and_keeps_every_other():
    """--only must not drop rows of families (or variants) another run wrote to plans.json."""
    def row(family, tp, sp, source, status):
        return {"family": family, "tp": tp, "sequence_parallel": sp, "source": source, "status": status}

    saved = [row("llama", 2, False, "handwritten", "ok"), row("falcon", 2, False, "hf", "failed"),
             row("falcon", 4, False, "hf", "ok")]
    fresh = [row("falcon", 2, False, "hf", "no plan"), row("falcon", 2, True, "synthesized", "ok")]
    assert bench_plans.merged(saved, fresh) == [saved[0], fresh[0], saved[2], fresh[1]]


@pytest.fixture(scope="module")
def tiny_falcon_models():
    """A family with no handwritten plan and no transformers plan, whose layers are ``transformer.h``."""
    config = shrink_config(load_config("falcon"), tp=TP)
    models = {"full": build_model(config, dtype=torch.bfloat16), "kinds": len(layer_kinds(config))}
    for copies in bench_plans.DEPTHS:
        models[copies] = build_model(with_layers(config, copies), dtype=torch.bfloat16)
    return models


def test_a_family_without_handwritten_plan_gets_no_plan_rows_and_a_measured_synthesized_one(tiny_falcon_models):
    rows = {source: bench_plans.measure_variant(tiny_falcon_models, "falcon", source, False, TP, batch=1, seq=SEQ)
            for source in ("handwritten", "synthesized", "hf")}
    assert rows["handwritten"]["status"] == rows["hf"]["status"] == "no plan"
    assert "handwritten" in rows["handwritten"]["reason"]
    synthesized = rows["synthesized"]
    assert synthesized["status"] == "ok", synthesized["reason"]
    assert synthesized["equal_to_handwritten"] is None
    assert synthesized["per_layer"]["forward"]["collectives"]  # a sharded layer communicates
    assert synthesized["activation_bytes_per_rank_per_layer"] > 0  # transformer.h found as the layer list
    assert bench_plans.ratios(list(rows.values())) == []  # nothing to divide by
