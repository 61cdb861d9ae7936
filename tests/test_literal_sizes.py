"""Attention sized by module-level constants (``split(DIM)``, ``view(b, n, HEADS, DIM_HEAD)``,
``qkv[..., DIM:2 * DIM]``, ``unflatten(-1, (3, HEADS, -1))``) is sharded by heads: the shape
proof's last resort (:mod:`autotp.synth.literal_sizes`) rewrites those calls per rank
(``ShardCounts(literals=...)``) where no attribute can be divided.

Before, each of these attentions was kept whole (0.50 of the parameters per rank at tp 4 where
the bound is 0.25) or, with the sizes written as ``-1`` nowhere, refused. Each plan must verify
against the unsharded model (logits and every gradient), at the traced shapes and at others (one
token, another batch), and hold the bound's parameter fraction.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from torch import nn
from outside_attention_models import IDIOMS, bound_fraction, tokens

import autotp
from autotp.check import check_plan
from autotp.emit import emit_python
from autotp.errors import WholeAttentionWarning
from autotp.styles import ShardCounts

LITERAL = ["literal_split", "literal_unflatten", "literal_slices", "literal_inferred", "literal_heads"]
MODES = dict(argnames=("tp", "sequence_parallel"), argvalues=[(2, True), (2, False), (4, True), (4, False)],
             ids=["tp2-sp", "tp2", "tp4-sp", "tp4"])


def _plan(idiom: str, tp: int, sequence_parallel: bool):
    model = IDIOMS[idiom]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autotp.synthesize(model, example_inputs=(tokens(),), tp_size=tp, sequence_parallel=sequence_parallel)
    assert not [w for w in caught if issubclass(w.category, WholeAttentionWarning)], [str(w.message) for w in caught]
    return model, plan


@pytest.mark.parametrize(**MODES)
@pytest.mark.parametrize("idiom", LITERAL)
def test_sizes_written_as_constants_are_rewritten_per_rank(idiom, tp, sequence_parallel):
    model, plan = _plan(idiom, tp, sequence_parallel)
    report = autotp.verify(model, plan, tp_size=tp, example_inputs=(tokens(),))
    assert report.ok, str(report)
    assert max(report.param_fraction) <= bound_fraction(model, tp) + 1e-3, (report.param_fraction, plan)
    style = plan["layers.*.attn"]
    rewrites = [s for s in (style, getattr(style, "base", None)) if isinstance(s, ShardCounts) and s.literals]
    assert rewrites, plan


@pytest.mark.parametrize("idiom", ["literal_split", "literal_unflatten", "literal_slices"])
def test_the_rewritten_plan_is_exact_at_shapes_it_was_not_traced_at(idiom):
    """The rules name calls by the shard's width, not by the traced batch and length: one token
    (a decode step), an odd length and another batch run the same plan exactly."""
    model, plan = _plan(idiom, 2, False)
    for batch, seq in [(1, 1), (3, 5)]:
        report = autotp.verify(model, plan, tp_size=2, example_inputs=(tokens(batch, seq),))
        assert report.ok, (batch, seq, str(report))


@pytest.mark.parametrize("idiom", LITERAL)
def test_the_checker_replays_the_rewrite_and_the_plan_without_it_fails(idiom):
    """The checker runs the module at per-rank widths with the plan's rewrite (``Shards.rewrites``),
    so the plan has no finding. Without the rewrite, the plan fails loudly where a size does not fit
    the per-rank width, and where it runs (``view(b, n, HEADS, -1)``: heads of half the size) the
    checker names the attention and the verifier finds other numbers."""
    model, plan = _plan(idiom, 2, False)
    assert check_plan(model, plan, tp_size=2, example_inputs=(tokens(),)) == []
    without = {key: style for key, style in plan.items() if key != "layers.*.attn"}
    report = autotp.verify(model, without, tp_size=2, example_inputs=(tokens(),))
    assert not report.ok, str(report)
    if idiom == "literal_heads":
        findings = check_plan(model, without, tp_size=2, example_inputs=(tokens(),))
        assert [f.module for f in findings if f.kind == "reshape_heads"] == ["layers.0.attn"]  # layers alike: one
        assert "raised" not in str(report), str(report)
    else:
        assert "raised" in str(report), str(report)


def test_an_emitted_python_plan_keeps_the_rules():
    model, plan = _plan("literal_split", 2, False)
    namespace: dict = {}
    exec(emit_python(model, plan), namespace)  # noqa: S102 - the emitted module, run as a user would import it
    assert repr(namespace["plan"](model)["layers.*.attn"]) == repr(plan["layers.*.attn"])


class _Cuts(nn.Module):
    """Views, splits and slices of a ``(b, n, 16)`` tensor (4 heads of 4) sized by constants."""

    def forward(self, x):
        b, n, _ = x.shape
        return (x.view(b, n, 4, 4), x.reshape(b, n, 4, 4), x.unflatten(-1, (4, -1)), x.split(4, dim=-1),
                x[..., 4:8], x[:, :, :4], x.narrow(-1, 8, 4))


RULES = (("view", 3, 2, 16, 2, 4, (1, 5, 4, 4)), ("split", 3, 2, 16, None, 4, ()), ("slice", 3, 2, 16, 4, 8, ()),
         ("slice", 3, 2, 16, 0, 4, ()), ("slice", 3, 2, 16, 8, 12, ()))


def _shapes(outputs):
    return [tuple(o.shape) if isinstance(o, torch.Tensor) else [tuple(p.shape) for p in o] for o in outputs]


def test_rules_rewrite_calls_on_the_shard_and_leave_the_global_width_alone():
    module = _Cuts()
    ShardCounts(literals=RULES).localize(module, 2)
    local = module(torch.arange(80.0).view(1, 5, 16)[..., :8].contiguous())  # 8 of the 16 features
    assert _shapes(local) == [(1, 5, 2, 4)] * 3 + [[(1, 5, 2)] * 4] + [(1, 5, 2)] * 3
    assert local[4][0, 0].tolist() == [2.0, 3.0]  # ``[4:8]`` of the global parts is ``[2:4]`` of the rank's
    whole = module(torch.zeros(1, 5, 16))  # a tensor of the global width: every call as written
    assert _shapes(whole) == [(1, 5, 4, 4)] * 3 + [[(1, 5, 4)] * 4] + [(1, 5, 4)] * 3


def test_a_slice_already_at_its_per_rank_place_is_not_cut_again():
    """Matched by both ends: ``[4:8]`` becomes ``[2:4]`` once; ``[2:4]`` is left alone, though 4 is
    a global cut point."""
    from autotp.styles.attention import _LiteralSizes

    x = torch.zeros(1, 5, 8)
    with _LiteralSizes(RULES, 2):
        assert tuple(x[..., 4:8].shape) == tuple(x[..., 2:4].shape) == (1, 5, 2)
        assert tuple(x[..., 6:8].shape) == (1, 5, 2)
