"""tp larger than the number of kv heads (GQA with few kv heads, MQA), for handwritten plans.

Each rank holds the one kv head its query heads read; the verifier compares every rank's copy (and
its gradient, after the copies' gradients are summed) with that head's rows of the reference.
"""

import pytest

import handwritten_plans
from autotp._simulate import simulated_mesh
from autotp.apply import apply_plan
from autotp.errors import MeshError
from autotp.models import build_model, load_config, shrink_config
from autotp.verifier import verify


def tiny(name: str, kv_heads: int):
    config = shrink_config(load_config(name), tp=8)
    config.num_key_value_heads = kv_heads
    return build_model(config, device="cpu")


CASES = [  # 2 kv heads (Llama-shaped, Qwen2 with k/v biases) and MQA (Qwen3 with QK-norm), tp 4 and 8
    ("llama", 2, 4, True),
    ("llama", 2, 8, False),
    ("qwen2", 2, 4, False),
    ("qwen3", 1, 4, False),
    ("qwen3", 1, 8, True),
]


@pytest.mark.parametrize("gather", [True, False], ids=["gathered", "copies"])
@pytest.mark.parametrize("name,kv_heads,tp_size,sequence_parallel", CASES)
def test_kv_heads_replicated_across_ranks_match_unsharded(name, kv_heads, tp_size, sequence_parallel, gather):
    """Gathered (the default): k/v rows sharded like any column (``1/tp`` of them per rank), each
    forward all-gathers k and v (one collective each per layer) and rank r cuts its head; the
    backward reduce-scatters their gradient. Would catch the wrong head cut on a rank, the gathered
    gradient taken whole (only this rank's query heads reaching k/v), or rows still copied.
    Copies (``gather_kv=False``): each rank holds its kv head whole, no collective added to the
    forward (k/v computed locally from the replicated input), the copies' gradients summed."""
    model = tiny(name, kv_heads)
    plan = handwritten_plans.plan_for(model, sequence_parallel=sequence_parallel, replicate_kv_for_tp=tp_size,
                                      gather_kv=gather)
    report = verify(model, plan, tp_size=tp_size)
    assert report.ok, str(report)
    layers = model.config.num_hidden_layers
    gathers = 2 * layers if gather else 0
    expected = (
        {"all_gather_into_tensor": 2 * layers + 1 + gathers, "reduce_scatter_tensor": 2 * layers + 1}
        if sequence_parallel
        else {"all_reduce": 2 * layers + 1, **({"all_gather_into_tensor": gathers} if gather else {})}
    )
    assert report.collectives == expected
    if gather:
        assert report.comm_volume_backward == report.comm_volume, report
        assert all(abs(f - 1 / tp_size) < 0.01 for f in report.param_fraction), report.param_fraction


def test_without_opt_in_tp_above_kv_heads_is_refused_with_the_way_out():
    model = tiny("llama", 2)
    with simulated_mesh(4) as mesh:
        with pytest.raises(MeshError, match="num_key_value_heads=2.*replicate kv heads"):
            apply_plan(model, mesh, handwritten_plans.plan_for(model))


def test_tp_not_a_multiple_of_kv_heads_is_refused():
    model = tiny("llama", 2)
    with pytest.raises(MeshError, match="multiple of 2"):
        handwritten_plans.plan_for(model, replicate_kv_for_tp=3)


def test_summed_kv_gradient_is_placed_like_the_weight_even_from_a_pending_sum():
    """DTensor may hand the weight hook a ``Partial`` gradient (its strategy for long sequences):
    the summed copies must come back ``Shard(0)``, as the weight is, holding each head's total.
    Would catch the hook redistributing to the gradient's own (Partial) placement, which fails."""
    import torch
    from torch.distributed.tensor import Partial, Shard, distribute_tensor

    from autotp.styles.attention import expand_kv_rows, sum_kv_copies

    a, b = torch.arange(32.0).reshape(8, 4), torch.ones(4, 1)
    full = a @ b  # 1 kv head of head_dim 2, expanded to tp=4 rows
    with simulated_mesh(4) as mesh:
        grad = distribute_tensor(a, mesh, [Shard(1)]) @ distribute_tensor(b, mesh, [Shard(0)])
        assert grad.placements == (Partial(),)  # a row-parallel product: a pending sum
        summed = sum_kv_copies(grad, kv_heads=1, head_dim=2)
        assert summed.placements == (Shard(0),)
        total = summed.full_tensor()
    per_head = full.reshape(1, 4, 2, 1).sum(dim=1).reshape(2, 1)
    assert torch.equal(total, expand_kv_rows(per_head, 1, 2, 4))


def test_layer_types_with_other_head_sizes_get_their_own_kv_keys():
    """Gemma4's full-attention layers have another head size than its sliding ones: one
    ``layers.*.k_proj`` key cannot carry both, so the rewrite splits it per layer (each with its
    own head size) and the plan verifies at tp=8 with 4 kv heads."""
    config = shrink_config(load_config("gemma4_text"), tp=4)
    model = build_model(config, device="cpu")
    plan = handwritten_plans.plan_for(model, replicate_kv_for_tp=8)
    head_dims = {key: style.head_dim for key, style in plan.items() if key.endswith("k_proj")}
    assert "model.layers.*.self_attn.k_proj" not in head_dims and len(set(head_dims.values())) == 2, head_dims
    report = verify(model, plan, tp_size=8)
    assert report.ok, str(report)
