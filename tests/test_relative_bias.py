"""Per-head biases computed from the heads, and what sequence parallel meets around them.

- **A learned relative-position bias.** A column Linear gives each head a few features per token;
  they mix a bank of bias-vs-distance profiles, and ``gather`` picks each (query, key) pair's
  distance with an index made from positions and expanded over batch and heads. The bias is per
  head, so it is sharded with the heads and passed to attention as its mask, which lines up with
  the heads. Before, ``gather`` stopped the shard and every projection of the attention stayed
  whole (fraction ~0.98 on the model this comes from).
- **An embedding that normalises its rows** (a norm child called inside its forward): under SP
  the stream is sharded from the embedding module's output on, so the norm inside sees every
  position. Given ``SequenceParallel``, it read the whole sequence as its shard (twice the length).
- **A MoE block that adds a whole term to its experts' partial sum** (a bias of the block's own
  here; a shared expert kept whole is the same). Under SP such a block used to leave the experts'
  output unreduced and reduce-scatter the sum once: the whole term came out counted once per rank,
  a plan that ran and gave wrong numbers. Now the block reduces inside.
- **A padding-masked module right after a MoE block** (a short convolution over time): it reads
  the stream the block reduce-scatters, and is gathered whole at entry like one after a row.

Every plan is verified on logits and every gradient against the unsharded model (1e-5) at tp 2
and 4, plain and SP, with its parameter fraction asserted near the Megatron-style bound.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel

import autotp
from autotp.synth import explain
from autotp.synth.api import plan_with_analysis
from autotp.verifier import verify
from tests.synth_toy import DIM, HEADS, VOCAB, example_tokens
from tests.test_loop_experts import LoopExperts, MoE, megatron_bound

D_REL, EXTENT = 4, 8


class RelativeBias(nn.Module):
    """``(b, t, heads, d_rel)`` features -> a ``(b, heads, t, t)`` bias: each head's mix of the
    profile bank, read at each pair's distance (zero beyond the extent, -inf above the diagonal)."""

    def __init__(self):
        super().__init__()
        self.profiles = nn.Parameter(torch.randn(D_REL, EXTENT) / D_REL ** 0.5)

    def forward(self, features):
        logits = (features @ self.profiles).transpose(1, 2)  # (b, heads, t, extent)
        t = logits.shape[2]
        positions = torch.arange(t, device=features.device)
        distance = (positions[:, None] - positions[None, :])[None, None]
        index = distance.clamp(0, EXTENT - 1).expand(*logits.shape[:2], -1, -1)
        bias = logits.gather(-1, index).masked_fill(distance >= EXTENT, 0.0)
        return bias.masked_fill(distance < 0, float("-inf"))


class RelativeAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.r = nn.Linear(DIM, HEADS * D_REL, bias=False)
        self.bias = RelativeBias()

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        bias = self.bias(self.r(x).view(b, t, self.heads, -1))
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class NormedEmbedding(nn.Embedding):
    """Rows normalised inside the embedding's own forward."""

    def __init__(self):
        super().__init__(VOCAB, DIM)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, tokens):
        return self.norm(super().forward(tokens))


class BiasedMoE(MoE):
    """Routed experts plus a bias of the block's own, added to their sum."""

    def __init__(self):
        super().__init__(LoopExperts)
        self.bias = nn.Parameter(torch.randn(DIM) * 0.5)

    def forward(self, x):
        return super().forward(x) + self.bias


class MaskedShortConv(nn.Module):
    """A depthwise causal convolution over time of the stream, its padded positions zeroed first."""

    def __init__(self):
        super().__init__()
        self.conv = nn.Conv1d(DIM, DIM, 3, groups=DIM, padding=2)

    def forward(self, x, mask):
        x = x * mask[:, :, None].to(x.dtype)
        return self.conv(x.transpose(1, 2))[..., : x.shape[1]].transpose(1, 2)


