"""Stacked experts whose up and down projections live in two modules, and heads tiled by ``repeat``.

ScatterMoE-style code keeps the experts' stacked up projection and their stacked down projection in
two modules (``ParallelExperts``), each looping ``F.linear(x_e, W[e])`` over the tokens sorted by
expert and joining the outputs with ``cat``; the activation between them runs in the parent. The up
module's output is then this rank's FFN features, handed on local, and the down module makes the
partial sum, reduced once at its exit (``ExpertsParallel(side=...)``).

Attention whose ``r`` query groups read the same kv heads tiles those heads with ``k.repeat(1, r, 1,
1)``: the tiled dim is ``(r, heads)`` merged, sharded on the heads (a fold). The query heads must be
folded the same way, ``(b, t, r, width)`` viewed as ``(b, t, r * heads, hd)``; query heads cut in one
contiguous block would meet other kv heads on each rank, so such an attention stays whole.

Every plan is verified on logits and every gradient at tp 2 and 4, plain and sequence-parallel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp import styles
from autotp.verifier import verify
from tests.synth_toy import DIM, HEADS, example_tokens
from tests.test_attention_variants import Model as VariantModel
from tests.test_loop_experts import Attention, megatron_bound

EXPERTS, TOP_K, FFN, SLOTS = 4, 2, 32, 2
HEAD_DIM = DIM // HEADS


class StackedLinear(nn.Module):
    """One side of the experts: ``weight`` (E, out, in); the tokens come sorted by expert, with
    ``sizes`` tokens per expert, and each expert's rows go through its own weight."""

    def __init__(self, d_in: int, d_out: int):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, d_out, d_in) * d_in ** -0.5)

    def forward(self, x, sizes):
        pieces = x.split(sizes, dim=0)
        return torch.cat([F.linear(pieces[e], self.weight[e]) for e in range(EXPERTS)], dim=0)


class SplitMoE(nn.Module):
    """Top-k routing with a fixed token order per expert (the example tokens route alike on every
    run: the order is a buffer, so the trace needs no data-dependent sizes)."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.up = StackedLinear(DIM, 2 * FFN)
        self.down = StackedLinear(FFN, DIM)

    def forward(self, x):
        b, t, d = x.shape
        x = x.reshape(-1, d)
        n = x.shape[0]
        weights = self.router(x).softmax(-1)
        # Token j goes to experts j % E and (j + 1) % E; sorted by expert, with their expert ids.
        order, experts, sizes = [], [], []
        for e in range(EXPERTS):
            picked = torch.cat([torch.arange(e, n, EXPERTS), torch.arange((e - 1) % EXPERTS, n, EXPERTS)])
            order.append(picked)
            experts.append(torch.full_like(picked, e))
            sizes.append(picked.numel())
        order, experts = torch.cat(order), torch.cat(experts)
        gate, up = self.up(x[order], sizes).chunk(2, dim=-1)
        y = self.down(F.silu(gate) * up, sizes) * weights[order, experts][:, None]
        return torch.zeros_like(x).index_add(0, order, y).view(b, t, d)


class FixedWidthScatterMoE(SplitMoE):
    """The near miss: the up module's rows are scattered into zeros of a fixed width (a number in
    the code, no attribute): each rank would make the global width and add its share into it."""

    def forward(self, x):
        b, t, d = x.shape
        x = x.reshape(-1, d)
        n = x.shape[0]
        order = torch.arange(n).repeat(TOP_K)
        sizes = [order.numel() // EXPERTS] * EXPERTS
        rows = self.up(x[order], sizes)
        rows = torch.zeros(order.numel(), 2 * FFN).index_add(0, torch.arange(order.numel()), rows)
        gate, up = rows.chunk(2, dim=-1)
        y = self.down(F.silu(gate) * up, sizes)
        return torch.zeros_like(x).index_add(0, order, y).view(b, t, d) * self.router(x).sum(-1, keepdim=True).view(b, t, 1)


class PermutedQueryAttention(Attention):
    """The query rows are computed in another token order and put back: picked by index from the
    sharded projection (``q(x)[order]``), then scattered by ``index_add`` into zeros whose width is
    an attribute (``self.width``), divided by tp on each rank."""

    def __init__(self):
        super().__init__()
        self.width = DIM

    def forward(self, x):
        b, t, _ = x.shape
        order = torch.arange(b * t - 1, -1, -1)
        rows = self.q(x).reshape(b * t, -1)[order]
        q = torch.zeros(b * t, self.width).index_add(0, order, rows).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        k, v = (p(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for p in (self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class RoutedQueryAttention(nn.Module):
    """Attention whose query projection is routed (mixture of attention heads): each token picks
    ``TOP_K`` of ``EXPERTS`` stacked query projections, computed on the tokens sorted by expert
    (sizes read from the routing: the code reads values) and scattered back into zeros of the
    attribute width ``self.width``; one k/v projection tiled to the ``TOP_K`` slots; the output
    projected by the chosen experts' stacked rows, weighted and summed back per token."""

    def __init__(self):
        super().__init__()
        self.width = DIM
        self.router = nn.Linear(DIM, EXPERTS, bias=False)
        self.queries, self.outputs = StackedLinear(DIM, DIM), StackedLinear(DIM, DIM)
        self.kv = nn.Linear(DIM, 2 * DIM)

    def route(self, x):
        weights, chosen = self.router(x).topk(TOP_K, dim=-1)
        flat = chosen.flatten()
        sizes = torch.bincount(flat, minlength=EXPERTS).tolist()
        order = flat.argsort(stable=True)
        return order, order // TOP_K, weights.softmax(-1).flatten()[order], sizes

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        order, token, gates, sizes = self.route(flat)
        q = torch.zeros(b * t * TOP_K, self.width).index_add(0, order, self.queries(flat[token], sizes))
        q = q.view(b, t, TOP_K, -1).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        k, v = (h.view(b, t, -1, HEAD_DIM).transpose(1, 2).repeat(1, TOP_K, 1, 1) for h in self.kv(x).chunk(2, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        y = y.reshape(b, t, TOP_K, -1).reshape(-1, self.width)
        out = self.outputs(y[order], sizes) * gates[:, None]
        return torch.zeros_like(flat).index_add(0, token, out).view(b, t, d)


class TiledKVAttention(nn.Module):
    """``SLOTS`` query projections stacked as ``(b, t, SLOTS, width)`` and viewed as ``SLOTS * HEADS``
    heads; k and v projected once and tiled to every slot with ``repeat``; the slots' outputs summed."""

    def __init__(self):
        super().__init__()
        self.queries = nn.ModuleList(nn.Linear(DIM, DIM) for _ in range(SLOTS))
        self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(3))

    def heads(self, x):
        b, t = x.shape[:2]
        q = torch.stack([p(x) for p in self.queries], dim=2).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        k, v = (p(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for p in (self.k, self.v))
        return q, k.repeat(1, SLOTS, 1, 1), v.repeat(1, SLOTS, 1, 1)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.heads(x)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, SLOTS, -1).sum(2))


