"""Non-transformers models for synthesis tests: nanoGPT-style, torchtitan-style, parallel block."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, KV_HEADS, VOCAB, SEQ = 64, 4, 2, 256, 11


class TwoLinear(nn.Module):
    """The smallest column/row pair: up -> gelu -> down."""

    def __init__(self):
        super().__init__()
        self.up = nn.Linear(DIM, 4 * DIM)
        self.down = nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return self.down(F.gelu(self.up(x)))


class CausalSelfAttention(nn.Module):
    """nanoGPT attention: fused ``c_attn`` split into q, k, v with sizes from ``n_embd`` / ``n_head``.

    The common attribute-based variant: every width is computed from ``self.n_embd`` and
    ``self.n_head``, so dividing both by tp makes the split and the views per-rank.
    """

    def __init__(self):
        super().__init__()
        self.n_embd, self.n_head = DIM, HEADS
        self.c_attn, self.c_proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, self.n_embd // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, self.n_embd))


class SizeFromInputAttention(CausalSelfAttention):
    """nanoGPT's original attention: head size and output width from ``x.size()``, the global width.

    ``C // n_head`` and ``view(B, T, C)`` read the replicated input's width, so no attribute
    division makes the per-rank shapes right: synthesis must keep ``c_attn`` whole.
    """

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.c_fc, self.c_proj = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        return self.c_proj(F.gelu(self.c_fc(x)))


class GPTBlock(nn.Module):
    """nanoGPT block: pre-LayerNorms (with bias), attention, MLP."""

    def __init__(self, attention: type[nn.Module] = CausalSelfAttention):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.mlp = attention(), MLP()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.mlp(self.ln_2(x))


class NanoGPT(nn.Module):
    """nanoGPT: token + position embeddings, blocks, final LayerNorm, head tied to ``wte``."""

    def __init__(self, layers: int = 2, attention: type[nn.Module] = CausalSelfAttention):
        super().__init__()
        torch.manual_seed(0)
        self.wte, self.wpe = nn.Embedding(VOCAB, DIM), nn.Embedding(64, DIM)
        self.h = nn.ModuleList(GPTBlock(attention) for _ in range(layers))
        self.ln_f = nn.LayerNorm(DIM)
        self.lm_head = nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.wte.weight
        for module in self.modules():  # nanoGPT's init: N(0, 0.02) keeps the tied logits O(1)
            if isinstance(module, (nn.Linear, nn.Embedding)):
                nn.init.normal_(module.weight, std=0.02)

    def forward(self, idx):
        pos = torch.arange(idx.shape[1], device=idx.device)
        x = self.wte(idx) + self.wpe(pos)
        for block in self.h:
            x = block(x)
        return self.lm_head(self.ln_f(x))


class TitanAttention(nn.Module):
    """torchtitan Llama attention: wq/wk/wv/wo, GQA by ``repeat_interleave``-free expand."""

    def __init__(self):
        super().__init__()
        hd = DIM // HEADS
        self.wq, self.wo = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.wk, self.wv = nn.Linear(DIM, KV_HEADS * hd, bias=False), nn.Linear(DIM, KV_HEADS * hd, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.wq(x).view(b, t, -1, DIM // HEADS).transpose(1, 2)
        k = self.wk(x).view(b, t, -1, DIM // HEADS).transpose(1, 2)
        v = self.wv(x).view(b, t, -1, DIM // HEADS).transpose(1, 2)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class TitanFeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False)
        self.w2 = nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TitanBlock(nn.Module):
    def __init__(self, parallel: bool = False):
        super().__init__()
        self.parallel = parallel
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attention, self.feed_forward = TitanAttention(), TitanFeedForward()

    def forward(self, x):
        if self.parallel:  # GPT-J / PaLM: attention and MLP read the same normed input
            h = self.attention_norm(x)
            return x + self.attention(h) + self.feed_forward(h)
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.ffn_norm(x))


class TitanLlama(nn.Module):
    """torchtitan-style Llama (``tok_embeddings``, ``layers``, ``norm``, ``output``)."""

    def __init__(self, layers: int = 2, parallel: bool = False):
        super().__init__()
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(TitanBlock(parallel) for _ in range(layers))
        self.norm = nn.RMSNorm(DIM)
        self.output = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.output(self.norm(h))


def example_tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ))


def verify_toy(model: nn.Module, plan, tp_size: int = 2, inputs=None):
    """Verify ``plan`` on a toy model fed ``inputs`` (default :func:`example_tokens`); the report,
    asserted ok."""
    import warnings

    from autotp.verifier import verify

    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp_size, example_inputs=(example_tokens(),) if inputs is None else inputs)
    assert report.ok, str(report)
    return report


class SeparateQKVAttention(nn.Module):
    """Causal attention with separate q / k / v / out Linears, heads split by ``view(..., -1, hd)``."""

    def __init__(self, dim, heads):
        super().__init__()
        self.heads, self.head_dim = heads, dim // heads
        self.q, self.k, self.v, self.out = (nn.Linear(dim, dim, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class StackedExperts(nn.Module):
    """Experts as stacked 3-D weights, run by a loop over experts that adds each one's weighted
    output into one sum (``index_add``): transformers' eager grouped-experts layout."""

    def __init__(self, dim, experts, ffn):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.randn(experts, 2 * ffn, dim) / dim**0.5)
        self.down_proj = nn.Parameter(torch.randn(experts, dim, ffn) / ffn**0.5)

    def forward(self, x, index, weights):
        out = torch.zeros_like(x)
        for expert in range(self.gate_up_proj.shape[0]):
            token, slot = torch.where(index == expert)
            gate, up = F.linear(x[token], self.gate_up_proj[expert]).chunk(2, dim=-1)
            y = F.linear(F.silu(gate) * up, self.down_proj[expert]) * weights[token, slot, None]
            out = out.index_add(0, token, y)
        return out


def train_step_runs(model, plan, tp_size, ids):
    """One training-mode forward and backward of the sharded model (live dropout), every rank
    holding the same logits; returns the logits' local values."""
    import copy

    from autotp import _simulate
    from autotp.apply import apply_plan

    sharded = copy.deepcopy(model).train()
    with _simulate.simulated_mesh(tp_size) as mesh:
        apply_plan(sharded, mesh, plan)
        logits = sharded(ids)
        logits = getattr(logits, "logits", logits)
        logits.full_tensor().float().square().mean().backward()
        ranks = _simulate.per_rank(logits.full_tensor(), tp_size)
    assert all(torch.equal(ranks[0], r) for r in ranks[1:]), "ranks disagree on the logits"
    assert all(p.grad is not None for p in sharded.parameters() if p.requires_grad)
    return ranks[0]
