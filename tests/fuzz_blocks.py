"""Plain-PyTorch decoder LMs written the ways people write them, for synthesis fuzzing.

A :class:`BlockSpec` picks one idiom per choice point: how q/k/v are projected (separate, one fused
Linear cut by ``chunk`` / ``split`` / ``unbind``, or viewed into parts and permuted), how the width
is split into heads (a fixed count with an inferred size, a fixed size with an inferred count, both
fixed, ``unflatten``), how attention is computed (``scaled_dot_product_attention``, matmuls, einsum,
``baddbmm`` / ``bmm`` on heads merged with the batch into rows), how heads merge back
(inferred width, a fixed width, ``flatten``), which parameter of the attention module itself meets
the heads (none, a shared lambda vector, a per-head scale, a per-head softmax sink, a per-feature
bias), and whether the head is tied to the embedding. None of these is any one model's code.

Shared by ``tests/test_silent_wrong.py``, ``tests/test_fuzz.py`` and ``benchmarks/fuzz.py``.
"""

from __future__ import annotations

import random
from dataclasses import asdict, dataclass

import torch
import torch.nn.functional as F
from hypothesis import strategies as st
from torch import nn

VOCAB, SEQ = 128, 11

PROJECTIONS = ("separate", "chunk", "split", "unbind_parts", "unbind_heads", "permute_parts")
HEAD_SPLITS = ("count", "size", "both", "unflatten", "reshape_count")
ATTENTIONS = ("sdpa", "matmul", "einsum", "bmm_rows")
MERGES = ("inferred", "fixed", "flatten")
HEAD_PARAMS = ("none", "lambda", "scale", "sink", "feature_bias")
MLPS = ("gelu", "swiglu", "fused_swiglu")


@dataclass(frozen=True)
class BlockSpec:
    """One point of the idiom space (see the module docstring); sizes are small and tp-divisible."""

    projection: str = "separate"
    head_split: str = "size"
    attention: str = "sdpa"
    merge: str = "inferred"
    head_param: str = "none"
    mlp: str = "gelu"
    tied: bool = False
    heads: int = 4
    head_dim: int = 8
    dim: int = 32

    def as_dict(self) -> dict:
        return asdict(self)


class SpecAttention(nn.Module):
    """Causal self-attention whose every step follows the idiom its :class:`BlockSpec` names."""

    def __init__(self, spec: BlockSpec):
        super().__init__()
        self.spec = spec
        self.n_heads, self.head_dim, self.inner = spec.heads, spec.head_dim, spec.heads * spec.head_dim
        if spec.projection == "separate":
            self.q, self.k, self.v = (nn.Linear(spec.dim, self.inner) for _ in range(3))
        else:
            self.qkv = nn.Linear(spec.dim, 3 * self.inner)
        self.out = nn.Linear(self.inner, spec.dim)
        if spec.head_param == "lambda":  # two vectors over head_dim, shared by every head
            self.lambda_q = nn.Parameter(torch.randn(self.head_dim) * 0.3)
            self.lambda_k = nn.Parameter(torch.randn(self.head_dim) * 0.3)
        elif spec.head_param == "scale":
            self.head_scale = nn.Parameter(1 + 0.3 * torch.randn(spec.heads))
        elif spec.head_param == "sink":
            self.sink = nn.Parameter(torch.randn(spec.heads))
        elif spec.head_param == "feature_bias":
            self.feature_bias = nn.Parameter(0.1 * torch.randn(self.inner))

    def project(self, x):
        """q, k, v as (b, t, heads, head_dim), or (b, t, width) for :meth:`split_heads`."""
        kind = self.spec.projection
        if kind == "separate":
            return self.q(x), self.k(x), self.v(x)
        qkv = self.qkv(x)
        if kind == "chunk":
            return qkv.chunk(3, dim=-1)
        if kind == "split":
            return qkv.split(self.inner, dim=-1)
        b, t, _ = x.shape
        if kind == "unbind_parts":  # (b, t, 3, heads, hd): parts outermost
            return qkv.view(b, t, 3, self.n_heads, -1).unbind(2)
        if kind == "permute_parts":  # the same, permuted to (3, b, t, heads, hd) first
            return qkv.view(b, t, 3, self.n_heads, -1).permute(2, 0, 1, 3, 4).unbind(0)
        return qkv.view(b, t, self.n_heads, 3, -1).unbind(3)  # heads outermost, q|k|v inside each

    def split_heads(self, z, b, t):
        """(b, t, width) -> (b, t, heads, head_dim) with the spec's idiom."""
        if z.dim() == 4:
            return z
        kind = self.spec.head_split
        if kind == "count":
            return z.view(b, t, self.n_heads, -1)
        if kind == "size":
            return z.view(b, t, -1, self.head_dim)
        if kind == "both":
            return z.view(b, t, self.n_heads, self.head_dim)
        if kind == "unflatten":
            return z.unflatten(-1, (self.n_heads, -1))
        return z.reshape(b, t, self.n_heads, -1)

    def lambda_value(self):
        """A scalar from the two shared vectors (a differential-attention style re-weighting)."""
        return torch.exp(torch.sum(self.lambda_q * self.lambda_k)) * 0.5

    def attend(self, q, k, v):
        """(b, t, heads, hd) each -> (b, t, heads, hd)."""
        kind, param = self.spec.attention, self.spec.head_param
        if kind == "sdpa" and param != "sink":
            y = F.scaled_dot_product_attention(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2),
                                               is_causal=True)
            return y.transpose(1, 2)
        t = q.shape[1]
        if kind == "bmm_rows" and param != "sink":  # heads merged with the batch into bmm rows
            b, _, _, d = q.shape
            rows = lambda z: z.transpose(1, 2).reshape(b * self.n_heads, t, d)  # noqa: E731
            causal = torch.full((t, t), float("-inf")).triu(1)  # made without a device
            scores = torch.baddbmm(causal, rows(q), rows(k).transpose(1, 2), alpha=self.head_dim ** -0.5)
            return torch.bmm(scores.softmax(-1), rows(v)).view(b, self.n_heads, t, d).transpose(1, 2)
        if kind == "einsum":
            scores = torch.einsum("bqhd,bkhd->bhqk", q, k)
        else:
            scores = q.transpose(1, 2) @ k.transpose(1, 2).transpose(-1, -2)
        scores = scores / self.head_dim ** 0.5
        causal = torch.ones(t, t, dtype=torch.bool, device=q.device).tril()
        scores = scores.masked_fill(~causal, float("-inf"))
        if param == "sink":  # one extra logit per head that takes probability mass and no value
            sink = self.sink.view(1, -1, 1, 1).expand(scores.shape[0], -1, t, 1)
            probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :t]
        else:
            probs = scores.softmax(-1)
        if kind == "einsum":
            return torch.einsum("bhqk,bkhd->bqhd", probs, v)
        return (probs @ v.transpose(1, 2)).transpose(1, 2)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (self.split_heads(z, b, t) for z in self.project(x))
        y = self.attend(q, k, v)
        if self.spec.head_param == "lambda":
            y = y * (1 - self.lambda_value())
        elif self.spec.head_param == "scale":
            y = y * self.head_scale.view(1, 1, -1, 1)
        merge = self.spec.merge
        if merge == "fixed":
            y = y.reshape(b, t, self.inner)
        elif merge == "flatten":
            y = y.flatten(2)
        else:
            y = y.reshape(b, t, -1)
        if self.spec.head_param == "feature_bias":
            y = y + self.feature_bias
        return self.out(y)


