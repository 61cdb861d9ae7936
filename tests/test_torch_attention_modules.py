"""torch's own attention modules (``nn.MultiheadAttention``, alone or inside
``nn.TransformerEncoderLayer``) sharded by heads, as Megatron shards attention.

Each toy is a small decoder LM (embedding, a stack of blocks with a causal mask, final norm, head).
Every synthesized plan is verified against the unsharded model (logits and every gradient) at tp 2
and 4, plain and sequence-parallel, and must hold near ``1/tp`` of the parameters per rank: a test
catches a plan that computes something else and one that leaves the attention whole (0.70 of the
parameters per rank at tp=2 before: ``in_proj_weight`` is a raw parameter whose head size
``F.multi_head_attention_forward`` reads from its input's width). A variant that cannot be
sharded (heads tp does not divide, an input that arrives sharded) stays whole, exact, with the
reason.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp import check_plan, styles
from autotp.synth import synthesize
from autotp.synth.api import analyse_model
from autotp.verifier import verify

DIM, HEADS, FFN, VOCAB, LAYERS, SEQ = 64, 8, 128, 128, 2, 8
MODES = [(2, False), (2, True), (4, False), (4, True)]
IDS = ["tp2", "tp2-sp", "tp4", "tp4-sp"]


def tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


class EncoderLayerLM(nn.Module):
    """A decoder LM built from ``nn.TransformerEncoderLayer`` blocks under a causal mask."""

    def __init__(self, *, batch_first: bool = True, norm_first: bool = True, heads: int = HEADS):
        super().__init__()
        self.batch_first = batch_first
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(
            nn.TransformerEncoderLayer(DIM, heads, FFN, dropout=0.0, batch_first=batch_first, norm_first=norm_first)
            for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        mask = nn.Transformer.generate_square_subsequent_mask(ids.shape[1], device=ids.device)
        h = self.embed(ids)
        h = h if self.batch_first else h.transpose(0, 1)
        for layer in self.layers:
            h = layer(h, src_mask=mask, is_causal=True)
        h = h if self.batch_first else h.transpose(0, 1)
        return self.head(self.norm(h))


class HandWrittenBlock(nn.Module):
    """Pre-norm block around a bare ``nn.MultiheadAttention`` (bool causal mask) and a GELU MLP."""

    def __init__(self, **attention):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = nn.MultiheadAttention(DIM, HEADS, batch_first=True, **attention)
        self.up, self.down = nn.Linear(DIM, FFN), nn.Linear(FFN, DIM)

    def forward(self, x):
        t = x.shape[1]
        causal = torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1)
        h = self.norm1(x)
        x = x + self.attn(h, h, h, attn_mask=causal, need_weights=False)[0]
        return x + self.down(F.gelu(self.up(self.norm2(x))))


class HandWrittenLM(nn.Module):
    def __init__(self, **attention):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(HandWrittenBlock(**attention) for _ in range(LAYERS))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        h = self.embed(ids)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


class AveragedWeightsBlock(HandWrittenBlock):
    """Reads the head-averaged attention weights too (``need_weights=True``) and a key padding mask:
    the weights must be the mean over all heads, not the rank's."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Linear(SEQ, DIM, bias=False)

    def forward(self, x):
        b, t = x.shape[:2]
        padding = torch.zeros(b, t, dtype=torch.bool, device=x.device)
        padding[0, -2:] = True
        h = self.norm1(x)
        out, weights = self.attn(h, h, h, key_padding_mask=padding,
                                 attn_mask=torch.ones(t, t, dtype=torch.bool, device=x.device).triu(1))
        x = x + out + self.mix(weights)
        return x + self.down(F.gelu(self.up(self.norm2(x))))


def _synthesize_and_verify(model, tp_size, sequence_parallel):
    plan = synthesize(model, example_inputs=(tokens(),), tp_size=tp_size, sequence_parallel=sequence_parallel,
                      verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp_size, example_inputs=(tokens(),))
    assert report.ok, str(report)
    assert check_plan(model, plan, tp_size=tp_size, example_inputs=(tokens(),)) == []
    return plan, report


def _assert_sharded(plan, report, key, tp_size):
    assert isinstance(plan[key], styles.MultiheadAttentionParallel), plan
    assert max(report.param_fraction) <= 1 / tp_size + 0.1, report.param_fraction


