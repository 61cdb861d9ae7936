"""Property: for random Llama-family configs and tp sizes that divide them, the synthesized plan has
no static finding and matches the unsharded model (logits and gradients within 1e-5, fp32).

A short profile here; ``benchmarks/fuzz.py`` runs the long one and records its result.
"""

import os

from hypothesis import HealthCheck, given, settings

from autotp import synthesize
from autotp.check import check_plan
from autotp.models import build_model
from autotp.verifier import verify
from fuzz_configs import build_config, llama_family_case

EXAMPLES = int(os.environ.get("AUTOTP_FUZZ_EXAMPLES", "4"))


def check_case(model_type: str, options: dict, tp: int, sequence_parallel: bool = False) -> None:
    model = build_model(build_config(model_type, options), device="cpu")
    plan = synthesize(model, sequence_parallel=sequence_parallel, tp_size=tp)
    findings = check_plan(model, plan, tp_size=tp)
    assert findings == [], [str(f) for f in findings]
    report = verify(model, plan, tp_size=tp)
    assert report.ok, f"{model_type} {options} tp={tp}\n{report}"


@settings(max_examples=EXAMPLES, deadline=None, derandomize=True,
          suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
@given(llama_family_case())
def test_random_llama_family_configs_synthesize_check_and_verify(case):
    check_case(*case)
