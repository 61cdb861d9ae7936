"""Remote-code families NeMo writes plans for, as small stand-ins: the synthesizer plans them.

No registry knows a ``trust_remote_code`` model's classes, so a handwritten plan keyed by class
name never fires for a fork or a rename. These stand-ins copy the structure that makes each family
hard (not the weights or every detail), take ``input_ids`` and return logits, and the tests show
that ``autotp.synthesize`` writes a plan for each that verifies against the unsharded model:

- Baichuan: ``W_pack`` fuses [Q | K | V] (split by ``unflatten``), and ``NormHead`` is not an
  ``nn.Linear`` (it L2-normalises each vocabulary row of its weight before the matmul). NeMo shards
  the MLP only, for both reasons.
- DeciLM / Nemotron-NAS: per-layer block configs; a layer may have no attention, a single Linear in
  place of attention, a different kv-head count, or a different FFN width.
- Llama-3.3-Nemotron Super: fused ``qkv_proj`` (unequal parts under GQA) and ``gate_up_proj``.
"""

from __future__ import annotations

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp

pytestmark = pytest.mark.filterwarnings("ignore:Parallelize plan key")

DIM, HEAD_DIM, VOCAB, SEQ = 64, 16, 256, 16


class RMSNorm(nn.Module):
    def __init__(self, dim: int = DIM):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        return x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + 1e-6) * self.weight


def attend(q, k, v, heads: int, kv_heads: int):
    """Causal GQA attention on (batch, seq, heads * HEAD_DIM) projections."""
    b, t, _ = q.shape
    q, k, v = (z.view(b, t, -1, HEAD_DIM).transpose(1, 2) for z in (q, k, v))
    y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=kv_heads != heads)
    return y.transpose(1, 2).reshape(b, t, -1)


class SwiGLU(nn.Module):
    def __init__(self, width: int):
        super().__init__()
        self.gate_proj = nn.Linear(DIM, width, bias=False)
        self.up_proj = nn.Linear(DIM, width, bias=False)
        self.down_proj = nn.Linear(width, DIM, bias=False)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class CausalLM(nn.Module):
    """Embedding, pre-norm blocks, final norm and a head: the shell every stand-in shares."""

    def __init__(self, layers: list[nn.Module], head: nn.Module | None = None):
        super().__init__()
        self.embed_tokens = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(layers)
        self.norm = RMSNorm()
        self.lm_head = head if head is not None else nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, input_ids):
        x = self.embed_tokens(input_ids)
        for layer in self.layers:
            x = layer(x)
        return self.lm_head(self.norm(x))


# --- Baichuan ------------------------------------------------------------------------------------


class BaichuanAttention(nn.Module):
    def __init__(self, heads: int = 4):
        super().__init__()
        self.heads = heads
        self.W_pack = nn.Linear(DIM, 3 * DIM, bias=False)
        self.o_proj = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x):
        proj = self.W_pack(x).unflatten(-1, (3, DIM)).unsqueeze(0).transpose(0, -2).squeeze(-2)
        return self.o_proj(attend(proj[0], proj[1], proj[2], self.heads, self.heads))


