"""Attention as reference implementations and single-file training repos write it is sharded by
heads at the bound (issue 42, item 7): complex rotary with ``view_as_complex`` and kv heads repeated
by ``expand``, a fused q/k/v Linear cut by ``split`` into unequal parts for grouped kv, an output
gated by ``sigmoid(Linear(x))``, a learned per-head temperature, differential attention.

Each plan must verify against the unsharded model (logits and every gradient), hold the bound's
parameter fraction per rank (``outside_reference_models.bound_fraction``), and keep no attention
whole: a plan that computes something else fails the first check; one that leaves the attention
whole (0.64-0.67 of the parameters per rank at tp 2 when the head counts are literals in the code,
which the synthesizer cannot divide) fails the second. Default tier: the first idiom at tp 2 under
SP; the rest in the slow tier (conftest's base-case rule).
"""

from __future__ import annotations

import warnings

import pytest
import torch.nn.functional as F
from outside_reference_models import IDIOMS, Transformer, bound_fraction, tokens
from torch import nn

import autotp
from autotp.errors import WholeAttentionWarning


@pytest.mark.parametrize("sequence_parallel", [True, False], ids=["sp", "plain"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("idiom", list(IDIOMS))
def test_reference_style_attention_is_sharded_at_the_bound(idiom, tp, sequence_parallel):
    model = IDIOMS[idiom]()
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        plan = autotp.synthesize(model, example_inputs=(tokens(),), tp_size=tp, sequence_parallel=sequence_parallel,
                                 verify=False)
        report = autotp.verify(model, plan, tp_size=tp, example_inputs=(tokens(),))
    assert report.ok, str(report)
    assert not [w for w in caught if issubclass(w.category, WholeAttentionWarning)], [str(w.message) for w in caught]
    assert max(report.param_fraction) <= bound_fraction(model, tp) + 1e-3, (report.param_fraction, plan)


class _Backend(nn.Module):
    """The fused kernel in a child module that holds no Linear (as attention backends are written)."""

    def forward(self, q, k, v):
        return F.scaled_dot_product_attention(q, k, v, is_causal=True)


class _LiteralCountsAttention(nn.Module):
    """Head counts written as literals (nothing to divide) and sdpa run by a child: kept whole."""

    def __init__(self):
        super().__init__()
        self.wq, self.wk, self.wv, self.wo = (nn.Linear(64, 64, bias=False) for _ in range(4))
        self.backend = _Backend()

    def forward(self, x, freqs_cis, mask):
        b, n, _ = x.shape
        q, k, v = (t.view(b, n, 8, 8).transpose(1, 2) for t in (self.wq(x), self.wk(x), self.wv(x)))
        return self.wo(self.backend(q, k, v).transpose(1, 2).reshape(b, n, 64))


def test_an_attention_kept_whole_is_warned_where_its_kernel_runs_in_a_child(no_shape_fixes):
    """The warning names the attention (the module with the projections), not the backend child that
    runs the kernel; before, an attention whose kernel ran in a child was kept whole silently. (Its
    literal counts keep it whole once the literal rewrite is off; with it, it shards.)"""
    model = Transformer(_LiteralCountsAttention)
    with pytest.warns(WholeAttentionWarning, match=r"^layers\.\*\.attention: attention kept whole"):
        plan = autotp.synthesize(model, example_inputs=(tokens(),), tp_size=2, verify=False)
    assert "layers.*.attention.wq" not in plan, plan


def test_a_float32_norm_under_autocast_inside_the_attention_is_proven_on_meta():
    """q / k norms computed inside ``torch.autocast(device_type=x.device.type, enabled=False)``:
    the shape proof runs the attention on meta, where torch raises "unsupported scalarType" for an
    autocast of device type meta. Before, the attention could not be proven and was kept whole
    (0.6 of the parameters per rank at tp 2, olmo-core's models among them); now autocast on meta
    is taken as the CPU's and the attention is sharded at the bound."""
    test_reference_style_attention_is_sharded_at_the_bound("float32_qk_norm", 2, True)