class MaskedShift(nn.Module):
    """Zeroes the padded positions, then mixes each position with the one before (no parameters)."""

    def forward(self, x, mask):
        x = x * mask[:, :, None].to(x.dtype)
        return 0.5 * (x + F.pad(x, (0, 0, 1, -1)))


class Block(nn.Module):
    def __init__(self, variant: str = "biased"):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = RelativeAttention()
        self.mlp, self.mix = (BiasedMoE(), MaskedShortConv()) if variant == "biased" else (MoE(LoopExperts), MaskedShift())

    def forward(self, x, mask):
        x = x + self.attn(self.norm1(x))
        return x + self.mix(self.mlp(self.norm2(x)), mask)


class Model(nn.Module):
    def __init__(self, variant: str = "biased", layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = NormedEmbedding()
        self.layers = nn.ModuleList(Block(variant) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens, mask):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h, mask)
        return self.head(self.norm(h))


def _inputs():
    tokens = example_tokens()
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0
    return tokens, mask


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("variant", ["biased", "plain_moe"])
def test_relative_bias_is_sharded_with_the_heads_and_exact(variant, tp_size, sequence_parallel):
    """Would catch the gather stopping the shard (every attention projection whole: fraction far
    above the bound), the bias sharded out of step with the heads, the embedding's inner norm
    given a sequence shard (twice the length), the block's bias counted once per rank (biased),
    and the masked module after the block meeting the reduce-scattered stream (plain_moe: mixed
    tensor and DTensor)."""
    model = Model(variant).eval()
    inputs = _inputs()
    plan = autotp.synthesize(model, example_inputs=inputs, tp_size=tp_size, sequence_parallel=sequence_parallel,
                             verify=False)
    for name in ("q", "k", "v", "r"):
        assert isinstance(plan.get(f"layers.*.attn.{name}"), ColwiseParallel), sorted(plan)
    report = verify(model, plan, tp_size=tp_size, example_inputs=inputs)
    assert report.ok, str(report)
    assert max(report.logits_max_abs_diff) <= 1e-5 and report.worst_grad[1] <= 1e-5, report
    # The bound counts the conv's depthwise weight and the relative bias' profile bank as whole
    # (neither is a Linear), and here the token table too: its rows are normalised inside the
    # embedding, where a vocab-parallel table would give partial rows.
    total = sum(p.numel() for p in model.parameters())
    bound = megatron_bound(model, tp_size) + model.embed.weight.numel() * (1 - 1 / tp_size) / total
    assert all(f <= bound + 0.03 for f in report.param_fraction), (report.param_fraction, bound)
    if sequence_parallel:
        assert "embed.norm" not in plan, plan.get("embed.norm")
        one_reduction = getattr(plan.get("layers.*.mlp"), "outputs", None) == "sum_shard"
        assert one_reduction == (variant == "plain_moe"), plan.get("layers.*.mlp")


def test_gather_along_the_sharded_dim_stays_whole():
    """The shard stops where the gather picks along the heads: a bias that reads other heads'
    values (each query takes a head chosen by position) keeps the projection that feeds it whole,
    and the plan is still exact."""

    class HeadPicking(RelativeBias):
        def forward(self, features):
            logits = (features @ self.profiles).transpose(1, 2)  # (b, heads, t, extent)
            b, h, t, e = logits.shape
            pick = (torch.arange(t, device=features.device) % h)[None, None, :, None].expand(b, 1, t, e)
            return logits.gather(1, pick)[..., :1].expand(b, h, t, t).contiguous()

    model = Model().eval()
    for layer in model.layers:
        layer.attn.bias = HeadPicking()
    inputs = _inputs()
    plan, analysis = plan_with_analysis(model, example_inputs=inputs, tp_size=2)  # traced once
    reasons = {r.key: r.reason for r in explain(analysis=analysis)}
    assert "picks along the sharded dim" in reasons.get("layers.*.attn.r", ""), reasons.get("layers.*.attn.r")
    assert "layers.*.attn.r" not in plan
    report = verify(model, plan, tp_size=2, example_inputs=inputs)
    assert report.ok, str(report)
