"""Backward against forward communication, before and after the shared-input layout, per family.

Reads two results of ``bench_plans.py``: ``plans_before_backward_fix.json`` (the plans as they were,
each column projection all-reducing its own input gradient) and ``plans.json`` (now), and prints per
family, tp, plain/SP and source the ring bytes per decoder layer per token, forward and backward, and
the ratio of each to the Megatron limit: one all-reduce (or one all-gather + one reduce-scatter
under SP, the same ring bytes) of the hidden state per branch that returns to the residual stream,
in each direction. A branch is a row-parallel projection; the two rows of a parallel block, which
the plan reduces together, count as one. Nothing here is measured anew: every figure is in the JSON
files, which come from runs.

    python benchmarks/comm_report.py          # prints the table and writes results/COMM.md
    python benchmarks/comm_report.py --counts # also counts collectives on 2-layer tiny models (~1 min)

Families with no handwritten plan (``bench_plans.py`` marks their handwritten rows "no plan") have
no branch count to set the limit by; they get their own table: parameters per rank over the model's,
and the collectives per decoder layer, forward and backward, of the synthesized and transformers'
plans (a plan that did not run is listed with its reason).

``--counts`` adds a measured table: collectives of one forward and of its ``loss.backward()`` on
2-layer tiny models at tp=2 (``autotp.verify``, simulated ranks, numerics checked), for families
the plan benchmark does not hold (MoE, no pre-norm) and a few it does, next to the counts before
the backward fix of issue 13 (:data:`BEFORE`, measured the same way).
"""

from __future__ import annotations

import argparse
import json
import sys
import warnings
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _plans_common import build, plan_from  # noqa: E402

from autotp.plan import resolve  # noqa: E402
from autotp.styles import Rowwise  # noqa: E402
from torch.distributed.tensor.parallel import RowwiseParallel  # noqa: E402

RESULTS = Path(__file__).parent / "results"
BYTES = 2  # bf16, as bench_plans measures


def branches(family: str, tp: int) -> float:
    """Row-parallel projections per decoder layer in the current handwritten plan (a parallel block's
    two partial rows count as one reduction), read from the plan applied to the 2-layer model."""
    model = build(family, copies=1)
    plan = plan_from(model, "handwritten", tp=tp, sequence_parallel=False)
    rows = 0.0
    for fqn, (_, style) in resolve(model, plan).items():
        if ".layers." not in fqn and ".h." not in fqn:
            continue
        if isinstance(style, Rowwise) and style.partial_output:
            rows += 0.5
        elif isinstance(style, RowwiseParallel):
            rows += 1
    layers = model.config.get_text_config().num_hidden_layers
    return rows / layers


def limit(hidden: int, tp: int, rows: float) -> float:
    """Megatron's ring bytes per layer per token in one direction: an all-reduce of the hidden state
    (2(W-1)/W x input) per branch."""
    return rows * 2 * (tp - 1) / tp * hidden * BYTES


def _index(rows: list[dict]) -> dict:
    return {(r["family"], r["tp"], r["sequence_parallel"], r["source"]): r for r in rows if r.get("status") == "ok"}


# Tiny-model counts (forward, backward) before issue 13's MoE / entry / kv / SP-parallel-block fixes.
BEFORE = {
    ("qwen3_moe", False): ("all_reduce=5", "all_reduce=7"),
    ("qwen3_moe", True): ("all_gather=5 reduce_scatter=5", "all_gather=5 all_reduce=4 reduce_scatter=3"),
    ("mixtral", False): ("all_reduce=5", "all_reduce=7"),
    ("mixtral", True): ("all_gather=5 reduce_scatter=5", "all_gather=5 all_reduce=4 reduce_scatter=3"),
    ("olmo2", False): ("all_reduce=9", "all_reduce=11 reduce_scatter=4"),
    ("olmo2", True): ("all_gather=5 all_reduce=4 reduce_scatter=5", "all_gather=5 all_reduce=10 reduce_scatter=5"),
    ("phi", False): ("all_reduce=3", "all_reduce=3"),
    ("phi", True): ("all_gather=3 reduce_scatter=3", "all_gather=5 reduce_scatter=3"),
    ("llama", False): ("all_reduce=5", "all_reduce=5"),
    ("llama", True): ("all_gather=5 reduce_scatter=5", "all_gather=5 reduce_scatter=5"),
}


