"""One training-mode step of every verified synthesized plan, with dropout live.

The verifier compares logits and every gradient in eval mode, where dropout is an identity. A
training step differs: each dropout draws a mask, and DTensor refuses to draw one on a ``Partial()``
value (a parallel block's branch passing through dropout before the sum crashed that way). This
runs, for each case the coverage sweep verified (``coverage.json``; the same tiny model, heads and
layer pattern), one training-mode forward and backward of the synthesized plan with every dropout
probability of the config at 0.1 (none where the config refuses dropout), on simulated ranks, and records whether it ran and whether every
rank holds the same logits (a replicated value drawn with a different mask per rank would not).

Each lane of cases runs in a child process; a case that kills its child (an abort in a kernel) is
recorded as such and the lane goes on in a new child.

Usage::

    python benchmarks/train_step.py                     # tp 2, plain and SP, 2 lanes
    python benchmarks/train_step.py --only gptj,phi --tp 2,4
    python benchmarks/train_step.py --only diffllama --update   # re-run some types in train_step.json

Writes ``benchmarks/results/train_step.json`` and prints the cases that did not run.
"""

from __future__ import annotations

import argparse
import json
import os
import signal
import subprocess
import sys
import time
import warnings
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
RESULTS = ROOT / "benchmarks" / "results"
DROPOUT = 0.1


def _cases(coverage: Path, only: set[str] | None, tps: set[int]) -> list[dict]:
    cases = json.loads(coverage.read_text())["cases"]
    return [{"model_type": c["model_type"], "tp": c["tp"], "sp": c["sp"],
             "heads_for": c.get("shrunk_heads_for_tp", c["tp"]), "repeat": c.get("layer_pattern_repeated", 1)}
            for c in cases if c.get("synth", {}).get("status") == "verified" and c["tp"] in tps
            and (only is None or c["model_type"] in only)]


def run_step(case: dict) -> dict:
    """Build, synthesize and run one training step on simulated ranks; never raises."""
    import copy

    import torch

    from autotp import _simulate, synthesize
    from autotp.apply import apply_plan
    from autotp.verifier import call_model, default_inputs
    from coverage import _tiny_model

    out = dict(case)
    start = time.perf_counter()
    try:
        try:
            model = _tiny_model(case["model_type"], case["heads_for"], case["repeat"], dropout=DROPOUT)
        except ValueError as error:  # a config that refuses dropout (DiffLlama's attention): none, still training mode
            out["dropout_refused"] = str(error)[:200]
            model = _tiny_model(case["model_type"], case["heads_for"], case["repeat"])
        model.eval()
        plan = synthesize(model, sequence_parallel=case["sp"], tp_size=case["tp"], verify=False)
        out["live_dropouts"] = sum(1 for m in model.modules() if isinstance(m, torch.nn.Dropout) and m.p > 0)
        inputs = default_inputs(model, case["tp"])
        sharded = copy.deepcopy(model).train()
        with _simulate.simulated_mesh(case["tp"]) as mesh:
            apply_plan(sharded, mesh, plan)
            output = call_model(sharded, inputs)
            logits = getattr(output, "logits", output[0] if isinstance(output, tuple) else output)
            whole = logits.full_tensor() if hasattr(logits, "full_tensor") else logits
            whole.float().square().mean().backward()
            ranks = _simulate.per_rank(whole.detach(), case["tp"])
        agree = all(torch.equal(ranks[0], r) for r in ranks[1:])
        out["status"] = "ran" if agree else "ranks-disagree"
    except Exception as error:
        out["status"], out["error"] = "crashed", f"{type(error).__name__}: {str(error)[:400]}"
    out["seconds"] = round(time.perf_counter() - start, 2)
    return out


def _child(path: Path, cases: list[dict], timeout: float) -> None:
    import logging

    import torch

    sys.path[:0] = [str(ROOT), str(ROOT / "benchmarks"), str(ROOT / "tests")]
    torch.set_num_threads(1)
    warnings.simplefilter("ignore")
    logging.disable(logging.WARNING)

    def late(signum, frame):
        raise TimeoutError(f"past {timeout:.0f} s")

    signal.signal(signal.SIGALRM, late)
    with path.open("a") as log:
        for case in cases:
            log.write(json.dumps({"start": case}) + "\n")
            log.flush()
            signal.alarm(int(timeout))
            result = run_step(case)
            signal.alarm(0)
            log.write(json.dumps({"done": result}) + "\n")
            log.flush()


