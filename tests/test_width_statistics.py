"""A block that takes per-token statistics over its sharded width all-reduces them, exactly.

The toy MLP sparsifies its gate activation by its own statistics over the intermediate width
(``relu(g - (mean(g) + k * std(g)))``), as activation-sparse feed-forwards do. With the gate
column-parallel, each rank holds a slice of that width: the mean and standard deviation are
all-reduced partial sums (a ``(b, t, 1)`` tensor each, each way), and the block is sharded like any
MLP. Every plan is verified on logits and every gradient against the unsharded model at tp 2 and 4,
plain and sequence-parallel. A block reducing its width otherwise (a median, a max, a top-k, or a
mean read by a Linear) keeps its Linears whole, and stays exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from autotp import styles
from autotp.check import check_plan
from autotp.synth import synthesize
from synth_toy import DIM, VOCAB, TitanAttention, example_tokens
from test_partial_sums import _run  # synthesize, then verify (logits and every gradient)

HIDDEN = 4 * DIM


class SparseGateMLP(nn.Module):
    """gate / up / down, the gate activation cut at a cutoff from its own statistics.

    ``statistic`` picks how the cutoff is taken over the intermediate width: ``"std"`` (mean and
    standard deviation), ``"var"`` (the same by ``var_mean``, biased), ``"rms"`` (a root mean
    square as a sum of squares, not kept dim); the guards ``"median"``, ``"amax"``, ``"topk"`` (no
    sum over the width) and ``"read"`` (a mean also fed to a Linear) need the whole vector.
    """

    def __init__(self, statistic: str = "std"):
        super().__init__()
        self.statistic = statistic
        self.gate_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.up_proj = nn.Linear(DIM, HIDDEN, bias=False)
        self.down_proj = nn.Linear(HIDDEN, DIM, bias=False)
        self.scale_proj = nn.Linear(1, DIM, bias=False)

    def cutoff(self, g):
        k = torch.tensor(0.4, device=g.device).type(g.dtype)
        if self.statistic == "std":
            return torch.mean(g, dim=-1, keepdim=True) + torch.std(g, dim=-1, keepdim=True, unbiased=False) * k
        if self.statistic == "var":
            var, mean = torch.var_mean(g, dim=-1, keepdim=True, correction=0)
            return mean + var.sqrt() * k
        if self.statistic == "rms":
            return (g.pow(2).sum(-1) / g.shape[-1]).sqrt().unsqueeze(-1) * k
        if self.statistic == "median":
            return g.median(dim=-1, keepdim=True).values
        if self.statistic == "amax":
            return g.amax(dim=-1, keepdim=True) * k
        if self.statistic == "topk":
            return g.topk(8, dim=-1).values[..., -1:]
        return g.mean(dim=-1, keepdim=True)  # "read": its caller's Linear reads it too

    def forward(self, x):
        g = self.gate_proj(x)
        cut = self.cutoff(g)
        out = self.down_proj(F.silu(F.relu(g - cut)) * self.up_proj(x))
        return out + self.scale_proj(cut) if self.statistic == "read" else out


class Block(nn.Module):
    def __init__(self, statistic):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attn, self.mlp = TitanAttention(), SparseGateMLP(statistic)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mlp(self.n2(x))


class SparseGateLM(nn.Module):
    def __init__(self, statistic: str = "std"):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(statistic) for _ in range(2))
        self.norm, self.head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_gate_sparsified_by_its_own_mean_and_std_is_sharded(tp, sequence_parallel):
    """Would catch a statistic read from one rank's slice (wrong logits), its gradient left a
    per-rank partial sum or counted tp times (wrong gate gradient), or the MLP kept whole."""
    plan, report = _run(SparseGateLM("std"), tp, sequence_parallel)
    assert isinstance(plan["layers.*.mlp"], styles.ShardedStatistics), plan
    assert isinstance(plan["layers.*.mlp.gate_proj"], ColwiseParallel), plan
    assert all(abs(f - 1 / tp) < 0.03 for f in report.param_fraction), report.param_fraction


@pytest.mark.parametrize("statistic", ["var", "rms"])
def test_other_sum_based_statistics_are_sharded(statistic):
    """``var_mean`` and a sum of squares without keepdim are partial sums too."""
    for tp, sequence_parallel in ((2, False), (4, True)):
        plan, report = _run(SparseGateLM(statistic), tp, sequence_parallel)
        assert isinstance(plan["layers.*.mlp"], styles.ShardedStatistics), plan
        assert all(abs(f - 1 / tp) < 0.03 for f in report.param_fraction), report.param_fraction


def test_statistics_cost_a_small_all_reduce_each_way():
    """Per layer, the mean and the two passes of the std: three all-reduces of a (b, t, 1)
    statistic forward and three backward, on top of the plain MLP's; the backward moves no more
    bytes than the forward does (no statistic's gradient spread over the width)."""
    _, report = _run(SparseGateLM("std"), 2, False)
    tokens = example_tokens().numel()
    assert report.collectives["all_reduce"] == 1 + 2 * (2 + 3), report  # embedding; attention, MLP, 3 statistics
    assert report.collectives_backward["all_reduce"] <= report.collectives["all_reduce"] + 2, report
    stats = 3 * 2 * tokens * 4  # 3 fp32 statistics per layer, 2 layers
    assert report.comm_volume_backward <= report.comm_volume + 2 * stats, report


@pytest.mark.parametrize("statistic", ["median", "amax", "topk", "read"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_statistics_that_need_the_whole_width_keep_the_mlp_whole(statistic, sequence_parallel):
    """Default-deny: a median, max or top-k is no sum of per-rank parts, and a mean that a Linear
    reads too would hand that Linear a replicated value whose gradient the style all-reduces as
    a partial one: the gate stays whole, the plan exact."""
    plan, report = _run(SparseGateLM(statistic), 2, sequence_parallel)
    assert "ShardedStatistics" not in repr(plan.get("layers.*.mlp")), plan
    assert "layers.*.mlp.gate_proj" not in plan, plan


def test_check_flags_a_plan_that_shards_the_statistics_without_their_style():
    """Would catch ``check_plan`` passing a hand-written plan whose MLP reads statistics of one
    rank's slice (silently wrong values); the synthesized plan passes."""
    model = SparseGateLM("std")
    synthesized = synthesize(model, example_inputs=(example_tokens(),), tp_size=2, verify=False)
    assert check_plan(model, synthesized, tp_size=2, example_inputs=(example_tokens(),)) == []
    plan = {"layers.*.mlp.gate_proj": ColwiseParallel(), "layers.*.mlp.up_proj": ColwiseParallel(),
            "layers.*.mlp.down_proj": RowwiseParallel()}
    findings = check_plan(model, plan, tp_size=2, example_inputs=(example_tokens(),))
    assert [(f.kind, f.module) for f in findings] == [("width_stats_style", "layers.0.mlp")], findings
