"""Tiny plain-PyTorch language models, one attention idiom each, written the way plain-PyTorch model
libraries write them (issue 42, items 3 and 7).

Every model is an embedding, two pre-norm blocks (attention + gated MLP), a final norm and a head.
What varies is the attention:

- ``sdpa``: heads split with ``view`` / ``transpose``, ``F.scaled_dot_product_attention`` with a
  boolean mask and a dropout probability that is zero outside training;
- ``gqa``: 8 query heads, 4 kv heads repeated to the query heads (``repeat_interleave`` or
  ``expand`` of a new group dim; or tiled by ``repeat``, which is kept whole with a warning);
- ``head_scale``: a per-head output scale ``Parameter(1, heads, 1, 1)``;
- ``memory_kv``: learned memory keys / values ``Parameter(heads, m, dim_head)`` prepended to k / v;
- ``shared_rel_bias``: a T5-style bucketed relative position bias, ``Embedding(buckets, heads)``
  held once by the model and its output handed to every block (``called_rel_bias``: the module
  itself handed to every attention, which calls it);
- ``residual_attn``: each layer returns its pre-softmax scores ``(b, h, n, n)``; the next adds them;
- ``talking_heads``: 1x1 convolutions mixing the heads before and after the softmax;
- ``value_residual``: the first layer's values mixed into the later layers' by a learned lerp;
- ``memory_tokens``: learned memory tokens ``Parameter(m, dim)`` prepended to the sequence before
  the first block and cut off before the head (the attention itself is plain);
- ``literal_split`` / ``literal_unflatten`` / ``literal_slices`` / ``literal_inferred`` /
  ``literal_heads``: attention sized by the module-level constants ``DIM, HEADS, DIM_HEAD`` rather
  than attributes: a fused qkv ``split(DIM)`` and ``view(b, n, HEADS, DIM_HEAD)``;
  ``unflatten(-1, (3, HEADS, -1))`` with a per-head sink logit (gpt-oss); ``qkv[..., DIM:2 * DIM]``
  slices; a head size computed from the width, ``view(b, n, HEADS, q.shape[-1] // HEADS)``; and
  ``view(b, n, HEADS, -1)`` merged back by ``reshape(b, n, -1)``, which at per-rank widths runs
  without an error into heads of half the size.

``bound_fraction`` gives the parameter fraction per rank of a plan at the bound: every parameter
sharded ``1/tp`` except the norms' weights (which tensor parallelism keeps whole).
"""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import nn

DIM, HEADS, DIM_HEAD, KV_HEADS, FFN, VOCAB, SEQ = 64, 8, 8, 4, 128, 128, 8
MEMORY, BUCKETS = 4, 16


def split_heads(x: torch.Tensor, heads: int) -> torch.Tensor:
    b, n, _ = x.shape
    return x.view(b, n, heads, -1).transpose(1, 2)


def merge_heads(x: torch.Tensor) -> torch.Tensor:
    b, h, n, d = x.shape
    return x.transpose(1, 2).reshape(b, n, h * d)


class Attention(nn.Module):
    """Plain multi-head attention, scores by ``matmul`` and a causal mask; the base every idiom
    changes. ``forward(x, **state)`` returns ``(out, state)``: the state a block hands on (scores,
    values) is what some idioms carry between layers."""

    def __init__(self, dim: int = DIM, heads: int = HEADS, dim_head: int = DIM_HEAD, layer: int = 0):
        super().__init__()
        self.heads, self.scale = heads, dim_head ** -0.5
        inner = heads * dim_head
        self.to_q = nn.Linear(dim, inner, bias=False)
        self.to_k = nn.Linear(dim, inner, bias=False)
        self.to_v = nn.Linear(dim, inner, bias=False)
        self.to_out = nn.Linear(inner, dim, bias=False)

    def qkv(self, x):
        return split_heads(self.to_q(x), self.heads), split_heads(self.to_k(x), self.heads), \
            split_heads(self.to_v(x), self.heads)

    def scores(self, q, k):
        return torch.matmul(q, k.transpose(-1, -2)) * self.scale

    def causal(self, sim):
        i, j = sim.shape[-2:]
        mask = torch.ones(i, j, dtype=torch.bool, device=sim.device).triu(j - i + 1)
        return sim.masked_fill(mask, -torch.finfo(sim.dtype).max)

    def forward(self, x, **state):
        q, k, v = self.qkv(x)
        attn = self.causal(self.scores(q, k)).softmax(dim=-1)
        return self.to_out(merge_heads(torch.matmul(attn, v))), {}


