"""Which plan auto selection hands out for every built-in model at tp 2, before and after a change.

For each built-in name (``autotp.models.builtin_names()``) a child process per side builds the
real-size model on the meta device (bfloat16, as ``autotp plan`` does), calls
``autotp.get_plan(model, tp_size=2)`` and reads the chosen source and its parameters per rank over
the model's (:func:`autotp.memory.param_bytes_per_rank`). The base side runs another tree (an
extracted commit: ``PYTHONPATH`` set to it); the new side runs this checkout. Prints the table and
writes ``results/selection_changes.json`` and ``results/selection_changes.md``; where the new side
says which sources it considered (``PlanChoice.considered``), the table shows that too.

    git archive <commit> | tar -x -C ../autotp-base
    python benchmarks/selection_changes.py --base ../autotp-base [--tp 2] [--only llama mixtral]
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
import json, sys, time, warnings
warnings.simplefilter("ignore")
import torch
import autotp
from autotp import get_plan, models
from autotp.memory import param_bytes_per_rank
assert autotp.__file__.startswith({tree!r}), autotp.__file__
out = {{}}
for name in {names!r}:
    start = time.perf_counter()
    model = models.build_model(models.load_config(name), dtype=torch.bfloat16)
    try:
        choice = get_plan(model, tp_size={tp})
    except Exception as error:
        out[name] = {{"error": f"{{type(error).__name__}}: {{str(error)[:160]}}"}}
        continue
    per_rank, total = param_bytes_per_rank(model, choice.plan, {tp})
    row = {{"source": choice.source, "fraction": per_rank / total, "seconds": time.perf_counter() - start}}
    considered = getattr(choice, "considered", None)
    if considered is not None:
        row["considered"] = [[c.source, c.fraction, c.collective_bytes, c.verdict] for c in considered]
        row["why"] = choice.why
    out[name] = row
print(json.dumps(out))
"""


def run_side(tree: Path, names: list[str], tp: int) -> dict:
    env = {**os.environ, "PYTHONPATH": str(tree)}
    code = CHILD.format(tree=str(tree), names=names, tp=tp)
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, capture_output=True, text=True)
    if done.returncode:
        raise SystemExit(f"{tree}: child failed:\n{done.stderr[-3000:]}")
    return json.loads(done.stdout.strip().splitlines()[-1])


def cell(row: dict) -> str:
    return row["error"][:60] if "error" in row else f"{row['source']} {row['fraction']:.3f}"


def table(names: list[str], old: dict, new: dict) -> list[str]:
    lines = ["| model | old: source, params/rank | new: source, params/rank | why (new) |", "| --- | --- | --- | --- |"]
    for name in names:
        changed = " (changed)" if cell(old[name]) != cell(new[name]) else ""
        lines.append(f"| {name} | {cell(old[name])} | {cell(new[name])}{changed} | {new[name].get('why', '')} |")
    return lines


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the tree to compare with (an extracted commit), or a JSON file of its side saved before")
    parser.add_argument("--base-label", default=None, help="what the base side is, for the result (e.g. a commit)")
    parser.add_argument("--new", type=Path, default=None, help="a JSON file of this side saved before (its 'new')")
    parser.add_argument("--tp", type=int, default=2)
    parser.add_argument("--only", nargs="*", default=None, help="built-in names (default: all)")
    args = parser.parse_args()
    sys.path.insert(0, str(ROOT))
    from autotp import models

    names = args.only or models.builtin_names()
    start = time.time()
    if args.base.suffix == ".json":  # a saved base side: {"old": {...}} from an earlier run, or the bare dict
        saved = json.loads(args.base.read_text())
        old = saved.get("old", saved)
    else:
        old = run_side(args.base.resolve(), names, args.tp)
    saved = json.loads(args.new.read_text()) if args.new else None
    new = saved["new"] if saved else run_side(ROOT, names, args.tp)
    lines = table(names, old, new)
    print("\n".join(lines))
    meta = {"command": " ".join(sys.argv), "tp": args.tp, "base": args.base_label or str(args.base),
            "machine": platform.node(),
            "python": platform.python_version(),
            "seconds": saved["meta"]["seconds"] if saved else round(time.time() - start, 1)}
    RESULTS.mkdir(exist_ok=True)
    (RESULTS / "selection_changes.json").write_text(json.dumps({"meta": meta, "old": old, "new": new}, indent=2))
    header = [f"# Auto selection at tp={args.tp}: old against new", "",
              f"`{meta['command']}` ({meta['seconds']} s on {meta['machine']}, a shared 2-core machine). Old: "
              f"{meta['base']}. Parameters per rank are over the model's (bfloat16, real-size configs on meta); "
              "collectives are the static estimate of autotp.cost, per token of a step, all layers.", ""]
    (RESULTS / "selection_changes.md").write_text("\n".join(header + lines) + "\n")


if __name__ == "__main__":
    main()
