"""Head-split idioms and per-head parameters that once gave plans that ran and computed wrong numbers.

Each toy attention below is plain PyTorch, named after the pattern it stands for. Synthesis must
either shard its projections and verify at tp 2 and 4 (logits and every gradient against the
unsharded model, 1e-5), or refuse with an ``AutoTPError``; it must never hand out a plan that runs
and differs. Each test's docstring says which bug it would catch.
"""

import warnings

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel

from autotp import styles
from autotp.check import check_plan
from autotp.synth.flow import Flow
from autotp.synth.shard import Shard
from autotp.synth.graph import Ref, add_node
from autotp.synth.ops import Break, Out, apply_rule
from autotp.synth.params import param_dim, stray_param_reads
from autotp.synth import synthesize
from autotp.verifier import verify
from fuzz_blocks import BlockSpec, SpecLM, tokens

SPEC = BlockSpec(heads=4, head_dim=8, dim=32)


class CountViewAttention(nn.Module):
    """Fixed head count, inferred head size: ``q.view(b, t, self.n_heads, -1)``."""

    def __init__(self, spec):
        super().__init__()
        self.n_heads = spec.heads
        width = spec.heads * spec.head_dim
        self.q, self.k, self.v = (nn.Linear(spec.dim, width) for _ in range(3))
        self.out = nn.Linear(width, spec.dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class ChunkReshapeAttention(nn.Module):
    """One fused projection cut by ``chunk(3)``, each part reshaped with a fixed head count."""

    def __init__(self, spec):
        super().__init__()
        self.heads = spec.heads
        width = spec.heads * spec.head_dim
        self.to_qkv, self.to_out = nn.Linear(spec.dim, 3 * width, bias=False), nn.Linear(width, spec.dim)

    def forward(self, x):
        b, n, _ = x.shape
        q, k, v = (z.reshape(b, n, self.heads, -1).transpose(1, 2) for z in self.to_qkv(x).chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.to_out(y.transpose(1, 2).reshape(b, n, -1))


class FixedWidthMergeAttention(nn.Module):
    """Heads split from a fixed size, merged back with a fixed width: ``reshape(b, t, self.inner)``."""

    def __init__(self, spec):
        super().__init__()
        self.head_dim, self.inner = spec.head_dim, spec.heads * spec.head_dim
        self.q, self.k, self.v = (nn.Linear(spec.dim, self.inner) for _ in range(3))
        self.out = nn.Linear(self.inner, spec.dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, self.inner))


class SharedLambdaAttention(CountViewAttention):
    """Two differential-attention style outputs mixed by a scalar from learned vectors over
    ``head_dim`` that every head reads (``lambda_q``, ``lambda_k``: plain parameters)."""

    def __init__(self, spec):
        super().__init__(spec)
        self.lambda_q = nn.Parameter(0.3 * torch.randn(spec.head_dim))
        self.lambda_k = nn.Parameter(0.3 * torch.randn(spec.head_dim))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, self.n_heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        lam = torch.exp(torch.sum(self.lambda_q * self.lambda_k))
        causal = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        y = causal - lam * F.scaled_dot_product_attention(q, k, v) * 0.5
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class SinkScaleAttention(nn.Module):
    """Per-head parameters of the attention module itself: a softmax sink logit (joined to the
    scores by ``cat``) and an output scale, each of size heads."""

    def __init__(self, spec):
        super().__init__()
        self.head_dim = spec.head_dim
        width = spec.heads * spec.head_dim
        self.q, self.k, self.v = (nn.Linear(spec.dim, width) for _ in range(3))
        self.out = nn.Linear(width, spec.dim)
        self.sink = nn.Parameter(torch.randn(spec.heads))
        self.scale = nn.Parameter(1 + 0.3 * torch.randn(spec.heads))

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, self.head_dim).transpose(1, 2) for p in (self.q, self.k, self.v))
        scores = (q @ k.transpose(-1, -2)) / self.head_dim ** 0.5
        scores = scores.masked_fill(~torch.ones(t, t, dtype=torch.bool).tril(), float("-inf"))
        sink = self.sink.reshape(1, -1, 1, 1).expand(b, -1, t, 1)
        probs = torch.cat([scores, sink], dim=-1).softmax(-1)[..., :t]
        y = (probs @ v) * self.scale.view(1, -1, 1, 1)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class CastWeightNorm(nn.Module):
    """RMSNorm over the whole width whose weight is cast to the input's dtype first
    (``self.weight.type_as(x)``), as olmo-core writes it."""

    def __init__(self, width):
        super().__init__()
        self.weight = nn.Parameter(torch.rand(width) + 0.5)

    def forward(self, x):
        x = x * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + 1e-6)
        return x * self.weight.type_as(x)


