"""Low-rank adapters written as peft writes them: ``base_layer`` plus ``lora_A`` / ``lora_B`` in
``nn.ModuleDict``s keyed by adapter name, dropout, and a scaling per adapter.

- Beside a Linear the analysis keeps whole (an attention whose code fixes its head count), the
  adapter pair stays whole too. Before, it was sharded on its rank: an all-reduce per call for
  nothing under plain TP, and under SP ``lora_B`` reduce-scattered onto the sequence inside a module
  that runs whole, so the sharded run met a sequence-sharded DTensor with a plain tensor ("got mixed
  torch.Tensor and DTensor" in ``scaled_dot_product_attention``).
- Beside a sharded Linear (heads split by a ``head_dim`` attribute) the attention stays sharded.

Every plan is verified against the unsharded model (logits and every gradient within 1e-5).
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from synth_toy import verify_toy
from torch import nn

import autotp

VOCAB, DIM, HEADS, SEQ, RANK = 128, 64, 4, 11, 8


class PeftLoraLinear(nn.Module):
    def __init__(self, base_layer: nn.Linear, adapter: str = "default", r: int = RANK, alpha: int = 16):
        super().__init__()
        self.base_layer = base_layer
        self.active_adapters = [adapter]
        self.scaling = {adapter: alpha / r}
        self.lora_dropout = nn.ModuleDict({adapter: nn.Identity()})
        self.lora_A = nn.ModuleDict({adapter: nn.Linear(base_layer.in_features, r, bias=False)})
        self.lora_B = nn.ModuleDict({adapter: nn.Linear(r, base_layer.out_features, bias=False)})
        nn.init.kaiming_uniform_(self.lora_A[adapter].weight, a=math.sqrt(5))
        nn.init.normal_(self.lora_B[adapter].weight, std=0.05)  # nonzero, so the adapter counts

    def forward(self, x):
        result = self.base_layer(x)
        for name in self.active_adapters:
            a, b = self.lora_A[name], self.lora_B[name]
            result = result + b(a(self.lora_dropout[name](x.to(a.weight.dtype)))) * self.scaling[name]
        return result


class Attention(nn.Module):
    """``fixed_heads``: heads by a module constant (kept whole: no attribute to divide), else by a
    ``head_dim`` attribute (sharded)."""

    def __init__(self, fixed_heads: bool):
        super().__init__()
        self.fixed_heads, self.head_dim = fixed_heads, DIM // HEADS
        self.q_proj, self.k_proj, self.v_proj, self.o_proj = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        shape = (b, t, HEADS, -1) if self.fixed_heads else (b, t, -1, self.head_dim)
        q, k, v = (p(x).view(shape).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, fixed_heads: bool):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention(fixed_heads)
        self.up_proj, self.down_proj = nn.Linear(DIM, 2 * DIM), nn.Linear(2 * DIM, DIM)

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.down_proj(F.gelu(self.up_proj(self.ln_2(x))))


class Decoder(nn.Module):
    def __init__(self, fixed_heads: bool):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(fixed_heads) for _ in range(2))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
        for layer in self.layers:  # as peft's inject_adapter_in_model does on q / v and the MLP
            for owner, name in ((layer.attn, "q_proj"), (layer.attn, "v_proj"), (layer, "up_proj"), (layer, "down_proj")):
                setattr(owner, name, PeftLoraLinear(getattr(owner, name)))

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def _roles(model, sequence_parallel):
    records = autotp.explain(model, example_inputs=(_tokens(),), sequence_parallel=sequence_parallel, tp_size=2)
    return {r.key: (r.role.value, r.reason) for r in records}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_adapter_beside_a_whole_linear_stays_whole(sequence_parallel, no_shape_fixes):
    """The fixed head count keeps q / v whole once the literal rewrite is off (with it, the count is
    rewritten per rank and they shard: test_literal_sizes)."""
    model = Decoder(fixed_heads=True)
    plan = autotp.synthesize(model, example_inputs=(_tokens(),), sequence_parallel=sequence_parallel, tp_size=2,
                             verify=False)
    roles = _roles(model, sequence_parallel)
    for proj in ("q_proj", "v_proj"):
        assert roles[f"layers.*.attn.{proj}.base_layer"][0] == "replicate", roles
        for part in ("lora_A", "lora_B"):
            kind, reason = roles[f"layers.*.attn.{proj}.{part}.default"]
            assert kind == "replicate" and "low-rank adapter beside" in reason, (proj, part, kind, reason)
    assert roles["layers.*.up_proj.base_layer"][0] == "column"  # the MLP beside it stays sharded
    verify_toy(model, plan, 2, inputs=(_tokens(),))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_adapter_beside_a_sharded_linear_keeps_the_attention_sharded(sequence_parallel):
    model = Decoder(fixed_heads=False)
    plan = autotp.synthesize(model, example_inputs=(_tokens(),), sequence_parallel=sequence_parallel, tp_size=2,
                             verify=False)
    roles = _roles(model, sequence_parallel)
    assert roles["layers.*.attn.q_proj.base_layer"][0] == "column", roles
    assert roles["layers.*.attn.o_proj"][0] == "row", roles
    report = verify_toy(model, plan, 2, inputs=(_tokens(),))
    assert max(report.param_fraction) < 0.56, report.param_fraction  # adapters replicated: 0.53
