"""check_plan agrees with verify on kv heads repeated over ranks and on group copies.

A plan for fewer kv heads than tp (:class:`~autotp.styles.ReplicatedKVColwise` on k / v, the
attention's counts made per rank) and a plan whose grouped parts are copied per rank
(:class:`~autotp.styles.GroupCopies`) both verify; the checker must read them as they run, not as
a contiguous split of one head, and still flag such styles when they are wrong. The tiny model
``autotp verify`` builds must keep a real config's kv heads below tp, so that this is what it checks.
"""

import functools
import warnings

import pytest
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

import handwritten_plans
from autotp import get_plan, styles
from autotp.check import check_plan
from autotp.cli import main
from autotp.models import build_model, load_config, shrink_config
from autotp.styles import GroupCopies, HeadParams, Colwise
from autotp.verifier import verify

ATTENTION = "model.layers.*.self_attn"


def one_kv_head(name: str):
    """``name``'s config with one kv head (Gemma-3-1B has one already)."""
    config = load_config(name)
    config.num_key_value_heads = 1
    return config


@functools.cache
def tiny_one_kv(name: str, tp: int):
    return build_model(one_kv_head(name), tiny=True, tp=tp, keep_kv_heads=True, device="cpu")


def test_tiny_copy_keeps_fewer_kv_heads_than_tp():
    """Would catch the tiny model verify builds getting tp kv heads (so the kv heads repeated over
    ranks are never what is verified), or the query/kv ratio lost with them."""
    small = shrink_config(one_kv_head("llama"), tp=4, keep_kv_heads=True)
    assert (small.num_key_value_heads, small.num_attention_heads) == (1, 32)
    gemma = shrink_config(load_config("gemma3"), tp=4, keep_kv_heads=True)
    assert (gemma.num_key_value_heads, gemma.num_attention_heads) == (1, 4)
    assert shrink_config(load_config("llama"), tp=4, keep_kv_heads=True).num_key_value_heads == 4  # 8 >= tp
    assert shrink_config(one_kv_head("llama"), tp=4).num_key_value_heads == 4  # the default: tp kv heads


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("name", ["gemma3", "llama"])
def test_one_kv_head_plans_have_no_finding_and_verify(name, tp):
    """One kv head over tp ranks, the handwritten plan (``replicate_kv_for_tp``) and the one
    ``get_plan`` chooses (synthesized): no finding, and both match the unsharded model. Would
    catch the checker reading the repeated head as a contiguous split of it (``breaks_shard``,
    ``fused_contiguous``, ``entry_not_sliced``: get_plan then raised NoPlanError)."""
    model = tiny_one_kv(name, tp)
    assert model.config.num_key_value_heads == 1
    handwritten = handwritten_plans.plan_for(model, replicate_kv_for_tp=tp)
    chosen = get_plan(model, tp_size=tp)
    assert isinstance(chosen.plan[f"{ATTENTION}.k_proj"], styles.ReplicatedKVColwise), chosen.source
    for plan in (handwritten, chosen.plan):
        assert check_plan(model, plan, tp_size=tp) == []
        with warnings.catch_warnings():
            warnings.simplefilter("ignore")
            report = verify(model, plan, tp_size=tp)
        assert report.ok, str(report)


def test_wrong_kv_replication_is_still_flagged():
    """Each plan below fails verification (checked by hand); reading the kv heads as they run must
    not let it pass: kv heads miscounted, a query projection replicated as if it were k, and k / v
    split contiguously."""
    model, tp = tiny_one_kv("llama", 2), 2
    good = handwritten_plans.plan_for(model, replicate_kv_for_tp=tp)
    miscounted = {**good, f"{ATTENTION}.k_proj": styles.ReplicatedKVColwise(kv_heads=2, head_dim=8, gather=True)}
    on_query = {**good, f"{ATTENTION}.q_proj": styles.ReplicatedKVColwise(kv_heads=1, head_dim=16, gather=True)}
    split = {**good, f"{ATTENTION}.k_proj": ColwiseParallel(), f"{ATTENTION}.v_proj": ColwiseParallel()}
    found = {label: {(f.kind, f.module.rsplit(".", 1)[-1]) for f in check_plan(model, plan, tp_size=tp)}
             for label, plan in (("miscounted", miscounted), ("on_query", on_query), ("split", split))}
    assert ("kv_heads", "k_proj") in found["miscounted"]
    assert ("kv_not_grouped", "q_proj") in found["on_query"]
    assert {kind for kind, _ in found["split"]} == {"indivisible"}


