"""MoE experts that loop over 3-D parameters and add into a running sum, sharded on the FFN dim.

The experts are held as 3-D parameters; a loop picks one expert's weight (``W[e]``), adds a
per-expert bias, scales by the routing weight and accumulates with ``index_add_``: gate/up fused and
interleaved (``[..., ::2]``, ``[..., 1::2]``) and clamped, or fused in halves and run by ``F.linear``.
Each rank holds its slice of every expert's FFN features; the down projection's per-expert bias is
added by one rank only, since the partial sums are reduced once after the module. Every plan is
verified on logits and every gradient at tp 2 and 4, plain and sequence-parallel, and must hold
about the Megatron-style bound of the parameters per rank (router and norms whole). Loops that
read the running sum other than linearly, or read the 3-D weight outside the products, stay whole.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp import styles
from autotp.errors import PlanError
from autotp.verifier import verify
from tests.synth_toy import DIM, HEADS, VOCAB, example_tokens

EXPERTS, TOP_K, FFN, LIMIT = 4, 2, 32, 7.0


class Router(nn.Module):
    """Top-k routing on raw parameters: logits, the top-k experts and their softmax weights."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, DIM) * DIM ** -0.5)
        self.bias = nn.Parameter(torch.randn(EXPERTS) * 0.1)

    def forward(self, x):
        top, index = torch.topk(F.linear(x, self.weight, self.bias), TOP_K, dim=-1)
        return F.softmax(top, dim=1), index


class LoopExperts(nn.Module):
    """``gate_up`` (E, in, 2*ffn) interleaved and clamped, ``down`` (E, ffn, in), per-expert biases;
    one expert per step, ``x[token] @ W[e]``, accumulated into ``out`` by ``index_add_``."""

    def __init__(self):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(EXPERTS, DIM, 2 * FFN) * DIM ** -0.5)
        self.gate_up_bias = nn.Parameter(torch.randn(EXPERTS, 2 * FFN) * 0.1)
        self.down = nn.Parameter(torch.randn(EXPERTS, FFN, DIM) * FFN ** -0.5)
        self.down_bias = nn.Parameter(torch.randn(EXPERTS, DIM) * 0.1)

    def expert(self, x, e):
        gate_up = x @ self.gate_up[e] + self.gate_up_bias[e]
        gate, up = gate_up[..., ::2].clamp(max=LIMIT), gate_up[..., 1::2].clamp(-LIMIT, LIMIT)
        return ((up + 1) * gate * torch.sigmoid(gate * 1.702)) @ self.down[e] + self.down_bias[e]

    def accumulate(self, out, token, y):
        return out.index_add_(0, token, y)

    def forward(self, x, index, weights):
        out = torch.zeros_like(x)
        for e in range(EXPERTS):
            token, slot = torch.where(index == e)
            out = self.accumulate(out, token, self.expert(x[token], e) * weights[token, slot, None])
        return out


class LinearChunkedLoopExperts(LoopExperts):
    """Weights stored (E, out, in) and run by ``F.linear(x, W[e])``, gate/up fused in halves (``chunk``),
    the running sum updated out of place (``out = out + ...``)."""

    def __init__(self):
        super().__init__()
        self.gate_up = nn.Parameter(torch.randn(EXPERTS, 2 * FFN, DIM) * DIM ** -0.5)
        self.down = nn.Parameter(torch.randn(EXPERTS, DIM, FFN) * FFN ** -0.5)

    def expert(self, x, e):
        gate, up = (F.linear(x, self.gate_up[e]) + self.gate_up_bias[e]).chunk(2, dim=-1)
        return F.linear(F.silu(gate) * up, self.down[e]) + self.down_bias[e]

    def accumulate(self, out, token, y):
        return out + torch.zeros_like(out).index_add(0, token, y)


class ClampedRunningSum(LoopExperts):
    """The running sum is clamped after every expert: a clamp of a per-rank partial sum is not the
    clamp of the sum, so the experts must stay whole."""

    def accumulate(self, out, token, y):
        return out.index_add_(0, token, y).clamp(-0.5, 0.5)