class SpecMLP(nn.Module):
    def __init__(self, spec: BlockSpec):
        super().__init__()
        self.kind, hidden = spec.mlp, 2 * spec.dim
        if self.kind == "fused_swiglu":
            self.up = nn.Linear(spec.dim, 2 * hidden)
        else:
            self.up = nn.Linear(spec.dim, hidden)
            if self.kind == "swiglu":
                self.gate = nn.Linear(spec.dim, hidden)
        self.down = nn.Linear(hidden, spec.dim)

    def forward(self, x):
        if self.kind == "gelu":
            return self.down(F.gelu(self.up(x)))
        if self.kind == "swiglu":
            return self.down(F.silu(self.gate(x)) * self.up(x))
        gate, up = self.up(x).chunk(2, dim=-1)
        return self.down(F.silu(gate) * up)


class SpecBlock(nn.Module):
    def __init__(self, spec: BlockSpec, attention: type[nn.Module] = SpecAttention):
        super().__init__()
        self.norm_1, self.norm_2 = nn.LayerNorm(spec.dim), nn.LayerNorm(spec.dim)
        self.attn, self.mlp = attention(spec), SpecMLP(spec)

    def forward(self, x):
        x = x + self.attn(self.norm_1(x))
        return x + self.mlp(self.norm_2(x))


class SpecLM(nn.Module):
    """Embedding, two :class:`SpecBlock` layers, a final norm and a head (tied if the spec says)."""

    def __init__(self, spec: BlockSpec, attention: type[nn.Module] = SpecAttention, seed: int = 0):
        super().__init__()
        torch.manual_seed(seed)
        self.embed = nn.Embedding(VOCAB, spec.dim)
        self.blocks = nn.ModuleList(SpecBlock(spec, attention) for _ in range(2))
        self.norm = nn.LayerNorm(spec.dim)
        self.head = nn.Linear(spec.dim, VOCAB, bias=False)
        if spec.tied:
            self.head.weight = self.embed.weight

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def tokens(seed: int = 0) -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(seed))


@st.composite
def block_spec(draw) -> BlockSpec:
    """A random :class:`BlockSpec` whose heads split over tp 2 and 4."""
    return BlockSpec(
        projection=draw(st.sampled_from(PROJECTIONS)),
        head_split=draw(st.sampled_from(HEAD_SPLITS)),
        attention=draw(st.sampled_from(ATTENTIONS)),
        merge=draw(st.sampled_from(MERGES)),
        head_param=draw(st.sampled_from(HEAD_PARAMS)),
        mlp=draw(st.sampled_from(MLPS)),
        tied=draw(st.booleans()),
        heads=draw(st.sampled_from([4, 8])),
        head_dim=draw(st.sampled_from([4, 8])),
    )


def distinct_specs(count: int, *, seed: int = 0) -> list[BlockSpec]:
    """``count`` different random :class:`BlockSpec` (a long sweep should not repeat a case).

    >>> len(set(distinct_specs(20)))
    20
    """
    rng, found = random.Random(seed), {}
    while len(found) < count:
        spec = BlockSpec(projection=rng.choice(PROJECTIONS), head_split=rng.choice(HEAD_SPLITS),
                         attention=rng.choice(ATTENTIONS), merge=rng.choice(MERGES),
                         head_param=rng.choice(HEAD_PARAMS), mlp=rng.choice(MLPS), tied=rng.random() < 0.5,
                         heads=rng.choice([4, 8]), head_dim=rng.choice([4, 8]))
        found.setdefault(spec, None)
    return list(found)
