"""Real-size parameters per rank and tiny-model collectives for the families issue 12 names.

For each model type below, the real-size model is built on the meta device from the config
defaults of transformers 5.23.0 (which follow the reference checkpoints: Qwen3-Next-80B-A3B,
Bamba-9B, Nemotron-H, gpt-oss-20b, Falcon-7B, DeepSeek-V4-Flash) and planned at tp 2, 4 and 8 by the synthesizer and
by transformers' own plan (and Falcon-H1's defaults, a Mamba2 hybrid with one B/C group): the bytes each rank holds (:func:`autotp.memory.param_bytes_per_rank`)
against the Megatron-style bound of ``tests/test_synth_matrix.py``. The collectives of one forward and
backward come from the tiny model of the same type (``autotp.models.build_model(tiny=True)``) on
simulated ranks at tp=2, where the plan is also verified (logits and every gradient).

    python benchmarks/bench_real_size.py [--types qwen3_next,bamba,...] [--tp 2,4,8]

Writes ``benchmarks/results/real_size.json`` and prints a table.
"""

from __future__ import annotations

import argparse
import json
import platform
import sys
import time
import warnings
from pathlib import Path

import torch
import transformers

sys.path.insert(0, str(Path(__file__).parents[1] / "tests"))

from test_synth_matrix import megatron_fraction  # noqa: E402

from autotp.errors import AutoTPError, one_line  # noqa: E402
from autotp.memory import param_bytes_per_rank  # noqa: E402
from autotp.models import build_model  # noqa: E402
from autotp.selection import get_plan  # noqa: E402
from autotp.synth import synthesize  # noqa: E402
from autotp.verifier import verify  # noqa: E402

TYPES = ("qwen3_next", "bamba", "nemotron_h", "falcon_h1", "gpt_oss", "falcon", "deepseek_v4")
RESULTS = Path(__file__).parent / "results" / "real_size.json"


def _fraction(model, plan, tp: int) -> float | None:
    if plan is None:
        return None
    per_rank, total = param_bytes_per_rank(model, plan, tp)
    return round(per_rank / total, 4)


def _plan(model, source: str, tp: int):
    """The plan of ``source`` at ``tp`` and why there is none."""
    try:
        if source == "synthesized":
            return synthesize(model, tp_size=tp, verify=False), None
        return get_plan(model, source="hf", tp_size=tp).plan, None
    except AutoTPError as error:
        return None, one_line(error)


def real_size(model_type: str, tps: list[int]) -> dict:
    model = build_model(model_type, device="meta")
    out = {"class": type(model).__name__, "params_b": round(sum(p.numel() for p in model.parameters()) / 1e9, 2),
           "per_tp": {}}
    for tp in tps:
        row = {"bound": round(megatron_fraction(model, tp), 4)}
        for source in ("synthesized", "hf"):
            start = time.perf_counter()
            plan, why = _plan(model, source, tp)
            row[source] = {"fraction": _fraction(model, plan, tp), "seconds": round(time.perf_counter() - start, 2)}
            if why:
                row[source]["none"] = why
        out["per_tp"][tp] = row
    return out


def tiny_collectives(model_type: str, tp: int = 2) -> dict:
    """Verify both plans on the tiny model at ``tp``; their collectives, forward and backward."""
    model = build_model(model_type, tiny=True, tp=tp, device="cpu")
    model.config.use_cache = False  # as the coverage sweep runs it: no cache objects in the forward
    out = {}
    for source in ("synthesized", "hf"):
        plan, why = _plan(model, source, tp)
        if plan is None:
            out[source] = {"none": why}
            continue
        try:
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                report = verify(model, plan, tp_size=tp)
        except Exception as error:  # a family the tiny run cannot take: recorded, the rest goes on
            out[source] = {"error": one_line(error)}
            continue
        if not report.param_fraction:  # the sharded run itself failed: its error is the result
            out[source] = {"ok": False, "error": report.error or str(report)}
            continue
        out[source] = {"ok": report.ok, "fraction": round(max(report.param_fraction), 4),
                       "forward": dict(report.collectives), "backward": dict(report.collectives_backward),
                       **({"error": report.error} if report.error else {})}
    return out


def _cell(entry: dict) -> str:
    return "-" if entry.get("fraction") is None else f"{entry['fraction']:.3f}"


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--types", default=",".join(TYPES))
    parser.add_argument("--tp", default="2,4,8")
    args = parser.parse_args()
    tps = [int(t) for t in args.tp.split(",")]
    rows = {}
    for model_type in args.types.split(","):
        rows[model_type] = {**real_size(model_type, tps), "tiny_tp2": tiny_collectives(model_type)}
        r = rows[model_type]
        print(f"{model_type} ({r['class']}, {r['params_b']}B):")
        for tp, row in r["per_tp"].items():
            print(f"  tp={tp}: bound {row['bound']:.3f}, synthesized {_cell(row['synthesized'])}, "
                  f"transformers {_cell(row['hf'])}")
        for source, t in r["tiny_tp2"].items():
            print(f"  tiny tp=2 {source}: {t}")
    RESULTS.write_text(json.dumps({
        "meta": {"command": "python benchmarks/bench_real_size.py " + " ".join(sys.argv[1:]),
                 "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "machine": platform.machine(),
                 "torch": torch.__version__, "transformers": transformers.__version__,
                 "what": "parameter fraction per rank (largest rank) of real-size meta models, synthesized vs "
                         "transformers' plan vs the Megatron-style bound; tiny-model collectives at tp=2"},
        "results": rows,
    }, indent=1) + "\n")
    print(f"wrote {RESULTS}")


if __name__ == "__main__":
    main()
