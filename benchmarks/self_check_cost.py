"""What ``synthesize``'s default self-check costs: ``verify=False`` beside ``verify=True``, side by side.

For each case, the median wall-clock and CPU time of ``--runs`` calls (after one warm-up of each) of
``autotp.synthesize(model, tp_size=tp, verify=False)`` and of the same call with the self-check
(``verify=True``, the default: logits and every gradient on simulated ranks, on the model itself or,
for a model on the meta device, on a tiny copy built from its config). Cases: a tiny Llama on the
CPU at tp 2, and the real-size Llama-3.1-8B config on the meta device at tp 8.

Prints the table and writes ``results/self_check_cost.json``. Run it on an idle machine:

    python benchmarks/self_check_cost.py [--runs 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
import warnings
from pathlib import Path

import torch

import autotp
from autotp.models import build_model

RESULTS = Path(__file__).resolve().parent / "results"

CASES = {  # case -> (built-in name, tiny, device, tp)
    "tiny llama, cpu, tp 2": ("llama", True, "cpu", 2),
    "llama 8B, meta, tp 8": ("llama", False, "meta", 8),
}


def timed(function) -> tuple[float, float]:
    wall, cpu = time.perf_counter(), time.process_time()
    function()
    return time.perf_counter() - wall, time.process_time() - cpu


def medians(function, runs: int) -> dict[str, float]:
    function()  # warm-up: imports, caches of the tracer
    samples = [timed(function) for _ in range(runs)]
    return {"wall_s": statistics.median(s[0] for s in samples), "cpu_s": statistics.median(s[1] for s in samples)}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--runs", type=int, default=3)
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    rows = {}
    for case, (name, tiny, device, tp) in CASES.items():
        model = build_model(name, tiny=tiny, tp=tp, device=device)
        row = {}
        for verify in (False, True):
            row[f"verify={verify}"] = medians(lambda: autotp.synthesize(model, tp_size=tp, verify=verify), args.runs)
        row["ratio"] = row["verify=True"]["wall_s"] / row["verify=False"]["wall_s"]
        row["added_s"] = row["verify=True"]["wall_s"] - row["verify=False"]["wall_s"]
        rows[case] = row
    lines = ["| case | verify=False s (cpu) | verify=True s (cpu) | added s | ratio |", "| --- | --- | --- | --- | --- |"]
    for case, row in rows.items():
        off, on = row["verify=False"], row["verify=True"]
        lines.append(f"| {case} | {off['wall_s']:.2f} ({off['cpu_s']:.2f}) | {on['wall_s']:.2f} ({on['cpu_s']:.2f}) "
                     f"| {row['added_s']:.2f} | {row['ratio']:.1f}x |")
    print("\n".join(lines))
    meta = {"command": " ".join(sys.argv), "runs": args.runs, "cpus": os.cpu_count(), "threads": torch.get_num_threads(),
            "load_average_at_end": os.getloadavg(), "python": platform.python_version(), "torch": torch.__version__}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "self_check_cost.json").write_text(json.dumps({"meta": meta, "rows": rows, "table": lines}, indent=2))


if __name__ == "__main__":
    main()
