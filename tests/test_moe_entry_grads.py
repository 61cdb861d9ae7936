"""A MoE block's input gradient reduced once, whatever hands the block its input.

A block with a router, grouped experts and a shared expert scaled by a learned gate
(``experts(h) + sigmoid(gate(h)) * shared(h)``) takes the input gradients of its router, experts and
shared expert. Summed as partial sums and reduced once, the backward costs no more bytes than the
forward; reduced apart (the experts' style all-reducing the gradients of their input and of the
routing weights on their own), it costs one more collective per layer. The block's input is made a
``Replicate()`` DTensor by the norm before it where the norm's output is read by the block alone,
and by the block itself where the residual reads that output too, or where no norm precedes the
block; under sequence parallel by the all-gather at the block's entry. Each test compares logits
and every gradient with the unsharded model (the verifier, 1e-5).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp.synth import synthesize
from autotp.verifier import verify
from synth_toy import SeparateQKVAttention, StackedExperts

LAYERS = 2


class _Router(nn.Module):
    def __init__(self, dim, experts, top_k=2):
        super().__init__()
        self.weight, self.top_k = nn.Parameter(torch.randn(experts, dim) / dim**0.5), top_k

    def forward(self, x):
        logits = F.linear(x, self.weight)
        top, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return top / top.sum(-1, keepdim=True), index


class _Mlp(nn.Module):
    def __init__(self, dim, ffn):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(dim, ffn, bias=False), nn.Linear(dim, ffn, bias=False), \
            nn.Linear(ffn, dim, bias=False)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _GatedSharedMoE(nn.Module):
    """Routed experts plus a shared expert scaled by a learned sigmoid gate."""

    def __init__(self, dim, experts=4, ffn=32):
        super().__init__()
        self.router, self.experts = _Router(dim, experts), StackedExperts(dim, experts, ffn)
        self.shared, self.shared_gate = _Mlp(dim, ffn), nn.Linear(dim, 1, bias=False)

    def forward(self, x):
        b, t, d = x.shape
        h = x.view(-1, d)
        weights, index = self.router(h)
        routed = self.experts(h, index, weights)
        return (routed + torch.sigmoid(self.shared_gate(h)) * self.shared(h)).view(b, t, d)


class _Layer(nn.Module):
    """``wiring``: ``pre_norm`` (``x + moe(norm(x))``: the norm's output is the block's alone),
    ``normed_residual`` (``h = norm(x); h + moe(h)``: the residual reads it too), ``post_norm``
    (``x + norm(moe(x))``: no norm before the block)."""

    def __init__(self, dim, heads, wiring):
        super().__init__()
        self.wiring = wiring
        self.attn_norm, self.attn = nn.LayerNorm(dim), SeparateQKVAttention(dim, heads)
        self.moe_norm, self.moe = nn.LayerNorm(dim), _GatedSharedMoE(dim)

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        if self.wiring == "pre_norm":
            return x + self.moe(self.moe_norm(x))
        if self.wiring == "normed_residual":
            h = self.moe_norm(x)
            return h + self.moe(h)
        return x + self.moe_norm(self.moe(x))


class _MoELM(nn.Module):
    layer = _Layer

    def __init__(self, wiring, vocab=128, dim=64, heads=4):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.layers = nn.ModuleList(self.layer(dim, heads, wiring) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("wiring", ["pre_norm", "normed_residual", "post_norm"])
def test_gated_shared_expert_block_backward_moves_no_more_than_forward(wiring, tp_size, sequence_parallel):
    """Would catch the routing weights' gradient and the block input's reduced apart (the experts
    without ``partial_grad_inputs``): 1.01 to 1.21 times the forward's bytes before, where the
    block's input was a plain tensor (every SP wiring; plain TP behind a normed residual or with
    no norm before the block)."""
    torch.manual_seed(0)
    model = _MoELM(wiring)
    ids = torch.randint(0, 128, (2, 8))
    plan = synthesize(model, example_inputs=(ids,), sequence_parallel=sequence_parallel, tp_size=tp_size, verify=False)
    assert plan["layers.*.moe.experts"].partial_grad_inputs
    assert type(plan["layers.*.moe.router"]).__name__ == "PartialGradRouter"
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp_size, example_inputs=(ids,))
    assert report.ok, str(report)
    assert report.comm_volume_backward <= report.comm_volume, (report.collectives, report.collectives_backward)


def test_block_reading_a_mask_keeps_its_plain_input():
    """A block that reads a second tensor from outside (a padding mask, a model input) cannot wrap
    every floating argument it gets as the one replicated input (the mask would meet plain tensors
    as a DTensor): it keeps plain inputs, and stays exact."""

    class Masked(_GatedSharedMoE):
        def forward(self, x, mask):
            return super().forward(x) * mask

    class Layer(_Layer):
        def __init__(self, dim, heads, wiring):
            super().__init__(dim, heads, wiring)
            self.moe = Masked(dim)

        def forward(self, x, mask):
            x = x + self.attn(self.attn_norm(x))
            h = self.moe_norm(x)
            return h + self.moe(h, mask)

    class LM(_MoELM):
        layer = Layer

        def forward(self, ids, mask):
            x = self.embed(ids)
            for layer in self.layers:
                x = layer(x, mask)
            return self.head(self.norm(x))

    torch.manual_seed(0)
    model = LM("normed_residual")
    inputs = (torch.randint(0, 128, (2, 8)), torch.rand(2, 8, 1))
    plan = synthesize(model, example_inputs=inputs, tp_size=2, verify=False)
    assert "layers.*.moe" not in plan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=2, example_inputs=inputs)
    assert report.ok, str(report)
