"""parallelize(): checks before sharding, and tied weights."""

import copy

import pytest
from torch.distributed.device_mesh import init_device_mesh

import handwritten_plans
from autotp._simulate import simulated_mesh
from autotp.apply import apply_plan, validate_tp_mesh
from autotp.errors import MeshError, PlanError
from autotp.models import build_model, load_config, shrink_config
from autotp.verifier import verify


def tiny_llama(**overrides):
    config = shrink_config(load_config("llama"), tp=2)
    for name, value in overrides.items():
        setattr(config, name, value)
    return build_model(config, device="cpu")


@pytest.fixture(scope="module")
def llama():
    return build_model("llama", tiny=True, tp=2, device="cpu")


def test_kv_heads_not_divisible_names_sizes_and_working_tp(llama):
    """A plan that splits kv heads tp does not divide is refused before sharding. (``parallelize``
    itself takes the synthesized plan there, which repeats each kv head over tp / kv ranks: its
    selection once failed under simulated ranks, where tracing ran per rank, and refused.)"""
    kv = llama.config.num_key_value_heads
    with simulated_mesh(2 * kv) as mesh:
        with pytest.raises(MeshError) as info:
            apply_plan(copy.deepcopy(llama), mesh, handwritten_plans.plan_for(llama))
    message = str(info.value)
    assert f"num_key_value_heads={kv}" in message and f"tp={2 * kv}" in message
    assert "use tp in (1, 2" in message


def test_mesh_must_be_one_dimensional(llama):
    with simulated_mesh(4):
        mesh = init_device_mesh("cpu", (2, 2), mesh_dim_names=("dp", "tp"))
        with pytest.raises(MeshError, match="1-D"):
            validate_tp_mesh(llama, mesh)


def test_sharded_dimension_not_divisible_is_caught_before_sharding(llama):
    model = tiny_llama(vocab_size=255)
    with simulated_mesh(2) as mesh:
        with pytest.raises(MeshError, match="embed_tokens.weight.*255"):
            apply_plan(model, mesh, handwritten_plans.plan_for(model))
        assert not hasattr(model.model.embed_tokens.weight, "placements")


def test_conflicting_keys_are_refused(llama):
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    plan = {"model.layers.*.mlp.up_proj": ColwiseParallel(), "model.layers.0.mlp.up_proj": RowwiseParallel()}
    with simulated_mesh(2) as mesh:
        with pytest.raises(PlanError, match="different styles"):
            apply_plan(copy.deepcopy(llama), mesh, plan)


def test_tied_embedding_and_head_stay_tied_and_correct():
    """Vocab-parallel embedding and colwise head both shard the vocabulary (dim 0): one parameter."""
    model = tiny_llama(tie_word_embeddings=True)
    assert model.lm_head.weight is model.model.embed_tokens.weight
    plan = handwritten_plans.plan_for(model)
    with simulated_mesh(2) as mesh:
        sharded = apply_plan(copy.deepcopy(model), mesh, plan)
        assert sharded.lm_head.weight is sharded.model.embed_tokens.weight
    report = verify(model, plan, tp_size=2)
    assert report.ok, str(report)


def test_tied_weights_sharded_differently_are_refused():
    from torch.distributed.tensor.parallel import ColwiseParallel

    model = tiny_llama(tie_word_embeddings=True)
    plan = {"lm_head": ColwiseParallel()}
    with simulated_mesh(2) as mesh:
        with pytest.raises(PlanError, match="tied"):
            apply_plan(model, mesh, plan)


def test_a_plan_describes_the_same_after_it_was_applied(llama):
    """parallelize_module writes into the style objects (src_data_rank, RowwiseParallel's desired
    input layouts): a reused plan must still compare equal to a fresh one."""
    from autotp.plan import describe_plan

    plan = handwritten_plans.plan_for(llama)
    before = describe_plan(plan)
    with simulated_mesh(2) as mesh:
        apply_plan(copy.deepcopy(llama), mesh, plan)
    assert describe_plan(plan) == before


def test_head_counts_are_checked_only_when_the_plan_shards_heads():
    """One kv head at tp=2: a plan that shards only the MLP is fine (and exact); one that shards
    the attention projections is refused before sharding. Would catch MQA models refused outright."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    config = shrink_config(load_config("llama"), tp=2)
    config.num_key_value_heads = 1
    config.intermediate_size = 96  # not a whole number of heads, as the FFN width of real models
    model = build_model(config, device="cpu")
    mlp = {"model.layers.*.mlp.gate_proj": ColwiseParallel(), "model.layers.*.mlp.up_proj": ColwiseParallel(),
           "model.layers.*.mlp.down_proj": RowwiseParallel()}
    assert verify(model, mlp, tp_size=2).ok
    attention = {**mlp, "model.layers.*.self_attn.k_proj": ColwiseParallel()}
    with simulated_mesh(2) as mesh:
        with pytest.raises(MeshError, match="num_key_value_heads=1 cannot be split over tp=2"):
            apply_plan(copy.deepcopy(model), mesh, attention)


def test_plan_keys_select_modules_as_parallelize_module_does():
    """``key_matches`` (one compiled pattern per key) against torch's own rule: the key and the FQN
    split on dots, then fnmatch atom by atom. Would catch ``*`` crossing a dot, or a class or ``?``
    read differently."""
    from fnmatch import fnmatch

    from autotp.plan import key_matches

    keys = ["model.layers.*.mlp.up_proj", "model.*.up_proj", "*", "*.*", "model.layers.?.mlp",
            "model.layers.[0-2].self_attn", "model.layers.[!0].self_attn", "h.*.attn.c_*", "lm_head",
            "model.layers.1*.mlp", "model.layers.*", "a+b.(c)", "model.layers.[13].x"]
    fqns = ["model.layers.3.mlp.up_proj", "model.layers.12.mlp.up_proj", "model.up_proj", "model",
            "model.layers.3.mlp", "model.layers.1.self_attn", "model.layers.0.self_attn", "h.0.attn.c_attn",
            "h.0.attn.c_proj", "lm_head", "model.layers.10.mlp", "model.layers.1", "model.layers.", "a+b.(c)",
            "model.layers.3.x", "model.layers.2.x", "model.layers..x"]
    for key in keys:
        for fqn in fqns:
            k, f = key.split("."), fqn.split(".")
            expected = len(k) == len(f) and all(fnmatch(b, a) for a, b in zip(k, f))
            assert key_matches(key, fqn) == expected, (key, fqn)
