"""Property: synthesized plans are never silently wrong.

Two generators: random Llama-family transformers configs (the plan has no static finding and
matches the unsharded model), and random plain-PyTorch decoder blocks written with the head-split
idioms, fused or separate projections, per-head parameters and ties of :mod:`fuzz_blocks` (each
case verifies at tp 2 and 4, or synthesis refuses it with an ``AutoTPError``; a plan that runs and
differs is the one outcome that fails). A short profile here; ``benchmarks/fuzz.py --long`` runs
the long one and records its result.
"""

import os
import warnings

from hypothesis import HealthCheck, given, settings

from autotp import synthesize
from autotp.check import check_plan
from autotp.errors import AutoTPError, one_line
from autotp.models import build_model
from autotp.verifier import verify
from fuzz_blocks import BlockSpec, SpecLM, block_spec, tokens
from fuzz_configs import build_config, llama_family_case

EXAMPLES = int(os.environ.get("AUTOTP_FUZZ_EXAMPLES", "4"))
BLOCK_EXAMPLES = int(os.environ.get("AUTOTP_FUZZ_BLOCK_EXAMPLES", "3"))


def check_case(model_type: str, options: dict, tp: int, sequence_parallel: bool = False) -> None:
    model = build_model(build_config(model_type, options), device="cpu")
    plan = synthesize(model, sequence_parallel=sequence_parallel, tp_size=tp, verify=False)
    findings = check_plan(model, plan, tp_size=tp)
    assert findings == [], [str(f) for f in findings]
    report = verify(model, plan, tp_size=tp)
    assert report.ok, f"{model_type} {options} tp={tp}\n{report}"


def block_outcome(spec: BlockSpec, tp: int) -> dict:
    """Synthesize for ``spec`` at ``tp`` and verify: ``{"outcome": "verified" | "refused" |
    "wrong", "sharded": attention projections sharded, "detail": ..., "findings": checker's}``.

    ``wrong`` (a plan handed out that runs and differs, or fails to run) is the silent failure.
    """
    model = SpecLM(spec)
    try:
        plan = synthesize(model, example_inputs=(tokens(),), tp_size=tp, verify=False)
    except AutoTPError as error:
        return {"outcome": "refused", "sharded": False, "detail": one_line(error), "findings": []}
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp, example_inputs=(tokens(),))
    findings = [f.kind for f in check_plan(model, plan, tp_size=tp, example_inputs=(tokens(),))]
    sharded = any(key.startswith("blocks.*.attn.") and key.rsplit(".", 1)[-1] != "out" for key in plan)
    return {"outcome": "verified" if report.ok else "wrong", "sharded": sharded,
            "detail": "" if report.ok else str(report).splitlines()[0], "findings": findings}


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(llama_family_case())
def test_random_llama_family_configs_synthesize_check_and_verify(case):
    check_case(*case)


@settings(max_examples=BLOCK_EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(block_spec())
def test_random_plain_pytorch_blocks_verify_or_are_refused(spec):
    """Would catch any idiom combination whose synthesized plan runs and computes other numbers,
    or that the checker flags although it verifies."""
    for tp in (2, 4):
        result = block_outcome(spec, tp)
        assert result["outcome"] != "wrong", (spec, tp, result)
        assert result["findings"] == [], (spec, tp, result)
