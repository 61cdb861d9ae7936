"""A query compressed to a low rank, one shared key/value head, and a grouped output projection.

The attention reads its query through a low-rank pair (``up(norm(down(x)))``), its one key/value
head through a norm and a rotary embedding (the same tensor read as key and value by every query
head), joined with a few summary keys made by a module of whole Linears, per-head sink logits, and
an output projected in two steps: each group of heads by its own block of one weight (a ``bmm`` over
``weight.view(groups, -1, width)``, no ``F.linear``), then one Linear over the groups.

Megatron's layout shards the heads: the up-projection by heads, the grouped block and the sinks
with them, the last projection as a row; the down-projection, the key/value head and the summary
stay whole, and their gradients, each rank's heads' share, are all-reduced where they leave their
modules. Taking the low-rank pair as a column / row pair instead (the first reading the propagation
finds) shards only the small pair and leaves the heads and the large output projections whole.

Every plan is verified on logits and every gradient against the unsharded model at tp 2 and 4,
plain and sequence-parallel, with the parameters per rank asserted at the bound.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from tests.synth_toy import DIM
from tests.test_attention_variants import Model
from tests.test_split_experts import synthesize_and_verify

HEADS, HEAD_DIM, RANK, GROUPS, GROUP_RANK, SUMMARY = 8, 16, 16, 4, 32, 4


def rotate(x: torch.Tensor) -> torch.Tensor:
    t, half = x.shape[-2], x.shape[-1] // 2
    angle = torch.arange(t, dtype=x.dtype)[:, None] * (1e-2 * torch.arange(1, half + 1, dtype=x.dtype))
    cos, sin = angle.cos().repeat(1, 2), angle.sin().repeat(1, 2)
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class GroupedProjection(nn.Linear):
    """Block-diagonal: group ``g`` of the input (``(b, t, groups, width)``) through rows ``g`` of one weight."""

    def __init__(self, width: int, out_per_group: int, groups: int):
        super().__init__(width, groups * out_per_group, bias=False)
        self.groups = groups

    def forward(self, x):
        b, t, _, width = x.shape
        w = self.weight.view(self.groups, -1, width).transpose(1, 2)
        y = torch.bmm(x.reshape(-1, self.groups, width).transpose(0, 1), w).transpose(0, 1)
        return y.reshape(b, t, -1)


class Summary(nn.Module):
    """A few keys summarising the sequence (whole Linears), and a mask that carries no gradient."""

    def __init__(self):
        super().__init__()
        self.proj, self.gate = nn.Linear(DIM, HEAD_DIM, bias=False), nn.Linear(DIM, SUMMARY, bias=False)

    def forward(self, x):
        weights = self.gate(x).softmax(dim=1)  # (b, t, SUMMARY): a soft pooling over positions
        keys = weights.transpose(1, 2) @ self.proj(x)  # (b, SUMMARY, hd)
        return keys.unsqueeze(1), keys.new_zeros(x.shape[0], 1, x.shape[1], SUMMARY)


class LowRankQueryAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads, self.groups = HEADS, GROUPS
        self.q_down, self.q_norm = nn.Linear(DIM, RANK, bias=False), nn.RMSNorm(RANK)
        self.q_up = nn.Linear(RANK, HEADS * HEAD_DIM, bias=False)
        self.kv, self.kv_norm = nn.Linear(DIM, HEAD_DIM, bias=False), nn.RMSNorm(HEAD_DIM)
        self.summary = Summary()
        self.sinks = nn.Parameter(torch.randn(HEADS) * 0.1)
        self.out_groups = GroupedProjection(HEADS * HEAD_DIM // GROUPS, GROUP_RANK, GROUPS)
        self.out = nn.Linear(GROUPS * GROUP_RANK, DIM, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = rotate(self.q_up(self.q_norm(self.q_down(x))).view(b, t, -1, HEAD_DIM).transpose(1, 2))
        kv = rotate(self.kv_norm(self.kv(x)).view(b, t, 1, HEAD_DIM).transpose(1, 2))
        summary, bias = self.summary(x)
        kv = torch.cat([kv, summary], dim=2)  # (b, 1, t + SUMMARY, hd)
        kv = kv[:, :, None].expand(b, 1, self.heads, kv.shape[2], HEAD_DIM).reshape(b, self.heads, -1, HEAD_DIM)
        causal = torch.full((t, t), float("-inf")).triu(1)
        scores = q @ kv.transpose(2, 3) * HEAD_DIM ** -0.5 + torch.cat([causal.expand(b, 1, t, t), bias], dim=-1)
        sinks = self.sinks.view(1, -1, 1, 1).expand(b, -1, t, 1)
        probs = torch.cat([scores, sinks], dim=-1).softmax(dim=-1)[..., :-1]
        y = (probs @ kv).transpose(1, 2).reshape(b, t, self.groups, -1)
        return self.out(self.out_groups(y))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(DIM, 64), nn.Linear(DIM, 64), nn.Linear(64, DIM)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


def bound(model: nn.Module, tp_size: int) -> float:
    """Parameters per rank with every weight sharded but the down-projection, the key/value head
    and the summary, kept whole as Megatron keeps a low-rank down-projection and a shared kv head."""
    whole = {id(p) for name, p in model.named_parameters()
             if not name.endswith("weight") or p.dim() < 2 or any(k in name for k in ("q_down", ".kv.", "summary"))}
    whole -= {id(m.sinks) for m in model.modules() if isinstance(m, LowRankQueryAttention)}
    total = sum(p.numel() for p in model.parameters())
    kept = sum(p.numel() for p in model.parameters() if id(p) in whole)
    return (kept + (total - kept) / tp_size) / total


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_low_rank_query_heads_are_sharded_by_heads(tp_size, sequence_parallel):
    """Would catch the low-rank pair taken as the column / row pair (fraction ~0.9: the heads and the
    grouped output whole), the shared kv head's gradient left a per-rank share (its norm's and
    Linear's gradients off), the grouped weight read whole (not a shard), and the output's row
    reduced as an inner row under SP (a plain tensor meeting the sequence-sharded stream)."""
    torch.manual_seed(0)
    model = Model(LowRankQueryAttention, MLP).eval()
    plan, report = synthesize_and_verify(model, tp_size, sequence_parallel)
    assert isinstance(plan["layers.*.mixer.q_up"], ColwiseParallel), plan
    assert isinstance(plan["layers.*.mixer.out"], RowwiseParallel), plan
    assert plan["layers.*.mixer.out_groups"].shard_dims == {"weight": 0}, plan
    assert set(plan["layers.*.mixer"].counts) == {"heads", "groups", "out_groups.groups"}, plan
    assert "layers.*.mixer.q_down" not in plan or not isinstance(plan["layers.*.mixer.q_down"], ColwiseParallel)
    expected = bound(model, tp_size)
    assert all(abs(f - expected) < 0.01 for f in report.param_fraction), (report.param_fraction, expected)
    # Plain: the heads' partial input gradients and the broadcast ones reduce in fewer bytes than the
    # forward's two row reductions. SP: the three small all-reduces (the query rank, the kv head, the
    # summary) stay beside the stream's reduce-scatters, 1.7% over the forward here (still short).
    allowed = 1.0 if not sequence_parallel else 1.02
    assert report.comm_volume_backward <= allowed * report.comm_volume, (report.comm_volume, report.comm_volume_backward)
