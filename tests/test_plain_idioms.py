"""Plain-PyTorch idioms the synthesizer must keep sharded (or refuse clearly), one toy decoder each.

Each toy is a two-layer decoder (embedding, pre-norm attention and MLP, head) in which one pattern
of hand-written model code varies: grouped-query attention by ``repeat_interleave`` or by
``expand`` + ``reshape``, a head-major fused qkv cut by ``unbind`` / ``split`` on the last-but-one
dim, an interleaved gate/up taken by strided slices, a fused gate/up cut by slices counted from
the end, a fused value / gate cut inside its own module that hands the still-sharded product to a
Linear outside it (x-transformers' ``GEGLU`` in a ``Sequential``), hidden features transposed out
of groups before the down projection, raw
``nn.Parameter`` weights used as Linears
(``x @ W.T``, ``x @ W``, ``F.linear``, ``einsum``, ``torch.bmm`` by stacked 3-D weights), LoRA-style
adapters beside a base Linear (``nn.Linear`` or raw), and a merge-back ``reshape`` to a fixed width
attribute.

Every synthesized plan is verified against the unsharded model (logits and every gradient) at tp 2
and 4, and its per-rank parameter fraction must be near ``1/tp``: a test catches both a plan that
computes something else and one that silently leaves the pattern whole. Patterns that cannot be
sharded correctly (kv heads tiled by ``repeat`` rather than interleaved, raw weights viewed into
heads by a module constant, a raw weight read twice) must be left whole.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Shard

from autotp import check_plan
from autotp.synth import synthesize
from autotp.synth.api import analyse_model
from autotp.verifier import verify

DIM, HEADS, KV_HEADS, HD, FFN, VOCAB, SEQ, RANK = 64, 8, 4, 8, 128, 128, 8, 4


def _heads(x, n):
    b, t, _ = x.shape
    return x.view(b, t, n, HD).transpose(1, 2)


class RepeatInterleaveGQA(nn.Module):
    """Grouped-query attention, kv heads repeated to the query heads by ``repeat_interleave``."""

    def __init__(self):
        super().__init__()
        self.n_rep = HEADS // KV_HEADS
        self.wq, self.wo = nn.Linear(DIM, HEADS * HD, bias=False), nn.Linear(HEADS * HD, DIM, bias=False)
        self.wk, self.wv = nn.Linear(DIM, KV_HEADS * HD, bias=False), nn.Linear(DIM, KV_HEADS * HD, bias=False)

    def repeat(self, k):
        return k.repeat_interleave(self.n_rep, dim=1)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = _heads(self.wq(x), -1), _heads(self.wk(x), -1), _heads(self.wv(x), -1)
        y = F.scaled_dot_product_attention(q, self.repeat(k), self.repeat(v), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


class ExpandReshapeGQA(RepeatInterleaveGQA):
    """kv heads repeated by ``expand`` of a new group dim and a ``reshape`` that merges it in."""

    def repeat(self, k):
        b, kv, t, hd = k.shape
        return k[:, :, None].expand(b, kv, self.n_rep, t, hd).reshape(b, kv * self.n_rep, t, hd)


class ExpandReshapeCountsGQA(RepeatInterleaveGQA):
    """The same repeat sized by head-count attributes: ``reshape(b, self.n_head, t, hd)``."""

    def __init__(self):
        super().__init__()
        self.n_head, self.n_kv_head = HEADS, KV_HEADS

    def repeat(self, k):
        b, _, t, hd = k.shape
        return k[:, :, None].expand(b, self.n_kv_head, self.n_rep, t, hd).reshape(b, self.n_head, t, hd)


class TiledRepeatGQA(RepeatInterleaveGQA):
    """kv heads tiled by ``repeat`` (head h reads kv head h % kv): not the grouping of the shards."""

    def repeat(self, k):
        return k.repeat(1, self.n_rep, 1, 1)


class HeadMajorQKVUnbind(nn.Module):
    """One fused qkv Linear laid out head by head: ``view(b, t, heads, 3, hd)``, then ``unbind(3)``."""

    def __init__(self):
        super().__init__()
        self.n_head, self.head_dim = HEADS, HD
        self.qkv, self.proj = nn.Linear(DIM, 3 * HEADS * HD), nn.Linear(HEADS * HD, DIM)

    def parts(self, qkv):
        return qkv.unbind(3)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, self.n_head, 3, self.head_dim)
        q, k, v = (z.reshape(b, t, self.n_head, self.head_dim).transpose(1, 2) for z in self.parts(qkv))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(y.transpose(1, 2).reshape(b, t, self.n_head * self.head_dim))


class HeadMajorQKVSplit(HeadMajorQKVUnbind):
    """The same layout cut by ``split(1, dim=-2)``."""

    def parts(self, qkv):
        return qkv.split(1, dim=-2)


class FixedWidthMerge(RepeatInterleaveGQA):
    """Heads merged back by ``reshape(b, t, self.d_model)``: a width attribute, not ``-1``."""

    def __init__(self):
        super().__init__()
        self.d_model = HEADS * HD

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = _heads(self.wq(x), -1), _heads(self.wk(x), -1), _heads(self.wv(x), -1)
        y = F.scaled_dot_product_attention(q, self.repeat(k), self.repeat(v), is_causal=True)
        return self.wo(y.transpose(1, 2).reshape(b, t, self.d_model))


class QKVMajorUnbind(nn.Module):
    """One fused projection viewed as ``(b, t, 3, heads, hd)`` and cut into q, k, v by ``unbind`` on
    the parts dim; ``permuted``: first permuted to ``(3, b, heads, t, hd)`` and unbound on dim 0."""

    def __init__(self, permuted: bool = False):
        super().__init__()
        self.permuted, self.n_heads, self.head_dim = permuted, HEADS, HD
        self.qkv, self.o = nn.Linear(DIM, 3 * HEADS * HD, bias=False), nn.Linear(HEADS * HD, DIM, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        qkv = self.qkv(x).view(b, t, 3, self.n_heads, self.head_dim)
        if self.permuted:
            q, k, v = qkv.permute(2, 0, 3, 1, 4).unbind(0)
        else:
            q, k, v = (part.transpose(1, 2) for part in qkv.unbind(2))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class FusedKVParts(nn.Module):
    """Grouped-query attention whose k and v come from one projection viewed as ``(b, t, 2,
    kv_heads, hd)``, permuted and unbound; the kv heads repeated by ``repeat_interleave``."""

    def __init__(self):
        super().__init__()
        self.n_heads, self.n_kv = HEADS, KV_HEADS
        self.q, self.o = nn.Linear(DIM, HEADS * HD), nn.Linear(HEADS * HD, DIM)
        self.kv = nn.Linear(DIM, 2 * KV_HEADS * HD)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.q(x).view(b, t, self.n_heads, HD).transpose(1, 2)
        k, v = self.kv(x).view(b, t, 2, self.n_kv, HD).permute(2, 0, 3, 1, 4)
        k, v = (u.repeat_interleave(self.n_heads // self.n_kv, dim=1) for u in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class MergedRowsAttention(nn.Module):
    """Sequence-first multi-head attention with the heads merged into the batch rows of ``bmm``
    (``view(t, b * heads, hd).transpose(0, 1)``), a causal mask made without a device, and a
    merge-back ``view(t, b, -1)``; ``input_width``: the merge-back takes the input's width instead."""

    def __init__(self, input_width: bool = False):
        super().__init__()
        self.input_width, self.num_heads = input_width, HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, HEADS * HD) for _ in range(4))

    def forward(self, x):
        x = x.transpose(0, 1)  # (t, b, c)
        t, b, c = x.shape
        q, k, v = (p(x).contiguous().view(t, b * self.num_heads, -1).transpose(0, 1) for p in (self.q, self.k, self.v))
        mask = torch.triu(torch.full((t, t), float("-inf")), 1)
        weights = F.softmax(torch.bmm(q, k.transpose(1, 2)) * HD**-0.5 + mask, dim=-1)
        y = torch.bmm(weights, v).transpose(0, 1).contiguous().view(t, b, c if self.input_width else -1)
        return self.o(y).transpose(0, 1)


class GatedMLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(DIM, FFN), nn.Linear(DIM, FFN), nn.Linear(FFN, DIM)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class GEGLU(nn.Module):
    """A fused value / gate projection cut inside its own module, which returns the product, still
    sharded, to a Linear outside it: ``chunk(2)``, or ``split`` by a width attribute."""

    def __init__(self, split_by_attribute: bool = False):
        super().__init__()
        self.split_by_attribute, self.inner = split_by_attribute, FFN
        self.proj = nn.Linear(DIM, 2 * FFN)

    def forward(self, x):
        h = self.proj(x)
        x, gate = h.split(self.inner, dim=-1) if self.split_by_attribute else h.chunk(2, dim=-1)
        return x * F.gelu(gate)


class NestedGEGLU(nn.Module):
    """x-transformers' feed-forward: ``Sequential(GEGLU, Dropout, Linear)``."""

    def __init__(self, split_by_attribute: bool = False):
        super().__init__()
        self.net = nn.Sequential(GEGLU(split_by_attribute), nn.Dropout(0.0), nn.Linear(FFN, DIM))

    def forward(self, x):
        return self.net(x)


class StridedGateUp(nn.Module):
    """gate and up fused feature by feature: ``h[..., ::2]`` is the gate, ``h[..., 1::2]`` the up."""

    def __init__(self):
        super().__init__()
        self.gate_up, self.down = nn.Linear(DIM, 2 * FFN), nn.Linear(FFN, DIM)

    def forward(self, x):
        h = self.gate_up(x)
        return self.down(F.silu(h[..., ::2]) * h[..., 1::2])


