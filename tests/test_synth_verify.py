"""Synthesized plans that the verification matrix (``test_synth_matrix``) does not cover, verified.

Each compares the sharded model on simulated ranks with the unsharded one (logits and every
parameter gradient within 1e-5): tp larger than the kv heads, and the fallback that keeps a fused
projection whole when its cuts cannot be made per-rank.
"""

import warnings

import pytest

from autotp import styles
from autotp.errors import MeshError
from autotp.synth import synthesize
from autotp.verifier import verify
from synth_models import tiny_model

# 8 query heads of 16, so tp 4 and 8 split them; kv heads fewer than tp.
WIDE = dict(hidden_size=128, num_attention_heads=8, head_dim=16)


def _verify(model, plan, tp_size, inputs=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp_size, example_inputs=inputs)
    assert report.ok, str(report)
    return report


@pytest.mark.parametrize("family", ["llama", "qwen2"])
@pytest.mark.parametrize("tp_size", [4, 8])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_tp_above_kv_heads_replicates_kv_heads_exactly(family, tp_size, sequence_parallel):
    """2 kv heads at tp 4 / 8: each rank holds the kv head its query heads read, the grouped-query
    ratio attribute is found and set per rank, and the collectives stay optimal. Would catch a k/v
    split through a head, a wrong ratio (shape error or wrong logits), unsummed kv gradients."""
    model = tiny_model(family, device="cpu", num_key_value_heads=2, **WIDE)
    plan = synthesize(model, sequence_parallel=sequence_parallel, tp_size=tp_size, verify=False)
    attn = "model.layers.*.self_attn"
    assert repr(plan[f"{attn}.k_proj"]).startswith("ReplicatedKVColwise")
    assert (plan[f"{attn}.k_proj"].kv_heads, plan[f"{attn}.k_proj"].head_dim) == (2, 16)
    assert isinstance(plan[attn], styles.ShardCounts) and plan[attn].query_heads == 8
    assert plan[attn].ratio == "num_key_value_groups"
    report = _verify(model, plan, tp_size)
    assert report.collectives == _optimum(sequence_parallel, gathered=True)
    assert report.comm_volume_backward == report.comm_volume, report


def _optimum(sequence_parallel: bool, gathered: bool) -> dict[str, int]:
    """One reduction per block and the head's (2 layers); ``gathered``: and the k and v of each layer
    gathered (``ReplicatedKVColwise(gather=True)``)."""
    optimum = {"all_gather_into_tensor": 5, "reduce_scatter_tensor": 5} if sequence_parallel else {"all_reduce": 5}
    if gathered:
        optimum["all_gather_into_tensor"] = optimum.get("all_gather_into_tensor", 0) + 4
    return optimum


@pytest.mark.parametrize("tp_size", [2, 4, 8])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "copies"])
def test_tp_above_one_kv_head_replicates_it(tp_size, sequence_parallel, gather):
    """One kv head (MQA): the view to (b, t, 1, head_dim) is read as a split into one head, so each
    rank holds that head whole instead of half of its head_dim (or, as before, the whole attention
    left replicated). Would catch a head_dim split (wrong logits), unsummed k/v gradients, or
    extra collectives. Gathered (the default), the head's rows are sharded and gathered each
    forward, the backward moving as many bytes; copies (``gather_copies=False``): each rank holds
    it whole, no forward collective."""
    model = tiny_model("llama", device="cpu", num_key_value_heads=1, **WIDE)
    plan = synthesize(model, sequence_parallel=sequence_parallel, tp_size=tp_size, gather_copies=gather, verify=False)
    assert plan["model.layers.*.self_attn.k_proj"].kv_heads == 1
    assert plan["model.layers.*.self_attn.k_proj"].gather == gather
    report = _verify(model, plan, tp_size)
    assert report.collectives == _optimum(sequence_parallel, gather)
    if gather:
        assert report.comm_volume_backward == report.comm_volume, report


def test_tp_not_a_multiple_of_kv_heads_raises_naming_the_projection():
    with pytest.raises(MeshError, match=r"self_attn\.k_proj: 2 kv heads cannot be shared evenly by tp=3"):
        synthesize(tiny_model("llama", num_key_value_heads=2, **WIDE), tp_size=3, verify=False)


DYNAMIC_ROPE = {"rope_type": "dynamic", "rope_theta": 10000.0, "factor": 2.0}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_dynamic_ntk_rope_is_traced_with_real_values(sequence_parallel):
    """Dynamic-NTK rotary embeddings branch on ``position_ids.max()``: fake tensors cannot decide
    it, so a materialised model is re-exported with real values (the branch is in a module without
    parameters). Would catch that retry being lost (a TraceError) or the plan going wrong."""
    model = tiny_model("llama", device="cpu", rope_parameters=DYNAMIC_ROPE)
    plan = synthesize(model, sequence_parallel=sequence_parallel, tp_size=2, verify=False)
    _verify(model, plan, 2)


@pytest.mark.parametrize("name", ["qwen2_moe", "deepseek_v3", "afmoe"])
def test_sp_plans_with_shared_experts_and_inner_rows_are_exact(name):
    """Sequence parallel where a row Linear does not return to the residual stream:

    - qwen2_moe: a shared expert scaled by a learned sigmoid gate inside the MoE block; the block
      reduces inside and slices its whole output back to the stream (left a partial sum, the gate's
      weight gradient would be partial: a wrong gradient, no error);
    - deepseek_v3: MLA's ``q_b_proj`` is row-parallel inside the attention; it all-reduces as under
      plain TP instead of reduce-scattering into the rotary embedding (a Tensor/DTensor crash);
    - afmoe: a norm after the MoE block, before the residual add, stays on the stream.
    """
    from autotp.models import build_model

    model = build_model(name, tiny=True, tp=2, device="cpu")
    _verify(model, synthesize(model, sequence_parallel=True, tp_size=2, verify=False), 2)


def test_sp_norm_read_by_several_whole_linears_gathers_once():
    """MLA's query and kv down-projections are kept whole and both read the pre-attention norm's
    output: under sequence parallel the norm all-gathers it once, as a plain tensor, where each
    down-projection gathered it again (7 all-gathers in a 2-layer forward, now 5: one per block
    input, one before the head). Would catch the norm left sharded (a gather per reader) or a
    gradient off (the readers' whole input gradients summed)."""
    from autotp.models import build_model

    model = build_model("deepseek_v3", tiny=True, tp=2, device="cpu")
    plan = synthesize(model, sequence_parallel=True, tp_size=2, verify=False)
    assert plan["model.layers.*.input_layernorm"].outputs == "gather", plan
    report = _verify(model, plan, 2)
    assert report.collectives["all_gather_into_tensor"] == 5, report.collectives
