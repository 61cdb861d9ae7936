"""Attention that reads its widths from its input's size, sharded with that input seen per rank.

nanoGPT's original attention computes ``B, T, C = x.size()``, then ``view(B, T, n_head, C //
n_head)`` and merges back with ``view(B, T, C)``; timm's reshapes with its head counts and merges
back with ``reshape(B, N, C)``. ``C`` comes from the replicated input, so no attribute divided by tp
makes the per-rank shapes right. The plan hands the module's code a size-only stand-in of the input
at width ``C / tp`` while its column Linears read the real input
(:class:`~autotp.styles.LocalWidthInputs`). Each plan is verified on logits and every gradient
against the unsharded model (fp32, 1e-5) at tp 2 and 4, plain and sequence-parallel, and must hold
the same parameters per rank as the plan of the same model written with attributes only. Where the
code reads the input for anything but its size, or computes a number (a scale) from the width, the
attention stays whole, with the reason.
"""

from __future__ import annotations

import math
import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp import explain, styles
from autotp.check import check_plan
from autotp.styles.attention import width_view
from autotp.synth import synthesize
from autotp.verifier import verify
from synth_toy import DIM, HEADS, MLP, CausalSelfAttention, NanoGPT, SizeFromInputAttention, example_tokens

MODES = [(2, False), (2, True), (4, False), (4, True)]
IDS = ["tp2", "tp2-sp", "tp4", "tp4-sp"]


class TimmAttention(nn.Module):
    """timm's ``Attention``: fused ``qkv`` reshaped with the head counts, merged back with the
    input's width ``C``."""

    def __init__(self):
        super().__init__()
        self.num_heads, self.head_dim = HEADS, DIM // HEADS
        self.qkv, self.proj = nn.Linear(DIM, 3 * DIM), nn.Linear(DIM, DIM)

    def forward(self, x):
        B, N, C = x.shape
        qkv = self.qkv(x).reshape(B, N, 3, self.num_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        q, k, v = qkv.unbind(0)
        x = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.proj(x.transpose(1, 2).reshape(B, N, C))


class ResidualInsideAttention(SizeFromInputAttention):
    """Reads its input for its values too (a residual inside the module): it cannot be handed a
    stand-in, so it stays whole."""

    def forward(self, x):
        return super().forward(x) + 0.5 * x


class ScaleFromWidthAttention(SizeFromInputAttention):
    """Scales the scores by the input's width (``1 / sqrt(C)``): seen per rank, the scale would
    change with every shape right, so the attention stays whole."""

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = self.c_attn(x).split(self.n_embd, dim=2)
        q, k, v = (z.view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True, scale=1.0 / math.sqrt(c))
        return self.c_proj(y.transpose(1, 2).contiguous().view(b, t, c))


def _plan_and_verify(attention, tp_size, sequence_parallel):
    model = NanoGPT(attention=attention)
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp_size,
                      sequence_parallel=sequence_parallel, verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp_size, example_inputs=(example_tokens(),))
    assert report.ok, str(report)
    return model, plan, report


@pytest.mark.parametrize("tp_size,sequence_parallel", MODES, ids=IDS)
@pytest.mark.parametrize("attention,reader", [(SizeFromInputAttention, "c_attn"), (TimmAttention, "qkv")],
                         ids=["nanogpt", "timm"])
def test_widths_read_from_the_input_are_sharded_like_attributes(attention, reader, tp_size, sequence_parallel):
    """Would catch the attention kept whole again (a parameter fraction above the attribute
    variant's), the stand-in reaching a Linear (NaN logits) or a per-rank shape gone wrong."""
    _, plan, report = _plan_and_verify(attention, tp_size, sequence_parallel)
    style = plan["h.*.attn"]
    assert isinstance(style, styles.LocalWidthInputs)
    assert style.inputs == (0,) and style.readers == (reader,)
    _, _, reference = _plan_and_verify(CausalSelfAttention, tp_size, sequence_parallel)
    assert max(report.param_fraction) == pytest.approx(max(reference.param_fraction))
    assert max(report.param_fraction) < 1 / tp_size + 0.05


def test_the_plan_names_the_input_and_its_reader_in_explain():
    model = NanoGPT(attention=SizeFromInputAttention)
    records = {r.key: r for r in explain(model, example_inputs=(example_tokens(),), tp_size=2)}
    assert records["h.*.attn.c_attn"].role == "packed_column"
    assert "reads widths from its argument(s) 0" in records["h.*.attn"].reason
    assert "c_attn read the real value" in records["h.*.attn"].reason


