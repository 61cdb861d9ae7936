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
"""

from __future__ import annotations

import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).parent))
from _plans_common import build, plan_from  # noqa: E402

from autotp.plan import resolve  # noqa: E402
from autotp.styles import PartialRowwiseParallel  # noqa: E402
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
        if isinstance(style, PartialRowwiseParallel):
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


def main() -> None:
    before = _index(json.loads((RESULTS / "plans_before_backward_fix.json").read_text())["results"])
    after = _index(json.loads((RESULTS / "plans.json").read_text())["results"])
    lines = ["| family | tp | SP | source | fwd / limit | bwd / limit before | bwd / limit now | bwd / fwd now |",
             "|---|---|---|---|---|---|---|---|"]
    cache: dict = {}
    for key in sorted(after):
        family, tp, sp, source = key
        if source == "hf":
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
    (RESULTS / "COMM.md").write_text(
        "# Backward communication against the Megatron limit\n\n"
        "Ring bytes per decoder layer per token (bf16, real-size widths, simulated ranks), from\n"
        "`plans_before_backward_fix.json` (before) and `plans.json` (now), divided by the Megatron limit\n"
        "(one all-reduce of the hidden state per branch and direction). `python benchmarks/comm_report.py`.\n\n"
        + text + "\n")


if __name__ == "__main__":
    main()