class BlockQueryTiledKV(TiledKVAttention):
    """The near miss: the query heads come from one projection cut in a contiguous block of
    ``SLOTS * HEADS`` heads (rank r holds slot-major heads), while the tiled k/v hold every slot's
    share: sharded, query head j would meet another kv head on each rank."""

    def __init__(self):
        super().__init__()
        self.queries = nn.ModuleList([nn.Linear(DIM, SLOTS * DIM)])
        self.o = nn.Linear(SLOTS * DIM, DIM)

    def heads(self, x):
        b, t = x.shape[:2]
        q = self.queries[0](x).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        k, v = (p(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for p in (self.k, self.v))
        return q, k.repeat(1, SLOTS, 1, 1), v.repeat(1, SLOTS, 1, 1)

    def forward(self, x):
        b, t, _ = x.shape
        y = F.scaled_dot_product_attention(*self.heads(x), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))  # every head's output, one row Linear


class DenseMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


def toy_model(attention: type[nn.Module] | None = None, mlp: type[nn.Module] | None = None) -> nn.Module:
    """Two pre-norm layers: ``attention`` as the mixer (plain multi-head attention by default) and
    ``mlp`` as the FFN (the experts split over two modules by default)."""
    return VariantModel(attention or Attention, mlp or SplitMoE)


