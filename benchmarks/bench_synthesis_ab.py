"""Synthesis time of this checkout against another commit's, side by side in one run.

Each round runs one child process per side (``PYTHONPATH`` set to that side's tree), alternating
A, B, A, B, ...; each child times ``synthesize`` on meta-device configs of
:mod:`bench_synthesis` (the median of ``--repeats`` calls after one warm-up). Reports the median
over rounds per case and the ratio new / base. Writes ``results/synthesis_ab.json``.

    git worktree add ../autotp-base <commit>
    python benchmarks/bench_synthesis_ab.py --base ../autotp-base [--rounds 3 --repeats 3]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "synthesis_ab.json"
CASES = [("llama-8b", 2, False), ("llama-8b", 80, False), ("llama-8b", 2, True), ("llama-70b-tp16", 2, False),
         ("phi3-mini", 2, False)]

CHILD = r"""
import json, statistics, sys, time, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, {bench!r})
from bench_synthesis import SHAPES, build
from autotp.synth import synthesize
out = {{}}
for name, layers, sp in {cases!r}:
    model = build(name, layers)
    tp = SHAPES[name][3]
    synthesize(model, tp_size=tp, sequence_parallel=sp)  # warm-up
    times = []
    for _ in range({repeats}):
        start = time.perf_counter()
        synthesize(model, tp_size=tp, sequence_parallel=sp)
        times.append(time.perf_counter() - start)
    out[f"{{name}}/{{layers}}L/{{'sp' if sp else 'plain'}}"] = statistics.median(times)
print(json.dumps(out))
"""


def run_side(tree: Path, repeats: int) -> dict[str, float]:
    code = CHILD.format(bench=str(HERE), cases=CASES, repeats=repeats)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    return json.loads(done.stdout.strip().splitlines()[-1])


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the other commit's tree (a git worktree)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    new_tree, base_tree = HERE.parent, Path(args.base).resolve()
    started = time.time()
    samples: dict[str, dict[str, list[float]]] = {"new": {}, "base": {}}
    for round_ in range(args.rounds):
        for side, tree in (("base", base_tree), ("new", new_tree)) if round_ % 2 else (("new", new_tree), ("base", base_tree)):
            for case, seconds in run_side(tree, args.repeats).items():
                samples[side].setdefault(case, []).append(seconds)
        print(f"round {round_ + 1}/{args.rounds} done", flush=True)
    rows = {}
    for case in samples["new"]:
        new, base = statistics.median(samples["new"][case]), statistics.median(samples["base"][case])
        rows[case] = {"new_s": round(new, 4), "base_s": round(base, 4), "ratio": round(new / base, 3)}
        print(f"{case:28s} new {new:.3f} s  base {base:.3f} s  ratio {new / base:.3f}")
    base_commit = subprocess.run(["git", "-C", str(base_tree), "rev-parse", "--short", "HEAD"],
                                 capture_output=True, text=True).stdout.strip()
    RESULTS.write_text(json.dumps({
        "command": "python benchmarks/bench_synthesis_ab.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "wall_s": round(time.time() - started, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "base_commit": base_commit,
        "rounds": args.rounds, "repeats": args.repeats, "cases": rows, "samples": samples}, indent=1) + "\n")


if __name__ == "__main__":
    main()
