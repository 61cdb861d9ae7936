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
from outside_reference_models import IDIOMS, bound_fraction, tokens

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
