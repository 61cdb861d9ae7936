"""Modules whose code cannot run on per-rank tensors run on DTensors (``autotp.synth.regions``).

Two patterns no per-rank plan can shard, in toy attentions named after no architecture:

- a key selector that scores every key with several query heads against one shared key head,
  weighs the heads and sums them with a ``matmul`` over the heads, then keeps the top-k keys per
  query (under ``no_grad``), or hands the summed scores on as an additive bias (with gradients): a
  partial sum over sharded heads with no module boundary before the op that needs it whole;
- an attention whose fused q/k/v output is cut by a literal group count (``view(b, t, 4, -1)``), one
  head per group, so no integer attribute divided by tp gives per-rank shapes.

Run on DTensors, the selector's query heads and head weights are column-sharded and DTensor
all-reduces the summed scores where the top-k (or the module's output) needs them; the grouped
attention's fused projection is sharded by groups and its output projection by rows. Every plan is
verified on logits and every gradient against the unsharded model at tp 2 and 4, plain and (where a
gather at entry hands the module whole inputs) sequence-parallel, parameters per rank asserted.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from autotp import styles
from autotp.synth.regions import plan_region
from tests.synth_toy import DIM, example_tokens, train_step_runs
from tests.test_attention_variants import Model
from tests.test_split_experts import synthesize_and_verify

HEADS, HEAD_DIM = 4, 16
SELECT_HEADS, SELECT_DIM, TOPK = 8, 16, 6
GROUPS = 4


def causal_bias(t: int) -> torch.Tensor:
    return torch.full((t, t), float("-inf")).triu(1)


class KeySelector(nn.Module):
    """Per-head relu scores of every key against one shared key head, weighed per head and summed
    over the heads by a matmul; the top-k keys per query kept (an additive 0 / -inf mask)."""

    def __init__(self, differentiable: bool = False):
        super().__init__()
        self.differentiable = differentiable
        self.query = nn.Linear(DIM, SELECT_HEADS * SELECT_DIM, bias=False)
        self.key = nn.Linear(DIM, SELECT_DIM, bias=False)
        self.head_weights = nn.Linear(DIM, SELECT_HEADS, bias=False)

    def scores(self, x):
        b, t, _ = x.shape
        q = self.query(x).view(b, t, SELECT_HEADS, SELECT_DIM)
        k = self.key(x)
        per_head = F.relu(q @ k.transpose(-1, -2).unsqueeze(1))  # (b, t, heads, t)
        return (self.head_weights(x).unsqueeze(-2) @ per_head).squeeze(-2) * SELECT_DIM ** -0.5  # (b, t, t)

    def forward(self, x):
        if self.differentiable:
            return self.scores(x).unsqueeze(1)  # an additive bias, with gradients
        with torch.no_grad():
            total = self.scores(x) + causal_bias(x.shape[1])
            keep = total.topk(TOPK, dim=-1).indices
            return torch.full_like(total, float("-inf")).scatter(-1, keep, 0.0).unsqueeze(1)


class SelectedAttention(nn.Module):
    def __init__(self, differentiable: bool = False):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.selector = KeySelector(differentiable)
        self.heads = HEADS

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(2, 3) * HEAD_DIM ** -0.5 + causal_bias(t) + self.selector(x)
        y = scores.softmax(dim=-1) @ v
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class ScoredAttention(SelectedAttention):
    def __init__(self):
        super().__init__(differentiable=True)


class LiteralGroupAttention(nn.Module):
    """A fused q/k/v cut into a literal 4 groups, each ``[q | k | v]`` of its heads (one head each)."""

    def __init__(self):
        super().__init__()
        self.qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, 4, -1)
        q, k, v = qkv.split(DIM // 4, dim=-1)
        q, k, v = (y.reshape(b, t, 4, -1, HEAD_DIM).reshape(b, t, -1, HEAD_DIM).transpose(1, 2) for y in (q, k, v))
        probs = (q @ k.transpose(2, 3) * HEAD_DIM ** -0.5 + causal_bias(t)).softmax(dim=-1)
        return self.out((probs @ v).transpose(1, 2).reshape(b, t, DIM))


def fraction(model: nn.Module, tp_size: int, whole=("selector.key",)) -> float:
    """Parameters per rank with every Linear weight and the embedding sharded but ``whole`` (the
    selector's one shared key head, kept whole as a shared kv head is)."""
    sharded = {id(m.weight) for name, m in model.named_modules() if isinstance(m, (nn.Linear, nn.Embedding))
               and not any(name.endswith(w) for w in whole)}
    total = sum(p.numel() for p in model.parameters())
    split = sum(p.numel() for p in model.parameters() if id(p) in sharded)
    return (total - split + split / tp_size) / total


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("mixer", [SelectedAttention, ScoredAttention], ids=["top_k", "bias"])
def test_head_summing_selector_runs_on_dtensors(mixer, tp_size, sequence_parallel):
    """Would catch the selector left whole (its query heads are 40% of the model: fraction far above
    the bound), and its summed scores taken per rank or reduce-scattered onto the batch by DTensor's
    cheapest ``topk`` strategy (logits off, or a sharded mask meeting plain tensors).

    With gradients through the summed scores, the attention around the selector stays whole: the
    whole bias it adds meets its sharded heads, and run as one region DTensor's own backward would
    reduce-scatter and gather the partial gradients (refused by the planner's backward run). The
    selector alone is the region, its input gradient all-reduced once."""
    torch.manual_seed(0)
    model = Model(mixer).eval()
    plan, report = synthesize_and_verify(model, tp_size, sequence_parallel)
    regions = {k: v for k, v in plan.items() if isinstance(v, styles.DTensorRegion)}
    assert list(regions) == ["layers.*.mixer.selector"], plan
    assert regions["layers.*.mixer.selector"].params == {"query.weight": 0, "head_weights.weight": 0}
    whole = ("selector.key",)
    if mixer is SelectedAttention:
        assert isinstance(plan["layers.*.mixer.q"], ColwiseParallel) and isinstance(plan["layers.*.mixer.o"], RowwiseParallel)
    else:
        whole += ("mixer.q", "mixer.k", "mixer.v", "mixer.o")
    expected = fraction(model, tp_size, whole)
    assert all(abs(f - expected) < 0.01 for f in report.param_fraction), (report.param_fraction, expected)
    if mixer is SelectedAttention:  # the selector has no backward; the rest is the Megatron layout
        assert report.comm_volume_backward <= report.comm_volume, (report.comm_volume, report.comm_volume_backward)
        if not sequence_parallel:  # per layer: the summed scores once (read twice), attention, MLP; the embedding
            assert report.collectives == {"all_reduce": 2 * 3 + 1}, report.collectives


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_literal_group_count_runs_on_dtensors(tp_size, sequence_parallel, no_shape_fixes):
    """Would catch the attention left whole (fraction ~0.6), a per-rank run of the literal
    ``view(b, t, 4, -1)`` (wrong q / k / v columns: logits off), and under SP the gather its whole
    Linear made not taken over at the region's entry (DTensor then gathers inside: right values,
    but more bytes backward than forward). With the literal rewrite off: on, the literal group count
    is rewritten per rank instead (``test_literal_group_count_is_rewritten_per_rank``)."""
    torch.manual_seed(0)
    model = Model(LiteralGroupAttention).eval()
    plan, report = synthesize_and_verify(model, tp_size, sequence_parallel)
    assert plan["layers.*.mixer"].params == {"qkv.weight": 0, "out.weight": 1}, plan
    expected = fraction(model, tp_size, whole=())
    assert all(abs(f - expected) < 0.01 for f in report.param_fraction), (report.param_fraction, expected)
    assert report.comm_volume_backward <= report.comm_volume, (report.comm_volume, report.comm_volume_backward)
    if not sequence_parallel:  # the output projection's partial sum is all-reduced once, as a row's is
        assert report.collectives["all_reduce"] == 1 + 2 * 2, report.collectives


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_literal_group_count_is_rewritten_per_rank(sequence_parallel):
    """The same attention with the literal rewrite on: each rank holds whole groups, the literal
    counts (``view(b, t, 4, -1)``, the merge-back width) rewritten per rank, no DTensor region; the
    same collectives as the region's, at the bound, exact."""
    torch.manual_seed(0)
    model = Model(LiteralGroupAttention).eval()
    plan, report = synthesize_and_verify(model, 2, sequence_parallel)
    assert plan["layers.*.mixer"].literals and not any(isinstance(s, styles.DTensorRegion) for s in plan.values())
    expected = fraction(model, 2, whole=())
    assert all(abs(f - expected) < 0.01 for f in report.param_fraction), (report.param_fraction, expected)
    assert report.comm_volume_backward <= report.comm_volume, (report.comm_volume, report.comm_volume_backward)
    if not sequence_parallel:
        assert report.collectives["all_reduce"] == 1 + 2 * 2, report.collectives


def test_metadata_runs_leave_real_meshes_alone():
    """While a region is planned, a redistribution on any other mesh (a real run in another thread)
    still communicates: would catch the recording answering it with an empty tensor."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from autotp import _simulate
    from autotp.synth.regions import _recorded_redistributions

    with _simulate.simulated_mesh(2) as mesh:
        partial = DTensor.from_local(torch.ones(3), mesh, [Partial()], run_check=False)
        log: list = []
        with _recorded_redistributions(log):
            whole = partial.redistribute(placements=[Replicate()]).to_local()
        assert log == [] and torch.equal(_simulate.per_rank(whole, 2)[1], torch.full((3,), 2.0))


def test_region_is_planned_from_the_graph_alone():
    """The planner alone, on the traced graph (no process group is up): the selector's heads and head
    weights sharded, the shared key head whole, one all-reduce (the summed scores, before the top-k).
    Would catch the key head sharded too (its shard meets the heads' in the score matmul) and the
    partial sum reduce-scattered by DTensor's cheapest strategy (counted as refused)."""
    from autotp.synth.pipeline import run
    from tests.synth_toy import example_tokens

    analysis = run(Model(SelectedAttention).eval(), example_inputs=(example_tokens(),), tp_size=4)
    region = plan_region(analysis.graph, "layers.0.mixer.selector", 4)
    assert region is not None and dict(region.params) == {"query.weight": 0, "head_weights.weight": 0}
    assert region.reductions == 1


class ParallelGroupBlock(nn.Module):
    """A parallel block (attention and MLP read one norm; both outputs summed into the residual)
    whose attention reshapes by a literal group count, so that with the literal rewrite off (the
    tests below) it can only run as a DTensor region. With ``dropout`` the MLP branch passes through
    one (live in training) before the sum."""

    def __init__(self, dropout: bool):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn = LiteralGroupAttention()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)
        self.drop = nn.Dropout(0.25) if dropout else nn.Identity()

    def forward(self, x):
        h = self.norm(x)
        return x + (self.attn(h) + self.drop(self.down(F.gelu(self.up(h)))))


class ParallelGroupModel(Model):
    def __init__(self, dropout: bool):
        super().__init__(LiteralGroupAttention)
        self.layers = nn.ModuleList(ParallelGroupBlock(dropout) for _ in range(2))


@pytest.mark.parametrize("dropout", [False, True], ids=["sum", "dropout"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_region_branch_of_a_parallel_block_is_reduced_with_the_other(tp_size, sequence_parallel, dropout,
                                                                    no_shape_fixes):
    """Would catch the region all-reducing its output on its own (two reductions per layer forward:
    5 all-reduces plain, an extra all-reduce per layer under SP) and, under SP, the region and the MLP
    each gathering the norm's output (two all-gathers per layer). Per layer one reduction forward and
    one backward, plus the vocab-parallel embedding's (plain) or the embedding and head's (SP)."""
    torch.manual_seed(0)
    model = ParallelGroupModel(dropout).eval()
    plan, report = synthesize_and_verify(model, tp_size, sequence_parallel)
    region = plan["layers.*.attn"]
    assert isinstance(region, styles.DTensorRegion) and region.partial_outputs, plan
    assert region.params == {"qkv.weight": 0, "out.weight": 1}, plan
    assert isinstance(plan["layers.*.down"], styles.Rowwise) and plan["layers.*.down"].output_layouts == (Partial(),), plan
    expected = fraction(model, tp_size, whole=())
    assert all(abs(f - expected) < 0.01 for f in report.param_fraction), (report.param_fraction, expected)
    if sequence_parallel:
        once = {"reduce_scatter_tensor": 3, "all_gather_into_tensor": 3}
    else:
        once = {"all_reduce": 3}
    assert report.collectives == once and report.collectives_backward == once, report
    assert report.comm_volume_backward == report.comm_volume, report
    if dropout:  # in training the MLP's partial sum is reduced before its dropout; the region's stays
        train_step_runs(model, plan, tp_size, example_tokens())


class DroppedGroupAttention(LiteralGroupAttention):
    """The grouped attention with a dropout on its output (live in training)."""

    def __init__(self):
        super().__init__()
        self.drop = nn.Dropout(0.25)

    def forward(self, x):
        return self.drop(super().forward(x))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_region_reduces_before_its_own_live_dropout(sequence_parallel, no_shape_fixes):
    """A region whose output passes through a dropout with ``p > 0`` inside it cannot hand on a
    partial sum (the mask must apply to the whole): it reduces at its output as before, the block
    keeps a reduction per branch, and a training step runs, every rank holding the same logits."""
    torch.manual_seed(0)
    model = ParallelGroupModel(False)
    for layer in model.layers:
        layer.attn = DroppedGroupAttention()
    model.eval()
    plan, report = synthesize_and_verify(model, 2, sequence_parallel)
    assert isinstance(plan["layers.*.attn"], styles.DTensorRegion) and not plan["layers.*.attn"].partial_outputs, plan
    train_step_runs(model, plan, 2, example_tokens())
