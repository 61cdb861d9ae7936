"""Long fuzz profile: random Llama-family configs x tp in {2, 4, 8}, plain and sequence parallel.

Each case: synthesize, check_plan (expect no finding), verify (logits and grads within 1e-5).
Records every case and its outcome in ``benchmarks/results/fuzz.json``.

    python benchmarks/fuzz.py --examples 40
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from pathlib import Path

from hypothesis import HealthCheck, given, settings

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from autotp.errors import one_line  # noqa: E402
from fuzz_configs import llama_family_case  # noqa: E402
from test_fuzz import check_case  # noqa: E402


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=40)
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/fuzz.json"))
    args = parser.parse_args()
    cases = []

    @settings(max_examples=args.examples, deadline=None, database=None,
              suppress_health_check=list(HealthCheck))
    @given(llama_family_case())
    def run(case):
        model_type, options, tp = case
        for sequence_parallel in (False, True):
            start = time.perf_counter()
            try:
                check_case(model_type, options, tp, sequence_parallel)
                outcome = "ok"
            except Exception as error:  # recorded, the sweep goes on
                outcome = one_line(error)
            cases.append(dict(model_type=model_type, tp=tp, sp=sequence_parallel, outcome=outcome,
                              seconds=round(time.perf_counter() - start, 2),
                              config={k: v for k, v in options.items() if k != "rope_parameters"},
                              rope=options["rope_parameters"]["rope_type"]))
            print(f"{len(cases):4d} {model_type:8s} tp={tp} sp={sequence_parallel!s:5s} {outcome}", flush=True)

    began = time.perf_counter()
    run()
    passed = sum(c["outcome"] == "ok" for c in cases)
    summary = dict(cases=len(cases), passed=passed, failed=len(cases) - passed,
                   command=f"python benchmarks/fuzz.py --examples {args.examples}",
                   wall_s=round(time.perf_counter() - began, 1), date=time.strftime("%Y-%m-%d"))
    Path(args.out).write_text(json.dumps(dict(summary=summary, cases=cases), indent=1))
    print(f"{passed}/{len(cases)} passed; wrote {args.out}")


if __name__ == "__main__":
    main()
