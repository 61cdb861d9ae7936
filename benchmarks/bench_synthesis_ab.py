"""Synthesis time of this checkout against another commit's, side by side in one run.

Each round runs one child process per side (``PYTHONPATH`` set to that side's tree), alternating
A, B, A, B, ...; each child times ``synthesize`` on meta-device configs of
:mod:`bench_synthesis` (the median of ``--repeats`` calls after one warm-up). Reports the median
over rounds per case and the ratio new / base (and the ratio of the fastest rounds), in wall time and in the child's CPU time
(``time.process_time``: on a machine shared with other work, wall time also counts the waits for a
core, CPU time much less). Writes ``results/synthesis_ab.json``.

Each child runs in its side's tree and checks that ``autotp`` was imported from there: ``python -c``
puts the working directory first on ``sys.path``, so a child started from this checkout would
otherwise time this checkout's code on both sides (and the editable install points here too).

    git worktree add ../autotp-base <commit>     # or: git archive <commit> | tar -x -C DIR; echo <commit> > DIR/COMMIT
    python benchmarks/bench_synthesis_ab.py --base ../autotp-base [--new ../autotp-head] [--rounds 3 --repeats 3]
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
import autotp
from autotp.synth import synthesize
out = {{"autotp": autotp.__file__}}
for name, layers, sp in {cases!r}:
    model = build(name, layers)
    tp = SHAPES[name][3]
    synthesize(model, tp_size=tp, sequence_parallel=sp, verify=False)  # warm-up
    wall, cpu = [], []
    for _ in range({repeats}):
        start, start_cpu = time.perf_counter(), time.process_time()
        synthesize(model, tp_size=tp, sequence_parallel=sp, verify=False)
        wall.append(time.perf_counter() - start)
        cpu.append(time.process_time() - start_cpu)
    case = f"{{name}}/{{layers}}L/{{'sp' if sp else 'plain'}}"
    out[case], out[case + " cpu"] = statistics.median(wall), statistics.median(cpu)
print(json.dumps(out))
"""


def run_side(tree: Path, repeats: int) -> dict[str, float]:
    code = CHILD.format(bench=str(HERE), cases=CASES, repeats=repeats)
    env = {**os.environ, "PYTHONPATH": str(tree)}
    done = subprocess.run([sys.executable, "-c", code], env=env, cwd=tree, capture_output=True, text=True,
                          check=True)
    out = json.loads(done.stdout.strip().splitlines()[-1])
    imported = Path(out.pop("autotp")).resolve()
    if not imported.is_relative_to(tree):
        raise SystemExit(f"the child for {tree} imported autotp from {imported}, not from that tree")
    return out


def _git(tree: Path, *args: str) -> str:
    """``git args`` in ``tree``; for a tree that is no checkout (``git archive`` output), the text of
    its ``COMMIT`` file if it has one, else its folder name."""
    done = subprocess.run(["git", "-C", str(tree), *args], capture_output=True, text=True)
    if done.returncode == 0:
        return done.stdout.strip()
    marker = Path(tree) / "COMMIT"
    return marker.read_text().strip() if marker.exists() else Path(tree).name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--base", required=True, help="the other commit's tree (a git worktree)")
    parser.add_argument("--new", default=str(HERE.parent), help="the tree to time as new (default: this checkout)")
    parser.add_argument("--rounds", type=int, default=3)
    parser.add_argument("--repeats", type=int, default=3)
    args = parser.parse_args()
    new_tree, base_tree = Path(args.new).resolve(), Path(args.base).resolve()
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
        # The fastest round of each side too: load on a shared machine only adds time, so the
        # minima compare the code where the medians still carry the machine's swings.
        fastest_new, fastest_base = min(samples["new"][case]), min(samples["base"][case])
        rows[case] = {"new_s": round(new, 4), "base_s": round(base, 4), "ratio": round(new / base, 3),
                      "min_ratio": round(fastest_new / fastest_base, 3)}
        print(f"{case:32s} new {new:.3f} s  base {base:.3f} s  ratio {new / base:.3f}  "
              f"(fastest rounds: {fastest_new:.3f} / {fastest_base:.3f} = {fastest_new / fastest_base:.3f})")
    RESULTS.write_text(json.dumps({
        "command": "python benchmarks/bench_synthesis_ab.py " + " ".join(sys.argv[1:]),
        "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime()), "wall_s": round(time.time() - started, 1),
        "machine": f"{platform.machine()}, {os.cpu_count()} cores", "base_commit": _git(base_tree, "rev-parse", "--short", "HEAD"),
        "new_commit": _git(new_tree, "rev-parse", "--short", "HEAD"),
        "new_tree_dirty": bool(_git(new_tree, "status", "--porcelain", "--untracked-files=no")),
        "rounds": args.rounds, "repeats": args.repeats, "cases": rows, "samples": samples}, indent=1) + "\n")


if __name__ == "__main__":
    main()