class WeightReadOutside(LoopExperts):
    """The 3-D down weight is also read whole (a scale from its mean magnitude): sharded, each rank
    would read its slice as the whole, so the experts must stay whole."""

    def forward(self, x, index, weights):
        return super().forward(x, index, weights) * self.down.abs().mean()


class MoE(nn.Module):
    def __init__(self, experts: type[nn.Module], router: type[nn.Module] = Router):
        super().__init__()
        self.router, self.experts = router(), experts()

    def forward(self, x):
        b, t, d = x.shape
        x = x.reshape(-1, d)
        weights, index = self.router(x)
        return self.experts(x, index, weights).reshape(b, t, d)


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, DIM // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self, experts, router: type[nn.Module] = Router):
        super().__init__()
        self.norm1, self.norm2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.mlp = Attention(), MoE(experts, router)

    def forward(self, x):
        x = x + self.attn(self.norm1(x))
        return x + self.mlp(self.norm2(x))


class Model(nn.Module):
    """Two pre-norm layers of attention and a MoE block of ``experts`` routed by ``router``."""

    def __init__(self, experts, layers: int = 2, router: type[nn.Module] = Router):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(experts, router) for _ in range(layers))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def megatron_bound(model: nn.Module, tp_size: int) -> float:
    """Parameters per rank if every Linear weight, the embedding and every 3-D expert parameter is
    sharded and the rest (norms, biases, the router) is whole."""
    sharded = {id(m.weight) for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding))}
    sharded |= {id(p) for p in model.parameters() if p.dim() == 3}
    total = sum(p.numel() for p in model.parameters())
    split = sum(p.numel() for p in model.parameters() if id(p) in sharded)
    return (total - split + split / tp_size) / total


def synthesize_and_verify(experts, tp_size, sequence_parallel, router: type[nn.Module] = Router):
    """The toy model with ``experts``, its synthesized plan and that plan's report (verified)."""
    torch.manual_seed(0)
    model = Model(experts, router=router).eval()
    tokens = example_tokens()
    plan = autotp.synthesize(model, example_inputs=(tokens,), tp_size=tp_size, sequence_parallel=sequence_parallel, verify=False)
    report = verify(model, plan, tp_size=tp_size, example_inputs=(tokens,))
    assert report.ok, str(report)
    assert max(report.logits_max_abs_diff) <= 1e-5 and report.worst_grad[1] <= 1e-5, report
    return model, plan, report


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("experts", [LoopExperts, LinearChunkedLoopExperts], ids=["interleaved", "chunked"])
def test_loop_experts_are_sharded_on_the_ffn_dim_and_exact(experts, tp_size, sequence_parallel):
    """Would catch the loop's experts left whole (fraction near 0.8), the interleaved gate/up or the
    gate/up bias sharded out of step with the weight (logits off), and the down bias added by every
    rank to its partial sum (counted tp times: logits off by (tp - 1) * bias)."""
    model, plan, report = synthesize_and_verify(experts, tp_size, sequence_parallel)
    style = plan["layers.*.mlp.experts"]
    assert isinstance(style, styles.ExpertsParallel), plan
    assert style.once == ("down_bias",), style
    assert style.shard_dims["gate_up_bias"] == 1, style
    assert isinstance(plan["layers.*.mlp.router"], styles.PartialGradRouter), plan
    bound = megatron_bound(model, tp_size)
    assert all(abs(f - bound) < 0.03 for f in report.param_fraction), (report.param_fraction, bound)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("experts", [ClampedRunningSum, WeightReadOutside], ids=["clamped_sum", "weight_read"])
def test_loop_experts_that_cannot_be_split_stay_whole_and_exact(experts, tp_size, sequence_parallel):
    """Would catch a plan that shards experts whose running sum is clamped inside the loop (a clamp
    of each rank's partial sum: logits off) or whose 3-D weight is also read whole elsewhere (a
    shard read as the whole): both must stay whole, the rest of the model still sharded."""
    _, plan, report = synthesize_and_verify(experts, tp_size, sequence_parallel)
    assert "layers.*.mlp.experts" not in plan or not isinstance(plan["layers.*.mlp.experts"], styles.ExpertsParallel)
    assert "layers.*.attn.q" in plan, sorted(plan)