def _lane(path: Path, cases: list[dict], timeout: float) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, __file__, "--child", str(path), "--timeout", str(timeout)],
                            stdin=subprocess.PIPE, text=True)


def _read(path: Path) -> tuple[list[dict], dict | None]:
    done, started = [], None
    for line in path.read_text().splitlines() if path.exists() else []:
        entry = json.loads(line)
        if "start" in entry:
            started = entry["start"]
        else:
            done.append(entry["done"])
            started = None
    return done, started


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--only", help="comma-separated model types (default: every verified one)")
    parser.add_argument("--tp", default="2", help="comma-separated tp sizes")
    parser.add_argument("--lanes", type=int, default=2)
    parser.add_argument("--timeout", type=float, default=300.0, help="seconds per case")
    parser.add_argument("--coverage", default=str(RESULTS / "coverage.json"))
    parser.add_argument("--out", default=str(RESULTS / "train_step.json"))
    parser.add_argument("--update", action="store_true",
                        help="replace only the --only types' cases in an existing --out")
    parser.add_argument("--child", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.child:
        _child(Path(args.child), json.loads(sys.stdin.read()), args.timeout)
        return
    only = set(args.only.split(",")) if args.only else None
    cases = _cases(Path(args.coverage), only, {int(t) for t in args.tp.split(",")})
    work = Path(args.out).with_suffix(f".lanes-{os.getpid()}")  # one per run: two runs never share a lane
    work.mkdir(exist_ok=True)
    start = time.perf_counter()
    lanes = {i: (work / f"lane{i}.jsonl", cases[i::args.lanes]) for i in range(args.lanes)}
    for path, _ in lanes.values():
        path.unlink(missing_ok=True)
    results: list[dict] = []
    pending = dict(lanes)
    while pending:
        procs = {}
        for i, (path, todo) in pending.items():
            procs[i] = _lane(path, todo, args.timeout)
            procs[i].stdin.write(json.dumps(todo))
            procs[i].stdin.close()
        for proc in procs.values():
            proc.wait()
        again = {}
        for i, (path, todo) in pending.items():
            done, started = _read(path)
            finished = {(d["model_type"], d["tp"], d["sp"]) for d in done}
            if started is not None:  # the child died inside this case
                results.append({**started, "status": "crashed", "error": f"child exited {procs[i].returncode}"})
                finished.add((started["model_type"], started["tp"], started["sp"]))
                path.write_text("")
            rest = [c for c in todo if (c["model_type"], c["tp"], c["sp"]) not in finished]
            results += done
            if rest and started is not None:
                again[i] = (path, rest)
        pending = again
    if args.update and Path(args.out).exists():
        kept = [r for r in json.loads(Path(args.out).read_text())["cases"] if only is None or r["model_type"] not in only]
        results += kept
    results.sort(key=lambda r: (r["model_type"], r["tp"], r["sp"]))
    import torch
    import transformers

    summary = {status: sum(r["status"] == status for r in results) for status in ("ran", "ranks-disagree", "crashed")}
    Path(args.out).write_text(json.dumps({
        "meta": {"dropout": DROPOUT, "cases": len(results), "seconds": round(time.perf_counter() - start, 1),
                 "torch": torch.__version__, "transformers": transformers.__version__,
                 "coverage": Path(args.coverage).name, "date": time.strftime("%Y-%m-%d %H:%M UTC", time.gmtime())},
        "summary": summary, "cases": results}, indent=1) + "\n")
    for path, _ in lanes.values():
        path.unlink(missing_ok=True)
    work.rmdir()
    print(json.dumps(summary))
    for r in results:
        if r["status"] != "ran":
            print(f"{r['model_type']} tp{r['tp']} {'SP' if r['sp'] else 'plain'}: {r['status']} {r.get('error', '')[:300]}")


if __name__ == "__main__":
    main()
