"""A MoE written as a loop over ``nn.Linear`` experts reduces its experts' partial sums once.

The block routes each token to ``top_k`` experts, runs every expert on its tokens and adds the
weighted outputs into one result (``index_add_``, or ``out[idx] += ...``). Each expert is a
column / row pair; left to themselves the rows would each reduce their own tokens: one collective
per expert and ``top_k`` times the bytes of the block's output, in each direction. The plan instead
leaves the rows' partial sums local (``Rowwise(output_layouts=Partial())``), reduces the block's
result once (``PartialSumBlock``), and its input gradient once at entry; the router's weight
gradient is all-reduced. Every plan is verified on logits and every gradient against the unsharded
model at tp 2 and 4, plain and sequence-parallel; the counts of collectives are asserted, forward
and backward. A block that adds anything but partial sums (its own input), or returns more than
its sum, keeps one reduction per expert, and stays exact.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp import styles
from autotp.synth import synthesize
from autotp.verifier import verify
from synth_toy import DIM, KV_HEADS, VOCAB, TitanAttention, TitanFeedForward, example_tokens

EXPERTS, TOP_K = 4, 2


class LoopMoE(nn.Module):
    """Top-k routing, then one expert at a time on its tokens; ``accumulate`` picks the idiom."""

    def __init__(self, accumulate: str = "index_add"):
        super().__init__()
        self.accumulate = accumulate
        self.gate = nn.Linear(DIM, EXPERTS, bias=False)
        self.experts = nn.ModuleList(TitanFeedForward() for _ in range(EXPERTS))

    def forward(self, x):
        b, t, d = x.shape
        x = x.view(-1, d)
        weights, chosen = torch.topk(self.gate(x), TOP_K, dim=-1)
        weights = F.softmax(weights, dim=-1)
        out = torch.zeros_like(x)
        for i, expert in enumerate(self.experts):
            token, slot = torch.where(chosen == i)
            y = weights[token, slot, None] * expert(x[token])
            if self.accumulate in ("index_add", "tuple", "tuple_unused"):
                out.index_add_(0, token, y)
            elif self.accumulate == "setitem":
                out[token] += y
            else:  # "input": an identity path adds the block's own input to the sum
                out.index_add_(0, token, y + x[token])
        out = out.view(b, t, d)
        return (out, weights) if self.accumulate.startswith("tuple") else out


class Block(nn.Module):
    def __init__(self, accumulate):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attn, self.moe = TitanAttention(), LoopMoE(accumulate)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        out = self.moe(self.n2(x))
        if self.moe.accumulate == "tuple_unused":  # ``hidden, router_logits = self.mlp(...)``, the logits unread
            return x + out[0]
        return x + (out[0] + 0.0 * out[1].sum() if isinstance(out, tuple) else out)


class LoopMoELM(nn.Module):
    def __init__(self, accumulate: str = "index_add"):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(accumulate) for _ in range(2))
        self.norm, self.head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def _run(model, tp, sequence_parallel):
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=sequence_parallel,
                      verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp, example_inputs=(example_tokens(),))
    assert report.ok, str(report)
    return plan, report


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("accumulate", ["index_add", "setitem"])
def test_loop_experts_reduce_once_per_block_each_way(accumulate, tp, sequence_parallel):
    """Would catch a reduction per expert again (4 more per layer), a router gradient left partial
    or counted tp times, or an input gradient reduced twice."""
    plan, report = _run(LoopMoELM(accumulate), tp, sequence_parallel)
    assert isinstance(plan["layers.*.moe"], styles.PartialSumBlock), plan
    assert plan["layers.*.moe.experts.0.w2"].use_local_output and isinstance(plan["layers.*.moe.gate"], styles.ReplicatedWithGradAllReduce)
    if sequence_parallel:  # per layer: attention and MoE, one reduce-scatter and one all-gather each
        expected = {"reduce_scatter_tensor": 5, "all_gather_into_tensor": 5}
    else:  # the embedding's, then attention and MoE per layer
        expected = {"all_reduce": 5}
    # At tp 4 over the attention's 2 kv heads, each layer's k and v are gathered, their gradients
    # reduce-scattered back.
    gathers = 2 * len(LoopMoELM().layers) if tp > KV_HEADS else 0
    forward, backward = dict(expected), dict(expected)
    if gathers:
        forward["all_gather_into_tensor"] = forward.get("all_gather_into_tensor", 0) + gathers
        backward["reduce_scatter_tensor"] = backward.get("reduce_scatter_tensor", 0) + gathers
    assert report.collectives == forward, report
    assert report.collectives_backward == backward, report
    assert report.comm_volume_backward <= report.comm_volume, report
    assert all(abs(f - 1 / tp) < 0.02 for f in report.param_fraction), report.param_fraction


@pytest.mark.parametrize("accumulate", ["input", "tuple"])
def test_a_block_adding_more_than_partial_sums_reduces_each_expert(accumulate):
    """Default-deny: the block's own input added to the sum would be counted once per rank, and a
    second output (the routing weights) would leave it unreduced: each expert keeps its reduction,
    and the plan stays exact."""
    plan, report = _run(LoopMoELM(accumulate), 2, False)
    assert "layers.*.moe" not in plan and not getattr(plan["layers.*.moe.experts.0.w2"], "local", False), plan
    assert report.collectives["all_reduce"] > 5, report


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_a_block_returning_its_sum_and_unread_routing_weights_reduces_once(sequence_parallel):
    """``hidden, router_logits = self.mlp(x)`` with the logits unread: the block still reduces its
    sum once. Would catch the style refusing the tuple when applied ("PartialSumBlock expects one
    plain tensor ... got tuple"), which refused every plan for such a model."""
    plan, report = _run(LoopMoELM("tuple_unused"), 2, sequence_parallel)
    assert isinstance(plan["layers.*.moe"], styles.PartialSumBlock), plan
    assert report.comm_volume_backward <= report.comm_volume, report
