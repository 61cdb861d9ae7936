"""A per-head bias built at the model's root (ALiBi) is sliced to each rank's heads where it enters.

The model builds ``(heads, t, t)`` once (slopes times distances, plus the causal mask) and hands it to
every layer; the attention adds it to its scores (by hand, or as SDPA's ``attn_mask``). With the heads
sharded, each rank needs its own heads' rows: the attention module takes the bias sliced on entry
(``ShardedInputs``) instead of the whole attention staying replicated (0.63 of the parameters per rank
at tp=2 before). Every plan is verified on logits and every gradient (1e-5) at tp 2 and 4, plain and
SP, with the parameter fraction asserted near 1/tp; a bias read whole inside the attention keeps it
whole.
"""

import math

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp import check_plan, styles
from autotp.errors import PlanError
from autotp.synth import explain, pipeline, synthesize
from autotp.verifier import verify
from synth_toy import DIM, VOCAB, example_tokens

HEADS = 4


def alibi_slopes(n: int) -> torch.Tensor:
    start = 2 ** (-8 / n)
    return torch.tensor([start ** (i + 1) for i in range(n)])


class Attention(nn.Module):
    """q/k/v/o; ``bias`` (heads, T, T) added to the scores by hand, or as SDPA's mask."""

    def __init__(self, by_hand: bool):
        super().__init__()
        self.by_hand = by_hand
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x, bias):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        if self.by_hand:
            scores = q @ k.transpose(-1, -2) / math.sqrt(DIM // HEADS) + bias[:, :t, :t]
            y = scores.softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, attn_mask=bias[:, :t, :t])
        return self.o(self.after(y, bias).transpose(1, 2).reshape(b, t, -1))

    def after(self, y, bias):
        return y


class MaskAttention(Attention):
    """The same attention through SDPA's mask, as a class of its own (a second layer kind)."""

    def __init__(self):
        super().__init__(by_hand=False)


class ReadsBiasWhole(Attention):
    """Also scales its output by the mean over every head's bias: sliced, each rank would take its
    own heads' mean, so the attention must stay whole."""

    def after(self, y, bias):
        return y * (1 + bias.clamp(min=-10).mean())


class RowsAttention(nn.Module):
    """Heads merged with the batch into the rows of batched matmuls: q, k, v ``(b * heads, t, hd)``,
    scores ``baddbmm(bias, q, k^T)`` with the root's bias ``(b * heads, 1, t)``."""

    def __init__(self):
        super().__init__()
        self.heads = HEADS
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x, bias):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.heads, -1).transpose(1, 2).reshape(b * self.heads, t, -1)
                   for p in (self.q, self.k, self.v))
        causal = torch.full((t, t), float("-inf"), device=x.device).triu(1)
        scores = torch.baddbmm(bias, q, k.transpose(1, 2), alpha=(DIM // HEADS) ** -0.5) + causal
        y = torch.bmm(scores.softmax(-1), v).view(b, self.heads, t, -1)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, attention: nn.Module):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = attention
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x, bias):
        x = x + self.attn(self.n1(x), bias)
        return x + self.down(F.gelu(self.up(self.n2(x))))


class MaskBlock(Block):
    """A second layer kind (its own class, so its own layer group in the trace)."""


class AlibiModel(nn.Module):
    """ALiBi at the root; ``attentions``: one attention factory per layer, or ``(block class,
    attention factory)`` (two kinds make two layer groups reading the one bias); ``learned``: the
    slopes are a parameter (the bias has a gradient of its own)."""

    def __init__(self, attentions, learned: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        kinds = [make if isinstance(make, tuple) else (Block, make) for make in attentions]
        self.layers = nn.ModuleList(block(make()) for block, make in kinds)
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
        if learned:
            self.slopes = nn.Parameter(alibi_slopes(HEADS))
        else:
            self.register_buffer("slopes", alibi_slopes(HEADS), persistent=False)

    def forward(self, ids):
        t = ids.shape[1]
        pos = torch.arange(t, device=ids.device)
        distance = (pos[None, :] - pos[:, None]).float()
        causal = torch.full((t, t), float("-inf"), device=ids.device).triu(1)
        bias = self.slopes[:, None, None] * distance[None] + causal
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, bias)
        return self.head(self.norm(x))


class RowsAlibiModel(AlibiModel):
    """The bias made per row of the merged ``(batch, heads)`` dim, ``(b * heads, 1, t)``;
    ``attention``: the layers' attention class."""

    def __init__(self, attention=None):
        super().__init__([attention or RowsAttention] * 2)

    def forward(self, ids):
        b, t = ids.shape
        per_head = self.slopes[:, None] * torch.arange(t, device=ids.device).float()[None]  # (heads, t)
        bias = per_head[None].expand(b, HEADS, t).reshape(b * HEADS, 1, t)
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, bias)
        return self.head(self.norm(x))


class RowsReadWhole(RowsAttention):
    """Also scales its output by the bias's mean over every row."""

    def forward(self, x, bias):
        return super().forward(x, bias) * (1 + bias.mean())


def _bound(model: nn.Module, tp: int) -> float:
    """Parameters per rank with every Linear weight and the embedding sharded, the rest whole."""
    sharded = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    total = sum(p.numel() for p in model.parameters())
    split = sum(p.numel() for p in model.parameters() if id(p) in sharded)
    return (total - split + split / tp) / total