class NegativeSliceGateUp(StridedGateUp):
    """gate and up fused side by side, cut by slices counted from the end: ``h[..., :-self.ffn]``
    and ``h[..., -self.ffn:]`` (the trace keeps the negative bounds; ``ffn`` divided per rank)."""

    def __init__(self):
        super().__init__()
        self.ffn = FFN

    def forward(self, x):
        h = self.gate_up(x)
        return self.down(F.silu(h[..., :-self.ffn]) * h[..., -self.ffn:])


class TransposedGroupsMLP(GatedMLP):
    """The hidden features viewed as ``(groups, width)``, transposed and merged back before the down
    projection: each rank's share of the groups lands interleaved, so the row's input is packed."""

    def __init__(self):
        super().__init__()
        self.groups = 8

    def forward(self, x):
        b, t, _ = x.shape
        h = F.silu(self.gate(x)) * self.up(x)
        return self.down(h.view(b, t, self.groups, -1).transpose(2, 3).reshape(b, t, -1))


def _param(*shape):
    return nn.Parameter(torch.randn(*shape) * shape[-1] ** -0.5)


class RawParamAttention(nn.Module):
    """Attention whose weights are raw parameters: ``x @ W.T``, ``F.linear``, ``x @ W`` (in, out)."""

    def __init__(self):
        super().__init__()
        self.n_head = HEADS
        self.wq, self.wk = _param(HEADS * HD, DIM), _param(HEADS * HD, DIM)
        self.wv_in_out, self.wo = _param(DIM, HEADS * HD), _param(DIM, HEADS * HD)

    def forward(self, x):
        b, t, _ = x.shape
        n = self.n_head
        q, k, v = _heads(x @ self.wq.T, n), _heads(F.linear(x, self.wk), n), _heads(x @ self.wv_in_out, n)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear(y.transpose(1, 2).reshape(b, t, -1), self.wo)