class SdpaAttention(Attention):
    """``F.scaled_dot_product_attention`` with a boolean causal mask and training-only dropout."""

    def __init__(self, dropout: float = 0.1, layer: int = 0):
        super().__init__()
        self.dropout = dropout

    def forward(self, x, **state):
        q, k, v = self.qkv(x)
        n = x.shape[1]
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).tril()
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask,
                                             dropout_p=self.dropout if self.training else 0.0)
        return self.to_out(merge_heads(out)), {}


class GroupedQueryAttention(Attention):
    """8 query heads, 4 kv heads; ``repeat``: ``"interleave"`` (``repeat_interleave``),
    ``"expand"`` (a new group dim expanded and merged with ``reshape``) or ``"tile"`` (``repeat``:
    the kv heads tiled, query head ``h`` reading kv head ``h % kv_heads``)."""

    def __init__(self, repeat: str = "interleave", kv_heads: int = KV_HEADS, layer: int = 0):
        super().__init__()
        self.kv_heads, self.repeat = kv_heads, repeat
        self.to_k = nn.Linear(DIM, kv_heads * DIM_HEAD, bias=False)
        self.to_v = nn.Linear(DIM, kv_heads * DIM_HEAD, bias=False)

    def expand_kv(self, t):
        groups = self.heads // self.kv_heads
        if self.repeat == "interleave":
            return t.repeat_interleave(groups, dim=1)
        if self.repeat == "tile":  # query head h reads kv head h % kv_heads
            return t.repeat(1, groups, 1, 1)
        b, h, n, d = t.shape
        return t[:, :, None].expand(b, h, groups, n, d).reshape(b, h * groups, n, d)

    def qkv(self, x):
        q = split_heads(self.to_q(x), self.heads)
        k, v = split_heads(self.to_k(x), self.kv_heads), split_heads(self.to_v(x), self.kv_heads)
        return q, self.expand_kv(k), self.expand_kv(v)


class HeadScaleAttention(Attention):
    """A learned per-head scale of the attention output, ``Parameter(1, heads, 1, 1)``."""

    def __init__(self, layer: int = 0):
        super().__init__()
        self.head_scale = nn.Parameter(torch.ones(1, HEADS, 1, 1) + 0.1 * torch.randn(1, HEADS, 1, 1))

    def forward(self, x, **state):
        q, k, v = self.qkv(x)
        attn = self.causal(self.scores(q, k)).softmax(dim=-1)
        out = torch.matmul(attn, v) * self.head_scale
        return self.to_out(merge_heads(out)), {}


class MemoryKVAttention(Attention):
    """Learned memory keys and values per head, ``Parameter(heads, m, dim_head)``, expanded over the
    batch and prepended to k / v along the sequence (every query may attend to them)."""

    def __init__(self, memory: int = MEMORY, layer: int = 0):
        super().__init__()
        self.mem_k = nn.Parameter(torch.randn(HEADS, memory, DIM_HEAD))
        self.mem_v = nn.Parameter(torch.randn(HEADS, memory, DIM_HEAD))

    def forward(self, x, **state):
        q, k, v = self.qkv(x)
        b = x.shape[0]
        mem_k, mem_v = (m.unsqueeze(0).expand(b, -1, -1, -1) for m in (self.mem_k, self.mem_v))
        k, v = torch.cat((mem_k, k), dim=-2), torch.cat((mem_v, v), dim=-2)
        attn = self.causal(self.scores(q, k)).softmax(dim=-1)  # causal() aligns the last query with the last key
        return self.to_out(merge_heads(torch.matmul(attn, v))), {}