@pytest.mark.parametrize("attention", [ResidualInsideAttention, ScaleFromWidthAttention],
                         ids=["residual-inside", "scale-from-width"])
def test_inputs_read_for_values_get_no_stand_in_and_their_sizes_are_rewritten(attention):
    """Would catch a stand-in handed to code that reads it (a residual: NaN) or a scale computed
    from the per-rank width (logits off with every shape right): the proof refuses the stand-in.
    The width those modules read is the global one on every call, so the literal rewrite divides it
    where it shapes the shard (before, the attention was kept whole): exact, no ``LocalWidthInputs``."""
    model, plan, _ = _plan_and_verify(attention, 2, False)
    assert plan["h.*.attn"].literals and not isinstance(plan["h.*.attn"], styles.LocalWidthInputs), plan
    records = {r.key: r for r in explain(model, example_inputs=(example_tokens(),), tp_size=2)}
    assert "rewritten" in records["h.*.attn"].reason, records["h.*.attn"]


def test_checker_flags_a_width_view_whose_head_count_is_not_divided():
    """With ``n_head`` left global, the stand-in's ``C / tp // n_head`` is half the head size: every
    shape runs, into heads of the wrong size. Would catch the checker not modelling the style."""
    model = NanoGPT(attention=SizeFromInputAttention)
    plan = dict(synthesize(model, example_inputs=(example_tokens(),), tp_size=2, verify=False))
    assert check_plan(model, plan, tp_size=2, example_inputs=(example_tokens(),)) == []
    good = plan["h.*.attn"]
    plan["h.*.attn"] = styles.LocalWidthInputs(inputs=good.inputs, readers=good.readers,
                                               style=styles.ShardCounts(names=("n_embd",)))
    findings = check_plan(model, plan, tp_size=2, example_inputs=(example_tokens(),))
    assert [f.kind for f in findings] == ["reshape_heads"] and findings[0].module == "h.0.attn"


class _ReadsItsInput(nn.Module):
    def __init__(self):
        super().__init__()
        self.lin = nn.Linear(8, 8)

    def forward(self, x):
        return self.lin(x)[..., : x.size(-1)], x.sum()


def test_stand_in_reaches_only_the_readers_and_shows_any_other_read():
    """The reader computes on the real input; any other read of the stand-in gives NaN, not a
    plausible number."""
    module, x = _ReadsItsInput(), torch.randn(2, 3, 8)
    expected = module.lin(x)[..., :4]
    width_view(module, (0,), ("lin",), 2, guard=True)
    sliced, total = module(x)
    torch.testing.assert_close(sliced, expected)
    assert torch.isnan(total)
    assert not module(x.clone())[0].isnan().any()  # the hooks hold no state between calls


class SeparateQKVSizeFromInput(nn.Module):
    """q, k and v Linears, head size from the input's width (``c // self.n_head``)."""

    def __init__(self):
        super().__init__()
        self.n_head = HEADS
        self.q, self.k, self.v, self.out = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x):
        b, t, c = x.size()
        q, k, v = (p(x).view(b, t, self.n_head, c // self.n_head).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


class PostNormBlock(nn.Module):
    """Post-norm: the attention reads the residual stream itself, so its three projections share
    one wrapper of it (placed on the attention, whose own style only divides its head count)."""

    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.mlp = SeparateQKVSizeFromInput(), MLP()

    def forward(self, x):
        x = self.ln_1(x + self.attn(x))
        return self.ln_2(x + self.mlp(x))


class PostNormGPT(NanoGPT):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.h = nn.ModuleList(PostNormBlock() for _ in range(2))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_the_readers_get_the_input_before_a_shared_wrapper_takes_it(tp_size):
    """The attention shares one ``Replicate()`` wrapper of the stream among its projections; the
    stand-in must be swapped back before that wrapper takes it (TrOCR's post-norm attention: the
    projections multiplied the stand-in and the plan crashed)."""
    model = PostNormGPT()
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp_size, verify=False)
    style = plan["h.*.attn"]
    assert isinstance(style, styles.LocalWidthInputs) and style.wrapped.columns, style
    assert isinstance(style.wrapped.wrapped, styles.ShardCounts)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp_size, example_inputs=(example_tokens(),))
    assert report.ok, str(report)
