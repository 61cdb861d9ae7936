"""Tiny decoders written the way reference implementations and single-file training repos write
them (issue 42, item 7: code nobody here wrote), named after no project.

The skeleton: ``tok_embeddings``, blocks of ``attention`` + SwiGLU ``feed_forward`` (``w1``, ``w2``,
``w3``) with pre-norms, a final norm and an ``output`` head. The root computes complex rotary
frequencies once (``torch.polar``, kept as a plain attribute, not a buffer) and a float causal
mask, and hands both to every block. What varies is the attention:

- ``complex_rotary``: separate ``wq`` / ``wk`` / ``wv`` / ``wo``, heads as ``(b, n, h, d)`` views,
  rotary applied through ``view_as_complex`` / ``view_as_real``, kv heads repeated by
  ``expand`` + ``reshape`` (4 kv heads, 8 query heads), scores by ``matmul``, softmax in float32;
- ``fused_gqa``: one ``qkv`` Linear (with a bias) for queries and grouped kv, cut by
  ``split([dim, kv_size, kv_size])``, heads by ``permute``, ``scaled_dot_product_attention`` with
  ``enable_gqa=True``;
- ``gated_output``: ``complex_rotary`` with its output multiplied by ``sigmoid(gate(x))`` before
  ``wo``, attention by sdpa with the float mask;
- ``head_temperature``: one ``to_qkv`` Linear cut by ``chunk(3)``, cosine-similarity scores
  (``F.normalize``) times a learned per-head temperature ``Parameter(heads)`` viewed
  ``(1, heads, 1, 1)``;
- ``float32_qk_norm``: ``complex_rotary`` with per-head RMS norms of the queries and keys computed
  in float32 inside ``torch.autocast(device_type=x.device.type, enabled=False)`` (as training
  libraries write norms that must not run in bf16);
- ``differential``: differential attention: twice the heads of queries and keys, two softmaxes per
  head subtracted with a learned scalar ``lambda`` (from four ``Parameter(head_dim)``), a norm over
  each head's doubled value width.

:func:`bound_fraction` is the parameter fraction per rank at the bound: every parameter cut
``1/tp`` but the norms' weights, the row biases and the differential attention's lambdas (scalars
shared by every head).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

VOCAB, DIM, HEADS, KV_HEADS, HEAD_DIM, FFN, SEQ, MAX_SEQ = 128, 64, 8, 4, 8, 128, 8, 64


def precompute_freqs_cis(dim: int, end: int, theta: float = 10000.0) -> torch.Tensor:
    freqs = 1.0 / (theta ** (torch.arange(0, dim, 2)[: dim // 2].float() / dim))
    return torch.polar(torch.ones(end, dim // 2), torch.outer(torch.arange(end).float(), freqs))


def apply_rotary_emb(xq, xk, freqs_cis):
    """Rotate ``(b, n, h, d)`` queries and keys by complex multiplication."""
    xq_ = torch.view_as_complex(xq.float().reshape(*xq.shape[:-1], -1, 2))
    xk_ = torch.view_as_complex(xk.float().reshape(*xk.shape[:-1], -1, 2))
    freqs_cis = freqs_cis.view(1, xq_.shape[1], 1, xq_.shape[-1])
    return (torch.view_as_real(xq_ * freqs_cis).flatten(3).type_as(xq),
            torch.view_as_real(xk_ * freqs_cis).flatten(3).type_as(xk))


def repeat_kv(x: torch.Tensor, n_rep: int) -> torch.Tensor:
    """``(b, n, kv, d)`` -> ``(b, n, kv * n_rep, d)``, each kv head repeated for its query heads."""
    b, n, kv, d = x.shape
    return x if n_rep == 1 else x[:, :, :, None, :].expand(b, n, kv, n_rep, d).reshape(b, n, kv * n_rep, d)


class ComplexRotaryAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = HEADS, KV_HEADS, HEAD_DIM
        self.wq = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.wk = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wv = nn.Linear(DIM, KV_HEADS * HEAD_DIM, bias=False)
        self.wo = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def qkv(self, x, freqs_cis):
        b, n, _ = x.shape
        xq = self.wq(x).view(b, n, self.n_heads, self.head_dim)
        xk = self.wk(x).view(b, n, self.n_kv_heads, self.head_dim)
        xv = self.wv(x).view(b, n, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        n_rep = self.n_heads // self.n_kv_heads
        return xq.transpose(1, 2), repeat_kv(xk, n_rep).transpose(1, 2), repeat_kv(xv, n_rep).transpose(1, 2)

    def forward(self, x, freqs_cis, mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x, freqs_cis)
        scores = torch.matmul(q, k.transpose(2, 3)) / math.sqrt(self.head_dim) + mask
        scores = F.softmax(scores.float(), dim=-1).type_as(q)
        return self.wo(torch.matmul(scores, v).transpose(1, 2).contiguous().view(b, n, -1))


class Float32Norm(nn.Module):
    """RMS norm in float32 whatever autocast says."""

    def __init__(self, width: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(width) + 0.1 * torch.randn(width)), eps

    def forward(self, x):
        with torch.autocast(enabled=False, device_type=x.device.type):
            og_dtype, x = x.dtype, x.float()
            x = x * torch.rsqrt(x.pow(2).mean(-1, keepdim=True) + self.eps)
            return (self.weight * x).to(og_dtype)


class Float32QKNormAttention(ComplexRotaryAttention):
    def __init__(self):
        super().__init__()
        self.q_norm, self.k_norm = Float32Norm(HEAD_DIM), Float32Norm(HEAD_DIM)

    def forward(self, x, freqs_cis, mask):
        b, n, _ = x.shape
        xq = self.q_norm(self.wq(x).view(b, n, self.n_heads, self.head_dim))
        xk = self.k_norm(self.wk(x).view(b, n, self.n_kv_heads, self.head_dim))
        xv = self.wv(x).view(b, n, self.n_kv_heads, self.head_dim)
        xq, xk = apply_rotary_emb(xq, xk, freqs_cis)
        n_rep = self.n_heads // self.n_kv_heads
        q, k, v = xq.transpose(1, 2), repeat_kv(xk, n_rep).transpose(1, 2), repeat_kv(xv, n_rep).transpose(1, 2)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)
        return self.wo(out.transpose(1, 2).reshape(b, n, -1))


class FusedGQAAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.n_head, self.n_local_heads, self.head_dim, self.dim = HEADS, KV_HEADS, HEAD_DIM, HEADS * HEAD_DIM
        self.qkv = nn.Linear(DIM, (HEADS + 2 * KV_HEADS) * HEAD_DIM, bias=True)
        self.proj = nn.Linear(HEADS * HEAD_DIM, DIM)

    def forward(self, x, freqs_cis, mask):
        b, n, _ = x.shape
        kv_size = self.n_local_heads * self.head_dim
        q, k, v = self.qkv(x).split([self.dim, kv_size, kv_size], dim=-1)
        q = q.view(b, n, self.n_head, self.head_dim).permute(0, 2, 1, 3)
        k = k.view(b, n, self.n_local_heads, self.head_dim).permute(0, 2, 1, 3)
        v = v.view(b, n, self.n_local_heads, self.head_dim).permute(0, 2, 1, 3)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=True)
        return self.proj(out.permute(0, 2, 1, 3).reshape(b, n, self.dim))


class GatedOutputAttention(ComplexRotaryAttention):
    def __init__(self):
        super().__init__()
        self.gate = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)

    def forward(self, x, freqs_cis, mask):
        b, n, _ = x.shape
        q, k, v = self.qkv(x, freqs_cis)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask).transpose(1, 2).reshape(b, n, -1)
        return self.wo(out * torch.sigmoid(self.gate(x)))


class HeadTemperatureAttention(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = HEADS
        self.to_qkv = nn.Linear(DIM, 3 * HEADS * HEAD_DIM, bias=False)
        self.to_out = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        self.temperature = nn.Parameter(torch.full((HEADS,), 10.0) + torch.randn(HEADS))

    def forward(self, x, freqs_cis, mask):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, self.heads, -1).transpose(1, 2) for t in self.to_qkv(x).chunk(3, dim=-1))
        q, k = F.normalize(q, dim=-1), F.normalize(k, dim=-1)
        sim = (q @ k.transpose(-2, -1)) * self.temperature.view(1, -1, 1, 1) + mask
        return self.to_out((sim.softmax(-1) @ v).transpose(1, 2).reshape(b, n, -1))


class DifferentialAttention(nn.Module):
    def __init__(self, lambda_init: float = 0.8):
        super().__init__()
        self.num_heads, self.head_dim, self.lambda_init = HEADS // 2, HEAD_DIM, lambda_init
        self.q_proj = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.k_proj = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.v_proj = nn.Linear(DIM, HEADS * HEAD_DIM, bias=False)
        self.out_proj = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)
        for name in ("lambda_q1", "lambda_k1", "lambda_q2", "lambda_k2"):
            setattr(self, name, nn.Parameter(torch.randn(HEAD_DIM) * 0.1))
        self.subln = nn.RMSNorm(2 * HEAD_DIM)

    def forward(self, x, freqs_cis, mask):
        b, n, _ = x.shape
        q = self.q_proj(x).view(b, n, 2 * self.num_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(b, n, 2 * self.num_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(b, n, self.num_heads, 2 * self.head_dim).transpose(1, 2)
        weights = (q @ k.transpose(-1, -2) / math.sqrt(self.head_dim) + mask).softmax(-1)
        weights = weights.view(b, self.num_heads, 2, n, n)
        lambda_full = (torch.exp(torch.sum(self.lambda_q1 * self.lambda_k1))
                       - torch.exp(torch.sum(self.lambda_q2 * self.lambda_k2)) + self.lambda_init)
        out = self.subln((weights[:, :, 0] - lambda_full * weights[:, :, 1]) @ v) * (1 - self.lambda_init)
        return self.out_proj(out.transpose(1, 2).reshape(b, n, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w2, self.w3 = nn.Linear(DIM, FFN, bias=False), nn.Linear(FFN, DIM, bias=False), \
            nn.Linear(DIM, FFN, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class TransformerBlock(nn.Module):
    def __init__(self, attention: nn.Module):
        super().__init__()
        self.attention, self.feed_forward = attention, FeedForward()
        self.attention_norm, self.ffn_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)

    def forward(self, x, freqs_cis, mask):
        h = x + self.attention(self.attention_norm(x), freqs_cis, mask)
        return h + self.feed_forward(self.ffn_norm(h))


class Transformer(nn.Module):
    def __init__(self, attention: type[nn.Module], n_layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.tok_embeddings = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(TransformerBlock(attention()) for _ in range(n_layers))
        self.norm, self.output = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
        self.freqs_cis = precompute_freqs_cis(HEAD_DIM, MAX_SEQ)  # a plain attribute, as such code keeps it

    def forward(self, tokens):
        n = tokens.shape[1]
        h = self.tok_embeddings(tokens)
        freqs_cis = self.freqs_cis[:n]
        mask = torch.full((n, n), float("-inf"), device=tokens.device).triu(1)
        for layer in self.layers:
            h = layer(h, freqs_cis, mask)
        return self.output(self.norm(h)).float()


IDIOMS = {
    "complex_rotary": lambda: Transformer(ComplexRotaryAttention),
    "fused_gqa": lambda: Transformer(FusedGQAAttention),
    "gated_output": lambda: Transformer(GatedOutputAttention),
    "head_temperature": lambda: Transformer(HeadTemperatureAttention),
    "float32_qk_norm": lambda: Transformer(Float32QKNormAttention),
    "differential": lambda: Transformer(DifferentialAttention),
}


def tokens(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def bound_fraction(model: nn.Module, tp: int) -> float:
    total = held = 0.0
    for name, param in model.named_parameters():
        owner = model.get_submodule(name.rpartition(".")[0])
        whole = (isinstance(owner, (nn.RMSNorm, Float32Norm)) or ".lambda_" in name
                 or name.endswith(("proj.bias", "wo.bias", "out_proj.bias")))
        total += param.numel()
        held += param.numel() if whole else param.numel() / tp
    return held / total