@pytest.mark.parametrize("batch_first", [True, False], ids=["batch-first", "seq-first"])
@pytest.mark.parametrize("norm_first", [True, False], ids=["pre-norm", "post-norm"])
@pytest.mark.parametrize("tp_size,sequence_parallel", MODES, ids=IDS)
def test_encoder_layer_stack_is_sharded_by_heads(batch_first, norm_first, tp_size, sequence_parallel):
    """Would catch the attention left whole (0.70 of the parameters per rank at tp=2), a packed
    in_proj sharded as one block (q, k, v mixed up on each rank), a bias added once per rank, or an
    SP layout that does not meet the sequence-sharded stream."""
    model = EncoderLayerLM(batch_first=batch_first, norm_first=norm_first)
    plan, report = _synthesize_and_verify(model, tp_size, sequence_parallel)
    _assert_sharded(plan, report, "layers.*.self_attn", tp_size)
    assert type(plan["layers.*.linear1"]).__name__ == "ColwiseParallel", plan
    assert type(plan["layers.*.linear2"]).__name__ == "RowwiseParallel", plan
    if sequence_parallel:  # per layer and direction: two reduce-scatters and two all-gathers, as Megatron-SP
        assert plan["layers.*.self_attn"].sequence_parallel
        assert report.collectives["reduce_scatter_tensor"] == 2 * LAYERS + 1, report.collectives
        assert "all_reduce" not in report.collectives, report.collectives
    else:  # per layer: one all-reduce after the attention, one after the MLP, one for the embedding
        assert report.collectives == {"all_reduce": 2 * LAYERS + 1}, report.collectives


@pytest.mark.parametrize("tp_size,sequence_parallel", MODES, ids=IDS)
def test_bare_multihead_attention_in_a_handwritten_block(tp_size, sequence_parallel):
    """A bare nn.MultiheadAttention with a bool causal mask, in a hand-written pre-norm block."""
    model = HandWrittenLM()
    plan, report = _synthesize_and_verify(model, tp_size, sequence_parallel)
    _assert_sharded(plan, report, "layers.*.attn", tp_size)


@pytest.mark.parametrize("attention", [{"add_bias_kv": True}, {"add_zero_attn": True}, {"bias": False}],
                         ids=["bias-kv", "zero-attn", "no-bias"])
def test_options_of_the_module_are_kept(attention):
    """``bias_k`` / ``bias_v`` sharded with the heads, a zero key appended per rank, no biases."""
    model = HandWrittenLM(**attention)
    plan, report = _synthesize_and_verify(model, 2, False)
    _assert_sharded(plan, report, "layers.*.attn", 2)


@pytest.mark.parametrize("tp_size,sequence_parallel", [(2, False), (4, True)], ids=["tp2", "tp4-sp"])
def test_averaged_attention_weights_are_over_all_heads(tp_size, sequence_parallel):
    """Would catch weights averaged over the rank's heads only (or over ``heads / tp``)."""
    model = HandWrittenLM()
    for layer in model.layers:
        layer.__class__ = AveragedWeightsBlock
        layer.mix = nn.Linear(SEQ, DIM, bias=False)
    plan, report = _synthesize_and_verify(model, tp_size, sequence_parallel)
    _assert_sharded(plan, report, "layers.*.attn", tp_size)


def test_heads_tp_does_not_divide_stay_whole_and_exact():
    """2 heads at tp=4: the attention stays whole with the reason, the MLP is still sharded, and the
    plan is exact."""
    model = EncoderLayerLM(heads=2)
    roles = analyse_model(model, example_inputs=(tokens(),), tp_size=4).roles
    role = roles["layers.0.self_attn"]
    assert role.kind == "replicate" and "2 heads do not split over tp=4" in role.reason, role
    plan, report = _synthesize_and_verify(model, 4, False)
    assert "layers.*.self_attn" not in plan and type(plan["layers.*.linear1"]).__name__ == "ColwiseParallel", plan
    assert max(report.param_fraction) > 1 / 4 + 0.1, report.param_fraction


def test_style_refuses_a_module_of_another_class():
    """The per-rank forward is nn.MultiheadAttention's: any other class is refused clearly."""
    from autotp.errors import AutoTPError
    from torch.distributed.tensor.parallel import parallelize_module

    from autotp._simulate import simulated_mesh

    with simulated_mesh(2) as mesh, pytest.raises(AutoTPError, match="nn.MultiheadAttention"):
        parallelize_module(nn.Linear(4, 4), mesh, styles.MultiheadAttentionParallel())