class RawQKVLinearOut(RawParamAttention):
    """Raw q/k/v weights and an ``nn.Linear`` output projection in the same module."""

    def __init__(self):
        super().__init__()
        self.out = nn.Linear(HEADS * HD, DIM, bias=False)
        del self.wo

    def forward(self, x):
        b, t, _ = x.shape
        n = self.n_head
        q, k, v = _heads(x @ self.wq.T, n), _heads(F.linear(x, self.wk), n), _heads(x @ self.wv_in_out, n)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class RawParamEinsumMLP(nn.Module):
    """Gated MLP written with ``torch.einsum`` over raw parameters."""

    def __init__(self):
        super().__init__()
        self.w_gate, self.w_up, self.w_down = _param(FFN, DIM), _param(FFN, DIM), _param(DIM, FFN)

    def forward(self, x):
        up = torch.einsum("btd,fd->btf", x, self.w_up.type_as(x))  # a cast of the weight is the weight
        h = F.silu(torch.einsum("btd,fd->btf", x, self.w_gate)) * up
        return torch.einsum("btf,df->btd", h, self.w_down)


class StackedBmmMLP(nn.Module):
    """A gated MLP per group over stacked 3-D weights, ``torch.bmm`` by each, groups averaged."""

    def __init__(self, groups: int = 2):
        super().__init__()
        self.w_gate, self.w_up = _param(groups, DIM, FFN), _param(groups, DIM, FFN)
        self.w_down = _param(groups, FFN, DIM)

    def forward(self, x):
        b, t, d = x.shape
        h = x.reshape(1, b * t, d).expand(self.w_gate.shape[0], b * t, d)
        y = torch.bmm(F.silu(torch.bmm(h, self.w_gate)) * torch.bmm(h, self.w_up), self.w_down)
        return y.mean(0).view(b, t, d)


class ChannelsFirstMLP(nn.Module):
    """An MLP on a channels-first (b, d, t) layout: ``W @ x`` by the weights of child Linears whose
    forward is never called (their parent's code reads ``self.up.weight``), bias added per channel."""

    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, FFN), nn.Linear(FFN, DIM)

    def forward(self, x):
        h = F.gelu(self.up.weight @ x.transpose(1, 2) + self.up.bias[:, None])
        return (self.down.weight @ h).transpose(1, 2) + self.down.bias


