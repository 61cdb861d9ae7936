"""A fused q / v / k projection viewed as a fixed number of groups is sharded within each group.

The attention's code views its fused output as ``G`` groups, ``G`` a constant of the code (no
attribute to divide), each group holding its own ``[q | v | k]`` for ``heads / G`` heads. Plainly
read, rank r would hold whole groups, which that code cannot take at per-rank widths. The expert
layout holds, on every rank, its share of every group's heads: the fused Linear is packed in
``G * 3`` parts, the head count attribute is divided by tp, ``G`` stays, and the output Linear
reads its heads as ``G`` parts (:class:`~autotp.styles.Rowwise` with ``sizes``). Each plan is checked
against the unsharded model on the logits and every gradient, at tp 2 and 4, plain and sequence
parallel, and must hold about ``1/tp`` of the parameters; layouts the per-rank shape proof cannot
make local stay whole, with the plan still exact.

The group count is a constant of the code, so the literal rewrite (:mod:`autotp.synth.literal_sizes`)
now reads these attentions first: where tp divides the groups, each rank holds whole groups and the
count is rewritten per rank (``test_fixed_groups_whose_count_tp_divides_are_held_whole_per_rank``).
The tests of the per-group reading run with that rewrite off (``no_shape_fixes``), as it still
serves code the rewrite cannot localize.
"""

import warnings

import pytest
import torch.nn.functional as F
from torch import nn

from autotp import check_plan
from torch.distributed.tensor.parallel import RowwiseParallel

from autotp.styles import Colwise
from autotp.synth import synthesize
from autotp.synth.api import analyse_model
from autotp.verifier import verify
from test_plain_idioms import DIM, HD, Decoder, tokens
from test_synth_matrix import megatron_fraction

HEADS = 16


