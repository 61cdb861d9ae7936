"""``parallelize``'s start-up (choosing and checking the plan, then sharding) beside ``synthesize``.

For each tiny model (2 layers, random weights, CPU) and tp size, a child process per tree times,
as medians of ``--runs`` calls after one warm-up of each:

- ``synthesize``: ``autotp.synthesize(model, tp_size=tp)`` alone;
- ``decide``: what ``parallelize`` decides before it shards, in this process without a mesh:
  ``get_plan`` and, for a synthesized winner, ``self_check`` (in process);
- ``base``: with ``--base TREE``, the same ``decide`` of that tree (an extracted commit): the
  start-up before this change (that tree's ``parallelize`` cannot be timed on simulated ranks: its
  selection traced under the simulation, which fails on transformers models);
- ``cold``: ``autotp.parallelize(copy, mesh)`` on simulated ranks with an empty plan cache
  (selection, the self-check of a synthesized winner in a child interpreter, as under a real
  process group, then sharding);
- ``cached``: the same with the cache that a first call filled (reading the plan, sharding).

A mode that fails is recorded with its error.
Prints the table and writes ``results/startup.json`` and ``results/startup.md``. Wall-clock times on
a shared machine carry its load: the CPU time of the process (``cpu`` columns, which leave out the
self-check's child) is printed beside them.

    git archive <commit> | tar -x -C ../autotp-base
    python benchmarks/startup.py [--base ../autotp-base] [--runs 3] [--models llama olmo2] [--tp 2 8]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import subprocess
import sys
import time
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results"

CHILD = r"""
import copy, json, os, statistics, sys, tempfile, time, warnings
warnings.simplefilter("ignore")
import autotp
from autotp import _simulate
from autotp.models import build_model
assert autotp.__file__.startswith({tree!r}), autotp.__file__
modes, runs = {modes!r}, {runs}

def timed(function):
    wall, cpu = time.perf_counter(), time.process_time()
    function()
    return time.perf_counter() - wall, time.process_time() - cpu

def median(function):
    function()  # warm-up
    samples = [timed(function) for _ in range(runs)]
    return [statistics.median(s[0] for s in samples), statistics.median(s[1] for s in samples)]

def parallelize(model, tp, **options):
    with _simulate.simulated_mesh(tp) as mesh:
        return autotp.parallelize(copy.deepcopy(model), mesh, **options)

def decide(model, tp):  # what parallelize decides before sharding, in this process, without a mesh
    choice = autotp.get_plan(model, tp_size=tp)
    if choice.source == "synthesized":
        from autotp.self_check import self_check
        self_check(model, choice.plan, tp_size=tp)

def fresh_cache():
    os.environ["AUTOTP_CACHE_DIR"] = tempfile.mkdtemp(prefix="autotp-startup-")

out = {{}}
for name in {models!r}:
    for tp in {tps!r}:
        model = build_model(name, tiny=True, tp=tp, device="cpu")
        row = {{"source": autotp.get_plan(model, tp_size=tp).source}}
        for mode in modes:
            try:
                if mode == "synthesize":
                    row[mode] = median(lambda: autotp.synthesize(model, tp_size=tp))
                elif mode in ("decide", "base"):
                    row[mode] = median(lambda: decide(model, tp))
                elif mode == "cold":
                    row[mode] = median(lambda: (fresh_cache(), parallelize(model, tp)))
                elif mode == "cached":
                    fresh_cache()
                    row[mode] = median(lambda: parallelize(model, tp))
            except Exception as error:
                row[mode + "_error"] = f"{{type(error).__name__}}: {{str(error)[:200]}}"
        out[f"{{name}} tp={{tp}}"] = row
        print(json.dumps({{f"{{name}} tp={{tp}}": row}}), file=sys.stderr, flush=True)
print(json.dumps(out))
"""


def run_side(tree: Path, modes: list[str], models: list[str], tps: list[int], runs: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = CHILD.format(tree=str(tree), modes=modes, models=models, tps=tps, runs=runs)
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"{tree}: child failed (its stderr is above)")
    return json.loads(done.stdout.strip().splitlines()[-1])


def table(rows: dict) -> list[str]:
    columns = [c for c in ("synthesize", "decide", "base", "cold", "cached") if any(c in r for r in rows.values())]
    head = " | ".join(f"{c} s (cpu)" for c in columns)
    lines = [f"| model | plan source | {head} |", "| --- | --- | " + " | ".join("---" for _ in columns) + " |"]
    for case, row in rows.items():
        cells = " | ".join(f"{row[c][0]:.2f} ({row[c][1]:.2f})" if c in row else "" for c in columns)
        source = row["source"] + (f" (base: {row['base_source']})" if row.get("base_source", row["source"]) != row["source"]
                                  else "")
        lines.append(f"| {case} | {source} | {cells} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, default=None, help="a tree to time parallelize of, for comparison")
    parser.add_argument("--runs", type=int, default=3)
    parser.add_argument("--models", nargs="*", default=["llama", "qwen3", "olmo2"])
    parser.add_argument("--tp", nargs="*", type=int, default=[2, 8])
    args = parser.parse_args()
    start = time.time()
    rows = run_side(ROOT, ["synthesize", "decide", "cold", "cached"], args.models, args.tp, args.runs)
    (RESULTS / "startup.json").write_text(json.dumps({"rows": rows}, indent=2))  # kept if the base side fails
    if args.base is not None:
        base = run_side(args.base.resolve(), ["base"], args.models, args.tp, args.runs)
        for case, row in base.items():
            rows[case].update({key: value for key, value in row.items() if key.startswith("base")})
            rows[case]["base_source"] = row["source"]
    lines = table(rows)
    print("\n".join(lines))
    load = os.getloadavg() if hasattr(os, "getloadavg") else None
    meta = {"command": " ".join(sys.argv), "runs": args.runs, "machine": platform.node(), "cpus": os.cpu_count(),
            "load_average_at_end": load, "seconds": round(time.time() - start, 1),
            "python": platform.python_version()}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "startup.json").write_text(json.dumps({"meta": meta, "rows": rows}, indent=2))
    header = [
        "# parallelize start-up against synthesize", "",
        f"`{meta['command']}`: medians of {args.runs} calls, wall seconds (this process's CPU seconds), tiny "
        f"models (2 layers) on simulated ranks, {meta['seconds']} s in all on {meta['machine']} ({meta['cpus']} "
        f"cores, load average {load} at the end: a shared, contended machine). `cold`: empty plan cache; "
        "`cached`: the cache a first call filled; `decide`: get_plan + the self-check of a synthesized winner, in "
        "process, no mesh; `base`: the same decision in the tree given as --base (its parallelize fails on "
        "simulated ranks); `cold` and `cached` include the sharding, and `cold` the self-check's child "
        "interpreter (not in the cpu figure).", ""]
    (RESULTS / "startup.md").write_text("\n".join(header + lines) + "\n")


if __name__ == "__main__":
    main()
