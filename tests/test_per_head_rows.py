"""A Linear that reads the head-sharded values (a row) and makes one number per head, which then
meets the heads again: its reduced output may stay sharded on the heads (reduce-scattered), each
rank taking the per-head values of its own heads, instead of the whole attention being kept
replicated. Verified on logits and every gradient at tp 2 and 4, plain and sequence-parallel."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.verifier import verify
from tests.synth_toy import DIM, HEADS, VOCAB, example_tokens
from tests.test_synth_matrix import megatron_fraction

HEAD_DIM = DIM // HEADS


class PerHeadMaskAttention(nn.Module):
    """A per-head bias on the scores computed from the values: ``Linear(heads * hd -> heads)``
    over the values, scaled by a per-head parameter, expanded over the queries and passed to the
    attention as its mask (a dynamic mask per head and key)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.gate = nn.Linear(DIM, HEADS)
        self.scale = nn.Parameter(torch.rand(HEADS))

    def per_head(self, v):
        b, _, t, _ = v.shape
        return self.gate(v.transpose(1, 2).reshape(b, t, -1))  # (b, t, heads)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        bias = torch.exp(self.scale * F.softplus(self.per_head(v))).transpose(-1, -2)  # (b, heads, t)
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).tril()
        mask = bias[:, :, None, :].expand(-1, -1, t, -1).masked_fill(~causal, float("-inf"))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class PerHeadGateAttention(PerHeadMaskAttention):
    """Per-head output gating: ``sigmoid(Linear(values) * scale)`` multiplies each head's output."""

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)  # (b, heads, t, hd)
        gate = torch.sigmoid(self.per_head(v) * self.scale).transpose(1, 2)[..., None]  # (b, heads, t, 1)
        return self.o((y * gate).transpose(1, 2).reshape(b, t, -1))


class WholeReadGateAttention(PerHeadGateAttention):
    """The per-head values are also read whole (their mean over the heads scales the output): a
    rank holding only its heads' values would scale by the wrong mean. Must stay exact."""

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        per_head = self.per_head(v)
        gate = torch.sigmoid(per_head * self.scale).transpose(1, 2)[..., None]
        return self.o((y * gate).transpose(1, 2).reshape(b, t, -1)) * torch.sigmoid(per_head.mean(-1, keepdim=True))


class Block(nn.Module):
    def __init__(self, mixer: type[nn.Module]):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.mixer = mixer()
        self.ffn = nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        x = x + self.mixer(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class Model(nn.Module):
    def __init__(self, mixer: type[nn.Module], layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(mixer) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def _synthesize_and_verify(mixer, tp_size, sequence_parallel):
    torch.manual_seed(0)
    model = Model(mixer).eval()
    tokens = example_tokens()
    plan = autotp.synthesize(model, example_inputs=(tokens,), tp_size=tp_size, sequence_parallel=sequence_parallel, verify=False)
    report = verify(model, plan, tp_size=tp_size, example_inputs=(tokens,))
    assert report.ok, str(report)
    assert max(report.logits_max_abs_diff) <= 1e-5 and report.worst_grad[1] <= 1e-5, str(report)
    return plan, report


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("mixer", [PerHeadMaskAttention, PerHeadGateAttention], ids=["mask", "gate"])
def test_per_head_row_output_stays_sharded_on_the_heads(mixer, tp_size, sequence_parallel):
    """The per-head Linear is a row whose output is reduce-scattered onto the heads, its per-head
    parameter sharded with them: the attention is sharded, about 1/tp of the parameters per rank.
    Would catch the attention kept whole (the per-head values made outside the sharded region)."""
    from torch.distributed.tensor import Shard
    from torch.distributed.tensor.parallel import RowwiseParallel

    plan, report = _synthesize_and_verify(mixer, tp_size, sequence_parallel)
    assert all(f"layers.*.mixer.{name}" in plan for name in ("q", "k", "v", "o")), sorted(plan)
    gate = plan["layers.*.mixer.gate"]
    assert isinstance(gate, RowwiseParallel) and gate.output_layouts == (Shard(-1),), gate
    assert max(report.param_fraction) <= megatron_fraction(Model(mixer), tp_size) + 0.1, (report.param_fraction, plan)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_per_head_values_read_whole_elsewhere_stay_exact(tp_size, sequence_parallel):
    """The per-head values are also averaged over all heads: left sharded, each rank would average
    its own heads only. The plan must keep them whole there (the row all-reduced) and stay exact.
    Would catch a row left sharded on the heads whatever else reads its output."""
    from torch.distributed.tensor import Shard

    plan, _ = _synthesize_and_verify(WholeReadGateAttention, tp_size, sequence_parallel)
    gate = plan.get("layers.*.mixer.gate")
    assert getattr(gate, "output_layouts", None) != (Shard(-1),), gate


def test_checker_flags_per_head_values_scattered_where_they_are_read_whole():
    """A plan that scatters the per-head row's output although the mean over all heads reads it
    whole: the checker must flag the row. Would catch a checker that trusts ``Shard(-1)``."""
    torch.manual_seed(0)
    tokens = example_tokens()
    plan = autotp.synthesize(Model(PerHeadGateAttention).eval(), example_inputs=(tokens,), tp_size=2, verify=False)
    findings = autotp.check_plan(Model(WholeReadGateAttention).eval(), plan, tp_size=2, example_inputs=(tokens,))
    assert any(f.module.endswith("mixer.gate") for f in findings), findings
