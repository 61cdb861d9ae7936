"""Wall-clock time of ``autotp plan MODEL``: a first run (empty cache), a repeated run (the kept
answer), and the imports a first run cannot avoid, side by side, medians of ``--runs``.

- ``cold``: ``autotp plan MODEL`` with an empty ``$AUTOTP_CACHE_DIR`` (build on meta, selection:
  synthesis and the checker over every source, memory, printing);
- ``cached``: the same command again (its answer read back without importing torch);
- ``imports``: ``python -c "import torch, transformers; from transformers import <Model>ForCausalLM;
  import torch.distributed.tensor, torch.export"``, what building and tracing the model needs.

- ``base``: with ``--base DIR`` (another tree, e.g. ``git archive <commit>``), its first run too,
  interleaved with this tree's, and the ratio of the medians.

Prints the table and writes ``results/cli_time.json``. Run it on an idle machine:

    python benchmarks/cli_time.py [--model llama] [--runs 3] [--base ../autotp-base]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

RESULTS = Path(__file__).resolve().parent / "results"
IMPORTS = ("import torch, transformers, torch.distributed.tensor, torch.export; "
           "from transformers import LlamaForCausalLM")


def timed(command: list[str], env: dict) -> float:
    start = time.perf_counter()
    subprocess.run(command, env=env, check=True, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--model", default="llama")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--base", help="another tree (its autotp imported through PYTHONPATH), timed alike")
    args = parser.parse_args()
    plan = [sys.executable, "-m", "autotp", "plan", args.model]
    samples: dict[str, list[float]] = {"cold": [], "cached": [], "imports": [], **({"base": []} if args.base else {})}
    for _ in range(args.runs):  # interleaved, so a change in load hits every column alike
        cache = tempfile.mkdtemp(prefix="autotp-cli-time-")
        env = {**os.environ, "AUTOTP_CACHE_DIR": cache}
        if args.base:
            base_cache = tempfile.mkdtemp(prefix="autotp-cli-time-base-")
            base_env = {**env, "AUTOTP_CACHE_DIR": base_cache, "PYTHONPATH": str(Path(args.base).resolve())}
            samples["base"].append(timed(plan, base_env))
            shutil.rmtree(base_cache)
        samples["cold"].append(timed(plan, env))
        samples["cached"].append(timed(plan, env))
        samples["imports"].append(timed([sys.executable, "-c", IMPORTS], env))
        shutil.rmtree(cache)
    medians = {name: statistics.median(values) for name, values in samples.items()}
    lines = [f"| command | median s ({args.runs} runs) |", "| --- | --- |",
             f"| autotp plan {args.model} (first run) | {medians['cold']:.2f} |",
             f"| autotp plan {args.model} (again: kept answer) | {medians['cached']:.2f} |",
             f"| imports alone (torch, transformers, DTensor, export) | {medians['imports']:.2f} |"]
    if args.base:
        lines.append(f"| autotp plan {args.model} (first run) in {args.base} | {medians['base']:.2f} "
                     f"(this tree / base: {medians['cold'] / medians['base']:.2f}) |")
    print("\n".join(lines))
    meta = {"command": " ".join(sys.argv), "cpus": os.cpu_count(), "load_average_at_end": os.getloadavg(),
            "python": platform.python_version()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "cli_time.json").write_text(json.dumps(
        {"meta": meta, "samples_s": samples, "medians_s": medians, "table": lines}, indent=2))


if __name__ == "__main__":
    main()
