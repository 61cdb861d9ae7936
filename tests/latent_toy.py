"""A latent-attention toy: low-rank query and key-value projections and a rope key shared by every head."""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import nn

from synth_toy import DIM, MLP, VOCAB

HEADS, NOPE, ROPE, V_DIM = 4, 8, 16, 16


def _rotate(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """Rotary embedding, rotate-half form (cos and sin over the whole rope width)."""
    half = x.shape[-1] // 2
    return x * cos + torch.cat([-x[..., half:], x[..., :half]], dim=-1) * sin


class LatentAttention(nn.Module):
    """Queries and keys/values come up from low-rank latents, each normalised first; the key's rope
    part is cut from the key-value down-projection, rotated once and expanded to every head."""

    def __init__(self, q_rank: int, kv_rank: int, rope: int = ROPE):
        super().__init__()
        self.kv_rank, self.rope = kv_rank, rope
        self.q_down, self.q_norm = nn.Linear(DIM, q_rank, bias=False), nn.RMSNorm(q_rank)
        self.q_up = nn.Linear(q_rank, HEADS * (NOPE + rope), bias=False)
        self.kv_down, self.kv_norm = nn.Linear(DIM, kv_rank + rope, bias=False), nn.RMSNorm(kv_rank)
        self.kv_up = nn.Linear(kv_rank, HEADS * (NOPE + V_DIM), bias=False)
        self.out = nn.Linear(HEADS * V_DIM, DIM, bias=False)
        self.register_buffer("inv_freq", 1.0 / 100 ** (torch.arange(rope // 2) / (rope // 2)), persistent=False)

    def forward(self, x):
        b, t, _ = x.shape
        angles = torch.arange(t, device=x.device)[:, None] * self.inv_freq
        angles = torch.cat([angles, angles], dim=-1)
        cos, sin = angles.cos(), angles.sin()
        q = self.q_up(self.q_norm(self.q_down(x))).view(b, t, -1, NOPE + self.rope).transpose(1, 2)
        q_nope, q_rot = q.split([NOPE, self.rope], dim=-1)
        latent, k_rot = self.kv_down(x).split([self.kv_rank, self.rope], dim=-1)
        kv = self.kv_up(self.kv_norm(latent)).view(b, t, -1, NOPE + V_DIM).transpose(1, 2)
        k_nope, v = kv.split([NOPE, V_DIM], dim=-1)
        k_rot = _rotate(k_rot.view(b, 1, t, self.rope), cos, sin)
        q = torch.cat([q_nope, _rotate(q_rot, cos, sin)], dim=-1)
        k = torch.cat([k_nope, k_rot.expand(-1, k_nope.shape[1], -1, -1)], dim=-1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class LatentLayer(nn.Module):
    def __init__(self, q_rank: int, kv_rank: int):
        super().__init__()
        self.attn_norm, self.mlp_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attn, self.mlp = LatentAttention(q_rank, kv_rank), MLP()

    def forward(self, x):
        x = x + self.attn(self.attn_norm(x))
        return x + self.mlp(self.mlp_norm(x))


class LatentModel(nn.Module):
    """Two latent-attention layers; ``q_rank`` and ``kv_rank`` size the latents against ``DIM``."""

    def __init__(self, q_rank: int = 32, kv_rank: int = 32):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(LatentLayer(q_rank, kv_rank) for _ in range(2))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))
