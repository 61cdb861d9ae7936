"""Attention variants and experts the synthesizer must shard, not leave whole: attention sinks
(per-head logits joined to the scores, a max over keys returning values and indices), a query
that concatenates a rope part shared by every head, and stacked 3-D experts with gate and up
interleaved feature by feature. Each is verified on logits and every gradient at tp 2 and 4,
plain and sequence-parallel, holding about 1/tp of its parameters per rank."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp.verifier import verify
from tests.synth_toy import DIM, HEADS, VOCAB, example_tokens

HEAD_DIM, ROPE = DIM // HEADS, 8


class SinkAttention(nn.Module):
    """Eager attention with one learned sink logit per head: cat to the scores, max-shift, softmax,
    then the sink column sliced off again."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.sinks = nn.Parameter(torch.randn(HEADS))
        self.heads = HEADS

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = q @ k.transpose(2, 3) * HEAD_DIM ** -0.5
        sinks = self.sinks.reshape(1, -1, 1, 1).expand(b, -1, t, -1)
        logits = torch.cat([scores, sinks], dim=-1)
        logits = logits - logits.max(dim=-1, keepdim=True).values
        probs = F.softmax(logits, dim=-1)[..., :-1]
        y = (probs @ v).transpose(1, 2).reshape(b, t, -1)
        return self.o(y)


class SharedRopeQueryAttention(nn.Module):
    """Each head's query and key end in a rope part computed once, from the positions, and
    expanded to every head (the same values for every head: each rank takes its heads' copies)."""

    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))
        self.register_buffer("freqs", torch.linspace(0.1, 1.0, ROPE), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        positions = torch.arange(t, device=x.device, dtype=x.dtype)
        rope = torch.sin(positions[:, None] * self.freqs).view(1, 1, t, ROPE)
        q = torch.cat([q, rope.expand(b, q.shape[1], -1, -1)], dim=-1)
        k = torch.cat([k, rope.expand(b, k.shape[1], -1, -1)], dim=-1)
        y = F.scaled_dot_product_attention(q, k, F.pad(v, (0, ROPE)), is_causal=True)[..., :HEAD_DIM]
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class LearnedSharedRopeAttention(SharedRopeQueryAttention):
    """The shared rope part comes from a Linear: expanded into each rank's heads of q and of k, its
    gradient on each rank is that rank's share, which the Linear (kept whole) must all-reduce."""

    def __init__(self):
        super().__init__()
        self.rope = nn.Linear(DIM, ROPE, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, HEAD_DIM).transpose(1, 2) for p in (self.q, self.k, self.v))
        rope = torch.sin(self.rope(x)).view(b, 1, t, ROPE)
        q = torch.cat([q, rope.expand(b, q.shape[1], -1, -1)], dim=-1)
        k = torch.cat([k, rope.expand(b, k.shape[1], -1, -1)], dim=-1)
        y = F.scaled_dot_product_attention(q, k, F.pad(v, (0, ROPE)), is_causal=True)[..., :HEAD_DIM]
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


EXPERTS, FFN = 4, 32


class InterleavedStackedExperts(nn.Module):
    """Experts stored as 3-D parameters and run as batched matmuls: ``gate_up`` (E, in, 2*ffn) with
    gate and up interleaved (``[..., ::2]``, ``[..., 1::2]``), ``down`` (E, ffn, in), biases; a
    router on the replicated input weighs the experts densely."""

    def __init__(self):
        super().__init__()
        self.router = nn.Linear(DIM, EXPERTS)
        self.gate_up = nn.Parameter(torch.randn(EXPERTS, DIM, 2 * FFN) * DIM ** -0.5)
        self.gate_up_bias = nn.Parameter(torch.randn(EXPERTS, 2 * FFN) * 0.1)
        self.down = nn.Parameter(torch.randn(EXPERTS, FFN, DIM) * FFN ** -0.5)
        self.down_bias = nn.Parameter(torch.randn(EXPERTS, DIM) * 0.1)

    def forward(self, x):
        b, t, _ = x.shape
        weights = F.softmax(self.router(x), dim=-1).reshape(-1, EXPERTS)
        h = x.reshape(1, b * t, DIM).expand(EXPERTS, -1, -1)
        gate_up = torch.bmm(h, self.gate_up) + self.gate_up_bias[..., None, :]
        gate, up = gate_up[..., ::2], gate_up[..., 1::2]
        y = torch.bmm(F.silu(gate) * up, self.down) + self.down_bias[..., None, :]
        y = (y * weights.transpose(0, 1)[..., None]).sum(dim=0)
        return y.view(b, t, DIM)


class Block(nn.Module):
    def __init__(self, mixer: type[nn.Module], ffn: type[nn.Module] | None):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.mixer = mixer()
        self.ffn = ffn() if ffn else nn.Sequential(nn.Linear(DIM, 2 * DIM), nn.GELU(), nn.Linear(2 * DIM, DIM))

    def forward(self, x):
        x = x + self.mixer(self.norm1(x))
        return x + self.ffn(self.norm2(x))


class Model(nn.Module):
    def __init__(self, mixer, ffn=None, layers: int = 2):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(mixer, ffn) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


CASES = {
    "sinks": (SinkAttention, None),
    "shared_rope_query": (SharedRopeQueryAttention, None),
    "interleaved_stacked_experts": (SinkAttention, InterleavedStackedExperts),
}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("case", CASES)
def test_variant_is_sharded_and_verified(case, tp_size, sequence_parallel):
    torch.manual_seed(0)
    model = Model(*CASES[case]).eval()
    tokens = example_tokens()
    plan = autotp.synthesize(model, example_inputs=(tokens,), tp_size=tp_size, sequence_parallel=sequence_parallel, verify=False)
    report = verify(model, plan, tp_size=tp_size, example_inputs=(tokens,))
    assert report.ok, str(report)
    assert max(report.logits_max_abs_diff) <= 1e-5 and report.worst_grad[1] <= 1e-5
    # Only norms, the router and the shared rope part stay whole: close to 1/tp per rank.
    assert all(f < 1 / tp_size + 0.06 for f in report.param_fraction), (report.param_fraction, plan)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_learned_shared_rope_part_stays_whole_with_its_gradient_reduced(tp_size, sequence_parallel):
    """The rope part from a Linear is expanded into every head of q and of k (two places it meets
    the shard, each giving a per-rank share of its gradient): the heads are sharded and the rope
    Linear kept whole with its output gradient all-reduced once. Would catch the gradient left
    partial (rope's weight off) or the heads left whole."""
    from autotp import styles

    torch.manual_seed(0)
    model = Model(LearnedSharedRopeAttention).eval()
    tokens = example_tokens()
    plan = autotp.synthesize(model, example_inputs=(tokens,), tp_size=tp_size, sequence_parallel=sequence_parallel, verify=False)
    assert all(f"layers.*.mixer.{name}" in plan for name in ("q", "k", "v", "o")), sorted(plan)
    rope = plan["layers.*.mixer.rope"]
    assert isinstance(rope, styles.Boundary) and rope.inputs == "whole" and rope.reduce_grad_features == ((0, ROPE),), rope
    report = verify(model, plan, tp_size=tp_size, example_inputs=(tokens,))
    assert report.ok, str(report)
