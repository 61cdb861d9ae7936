"""Fuzz profiles: random Llama-family configs, and random plain-PyTorch decoder blocks.

Configs (x tp in {2, 4, 8}, plain and sequence parallel): synthesize, check_plan (expect no
finding), verify (logits and grads within 1e-5). Blocks (:mod:`fuzz_blocks`: head-split idioms,
fused or separate projections, per-head parameters, tied or not) at tp 2 and 4: synthesize and
verify, or an ``AutoTPError`` refusal; a plan that runs and differs is counted ``silently_wrong``.
Records every case and its outcome in ``benchmarks/results/fuzz.json``.

    python benchmarks/fuzz.py --examples 40          # configs only
    python benchmarks/fuzz.py --long                 # >= 200 block cases and 20 configs
"""

from __future__ import annotations

import argparse
import json
import sys
import time
from collections import Counter
from pathlib import Path

from hypothesis import HealthCheck, given, settings

ROOT = Path(__file__).resolve().parents[1]
sys.path[:0] = [str(ROOT), str(ROOT / "tests")]

from autotp.errors import one_line  # noqa: E402
from fuzz_blocks import distinct_specs  # noqa: E402
from fuzz_configs import llama_family_case  # noqa: E402
from test_fuzz import block_outcome, check_case  # noqa: E402

LONG = {"block_specs": 100, "examples": 10}  # 100 specs x tp 2, 4 = 200 block cases


def _settings(examples: int):
    return settings(max_examples=examples, deadline=None, database=None, suppress_health_check=list(HealthCheck))


def run_configs(examples: int, cases: list) -> None:
    @_settings(examples)
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
            cases.append(dict(kind="config", model_type=model_type, tp=tp, sp=sequence_parallel, outcome=outcome,
                              seconds=round(time.perf_counter() - start, 2),
                              config={k: v for k, v in options.items() if k != "rope_parameters"},
                              rope=options["rope_parameters"]["rope_type"]))
            print(f"{len(cases):4d} {model_type:8s} tp={tp} sp={sequence_parallel!s:5s} {outcome}", flush=True)

    run()


def run_blocks(specs: int, cases: list, out: Path | None = None) -> None:
    for spec in distinct_specs(specs):
        for tp in (2, 4):
            start = time.perf_counter()
            try:
                result = block_outcome(spec, tp)
            except Exception as error:  # a crash outside synthesis and verify: counted, not hidden
                result = {"outcome": "error", "sharded": False, "detail": one_line(error), "findings": []}
            cases.append(dict(kind="block", tp=tp, spec=spec.as_dict(), **result,
                              seconds=round(time.perf_counter() - start, 2)))
            if out is not None:  # saved as it goes: a sweep cut short still leaves its evidence
                out.write_text(json.dumps(dict(summary=dict(summarize(cases), partial=True), cases=cases), indent=1))
            print(f"{len(cases):4d} block tp={tp} {result['outcome']:8s} sharded={result['sharded']!s:5s} "
                  f"{spec.projection}/{spec.head_split}/{spec.attention}/{spec.merge}/{spec.head_param} "
                  f"{result['detail']} {result['findings'] or ''}", flush=True)


def summarize(cases: list) -> dict:
    blocks = [c for c in cases if c["kind"] == "block"]
    configs = [c for c in cases if c["kind"] == "config"]
    outcomes = Counter(c["outcome"] for c in blocks)
    return dict(
        block_cases=len(blocks), block_outcomes=dict(outcomes),
        silently_wrong=outcomes.get("wrong", 0),
        block_sharded=sum(c["sharded"] for c in blocks if c["outcome"] == "verified"),
        checker_flags_verified=sum(bool(c["findings"]) for c in blocks if c["outcome"] == "verified"),
        config_cases=len(configs), config_passed=sum(c["outcome"] == "ok" for c in configs),
    )


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--examples", type=int, default=40, help="random transformers configs")
    parser.add_argument("--blocks", type=int, default=0, help="random plain-PyTorch block specs (x2 tp sizes)")
    parser.add_argument("--long", action="store_true", help=f"the long profile: {LONG}")
    parser.add_argument("--out", default=str(ROOT / "benchmarks/results/fuzz.json"))
    args = parser.parse_args()
    examples, blocks = (LONG["examples"], LONG["block_specs"]) if args.long else (args.examples, args.blocks)
    cases: list = []
    began = time.perf_counter()
    if blocks:
        run_blocks(blocks, cases, Path(args.out))
    if examples:
        run_configs(examples, cases)
    summary = dict(summarize(cases), command="python benchmarks/fuzz.py " + " ".join(sys.argv[1:]),
                   wall_s=round(time.perf_counter() - began, 1), date=time.strftime("%Y-%m-%d"))
    Path(args.out).write_text(json.dumps(dict(summary=summary, cases=cases), indent=1))
    print(json.dumps(summary, indent=1))
    print(f"wrote {args.out}")


if __name__ == "__main__":
    main()