class RelativePositionBias(nn.Module):
    """T5's bucketed relative position bias: ``Embedding(buckets, heads)`` looked up at each pair's
    bucket, returned as ``(heads, i, j)``. Held once by the model, read by every layer."""

    def __init__(self, buckets: int = BUCKETS, heads: int = HEADS, max_distance: int = 32):
        super().__init__()
        self.buckets, self.max_distance = buckets, max_distance
        self.relative_attention_bias = nn.Embedding(buckets, heads)

    def bucket(self, relative_position):
        n = -relative_position
        n = torch.max(n, torch.zeros_like(n))  # causal: only the past
        max_exact = self.buckets // 2
        is_small = n < max_exact
        large = max_exact + (torch.log(n.float().clamp(min=1) / max_exact)
                             / math.log(self.max_distance / max_exact) * (self.buckets - max_exact)).long()
        large = torch.min(large, torch.full_like(large, self.buckets - 1))
        return torch.where(is_small, n, large)

    def forward(self, i: int, j: int, device=None):
        q_pos = torch.arange(j - i, j, dtype=torch.long, device=device)
        k_pos = torch.arange(j, dtype=torch.long, device=device)
        buckets = self.bucket(k_pos[None, :] - q_pos[:, None])
        values = self.relative_attention_bias(buckets)  # (i, j, heads)
        return values.permute(2, 0, 1)


class RelBiasAttention(Attention):
    """Adds the model's shared relative position bias ``(heads, i, j)`` to its scores."""

    def forward(self, x, *, rel_pos=None, **state):
        q, k, v = self.qkv(x)
        sim = self.scores(q, k)
        if rel_pos is not None:
            sim = sim + rel_pos
        attn = self.causal(sim).softmax(dim=-1)
        return self.to_out(merge_heads(torch.matmul(attn, v))), {}


class CalledRelBiasAttention(Attention):
    """Calls the model's shared relative position bias module, handed to it as an argument, at its
    own query / key lengths (``attn_bias = rel_pos(i, j)``)."""

    def forward(self, x, *, rel_pos=None, **state):
        q, k, v = self.qkv(x)
        sim = self.scores(q, k)
        if rel_pos is not None:
            sim = sim + rel_pos(q.shape[-2], k.shape[-2], device=x.device)
        attn = self.causal(sim).softmax(dim=-1)
        return self.to_out(merge_heads(torch.matmul(attn, v))), {}


class SdpaRelBiasAttention(Attention):
    """The called bias expanded to ``(b, heads, i, j)``, causally masked with ``masked_fill`` and
    handed to ``F.scaled_dot_product_attention`` as its float ``attn_mask``."""

    def forward(self, x, *, rel_pos=None, **state):
        q, k, v = self.qkv(x)
        b, h, n, _ = q.shape
        bias = rel_pos(n, n, device=x.device)[None].expand(b, h, -1, -1)
        future = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        out = F.scaled_dot_product_attention(q, k, v, attn_mask=bias.masked_fill(future, -1e4))
        return self.to_out(merge_heads(out)), {}


class ResidualAttention(Attention):
    """Residual attention: the previous layer's pre-softmax scores ``(b, h, n, n)`` are added to
    this layer's, and this layer's are handed on."""

    def forward(self, x, *, prev_attn=None, **state):
        q, k, v = self.qkv(x)
        sim = self.scores(q, k)
        if prev_attn is not None:
            sim = sim + prev_attn
        pre_softmax = sim
        attn = self.causal(sim).softmax(dim=-1)
        return self.to_out(merge_heads(torch.matmul(attn, v))), {"prev_attn": pre_softmax}


class TalkingHeadsAttention(Attention):
    """Talking heads: ``Conv2d(heads, heads, 1)`` mixing the heads' scores before the softmax and
    their weights after it."""

    def __init__(self, layer: int = 0):
        super().__init__()
        self.pre_softmax_talking_heads = nn.Conv2d(HEADS, HEADS, 1, bias=False)
        self.post_softmax_talking_heads = nn.Conv2d(HEADS, HEADS, 1, bias=False)

    def forward(self, x, **state):
        q, k, v = self.qkv(x)
        sim = self.pre_softmax_talking_heads(self.scores(q, k))
        attn = self.post_softmax_talking_heads(self.causal(sim).softmax(dim=-1))
        return self.to_out(merge_heads(torch.matmul(attn, v))), {}


class ValueResidualAttention(Attention):
    """Value residual: the first layer hands its values on; every later layer mixes them into its
    own by a learned per-token, per-head lerp (``Linear(dim, heads)`` then a sigmoid)."""

    def __init__(self, layer: int = 0):
        super().__init__()
        # Only the later layers mix: the first one's values are what they mix in.
        self.to_value_residual_mix = nn.Linear(DIM, HEADS) if layer > 0 else None

    def forward(self, x, *, value_residual=None, **state):
        q, k, v = self.qkv(x)
        first = v
        if value_residual is not None:
            mix = self.to_value_residual_mix(x).sigmoid().transpose(1, 2).unsqueeze(-1)  # (b, h, n, 1)
            v = v.lerp(value_residual, mix)
        attn = self.causal(self.scores(q, k)).softmax(dim=-1)
        out = self.to_out(merge_heads(torch.matmul(attn, v)))
        return out, ({"value_residual": first} if value_residual is None else {})


