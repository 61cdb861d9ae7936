"""One kv head (multi-query attention) found from the graph, without ``tp_size``.

Every tp is above one kv head, and the plan for it is the same at each: every rank holds the head
(:class:`~autotp.styles.ReplicatedKVColwise`, its copies' gradients summed) and the attention's
head counts are set per rank from the mesh when the plan is applied
(:class:`~autotp.styles.ShardCounts` with ``query_heads``). So ``synthesize`` without ``tp_size`` writes that plan, and
it verifies at tp 2 and 4; it used to keep the attention (and a tied embedding with it) whole
(0.51 of the parameters per rank at tp 4, where the plan written for tp 4 holds 0.34). Where the
one-head plan cannot be written without a tp (query heads that 2 does not divide), synthesis asks
for ``tp_size`` instead of replicating silently.
"""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F
from torch import nn

import autotp
from autotp import styles
from autotp.errors import MeshError
from autotp.verifier import verify

DIM, VOCAB, LAYERS = 64, 256, 2


class MultiQueryAttention(nn.Module):
    """Separate q, k, v as component builders make them: k and v one head, repeated to the queries."""

    def __init__(self, heads: int):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = heads, 1, DIM // heads
        self.w_q = nn.Linear(DIM, heads * self.head_dim, bias=False)
        self.w_k = nn.Linear(DIM, self.head_dim, bias=False)
        self.w_v = nn.Linear(DIM, self.head_dim, bias=False)
        self.w_out = nn.Linear(heads * self.head_dim, DIM, bias=False)

    def forward(self, x):
        b, t, _ = x.shape
        q = self.w_q(x).view(b, t, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.w_k(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        v = self.w_v(x).view(b, t, self.n_kv_heads, self.head_dim).transpose(1, 2)
        rep = self.n_heads // self.n_kv_heads
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.w_out(y.transpose(1, 2).reshape(b, t, -1))


class FeedForward(nn.Module):
    def __init__(self):
        super().__init__()
        self.w1, self.w3, self.w2 = nn.Linear(DIM, 2 * DIM, bias=False), nn.Linear(DIM, 2 * DIM, bias=False), \
            nn.Linear(2 * DIM, DIM, bias=False)

    def forward(self, x):
        return self.w2(F.silu(self.w1(x)) * self.w3(x))


class Block(nn.Module):
    def __init__(self, heads: int):
        super().__init__()
        self.attention_norm, self.attention = nn.RMSNorm(DIM), MultiQueryAttention(heads)
        self.feed_forward_norm, self.feed_forward = nn.RMSNorm(DIM), FeedForward()

    def forward(self, x):
        x = x + self.attention(self.attention_norm(x))
        return x + self.feed_forward(self.feed_forward_norm(x))


class TiedMQALM(nn.Module):
    """Embedding and output projection share one weight."""

    def __init__(self, heads: int = 4):
        super().__init__()
        self.embeddings = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(Block(heads) for _ in range(LAYERS))
        self.norm, self.lm_head = nn.RMSNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)
        self.lm_head.weight = self.embeddings.weight

    def forward(self, ids):
        x = self.embeddings(ids)
        for block in self.blocks:
            x = block(x)
        return self.lm_head(self.norm(x))


def _tokens() -> torch.Tensor:
    return torch.randint(0, VOCAB, (2, 12), generator=torch.Generator().manual_seed(3))


def _bound(model: nn.Module, tp_size: int) -> float:
    """Every Linear and the embedding sharded, norms whole, k and v one whole head on each rank."""
    whole = {id(p) for name, p in model.named_parameters() if "norm" in name or ".w_k." in name or ".w_v." in name}
    params = {id(p): p for p in model.parameters()}
    total = sum(p.numel() for p in params.values())
    split = sum(p.numel() for i, p in params.items() if i not in whole)
    return (total - split + split / tp_size) / total


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_one_kv_head_is_sharded_without_tp_size(sequence_parallel, tp_size):
    """Would catch: k/v of one head kept whole with the attention and the tied embedding when no
    tp_size is given. One plan, written without a tp, verifies at ``tp_size`` (logits and every
    gradient) with the attention sharded by query heads and about the bound per rank; the same
    as the plan written for that tp."""
    torch.manual_seed(0)
    model = TiedMQALM()
    plan = autotp.synthesize(model, example_inputs=(_tokens(),), sequence_parallel=sequence_parallel, verify=False)
    assert isinstance(plan["blocks.*.attention.w_k"], styles.ReplicatedKVColwise), plan
    assert "blocks.*.attention.w_q" in plan and "embeddings" in plan, plan
    report = verify(model, plan, tp_size=tp_size, inputs=(_tokens(),))
    assert report.ok, str(report)
    assert max(report.param_fraction) <= _bound(model, tp_size) + 0.01, (report.param_fraction, plan)
    at_tp = autotp.synthesize(model, example_inputs=(_tokens(),), sequence_parallel=sequence_parallel,
                              tp_size=tp_size, verify=False)
    assert {k: repr(v) for k, v in plan.items()} == {k: repr(v) for k, v in at_tp.items()}


def test_one_kv_head_without_tp_size_asks_for_it_where_two_does_not_divide_the_heads():
    """Three query heads over one kv head: only tp 3 splits them, so without tp_size synthesis
    says so, naming the module and asking for tp_size, instead of replicating silently."""
    torch.manual_seed(0)
    model = TiedMQALM(heads=3)
    with pytest.raises(MeshError, match=r"blocks\.\d\.attention.*one head.*pass tp_size=") as caught:
        autotp.synthesize(model, example_inputs=(_tokens(),), verify=False)
    assert "3 query heads" in str(caught.value)