class LoRALinear(nn.Module):
    """A base Linear plus low-rank adapters: ``base(x) + lora_B(lora_A(x)) * scale``."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base, self.scale = base, 0.5
        self.lora_A = nn.Linear(base.in_features, RANK, bias=False)
        self.lora_B = nn.Linear(RANK, base.out_features, bias=False)

    def forward(self, x):
        return self.base(x) + self.lora_B(self.lora_A(x)) * self.scale


class RawLoRALinear(nn.Module):
    """The adapters as raw parameters beside the base Linear: ``x @ lora_A.T @ lora_B.T``."""

    def __init__(self, base: nn.Linear):
        super().__init__()
        self.base, self.scale = base, 0.5
        self.lora_A, self.lora_B = _param(RANK, base.in_features), _param(base.out_features, RANK)

    def forward(self, x):
        return self.base(x) + (x @ self.lora_A.T) @ self.lora_B.T * self.scale


class LoRAAttention(RepeatInterleaveGQA):
    """Adapters on q, v and o."""

    def __init__(self):
        super().__init__()
        self.wq, self.wv, self.wo = LoRALinear(self.wq), LoRALinear(self.wv), LoRALinear(self.wo)


class LoRAMLP(GatedMLP):
    """Adapters on up and down."""

    def __init__(self):
        super().__init__()
        self.up, self.down = LoRALinear(self.up), LoRALinear(self.down)


class RawLoRAMLP(GatedMLP):
    """Raw-parameter adapters on up (a column) and down (a row)."""

    def __init__(self):
        super().__init__()
        self.up, self.down = RawLoRALinear(self.up), RawLoRALinear(self.down)


class Block(nn.Module):
    def __init__(self, attention, mlp):
        super().__init__()
        self.norm1, self.norm2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attn, self.mlp = attention(), mlp()

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Decoder(nn.Module):
    """Two blocks between a token embedding and a head; ``attention`` and ``mlp`` are the idiom."""

    def __init__(self, attention=RepeatInterleaveGQA, mlp=GatedMLP):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(attention, mlp) for _ in range(2))
        self.norm, self.head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
        for name, param in self.named_parameters():
            if name.endswith(("lora_B.weight",)):  # adapters start at zero in training; not here
                nn.init.normal_(param, std=0.1)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


IDIOMS = {
    "repeat_interleave_gqa": dict(attention=RepeatInterleaveGQA),
    "expand_reshape_gqa": dict(attention=ExpandReshapeGQA),
    "expand_reshape_counts_gqa": dict(attention=ExpandReshapeCountsGQA),
    "head_major_qkv_unbind": dict(attention=HeadMajorQKVUnbind),
    "head_major_qkv_split": dict(attention=HeadMajorQKVSplit),
    "fixed_width_merge": dict(attention=FixedWidthMerge),
    "strided_gate_up": dict(mlp=StridedGateUp),
    "nested_geglu_chunk": dict(mlp=NestedGEGLU),
    "nested_geglu_split_attribute": dict(mlp=lambda: NestedGEGLU(split_by_attribute=True)),
    "negative_slice_gate_up": dict(mlp=NegativeSliceGateUp),
    "transposed_groups_mlp": dict(mlp=TransposedGroupsMLP),
    "merged_rows_attention": dict(attention=MergedRowsAttention),
    "qkv_major_unbind": dict(attention=QKVMajorUnbind),
    "fused_kv_parts": dict(attention=FusedKVParts),
    "qkv_major_permute_unbind": dict(attention=lambda: QKVMajorUnbind(permuted=True)),
    "raw_param_attention": dict(attention=RawParamAttention),
    "raw_qkv_linear_out": dict(attention=RawQKVLinearOut),
    "raw_param_einsum_mlp": dict(mlp=RawParamEinsumMLP),
    "stacked_bmm_mlp": dict(mlp=StackedBmmMLP),
    "channels_first_mlp": dict(mlp=ChannelsFirstMLP),
    "lora_adapters": dict(attention=LoRAAttention, mlp=LoRAMLP),
    "raw_lora_adapters": dict(mlp=RawLoRAMLP),
}


def tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


def run(model, tp, sequence_parallel=False):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = synthesize(model, example_inputs=(tokens(),), tp_size=tp, sequence_parallel=sequence_parallel, verify=False)
        return plan, verify(model, plan, tp_size=tp, example_inputs=(tokens(),))


# Plain at tp 2 and 4; sequence parallel at tp 2 (its layouts do not depend on the tp size).
@pytest.mark.parametrize(("tp", "sequence_parallel"), [(2, False), (4, False), (2, True)], ids=["tp2", "tp4", "sp2"])
@pytest.mark.parametrize("idiom", list(IDIOMS))
def test_idiom_keeps_its_shard_and_is_exact(idiom, tp, sequence_parallel):
    """Would catch a wrong plan (logits or a gradient off) and a pattern silently left whole."""
    model = Decoder(**IDIOMS[idiom])
    plan, report = run(model, tp, sequence_parallel)
    assert report.ok, str(report)
    assert max(report.logits_max_abs_diff) <= 1e-4 and report.worst_grad[1] <= 1e-4
    # Norm weights and biases stay whole: a little above 1/tp.
    assert all(f <= 1 / tp + 0.05 for f in report.param_fraction), (report.param_fraction, plan)
    if tp == 2 and not sequence_parallel:  # the static checker reads the plan as the synthesizer meant it
        assert check_plan(model, plan, tp_size=tp, example_inputs=(tokens(),)) == []


def test_tiled_kv_repeat_is_left_whole():
    """``repeat`` tiles the kv heads (query head h reads kv head h % kv): each rank holds its block of
    every copy (a fold), which a query cut in one block of heads does not match (a rank's query heads
    would read kv heads other ranks hold), so k and v (and all attention) must stay whole."""
    model = Decoder(attention=TiledRepeatGQA)
    roles = analyse_model(model, example_inputs=(tokens(),), tp_size=2).roles
    assert roles["layers.0.attn.wk"].kind == "replicate", roles["layers.0.attn.wk"]
    assert "does not keep that layout" in roles["layers.0.attn.wk"].reason, roles["layers.0.attn.wk"]
    plan, report = run(model, 2)
    assert report.ok, str(report)


class RawParamConstantHeads(RawParamAttention):
    """Raw weights viewed into heads by a module constant: no attribute to divide by tp."""

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = _heads(x @ self.wq.T, HEADS), _heads(F.linear(x, self.wk), HEADS), _heads(x @ self.wv_in_out, HEADS)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return F.linear(y.transpose(1, 2).reshape(b, t, -1), self.wo)


def test_raw_weights_viewed_by_a_constant_are_rewritten_per_rank():
    """Per rank, ``view(b, t, HEADS, HD)`` of a sharded raw projection fails or mixes heads. No
    attribute holds ``HEADS``: the literal rewrite divides it in that view, and the raw weights
    shard (before, they were kept whole, 0.67 of the parameters per rank). Exact."""
    model = Decoder(attention=RawParamConstantHeads)
    role = analyse_model(model, example_inputs=(tokens(),), tp_size=2).roles["layers.0.attn"]
    assert role.kind == "linear_params" and role.rewrites and role.rewrites[0].literals, role
    plan, report = run(model, 2)
    assert report.ok, str(report)
    assert max(report.param_fraction) <= 0.51, report.param_fraction


def test_raw_weights_viewed_by_a_constant_stay_whole_without_the_rewrite(no_shape_fixes):
    model = Decoder(attention=RawParamConstantHeads)
    roles = analyse_model(model, example_inputs=(tokens(),), tp_size=2).roles
    assert roles["layers.0.attn"].kind == "replicate" and "fixed sizes" in roles["layers.0.attn"].reason
    plan, report = run(model, 2)
    assert report.ok, str(report)



class RawWeightReadTwice(RawParamEinsumMLP):
    """``w_up`` is also read by a penalty term: sharded, that term would see a shard as the whole."""

    def forward(self, x):
        return super().forward(x) + 1e-3 * self.w_up.pow(2).mean()


def test_raw_weight_read_elsewhere_stays_whole():
    """A raw weight with a second reader in the module is no Linear's alone: kept whole, plan exact."""
    model = Decoder(mlp=RawWeightReadTwice)
    roles = analyse_model(model, example_inputs=(tokens(),), tp_size=2).roles
    assert roles["layers.0.mlp"].kind == "replicate", roles["layers.0.mlp"]
    plan, report = run(model, 2)
    assert report.ok, str(report)


