"""A projection viewed into heads whose heads dim is then cut into equal parts (``chunk``), each part
read by its own attention and the results recombined (a differential attention's two value halves):
the projection's rows are laid out per part, each part sharded over the ranks, when tp divides each
part's heads; otherwise it stays whole. Verified on logits and every gradient at tp 2 and 4, plain
and sequence-parallel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from tests.synth_toy import DIM, example_tokens
from tests.test_per_head_rows import Model
from tests.test_per_head_rows import _synthesize_and_verify as _plan_and_report
from tests.test_synth_matrix import megatron_fraction


class HalvedValues(nn.Module):
    """Queries and keys of ``heads`` heads; values projected to ``2 * heads`` heads, viewed into
    heads and chunked in two along them; one attention per half, combined as ``y1 - lam * y2``."""

    def __init__(self, heads: int = 4):
        super().__init__()
        self.head_dim = DIM // heads
        self.q, self.k, self.o = nn.Linear(DIM, DIM), nn.Linear(DIM, DIM), nn.Linear(DIM, DIM)
        self.v = nn.Linear(DIM, 2 * DIM)
        self.lam = nn.Parameter(torch.tensor(0.3))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        v1, v2 = torch.chunk(v, 2, dim=1)
        y = F.scaled_dot_product_attention(q, k, v1, is_causal=True) \
            - self.lam * F.scaled_dot_product_attention(q, k, v2, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class FewHeadsHalvedValues(HalvedValues):
    """The same with 2 query heads and 4 value heads: each half holds 2 heads, which tp=4 does not
    divide (a rank would hold half a head of each half)."""

    def __init__(self):
        super().__init__(heads=2)


class ScaledHalvedValues(HalvedValues):
    """A per-head scale over all ``2 * heads`` value heads before the chunk: a rank holding a share
    of each half holds heads of both, which a contiguous shard of the scale would not match."""

    def __init__(self):
        super().__init__()
        self.head_scale = nn.Parameter(torch.rand(8))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        v1, v2 = torch.chunk(v * self.head_scale[:, None, None], 2, dim=1)
        y = F.scaled_dot_product_attention(q, k, v1, is_causal=True) \
            - self.lam * F.scaled_dot_product_attention(q, k, v2, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class SwappedHalvesValues(HalvedValues):
    """The halves joined back in the other order and read by queries of ``2 * heads`` heads: each
    rank's joined values are not the heads its queries pair with in a contiguous shard."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.o = nn.Linear(DIM, 2 * DIM), nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        v1, v2 = torch.chunk(v, 2, dim=1)
        y = F.scaled_dot_product_attention(q, k, torch.cat([v2, v1], dim=1), is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


def _synthesize_and_verify(mixer, tp_size, sequence_parallel):
    """The toy model of ``mixer`` (built as the verified one was), its plan and that plan's report."""
    plan, report = _plan_and_report(mixer, tp_size, sequence_parallel)
    torch.manual_seed(0)
    return Model(mixer).eval(), plan, report


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_heads_chunked_in_equal_parts_shard_each_part(tp_size, sequence_parallel):
    """The value projection is packed in two parts (each rank a share of each half), q, k and o
    sharded by heads: about 1/tp of the parameters per rank. Would catch the value projection kept
    whole (the chunk read as a cut of a contiguous shard), or a contiguous shard of the values, whose
    halves would then pair each rank's queries with another rank's values."""
    from autotp.styles import Colwise

    model, plan, report = _synthesize_and_verify(HalvedValues, tp_size, sequence_parallel)
    assert all(f"layers.*.mixer.{name}" in plan for name in ("q", "k", "v", "o")), sorted(plan)
    assert isinstance(plan["layers.*.mixer.v"], Colwise), plan["layers.*.mixer.v"]
    assert max(report.param_fraction) <= megatron_fraction(model, tp_size) + 0.1, (report.param_fraction, plan)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_heads_parts_tp_does_not_divide_stay_whole(sequence_parallel):
    """Halves of 2 heads at tp=4: no rank can hold a share of each half, so the attention stays
    whole (not refused) and the plan is exact. Would catch the parts sharded all the same."""
    from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

    model, plan, _ = _synthesize_and_verify(FewHeadsHalvedValues, 4, sequence_parallel)
    mixer = [style for key, style in plan.items() if key.startswith("layers.*.mixer.")]
    assert not any(isinstance(style, (ColwiseParallel, RowwiseParallel)) for style in mixer), sorted(plan)
    explained = {r.key: r for r in autotp.explain(model, example_inputs=(example_tokens(),), tp_size=4,
                                                         sequence_parallel=sequence_parallel)}
    assert "tp=4 does not divide" in explained["layers.*.mixer.v"].reason, explained["layers.*.mixer.v"].reason


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_heads_parts_of_two_heads_shard_at_tp_2(sequence_parallel):
    """The same model at tp=2 (one head of each half per rank) is sharded: the divisibility is
    per part, not all or nothing."""
    _, plan, _ = _synthesize_and_verify(FewHeadsHalvedValues, 2, sequence_parallel)
    assert all(f"layers.*.mixer.{name}" in plan for name in ("q", "k", "v", "o")), sorted(plan)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("mixer", [ScaledHalvedValues, SwappedHalvesValues], ids=["scaled", "swapped"])
def test_heads_parts_near_misses_stay_exact(mixer, sequence_parallel):
    """A per-head parameter over the heads of both parts, or the parts joined back out of order:
    the values are not sharded per part (the plan stays exact at tp=4). Would catch the parameter
    sharded contiguously, or queries paired with another rank's values."""
    from autotp.styles import Colwise

    _, plan, _ = _synthesize_and_verify(mixer, 4, sequence_parallel)
    assert not isinstance(plan.get("layers.*.mixer.v"), Colwise), plan.get("layers.*.mixer.v")