class GroupedFusedQKV(nn.Module):
    """``qkv.reshape(b, t, GROUPS, -1)``, split into ``q, v, k`` per group by a width computed from
    the head count, each part viewed into ``heads / GROUPS`` heads and merged into all heads.
    ``GROUPS`` is a constant of the code (a class constant here, a local one in the code this
    stands for): no instance attribute holds it, so nothing can divide it per rank."""

    GROUPS = 4

    def __init__(self, heads: int = HEADS):
        super().__init__()
        self.n_heads, self.head_dim = heads, HD
        self.qkv = nn.Linear(DIM, 3 * heads * HD, bias=False)
        self.out = nn.Linear(heads * HD, DIM, bias=False)

    def split_heads(self, part, b, t):
        return part.reshape(b, t, self.GROUPS, self.n_heads // self.GROUPS, HD).reshape(b, t, -1, HD)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x).reshape(b, t, self.GROUPS, -1)
        q, v, k = qkv.split(self.n_heads * self.head_dim // self.GROUPS, dim=-1)
        q, k, v = (self.split_heads(z, b, t).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, self.n_heads * self.head_dim))


class TwoGroups(GroupedFusedQKV):
    GROUPS = 2


class LiteralHeadsPerGroup(GroupedFusedQKV):
    """The heads per group a literal of the code: per rank no attribute makes the view local."""

    def split_heads(self, part, b, t):
        return part.reshape(b, t, 4, 4, HD).reshape(b, t, -1, HD)


def run(model, tp, sequence_parallel=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = synthesize(model, example_inputs=(tokens(),), tp_size=tp, sequence_parallel=sequence_parallel, verify=False)
        return plan, verify(model, plan, tp_size=tp, example_inputs=(tokens(),))


MODES = [pytest.param(False, id="plain"), pytest.param(True, id="sp")]


@pytest.mark.parametrize("sequence_parallel", MODES)
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("attention", [TwoGroups, GroupedFusedQKV], ids=["2groups", "4groups"])
def test_fixed_groups_are_sharded_within_each_group(attention, tp, sequence_parallel, no_shape_fixes):
    """Would catch: the fused Linear kept whole (fraction far above the bound), a rank given whole
    groups (the code's fixed group count then reads the wrong features), the output Linear's
    columns not permuted like the heads each rank holds, or the head count left global."""
    model = Decoder(attention=attention)
    plan, report = run(model, tp, sequence_parallel)
    assert report.ok, str(report)
    assert max(report.logits_max_abs_diff) <= 1e-4 and report.worst_grad[1] <= 1e-4
    assert max(report.param_fraction) <= megatron_fraction(model, tp) + 0.1, report.param_fraction
    assert max(report.param_fraction) <= 1 / tp + 0.05, (report.param_fraction, plan)
    groups = attention.GROUPS
    width = HEADS * HD // groups
    assert plan["layers.*.attn.qkv"].sizes == (width,) * (3 * groups), plan
    assert plan["layers.*.attn.out"].sizes == (width,) * groups, plan
    assert plan["layers.*.attn"].names == ("n_heads",), plan  # the group count stays
    if tp == 2 and not sequence_parallel:  # the checker reads the plan as the synthesizer meant it
        assert check_plan(model, plan, tp_size=tp, example_inputs=(tokens(),)) == []


def test_a_literal_head_count_per_group_stays_whole(no_shape_fixes):
    """Per rank, ``reshape(b, t, 4, 4, hd)`` of a group's share fails or mixes heads whatever is
    divided: neither reading passes the shape proof, so the projection stays whole, plan exact."""
    model = Decoder(attention=LiteralHeadsPerGroup)
    roles = analyse_model(model, example_inputs=(tokens(),), tp_size=2).roles
    role = roles["layers.0.attn.qkv"]
    assert role.kind == "replicate" and "read per fixed group" in role.reason, role
    plan, report = run(model, 2)
    assert report.ok, str(report)
    assert type(plan["layers.*.mlp.gate"]).__name__ == "ColwiseParallel", plan  # the MLP still sharded


@pytest.mark.parametrize(("heads", "tp"), [(8, 4), (16, 8)], ids=["groups-divide-tp", "fewer-groups-than-tp"])
def test_fewer_heads_per_group_than_ranks_stay_whole(heads, tp, no_shape_fixes):
    """Too few heads per group for tp: no rank can hold a share of every group's heads (and with
    fewer groups than ranks, none can hold whole groups either). The projection stays whole with
    the reason, not the whole plan refused (nor read as kv heads to replicate), and is exact."""
    model = Decoder(attention=lambda: GroupedFusedQKV(heads=heads))
    roles = analyse_model(model, example_inputs=(tokens(),), tp_size=tp).roles
    role = roles["layers.0.attn.qkv"]
    assert role.kind == "replicate" and f"tp={tp} does not divide" in role.reason, role
    plan, report = run(model, tp)
    assert report.ok, str(report)


def test_a_contiguous_row_after_grouped_heads_is_flagged_and_wrong(no_shape_fixes):
    """The output Linear sharded as one block of features while each rank holds a share of every
    group's heads: the checker names it (``packed_row``) and the numbers disagree."""
    model = Decoder(attention=GroupedFusedQKV)
    plan, _ = run(model, 2)
    wrong = {**plan, "layers.*.attn.out": RowwiseParallel()}
    findings = check_plan(model, wrong, tp_size=2, example_inputs=(tokens(),))
    assert [f.kind for f in findings] == ["packed_row"], findings
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        assert not verify(model, wrong, tp_size=2, example_inputs=(tokens(),)).ok
    assert isinstance(plan["layers.*.attn.qkv"], Colwise)


@pytest.mark.parametrize(("attention", "tp"), [(GroupedFusedQKV, 4), (TwoGroups, 2), (LiteralHeadsPerGroup, 2),
                                               (lambda: GroupedFusedQKV(heads=8), 4)],
                         ids=["4groups-4", "2groups-2", "literal-heads-per-group", "8heads-4"])
def test_fixed_groups_whose_count_tp_divides_are_held_whole_per_rank(attention, tp):
    """With the literal rewrite on, a group count tp divides is read plainly: each rank holds whole
    groups, the code's group count (and a literal head count per group) rewritten per rank,
    ``qkv`` and ``out`` plain column / row Linears. Exact, at the bound."""
    model = Decoder(attention=attention)
    plan, report = run(model, tp)
    assert report.ok, str(report)
    assert max(report.param_fraction) <= 1 / tp + 0.01, (report.param_fraction, plan)
    style = plan["layers.*.attn"]
    assert style.literals and type(plan["layers.*.attn.qkv"]).__name__ == "ColwiseParallel", plan


def test_fewer_groups_than_ranks_still_read_per_group():
    """Two groups at tp 4: no rank can hold a whole group, so the rewrite is not proven and the
    per-group reading serves, as before."""
    model = Decoder(attention=TwoGroups)
    plan, report = run(model, 4)
    assert report.ok, str(report)
    assert plan["layers.*.attn.qkv"].sizes == (HEADS * HD // 2,) * 6, plan