def test_merge_back_to_the_inputs_width_is_rewritten_per_rank():
    """``view(t, b, c)`` with ``c`` read from the (replicated) input: per rank the attention's output
    holds ``c / tp`` features, which no attribute can make ``c``. ``c`` is the global width on every
    call, so the literal rewrite divides it in that view; the attention shards (before: kept whole).
    Exact, also at a length it was not traced at."""
    model = Decoder(attention=lambda: MergedRowsAttention(input_width=True))
    roles = analyse_model(model, example_inputs=(tokens(),), tp_size=2).roles
    assert roles["layers.0.attn.q"].kind == "column" and roles["layers.0.attn"].rewrites, roles["layers.0.attn"]
    plan, report = run(model, 2)
    assert report.ok, str(report)
    assert verify(model, plan, tp_size=2, example_inputs=(tokens()[:, :5],)).ok


def test_head_counts_sizing_the_kv_repeat_take_their_per_rank_values():
    """tp=8 over 4 kv heads: each rank holds one kv head, replicated, and one query head. The
    attention sizes its repeat by three counts (``n_kv_head``, ``n_rep``, ``n_head``), all of which
    must take their per-rank values (1, 1, 1): would catch the ratio alone set (the reshape to
    ``n_head`` heads fails at apply) or the attention refused."""
    from autotp import styles

    model = Decoder(attention=ExpandReshapeCountsGQA)
    plan, report = run(model, 8)
    assert report.ok, str(report)
    style = plan["layers.*.attn"]
    assert isinstance(style, styles.ShardCounts) and style.kv_names == ("n_kv_head",), style
    assert {style.ratio, *style.head_names} == {"n_rep", "n_head"}, style
    assert max(report.param_fraction) < 0.2, report.param_fraction  # k/v one head per rank, the rest 1/8