def synthesize_and_verify(model: nn.Module, tp_size: int, sequence_parallel: bool):
    tokens = example_tokens()
    plan = autotp.synthesize(model, example_inputs=(tokens,), tp_size=tp_size, sequence_parallel=sequence_parallel, verify=False)
    report = verify(model, plan, tp_size=tp_size, example_inputs=(tokens,))
    assert report.ok, str(report)
    assert max(report.logits_max_abs_diff) <= 1e-5 and report.worst_grad[1] <= 1e-5, report
    return plan, report


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_experts_split_over_two_modules_are_sharded_and_exact(tp_size, sequence_parallel):
    """Would catch the pair left whole (the cat of per-expert partial sums read as non-linear:
    fraction near 0.9), and the up module's output all-reduced as a partial sum (logits off)."""
    torch.manual_seed(0)
    model = toy_model().eval()
    plan, report = synthesize_and_verify(model, tp_size, sequence_parallel)
    up, down = plan["layers.*.ffn.up"], plan["layers.*.ffn.down"]
    assert isinstance(up, styles.ExpertsParallel) and up.side == "columns" and up.packed == {"weight": 2}, plan
    assert isinstance(down, styles.ExpertsParallel) and down.side == "rows", plan
    bound = megatron_bound(model, tp_size)
    assert all(abs(f - bound) < 0.03 for f in report.param_fraction), (report.param_fraction, bound)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_experts_output_scattered_into_a_fixed_width_stays_whole(tp_size):
    """The near miss stays whole and verifies: without the shape proof over the experts' columns,
    the plan sharded them and the run failed on the zeros' global width."""
    torch.manual_seed(0)
    model = toy_model(mlp=FixedWidthScatterMoE).eval()
    plan, report = synthesize_and_verify(model, tp_size, False)
    assert not {key for key in plan if key.startswith("layers.*.ffn.")}, plan


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_kv_heads_tiled_by_repeat_shard_with_folded_query_heads(tp_size, sequence_parallel):
    """Would catch the tiled k/v kept whole (``repeat`` of the sharded heads refused: the attention
    and its projections whole, fraction far above the bound)."""
    torch.manual_seed(0)
    model = toy_model(TiledKVAttention, DenseMLP).eval()
    plan, report = synthesize_and_verify(model, tp_size, sequence_parallel)
    attention = {key for key in plan if key.startswith("layers.*.mixer.")}
    assert attention == {"layers.*.mixer.k", "layers.*.mixer.v", "layers.*.mixer.o",
                         *(f"layers.*.mixer.queries.{i}" for i in range(SLOTS))}, plan
    bound = megatron_bound(model, tp_size)
    assert all(abs(f - bound) < 0.03 for f in report.param_fraction), (report.param_fraction, bound)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_rows_picked_and_scattered_back_keep_the_feature_shard(tp_size, sequence_parallel):
    """Would catch ``index`` / ``index_add`` taken as ops that need the whole features (the attention
    whole), and the zeros made at the global width on each rank (the run fails on the shapes)."""
    torch.manual_seed(0)
    model = toy_model(PermutedQueryAttention, DenseMLP).eval()
    plan, report = synthesize_and_verify(model, tp_size, sequence_parallel)
    assert isinstance(plan["layers.*.mixer"], styles.ShardCounts) and plan["layers.*.mixer"].names == ("width",), plan
    bound = megatron_bound(model, tp_size)
    assert all(abs(f - bound) < 0.03 for f in report.param_fraction), (report.param_fraction, bound)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_routed_query_attention_is_proven_on_its_values_and_sharded(tp_size, sequence_parallel):
    """Would catch the module left whole because it cannot run on meta (its routing reads values:
    the shape proof now runs it on the captured values), and, under sequence parallel, the width
    division dropped when the block is gathered whole at entry (the run fails on the zeros' width)."""
    torch.manual_seed(0)
    model = toy_model(RoutedQueryAttention, DenseMLP).eval()
    plan, report = synthesize_and_verify(model, tp_size, sequence_parallel)
    style = plan["layers.*.mixer"]
    assert isinstance(style, styles.ShardCounts) and style.names == ("width",), plan
    assert (style.base is not None) == sequence_parallel, style
    assert plan["layers.*.mixer.queries"].side == "columns" and plan["layers.*.mixer.outputs"].side == "rows", plan
    bound = megatron_bound(model, tp_size)
    assert all(abs(f - bound) < 0.03 for f in report.param_fraction), (report.param_fraction, bound)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_query_heads_in_one_block_do_not_meet_tiled_kv_heads(tp_size):
    """The near miss stays whole (and verifies): the tiled k/v's folded heads meet query heads cut
    in one block, a layout the attention does not keep (taken, each rank's query head j would read
    another kv head)."""
    torch.manual_seed(0)
    model = toy_model(BlockQueryTiledKV, DenseMLP).eval()
    plan, report = synthesize_and_verify(model, tp_size, False)
    assert not {key for key in plan if key.startswith("layers.*.mixer.")}, plan


@pytest.mark.parametrize("side", ["columns", "rows"])
def test_one_side_experts_export_as_they_are(side):
    from autotp import emit
    from autotp.plan import describe_style

    style = styles.ExpertsParallel(shard_dims={"weight": 1 if side == "columns" else 2}, packed={}, side=side)
    names: set[str] = set()
    namespace: dict = {}
    source = emit.render(style, names)
    exec("\n".join(emit._imports(names, uses_parts=False)), namespace)
    rebuilt = eval(source, namespace)
    assert rebuilt.side == side and repr(rebuilt) == repr(style) and describe_style(rebuilt) == describe_style(style)


def test_side_options_are_checked():
    with pytest.raises(autotp.errors.PlanError, match="side"):
        styles.ExpertsParallel(side="up")
    with pytest.raises(autotp.errors.PlanError, match="partial sum"):
        styles.ExpertsParallel(shard_dims={"weight": 1}, packed={}, side="columns", once=("bias",))
    with pytest.raises(autotp.errors.PlanError, match="partial_grad_inputs"):
        styles.ExpertsParallel(shard_dims={"weight": 2}, packed={}, side="rows", partial_grad_inputs=True)
