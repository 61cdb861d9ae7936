"""A latent attention's whole front runs its backward on partial gradients, reduced once at its norm.

The toy (``latent_toy.py``) reads its block input through low-rank query and key-value
down-projections kept whole, a norm on each latent, and a rope key cut from the key-value latent
and expanded to every head; only the up-projections are sharded. Each up-projection's input
gradient and the rope key's were all-reduced apart: 32 + 32 + 16 features per token where the
block input has 64, so the backward moved more bytes than the forward (1.10 times under plain TP,
1.26 under SP). Where the latents are narrower than the block input, those reductions are the
cheaper cut and stay.

Every test verifies logits and every gradient against the unsharded model.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp import styles
from autotp.synth import synthesize
from autotp.synth import pipeline
from autotp.synth.fronts import front
from autotp.synth.graph import build_graph
from autotp.synth.stages import post_passes
from autotp.synth.trace import trace
from autotp.verifier import verify
from latent_toy import LatentModel
from synth_toy import DIM, VOCAB, GPTBlock, example_tokens

FRONT = ("attn.q_down", "attn.q_norm", "attn.kv_down", "attn.kv_norm")


def _verified(model, plan, tp):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp, example_inputs=(example_tokens(),))
    assert report.ok, str(report)
    return report


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_wide_latents_reduce_the_block_input_once(tp, sequence_parallel):
    """Would catch one all-reduce per up-projection input and rope key (backward bytes above the
    forward's), or a partial gradient left unreduced (a weight or input gradient differs)."""
    model = LatentModel(q_rank=32, kv_rank=32)
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=sequence_parallel,
                      verify=False)
    report = _verified(model, plan, tp)
    assert report.comm_volume_backward <= report.comm_volume, (report.comm_volume, report.comm_volume_backward)
    for name in FRONT:
        assert isinstance(plan.get(f"layers.*.{name}"), styles.ReplicatedWithGradAllReduce), plan.get(f"layers.*.{name}")
    assert plan["layers.*.attn"].input_grad == "partial"
    norm = plan["layers.*.attn_norm"]  # SP: its all-gather reduce-scatters; plain TP: its output's gradient reduced
    assert norm.output_grad == "partial" and norm.outputs == ("gather" if sequence_parallel else None), norm
    # the front's modules stay replicated, as before: 0.542 of the parameters per rank at tp=2, 0.312 at tp=4
    assert max(report.param_fraction) < {2: 0.55, 4: 0.32}[tp], report.param_fraction


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_narrow_latents_keep_their_own_reductions(tp, sequence_parallel):
    """Latents of 8 + 8 + 16 features under a 64-wide input: reducing them (twice 32 per token) is
    no dearer than the block input (plain: twice 64; SP: 64). Would catch the front taken where it
    moves more bytes, or the latent reductions dropped without it."""
    model = LatentModel(q_rank=8, kv_rank=8)
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=sequence_parallel,
                      verify=False)
    assert not any(isinstance(plan.get(f"layers.*.{name}"), styles.ReplicatedWithGradAllReduce) for name in FRONT)
    assert plan["layers.*.attn.kv_down"].reduce_grad_features == ((8, 24),)
    report = _verified(model, plan, tp)
    assert report.comm_volume_backward <= report.comm_volume, (report.comm_volume, report.comm_volume_backward)


def test_front_ends_in_the_columns_and_the_rope_span():
    """The front of the attention's norm: both down-projections and latent norms, the two
    up-projections as its columns, and the rope key's span as the one place it meets the heads."""
    model, inputs = LatentModel(), (example_tokens(),)
    program, groups = trace(model, inputs)
    analysis = pipeline.constraint_fixpoint(build_graph(program), groups, model, inputs, 2)
    passes = post_passes()
    for step in passes[:[p.__name__ for p in passes].index("whole_fronts")]:
        analysis = step(analysis)
    g = analysis.graph
    start = next(n for n, d in g.nodes(data=True) if d["stack"] and d["stack"][-1] == "layers.0.attn_norm"
                 and any(g.nodes[s]["module"] == "layers.0.attn.q_down" for s in g.successors(n)))
    found = front(g, analysis.flow, analysis.roles, start)
    assert found is not None
    assert found.columns == {"layers.0.attn.q_up", "layers.0.attn.kv_up"}
    assert found.owners == {f"layers.0.{name}" for name in FRONT}
    assert list(found.spans.values()) == [2 * 11 * 16]  # batch x positions x rope width


class _DenseHead(nn.Module):
    """A prediction head kept whole before a tied output projection: dense -> gelu -> LayerNorm."""

    def __init__(self, width: int):
        super().__init__()
        self.dense, self.norm = nn.Linear(DIM, width), nn.LayerNorm(width)

    def forward(self, x):
        return self.norm(F.gelu(self.dense(x)))


class _DenseHeadLM(nn.Module):
    """nanoGPT blocks and final norm, then :class:`_DenseHead` and an output Linear (tied to the
    embedding where as wide): under SP the head gathers the stream at its entry, with no norm of its
    own before it to do so."""

    def __init__(self, width: int = DIM, scaled: bool = False):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList(GPTBlock() for _ in range(2))
        self.norm, self.head = nn.LayerNorm(DIM), _DenseHead(width)
        self.output = nn.Linear(width, VOCAB, bias=False)
        if width == DIM:
            self.output.weight = self.embed.weight
        # a parameter of the model itself read between the head and the output (no plan key names it)
        self.scale = nn.Parameter(torch.full((width,), 1.5)) if scaled else None

    def forward(self, tokens):
        h = self.embed(tokens)
        for block in self.blocks:
            h = block(h)
        features = self.head(self.norm(h))
        return self.output(features * self.scale if self.scale is not None else features)


@pytest.mark.parametrize("tp", [2, 4])
def test_head_gathered_at_entry_reduce_scatters_once(tp):
    """Would catch the output projection's input gradient all-reduced at full (b, t, d) size where
    one reduce-scatter to the sequence shard at the head's entry does (backward bytes above the
    forward's), or a partial gradient left unreduced (the head's or an embedding's gradient differs)."""
    model = _DenseHeadLM()
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=True, verify=False)
    report = _verified(model, plan, tp)
    assert report.comm_volume_backward <= report.comm_volume, (report.comm_volume, report.comm_volume_backward)
    assert getattr(plan["output"], "input_grad", None) == "partial", plan["output"]
    assert plan["head.dense"].partial_grad_inputs and plan["head.dense"].reduce == ("bias", "weight"), plan["head.dense"]
    assert isinstance(plan["head.norm"], styles.ReplicatedWithGradAllReduce), plan["head.norm"]


@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("model", [_DenseHeadLM(scaled=True), _DenseHeadLM(width=DIM // 4)], ids=["root_param", "narrow"])
def test_head_gathered_at_entry_keeps_its_reductions(tp, model):
    """A parameter of the model itself read in the head's front (a scale) would need a plan key for
    the root, which none names; a head narrower than the stream is cheaper reduced at the output
    projection's input. Would catch the rule taken there (a plan key '' that matches no module, or
    more bytes)."""
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=True, verify=False)
    assert getattr(plan["output"], "input_grad", None) != "partial", plan["output"]
    assert getattr(plan["head.dense"], "inputs", None) == "gather", plan["head.dense"]
    assert "head.norm" not in plan
    _verified(model, plan, tp)
