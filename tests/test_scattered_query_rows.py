"""An attention whose query comes from a low-rank pair (a down-projection, a norm, an up-projection)
whose latent a second up-projection reads too, with a per-head output gate and an eager score
matmul masked by a top-k selection. Keeping the latent sharded (the down-projection a column, both
up-projections rows) and the heads sharded (k, v, gate, o) needs the query's row reduce-scattered
onto the heads; the gate, dropped in the round where the attention was still whole, is revived
once the heads reach it; the selection mask, computed from a Linear only through top-k indices,
gets no gradient and may meet the heads. Verified on logits and every gradient at tp 2 and 4,
plain and sequence-parallel."""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.synth_toy import DIM, HEADS
from tests.test_per_head_rows import Model, _synthesize_and_verify
from tests.test_synth_matrix import megatron_fraction

HEAD_DIM = DIM // HEADS
LATENT = DIM // 2
KEEP = 6  # keys each query may attend to, chosen by the selector


class RMSNorm(nn.Module):
    """A norm over the latent written out (mean of squares, ``rsqrt``, weight): its statistic is
    all-reduced where the latent is sharded."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width)), eps

    def forward(self, x):
        return self.weight * (x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps))


class LatentQueryAttention(nn.Module):
    """``q = up(norm(down(x)))`` viewed into heads; ``aux(norm(down(x)))`` a second reader of the
    latent, added to the output; ``gate(x)`` a per-head sigmoid gate on the attention output; the
    scores masked to the top ``KEEP`` keys of a selector's scores (indices only: no gradient)."""

    def __init__(self):
        super().__init__()
        self.down = nn.Linear(DIM, LATENT, bias=False)
        self.norm = RMSNorm(LATENT)
        self.up, self.aux = nn.Linear(LATENT, DIM, bias=False), nn.Linear(LATENT, DIM, bias=False)
        self.k, self.v, self.gate, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))
        self.select = nn.Linear(DIM, HEAD_DIM, bias=False)

    def keep_mask(self, x, causal):
        s = self.select(x)
        scores = (s @ s.transpose(-1, -2)).masked_fill(~causal, float("-inf"))
        picked = scores.topk(min(KEEP, x.shape[1]), dim=-1).indices
        return torch.ones_like(scores, dtype=torch.bool).scatter(-1, picked, False)  # True: dropped

    def forward(self, x):
        b, t, _ = x.shape
        latent = self.norm(self.down(x))
        q = self.up(latent).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        k, v = (p(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for p in (self.k, self.v))
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        mask = torch.zeros(b, 1, t, t, device=x.device).masked_fill(~causal, float("-inf"))
        mask = mask.masked_fill(self.keep_mask(x, causal)[:, None], float("-inf"))
        weights = torch.softmax(q @ k.transpose(-1, -2) * HEAD_DIM**-0.5 + mask, dim=-1)
        y = (weights @ v).transpose(1, 2)  # (b, t, heads, hd)
        y = y * torch.sigmoid(self.gate(x).view(b, t, -1, HEAD_DIM))
        return self.o(y.reshape(b, t, -1)) + self.aux(latent)


class QueryReadWholeAttention(LatentQueryAttention):
    """The near miss: the query is also summed over all its features (every head) into the output.
    Scattered onto the heads, each rank would sum its own heads only: it must be reduced whole."""

    def forward(self, x):
        b, t, _ = x.shape
        out = super().forward(x)
        return out + self.up(self.norm(self.down(x))).sum(-1, keepdim=True)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_query_row_is_scattered_onto_the_heads(tp_size, sequence_parallel):
    """The latent stays sharded (down a column, up and aux rows), the query's row reduce-scattered
    onto the heads, and k, v, gate, o sharded by heads: about 1/tp of the parameters per rank.
    Would catch the heads kept whole because the query arrives reduced (whole) at the score matmul,
    the gate left whole after the round where the attention was whole, or the selection mask taken
    for a value whose gradient would stay a per-rank partial sum."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    plan, report = _synthesize_and_verify(LatentQueryAttention, tp_size, sequence_parallel)
    assert all(f"layers.*.mixer.{name}" in plan for name in ("down", "up", "aux", "k", "v", "gate", "o")), sorted(plan)
    up = plan["layers.*.mixer.up"]
    assert isinstance(up, RowwiseParallel) and up.output_layouts == (Shard(-1),), up
    assert max(report.param_fraction) <= megatron_fraction(Model(LatentQueryAttention), tp_size) + 0.1, \
        (report.param_fraction, plan)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_query_read_whole_elsewhere_is_reduced_whole(tp_size, sequence_parallel):
    """The query is also summed over every head: its row must not be left scattered on the heads,
    and the plan must stay exact. Would catch a row scattered whatever else reads its output."""
    from torch.distributed.tensor import Shard

    plan, _ = _synthesize_and_verify(QueryReadWholeAttention, tp_size, sequence_parallel)
    assert getattr(plan.get("layers.*.mixer.up"), "output_layouts", None) != (Shard(-1),), plan.get("layers.*.mixer.up")
