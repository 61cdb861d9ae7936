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
