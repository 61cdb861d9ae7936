"""Zero-compute (identity) experts beside real 3-D experts in one running sum.

Some MoE layers route tokens to experts that compute nothing: the routed tokens, times their
routing weight, are added into the same running sum as the real experts' outputs. Sharded on the
FFN dim, the real experts leave per-rank partial sums, while the identity term is whole on every
rank: the reduction would count it tp times. The experts style multiplies the down projection by tp
and divides the output by tp (``scale_rows``), so each whole term counts once and its gradient adds
up to the full one. Every plan is verified on logits and every gradient at tp 2 and 4, plain and
sequence-parallel; a running sum read other than linearly after a whole term is added stays whole.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp import styles
from autotp.errors import PlanError
from tests.synth_toy import DIM
from tests.test_loop_experts import megatron_bound, synthesize_and_verify

REAL, ZERO, TOP_K, FFN = 4, 2, 2, 32


class Router(nn.Module):
    """Top-k over real and zero-compute experts; softmax weights of the chosen ones."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(REAL + ZERO, DIM) * DIM ** -0.5)

    def forward(self, x):
        top, index = torch.topk(F.linear(x, self.weight), TOP_K, dim=-1)
        return F.softmax(top, dim=1), index


class IdentityExperts(nn.Module):
    """Experts ``0 .. REAL-1`` are SwiGLU FFNs on 3-D weights; the last ``ZERO`` return their tokens.
    Every expert's output, times its routing weight, is added by ``index_add_`` to one running sum."""

    zero_first = False

    def __init__(self):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(REAL, 2 * FFN, DIM) * DIM ** -0.5)
        self.down = nn.Parameter(torch.randn(REAL, DIM, FFN) * FFN ** -0.5)

    def expert(self, x, e):
        gate, up = F.linear(x, self.gate_up[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down[e])

    def finish(self, out, x):
        return out

    def forward(self, x, index, weights):
        out = torch.zeros_like(x)
        order = list(range(REAL, REAL + ZERO)) + list(range(REAL)) if self.zero_first else range(REAL + ZERO)
        for e in order:
            token, slot = torch.where(index == e)
            y = x[token] if e >= REAL else self.expert(x[token], e)
            out.index_add_(0, token, y * weights[token, slot, None])
        return self.finish(out, x)


class ZeroFirstIdentityExperts(IdentityExperts):
    """The identity experts run first: the partial sums are then added into a whole running sum."""

    zero_first = True


class BiasedIdentityExperts(IdentityExperts):
    """A per-expert down bias, then a replicated term made from the tokens (``x * 0.5``) and a
    constant added to the running sum: all whole on every rank, each to be counted once."""

    def __init__(self):
        super().__init__()
        self.down_bias = nn.Parameter(torch.randn(REAL, DIM) * 0.1)

    def expert(self, x, e):
        return super().expert(x, e) + self.down_bias[e]

    def finish(self, out, x):
        return out + x * 0.5 + 0.25


class SiluAfterIdentity(IdentityExperts):
    """The running sum, identity term included, goes through a SiLU: not linear in the partial
    sums, so no scaling counts the identity term right: the experts must stay whole."""

    def finish(self, out, x):
        return F.silu(out)


class ParamScaledIdentity(IdentityExperts):
    """The identity term is scaled by a parameter of the experts module: not proven the same
    value on every rank by the analysis (default deny), so the experts stay whole."""

    def __init__(self):
        super().__init__()
        self.zero_scale = nn.Parameter(torch.tensor(0.5))

    def finish(self, out, x):
        return out + x * self.zero_scale


def _synthesize_and_verify(experts, tp_size, sequence_parallel):
    return synthesize_and_verify(experts, tp_size, sequence_parallel, router=Router)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("experts", [IdentityExperts, ZeroFirstIdentityExperts, BiasedIdentityExperts],
                         ids=["zero_last", "zero_first", "biased"])
def test_identity_experts_beside_real_ones_are_sharded_and_exact(experts, tp_size, sequence_parallel):
    """Would catch the experts kept whole (fraction near 0.8), the identity term, the down bias or
    the replicated addends counted tp times (logits off by (tp - 1) times them), or their gradient
    (routing weights, tokens) reaching the router and the embedding tp times or 1/tp of it."""
    model, plan, report = _synthesize_and_verify(experts, tp_size, sequence_parallel)
    style = plan["layers.*.mlp.experts"]
    assert isinstance(style, styles.ExpertsParallel), plan
    assert style.scale_rows == ("down",) and style.once == (), style
    bound = megatron_bound(model, tp_size)
    assert all(abs(f - bound) < 0.03 for f in report.param_fraction), (report.param_fraction, bound)
    assert report.comm_volume_backward <= report.comm_volume, report


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("experts", [SiluAfterIdentity, ParamScaledIdentity], ids=["silu_sum", "param_scaled"])
def test_identity_terms_the_analysis_cannot_count_once_keep_the_experts_whole(experts, tp_size, sequence_parallel):
    """Would catch a whole term counted once by scaling where the running sum then meets a
    nonlinearity (silu(P / tp + W / tp) summed is not silu(P + W)), or where the addend reads a
    parameter of the module: the experts stay whole, the rest of the model sharded, all exact."""
    _, plan, report = _synthesize_and_verify(experts, tp_size, sequence_parallel)
    assert not isinstance(plan.get("layers.*.mlp.experts"), styles.ExpertsParallel), plan
    assert "layers.*.attn.q" in plan, sorted(plan)


def _identity_graph(scale_param: bool = False, after: str | None = None):
    """``out = zeros; out.index_add_(0, t, (x @ W[0]) @ D[0]); out.index_add_(0, t, x[t] * w)``,
    the identity term optionally scaled by a parameter of the module, then optionally one op."""
    import networkx as nx

    from autotp.synth.graph import Ref, add_node

    g, m = nx.DiGraph(), "moe.experts"
    add_node(g, "x", "placeholder", kind="input", shape=(6, 8))
    add_node(g, "t", "placeholder", kind="input", shape=(6,))
    add_node(g, "w", "placeholder", kind="input", shape=(6, 1))
    for name, shape in (("W", (4, 8, 16)), ("D", (4, 16, 8)), ("s", (1,))):
        add_node(g, name, "placeholder", kind="param", param=f"{m}.{name}", shape=shape)
    add_node(g, "w0", "select", (Ref("W"), 0, 0), shape=(8, 16), module=m)
    add_node(g, "h", "matmul", (Ref("x"), Ref("w0")), shape=(6, 16), module=m)
    add_node(g, "d0", "select", (Ref("D"), 0, 0), shape=(16, 8), module=m)
    add_node(g, "y", "matmul", (Ref("h"), Ref("d0")), shape=(6, 8), module=m)
    add_node(g, "out", "zeros_like", (Ref("x"),), shape=(6, 8), module=m)
    add_node(g, "sum", "index_add_", (Ref("out"), 0, Ref("t"), Ref("y")), shape=(6, 8), module=m)
    add_node(g, "tok", "index", (Ref("x"), [Ref("t")]), shape=(6, 8), module=m)
    add_node(g, "ident", "mul", (Ref("tok"), Ref("w")), shape=(6, 8), module=m)
    if scale_param:
        add_node(g, "ident_s", "mul", (Ref("ident"), Ref("s")), shape=(6, 8), module=m)
    term = "ident_s" if scale_param else "ident"
    add_node(g, "sum2", "index_add_", (Ref("sum"), 0, Ref("t"), Ref(term)), shape=(6, 8), module=m)
    if after:
        add_node(g, "after", after, (Ref("sum2"),), shape=(6, 8), module=m)
    return g


def test_whole_terms_on_a_hand_built_running_sum():
    """Would catch an identity term not found (the style would not scale: counted tp times), one
    that reads a module parameter taken as whole, or a nonlinear read after it passing."""
    from autotp.synth.queries import module_of
    from autotp.synth.experts import partial_sum_breaks, whole_terms

    rows = {"y": frozenset({"h"})}
    assert partial_sum_breaks(_identity_graph(), rows, module_of) == {}
    assert whole_terms(_identity_graph(), ["y"], "moe.experts") == {"ident"}
    bad = partial_sum_breaks(_identity_graph(scale_param=True), rows, module_of)
    assert "reads a parameter" in bad["h"], bad
    bad = partial_sum_breaks(_identity_graph(after="tanh"), rows, module_of)
    assert "tanh" in bad["h"], bad


def test_experts_parallel_refuses_once_with_scale_rows():
    """Would catch a bias both added by one rank and scaled 1/tp (counted 1/tp in all)."""
    with pytest.raises(PlanError, match="drop once"):
        styles.ExpertsParallel(shard_dims={"down": 1}, packed={}, once=("down_bias",), scale_rows=("down",))


def test_experts_parallel_refuses_scale_rows_naming_an_unsharded_parameter():
    """Would catch ``scale_rows`` naming a parameter the style does not shard (a typo): the output
    would be divided by tp with nothing multiplied."""
    with pytest.raises(PlanError, match="dwon"):
        styles.ExpertsParallel(shard_dims={"down": 1}, packed={}, scale_rows=("dwon",))
