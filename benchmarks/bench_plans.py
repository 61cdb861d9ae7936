"""Compare handwritten, synthesized and transformers' tensor-parallel plans, family by family.

For each architecture with a handwritten plan, and four without one (Qwen3-Next, Nemotron-H,
gpt-oss, Falcon: their handwritten rows say "no plan"), at tp 2, 4 and 8 over simulated ranks, with
the real-size config's widths on the meta device (shapes only: no memory, no weights), bf16:

- collectives and bytes communicated per decoder layer per token, forward and backward;
- parameter bytes per rank, of the whole real-size model, and that over the model's bytes;
- activation bytes per rank per decoder layer at ``--seq`` tokens (what autograd saves for backward);

for the plain-TP plans of all three sources and the sequence-parallel (SP) plans of the first two
(transformers' plans have none). Ratios synthesized/handwritten are printed and saved, and
synthesized/transformers where both plans ran.

How it is measured (nothing is computed from formulas; every figure comes from a run):

- Bytes: every collective the sharded model issues in one forward and one backward of the loss
  it is trained with (next-token cross-entropy, vocab-parallel where the head keeps the vocabulary
  sharded) is recorded with the bytes of its per-rank input. The model is built twice, with 2 and 3
  copies of one layer of each kind (Gemma3: one sliding, one full); the difference over the extra
  layers is the per-layer cost (a mean over the layer kinds), and what the 2-copy model issues
  beyond its layers is the boundary cost (embedding, head and loss, once per model). Bytes are
  given two ways: ``payload`` (sum of collective inputs per rank) and ``ring`` (bytes one rank sends
  with ring algorithms, the NCCL bus-bandwidth convention: all-reduce 2(W-1)/W x input,
  reduce-scatter (W-1)/W x input, all-gather (W-1) x input shard). Per token = / (batch x seq).
- Activation memory: a saved-tensor hook inside every decoder layer sums the storage bytes one
  rank keeps for backward (each storage once, parameters excluded), divided by the layer count.

    python benchmarks/bench_plans.py [--only llama,qwen3] [--tp 2 4 8] [--seq 2048] [--chart-only]

Writes ``benchmarks/results/plans.json``, merged by (family, tp, SP, source): the rows this run
measured replace theirs, every other row already there is kept (``--only`` refreshes part of it;
the file is re-read just before writing, so a run of other families in between is kept too), and the chart ``benchmarks/results/plans.png``, which also shows
the measured tokens/s ratios from ``benchmarks/results/runtime.json`` when that file exists
(``bench_runtime.py``).
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

sys.path.insert(0, str(Path(__file__).parent))
from _plans_common import FAMILIES, NoPlan, build, layer_kinds, measure, plan_from  # noqa: E402

from autotp.memory import param_bytes_per_rank  # noqa: E402
from autotp.plan import plan_diff  # noqa: E402

RESULTS = Path(__file__).parent / "results"
PLANS_JSON = RESULTS / "plans.json"
RUNTIME_JSON = RESULTS / "runtime.json"
CHART = RESULTS / "plans.png"
# (source, sequence_parallel) in the order of the table.
VARIANTS = [("handwritten", False), ("synthesized", False), ("hf", False), ("handwritten", True), ("synthesized", True)]
DEPTHS = (2, 3)  # copies of one layer of each kind; the difference is the per-layer cost
PHASES = ("forward", "backward")


def _first_line(error: BaseException) -> str:
    return f"{type(error).__name__}: {str(error).strip().splitlines()[0][:300]}" if str(error).strip() else type(error).__name__


def _phase_summary(collectives: dict, tokens: int, layers: float) -> dict:
    """Collective counts and bytes per token of one phase, divided by ``layers``."""
    counts = {op: round(v[0] / layers, 3) for op, v in sorted(collectives.items()) if v[0]}
    return {
        "collectives": counts,
        "payload_bytes_per_token": round(sum(v[1] for v in collectives.values()) / tokens / layers, 1),
        "ring_bytes_per_token": round(sum(v[2] for v in collectives.values()) / tokens / layers, 1),
    }


def _difference(deep: dict, shallow: dict) -> dict:
    """``deep - shallow`` per phase and op, of ``[count, payload, ring]`` lists."""
    out = {}
    for phase in PHASES:
        ops = set(deep.get(phase, {})) | set(shallow.get(phase, {}))
        zero = [0, 0, 0.0]
        out[phase] = {op: [d - s for d, s in zip(deep.get(phase, {}).get(op, zero), shallow.get(phase, {}).get(op, zero))]
                      for op in ops}
    return out


def _scaled_difference(total: dict, per_layer: dict, layers: int) -> dict:
    """``total - layers x per_layer``: what the model issues outside its decoder layers."""
    out = {}
    for phase in PHASES:
        ops = set(total.get(phase, {})) | set(per_layer.get(phase, {}))
        zero = [0, 0, 0.0]
        out[phase] = {op: [t - layers * p for t, p in zip(total.get(phase, {}).get(op, zero), per_layer.get(phase, {}).get(op, zero))]
                      for op in ops}
    return out


def measure_variant(models: dict, family: str, source: str, sp: bool, tp: int, *, batch: int, seq: int) -> dict:
    """One row of results: a family's plan from ``source`` at ``tp``, plain TP or SP."""
    row = {"family": family, "config_of": FAMILIES[family].config_of, "tp": tp, "sequence_parallel": sp,
           "source": source, "status": "ok", "reason": None}
    kinds = models["kinds"]
    try:
        plan = plan_from(models["full"], source, tp=tp, sequence_parallel=sp)
        per_rank, total = param_bytes_per_rank(models["full"], plan, tp)
        row.update(param_bytes_per_rank=per_rank, param_bytes_total=total, param_fraction=round(per_rank / total, 4))
        if source != "handwritten":
            row["equal_to_handwritten"] = _equal_to_handwritten(models["full"], plan, tp, sp)
        runs = {}
        for copies in DEPTHS:
            model = models[copies]
            runs[copies] = measure(model, plan_from(model, source, tp=tp, sequence_parallel=sp), tp,
                                   batch=batch, seq=seq, activations=copies == DEPTHS[0])
    except NoPlan as error:
        row.update(status="no plan", reason=str(error))
        return row
    except Exception as error:  # recorded, not hidden: the table and the JSON say which and why
        row.update(status="failed", reason=_first_line(error))
        return row
    tokens = batch * seq
    extra = (DEPTHS[1] - DEPTHS[0]) * kinds
    per_layer = _difference(runs[DEPTHS[1]]["collectives"], runs[DEPTHS[0]]["collectives"])
    boundary = _scaled_difference(runs[DEPTHS[0]]["collectives"], per_layer, DEPTHS[0] * kinds // extra)
    row["per_layer"] = {phase: _phase_summary(per_layer[phase], tokens, extra) for phase in PHASES}
    row["boundary"] = {phase: _phase_summary(boundary[phase], tokens, 1) for phase in PHASES}
    row["ring_bytes_per_layer_per_token"] = sum(row["per_layer"][p]["ring_bytes_per_token"] for p in PHASES)
    row["activation_bytes_per_rank_per_layer"] = runs[DEPTHS[0]]["activation_bytes"] // (DEPTHS[0] * kinds)
    return row


def _equal_to_handwritten(model, plan, tp: int, sp: bool) -> bool | None:
    """Whether ``plan`` gives every module the handwritten plan's style (None: no handwritten plan)."""
    try:
        return plan_diff(model, plan, plan_from(model, "handwritten", tp=tp, sequence_parallel=sp)) == {}
    except Exception:
        return None


def measure_family(family: str, tps: list[int], *, batch: int, seq: int) -> list[dict]:
    models = {"full": build(family)}
    models["kinds"] = len(layer_kinds(models["full"].config))
    for copies in DEPTHS:
        models[copies] = build(family, copies=copies)
    return [measure_variant(models, family, source, sp, tp, batch=batch, seq=seq)
            for tp in tps for source, sp in VARIANTS]


# --- ratios and the table ----------------------------------------------------------------------

METRICS = {  # name -> (row key, unit divisor, unit)
    "comm": ("ring_bytes_per_layer_per_token", 2**10, "KiB"),
    "param": ("param_bytes_per_rank", 2**30, "GiB"),
    "act": ("activation_bytes_per_rank_per_layer", 2**20, "MiB"),
}


def _find(rows, family, tp, source, sp):
    for row in rows:
        if (row["family"], row["tp"], row["source"], row["sequence_parallel"]) == (family, tp, source, sp):
            return row
    return None


# (numerator, denominator) sources of the saved ratios; a pair is skipped where either did not run.
RATIO_PAIRS = (("synthesized", "handwritten"), ("hf", "handwritten"), ("synthesized", "hf"))


def ratios(rows: list[dict]) -> list[dict]:
    """synthesized / handwritten, transformers / handwritten and synthesized / transformers per
    family, tp and SP, per metric, for the pairs where both plans ran."""
    out = []
    for family, tp, sp in sorted({(r["family"], r["tp"], r["sequence_parallel"]) for r in rows}):
        for top, bottom in RATIO_PAIRS:
            a_row, b_row = _find(rows, family, tp, top, sp), _find(rows, family, tp, bottom, sp)
            if a_row is None or b_row is None or a_row["status"] != "ok" or b_row["status"] != "ok":
                continue
            entry = {"family": family, "tp": tp, "sequence_parallel": sp, "ratio": f"{top}/{bottom}"}
            for metric, (key, _, _) in METRICS.items():
                a, b = a_row.get(key), b_row.get(key)
                entry[metric] = round(a / b, 4) if a is not None and b else None
            out.append(entry)
    return out


def _cell(row, key, divisor) -> str:
    if row is None or row["status"] == "no plan":
        return "-"
    if row["status"] != "ok":
        return "FAIL"
    return f"{row[key] / divisor:.2f}"


def print_table(rows: list[dict], ratio_rows: list[dict]) -> None:
    sources = ("handwritten", "synthesized", "hf")
    head = (f"{'family':11s} {'tp':>2s} {'sp':3s} | {'comm KiB/token/layer (H S T)':>28s} | "
            f"{'param GiB/rank (H S T)':>24s} | {'act MiB/rank/layer (H S T)':>26s} | {'S/H comm':>8s} {'param':>6s} {'act':>6s}")
    print("H handwritten, S synthesized, T transformers' plan; comm = ring bytes sent per rank, forward + backward")
    print(head)
    print("-" * len(head))
    for family, tp, sp in sorted({(r["family"], r["tp"], r["sequence_parallel"]) for r in rows},
                                 key=lambda k: (list(FAMILIES).index(k[0]) if k[0] in FAMILIES else 99, k[1], k[2])):
        cells = []
        for metric, (key, divisor, _) in METRICS.items():
            cells.append(" ".join(f"{_cell(_find(rows, family, tp, s, sp), key, divisor):>8s}" for s in sources))
        ratio = next((r for r in ratio_rows if (r["family"], r["tp"], r["sequence_parallel"], r["ratio"])
                      == (family, tp, sp, "synthesized/handwritten")), None)
        ratio_cells = " ".join(f"{ratio[m]:>6.3f}" if ratio and ratio[m] is not None else f"{'-':>6s}" for m in METRICS)
        print(f"{family:11s} {tp:>2d} {'sp' if sp else 'tp':3s} | {cells[0]:>28s} | {cells[1]:>24s} | {cells[2]:>26s} | {ratio_cells}")
    failures = [r for r in rows if r["status"] == "failed"]
    if failures:
        print("\nFailed:")
        for r in failures:
            print(f"  {r['family']} tp={r['tp']} {'sp' if r['sequence_parallel'] else 'tp'} {r['source']}: {r['reason']}")


# --- the chart ---------------------------------------------------------------------------------


def draw_chart(rows: list[dict], tp: int, path: Path) -> None:
    """Four panels at ``tp``: bytes per token per layer, parameters per rank, activations per rank
    per layer (plain TP and SP) and, from runtime.json, the measured tokens/s ratios."""
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    families = [f for f in FAMILIES if any(r["family"] == f and r["tp"] == tp for r in rows)]
    colours = {("handwritten", False): "#1f77b4", ("synthesized", False): "#ff7f0e", ("hf", False): "#2ca02c",
               ("handwritten", True): "#9ecae1", ("synthesized", True): "#fdd0a2"}
    labels = {("handwritten", False): "handwritten", ("synthesized", False): "synthesized",
              ("hf", False): "transformers' plan", ("handwritten", True): "handwritten + SP",
              ("synthesized", True): "synthesized + SP"}
    panels = [("comm", VARIANTS, "KiB sent per rank per token per layer\n(fwd + bwd, ring)"),
              ("param", VARIANTS[:3], "GiB of parameters per rank (bf16)"),
              ("act", VARIANTS, "MiB of activations per rank per layer")]
    fig, axes = plt.subplots(4, 1, figsize=(15, 17))
    seq = next((r.get("seq") for r in rows if r.get("seq")), None)
    for ax, (metric, variants, ylabel) in zip(axes, panels):
        key, divisor, _ = METRICS[metric]
        width = 0.8 / len(variants)
        for i, variant in enumerate(variants):
            xs, ys, fails = [], [], []
            for j, family in enumerate(families):
                row = _find(rows, family, tp, *variant)
                x = j + (i - (len(variants) - 1) / 2) * width
                if row is None or row["status"] == "no plan":
                    continue
                if row["status"] != "ok":
                    fails.append(x)
                    continue
                xs.append(x)
                ys.append(row[key] / divisor)
            ax.bar(xs, ys, width, color=colours[variant], label=labels[variant], edgecolor="black", linewidth=0.3)
            for x in fails:  # x in data units, y in axes units: visible on a log scale
                ax.text(x, 0.02, "fail", rotation=90, ha="center", va="bottom", fontsize=7, color="red",
                        transform=ax.get_xaxis_transform())
        ax.set_xticks(range(len(families)), families, rotation=20)
        ax.set_yscale("log")  # 1B to 24B models side by side
        ax.set_ylabel(ylabel)
        ax.grid(axis="y", alpha=0.3)
        ax.legend(fontsize=8, ncol=5, loc="upper right")
    axes[0].set_title(f"Plans compared at tp={tp} (simulated ranks, real-size widths"
                      + (f", activations at {seq} tokens)" if seq else ")"))
    _runtime_panel(axes[3])
    fig.tight_layout(rect=(0, 0.02, 1, 1))
    fig.text(0.01, 0.005, "Missing bar: the source has no such plan (transformers: no SP; TP-only handwritten plans). "
             "'fail': the plan could not be applied or run (reasons in plans.json). Falcon-H1 and Qwen3.5 "
             "activations are those of transformers' reference PyTorch SSM / delta-rule kernels.", fontsize=8)
    path.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)


