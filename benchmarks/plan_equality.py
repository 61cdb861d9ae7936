"""Are two trees' synthesized plans equal? The tp=2 synthesis matrix, key by key and option by option.

For a restructuring that must keep behaviour (issue 40, item 5): one child process per tree
(``PYTHONPATH`` set to it, checked) synthesizes every model of the tp=2 test matrix
(``tests/test_synth_matrix.py``: the transformers families and the plain-PyTorch toys), plain and
sequence parallel, and writes each plan as ``{key: repr(style)}``; a style's repr carries its
class and every option. The models come from this checkout's ``tests/`` (they import nothing of
autotp), so both sides plan the same modules. A case that raises records its error.

Styles are compared as :func:`style_renames.canonical` writes them: the base's old spellings of the
styles issue 40 folded (``PackedColwiseParallel(sizes=...)``, ``ReplicatedOutput()``, ...) in the new
names (``Colwise(sizes=...)``, ``Boundary(outputs='replicate')``), options sorted; a style whose
options or layouts differ still differs.

Prints the cases that differ (keys only on one side, styles that differ) and writes
``results/plan_equality.json``. Exit status 1 when any case differs.

    mkdir ../autotp-base && git archive <commit> | tar -x -C ../autotp-base
    python benchmarks/plan_equality.py --base ../autotp-base [--new .]
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path

from style_renames import canonical

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
RESULTS = HERE / "results" / "plan_equality.json"

# The start of a child's script (a ``str.format`` template: ``tests``, ``tree``): this checkout's test
# models importable, one thread, and ``autotp`` checked to be the tree's.
PREAMBLE = r"""
import inspect, json, sys, warnings
warnings.simplefilter("ignore")
sys.path.insert(0, {tests!r})
import torch
torch.set_num_threads(1)
import autotp
assert autotp.__file__.startswith({tree!r}), autotp.__file__
"""

CHILD = PREAMBLE + r"""
from test_synth_matrix import FAMILIES, TOYS, _model
options = {{"verify": False}} if "verify" in inspect.signature(autotp.synthesize).parameters else {{}}
out = {{}}
for name in FAMILIES + list(TOYS):
    model, inputs = _model(name)
    for sp in (False, True):
        case = name + (" sp" if sp else "")
        try:
            extra = {{"example_inputs": inputs}} if inputs is not None else {{}}
            plan = autotp.synthesize(model, tp_size=2, sequence_parallel=sp, **extra, **options)
            out[case] = {{key: repr(style) for key, style in sorted(plan.items())}}
        except Exception as error:
            out[case] = {{"<error>": type(error).__name__ + ": " + str(error)[:300]}}
print(json.dumps(out))
"""


def plans_of(tree: Path) -> dict:
    return run_in_tree(tree, CHILD.format(tree=str(tree), tests=str(ROOT / "tests")))


def run_in_tree(tree: Path, code: str) -> dict:
    """The JSON that ``code`` prints last, run by a child whose ``autotp`` is the one in ``tree``."""
    env = {**os.environ, "PYTHONPATH": str(tree), "OMP_NUM_THREADS": "1", "AUTOTP_CACHE_DIR": "off"}
    done = subprocess.run([sys.executable, "-c", code], cwd=tree, env=env, stdout=subprocess.PIPE, text=True)
    if done.returncode:
        raise SystemExit(f"{tree}: child failed (its stderr is above)")
    return json.loads(done.stdout.strip().splitlines()[-1])


def differences(base: dict, new: dict) -> dict:
    out = {}
    for case in sorted(set(base) | set(new)):
        old, now = _canonical(base.get(case, {})), _canonical(new.get(case, {}))
        diff = {key: {"base": old.get(key), "new": now.get(key)}
                for key in sorted(set(old) | set(now)) if old.get(key) != now.get(key)}
        if diff:
            out[case] = diff
    return out


def _canonical(plan: dict) -> dict:
    return {key: canonical(text) if key != "<error>" else text for key, text in plan.items()}


def tree_name(tree: Path) -> str:
    """A tree as the commit its ``COMMIT`` file names (``git archive`` exports), else its folder name."""
    marker = tree / "COMMIT"
    return marker.read_text().strip() if marker.exists() else tree.resolve().name


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the tree before the change")
    parser.add_argument("--new", type=Path, default=ROOT, help="the tree after it (default: this checkout)")
    parser.add_argument("--out", type=Path, default=RESULTS)
    args = parser.parse_args()
    start = time.time()
    base, new = plans_of(args.base.resolve()), plans_of(args.new.resolve())
    diff = differences(base, new)
    keys = sum(len(plan) for plan in new.values())
    summary = (f"{len(new)} cases ({keys} plan keys): {len(new) - len(diff)} equal key by key and option by "
               f"option, {len(diff)} differ")
    for case, entries in diff.items():
        print(f"{case}:")
        for key, sides in entries.items():
            print(f"  {key}\n    base: {sides['base']}\n    new:  {sides['new']}")
    print(summary)
    args.out.parent.mkdir(exist_ok=True)
    args.out.write_text(json.dumps({"command": " ".join(sys.argv), "base": tree_name(args.base), "new": tree_name(args.new),
                                    "seconds": round(time.time() - start, 1), "summary": summary,
                                    "differences": diff, "new_plans": new}, indent=2))
    sys.exit(1 if diff else 0)


if __name__ == "__main__":
    main()
