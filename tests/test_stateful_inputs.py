"""Model code that reads a tensor's value and hands its layers a state object (a kv cache).

The toy is written the way older encoder-style decoders are: the root checks the sequence lengths
with ``torch._check(lengths.max().item() <= t)`` (a value fake tensors cannot give;
export makes it a runtime check, as it does a model's own ``assert``) and creates a cache object that
every attention call appends its keys and values to; the layers are parallel ``nn.ModuleList``s
the root indexes (no block module around attention and MLP), and the attention splits heads with
``view(bs, -1, self.n_heads, self.head_dim)``, so ``n_heads`` must be divided by tp.

What must hold: the per-rank shape proof still runs (its capture forward retries with real values
when a value is read, and each module run alone gets its own copy of the cache), the cache's first
``cat`` onto an empty tensor keeps the head shard, so q, k and v are
sharded with ``n_heads`` divided, not kept whole; the three projections share their input's
gradient reduction with the head-count division on the same module, so the backward moves no more
than the forward; logits and every gradient match the unsharded model.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp.synth import synthesize
from autotp.synth.api import analyse_model
from autotp.verifier import verify

DIM, HEADS, FFN, VOCAB, SEQ = 64, 8, 128, 128, 8


class KeyValueStore:
    """Per-layer keys and values, grown by concatenation onto an empty tensor at first (a plain
    object, not a pytree): the first ``cat`` joins the sharded heads with a replicated nothing."""

    def __init__(self, layers: int):
        self.keys = [torch.tensor([]) for _ in range(layers)]
        self.values = [torch.tensor([]) for _ in range(layers)]

    def update(self, k, v, layer: int):
        k, v = torch.cat([self.keys[layer], k], dim=-2), torch.cat([self.values[layer], v], dim=-2)
        self.keys[layer], self.values[layer] = k, v
        return k, v


class CachedAttention(nn.Module):
    def __init__(self, layer: int):
        super().__init__()
        self.layer, self.n_heads, self.head_dim = layer, HEADS, DIM // HEADS
        self.q_lin, self.k_lin, self.v_lin = (nn.Linear(DIM, DIM) for _ in range(3))
        self.out_lin = nn.Linear(DIM, DIM)

    def forward(self, x, mask, cache=None):
        bs = x.size(0)
        q = self.q_lin(x).view(bs, -1, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_lin(x).view(bs, -1, self.n_heads, self.head_dim).transpose(1, 2)
        v = self.v_lin(x).view(bs, -1, self.n_heads, self.head_dim).transpose(1, 2)
        if cache is not None:
            k, v = cache.update(k, v, self.layer)
        y = F.scaled_dot_product_attention(q, k, v, attn_mask=mask[:, None, None, :])
        return self.out_lin(y.transpose(1, 2).reshape(bs, -1, self.n_heads * self.head_dim))


class ParallelListsDecoder(nn.Module):
    def __init__(self, layers: int = 2):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attentions = nn.ModuleList(CachedAttention(i) for i in range(layers))
        self.norms1 = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(layers))
        self.ffns = nn.ModuleList(nn.Sequential(nn.Linear(DIM, FFN), nn.GELU(), nn.Linear(FFN, DIM))
                                  for _ in range(layers))
        self.norms2 = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(layers))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        lengths = torch.full((tokens.size(0),), tokens.size(1))
        torch._check(lengths.max().item() <= tokens.size(1))  # a value read: no fake tensor can answer it
        mask = torch.arange(tokens.size(1))[None, :] < lengths[:, None]
        cache = KeyValueStore(len(self.attentions))
        x = self.embed(tokens)
        for attention, norm1, ffn, norm2 in zip(self.attentions, self.norms1, self.ffns, self.norms2):
            x = norm1(x + attention(x, mask, cache=cache))
            x = norm2(x + ffn(x))
        return self.head(x)


def tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(1))


@pytest.mark.parametrize(("tp", "sequence_parallel"), [(2, False), (4, False), (2, True), (4, True)],
                         ids=["tp2", "tp4", "sp2", "sp4"])
def test_value_read_and_cache_object_keep_the_attention_sharded(tp, sequence_parallel):
    """Would catch q/k/v kept whole (fraction), a wrong plan (diffs), and per-column reductions."""
    model = ParallelListsDecoder()
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        plan = synthesize(model, example_inputs=(tokens(),), tp_size=tp, sequence_parallel=sequence_parallel, verify=False)
        report = verify(model, plan, tp_size=tp, example_inputs=(tokens(),))
    assert report.ok, str(report)
    assert max(report.logits_max_abs_diff) <= 1e-4 and report.worst_grad[1] <= 1e-4
    # Norms, biases of rows and the embedding stay whole: a little above 1/tp.
    assert all(f <= 1 / tp + 0.1 for f in report.param_fraction), (report.param_fraction, plan)
    assert report.comm_volume_backward <= report.comm_volume, (report.collectives, report.collectives_backward)


def test_the_attention_divides_its_head_count_and_shares_its_input():
    roles = analyse_model(ParallelListsDecoder(), example_inputs=(tokens(),), tp_size=2).roles
    attention = roles["attentions.0"]
    assert attention.kind == "shard_counts" and attention.names == ("n_heads",)
    assert set(attention.shared_columns) == {"q_lin", "k_lin", "v_lin"}
    assert all(roles[f"attentions.0.{c}"].kind == "column" for c in ("q_lin", "k_lin", "v_lin"))
