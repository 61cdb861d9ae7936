"""The checker's findings at two commits, side by side: the same plans, the same models.

Made for a change to how :func:`autotp.check_plan` reads styles (the styles' declarations in
place of class tests): the findings must not change. For each model type (tiny, as the coverage
sweep builds it) at each tp it checks the handwritten plan (if any), transformers' plan, the
synthesized plan (plain and SP), and broken variants of the synthesized plan that exercise the
finding kinds: each key dropped in turn, and every torch-style subclass replaced by the plain
``ColwiseParallel()`` / ``RowwiseParallel()`` (packed sizes and kv repeats lost).

The plans are made once, by the working tree; both trees check them (``--base`` is exported with
``git archive`` to a temporary folder and imported first on ``sys.path`` there). Prints the cases
whose findings differ and writes ``results/checker_ab.json``.

    python benchmarks/checker_ab.py --base HEAD~1 [--types llama qwen3 ...] [--tp 2 4]
"""

from __future__ import annotations

import argparse
import json
import os
import pickle
import subprocess
import sys
import tempfile
import time
import warnings
from pathlib import Path

HERE = Path(__file__).resolve().parent
ROOT = HERE.parent
TYPES = ["llama", "qwen3", "gemma3", "phi3", "gpt2", "mixtral", "qwen3_moe", "deepseek_v3", "falcon_h1",
         "bamba", "zamba2", "olmo2", "gpt_neox", "qwen3_5", "granitemoehybrid", "gemma"]


def _variants(plan: dict) -> dict[str, dict]:
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    out = {f"drop {key}": {k: v for k, v in plan.items() if k != key} for key in plan}
    plain = {k: ColwiseParallel() if type(v) is not ColwiseParallel and isinstance(v, ColwiseParallel) else
             RowwiseParallel() if type(v) is not RowwiseParallel and isinstance(v, RowwiseParallel) else v
             for k, v in plan.items()}
    if any(plain[k] is not plan[k] for k in plan):
        out["plain torch styles"] = plain
    return out


def make_cases(types: list[str], tps: list[int]) -> list[tuple]:
    """(type, tp, label, plan) for every plan checked; the models are rebuilt by the checker run."""
    import autotp
    import handwritten_plans
    from autotp.hf_plans import hf_plan

    sys.path.insert(0, str(HERE))
    from coverage import _tiny_model

    cases = []
    for name in types:
        for tp in tps:
            model = _tiny_model(name, tp)
            hand = handwritten_plans.plan_for(model)
            if hand:
                cases.append((name, tp, "handwritten", hand))
            try:
                hf = hf_plan(model)
            except Exception:  # noqa: BLE001 - a type without transformers' plan
                hf = None
            if hf:
                cases.append((name, tp, "transformers", hf))
            for sp in (False, True):
                try:
                    plan = autotp.synthesize(model, tp_size=tp, sequence_parallel=sp, verify=False)
                except Exception as error:  # noqa: BLE001 - recorded, not compared
                    print(f"{name} tp{tp}: no synthesized plan ({type(error).__name__})", flush=True)
                    continue
                cases.append((name, tp, f"synthesized{' sp' if sp else ''}", plan))
                if not sp and tp == tps[0]:
                    cases += [(name, tp, f"synthesized, {label}", p) for label, p in _variants(plan).items()]
    return cases


def check_cases(path: str) -> dict[str, list[str]]:
    """Findings of each case in the pickle at ``path`` (run inside the tree under test)."""
    from autotp.check import check_plan

    sys.path.insert(0, str(HERE))
    from coverage import _tiny_model

    with open(path, "rb") as f:
        cases = pickle.load(f)
    out, models = {}, {}
    for name, tp, label, plan in cases:
        model = models.setdefault((name, tp), _tiny_model(name, tp))
        try:
            found = sorted(str(f) for f in check_plan(model, plan, tp_size=tp))
        except Exception as error:  # noqa: BLE001 - a refusal is an answer too
            found = [f"raised {type(error).__name__}: {str(error).splitlines()[0][:200]}"]
        out[f"{name} tp{tp} {label}"] = found
    return out


def _run_in(tree: Path, cases: str, out: str) -> float:
    env = {**os.environ, "PYTHONPATH": f"{tree}{os.pathsep}{tree / 'benchmarks'}", "AUTOTP_CACHE_DIR": tempfile.mkdtemp()}
    start = time.perf_counter()
    code = (f"import json, sys; sys.path.insert(0, {str(tree)!r}); sys.path.insert(0, {str(HERE)!r}); "
            f"import warnings; warnings.simplefilter('ignore'); from checker_ab import check_cases; "
            f"json.dump(check_cases({cases!r}), open({out!r}, 'w'))")
    subprocess.run([sys.executable, "-c", code], env=env, check=True, cwd=tree)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", required=True, help="the commit to compare the working tree with")
    parser.add_argument("--types", nargs="*", default=TYPES)
    parser.add_argument("--tp", nargs="*", type=int, default=[2, 4])
    args = parser.parse_args()
    warnings.simplefilter("ignore")
    tmp = Path(tempfile.mkdtemp())
    base = tmp / "base"
    base.mkdir()
    archive = subprocess.run(["git", "archive", args.base], cwd=ROOT, check=True, capture_output=True).stdout
    subprocess.run(["tar", "-x", "-C", str(base)], input=archive, check=True)
    (base / "benchmarks" / "checker_ab.py").write_text((HERE / "checker_ab.py").read_text())
    commit = subprocess.run(["git", "rev-parse", "--short", args.base], cwd=ROOT, check=True, capture_output=True,
                            text=True).stdout.strip()
    cases = make_cases(args.types, args.tp)
    with open(tmp / "cases.pkl", "wb") as f:
        pickle.dump(cases, f)
    seconds = {"base": _run_in(base, str(tmp / "cases.pkl"), str(tmp / "base.json")),
               "head": _run_in(ROOT, str(tmp / "cases.pkl"), str(tmp / "head.json"))}
    before, after = json.loads((tmp / "base.json").read_text()), json.loads((tmp / "head.json").read_text())
    differ = {case: {"base": before[case], "working tree": after[case]} for case in before if before[case] != after[case]}
    flagged = sum(bool(v) for v in after.values())
    summary = (f"{len(after)} plans checked at {commit} and in the working tree: {len(differ)} differ; "
               f"{flagged} with findings in both" if not differ else f"{len(differ)} of {len(after)} differ")
    print(summary)
    for case, pair in differ.items():
        print(case, json.dumps(pair, indent=1))
    (HERE / "results" / "checker_ab.json").write_text(json.dumps(
        {"command": " ".join(["python", "benchmarks/checker_ab.py", *sys.argv[1:]]), "base": commit,
         "tree": subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT, capture_output=True,
                                text=True).stdout.strip(),
         "summary": summary, "seconds": seconds, "differ": differ,
         "findings": {case: after[case] for case in after}}, indent=1))


if __name__ == "__main__":
    main()