# The plan synthesize(tp_size=2) writes for the tiny Bamba of the coverage sweep (one SSM group:
# B and C of the mixer copied per rank and gathered): it verifies there, and the checker flagged
# it `row_without_shard` (with breaks_shard, head_params_style) before it read the copies.
BAMBA_IN_ROWS = {"weight": (0, 552, ((512, 528, 1), (528, 544, 1)))}
BAMBA_CONV_ROWS = {path: (0, 288, ((256, 272, 1), (272, 288, 1))) for path in ("conv1d.weight", "conv1d.bias")}
BAMBA_MIXER = HeadParams(shard_dims={"A_log": 0, "D": 0, "conv1d.bias": 0, "conv1d.weight": 0, "dt_bias": 0},
                         counts=("conv_dim", "intermediate_size", "n_groups", "num_heads"),
                         packed={"conv1d.bias": (256, 32, 32), "conv1d.weight": (256, 32, 32)})


def bamba_plan(values: dict) -> dict:
    return {
        "lm_head": ColwiseParallel(use_local_output=False),
        "model.embed_tokens": styles.VocabParallelEmbedding(input_layouts=Replicate()),
        "model.layers.*.mamba.in_proj": GroupCopies(base=Colwise(sizes=(256, 256, 32, 32, 8)),
                                                    rows=BAMBA_IN_ROWS, gather=True),
        "model.layers.*.mamba.out_proj": RowwiseParallel(),
        "model.layers.*.mamba.norm": styles.WidthShardedNorm(),
        "model.layers.*.mamba": GroupCopies(base=BAMBA_MIXER, rows=BAMBA_CONV_ROWS, values=values, gather=True),
        "model.layers.*.feed_forward.gate_proj": ColwiseParallel(),
        "model.layers.*.feed_forward.up_proj": ColwiseParallel(),
        "model.layers.*.feed_forward.down_proj": RowwiseParallel(),
        "model.layers.*.pre_ff_layernorm": styles.Boundary(outputs="replicate"),
    }


@pytest.fixture(scope="module")
def tiny_bamba():
    config = shrink_config(load_config("bamba"), tp=2)
    config.use_cache = False  # as the sweep builds it
    return build_model(config, device="cpu")


def test_group_copies_of_the_sweep_have_no_finding(tiny_bamba):
    """Would catch the checker reading the copied B / C as parts of the unexpanded mixer (its
    ``row_without_shard`` on out_proj), or the plan no longer being one that verifies."""
    plan = bamba_plan({"conv_dim": 320, "n_groups": 2})
    assert check_plan(tiny_bamba, plan, tp_size=2) == []
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(tiny_bamba, plan, tp_size=2)
    assert report.ok, str(report)


def test_group_copies_that_change_the_model_are_flagged(tiny_bamba):
    """The copies' attributes left at their unexpanded values: the expanded mixer computes
    something else (the plan fails to apply), so the checker may not read the plan on it."""
    findings = check_plan(tiny_bamba, bamba_plan({"conv_dim": 320, "n_groups": 1}), tp_size=2)
    assert [(f.kind, f.module) for f in findings] == [("group_copies", "model.layers.0.mamba")]


def test_cli_verifies_gemma3_with_its_one_kv_head(capsys):
    """``autotp verify gemma3 --tp 2``: the real config's plan passes the checker (it was rejected,
    NoPlanError) and the tiny model, built keeping the real single kv head, verifies."""
    assert main(["verify", "gemma3", "--tp", "2"]) == 0
    out = capsys.readouterr().out
    assert "num_key_value_heads=1" in out and "tp=2  OK" in out
