"""A normed input read by experts columns, a column Linear and a router kept whole: its gradient reduced once.

Attention whose query comes from routed experts columns (each token's rows picked by ``x[token]``)
and whose k/v come from one column Linear, with the router Linear kept whole, all reading one normed
input: each column all-reduced its own input gradient (the experts at ``top_k`` rows per token), so
backward moved more bytes than forward. Each reader now hands back its share of the gradient (the
router its outputs' whole gradient divided by tp) and the norm reduces their sum once
(:mod:`autotp.synth.partial_inputs`). Every plan is verified on logits and every gradient against the
unsharded model at tp 2 and 4, plain and sequence-parallel.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from autotp import styles
from autotp.errors import PlanError
from tests.test_loop_experts import megatron_bound
from tests.test_split_experts import HEAD_DIM, TOP_K, DenseMLP, RoutedQueryAttention, synthesize_and_verify, toy_model


class ScaledInputRoutedAttention(RoutedQueryAttention):
    """The near miss: the routing weights scale the experts' input rows, so the router's outputs get
    a share of the gradient from the experts (not the whole it could divide by tp)."""

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        order, token, gates, sizes = self.route(flat)
        q = torch.zeros(b * t * TOP_K, self.width).index_add(0, order, self.queries(flat[token] * gates[:, None], sizes))
        q = q.view(b, t, TOP_K, -1).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        k, v = (h.view(b, t, -1, HEAD_DIM).transpose(1, 2).repeat(1, TOP_K, 1, 1) for h in self.kv(x).chunk(2, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2)
        y = y.reshape(b, t, TOP_K, -1).reshape(-1, self.width)
        return torch.zeros_like(flat).index_add(0, token, self.outputs(y[order], sizes)).view(b, t, d)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_routed_query_input_gradient_is_reduced_once(tp_size, sequence_parallel):
    """Would catch each column reducing its own input gradient (the experts' at top_k rows per
    token: backward bytes above forward), and the router's whole gradient added to the columns'
    shares unscaled (gradients tp times too large)."""
    torch.manual_seed(0)
    model = toy_model(RoutedQueryAttention, DenseMLP).eval()
    plan, report = synthesize_and_verify(model, tp_size, sequence_parallel)
    assert plan["layers.*.mixer.queries"].partial_grad_plain, plan
    assert isinstance(plan["layers.*.mixer.router"], styles.PartialGradRouter), plan
    assert plan["layers.*.mixer.router"].partial_grad_plain, plan
    assert report.comm_volume_backward <= report.comm_volume, (report.comm_volume, report.comm_volume_backward)
    bound = megatron_bound(model, tp_size)
    assert all(abs(f - bound) < 0.03 for f in report.param_fraction), (report.param_fraction, bound)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_router_scaling_the_experts_input_keeps_its_own_reductions(tp_size, sequence_parallel):
    """The near miss keeps the plain plan and verifies: the routing weights scale the rows the
    experts read, so their gradient is a share the router must not divide again."""
    torch.manual_seed(0)
    model = toy_model(ScaledInputRoutedAttention, DenseMLP).eval()
    plan, _ = synthesize_and_verify(model, tp_size, sequence_parallel)
    assert not any(getattr(style, "partial_grad_plain", False) for style in plan.values()), plan
    assert not isinstance(plan.get("layers.*.mixer.router"), styles.PartialGradRouter), plan


def test_plain_partial_gradients_need_a_module_of_columns():
    """A module of rows takes this rank's features: no partial input gradient to hand back."""
    with pytest.raises(PlanError, match="partial_grad_plain"):
        styles.ExpertsParallel(shard_dims={"weight": 2}, packed={}, side="rows", partial_grad_plain=True)


def test_plain_partial_gradient_styles_export_as_they_are():
    from autotp import emit

    for style in (styles.ExpertsParallel(shard_dims={"weight": 1}, packed={}, side="columns", partial_grad_plain=True),
                  styles.PartialGradRouter(partial_grad_plain=True)):
        names: set[str] = set()
        namespace: dict = {}
        source = emit.render(style, names)
        exec("\n".join(emit._imports(names, uses_parts=False)), namespace)
        assert repr(eval(source, namespace)) == repr(style), source
