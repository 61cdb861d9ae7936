"""A mixer that loops over its heads in Python, one head at a time, is sharded by heads.

The toy mixer projects its input, views it into ``self.n_heads`` heads and runs a Python loop
that selects each head in turn (``xs[:, i]``), multiplies it by that head's own weight and bias
(``self.head_weight[i]``, ``self.head_bias[i]``), scans it over time with a per-head decay, and
stacks the heads back together before the output projection. The trace unrolls the loop; read as
one body run for every head, the input projection is column-parallel, the output projection
row-parallel, the per-head parameters sharded with the heads and ``n_heads`` divided by tp, so each
rank loops over its own heads. Every plan is verified on logits and every gradient against the
unsharded model at tp 2 and 4, plain and sequence-parallel. Loops that are not one body per head
(a head read twice, heads mixed, an iteration that differs, a count that is no attribute) keep the
mixer whole, and stay exact.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from autotp.synth.api import explain
from synth_toy import DIM, HEADS, VOCAB, TitanAttention, example_tokens
from test_partial_sums import _run  # synthesize, then verify (logits and every gradient)

HEAD_DIM = 16
INNER = HEADS * HEAD_DIM


class HeadLoopMixer(nn.Module):
    """Input projection, a Python loop over the heads with per-head parameters, output projection.

    ``variant`` picks the loop: ``"loop"`` (every head, one body), ``"cat"`` (the same, joined by
    ``cat`` along the features instead of ``stack``); the near misses ``"first"`` (every iteration
    reads head 0), ``"mix"`` (each head adds its neighbour's values), ``"uneven"`` (head 0 is scaled
    as no other is), ``"constant"`` (the loop runs over a module constant, not an attribute).
    """

    def __init__(self, variant: str = "loop"):
        super().__init__()
        self.variant = variant
        self.n_heads, self.head_dim = HEADS, HEAD_DIM
        self.in_proj = nn.Linear(DIM, 2 * INNER, bias=False)
        self.head_weight = nn.Parameter(torch.randn(HEADS, HEAD_DIM, HEAD_DIM) / HEAD_DIM ** 0.5)
        self.head_bias = nn.Parameter(torch.randn(HEADS, HEAD_DIM) * 0.1)
        self.decay = nn.Parameter(torch.rand(HEADS, HEAD_DIM))
        self.out_proj = nn.Linear(INNER, DIM, bias=False)

    def head(self, x, i):
        h = x @ self.head_weight[i] + self.head_bias[i]
        if self.variant == "uneven" and i == 0:
            h = h * 2.0
        state = torch.zeros(x.shape[0], x.shape[2], dtype=x.dtype)
        outs = []
        for step in range(x.shape[1]):  # a scan over time within the head
            state = state * torch.sigmoid(self.decay[i]) + h[:, step]
            outs.append(state)
        return torch.stack(outs, dim=1)

    def forward(self, x):
        b, t, _ = x.shape
        x_in, gate = self.in_proj(x).chunk(2, dim=-1)
        xs = x_in.view(b, t, self.n_heads, self.head_dim).transpose(1, 2)  # (b, heads, t, head_dim)
        count = HEADS if self.variant == "constant" else self.n_heads
        outs = []
        for i in range(count):
            if self.variant == "first":
                outs.append(self.head(xs[:, 0], i))
            elif self.variant == "mix":
                outs.append(self.head(xs[:, i] + xs[:, (i + 1) % count], i))
            else:
                outs.append(self.head(xs[:, i], i))
        if self.variant == "cat":
            y = torch.cat([o.transpose(1, 2) for o in outs], dim=1).transpose(1, 2)  # (b, t, inner)
        else:
            y = torch.stack(outs, dim=2).reshape(b, t, -1)  # (b, t, heads, head_dim) -> (b, t, inner)
        return self.out_proj(y * F.silu(gate))


class Block(nn.Module):
    def __init__(self, variant):
        super().__init__()
        self.n1, self.n2 = nn.RMSNorm(DIM), nn.RMSNorm(DIM)
        self.attn, self.mixer = TitanAttention(), HeadLoopMixer(variant)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.mixer(self.n2(x))


class HeadLoopLM(nn.Module):
    def __init__(self, variant: str = "loop"):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(Block(variant) for _ in range(2))
        self.norm, self.head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        x = self.embed(tokens)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_loop_over_every_head_is_sharded_by_heads(tp, sequence_parallel):
    """Would catch the mixer kept whole (fraction far above 1/tp), a rank looping over every head
    (index out of range, or heads of other ranks), per-head parameters left whole or read at the
    wrong head (wrong logits), or their gradients left partial (wrong gradients)."""
    plan, report = _run(HeadLoopLM("loop"), tp, sequence_parallel)
    assert isinstance(plan["layers.*.mixer.in_proj"], ColwiseParallel), plan
    mixer = {r.key: r for r in explain(HeadLoopLM("loop"), example_inputs=(example_tokens(),),
                                       sequence_parallel=sequence_parallel, tp_size=tp)}
    reason = mixer["layers.*.mixer"].reason
    assert "head_bias, head_weight" in reason and "decay" in reason and "n_heads" in reason, reason
    assert all(abs(f - 1 / tp) < 0.03 for f in report.param_fraction), report.param_fraction


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_loop_joined_by_cat_along_the_features_is_sharded(tp, sequence_parallel):
    """The heads joined by ``cat`` along their features, not ``stack`` on a new dim."""
    plan, report = _run(HeadLoopLM("cat"), tp, sequence_parallel)
    assert isinstance(plan["layers.*.mixer.in_proj"], ColwiseParallel), plan
    assert all(abs(f - 1 / tp) < 0.03 for f in report.param_fraction), report.param_fraction


@pytest.mark.parametrize("variant", ["first", "mix", "uneven", "constant"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_loops_that_are_not_one_body_per_head_keep_the_mixer_whole(variant, sequence_parallel):
    """Default-deny: every iteration reading head 0, a head mixed with its neighbour, an iteration
    that differs from the others (a rank's local head 0 is not global head 0), or a loop count no
    attribute gives (a rank would loop over heads it does not hold): the mixer stays whole, and the
    plan exact."""
    plan, report = _run(HeadLoopLM(variant), 2, sequence_parallel)
    assert not isinstance(plan.get("layers.*.mixer.in_proj"), ColwiseParallel), plan
    assert not isinstance(plan.get("layers.*.mixer.out_proj"), RowwiseParallel), plan
    assert max(report.param_fraction) > 0.6, report.param_fraction