class NormHead(nn.Module):
    """Baichuan2's head: logits against the L2-normalised vocabulary rows (not an nn.Linear)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(VOCAB, DIM))
        nn.init.kaiming_uniform_(self.weight, a=math.sqrt(5))

    def forward(self, x):
        return F.linear(x, F.normalize(self.weight))


class BaichuanLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(), RMSNorm()
        self.self_attn, self.mlp = BaichuanAttention(), SwiGLU(2 * DIM)

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def baichuan() -> CausalLM:
    return CausalLM([BaichuanLayer() for _ in range(2)], head=NormHead())


# --- DeciLM / Nemotron-NAS ----------------------------------------------------------------------


class DeciAttention(nn.Module):
    def __init__(self, heads: int, kv_heads: int):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.q_proj = nn.Linear(DIM, heads * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(DIM, kv_heads * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(DIM, kv_heads * HEAD_DIM, bias=False)
        self.o_proj = nn.Linear(heads * HEAD_DIM, DIM, bias=False)

    def forward(self, x):
        return self.o_proj(attend(self.q_proj(x), self.k_proj(x), self.v_proj(x), self.heads, self.kv_heads))


class DeciLayer(nn.Module):
    """One block config: ``attention`` is "gqa:<kv heads>", "linear" or "no_op"; ``ffn`` a width or 0."""

    def __init__(self, attention: str, ffn: int):
        super().__init__()
        self.attention_kind = attention
        if attention.startswith("gqa"):
            self.input_layernorm = RMSNorm()
            self.self_attn = DeciAttention(heads=4, kv_heads=int(attention.split(":")[1]))
        elif attention == "linear":  # NAS replaced the attention by one Linear
            self.input_layernorm = RMSNorm()
            self.self_attn = nn.Linear(DIM, DIM, bias=False)
        if ffn:
            self.post_attention_layernorm = RMSNorm()
            self.mlp = SwiGLU(ffn)

    def forward(self, x):
        if hasattr(self, "self_attn"):
            x = x + self.self_attn(self.input_layernorm(x))
        if hasattr(self, "mlp"):
            x = x + self.mlp(self.post_attention_layernorm(x))
        return x


DECI_BLOCKS = [("gqa:2", 128), ("no_op", 192), ("linear", 64), ("gqa:4", 0)]


def decilm() -> CausalLM:
    return CausalLM([DeciLayer(attention, ffn) for attention, ffn in DECI_BLOCKS])


# --- Llama-3.3-Nemotron Super (fused projections) --------------------------------------------------


class FusedAttention(nn.Module):
    def __init__(self, heads: int = 8, kv_heads: int = 4):
        super().__init__()
        self.heads, self.kv_heads = heads, kv_heads
        self.sizes = (heads * HEAD_DIM, kv_heads * HEAD_DIM, kv_heads * HEAD_DIM)
        self.qkv_proj = nn.Linear(DIM, sum(self.sizes), bias=False)
        self.o_proj = nn.Linear(heads * HEAD_DIM, DIM, bias=False)

    def forward(self, x):
        # Cut sizes from the head counts, as the remote code does: per-rank once tp divides them.
        q, k, v = self.qkv_proj(x).split(
            [self.heads * HEAD_DIM, self.kv_heads * HEAD_DIM, self.kv_heads * HEAD_DIM], dim=-1
        )
        return self.o_proj(attend(q, k, v, self.heads, self.kv_heads))


class FusedMLP(nn.Module):
    def __init__(self, width: int = 2 * DIM):
        super().__init__()
        self.gate_up_proj = nn.Linear(DIM, 2 * width, bias=False)
        self.down_proj = nn.Linear(width, DIM, bias=False)

    def forward(self, x):
        gate, up = self.gate_up_proj(x).chunk(2, dim=-1)
        return self.down_proj(F.silu(gate) * up)


class FusedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(), RMSNorm()
        self.self_attn, self.mlp = FusedAttention(), FusedMLP()

    def forward(self, x):
        x = x + self.self_attn(self.input_layernorm(x))
        return x + self.mlp(self.post_attention_layernorm(x))


def nemotron_super() -> CausalLM:
    return CausalLM([FusedLayer() for _ in range(2)])


# --- Tests ---------------------------------------------------------------------------------------

STANDINS = {"baichuan": baichuan, "decilm": decilm, "nemotron_super": nemotron_super}


@pytest.fixture(scope="module")
def standins():
    torch.manual_seed(0)
    return {name: build().eval() for name, build in STANDINS.items()}


def _ids(seed: int = 0):
    return (torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed)),)


@pytest.mark.parametrize(("name", "tp_size"), [
    ("baichuan", 2), ("baichuan", 4), ("decilm", 2), ("nemotron_super", 2), ("nemotron_super", 4),
])
def test_synthesized_plan_verifies_on_remote_code_standin(standins, name, tp_size):
    """Would catch a synthesized plan that splits a fused projection contiguously, shards a layer
    by another layer's key, or leaves a partial sum unreduced: all give wrong logits or grads."""
    model = standins[name]
    plan = autotp.synthesize(model, example_inputs=_ids(), verify=False)
    report = autotp.verify(model, plan, tp_size=tp_size, example_inputs=_ids(1))
    assert report.ok, str(report)
    assert report.param_fraction[0] < 0.75, report.param_fraction  # most of the model is sharded