def _runtime_panel(ax) -> None:
    if not RUNTIME_JSON.exists():
        ax.text(0.5, 0.5, "no runtime.json yet: run benchmarks/bench_runtime.py under torchrun", ha="center",
                transform=ax.transAxes)
        ax.set_axis_off()
        return
    runtime = json.loads(RUNTIME_JSON.read_text())
    entries = [r for r in runtime["ratios"] if r.get("ratio") is not None]
    names = [f"{r['family']} {'sp' if r['sequence_parallel'] else 'tp'}\n{r['plan'].split('/')[0]}" for r in entries]
    colours = ["#ff7f0e" if r["plan"].startswith("synthesized") else "#2ca02c" for r in entries]
    ax.bar(range(len(entries)), [r["ratio"] for r in entries], color=colours, edgecolor="black", linewidth=0.3)
    for i, r in enumerate(entries):  # an identical plan's ratio is the run's noise floor
        if r.get("plans_equal"):
            ax.text(i, r["ratio"], "same plan", ha="center", va="bottom", fontsize=7)
    ax.axhline(1.0, color="black", linewidth=0.8)
    ax.set_xticks(range(len(entries)), names, fontsize=8)
    ax.set_ylabel("tokens/s ratio to handwritten\n(median, fwd + bwd)")
    ax.set_ylim(0, max(1.2, max((r["ratio"] for r in entries), default=1) * 1.1))
    ax.set_title(f"Measured runtime: {runtime['world_size']} {runtime['backend']} ranks on {runtime['device']}, "
                 f"{runtime['model_shape']}")
    ax.grid(axis="y", alpha=0.3)


