"""Plan selection order and transformers plan translation."""

import pytest
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import handwritten_plans
from autotp import get_plan
from autotp.errors import PlanError
from autotp.hf_plans import STYLE_FACTORIES, raw_hf_plan, translate
from autotp.models import build_model
from autotp.selection import register_plan
from autotp.verifier import verify

# Referenced by import path in the tests below.
CUSTOM_PLAN = {"model.layers.*.mlp.up_proj": ColwiseParallel()}


def custom_plan_function(model, sequence_parallel=False):
    return {"model.layers.*.mlp.down_proj": RowwiseParallel()}


@pytest.fixture(scope="module")
def llama():
    return build_model("llama", tiny=True, tp=2, device="cpu")


def test_explicit_dict_wins(llama):
    choice = get_plan(llama, tp_shard_plan=CUSTOM_PLAN)
    assert choice.source == "custom" and choice.plan is CUSTOM_PLAN


def test_import_path_to_a_dict_and_to_a_function(llama):
    assert get_plan(llama, tp_shard_plan="tests.test_selection.CUSTOM_PLAN").plan.keys() == CUSTOM_PLAN.keys()
    plan = get_plan(llama, tp_shard_plan="tests.test_selection.custom_plan_function").plan
    assert list(plan) == ["model.layers.*.mlp.down_proj"]


def test_registered_name(llama):
    register_plan("test-only-plan", custom_plan_function)
    assert list(get_plan(llama, tp_shard_plan="test-only-plan").plan) == ["model.layers.*.mlp.down_proj"]


@pytest.mark.parametrize("path", ["no_such_package.plans.PLAN", "tests.test_selection.NO_SUCH_PLAN", "justaword"])
def test_bad_import_path_is_a_plan_error(llama, path):
    with pytest.raises(PlanError, match="tp_shard_plan"):
        get_plan(llama, tp_shard_plan=path)


def test_handwritten_comes_before_transformers_plan(llama):
    choice = get_plan(llama)
    assert choice.source == "handwritten"
    assert choice.plan.keys() == handwritten_plans.plan_for(llama).keys()


def test_transformers_plan_when_no_handwritten_one():
    model = build_model("olmo2", tiny=True, tp=2, device="cpu")
    choice = get_plan(model)
    assert choice.source == "hf"
    assert isinstance(choice.plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)


def test_unknown_style_string_names_key_and_string(llama):
    with pytest.raises(PlanError, match=r"'model.layers.\*.mlp.up_proj'.*'diagonal'"):
        translate(llama, {"model.layers.*.mlp.up_proj": "diagonal"})


def test_every_style_string_transformers_uses_is_translated():
    """All style strings in the text-model plans of transformers 5.23 have a translation."""
    from transformers import AutoConfig
    from transformers.models.auto.modeling_auto import MODEL_FOR_CAUSAL_LM_MAPPING_NAMES

    used = set()
    for model_type in MODEL_FOR_CAUSAL_LM_MAPPING_NAMES:
        try:
            config = AutoConfig.for_model(model_type)
        except Exception:
            continue
        for sub in (config, getattr(config, "text_config", None)):
            used |= set((getattr(sub, "base_model_tp_plan", None) or {}).values())
    assert used, "no transformers plan found"
    assert used <= set(STYLE_FACTORIES), sorted(used - set(STYLE_FACTORIES))


@pytest.mark.parametrize("name", ["qwen3", "qwen3-moe", "phi3"])
def test_translated_transformers_plan_verifies(name):
    model = build_model(name, tiny=True, tp=2, device="cpu")
    plan = translate(model, raw_hf_plan(model))
    report = verify(model, plan, tp_size=2)
    assert report.ok, str(report)


# --- selection falls through rejected sources ------------------------------------------------------


@pytest.fixture(scope="module")
def starcoder2():
    return build_model("starcoder2", tiny=True, tp=2, device="cpu")


def test_tied_weights_sharded_two_ways_fall_through_to_a_plan_that_verifies(starcoder2):
    """transformers' Starcoder2 plan shards lm_head but not the tied embedding: it must be skipped
    with that reason, and the plan chosen instead must verify."""
    choice = get_plan(starcoder2, tp_size=2)
    assert choice.source == "synthesized"
    reasons = dict(choice.skipped)
    assert list(reasons) == ["handwritten", "hf"]
    assert "tied_weights" in reasons["hf"] and "lm_head.weight" in reasons["hf"]
    report = verify(starcoder2, choice.plan, tp_size=2)
    assert report.ok, str(report)


def test_an_insisted_source_is_returned_unchecked_unless_asked(starcoder2):
    assert get_plan(starcoder2, source="hf").source == "hf"
    with pytest.raises(PlanError, match="hf plan rejected: check: .*tied_weights"):
        get_plan(starcoder2, source="hf", check=True, tp_size=2)


def test_real_size_model_whose_transformers_plan_tp_does_not_divide_falls_through():
    """Qwen3-Next (real config, meta) has 2 kv heads: at tp=4 transformers' plan cuts them; the
    checker rejects it, so selection must not hand it out."""
    from autotp.errors import NoPlanError

    model = build_model("qwen3_next")
    try:
        choice = get_plan(model, tp_size=4)
    except NoPlanError as error:
        skipped = dict(error.skipped)
        assert "synthesized" in skipped and str(error).startswith("Qwen3NextForCausalLM: no plan source")
    else:
        assert choice.source == "synthesized"
        skipped = dict(choice.skipped)
    assert "indivisible" in skipped["hf"] and "num_key_value_heads=2" in skipped["hf"]


def test_an_accepted_first_source_skips_nothing(llama):
    choice = get_plan(llama, tp_size=2)
    assert (choice.source, choice.skipped) == ("handwritten", [])


def test_an_explicit_plan_sharding_tied_weights_two_ways_is_refused():
    from torch.distributed.tensor.parallel import ColwiseParallel

    model = build_model("llama-1b", tiny=True, tp=2)  # meta; tied embedding and head
    with pytest.raises(PlanError, match=r"tied parameters .*lm_head\.weight"):
        get_plan(model, tp_shard_plan={"lm_head": ColwiseParallel()}, tp_size=2)


def test_api_functions_show_their_keywords():
    """``help(autotp.synthesize)`` used to show ``(model, **kwargs)``; the lazy exports are the
    functions themselves."""
    import inspect

    import autotp

    def keywords(function):
        return set(inspect.signature(function).parameters)

    assert {"example_inputs", "tp_size", "sequence_parallel"} <= keywords(autotp.synthesize)
    assert {"example_inputs", "tp_size"} <= keywords(autotp.explain)
    assert {"procs", "backward"} <= keywords(autotp.verify_multiprocess)
    assert {"device_mesh", "tp_shard_plan", "sequence_parallel"} <= keywords(autotp.fsdp2_strategy_parallelize)
    assert {"tp_size", "check"} <= keywords(autotp.get_plan)
    assert set(autotp.__all__) <= set(dir(autotp))