class TiedLinearHead(Decoder):
    """The logits computed by the model's own code on the embedding's weight:
    ``F.linear(norm(x), self.embed.weight)``, no head module."""

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return F.linear(self.norm(x), self.embed.weight)


class FreeNormTiedLinearHead(TiedLinearHead):
    """The same head after a parameter-free final norm (``LayerNorm(d, elementwise_affine=False)``)."""

    def __init__(self):
        super().__init__()
        self.norm = nn.LayerNorm(DIM, elementwise_affine=False)


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("model_class", [TiedLinearHead, FreeNormTiedLinearHead], ids=["norm", "free_norm"])
def test_a_head_on_the_tied_embedding_in_the_models_own_code(model_class, tp, sequence_parallel):
    """Under sequence parallel the final norm's output reaches ``F.linear`` with a plain weight in
    code no style wraps: it is all-gathered to a plain tensor there (the plan crashed on a
    sequence-sharded DTensor before; with a parameter-free norm, until it got a style too). The
    embedding and its tied reader stay whole; the blocks are sharded."""
    model = model_class()
    plan, report = run(model, tp, sequence_parallel)
    assert report.ok, str(report)
    assert "layers.*.attn.wq" in plan and type(plan.get("embed")).__name__ != "VocabParallelEmbedding", plan
    if sequence_parallel:
        assert plan["norm"].outputs == "gather" and plan["norm"].local_outputs, plan
        assert report.comm_volume_backward <= report.comm_volume, report