def test_experts_parallel_refuses_a_bias_both_sharded_and_added_once():
    """Would catch a style built with a parameter both sharded and added once (which is it?)."""
    with pytest.raises(PlanError, match="down_bias"):
        styles.ExpertsParallel(shard_dims={"down_bias": 1}, packed={}, once=("down_bias",))


def test_experts_parallel_refuses_once_naming_no_parameter():
    """Would catch ``once`` naming something the module does not hold (a typo): that bias would then
    silently be added by every rank."""
    torch.manual_seed(0)
    model = Model(LoopExperts).eval()
    plan = {"layers.*.mlp.experts": styles.ExpertsParallel(shard_dims={"gate_up": 2, "down": 1}, packed={},
                                                             once=("down_bais",))}
    try:
        message = verify(model, plan, tp_size=2, example_inputs=(example_tokens(),)).error or ""
    except PlanError as error:  # raised, or reported by the verifier: either names the parameter
        message = str(error)
    assert "down_bais" in message and "not parameters" in message, message


def _loop_graph(after_sum: str | None = None, read_weight: bool = False):
    """One expert step on a hand-built graph: ``y = (x @ W[0]) @ D[0] + b[0]; out.index_add_(0, t, y)``,
    then optionally one more op on the running sum, or a second read of the 3-D weight ``W``."""
    import networkx as nx

    from autotp.synth.graph import Ref, add_node

    g, m = nx.DiGraph(), "moe.experts"
    add_node(g, "x", "placeholder", kind="input", shape=(6, 8))
    add_node(g, "t", "placeholder", kind="input", shape=(6,))
    for name, shape in (("W", (4, 8, 16)), ("D", (4, 16, 8)), ("b", (4, 8))):
        add_node(g, name, "placeholder", kind="param", param=f"{m}.{name}", shape=shape)
    add_node(g, "w0", "select", (Ref("W"), 0, 0), shape=(8, 16), module=m)
    add_node(g, "h", "matmul", (Ref("x"), Ref("w0")), shape=(6, 16), module=m)
    add_node(g, "d0", "select", (Ref("D"), 0, 0), shape=(16, 8), module=m)
    add_node(g, "y", "matmul", (Ref("h"), Ref("d0")), shape=(6, 8), module=m)
    add_node(g, "b0", "select", (Ref("b"), 0, 0), shape=(8,), module=m)
    add_node(g, "yb", "add", (Ref("y"), Ref("b0")), shape=(6, 8), module=m)
    add_node(g, "out", "zeros_like", (Ref("x"),), shape=(6, 8), module=m)
    add_node(g, "sum", "index_add_", (Ref("out"), 0, Ref("t"), Ref("yb")), shape=(6, 8), module=m)
    if after_sum:
        add_node(g, "after", after_sum, (Ref("sum"),), shape=(6, 8), module=m)
    if read_weight:
        add_node(g, "norm", "abs", (Ref("W"),), shape=(4, 8, 16), module=m)
    return g


def test_partial_sum_rule_on_a_hand_built_loop():
    """Would catch a running sum read nonlinearly (a clamp) passing as linear, or a per-expert down
    bias not collected to be added once."""
    from autotp.synth.queries import module_of
    from autotp.synth.experts import once_params, partial_sum_breaks

    g = _loop_graph()
    assert partial_sum_breaks(g, {"y": frozenset({"h"})}, module_of) == {}
    assert once_params(g, ["y"], "moe.experts") == {"b"}
    bad = partial_sum_breaks(_loop_graph("clamp"), {"y": frozenset({"h"})}, module_of)
    assert set(bad) == {"h"} and "clamp" in bad["h"], bad


def test_selected_weight_needs_every_read_to_be_a_product():
    """Would catch ``W[e]`` read as a Linear weight while ``W`` is also read whole (sharding it would
    hand that reader a slice)."""
    from autotp.synth.queries import selected_weight

    assert selected_weight(_loop_graph(), "w0") == ("W", False)
    assert selected_weight(_loop_graph(read_weight=True), "w0") is None