# --- main --------------------------------------------------------------------------------------


def _row_key(row: dict) -> tuple:
    return row["family"], row["tp"], row["sequence_parallel"], row["source"]


def merged(saved: list[dict], rows: list[dict]) -> list[dict]:
    """``rows`` over ``saved`` by (family, tp, SP, source): a saved row measured again is replaced in
    place, every other saved row is kept, new rows go last."""
    new = {_row_key(r): r for r in rows}
    out = [new.pop(_row_key(r), r) for r in saved]
    return out + [r for r in rows if _row_key(r) in new]


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--only", default=None, help=f"comma-separated families (of {', '.join(FAMILIES)})")
    parser.add_argument("--tp", type=int, nargs="+", default=[2, 4, 8])
    parser.add_argument("--seq", type=int, default=2048, help="tokens per sequence (divisible by every tp)")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--chart-tp", type=int, default=None, help="tp the chart shows (default: the largest)")
    parser.add_argument("--chart-only", action="store_true", help="redraw the chart from the saved JSON files")
    args = parser.parse_args()
    warnings.filterwarnings("ignore", message="Parallelize plan key")
    if args.chart_only:
        saved = json.loads(PLANS_JSON.read_text())
        draw_chart(saved["results"], args.chart_tp or max(r["tp"] for r in saved["results"]), CHART)
        print(f"wrote {CHART}")
        return
    families = args.only.split(",") if args.only else list(FAMILIES)
    unknown = [f for f in families if f not in FAMILIES]
    if unknown:
        parser.error(f"unknown families {unknown}; choose from {', '.join(FAMILIES)}")
    rows, timings = [], {}
    for family in families:
        start = time.perf_counter()
        family_rows = measure_family(family, args.tp, batch=args.batch, seq=args.seq)
        for row in family_rows:
            row.update(seq=args.seq, batch=args.batch)
        rows += family_rows
        timings[family] = round(time.perf_counter() - start, 1)
        print(f"measured {family} in {timings[family]} s", file=sys.stderr)
    saved = json.loads(PLANS_JSON.read_text()) if PLANS_JSON.exists() else {}
    rows = merged(saved.get("results", []), rows)
    timings = {**saved.get("seconds_per_family", {}), **timings}
    ratio_rows = ratios(rows)
    print_table(rows, ratio_rows)
    result = {
        "what": "per-layer collectives and bytes per token (forward, backward), parameter bytes per rank, "
                "activation bytes per rank per decoder layer; simulated ranks, real-size widths on meta, bf16",
        "bytes_convention": "payload = sum of per-rank collective inputs; ring = bytes one rank sends with ring "
                            "algorithms (all-reduce 2(W-1)/W x input, reduce-scatter (W-1)/W x input, "
                            "all-gather (W-1) x input shard); per token = / (batch x seq)",
        "per_layer": f"difference between {DEPTHS[1]} and {DEPTHS[0]} copies of one layer of each kind, "
                     "divided by the extra layers; boundary = embedding + head + loss, once per model",
        "ratios": ratio_rows,
        "results": rows,
        "seconds_per_family": timings,
        "torch": torch.__version__, "transformers": transformers.__version__,
        "machine": platform.processor() or platform.machine(),
    }
    RESULTS.mkdir(parents=True, exist_ok=True)
    PLANS_JSON.write_text(json.dumps(result, indent=1) + "\n")
    draw_chart(rows, args.chart_tp or max(args.tp), CHART)
    print(f"\nwrote {PLANS_JSON} and {CHART}")


if __name__ == "__main__":
    main()
