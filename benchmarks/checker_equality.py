"""Does the checker judge two trees' plans alike where a style's declaration changed?

The second step of issue 40's fold gave two old styles new spellings whose declarations say more:
``OwnPositionsOutput`` -> ``Boundary(outputs="slice", output_grad="partial",
style=ReplicatedWithGradAllReduce())`` and ``ReducedInputGrads(partial_params=True)`` ->
``Boundary(inputs="reduce_grad", style=ReplicatedWithGradAllReduce())`` now declare that their
parameters' gradients are reduced (the old classes reduced them without saying so;
``fold_equality.py`` shows values, gradients and collectives equal). A declared reduction can only
meet a requirement of the checker, never raise a finding; this runs ``check_plan`` in each tree on
the models whose synthesized plans use those styles (nanoGPT with learned positions under sequence
parallel, three forms; the side-input blocks of ``tests/test_side_inputs.py``), tp 2 and 4, and
compares the findings.

    python benchmarks/checker_equality.py --base ../autotp-s0

Writes ``results/checker_equality.json``; exit status 1 when any case differs.
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from plan_equality import PREAMBLE, run_in_tree, tree_name

HERE = Path(__file__).resolve().parent
RESULTS = HERE / "results" / "checker_equality.json"

CHILD = PREAMBLE + r"""
from autotp import check_plan
from autotp.synth import synthesize
import test_backward_comm as comm
import test_side_inputs as side
from synth_toy import example_tokens
out = {{}}
for form in ("(t, d)", "(1, t, d)", "scaled"):
    for tp in (2, 4):
        model = comm._nano_gpt_with_positions(form)
        plan = synthesize(model, example_inputs=(example_tokens(),), sequence_parallel=True, tp_size=tp, verify=False)
        findings = check_plan(model, plan, tp_size=tp, example_inputs=(example_tokens(),))
        out[f"positions {{form}} tp {{tp}}"] = {{"style": repr(plan.get("wpe")), "findings": [str(f) for f in findings]}}
for name, make in (("side input, 3 layers", lambda: side.SideInputModel(3)),
                   ("copied side, 3 layers", lambda: side.CopiedSideModel(3, copy=True)),
                   ("copied side, 1 layer", lambda: side.CopiedSideModel(1, copy=True))):
    for tp in (2, 4):
        model = make()
        plan = side._plan(model, tp)
        findings = check_plan(model, plan, tp_size=tp, example_inputs=(side._tokens(),))
        styles = sorted(repr(s) for s in plan.values() if "reduce_grad" in repr(s) or "ReducedInputGrads" in repr(s))
        out[f"{{name}} tp {{tp}}"] = {{"style": "; ".join(styles), "findings": [str(f) for f in findings]}}
print(json.dumps(out))
"""


def records(tree: Path) -> dict:
    return run_in_tree(tree, CHILD.format(tree=str(tree), tests=str(HERE.parent / "tests")))


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--base", type=Path, required=True, help="the tree before the fold")
    parser.add_argument("--new", type=Path, default=HERE.parent, help="the tree after it (default: this checkout)")
    args = parser.parse_args()
    start = time.time()
    old, new = records(args.base.resolve()), records(args.new.resolve())
    differ = sorted(case for case in new if old.get(case, {}).get("findings") != new[case]["findings"])
    for case, record in new.items():
        status = "differ" if case in differ else "equal"
        print(f"{case:28s} findings {len(old.get(case, {}).get('findings', []))} -> {len(record['findings'])}: "
              f"{status}  ({old.get(case, {}).get('style')} -> {record['style']})")
    summary = f"{len(new)} cases: the checker's findings {len(new) - len(differ)} equal, {len(differ)} differ"
    print(summary)
    RESULTS.parent.mkdir(exist_ok=True)
    RESULTS.write_text(json.dumps({"command": " ".join(sys.argv), "base": tree_name(args.base), "summary": summary,
                                   "seconds": round(time.time() - start, 1), "base_records": old,
                                   "new_records": new}, indent=1))
    sys.exit(1 if differ else 0)


if __name__ == "__main__":
    main()