class TypedRouter(nn.Module):
    """A raw-weight router whose top-k reads a routing bias of its block (no gradient) and whose
    routing weights take the input's dtype (``type_as(x)``: x lends only its dtype)."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(EXPERTS, DIM) * DIM ** -0.5)

    def forward(self, x, bias):
        scores = torch.sigmoid(F.linear(x, self.weight).float())
        _, index = torch.topk(scores + bias, TOP_K, dim=-1)
        top = scores.gather(1, index)
        return (top / top.sum(-1, keepdim=True)).type_as(x), index


class BiasedMoE(MoE):
    def __init__(self, experts: type[nn.Module]):
        super().__init__(experts)
        self.router = TypedRouter()
        self.routing_bias = nn.Parameter(0.1 * torch.randn(EXPERTS), requires_grad=False)

    def forward(self, x):
        b, t, d = x.shape
        x = x.reshape(-1, d)
        weights, index = self.router(x, self.routing_bias)
        return self.experts(x, index, weights).reshape(b, t, d)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_router_inside_a_moe_block_reduces_the_block_input_once_under_sequence_parallel(tp_size):
    """The block takes whole tokens at entry; its router, reading them, must not gather them again
    nor slice its routing weights back onto the stream (``type_as(x)`` made them look like the
    stream): then it runs its backward on the experts' partial gradients and the block's input
    gradient is reduce-scattered once. Would catch the router's own all-reduces (backward: 3 more
    collectives per layer than the forward)."""
    torch.manual_seed(0)
    model = Model(LoopExperts).eval()
    for block in model.layers:
        block.mlp = BiasedMoE(LoopExperts)
    tokens = example_tokens()[:, :8]
    plan = autotp.synthesize(model, example_inputs=(tokens,), tp_size=tp_size, sequence_parallel=True, verify=False)
    report = verify(model, plan, tp_size=tp_size, example_inputs=(tokens,))
    assert report.ok, str(report)
    assert isinstance(plan["layers.*.mlp.router"], styles.PartialGradRouter), plan.get("layers.*.mlp.router")
    swap = {"reduce_scatter_tensor": "all_gather_into_tensor", "all_gather_into_tensor": "reduce_scatter_tensor"}
    assert report.collectives_backward == {swap.get(op, op): n for op, n in report.collectives.items()}
    assert report.comm_volume_backward == report.comm_volume
    assert max(report.param_fraction) <= megatron_bound(model, tp_size) + 0.01, report.param_fraction


class ParallelMoEBlock(nn.Module):
    """Attention and a MoE block side by side on one norm's output, summed into the residual."""

    def __init__(self, experts):
        super().__init__()
        self.norm = nn.LayerNorm(DIM)
        self.attn, self.mlp = Attention(), MoE(experts)

    def forward(self, x):
        h = self.norm(x)
        return x + self.attn(h) + self.mlp(h)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_moe_block_beside_attention_reduces_their_shared_input_once(tp_size, sequence_parallel):
    """The norm's output is read by the MoE block and, beside it, by the attention's q/k/v: all of
    them take one DTensor of it, so its gradient is reduced once per layer (plain: one all-reduce;
    SP: one reduce-scatter). Would catch the attention's columns keeping the block input plain
    (backward: the router's, the experts' and the attention's input gradients reduced apart)."""
    torch.manual_seed(0)
    model = Model(LoopExperts).eval()
    model.layers = nn.ModuleList(ParallelMoEBlock(LoopExperts) for _ in range(2))
    tokens = example_tokens()[:, :8]
    plan = autotp.synthesize(model, example_inputs=(tokens,), tp_size=tp_size, sequence_parallel=sequence_parallel, verify=False)
    report = verify(model, plan, tp_size=tp_size, example_inputs=(tokens,))
    assert report.ok, str(report)
    assert isinstance(plan["layers.*.mlp.router"], styles.PartialGradRouter), plan.get("layers.*.mlp.router")
    layers = len(model.layers)
    if sequence_parallel:  # one all-gather per layer + the head's; its mirror in backward
        assert report.collectives_backward.get("reduce_scatter_tensor") == layers + 1, report.collectives_backward
        assert "all_reduce" not in report.collectives_backward, report.collectives_backward
    else:  # the norm's output reduced once per layer, + the head's input
        assert report.collectives_backward == {"all_reduce": layers + 1}, report.collectives_backward
    assert report.comm_volume_backward <= report.comm_volume
    assert max(report.param_fraction) <= megatron_bound(model, tp_size) + 0.01, report.param_fraction