def _synthesize_and_verify(model, tp, sequence_parallel):
    tokens = example_tokens()[:, :8]
    plan = synthesize(model, example_inputs=(tokens,), tp_size=tp, sequence_parallel=sequence_parallel, verify=False)
    report = verify(model, plan, tp_size=tp, example_inputs=(tokens,))
    assert report.ok, str(report)
    return plan, report


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("by_hand", [True, False], ids=["scores", "sdpa_mask"])
def test_root_bias_is_sliced_to_each_ranks_heads(by_hand, tp, sequence_parallel):
    """Would catch the attention kept whole for the root's bias (0.63 of the parameters at tp=2),
    or the bias handed over whole or cut on the wrong dim (a broadcast error, or wrong logits)."""
    model = AlibiModel([lambda: Attention(by_hand)] * 2)
    plan, report = _synthesize_and_verify(model, tp, sequence_parallel)
    style = plan["layers.*.attn"]
    assert isinstance(style, styles.ShardedInputs) and style.inputs == ((1, 0),), style
    assert max(report.param_fraction) <= _bound(model, tp) + 0.01, report.param_fraction


@pytest.mark.parametrize("tp", [2, 4])
def test_one_root_bias_entering_two_layer_kinds(tp):
    """Two attention kinds (two layer groups) read the same root bias: each takes its own slice."""
    model = AlibiModel([lambda: Attention(True), (MaskBlock, MaskAttention)])
    plan, report = _synthesize_and_verify(model, tp, False)
    assert isinstance(plan["layers.*.attn"], styles.ShardedInputs), sorted(plan)  # both kinds: one key
    analysis = pipeline.run(model, example_inputs=(example_tokens()[:, :8],), tp_size=tp)
    assert sorted(analysis.entries) == ["layers.0.attn", "layers.1.attn"], analysis.entries
    assert max(report.param_fraction) <= _bound(model, tp) + 0.01, report.param_fraction


def test_a_bias_with_a_gradient_keeps_the_attention_whole():
    """Learned slopes give the bias a gradient of its own: sliced, it would need that gradient
    all-gathered back in every backward, so the slice is not taken (the plan stays exact)."""
    model = AlibiModel([lambda: Attention(True)] * 2, learned=True)
    plan, _ = _synthesize_and_verify(model, 2, False)
    assert not any(isinstance(style, styles.ShardedInputs) for style in plan.values()), plan


def test_bias_read_whole_inside_the_attention_keeps_it_whole():
    """Would catch the slice taken although the attention also reads every head's bias (each rank
    would subtract its own heads' mean: wrong logits)."""
    model = AlibiModel([lambda: ReadsBiasWhole(True)] * 2)
    plan, report = _synthesize_and_verify(model, 2, False)
    assert not any(isinstance(style, styles.ShardedInputs) for style in plan.values()), plan
    records = {r.key: r for r in explain(model, example_inputs=(example_tokens()[:, :8],), tp_size=2)}
    assert "reads the value whole" in records["layers.*.attn.q"].reason


def test_sharded_inputs_refuses_a_call_without_the_argument():
    """The style raises rather than let the module broadcast a whole bias against its heads."""
    from autotp import _simulate
    from torch.distributed.tensor.parallel import parallelize_module

    module = Attention(True)
    with _simulate.simulated_mesh(2) as mesh:
        parallelize_module(module, mesh, styles.ShardedInputs(inputs=(("bias", 0),)))
        with pytest.raises(PlanError, match="argument 'bias'"):
            module(torch.randn(2, 8, DIM), torch.zeros(HEADS, 8, 8))  # passed by position, not keyword


def test_checker_flags_a_plan_that_hands_the_bias_over_whole():
    """The synthesized plan passes the checker; without its ShardedInputs (q/k/v still sharded) the
    attention would meet every head's bias: flagged where it is, before anything runs."""
    model = AlibiModel([lambda: Attention(True)] * 2)
    tokens = example_tokens()[:, :8]
    plan = synthesize(model, example_inputs=(tokens,), tp_size=2, verify=False)
    assert check_plan(model, plan, tp_size=2, example_inputs=(tokens,)) == []
    unsliced = {key: style for key, style in plan.items() if not isinstance(style, styles.ShardedInputs)}
    kinds = {f.kind for f in check_plan(model, unsliced, tp_size=2, example_inputs=(tokens,))}
    assert "entry_not_sliced" in kinds, kinds


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_root_bias_merged_with_the_batch_is_sliced_per_row(tp, sequence_parallel):
    """The bias's rows are (batch, head) pairs like the attention's: sliced as ``(-1, heads, 1)`` on
    the heads. Would catch the attention kept whole, or a contiguous cut of the rows (the first
    batch's heads on rank 0: wrong logits)."""
    model = RowsAlibiModel()
    plan, report = _synthesize_and_verify(model, tp, sequence_parallel)
    style = plan["layers.*.attn"]
    assert isinstance(style, styles.ShardedInputs) and style.inputs == ((1, 0, HEADS, 1),), style
    assert max(report.param_fraction) <= _bound(model, tp) + 0.01, report.param_fraction


def test_root_bias_merged_with_the_batch_read_whole_keeps_the_attention_whole():
    """Default-deny: the attention also reads every row of the bias (its mean): sliced, each rank
    would take its own rows' mean, so the attention stays whole and the plan exact."""
    model = RowsAlibiModel(RowsReadWhole)
    plan, _ = _synthesize_and_verify(model, 2, False)
    assert not any(isinstance(style, styles.ShardedInputs) for style in plan.values()), plan
    assert "layers.*.attn.q" not in plan, plan
