"""Replicated values broadcast along a sharded dim: their gradient must be made whole, or refused.

A tensor kept whole that meets head-sharded computation through a broadcast (a rotary key shared
by every head, expanded and concatenated to each head's key; a gate of one value per position
multiplied into every head) gets, on each rank, the gradient of that rank's heads only. Before
this rule a gate computed by a Linear kept whole was accepted as is: logits exact, the gate's
gradients a per-rank partial sum (1.6e-4 off in float64). Now the Linear it is cut from all-reduces
that span of its output gradient (``Boundary(inputs="whole", reduce_grad_features=...)``), or, where
something else reads the span, the shard is refused and the attention stays whole.

The toy attentions are plain PyTorch named after the pattern, verified on logits and every
gradient against the unsharded model (1e-5) at tp 2 and 4, plain and sequence-parallel.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from autotp import styles
from autotp.synth import explain, synthesize
from autotp.verifier import verify
from fuzz_blocks import BlockSpec, SpecLM, tokens

SPEC = BlockSpec(heads=4, head_dim=8, dim=32)
RANK, ROPE = 16, 4


def _rotate(x, cos, sin):
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class SharedRopeKeyAttention(nn.Module):
    """Low-rank attention: queries from a down/up pair with a norm between; keys and values from a
    down-projection kept whole whose output is cut into a latent (normed, then up-projected to
    per-head keys and values) and a rotary key part shared by every head, expanded to the heads
    and concatenated to each head's key."""

    def __init__(self, spec, share_rope_elsewhere: bool = False):
        super().__init__()
        self.head_dim, self.share_rope_elsewhere = spec.head_dim, share_rope_elsewhere
        heads = spec.heads
        self.q_down, self.q_norm = nn.Linear(spec.dim, RANK), nn.LayerNorm(RANK)
        self.q_up = nn.Linear(RANK, heads * (spec.head_dim + ROPE))
        self.kv_down, self.kv_norm = nn.Linear(spec.dim, RANK + ROPE), nn.LayerNorm(RANK)
        self.kv_up = nn.Linear(RANK, heads * 2 * spec.head_dim)
        self.out = nn.Linear(heads * spec.head_dim, spec.dim)
        self.register_buffer("inv_freq", 1.0 / 10000 ** (torch.arange(0, ROPE, 2).float() / ROPE), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        angles = torch.arange(t, device=x.device).float()[:, None] * self.inv_freq[None]
        cos, sin = torch.cat([angles, angles], -1).cos(), torch.cat([angles, angles], -1).sin()
        q = self.q_up(self.q_norm(self.q_down(x))).view(b, t, -1, self.head_dim + ROPE).transpose(1, 2)
        q_pass, q_rot = q.split([self.head_dim, ROPE], dim=-1)
        latent, k_rot = self.kv_down(x).split([RANK, ROPE], dim=-1)
        kv = self.kv_up(self.kv_norm(latent)).view(b, t, -1, 2 * self.head_dim).transpose(1, 2)
        k_pass, v = kv.split([self.head_dim, self.head_dim], dim=-1)
        k_rot = _rotate(k_rot.view(b, 1, t, ROPE), cos, sin)
        q = torch.cat([q_pass, _rotate(q_rot, cos, sin)], dim=-1)
        k = torch.cat([k_pass, k_rot.expand(-1, k_pass.shape[1], -1, -1)], dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(b, t, -1)
        out = self.out(y)
        if self.share_rope_elsewhere:  # the rotary key read outside the heads too: a whole gradient part
            out = out + k_rot.mean(dim=(1, 3)).unsqueeze(-1)
        return out


class RopeReadElsewhereAttention(SharedRopeKeyAttention):
    def __init__(self, spec):
        super().__init__(spec, share_rope_elsewhere=True)


class WholeGateAttention(nn.Module):
    """Each position's output scaled by one gate value for all heads, from a Linear kept whole."""

    def __init__(self, spec):
        super().__init__()
        self.head_dim = spec.head_dim
        width = spec.heads * spec.head_dim
        self.q, self.k, self.v = (nn.Linear(spec.dim, width) for _ in range(3))
        self.gate = nn.Linear(spec.dim, spec.dim)
        self.out = nn.Linear(width, spec.dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        gate = torch.sigmoid(self.gate(x)).mean(-1, keepdim=True)  # (b, t, 1): mixes the features, so whole
        return self.out((y * gate.unsqueeze(-1)).reshape(b, t, -1))


class EinsumGateAttention(WholeGateAttention):
    """The same gate, one value per position, combined with the heads by an einsum whose gate operand
    lacks the head index (``"bhtd,bt->bthd"``): an operand broadcast along the sharded letter."""

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        gate = torch.sigmoid(self.gate(x)).mean(-1)
        return self.out(torch.einsum("bhtd,bt->bthd", y, gate).reshape(b, t, -1))


def _verified(attention, tp_size, sequence_parallel):
    model = SpecLM(SPEC, attention)
    plan = synthesize(model, example_inputs=(tokens(),), tp_size=tp_size, sequence_parallel=sequence_parallel,
                      verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp_size, example_inputs=(tokens(),))
    assert report.ok, str(report)
    return model, plan, report


def _fraction_keeping_whole(model: nn.Module, tp: int, whole: tuple[str, ...]) -> float:
    """Per-rank parameter fraction of a plan sharding every Linear weight and bias but ``whole``'s
    and the token table, keeping norms and row biases whole."""
    sharded = 0
    for name, module in model.named_modules():
        leaf = name.rpartition(".")[2]
        if isinstance(module, nn.Embedding) or (isinstance(module, nn.Linear) and leaf not in whole):
            sharded += module.weight.numel()
            if isinstance(module, nn.Linear) and module.bias is not None and leaf not in ("out", "fc2", "down"):
                sharded += module.bias.numel()
    total = sum(p.numel() for p in model.parameters())
    return (sharded / tp + total - sharded) / total


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_shared_rope_key_down_projection_reduces_that_span_and_the_heads_shard(tp_size, sequence_parallel):
    """Would catch the rotary key's gradient left partial (kv_down's weight off), the attention left
    whole again, or the query pair sharded on its rank instead of by heads.

    Its latents and rope key (16 + 16 + 4 features) are wider than the block input (32): the down
    side runs its backward on the partial gradients, reduced once at the block's norm, rather than
    kv_down all-reducing the rope span (``tests/test_fronts.py``; narrower latents keep the span's
    reduction there)."""
    model, plan, report = _verified(SharedRopeKeyAttention, tp_size, sequence_parallel)
    for name in ("q_up", "kv_up", "out"):
        assert f"blocks.*.attn.{name}" in plan, sorted(plan)
    assert isinstance(plan["blocks.*.attn.kv_down"], styles.ReplicatedWithGradAllReduce), plan["blocks.*.attn.kv_down"]
    assert plan["blocks.*.attn"].input_grad == "partial" and plan["blocks.*.attn"].columns == ("kv_up", "q_up")
    # The low-rank query pair gave way to the heads (under SP q_down only gathers its input).
    assert not isinstance(plan.get("blocks.*.attn.q_down"), (ColwiseParallel, RowwiseParallel))
    bound = _fraction_keeping_whole(model, tp_size, ("q_down", "kv_down"))
    assert all(abs(f - bound) < 0.01 for f in report.param_fraction), (report.param_fraction, bound)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_rope_key_read_outside_the_heads_keeps_the_attention_whole(tp_size):
    """Would catch an all-reduce of a span whose gradient also holds a whole part (multiplied by tp)."""
    model, plan, _ = _verified(RopeReadElsewhereAttention, tp_size, False)
    assert "blocks.*.attn.kv_down" not in plan and "blocks.*.attn.kv_up" not in plan
    reasons = {r.key: r.reason for r in explain(model, example_inputs=(tokens(),), tp_size=tp_size)}
    assert "partial sum" in reasons["blocks.*.attn.kv_up"], reasons["blocks.*.attn.kv_up"]


@pytest.mark.parametrize("attention", [WholeGateAttention, EinsumGateAttention], ids=["mul", "einsum"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_gate_from_a_whole_linear_broadcast_over_heads_gets_its_gradient_reduced(tp_size, sequence_parallel, attention):
    """Would catch the silently wrong plan this rule replaced: heads sharded, the gate Linear's
    gradients each rank's share only (the einsum form was still handed out so: 4.9e-4 off in float64)."""
    model, plan, report = _verified(attention, tp_size, sequence_parallel)
    for name in ("q", "k", "v", "out"):
        assert f"blocks.*.attn.{name}" in plan
    assert plan["blocks.*.attn.gate"].reduce_grad_features == ((0, SPEC.dim),)
    bound = _fraction_keeping_whole(model, tp_size, ("gate",))
    assert all(abs(f - bound) < 0.01 for f in report.param_fraction), (report.param_fraction, bound)