# What the rows still above 1.00 in backward pay for (kept by hand: the JSON holds bytes, not causes).
ABOVE = (
    "Still above the forward: replicated kv heads (tp > kv heads: gemma3 at tp 2 and 4, gemma3-vlm, "
    "gemma4 and qwen3_5 at tp 8) sum each k / v weight gradient's copies with one all-reduce of the "
    "kv-head-sized gradient per projection (an all-gather of the tp-times-expanded gradient before: "
    "gemma3 tp 4 went 1.25 -> 1.12; equal where kv heads = tp / 2); an all-reduce among a head's copies "
    "only would need sub-groups of the tp mesh. Falcon-H1 under SP: its branches are scaled by different "
    "constants before their sum, and each gathered its own gradient (1.24); the block's add now "
    "redistributes the partial sum explicitly (`JoinPartialSums`), one gather for both (1.00). Phi under "
    "SP: the two branches now share one all-gather of the joined gradient (1.50 -> 1.00). MoE and OLMo2 (not in the plan benchmark): see the counts below.\n"
)


def _short(counts: dict[str, float]) -> str:
    return " ".join(f"{op.replace('_into_tensor', '').replace('_tensor', '')}={n:g}" for op, n in sorted(
        counts.items(), key=lambda kv: kv[0].replace("_into_tensor", "").replace("_tensor", "")))


def without_handwritten(rows: list[dict]) -> list[str]:
    """Families whose every handwritten row is "no plan" (none at all is the same)."""
    families = dict.fromkeys(r["family"] for r in rows)
    return [f for f in families
            if all(r["status"] == "no plan" for r in rows if r["family"] == f and r["source"] == "handwritten")]


def synthesized_vs_hf(rows: list[dict], families: list[str]) -> str:
    """The markdown table of :func:`without_handwritten`'s families: every synthesized and
    transformers row, ok or not."""
    lines = ["| family | tp | SP | source | params / rank | fwd collectives / layer | bwd collectives / layer | "
             "fwd, bwd KiB / token / layer (ring) |", "|---|---|---|---|---|---|---|---|"]
    order = {"synthesized": 0, "hf": 1}
    picked = [r for r in rows if r["family"] in families and r["source"] in order]
    for r in sorted(picked, key=lambda r: (families.index(r["family"]), r["tp"], r["sequence_parallel"],
                                           order[r["source"]])):
        head = f"| {r['family']} | {r['tp']} | {'SP' if r['sequence_parallel'] else 'plain'} | {r['source']} |"
        if r["status"] != "ok":
            lines.append(f"{head} {r['status']}: {r['reason']} | | | |")
            continue
        fwd, bwd = r["per_layer"]["forward"], r["per_layer"]["backward"]
        fraction = r["param_bytes_per_rank"] / r["param_bytes_total"]
        lines.append(f"{head} {fraction:.3f} | {_short(fwd['collectives']) or 'none'} | "
                     f"{_short(bwd['collectives']) or 'none'} | {fwd['ring_bytes_per_token'] / 1024:.1f}, "
                     f"{bwd['ring_bytes_per_token'] / 1024:.1f} |")
    return "\n".join(lines)


