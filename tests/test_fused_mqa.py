"""Fused multi-query attention: the query part sharded by heads, the one k / v head whole per rank.

One Linear makes ``[q | k | v]`` with ``HEADS`` query heads and a single k and v head, cut by
``split``; every query head reads the one k / v head through a broadcast (``expand``, the
grouped-query repeat ``[:, :, None].expand(...).reshape(...)``, or a matmul broadcasting over the
heads). No tp splits one head, so the projection used to stay whole. Each rank now holds its
share of the query heads and a whole copy of k and v (:mod:`autotp.synth.copies`), the copies'
gradients summed. Checked against the unsharded model on the logits and every gradient, at tp 2
and 4, plain and sequence parallel, with about 1/tp of the parameters per rank.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp.styles import GroupCopies
from autotp.synth import explain, synthesize
from autotp.verifier import verify
from synth_toy import DIM, example_tokens
from test_ssm_mixer import SSMStack

HEADS, HEAD_DIM = 8, 8


class FusedMultiQueryAttention(nn.Module):
    """``c_attn`` -> split into q (``HEADS`` heads), one k head, one v head -> attention -> ``c_proj``.

    ``layout``: ``"expand"`` (k, v unsqueezed to one head and expanded to the query heads),
    ``"repeat"`` (the output unsqueezed before the split, k and v repeated as transformers'
    ``repeat_kv`` does) or ``"matmul"`` (scores by matmuls broadcasting the one head).
    """

    def __init__(self, layout: str = "expand"):
        super().__init__()
        self.layout, self.n_head, self.embed = layout, HEADS, HEADS * HEAD_DIM
        self.c_attn = nn.Linear(DIM, self.embed + 2 * HEAD_DIM)
        self.c_proj = nn.Linear(self.embed, DIM)

    def forward(self, x):
        b, t, _ = x.shape
        if self.layout == "repeat":
            q, k, v = self.c_attn(x).unsqueeze(1).split((self.embed, HEAD_DIM, HEAD_DIM), dim=3)
            k, v = (z[:, :, None].expand(b, 1, self.n_head, t, HEAD_DIM).reshape(b, self.n_head, t, HEAD_DIM)
                    for z in (k, v))
        else:
            q, k, v = self.c_attn(x).split((self.embed, HEAD_DIM, HEAD_DIM), dim=-1)
            k, v = k.unsqueeze(1), v.unsqueeze(1)
        q = q.reshape(b, t, -1, HEAD_DIM).transpose(1, 2)
        if self.layout == "expand":
            k, v = k.expand(b, self.n_head, t, HEAD_DIM), v.expand(b, self.n_head, t, HEAD_DIM)
        if self.layout == "matmul":
            scores = (q @ k.transpose(-1, -2)) * HEAD_DIM ** -0.5
            scores = scores.masked_fill(torch.ones(t, t, dtype=torch.bool).triu(1), float("-inf"))
            y = scores.softmax(-1) @ v
        else:
            y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.c_proj(y.transpose(1, 2).reshape(b, t, -1))


class KeyReadWhole(FusedMultiQueryAttention):
    """Also adds the key's mean to the output: that read is whole on every rank, so a per-rank
    copy's gradient would count it once per rank."""

    def forward(self, x):
        k = self.c_attn(x)[..., self.embed:self.embed + HEAD_DIM]
        return super().forward(x) + k.mean(-1, keepdim=True)


def _model(layout: str = "expand", mixer=FusedMultiQueryAttention):
    torch.manual_seed(0)
    return SSMStack(mixer=lambda: mixer(layout))


def _bound(model, tp: int) -> float:
    """The Megatron-style fraction: every Linear weight and the token table sharded, the rest whole."""
    sharded = sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding)))
    total = sum(p.numel() for p in model.parameters())
    return (sharded / tp + total - sharded) / total


MODES = [pytest.param(False, id="plain"), pytest.param(True, id="sp")]


def _verified_plan(model, tp, sequence_parallel, near_bound=True):
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=sequence_parallel,
                      verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp, example_inputs=(example_tokens(),))
    assert report.ok, str(report)
    if near_bound:
        assert max(report.param_fraction) <= _bound(model, tp) + 0.1, (report.param_fraction, _bound(model, tp))
    return plan


@pytest.mark.parametrize("sequence_parallel", MODES)
@pytest.mark.parametrize("tp", [2, 4])
def test_fused_multi_query_attention_shards_the_query_heads(tp, sequence_parallel):
    """Would catch: the fused projection kept whole (about 0.52 of the parameters per rank at tp 4,
    over the bound + 0.1), the k / v head cut over ranks, its copies' weight or bias gradients left
    as per-rank shares, or the attention's head count left global."""
    plan = _verified_plan(_model(), tp, sequence_parallel)
    assert isinstance(plan["layers.*.mixer.c_attn"], GroupCopies)


@pytest.mark.parametrize("sequence_parallel", MODES)
@pytest.mark.parametrize("layout", ["repeat", "matmul"])
def test_other_broadcasts_of_the_one_head_shard_the_query_heads(layout, sequence_parallel):
    """The output unsqueezed before the split and repeated by expand + reshape (the layout of
    transformers' multi-query GPT-BigCode), and matmuls broadcasting the head: the same plan."""
    plan = _verified_plan(_model(layout), 4, sequence_parallel)
    assert isinstance(plan["layers.*.mixer.c_attn"], GroupCopies)


def test_part_read_whole_elsewhere_keeps_the_projection_whole():
    """Default-deny: a k read outside its broadcast (its mean added to the output) would get a
    whole gradient on every rank, summed tp times over the copies; the projection stays whole."""
    model = _model(mixer=KeyReadWhole)
    records = {r.key: r for r in explain(model, example_inputs=(example_tokens(),), tp_size=4)}
    assert records["layers.*.mixer.c_attn"].style == "replicated"
    _verified_plan(model, 4, False, near_bound=False)


@pytest.mark.parametrize("tp", [2, 4])
def test_checker_reads_the_parts_held_whole(tp):
    """``check_plan`` follows the shard as the plan lays it out: the k / v parts held whole by
    ``GroupCopies`` are replicated from the cut on, so the synthesized plan reads clean (the checker
    used to flag its row ``row_without_shard``); the same projection sharded without the copies is
    flagged (the one head cut over ranks, the parts' sizes)."""
    from autotp import check_plan

    model = _model()
    plan = _verified_plan(model, tp, False)
    assert check_plan(model, plan, tp_size=tp, example_inputs=(example_tokens(),)) == []
    plain = {**plan, "layers.*.mixer.c_attn": plan["layers.*.mixer.c_attn"].base}
    kinds = {f.kind for f in check_plan(model, plain, tp_size=tp, example_inputs=(example_tokens(),))}
    assert {"breaks_shard", "fused_sizes"} <= kinds