class ProjectedTiedHead(Decoder):
    """Embeddings narrower than the blocks, projected in and out, and the head tied to the
    embedding: ``head(project_out(norm(x)))`` with ``head.weight = embed.weight``."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM // 2)
        self.project_in, self.project_out = nn.Linear(DIM // 2, DIM, bias=False), nn.Linear(DIM, DIM // 2, bias=False)
        self.head = nn.Linear(DIM // 2, VOCAB, bias=False)
        self.head.weight = self.embed.weight

    def forward(self, tokens):
        x = self.project_in(self.embed(tokens))
        for layer in self.layers:
            x = layer(x)
        return self.head(self.project_out(self.norm(x)))


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_a_tied_head_after_a_projection_shards_the_vocabulary(tp, sequence_parallel):
    """``project_out`` column-parallel would make the tied head a row (its weight split on the other
    dim than the embedding's): the projection stays whole instead, and the tied weight is sharded
    over the vocabulary by both users. Would catch both kept whole again (the largest matrix on
    every rank). Under SP the stream starts sharded at the layers (the projection's output is
    replicated); the plan crashed there before."""
    model = ProjectedTiedHead()
    plan, report = run(model, tp, sequence_parallel)
    assert report.ok, str(report)
    assert type(plan["embed"]).__name__ == "VocabParallelEmbedding", plan
    assert "Colwise" not in type(plan.get("project_out")).__name__, plan  # whole (gathered under SP)
    assert plan["head"].output_layouts == (Shard(-1),), plan
    assert max(report.param_fraction) < 1 / tp + 0.12, report.param_fraction


def test_fused_kv_parts_with_fewer_heads_than_ranks_stay_whole():
    """tp=8 over 4 kv heads viewed into parts: each part's heads do not split over the ranks. The
    projection is kept whole with the reason (as the cut alone left it before parts were read),
    not the whole plan refused, and the plan is exact."""
    model = Decoder(attention=FusedKVParts)
    roles = analyse_model(model, example_inputs=(tokens(),), tp_size=8).roles
    assert roles["layers.0.attn.kv"].kind == "replicate" and "tp=8 does not divide" in roles["layers.0.attn.kv"].reason
    plan, report = run(model, 8)
    assert report.ok, str(report)
    assert type(plan["layers.*.mlp.gate"]).__name__ == "ColwiseParallel", plan  # the MLP still sharded


class TorchMHA(nn.Module):
    """``nn.MultiheadAttention`` called as ``attn(h, h, h, attn_mask=...)``: sharded by heads as one
    module (``MultiheadAttentionParallel``, ``tests/test_torch_attention_modules.py``)."""

    def __init__(self):
        super().__init__()
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True)

    def forward(self, x):
        t = x.shape[1]
        mask = torch.triu(torch.full((t, t), float("-inf"), device=x.device), 1)
        return self.attn(x, x, x, attn_mask=mask, need_weights=False)[0]


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_a_whole_module_taking_the_stream_three_times(sequence_parallel):
    """Under sequence parallel the whole attention takes the sequence-sharded stream as three
    arguments: each is gathered (once, the same tensor), where a one-argument layout raised
    ("module inputs and input_layouts should have same length"). The MLP stays sharded."""
    model = Decoder(attention=TorchMHA)
    plan, report = run(model, 2, sequence_parallel)
    assert report.ok, str(report)
    assert type(plan["layers.*.mlp.gate"]).__name__ == "ColwiseParallel", plan
    if sequence_parallel:
        # Per layer: one gather into the attention, one for the MLP; one before the head.
        assert report.collectives["all_gather_into_tensor"] == 2 * len(model.layers) + 1, report.collectives


class HeadTemperatureGQA(nn.Module):
    """Two kv heads read by eight query heads (``repeat_interleave`` by a ratio attribute), and a
    learned temperature per query head scaling the scores: at tp 4 the kv heads are replicated
    (the ratio set per rank) and the temperature sharded with the query heads."""

    def __init__(self, kv_heads=2):
        super().__init__()
        self.num_key_value_groups = HEADS // kv_heads
        self.temperature = nn.Parameter(torch.linspace(0.5, 1.5, HEADS).view(HEADS, 1, 1))
        self.wq, self.wo = nn.Linear(DIM, HEADS * HD, bias=False), nn.Linear(HEADS * HD, DIM, bias=False)
        self.wk, self.wv = nn.Linear(DIM, kv_heads * HD, bias=False), nn.Linear(DIM, kv_heads * HD, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = _heads(self.wq(x), -1), _heads(self.wk(x), -1), _heads(self.wv(x), -1)
        k, v = (z.repeat_interleave(self.num_key_value_groups, dim=1) for z in (k, v))
        scores = q @ k.transpose(-1, -2) * HD**-0.5 * self.temperature
        scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
        y = scores.softmax(-1) @ v
        return self.wo(y.transpose(1, 2).reshape(b, t, -1))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_per_head_parameter_with_kv_heads_replicated(sequence_parallel):
    """Would catch the kv-head counts and the per-head parameter competing for the attention's one
    plan key (before: the counts won, the temperature stayed whole and broadcast over 2 of 8 heads,
    and the sharded run failed on the shapes)."""
    from autotp.styles import HeadParams, ShardCounts

    model = Decoder(attention=HeadTemperatureGQA)
    plan, report = run(model, 4, sequence_parallel)
    assert report.ok, str(report)
    style = plan["layers.*.attn"]
    assert isinstance(style, ShardCounts) and style.query_heads and isinstance(style.base, HeadParams), style
    assert style.base.shard_dims == {"temperature": 0}
    assert all(f <= 1 / 4 + 0.1 for f in report.param_fraction), report.param_fraction
