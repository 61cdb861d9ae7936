"""Plan selection order and transformers plan translation."""

import pytest
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import handwritten_plans
from autotp import get_plan
from autotp.errors import PlanError
from autotp.hf_plans import STYLE_FACTORIES, raw_hf_plan, translate
from autotp.models import build_model
from autotp.cli import _skipped_lines
from autotp.cost import PlanCost
from autotp.selection import PlanChoice, register_plan
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


def test_transformers_plan_is_weighed_against_the_synthesized_one_when_no_handwritten_one():
    """OLMo2 has no handwritten plan: transformers' (embedding whole) and the synthesized plan
    (vocab-parallel embedding) both pass; the one holding fewer parameters per rank wins, and the
    choice says so."""
    model = build_model("olmo2", tiny=True, tp=2, device="cpu")
    choice = get_plan(model, tp_size=2)
    by_source = {c.source: c for c in choice.considered}
    assert by_source["handwritten"].fraction is None and by_source["hf"].verdict == "passes"
    assert by_source["synthesized"].fraction < by_source["hf"].fraction - 0.005
    assert choice.source == "synthesized" and "fewest parameters per rank" in choice.why
    assert "hf 0." in choice.why and "synthesized 0." in choice.why
    hf = get_plan(model, source="hf")
    assert isinstance(hf.plan["model.layers.*.self_attn.q_proj"], ColwiseParallel)
    assert f"sources considered: {choice.why}" in _skipped_lines(choice)  # what `autotp plan` prints


def _costed(source: str, fraction: float, collective_bytes: int) -> PlanChoice:
    return PlanChoice({}, source, cost=PlanCost(int(fraction * 1000), 1000, collective_bytes))


# (parameters per rank, collective bytes) per source -> the winner and the reason it names.
RANKING_CASES = [
    ({"handwritten": (0.44, 10), "synthesized": (0.31, 10)}, "synthesized", "fewest parameters per rank"),
    ({"handwritten": (0.50, 100), "hf": (0.502, 60), "synthesized": (0.50, 80)}, "hf", "fewest collective bytes"),
    ({"handwritten": (0.50, 100), "synthesized": (0.50, 98)}, "handwritten", "a tie"),
    ({"hf": (0.50, 100), "synthesized": (0.50, 100)}, "hf", "a tie"),
    ({"handwritten": (0.50, 100), "hf": (0.40, 900), "synthesized": (0.45, 10)}, "hf", "fewest parameters"),
]


def test_ranking_prefers_fewer_parameters_then_fewer_collectives_then_source_order(monkeypatch):
    """Parameters within 0.5% of the model and collectives within 5% count as equal."""
    import autotp.selection as selection

    for costs, winner, reason in RANKING_CASES:
        choices = [_costed(source, *cost) for source, cost in costs.items()]
        monkeypatch.setattr(selection, "plan_cost", lambda model, plan, tp: next(c.cost for c in choices
                                                                                  if c.plan is plan))
        ranked = selection._ranked(None, choices, [], 2)
        assert (ranked.source, costs) == (winner, costs) and reason in ranked.why, ranked.why
        assert [c.source for c in ranked.considered] == list(costs) and len(ranked.runners_up) == len(costs) - 1
        assert [c.verdict for c in ranked.considered].count("chosen") == 1


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
    for entry in (autotp.synthesize, autotp.verify, autotp.check_plan, autotp.get_plan, autotp.parallelize,
                  autotp.fsdp2_strategy_parallelize, autotp.verify_multiprocess):
        assert "example_inputs" in keywords(entry), entry.__name__
    assert {"device_mesh", "tp_shard_plan", "sequence_parallel"} <= keywords(autotp.fsdp2_strategy_parallelize)
    assert {"tp_size", "check"} <= keywords(autotp.get_plan)
    assert set(autotp.__all__) <= set(dir(autotp))


@pytest.mark.slow
def test_autotp_plan_says_which_sources_it_considered_and_why(capsys):
    """``autotp plan`` on a real-size config (meta): the table's heading names the sources weighed
    and the reason; the JSON lists each with its parameters per rank."""
    import json

    from autotp import cli

    assert cli.main(["plan", "olmo2", "--tp", "2"]) == 0
    text = capsys.readouterr().out
    assert "sources considered: hf 0.528, synthesized 0.500 params/rank: synthesized (fewest parameters" in text
    assert cli.main(["plan", "olmo2", "--tp", "2", "--json"]) == 0
    data = json.loads(capsys.readouterr().out)
    verdicts = {c["source"]: (c["verdict"], c["params_fraction"]) for c in data["considered"]}
    assert verdicts["synthesized"][0] == "chosen" and verdicts["hf"][0] == "passes"
    assert verdicts["handwritten"][1] is None and data["why"].endswith("(fewest parameters per rank)")