def tiny_counts() -> str:
    """The measured table of ``--counts`` (markdown)."""
    sys.path.insert(0, str(Path(__file__).parent.parent / "tests"))
    from synth_models import tiny_model

    from autotp.synth import synthesize
    from autotp.verifier import verify

    lines = ["| family | SP | forward before | backward before | forward now | backward now | numerics |",
             "|---|---|---|---|---|---|---|"]
    for family in ("qwen3_moe", "mixtral", "olmo2", "phi", "llama"):
        model = tiny_model(family, device="cpu")
        for sp in (False, True):
            with warnings.catch_warnings():
                warnings.simplefilter("ignore")
                report = verify(model, synthesize(model, tp_size=2, sequence_parallel=sp, verify=False), tp_size=2)
            fwd, bwd = BEFORE.get((family, sp), ("-", "-"))
            lines.append(f"| {family} | {'SP' if sp else 'plain'} | {fwd} | {bwd} | {_short(report.collectives)} | "
                         f"{_short(report.collectives_backward)} | {'ok' if report.ok else 'FAIL'} |")
            print(lines[-1], flush=True)
    return "\n".join(lines)


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--counts", action="store_true", help="also count collectives on 2-layer tiny models")
    args = parser.parse_args()
    before = _index(json.loads((RESULTS / "plans_before_backward_fix.json").read_text())["results"])
    saved = json.loads((RESULTS / "plans.json").read_text())["results"]
    after = _index(saved)
    no_hand = without_handwritten(saved)
    lines = ["| family | tp | SP | source | fwd / limit | bwd / limit before | bwd / limit now | bwd / fwd now |",
             "|---|---|---|---|---|---|---|---|"]
    cache: dict = {}
    for key in sorted(after):
        family, tp, sp, source = key
        if source == "hf" or family in no_hand:
            continue
        if (family, tp) not in cache:
            model = build(family, copies=1)
            cache[(family, tp)] = (model.config.get_text_config().hidden_size, branches(family, tp))
        hidden, rows = cache[(family, tp)]
        bound = limit(hidden, tp, rows)
        now = after[key]["per_layer"]
        fwd, bwd = now["forward"]["ring_bytes_per_token"], now["backward"]["ring_bytes_per_token"]
        old = before.get(key)
        old_bwd = f"{old['per_layer']['backward']['ring_bytes_per_token'] / bound:.2f}" if old else "-"
        lines.append(f"| {family} | {tp} | {'SP' if sp else 'plain'} | {source} | {fwd / bound:.2f} | {old_bwd} | "
                     f"{bwd / bound:.2f} | {bwd / fwd if fwd else float('nan'):.2f} |")
    text = "\n".join(lines)
    print(text)
    others = ""
    if no_hand:
        others = ("\n## Families without a handwritten plan: synthesized against transformers' plan\n\n"
                  "No handwritten plan, so no branch count for the limit above: parameters per rank over the "
                  "model's (largest rank, the whole real-size model) and the collectives per decoder layer, "
                  "a mean over the layer kinds (a fraction where kinds differ), from `plans.json`. "
                  "transformers' plans have no SP variant.\n\n" + synthesized_vs_hf(saved, no_hand) + "\n")
        print(others)
    previous = (RESULTS / "COMM.md").read_text() if (RESULTS / "COMM.md").exists() else ""
    counts = previous[previous.find("\n## Collective counts"):] if "\n## Collective counts" in previous else ""
    if args.counts:  # else the last measured table is kept
        counts = ("\n## Collective counts on 2-layer tiny models (synthesized, tp=2)\n\n"
                  "One forward and its `loss.backward()`, `autotp.verify` on simulated ranks (logits and every "
                  "gradient checked). At the limit the backward mirrors the forward (all-reduce for "
                  "all-reduce, all-gather for reduce-scatter); OLMo2's QK-norms over the sharded width add one "
                  "statistic all-reduce each in forward and one reduce-scatter each in backward. "
                  "`python benchmarks/comm_report.py --counts`.\n\n" + tiny_counts() + "\n")
    (RESULTS / "COMM.md").write_text(
        "# Backward communication against the Megatron limit\n\n"
        "Ring bytes per decoder layer per token (bf16, real-size widths, simulated ranks), from\n"
        "`plans_before_backward_fix.json` (before) and `plans.json` (now), divided by the Megatron limit\n"
        "(one all-reduce of the hidden state per branch and direction). `python benchmarks/comm_report.py`.\n\n"
        + text + "\n\n" + ABOVE + others + "\n" + counts)


if __name__ == "__main__":
    main()
