"""Models without a stack of repeated layers: one block, a block run in a loop, one decoder layer.

Synthesis traces the whole model when no container holds two or more layers of one structure. The
plans must shard the block's Linears and verify (logits and every gradient within 1e-5). Under
sequence parallelism a stream that starts replicated (a Linear kept whole between the embedding
and the block) has no layer entry to slice it at: the stream stays replicated, and the plan must
still verify.
"""

from __future__ import annotations

import warnings

import pytest
import torch
import torch.nn.functional as F
import transformers
from synth_toy import verify_toy
from torch import nn

import autotp
from autotp.memory import param_bytes_per_rank
from autotp.verifier import VerificationError, call_model

VOCAB, DIM, HEADS, SEQ = 128, 64, 4, 11


class Attention(nn.Module):
    def __init__(self):
        super().__init__()
        self.heads = HEADS  # an attribute: divided by tp, the per-rank views keep the head size
        self.q, self.k, self.v, self.o = (nn.Linear(DIM, DIM, bias=False) for _ in range(4))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (m(x).view(b, t, self.heads, -1).transpose(1, 2) for m in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class Block(nn.Module):
    def __init__(self):
        super().__init__()
        self.n1, self.n2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn = Attention()
        self.fc, self.proj = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x):
        x = x + self.attn(self.n1(x))
        return x + self.proj(F.gelu(self.fc(self.n2(x))))


class OneBlock(nn.Module):
    """A block held as a plain attribute; ``table`` narrower than the block: projected up first."""

    def __init__(self, table: int = DIM, calls: int = 1):
        super().__init__()
        self.calls = calls
        self.embed = nn.Embedding(VOCAB, table)
        self.up = nn.Linear(table, DIM) if table != DIM else nn.Identity()
        self.block = Block()
        self.norm, self.out = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.up(self.embed(ids))
        for _ in range(self.calls):  # calls > 1: one block's weights shared across depth
            x = self.block(x)
        return {"logits": self.out(self.norm(x))}


def _tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _roles(model, sequence_parallel) -> dict[str, str]:
    records = autotp.explain(model, example_inputs=(_tokens(),), sequence_parallel=sequence_parallel, tp_size=2)
    return {r.key: r.role.value for r in records}


@pytest.mark.parametrize("sequence_parallel", [False, True])
@pytest.mark.parametrize("table,calls", [(DIM, 1), (32, 1), (DIM, 3), (32, 3)])
def test_a_model_without_a_layer_stack_is_sharded_and_exact(table, calls, sequence_parallel):
    torch.manual_seed(0)
    model = OneBlock(table, calls)
    plan = autotp.synthesize(model, example_inputs=(_tokens(),), sequence_parallel=sequence_parallel, tp_size=2,
                             verify=False)
    roles = _roles(model, sequence_parallel)
    assert {m: roles.get(m) for m in ("block.attn.q", "block.attn.k", "block.attn.v", "block.fc")} \
        == dict.fromkeys(("block.attn.q", "block.attn.k", "block.attn.v", "block.fc"), "column"), roles
    assert roles.get("block.attn.o") == roles.get("block.proj") == "row", roles
    verify_toy(model, plan, 2, inputs=(_tokens(),))


def test_a_replicated_stream_without_a_layer_stack_stays_replicated_under_sp():
    """The Linear between the embedding and the block is kept whole: with no layer entry to slice
    the stream at, the SP plan is the plain one (before: norms sharded on a plain stream, a crash)."""
    model = OneBlock(32, 1)
    plain = autotp.synthesize(model, example_inputs=(_tokens(),), tp_size=2, verify=False)
    sp = autotp.synthesize(model, example_inputs=(_tokens(),), sequence_parallel=True, tp_size=2, verify=False)
    assert {k: repr(v) for k, v in sp.items()} == {k: repr(v) for k, v in plain.items()}


@pytest.mark.parametrize("sequence_parallel", [False, True])
def test_one_layer_transformers_model(sequence_parallel):
    config = transformers.LlamaConfig(vocab_size=VOCAB, hidden_size=DIM, intermediate_size=2 * DIM,
                                      num_hidden_layers=1, num_attention_heads=HEADS, num_key_value_heads=2)
    torch.manual_seed(0)
    model = transformers.LlamaForCausalLM(config)
    plan = autotp.synthesize(model, sequence_parallel=sequence_parallel, tp_size=2, verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = autotp.verify(model, plan, tp_size=2)
    assert report.ok, str(report)
    per_rank, total = param_bytes_per_rank(model, plan, 2)
    assert per_rank / total < 0.51  # every Linear and the embedding sharded: 0.501 of the parameters


def test_output_without_logits_is_a_clear_error():
    class Hidden(nn.Module):
        def __init__(self):
            super().__init__()
            self.embed = nn.Embedding(VOCAB, DIM)

        def forward(self, ids):
            return {"hidden": self.embed(ids)}

    with pytest.raises(VerificationError, match="Hidden: its forward returned dict"):
        call_model(Hidden(), (_tokens(),))