def test_baichuan_plan_is_nemos_mlp_only_plan(standins):
    """NeMo shards Baichuan's MLP only; the synthesizer reaches the same plan on its own: W_pack's
    output is unflattened to (3, dim) and each of Q, K, V is picked by index on that axis, which it
    does not prove shard-safe, and NormHead (not an nn.Linear) normalises and uses its whole weight.
    Both stay replicated (the embedding is vocab-parallel on top of NeMo's)."""
    model = standins["baichuan"]
    plan = autotp.synthesize(model, example_inputs=_ids(), verify=False)
    # the MLP's pre-norm hands gate and up one replicated DTensor (their input gradients reduced once)
    assert sorted(plan) == ["embed_tokens", *(f"layers.*.mlp.{p}_proj" for p in ("down", "gate", "up")),
                            "layers.*.post_attention_layernorm"]
    reasons = {r.key: r.reason for r in autotp.explain(model, example_inputs=_ids())}
    assert "select" in reasons["layers.*.self_attn.W_pack"]


def test_decilm_layers_with_different_blocks_get_their_own_keys(standins):
    """Layer 1 has no attention and layer 3 no FFN: no key may give them another layer's styles."""
    model = standins["decilm"]
    plan = autotp.synthesize(model, example_inputs=_ids(), verify=False)
    touched = autotp.plan.resolve(model, plan)
    assert "layers.0.self_attn.k_proj" in touched and "layers.3.self_attn.k_proj" in touched
    assert "layers.1.mlp.down_proj" in touched and "layers.2.mlp.down_proj" in touched
    assert not any(fqn.startswith(("layers.1.self_attn", "layers.3.mlp")) for fqn in touched)


def test_nemotron_super_fused_gate_up_is_packed(standins):
    plan = autotp.synthesize(standins["nemotron_super"], example_inputs=_ids(), verify=False)
    assert plan["layers.*.mlp.gate_up_proj"].sizes == (2 * DIM, 2 * DIM)


def test_nemotron_super_fused_qkv_is_packed_with_gqa_sizes(standins):
    """The cut sizes come from ``heads`` and ``kv_heads``: both divided by tp make them per-rank.
    Would catch the fused qkv left replicated, or cut with global sizes (a split_with_sizes error)."""
    plan = autotp.synthesize(standins["nemotron_super"], example_inputs=_ids(), verify=False)
    assert plan["layers.*.self_attn.qkv_proj"].sizes == (8 * HEAD_DIM, 4 * HEAD_DIM, 4 * HEAD_DIM)
    assert plan["layers.*.self_attn"].names == ("heads", "kv_heads")


def test_decilm_layer_with_fewer_kv_heads_than_tp_replicates_them(standins):
    """Layer 0 has 2 kv heads: at tp=4 each rank holds the kv head its query heads read, and the plan
    still matches the unsharded model. Would catch kv heads split below one head per rank."""
    model = standins["decilm"]
    plan = autotp.synthesize(model, example_inputs=_ids(), tp_size=4, verify=False)
    assert plan["layers.0.self_attn.k_proj"].kv_heads == 2
    report = autotp.verify(model, plan, tp_size=4, example_inputs=_ids(1))
    assert report.ok, str(report)


def test_decilm_query_heads_that_tp_cannot_split_are_refused_by_name(standins):
    """4 query heads over tp=8: the error names the module and the tp sizes that work."""
    with pytest.raises(autotp.AutoTPError, match=r"layers\.0\.self_attn\.k_proj: 4 query heads .*tp=8.*use tp in \(1, 2, 4\)"):
        autotp.synthesize(standins["decilm"], example_inputs=_ids(), tp_size=8, verify=False)