class LiteralAttention(nn.Module):
    """Attention written with the module-level constants for its sizes (no attribute holds them);
    ``cut`` picks how the fused projection is cut into q, k, v and heads (see the module doc)."""

    def __init__(self, cut: str = "split", layer: int = 0):
        super().__init__()
        self.cut = cut
        if cut in ("inferred", "heads"):
            self.to_q, self.to_k, self.to_v = (nn.Linear(DIM, DIM, bias=False) for _ in range(3))
        else:
            self.to_qkv = nn.Linear(DIM, 3 * DIM, bias=False)
        if cut == "unflatten":
            self.sinks = nn.Parameter(torch.linspace(-1.0, 1.0, HEADS))
        self.to_out = nn.Linear(DIM, DIM, bias=False)

    def heads(self, x):
        b, n, _ = x.shape
        if self.cut == "split":
            q, k, v = self.to_qkv(x).split(DIM, dim=-1)
            return (t.view(b, n, HEADS, DIM_HEAD).transpose(1, 2) for t in (q, k, v))
        if self.cut == "unflatten":
            return self.to_qkv(x).unflatten(-1, (3, HEADS, -1)).permute(2, 0, 3, 1, 4).unbind(0)
        if self.cut == "slices":
            qkv = self.to_qkv(x)
            q, k, v = qkv[..., :DIM], qkv[..., DIM:2 * DIM], qkv[..., 2 * DIM:]
            return (t.view(b, n, HEADS, -1).transpose(1, 2) for t in (q, k, v))
        q, k, v = self.to_q(x), self.to_k(x), self.to_v(x)
        if self.cut == "heads":
            return (t.view(b, n, HEADS, -1).transpose(1, 2) for t in (q, k, v))
        return (t.view(b, n, HEADS, t.shape[-1] // HEADS).transpose(1, 2) for t in (q, k, v))

    def forward(self, x, **state):
        b, n, _ = x.shape
        q, k, v = self.heads(x)
        sim = torch.matmul(q, k.transpose(-1, -2)) * DIM_HEAD ** -0.5
        mask = torch.ones(n, n, dtype=torch.bool, device=x.device).triu(1)
        sim = sim.masked_fill(mask, -torch.finfo(sim.dtype).max)
        if self.cut == "unflatten":  # a per-head sink logit that takes some of each row's weight
            sink = self.sinks.view(1, HEADS, 1, 1).expand(b, -1, n, 1)
            attn = torch.cat((sim, sink), dim=-1).softmax(dim=-1)[..., :-1]
        else:
            attn = sim.softmax(dim=-1)
        merged = torch.matmul(attn, v).transpose(1, 2)
        return self.to_out(merged.reshape(b, n, -1 if self.cut == "heads" else DIM)), {}


def _literal(cut: str):
    return lambda layer=0: LiteralAttention(cut, layer)


class GatedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.w_gate = nn.Linear(DIM, FFN, bias=False)
        self.w_up = nn.Linear(DIM, FFN, bias=False)
        self.w_down = nn.Linear(FFN, DIM, bias=False)

    def forward(self, x):
        return self.w_down(F.silu(self.w_gate(x)) * self.w_up(x))


class Block(nn.Module):
    """Pre-norm block; extra keyword state goes to the attention, whose handed-on state is returned."""

    def __init__(self, attention: nn.Module):
        super().__init__()
        self.attn_norm, self.ff_norm = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attn, self.ff = attention, GatedMLP()

    def forward(self, x, **state):
        out, handed = self.attn(self.attn_norm(x), **state)
        x = x + out
        return x + self.ff(self.ff_norm(x)), handed


class LM(nn.Module):
    """Embedding, blocks, final norm, head. The state a block hands on (scores, first values) is
    merged into what the next blocks receive; ``rel_pos`` (a shared bias module) is called once and
    its output given to every block."""

    def __init__(self, attention, depth: int = 2, rel_pos: nn.Module | None = None, hand_module: bool = False):
        """``attention(layer=i)`` makes layer ``i``'s attention; ``hand_module``: every block gets
        the ``rel_pos`` module itself and calls it, rather than its output."""
        super().__init__()
        torch.manual_seed(0)
        self.token_emb = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(attention(layer=i)) for i in range(depth))
        self.rel_pos, self.hand_module = rel_pos, hand_module
        self.norm, self.to_logits = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
        for module in self.modules():  # a visible, non-trivial bias table and head mixing
            if isinstance(module, (nn.Conv2d,)):
                nn.init.normal_(module.weight, std=0.3)
            if isinstance(module, RelativePositionBias):
                nn.init.normal_(module.relative_attention_bias.weight, std=0.5)

    def forward(self, tokens):
        x = self.token_emb(tokens)
        state = {}
        if self.rel_pos is not None and self.hand_module:
            state["rel_pos"] = self.rel_pos
        elif self.rel_pos is not None:
            n = tokens.shape[1]
            state["rel_pos"] = self.rel_pos(n, n, device=tokens.device)
        for layer in self.layers:
            x, handed = layer(x, **state)
            state.update(handed)
        return self.to_logits(self.norm(x))


class MemoryTokensLM(LM):
    """``m`` learned tokens prepended to the embedded sequence, seen by every block, and cut off
    before the final norm: the blocks run on ``n + m`` positions, the head on ``n``."""

    def __init__(self, memory: int = MEMORY):
        super().__init__(Attention)
        self.memory = memory
        self.memory_tokens = nn.Parameter(torch.randn(memory, DIM))

    def forward(self, tokens):
        x = self.token_emb(tokens)
        x = torch.cat((self.memory_tokens.expand(x.shape[0], -1, -1), x), dim=1)
        for layer in self.layers:
            x, _ = layer(x)
        return self.to_logits(self.norm(x[:, self.memory:]))


def _gqa_expand(layer: int = 0):
    return GroupedQueryAttention(repeat="expand")


def _gqa_tile(layer: int = 0):
    return GroupedQueryAttention(repeat="tile")


IDIOMS = {
    "sdpa": lambda: LM(SdpaAttention),
    "gqa": lambda: LM(GroupedQueryAttention),
    "gqa_expand": lambda: LM(_gqa_expand),
    "gqa_tile": lambda: LM(_gqa_tile),
    "head_scale": lambda: LM(HeadScaleAttention),
    "memory_kv": lambda: LM(MemoryKVAttention),
    "shared_rel_bias": lambda: LM(RelBiasAttention, rel_pos=RelativePositionBias()),
    "called_rel_bias": lambda: LM(CalledRelBiasAttention, rel_pos=RelativePositionBias(), hand_module=True),
    "sdpa_rel_bias": lambda: LM(SdpaRelBiasAttention, rel_pos=RelativePositionBias(), hand_module=True),
    "residual_attn": lambda: LM(ResidualAttention),
    "talking_heads": lambda: LM(TalkingHeadsAttention),
    "value_residual": lambda: LM(ValueResidualAttention),
    "memory_tokens": MemoryTokensLM,
    "literal_split": lambda: LM(_literal("split")),
    "literal_unflatten": lambda: LM(_literal("unflatten")),
    "literal_slices": lambda: LM(_literal("slices")),
    "literal_inferred": lambda: LM(_literal("inferred")),
    "literal_heads": lambda: LM(_literal("heads")),
}


def plain_model() -> LM:
    """The same model without any idiom."""
    return LM(Attention)


def tokens(batch: int = 2, seq: int = SEQ) -> torch.Tensor:
    return torch.randint(0, VOCAB, (batch, seq), generator=torch.Generator().manual_seed(1))


def is_norm_weight(model: nn.Module, name: str) -> bool:
    owner = model.get_submodule(name.rpartition(".")[0])
    return isinstance(owner, (nn.RMSNorm, nn.LayerNorm))


def bound_fraction(model: nn.Module, tp: int, whole: tuple[str, ...] = ()) -> float:
    """Parameters per rank, as a fraction of the model's, when every parameter is cut ``1/tp``
    except the norms' weights and those named in ``whole`` (suffixes)."""
    total = held = 0
    for name, p in model.named_parameters():
        total += p.numel()
        keep = is_norm_weight(model, name) or name.endswith(whole)
        held += p.numel() if keep else p.numel() / tp
    return held / total