class WidthNormAttention(CountViewAttention):
    """OLMo2-style QK-norm: q and k normalised over their whole width, before the head split."""

    def __init__(self, spec):
        super().__init__(spec)
        self.q_norm, self.k_norm = CastWeightNorm(spec.heads * spec.head_dim), CastWeightNorm(spec.heads * spec.head_dim)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = self.q_norm(self.q(x)), self.k_norm(self.k(x)), self.v(x)
        q, k, v = (z.view(b, t, self.n_heads, -1).transpose(1, 2) for z in (q, k, v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


def _synthesize_and_verify(attention, tp_size):
    model = SpecLM(SPEC, attention)
    plan = synthesize(model, example_inputs=(tokens(),), tp_size=tp_size, verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp_size, example_inputs=(tokens(),))
    assert report.ok, str(report)
    return model, plan


def _sharded_projections(plan, *names):
    return all(f"blocks.*.attn.{n}" in plan for n in names)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_fixed_head_count_with_inferred_size_gets_per_rank_counts(tp_size):
    """Would catch the shape proof skipping a module that runs at per-rank widths: each rank would
    view its half-width shard as all the heads at half the size (logits off by ~0.1)."""
    _, plan = _synthesize_and_verify(CountViewAttention, tp_size)
    assert _sharded_projections(plan, "q", "k", "v", "out")
    assert plan["blocks.*.attn"].names == ("n_heads",)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_chunk_then_reshape_with_fixed_count_is_packed_and_counted(tp_size):
    """Would catch a fused projection cut by ``chunk`` escaping the shape proof (chunk needs no
    attribute, the reshape after it does)."""
    _, plan = _synthesize_and_verify(ChunkReshapeAttention, tp_size)
    assert _sharded_projections(plan, "to_qkv", "to_out")
    assert plan["blocks.*.attn"].names == ("heads",)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_merge_back_to_a_fixed_width_divides_that_width(tp_size):
    """Would catch the width attribute of a merge-back reshape not being a candidate (the module
    then fails at per-rank widths and the projections stay whole)."""
    _, plan = _synthesize_and_verify(FixedWidthMergeAttention, tp_size)
    assert _sharded_projections(plan, "q", "k", "v", "out")
    assert plan["blocks.*.attn"].names == ("inner",)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_lambda_vectors_read_by_every_head_get_their_gradient_reduced(tp_size):
    """Would catch parameters of the attention module itself left without a style: forward exact,
    their gradients only the rank's own heads' share."""
    _, plan = _synthesize_and_verify(SharedLambdaAttention, tp_size)
    style = plan["blocks.*.attn"]
    assert isinstance(style, styles.HeadParams)
    assert style.reduce == ("lambda_q", "lambda_k") and style.counts == ("n_heads",)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_per_head_sink_and_scale_are_sharded_with_the_heads(tp_size):
    """Would catch a per-head parameter kept whole next to sharded heads (a shape error or heads
    read against another rank's entries) or one replicated with a partial gradient."""
    _, plan = _synthesize_and_verify(SinkScaleAttention, tp_size)
    assert _sharded_projections(plan, "q", "k", "v", "out")
    assert plan["blocks.*.attn"].shard_dims == {"sink": 0, "scale": 0}


class SizeFromInputAttention(CountViewAttention):
    """Head size from the replicated input's width (``c // self.n_heads``): only with the input
    seen at its per-rank width (and ``n_heads`` divided) are the per-rank shapes right."""

    def forward(self, x):
        b, t, c = x.shape
        q, k, v = (p(x).view(b, t, self.n_heads, c // self.n_heads).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, c))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_sizes_from_the_input_width_are_read_per_rank_by_every_projection(tp_size):
    """Would catch the input's width read globally by the code (a view error, or heads of the wrong
    size) or the stand-in reaching one of the three projections (NaN)."""
    _, plan = _synthesize_and_verify(SizeFromInputAttention, tp_size)
    assert _sharded_projections(plan, "q", "k", "v", "out")
    style = plan["blocks.*.attn"]
    assert isinstance(style, styles.LocalWidthInputs) and style.readers == ("k", "q", "v")
    assert style.style.names == ("n_heads",)


@pytest.mark.parametrize("attention", [CountViewAttention, SharedLambdaAttention, SinkScaleAttention],
                         ids=["count_view", "lambda", "sink_scale"])
def test_checker_accepts_the_synthesized_plans(attention):
    model = SpecLM(SPEC, attention)
    plan = synthesize(model, example_inputs=(tokens(),), tp_size=2, verify=False)
    assert check_plan(model, plan, tp_size=2, example_inputs=(tokens(),)) == []


NAIVE = {f"blocks.*.attn.{n}": ColwiseParallel() for n in ("q", "k", "v")} | {"blocks.*.attn.out": RowwiseParallel()}


@pytest.mark.parametrize("attention, kinds", [
    (CountViewAttention, {"reshape_heads"}),
    (SharedLambdaAttention, {"reshape_heads", "partial_grad"}),
    (SinkScaleAttention, {"head_params_style"}),
], ids=["count_view", "lambda", "sink_scale"])
def test_checker_flags_plans_that_shard_the_projections_only(attention, kinds):
    """Would catch the checker missing a per-rank reshape into other heads, or a parameter of the
    attention module left with a partial gradient or unsharded next to sharded heads."""
    model = SpecLM(SPEC, attention)
    findings = check_plan(model, NAIVE, tp_size=2, example_inputs=(tokens(),))
    assert {f.kind for f in findings} == kinds, [str(f) for f in findings]
    assert all(f.module == "blocks.0.attn" for f in findings)


def test_einsum_keeps_a_shard_on_an_index_that_reaches_the_output():
    g = nx.DiGraph()
    for name, shape in (("q", (2, 11, 4, 8)), ("k", (2, 11, 4, 8))):
        add_node(g, name, "placeholder", kind="input", shape=shape)
    add_node(g, "s", "einsum", ("bqhd,bkhd->bhqk", [Ref("q"), Ref("k")]), shape=(2, 4, 11, 11))
    flow = Flow(g)
    assert apply_rule(g, "s", {"q": 2, "k": 2}, flow) == Out(1)
    assert isinstance(apply_rule(g, "s", {"q": 3, "k": 3}, flow), Break)  # head_dim is contracted
    assert isinstance(apply_rule(g, "s", {"q": 2}, flow), Break)  # k replicated on the heads


def test_a_per_head_parameter_is_found_through_its_view_and_expand():
    g = nx.DiGraph()
    add_node(g, "p", "placeholder", kind="param", param="attn.sink", shape=(4,))
    add_node(g, "v", "reshape", (Ref("p"), [1, -1, 1, 1]), shape=(1, 4, 1, 1))
    add_node(g, "e", "expand", (Ref("v"), [2, -1, 11, 1]), shape=(2, 4, 11, 1))
    assert param_dim(g, "e", 1) == ("p", 0)
    assert param_dim(g, "e", 2) is None  # that dim is a broadcast, not the parameter's
    # Where the expand meets the heads, the parameter is sharded; a second reader that reads it
    # whole (outside the sharded region) refuses the shard that met it.
    add_node(g, "x", "placeholder", kind="input", shape=(2, 4, 11, 1))
    add_node(g, "m", "mul", (Ref("x"), Ref("e")), shape=(2, 4, 11, 1))
    flow = Flow(g)
    flow.state["m"] = Shard(1, frozenset({"q_proj"}), True, "x", None, None)
    flow.param_uses = {"p": {("e", "m")}}
    assert stray_param_reads(flow) == {}
    add_node(g, "other", "mul", (Ref("p"), 2.0), shape=(4,))
    assert "reads it whole" in stray_param_reads(flow)["q_proj"]


@pytest.mark.parametrize("name", ["deepseek_v2", "deepseek_v3"])
def test_checker_accepts_transformers_mla_plans(name):
    """Would catch the checker flagging MLA attention, which writes k/v heads into a fresh
    ``new_empty`` tensor and broadcasts one shared rotary key to every head (both verify)."""
    from autotp.hf_plans import hf_plan
    from autotp.models import build_model

    model = build_model(name, tiny=True, tp=2, device="cpu")
    assert check_plan(model, hf_plan(model), tp_size=2) == []


@pytest.mark.parametrize("tp_size", [2, 4])
def test_width_norm_with_a_cast_weight_reduces_its_statistic(tp_size):
    """Would catch the norm's weight, once followed through ``type_as``, being sharded with the
    heads (HeadParams) instead of the width norm's style: the mean over the sharded width would then
    be a per-rank mean, and the logits wrong."""
    _, plan = _synthesize_and_verify(WidthNormAttention, tp_size)
    assert _sharded_projections(plan, "q", "k", "v", "out")
    assert type(plan["blocks.*.attn.q_norm"]).__name__ == "WidthShardedNorm"
