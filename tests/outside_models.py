"""Tiny plain-PyTorch language models written the way outside libraries write them: position terms
and residual-stream idioms.

Each builder returns a decoder of the same skeleton (token embedding, two pre-norm blocks of
attention and a feed-forward, a final norm, a head) that differs from :func:`plain` in one idiom:

- ``partial_rotary``: heads split and merged by einops layer modules holding a fixed head count
  (``Rearrange('b n (h d) -> b h n d', h=heads)``), rotary embedding on the first half of each head
  (the rest concatenated back), scores and values by ``einsum`` patterns;
- ``alibi``: the same attention with ALiBi: per-head slopes registered as a ``(heads, 1, 1)`` buffer
  times a distance matrix, added to the scores;
- ``distance_mlp``: a per-head bias made by a small MLP from relative distances
  (``1 -> hidden -> heads``), ``(heads, n, n)``, added to the scores;
- ``hyper_connections``: several residual streams ``(streams, b, n, d)``; each branch reads a learned
  weighted mix of the streams, the streams are mixed by a learned matrix, the branch's output is
  written back with learned weights;
- ``token_shift``: half the channels of each branch's (normed) input shifted by one position along
  the sequence (``F.pad``) before the branch.

The models are the test subject of ``tests/test_outside_positions.py``; they are built for the
patterns in the graph, not for names, and are named after no library.
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from einops import rearrange, repeat
from einops.layers.torch import Rearrange
from torch import einsum, nn

VOCAB, DIM, HEADS, DIM_HEAD, SEQ = 64, 64, 4, 16, 12


def tokens(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(0))


# ----------------------------------------------------------------------------- position terms


class RotaryEmbedding(nn.Module):
    """Rotary frequencies for ``dim`` channels (applied to the first ``dim`` of each head)."""

    def __init__(self, dim: int, theta: float = 10000.0):
        super().__init__()
        inv_freq = 1.0 / (theta ** (torch.arange(0, dim, 2).float() / dim))
        self.register_buffer("inv_freq", inv_freq, persistent=False)

    def forward(self, seq_len: int, device=None):
        t = torch.arange(seq_len, device=device, dtype=self.inv_freq.dtype)
        freqs = einsum("i , j -> i j", t, self.inv_freq)
        return torch.cat((freqs, freqs), dim=-1)


def rotate_half(x):
    x = rearrange(x, "... (j d) -> ... j d", j=2)
    x1, x2 = x.unbind(dim=-2)
    return torch.cat((-x2, x1), dim=-1)


def apply_rotary_pos_emb(t, freqs):
    """Rotate the first ``freqs.shape[-1]`` channels of each head; pass the rest through."""
    rot_dim = freqs.shape[-1]
    t, t_pass = t[..., :rot_dim], t[..., rot_dim:]
    t = (t * freqs.cos()) + (rotate_half(t) * freqs.sin())
    return torch.cat((t, t_pass), dim=-1)


class AlibiPositionalBias(nn.Module):
    """ALiBi: ``-|i - j| * slope_h``, slopes a ``(heads, 1, 1)`` buffer."""

    def __init__(self, heads: int):
        super().__init__()
        slopes = torch.tensor(self._get_slopes(heads))
        self.register_buffer("slopes", rearrange(slopes, "h -> h 1 1"), persistent=False)

    @staticmethod
    def _get_slopes(heads):
        def power_of_2(n):
            start = 2 ** (-(2 ** -(math.log2(n) - 3)))
            return [start * start**i for i in range(n)]

        if math.log2(heads).is_integer():
            return power_of_2(heads)
        closest = 2 ** math.floor(math.log2(heads))
        return power_of_2(closest) + power_of_2(2 * closest)[0::2][: heads - closest]

    def forward(self, i: int, j: int):
        device = self.slopes.device
        i_arange = torch.arange(j - i, j, device=device)
        j_arange = torch.arange(j, device=device)
        bias = -torch.abs(rearrange(j_arange, "j -> 1 1 j") - rearrange(i_arange, "i -> 1 i 1"))
        return bias * self.slopes


class DynamicPositionBias(nn.Module):
    """A per-head bias from relative distances by a small MLP (``1 -> hidden -> heads``)."""

    def __init__(self, dim: int, heads: int):
        super().__init__()
        self.mlp = nn.Sequential(nn.Linear(1, dim), nn.SiLU(), nn.Linear(dim, heads))

    def forward(self, i: int, j: int):
        device = self.mlp[0].weight.device
        seq_arange = torch.arange(j - i, j, device=device)
        context_arange = torch.arange(j, device=device)
        indices = rearrange(seq_arange, "i -> i 1") - rearrange(context_arange, "j -> 1 j")
        indices = indices + (j - 1)
        pos = torch.arange(-j + 1, j, device=device).float()
        pos = rearrange(pos, "... -> ... 1")
        pos = self.mlp(pos)  # (2j - 1, heads)
        bias = pos[indices]  # (i, j, heads)
        return rearrange(bias, "i j h -> h i j")


class Attention(nn.Module):
    """Causal attention with q / kv / out Linears, heads split and merged by einops layer modules
    holding the head count, scores and values by ``einsum``; ``position`` picks the position term:
    ``"rotary"`` (partial rotary, the freqs handed in), ``"alibi"``, ``"dynamic"`` or ``None``."""

    def __init__(self, dim: int = DIM, heads: int = HEADS, dim_head: int = DIM_HEAD, position: str | None = None):
        super().__init__()
        self.heads = heads
        inner = heads * dim_head
        self.scale = dim_head**-0.5
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_kv = nn.Linear(dim, inner * 2, bias=False)
        self.split_heads = Rearrange("b n (h d) -> b h n d", h=heads)
        self.merge_heads = Rearrange("b h n d -> b n (h d)")
        self.to_out = nn.Linear(inner, dim, bias=False)
        self.position = position
        if position == "alibi":
            self.rel_pos = AlibiPositionalBias(heads)
        elif position == "dynamic":
            self.rel_pos = DynamicPositionBias(dim // 2, heads)

    def forward(self, x, rotary_freqs=None, rel_pos=None):
        n = x.shape[1]
        q = self.to_q(x)
        k, v = self.to_kv(x).chunk(2, dim=-1)
        q, k, v = map(self.split_heads, (q, k, v))
        if rotary_freqs is not None:
            q, k = apply_rotary_pos_emb(q, rotary_freqs), apply_rotary_pos_emb(k, rotary_freqs)
        sim = einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        if self.position in ("alibi", "dynamic"):
            sim = sim + self.rel_pos(n, n)
        elif rel_pos is not None:  # a position module shared by every layer, handed in by the caller
            sim = sim + rel_pos(n, n)
        causal = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        sim = sim.masked_fill(causal, -torch.finfo(sim.dtype).max)
        attn = sim.softmax(dim=-1)
        out = einsum("b h i j, b h j d -> b h i d", attn, v)
        return self.to_out(self.merge_heads(out))


class CpuMaskAttention(Attention):
    """:class:`Attention` whose causal mask is made on an explicit device (``device="cpu"``), as code
    written for one machine does: it cannot run alone on meta tensors, so its per-rank shapes
    cannot be proven."""

    def forward(self, x, rotary_freqs=None, rel_pos=None):
        n = x.shape[1]
        q = self.to_q(x)
        k, v = self.to_kv(x).chunk(2, dim=-1)
        q, k, v = map(self.split_heads, (q, k, v))
        sim = einsum("b h i d, b h j d -> b h i j", q, k) * self.scale
        causal = torch.ones(n, n, dtype=torch.bool, device="cpu").triu(1)
        sim = sim.masked_fill(causal, -torch.finfo(sim.dtype).max)
        out = einsum("b h i j, b h j d -> b h i d", sim.softmax(dim=-1), v)
        return self.to_out(self.merge_heads(out))


class FeedForward(nn.Module):
    def __init__(self, dim: int = DIM, mult: int = 4):
        super().__init__()
        self.net = nn.Sequential(nn.Linear(dim, dim * mult), nn.GELU(), nn.Linear(dim * mult, dim))

    def forward(self, x):
        return self.net(x)


class PreNormBlock(nn.Module):
    def __init__(self, position: str | None = None):
        super().__init__()
        self.attn_norm, self.attn = nn.LayerNorm(DIM), Attention(position=position)
        self.ff_norm, self.ff = nn.LayerNorm(DIM), FeedForward()

    def forward(self, x, rotary_freqs=None, rel_pos=None):
        x = x + self.attn(self.attn_norm(x), rotary_freqs=rotary_freqs, rel_pos=rel_pos)
        return x + self.ff(self.ff_norm(x))


class Decoder(nn.Module):
    """Embedding, pre-norm blocks, final norm, head; ``position`` as :class:`Attention` takes it
    (``"rotary"``: one rotary module at the root, its freqs handed to every block). With
    ``shared``, the ALiBi or distance-MLP module is one at the root, handed to every layer's
    attention, which calls it (as libraries share one relative-position module across depth)."""

    def __init__(self, position: str | None = None, depth: int = 2, shared: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.token_emb = nn.Embedding(VOCAB, DIM)
        self.rotary = RotaryEmbedding(DIM_HEAD // 2) if position == "rotary" else None
        self.rel_pos = None
        if shared and position == "alibi":
            self.rel_pos = AlibiPositionalBias(HEADS)
        elif shared and position == "dynamic":
            self.rel_pos = DynamicPositionBias(DIM // 2, HEADS)
        inner = None if position == "rotary" or shared else position
        self.layers = nn.ModuleList(PreNormBlock(inner) for _ in range(depth))
        self.norm = nn.LayerNorm(DIM)
        self.to_logits = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.token_emb(ids)
        freqs = self.rotary(ids.shape[1], ids.device) if self.rotary is not None else None
        for layer in self.layers:
            x = layer(x, rotary_freqs=freqs, rel_pos=self.rel_pos)
        return self.to_logits(self.norm(x))


# ----------------------------------------------------------------------------- residual streams


class HyperConnection(nn.Module):
    """Wraps a branch over ``streams`` residual streams ``(s, b, n, d)``: the branch reads a learned
    weighted mix of the streams, the streams are mixed by a learned ``(s, s)`` matrix, and the
    branch output is added back to each stream with a learned weight."""

    def __init__(self, streams: int, branch: nn.Module, layer_index: int):
        super().__init__()
        self.branch = branch
        read = torch.zeros(streams)
        read[layer_index % streams] = 1.0
        self.read = nn.Parameter(read + 0.1)
        self.mix = nn.Parameter(torch.eye(streams) + 0.05)
        self.write = nn.Parameter(torch.ones(streams))

    def forward(self, residuals):
        branch_input = einsum("s b n d, s -> b n d", residuals, self.read)
        residuals = einsum("s b n d, s t -> t b n d", residuals, self.mix)
        out = self.branch(branch_input)
        return residuals + einsum("b n d, s -> s b n d", out, self.write)


class PreNorm(nn.Module):
    def __init__(self, dim: int, fn: nn.Module):
        super().__init__()
        self.norm, self.fn = nn.LayerNorm(dim), fn

    def forward(self, x):
        return self.fn(self.norm(x))


class HyperBlock(nn.Module):
    def __init__(self, streams: int, index: int):
        super().__init__()
        self.attn = HyperConnection(streams, PreNorm(DIM, Attention()), 2 * index)
        self.ff = HyperConnection(streams, PreNorm(DIM, FeedForward()), 2 * index + 1)

    def forward(self, residuals):
        return self.ff(self.attn(residuals))


class HyperConnectionDecoder(nn.Module):
    """The embedding expanded to ``streams`` residual streams, hyper-connected blocks, the streams
    summed before the final norm."""

    def __init__(self, streams: int = 4, depth: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.streams = streams
        self.token_emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(HyperBlock(streams, i) for i in range(depth))
        self.norm = nn.LayerNorm(DIM)
        self.to_logits = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.token_emb(ids)
        residuals = repeat(x, "b n d -> s b n d", s=self.streams)
        for layer in self.layers:
            residuals = layer(residuals)
        return self.to_logits(self.norm(residuals.sum(dim=0)))


def shift(t, amount: int):
    if amount == 0:
        return t
    return F.pad(t, (0, 0, amount, -amount), value=0.0)


class ShiftTokens(nn.Module):
    """Shifts chunks of the features along the sequence (by ``shifts``, one per chunk; the rest
    unshifted) before the wrapped branch."""

    def __init__(self, shifts, fn: nn.Module):
        super().__init__()
        self.fn, self.shifts = fn, tuple(shifts)

    def forward(self, x):
        segments = len(self.shifts)
        feats_per_shift = x.shape[-1] // segments
        splitted = x.split(feats_per_shift, dim=-1)
        segments_to_shift, rest = splitted[:segments], splitted[segments:]
        segments_to_shift = [shift(t, amount) for t, amount in zip(segments_to_shift, self.shifts)]
        return self.fn(torch.cat((*segments_to_shift, *rest), dim=-1))


class FoldedHyperConnection(nn.Module):
    """Hyper-connections with the streams folded into the batch, ``(b * s, n, d)``: each call
    unfolds them, reads a learned mix, mixes and writes back, and folds them again."""

    def __init__(self, streams: int, branch: nn.Module, layer_index: int):
        super().__init__()
        self.streams, self.branch = streams, branch
        read = torch.zeros(streams, 1)
        read[layer_index % streams] = 1.0
        self.static_alpha = nn.Parameter(torch.cat((read + 0.1, torch.eye(streams) + 0.05), dim=1))  # (s, 1 + s)
        self.static_beta = nn.Parameter(torch.ones(streams))

    def forward(self, residuals):
        residuals = rearrange(residuals, "(b s) n d -> b n s d", s=self.streams)
        mix = einsum("b n s d, s t -> b n t d", residuals, self.static_alpha)
        branch_input, residuals = mix[..., 0, :], mix[..., 1:, :]
        out = self.branch(branch_input)
        residuals = residuals + einsum("b n d, s -> b n s d", out, self.static_beta)
        return rearrange(residuals, "b n s d -> (b s) n d")


class FoldedHyperBlock(nn.Module):
    def __init__(self, streams: int, index: int):
        super().__init__()
        self.attn = FoldedHyperConnection(streams, PreNorm(DIM, Attention()), 2 * index)
        self.ff = FoldedHyperConnection(streams, PreNorm(DIM, FeedForward()), 2 * index + 1)

    def forward(self, residuals):
        return self.ff(self.attn(residuals))


class FoldedHyperDecoder(HyperConnectionDecoder):
    """:class:`HyperConnectionDecoder` with the streams folded into the batch dim."""

    def __init__(self, streams: int = 4, depth: int = 2):
        super().__init__(streams, depth)
        torch.manual_seed(1)
        self.layers = nn.ModuleList(FoldedHyperBlock(streams, i) for i in range(depth))

    def forward(self, ids):
        x = self.token_emb(ids)
        residuals = repeat(x, "b n d -> (b s) n d", s=self.streams)
        for layer in self.layers:
            residuals = layer(residuals)
        residuals = rearrange(residuals, "(b s) n d -> b n s d", s=self.streams).sum(dim=2)
        return self.to_logits(self.norm(residuals))


class ShiftBlock(nn.Module):
    """Each branch ``PreNorm(ShiftTokens(branch))``; with ``before_norm``, ``ShiftTokens(PreNorm(branch))``:
    the stream itself shifted before the norm."""

    def __init__(self, before_norm: bool = False):
        super().__init__()
        if before_norm:
            self.attn = ShiftTokens((0, 1), PreNorm(DIM, Attention()))
            self.ff = ShiftTokens((0, 1), PreNorm(DIM, FeedForward()))
        else:
            self.attn = PreNorm(DIM, ShiftTokens((0, 1), Attention()))
            self.ff = PreNorm(DIM, ShiftTokens((0, 1), FeedForward()))

    def forward(self, x):
        x = x + self.attn(x)
        return x + self.ff(x)


class ShiftDecoder(nn.Module):
    def __init__(self, depth: int = 2, before_norm: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.token_emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(ShiftBlock(before_norm) for _ in range(depth))
        self.norm = nn.LayerNorm(DIM)
        self.to_logits = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.token_emb(ids)
        for layer in self.layers:
            x = layer(x)
        return self.to_logits(self.norm(x))


# ----------------------------------------------------------------------------- builders


def plain() -> nn.Module:
    """The bound: the same skeleton and attention with no position term."""
    return Decoder(None)


def partial_rotary() -> nn.Module:
    return Decoder("rotary")


def alibi() -> nn.Module:
    return Decoder("alibi")


def distance_mlp() -> nn.Module:
    return Decoder("dynamic")


def cpu_mask() -> nn.Module:
    model = Decoder(None)
    for layer in model.layers:
        layer.attn = CpuMaskAttention()
    return model


def shared_alibi() -> nn.Module:
    return Decoder("alibi", shared=True)


def shared_distance_mlp() -> nn.Module:
    return Decoder("dynamic", shared=True)


def hyper_connections() -> nn.Module:
    return HyperConnectionDecoder()


def folded_hyper_connections() -> nn.Module:
    return FoldedHyperDecoder()


def token_shift() -> nn.Module:
    return ShiftDecoder()


def stream_shift() -> nn.Module:
    return ShiftDecoder(before_norm=True)


BUILDERS = {
    "partial_rotary": partial_rotary,
    "alibi": alibi,
    "distance_mlp": distance_mlp,
    "shared_alibi": shared_alibi,
    "shared_distance_mlp": shared_distance_mlp,
    "hyper_connections": hyper_connections,
    "folded_hyper_connections": folded_hyper_connections,
    "token_shift": token_shift,
    "stream_shift": stream_shift,
}
