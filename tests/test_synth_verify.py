"""Synthesized plans are numerically right: sharded at tp=2 on simulated ranks vs the unsharded model.

Each case would catch a plan that runs but is wrong (a missing reduction, a fused projection split
contiguously, an unreduced gradient) and checks the collective count is the optimum:
plain TP 2 all-reduces per layer + 1 (vocab-parallel embedding); SP 2 all-gathers and
2 reduce-scatters per layer + 1 each at the boundary (2 layers here).
"""

import warnings

import pytest

from autotp.synth import synthesize
from autotp.verifier import verify
from synth_models import tiny_model
from synth_toy import NanoGPT, TitanLlama, example_tokens

TP_OPTIMUM = {"all_reduce": 5}
SP_OPTIMUM = {"all_gather_into_tensor": 5, "reduce_scatter_tensor": 5}


def _check(model, sequence_parallel, **kwargs):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = synthesize(model, sequence_parallel=sequence_parallel, **kwargs)
        inputs = kwargs.get("example_inputs")
        report = verify(model, plan, tp_size=2, inputs=inputs)
    assert report.ok, (report.error, report.logits_max_abs_diff)
    return report


@pytest.mark.parametrize("family,sequence_parallel", [
    ("llama", False), ("llama", True), ("qwen3", False), ("qwen3", True),
    ("gpt_neox", False), ("glm4", True),
])
def test_hf_plan_matches_unsharded_with_optimal_collectives(family, sequence_parallel):
    report = _check(tiny_model(family, device="cpu"), sequence_parallel)
    assert report.collectives == (SP_OPTIMUM if sequence_parallel else TP_OPTIMUM)


def test_olmo2_width_norm_adds_one_statistic_all_reduce_per_norm():
    """q_norm / k_norm over the sharded width: exact, at 2 small extra all-reduces per layer."""
    report = _check(tiny_model("olmo2", device="cpu"), False)
    assert report.collectives == {"all_reduce": 5 + 2 * 2}


def test_gemma3_sp_tied_vocab_parallel_matches_unsharded():
    _check(tiny_model("gemma3", device="cpu"), True)


def test_mixtral_experts_plan_matches_unsharded():
    report = _check(tiny_model("mixtral", device="cpu"), False)
    assert report.collectives == TP_OPTIMUM


def test_parallel_block_sp_gathers_once_per_layer():
    """GPT-J style block: one norm feeds attention and MLP, so one all-gather per layer."""
    model = TitanLlama(parallel=True)
    report = _check(model, True, example_inputs=(example_tokens(),))
    assert report.collectives["all_gather_into_tensor"] == 3


@pytest.mark.xfail(strict=True, reason="c_attn(x).split(n_embd) uses the global width on the local "
                   "shard; needs a ShardCounts-like fix the graph cannot name (same gap as Phi3 qkv)")
def test_nanogpt_packed_c_attn_and_tied_head_match_unsharded():
    _check(NanoGPT(), False, example_inputs=(example_tokens(),))
