"""check_plan: each known-bad plan is caught statically; good plans yield no finding."""

import pytest
import torch
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import handwritten_plans
from autotp import styles, synthesize
from autotp.check import check_plan
from autotp.models import build_model, load_config, shrink_config
from tests.synth_toy import example_tokens
from tests.test_split_experts import RoutedQueryAttention, synthesize_and_verify, toy_model

FAMILIES = ["llama", "mistral", "qwen2", "qwen3", "gemma3", "gemma3-vlm", "phi3"]


@pytest.fixture(scope="module")
def models():
    return {name: build_model(name, tiny=True, tp=4, device="cpu") for name in FAMILIES + ["olmo2"]}


def kinds(findings):
    return {f.kind for f in findings}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("name", FAMILIES)
def test_handwritten_plans_have_no_finding(models, name, sequence_parallel):
    model = models[name]
    assert check_plan(model, handwritten_plans.plan_for(model, sequence_parallel=sequence_parallel), tp_size=4) == []


@pytest.mark.parametrize("name", ["llama", "qwen3", "gemma3", "phi3", "olmo2"])
def test_synthesized_plans_have_no_finding(models, name):
    model = models[name]
    assert check_plan(model, synthesize(model, verify=False), tp_size=4) == []


def test_key_matching_nothing(models):
    plan = handwritten_plans.plan_for(models["llama"]) | {"model.layers.*.attn.qkv": ColwiseParallel()}
    findings = check_plan(models["llama"], plan, tp_size=2)
    assert [f.module for f in findings if f.kind == "unmatched_key"] == ["model.layers.*.attn.qkv"]


def test_conflicting_keys(models):
    plan = handwritten_plans.plan_for(models["llama"]) | {"model.layers.0.mlp.up_proj": RowwiseParallel()}
    assert "conflicting_keys" in kinds(check_plan(models["llama"], plan, tp_size=2))


def test_column_output_without_row_partner(models):
    plan = handwritten_plans.plan_for(models["llama"])
    del plan["model.layers.*.mlp.down_proj"]
    findings = check_plan(models["llama"], plan, tp_size=2)
    assert [(f.module, f.kind) for f in findings] == [("model.layers.0.mlp.down_proj", "missing_row")]


def test_row_parallel_without_sharded_input(models):
    plan = handwritten_plans.plan_for(models["llama"])
    del plan["model.layers.*.mlp.up_proj"], plan["model.layers.*.mlp.gate_proj"]
    findings = check_plan(models["llama"], plan, tp_size=2)
    assert [(f.module, f.kind) for f in findings] == [("model.layers.0.mlp.down_proj", "row_without_shard")]


def test_fused_gate_up_sharded_contiguously(models):
    plan = handwritten_plans.plan_for(models["phi3"])
    plan["model.layers.*.mlp.gate_up_proj"] = ColwiseParallel()
    findings = check_plan(models["phi3"], plan, tp_size=2)
    assert [(f.module, f.kind) for f in findings] == [("model.layers.0.mlp.gate_up_proj", "fused_contiguous")]
    assert "Colwise(sizes=" in findings[0].fix


def test_reduction_over_sharded_width_olmo2_under_llama_plan(models):
    """OLMo2 normalises q and k over all heads together: a Llama plan leaves that norm inexact."""
    model = models["olmo2"]
    # OLMo2 has no pre-norms (it normalises after each branch): only the Llama plan's Linears apply.
    plan = {k: v for k, v in handwritten_plans.plan_for(models["llama"]).items() if not k.endswith("layernorm")}
    findings = check_plan(model, plan, tp_size=2)
    assert {(f.module.rsplit(".", 1)[-1], f.kind) for f in findings} == {
        ("q_norm", "width_norm_style"),
        ("k_norm", "width_norm_style"),
    }


def test_missing_qk_norm_style_leaves_partial_gradients(models):
    plan = handwritten_plans.plan_for(models["qwen3"])
    del plan["model.layers.*.self_attn.q_norm"]
    findings = check_plan(models["qwen3"], plan, tp_size=2)
    assert [(f.module, f.kind) for f in findings] == [("model.layers.0.self_attn.q_norm", "head_norm_style")]


def test_size_tp_does_not_divide(models):
    model = models["llama"]
    findings = check_plan(model, handwritten_plans.plan_for(model), tp_size=3)
    assert kinds(findings) == {"indivisible"}
    assert "tp=3" in findings[0].problem


def test_tied_weights_sharded_differently():
    config = shrink_config(load_config("llama"), tp=2)
    config.tie_word_embeddings = True
    model = build_model(config, device="cpu")
    plan = handwritten_plans.plan_for(model)
    plan["lm_head"] = RowwiseParallel()
    assert "tied_weights" in kinds(check_plan(model, plan, tp_size=2))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_verified_plan_with_routed_experts_columns_is_not_flagged(tp_size, sequence_parallel):
    """Would catch the checker starting no shard at experts columns (``ExpertsParallel``): the
    routed query heads read as replicated, the k/v Linear whose heads ``repeat`` tiles to the query
    slots flagged ``breaks_shard`` on a plan that verifies, and the experts' fused gate/up output
    taken for a contiguous shard (``fused_contiguous``)."""
    torch.manual_seed(0)
    model = toy_model(RoutedQueryAttention).eval()
    plan, _ = synthesize_and_verify(model, tp_size, sequence_parallel)
    assert plan["layers.*.mixer.queries"].side == "columns" and plan["layers.*.ffn.up"].packed == {"weight": 2}, plan
    assert check_plan(model, plan, tp_size=tp_size, example_inputs=(example_tokens(),)) == []


def test_routed_query_left_replicated_beside_sharded_kv_is_flagged():
    """The real break next to the verified plan: the routed query projections kept whole while the
    tiled k/v are sharded, so attention would mix sharded and replicated heads."""
    torch.manual_seed(0)
    model = toy_model(RoutedQueryAttention).eval()
    plan = {k: v for k, v in synthesize(model, example_inputs=(example_tokens(),), tp_size=2, verify=False).items()
            if not k.startswith("layers.*.mixer.queries")}
    findings = check_plan(model, plan, tp_size=2, example_inputs=(example_tokens(),))
    assert ("layers.0.mixer.kv", "breaks_shard") in {(f.module, f.kind) for f in findings}, findings


def test_experts_columns_packed_unlike_their_parts_are_flagged():
    """Experts columns whose output is chunked into gate and up, sharded as one contiguous block:
    each rank would take gate features as up features."""
    torch.manual_seed(0)
    model = toy_model(RoutedQueryAttention).eval()
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=2, verify=False)
    plan["layers.*.ffn.up"] = styles.ExpertsParallel(shard_dims={"weight": 1}, packed={}, side="columns")
    findings = check_plan(model, plan, tp_size=2, example_inputs=(example_tokens(),))
    assert [(f.module, f.kind) for f in findings] == [("layers.0.ffn.up", "fused_sizes")], findings
    assert "packed={'weight': 2}" in findings[0].fix
