"""Sequence parallel on modules of the residual stream that are not plain norms.

- A module that takes two stream tensors and combines them with parameters of its own (a scaled
  residual: ``(h + b1) * s1 + (r + b2) * s2``). torch's ``SequenceParallel`` keeps only its first
  input and drops the second, so the forward raised "missing 1 required positional argument".
  Both inputs arrive as sequence-sharded DTensors: only its parameters need to become replicated
  DTensors.
- A mixer written on raw parameters (``einsum`` on ``nn.Parameter`` weights) that cannot be
  sharded, with a child module of its own (a norm). It is a weight product, not a norm: it must be
  gathered whole at entry and its output sliced back. Read as a norm it got ``SequenceParallel``,
  which registers a child's parameter under a dotted name (``KeyError``).

Each model is verified on logits and every gradient against the unsharded model at tp 2 and 4
under sequence parallel (and plain, as a control), with its parameter fraction asserted.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import SequenceParallel

from autotp import styles
from autotp.synth import synthesize
from synth_toy import DIM, MLP, VOCAB, CausalSelfAttention, GPTBlock, example_tokens, verify_toy


def _dtensor_params(style) -> bool:
    """A module's own parameters kept replicated DTensors during its forward."""
    return isinstance(style, styles.ReplicatedWithGradAllReduce) and style.dtensor


class ScaledResidual(nn.Module):
    """Adds a branch's output to the residual, each with a learned scale and bias."""

    def __init__(self):
        super().__init__()
        self.branch_scale, self.branch_bias = nn.Parameter(1 + 0.1 * torch.randn(DIM)), nn.Parameter(0.1 * torch.randn(DIM))
        self.residual_scale, self.residual_bias = nn.Parameter(1 + 0.1 * torch.randn(DIM)), nn.Parameter(0.1 * torch.randn(DIM))

    def forward(self, branch, residual):
        return (branch + self.branch_bias) * self.branch_scale + (residual + self.residual_bias) * self.residual_scale


class RawCumulativeMixer(nn.Module):
    """``einsum`` on raw weights, a cumulative sum over the features (no shard survives it), and a
    child norm: kept whole."""

    def __init__(self):
        super().__init__()
        self.w_in = nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5)
        self.w_out = nn.Parameter(torch.randn(DIM, DIM) / DIM ** 0.5)
        self.norm = nn.LayerNorm(DIM)

    def forward(self, x):
        y = torch.einsum("btd,de->bte", x, self.w_in)
        y = self.norm(y.cumsum(-1) / DIM)
        return torch.einsum("bte,ed->btd", F.gelu(y), self.w_out)


class Block(nn.Module):
    def __init__(self, mixer: str):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.mixer = CausalSelfAttention() if mixer == "attention" else RawCumulativeMixer()
        self.mlp = MLP()
        self.res_1, self.res_2 = ScaledResidual(), ScaledResidual()

    def forward(self, x):
        x = self.res_1(self.mixer(self.ln_1(x)), x)
        return self.res_2(self.mlp(self.ln_2(x)), x)


class Stack(nn.Module):
    """Embedding, two layers made by ``layer``, final norm and head."""

    def __init__(self, layer):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(layer() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


def Model(mixer: str) -> Stack:  # noqa: N802 (a model constructor)
    return Stack(lambda: Block(mixer))


def _whole_fraction(model: nn.Module, tp: int) -> float:
    """The per-rank fraction with every Linear, the embedding and the head sharded and the rest
    (norms, scales, the raw-weight mixer) whole."""
    total = sum(p.numel() for p in model.parameters())
    sharded = sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding)))
    return (total - sharded + sharded / tp) / total


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("mixer", ["attention", "raw_cumulative"])
def test_stream_modules_are_exact_under_sequence_parallel(mixer, tp, sequence_parallel):
    model = Model(mixer)
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=sequence_parallel,
                      verify=False)
    report = verify_toy(model, plan, tp)
    bound = _whole_fraction(model, tp)
    assert all(f <= bound + 0.01 for f in report.param_fraction), (report.param_fraction, bound, sorted(plan))
    if sequence_parallel:
        # The two-input residual module holds only parameters of its own: replicated DTensors, its
        # inputs left as the sequence-sharded DTensors they arrive as.
        assert _dtensor_params(plan["layers.*.res_1"]), plan["layers.*.res_1"]
        if mixer == "raw_cumulative":
            # A weight product, not a norm: gathered whole at entry, not run as SequenceParallel.
            assert not isinstance(plan["layers.*.mixer"], SequenceParallel), plan["layers.*.mixer"]


class RootPositionTable(nn.Module):
    """Token embeddings plus a sinusoidal position table that is no module (a buffer indexed in the
    model's own code, as CTRL does), scaled in place: the stream cannot be a sequence-sharded
    DTensor before the first block, since the plain table meets it at the root. ``learned``: the
    table is a parameter of the model itself, sliced (``self.pos[:, :t]``), which no style wraps."""

    def __init__(self, learned: bool = False):
        super().__init__()
        self.learned = learned
        self.pos = nn.Parameter(0.02 * torch.randn(1, 64, DIM)) if learned else None
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        position = torch.arange(64.0)[:, None] / 10000 ** (torch.arange(0, DIM, 2.0) / DIM)
        self.register_buffer("table", torch.cat([position.sin(), position.cos()], dim=-1), persistent=False)
        self.layers = nn.ModuleList(Block("attention") for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        x *= DIM ** 0.5
        if self.learned:
            x = x + self.pos[:, : ids.shape[1]]
        else:
            x = x + self.table[torch.arange(ids.shape[1], device=ids.device)]
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x))


@pytest.mark.parametrize("learned", [False, True], ids=["buffer", "own_parameter"])
@pytest.mark.parametrize("tp", [2, 4])
def test_stream_starts_at_the_first_block_when_the_root_adds_a_plain_table(tp, learned):
    """Would catch the embedding handing out a sequence-sharded DTensor that the root's plain
    position table then meets (the forward raised "got mixed torch.Tensor and DTensor"), or the
    block slicing a stream that is already sharded (logits off)."""
    model = RootPositionTable(learned)
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=True, verify=False)
    assert getattr(plan["layers.*"], "inputs", None) == "slice", plan.get("layers.*")
    report = verify_toy(model, plan, tp)
    assert all(f <= _whole_fraction(model, tp) + 0.01 for f in report.param_fraction), report.param_fraction
    # Every block after the first receives the stream sharded: the blocks' norms still gather
    # (one all-gather per branch) and the rows reduce-scatter.
    assert report.collectives.get("reduce_scatter_tensor", 0) >= 4, report.collectives


class StackedExperts(nn.Module):
    """Every expert on every routed copy of the tokens, by ``bmm`` on 3-D weights (kept whole)."""

    def __init__(self, experts: int):
        super().__init__()
        self.up = nn.Parameter(torch.randn(experts, DIM, 2 * DIM) / DIM ** 0.5)
        self.down = nn.Parameter(torch.randn(experts, 2 * DIM, DIM) / (2 * DIM) ** 0.5)

    def forward(self, routed):
        hidden = torch.bmm(routed.view(self.up.shape[0], -1, DIM), self.up)
        return torch.bmm(F.gelu(hidden), self.down)


class TopKRouter(nn.Linear):
    """Sigmoid routing weights of the top-k experts, zero elsewhere: (tokens, experts)."""

    def __init__(self, experts: int, top_k: int):
        super().__init__(DIM, experts, bias=False)
        self.top_k = top_k

    def forward(self, x):
        logits = super().forward(x)
        top, index = logits.topk(self.top_k, dim=-1)
        return torch.zeros_like(logits).scatter(1, index, torch.sigmoid(top))


class RoutedBlock(nn.Module):
    """A MoE block whose router is kept whole (top-k) and whose own code scales a repeat of its
    input by the routing weights, with stacked experts run whole by ``bmm`` in a child module and a
    shared expert whose Linears are sharded."""

    def __init__(self, experts: int = 4, top_k: int = 2):
        super().__init__()
        self.router = TopKRouter(experts, top_k)
        self.experts = StackedExperts(experts)
        self.shared = MLP()

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        scores = self.router(flat)  # (tokens, experts)
        routed = flat.repeat(scores.shape[1], 1) * scores.transpose(0, 1).reshape(-1, 1)
        out = self.experts(routed).sum(dim=0)
        return (self.shared(flat) + out).view(b, t, d)


def RoutedBlockModel() -> Stack:  # noqa: N802 (a model constructor)
    return Stack(lambda: RoutedLayer())


class RoutedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.moe = CausalSelfAttention(), RoutedBlock()

    def forward(self, x):
        x = x + self.attn(self.ln_1(x))
        return x + self.moe(self.ln_2(x))


@pytest.mark.parametrize("tp", [2, 4])
def test_block_scaling_by_a_whole_router_is_gathered_under_sequence_parallel(tp):
    """Would catch the block's own ``repeat(...) * scores`` meeting the router's plain output with
    a sequence-sharded DTensor (the forward raised "got mixed torch.Tensor and DTensor"): the
    block is gathered whole at entry and its output sliced back; its shared expert stays sharded."""
    model = RoutedBlockModel()
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=True, verify=False)
    gathered = plan.get("layers.*.moe")
    assert getattr(gathered, "inputs", None) == "gather" or \
        getattr(gathered, "desired_input_layouts", None) == (Replicate(),), gathered
    assert "layers.*.moe.shared.c_fc" in plan, sorted(plan)
    verify_toy(model, plan, tp)


class MaskedMixer(nn.Module):
    """Zeroes the padded positions of its input with the model's padding mask, then a per-channel
    scale and an MLP (the scale is the mixer's own parameter, so the mixer keeps a style of its own)."""

    def __init__(self):
        super().__init__()
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(4 * DIM))
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, h, mask):
        h = h * mask[:, :, None].to(h.dtype)
        return self.down(F.gelu(self.up(h)) * self.scale)


class MaskedLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.mixer, self.mlp = MaskedMixer(), MLP()

    def forward(self, x, mask):
        x = x + self.mixer(self.ln_1(x), mask)
        return x + self.mlp(self.ln_2(x))


class MaskedModel(nn.Module):
    """Two layers that take the padding mask beside the stream (``layer``: builds one)."""

    def __init__(self, layer=MaskedLayer):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(layer() for _ in range(2))
        self.norm = nn.LayerNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids, mask):
        x = self.embed(ids)
        for layer in self.layers:
            x = layer(x, mask)
        return self.head(self.norm(x))


@pytest.mark.parametrize("tp", [2, 4])
def test_module_masking_the_stream_reads_it_gathered(tp):
    """Would catch the mixer's ``h * mask`` meeting a sequence-sharded DTensor with the plain
    padding mask (the forward raised "got mixed torch.Tensor and DTensor"): the norm before it
    all-gathers to a plain tensor, the mixer keeps its own sharded parameter, its row reduce-scatters."""
    from autotp.verifier import verify

    tokens = example_tokens()
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0
    model = MaskedModel()
    plan = synthesize(model, example_inputs=(tokens, mask), tp_size=tp, sequence_parallel=True, verify=False)
    norm = plan["layers.*.ln_1"]
    assert isinstance(norm, styles.Boundary) and norm.outputs == "gather" and norm.local_outputs, norm
    assert isinstance(plan["layers.*.mixer"], styles.HeadParams), plan.get("layers.*.mixer")
    report = verify(model, plan, tp_size=tp, example_inputs=(tokens, mask))
    assert report.ok, str(report)
    assert all(f <= _whole_fraction(model, tp) + 0.01 for f in report.param_fraction), report.param_fraction


def test_a_whole_token_table_starts_the_stream_sliced():
    """A token table whose rows tp does not divide (258 at tp=4) stays whole; under SP its output
    still starts the sequence-sharded stream, sliced to this rank's positions. Would catch the
    plain output the first SequenceParallel norm would read as this rank's shard (a sequence tp
    times too long: a shape error, or wrong logits where nothing checks the length)."""
    from synth_toy import TitanLlama

    torch.manual_seed(0)
    model = TitanLlama()
    model.tok_embeddings = nn.Embedding(VOCAB + 2, DIM)
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=4, sequence_parallel=True, verify=False)
    assert "desired_output_layouts=(Shard(dim=1),)" in repr(plan["tok_embeddings"]), plan["tok_embeddings"]
    verify_toy(model, plan, tp_size=4)


class SeededBody(nn.Module):
    """A second state seeded from a learned vector of the body, cast and expanded to the stream's
    shape (``init.to(dtype).expand_as(x).contiguous()``), added to the stream before every layer."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(GPTBlock() for _ in range(2))
        self.init = nn.Parameter(0.1 * torch.randn(DIM))

    def forward(self, ids):
        x = self.embed(ids)
        state = self.init.to(x.dtype).expand_as(x).contiguous()
        for layer in self.layers:
            state = layer(state + x)
        return state


class SeededModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.norm, self.head = SeededBody(), nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        return self.head(self.norm(self.body(ids)))


@pytest.mark.parametrize("tp", [2, 4])
def test_body_parameter_expanded_into_the_stream_is_replicated(tp):
    """Would catch the body's own vector, reaching the stream through a cast and an expand, left a
    plain tensor: it met the sequence-sharded stream ("got mixed torch.Tensor and DTensor"). As a
    replicated DTensor, its gradient is summed over the sequence shards."""
    model = SeededModel()
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=True, verify=False)
    assert _dtensor_params(plan.get("body")), plan.get("body")
    report = verify_toy(model, plan, tp)
    assert all(f <= _whole_fraction(model, tp) + 0.01 for f in report.param_fraction), report.param_fraction


STREAMS = 4


class HyperConnection(nn.Module):
    """Mixes ``STREAMS`` copies of the residual into one branch input and returns the per-stream
    weights of the branch's output: ``(post, x)``, both per position. Raw weights (``F.linear`` on
    parameters): kept whole."""

    def __init__(self):
        super().__init__()
        self.fn = nn.Parameter(torch.randn(2 * STREAMS, STREAMS * DIM) / (STREAMS * DIM) ** 0.5)
        self.base = nn.Parameter(0.1 * torch.randn(2 * STREAMS))

    def forward(self, streams):
        flat = streams.flatten(2)
        mixes = F.linear(flat, self.fn) * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6) + self.base
        pre, post = torch.sigmoid(mixes).split(STREAMS, dim=-1)
        return post, (pre.unsqueeze(-1) * streams).sum(dim=2)


class HyperLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.attn_hc, self.mlp_hc = HyperConnection(), HyperConnection()
        self.ln_1, self.ln_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.attn, self.mlp = CausalSelfAttention(), MLP()

    def forward(self, streams):
        post, x = self.attn_hc(streams)
        streams = post.unsqueeze(-1) * self.attn(self.ln_1(x)).unsqueeze(-2) + streams
        post, x = self.mlp_hc(streams)
        return post.unsqueeze(-1) * self.mlp(self.ln_2(x)).unsqueeze(-2) + streams


class HyperModel(nn.Module):
    """The residual kept as ``STREAMS`` copies, ``(b, t, streams, dim)``, collapsed before the head."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(HyperLayer() for _ in range(2))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        streams = self.embed(ids).unsqueeze(2).expand(-1, -1, STREAMS, -1).contiguous()
        for layer in self.layers:
            streams = layer(streams)
        return self.head(self.norm(streams.mean(dim=2)))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_hyper_connections_run_on_the_sequence_shard(tp, sequence_parallel):
    """Would catch a whole module with raw weights that returns two per-position values the stream
    reads (a hyper-connection's branch input and output weights) handing them back whole: the next
    norm read the whole sequence as its shard (twice the length), or a plain tensor met the
    sequence-sharded stream."""
    model = HyperModel()
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=sequence_parallel,
                      verify=False)
    assert "layers.*.attn.c_attn" in plan and "layers.*.mlp.c_fc" in plan, sorted(plan)
    report = verify_toy(model, plan, tp)
    assert all(f <= _whole_fraction(model, tp) + 0.01 for f in report.param_fraction), report.param_fraction


class NormedRoutedBlock(RoutedBlock):
    """:class:`RoutedBlock` whose router reads the block input through a norm of the block's own."""

    def __init__(self):
        super().__init__()
        self.router_norm = nn.LayerNorm(DIM)

    def forward(self, x):
        b, t, d = x.shape
        flat = x.reshape(-1, d)
        scores = self.router(self.router_norm(flat))
        routed = flat.repeat(scores.shape[1], 1) * scores.transpose(0, 1).reshape(-1, 1)
        out = self.experts(routed).sum(dim=0)
        return (self.shared(flat) + out).view(b, t, d)


class NormedRoutedLayer(RoutedLayer):
    def __init__(self):
        super().__init__()
        self.moe = NormedRoutedBlock()


@pytest.mark.parametrize("tp", [2, 4])
def test_norm_inside_a_block_gathered_at_entry_stays_whole(tp):
    """Would catch a norm inside a MoE block that is gathered whole at entry keeping the
    sequence-parallel style it got before the block was: it read the block's whole input as its
    sequence shard (twice the length, or a plain tensor met a DTensor)."""
    model = Stack(lambda: NormedRoutedLayer())
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=True, verify=False)
    assert "layers.*.moe.router_norm" not in plan, plan.get("layers.*.moe.router_norm")
    verify_toy(model, plan, tp)


class RootLoopModel(nn.Module):
    """The layers are the mixers and norms themselves, in lists of their own, and the model's own
    loop adds the residual and multiplies the stream by the padding mask after every layer."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.attns = nn.ModuleList(CausalSelfAttention() for _ in range(2))
        self.norms_1 = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(2))
        self.mlps = nn.ModuleList(MLP() for _ in range(2))
        self.norms_2 = nn.ModuleList(nn.LayerNorm(DIM) for _ in range(2))
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        mask = (ids != 0).unsqueeze(-1).to(torch.float32)
        x = self.embed(ids) * mask
        for attn, norm_1, mlp, norm_2 in zip(self.attns, self.norms_1, self.mlps, self.norms_2):
            x = norm_1(x + attn(x))
            x = norm_2(x + mlp(x))
            x = x * mask
        return self.head(x)


@pytest.mark.parametrize("tp", [2, 4])
def test_stream_masked_by_the_root_between_layers_stays_replicated(tp):
    """Would catch a sequence-parallel plan for a stream that the model's own loop multiplies by a
    plain mask between its layers: no module boundary is there to hand the stream over, and the
    forward raised "got mixed torch.Tensor and DTensor" (at the first norm, sliced at entry, whose
    weight stayed plain). The plan is the plain-TP one, which runs."""
    model = RootLoopModel()
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=True, verify=False)
    plain = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, verify=False)
    assert repr(plan) == repr(plain), (plan, plain)
    report = verify_toy(model, plan, tp)
    assert "reduce_scatter_tensor" not in report.collectives, report.collectives


class TopKGate(nn.Linear):
    """Per-position weights of the top-k features, zero elsewhere (the top-k keeps it whole)."""

    def __init__(self, top_k: int = 8):
        super().__init__(DIM, DIM, bias=False)
        self.top_k = top_k

    def forward(self, x):
        logits = super().forward(x)
        top, index = logits.topk(self.top_k, dim=-1)
        return torch.zeros_like(logits).scatter(-1, index, torch.sigmoid(top))


class GatedLayer(GPTBlock):
    """A block whose own code scales its output by a whole gate child."""

    def __init__(self):
        super().__init__()
        self.gate = TopKGate()

    def forward(self, x):
        x = super().forward(x)
        return x * self.gate(x)


class GatedBody(nn.Module):
    """The token embedding, scaled by a whole gate child in the body's own code, then the layers."""

    def __init__(self):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.gate = TopKGate()
        self.layers = nn.ModuleList(GatedLayer() for _ in range(2))

    def forward(self, ids):
        x = self.embed(ids)
        x = x * self.gate(x)
        for layer in self.layers:
            x = layer(x)
        return {"hidden": x}  # as transformers' bodies return a ModelOutput


class GatedBodyModel(nn.Module):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.body, self.norm, self.head = GatedBody(), nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        return self.head(self.norm(self.body(ids)["hidden"]))


@pytest.mark.parametrize("tp", [2, 4])
def test_gated_body_holding_the_embedding_and_gated_layers_runs_whole(tp):
    """A body scaled by a whole gate child is gathered whole at entry (as a routed MoE block is).
    Would catch the token table inside it still starting a sequence-sharded stream (a whole gate
    Linear read it: "aten.mm.default got mixed torch.Tensor and DTensor"), or a gated layer inside
    it gathered again and its whole output sliced to the sequence shard within the whole body, or
    the body's output, a dict, handed on whole (the norm read it as its shard: twice the length)."""
    model = GatedBodyModel()
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=True, verify=False)
    assert getattr(plan.get("body"), "inputs", None) == "gather", plan.get("body")
    assert "body.layers.*.attn.c_attn" in plan, sorted(plan)
    assert getattr(plan.get("body.layers.*"), "inputs", None) != "gather", plan.get("body.layers.*")
    verify_toy(model, plan, tp)


class TimeMajorAttention(CausalSelfAttention):
    """:class:`CausalSelfAttention` on a sequence-first ``(t, b, d)`` input."""

    def forward(self, x):
        return super().forward(x.transpose(0, 1)).transpose(0, 1)


class TimeMajorModel(nn.Module):
    """Token ids transposed before the lookup: the stream is ``(t, b, d)`` until the head. An
    attention block, then one with a raw-weight mixer kept whole (gathered at entry)."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(layer() for layer in (lambda: GPTBlock(TimeMajorAttention), lambda: Block("raw")))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids.transpose(0, 1).contiguous())
        for layer in self.layers:
            x = layer(x)
        return self.head(self.norm(x).permute(1, 0, 2))


@pytest.mark.parametrize("tp", [2, 4])
def test_sequence_first_stream_stays_replicated(tp):
    """Would catch sequence-parallel styles sharding dim 1 of a sequence-first stream, the batch
    (two rows over four ranks at tp=4: the forward raised, as XLNet's did). The plan is the plain-TP one."""
    model = TimeMajorModel()
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=True, verify=False)
    plain = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, verify=False)
    assert repr(plan) == repr(plain), (plan, plain)
    verify_toy(model, plan, tp)


class NormedHyperConnection(HyperConnection):
    """:class:`HyperConnection` whose weights come from a normed copy of the streams: ``post`` is
    computed from the stream through a weight only, so only ``x`` carries the stream itself."""

    def forward(self, streams):
        flat = streams.flatten(2)
        normed = flat * torch.rsqrt(flat.pow(2).mean(-1, keepdim=True) + 1e-6)
        pre, post = torch.sigmoid(F.linear(normed, self.fn) + self.base).split(STREAMS, dim=-1)
        return post, (pre.unsqueeze(-1) * streams).sum(dim=2)


class SparseOutMLP(nn.Module):
    """An MLP (sharded), then the top-k of its output features per position into a last Linear
    (kept whole): a branch whose output is a whole Linear's, with sharded Linears before it."""

    def __init__(self):
        super().__init__()
        self.mlp, self.out = MLP(), nn.Linear(DIM, DIM)

    def forward(self, x):
        h = self.mlp(x)
        top, index = h.topk(DIM // 4, dim=-1)
        return self.out(torch.zeros_like(h).scatter(-1, index, top))


class NormedHyperLayer(HyperLayer):
    def __init__(self):
        super().__init__()
        self.attn_hc, self.mlp_hc = NormedHyperConnection(), NormedHyperConnection()
        self.mlp = SparseOutMLP()


class NormedHyperModel(HyperModel):
    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.layers = nn.ModuleList(NormedHyperLayer() for _ in range(2))


@pytest.mark.parametrize("tp", [2, 4])
def test_hyper_connection_weights_from_a_normed_copy_are_sliced_back(tp):
    """Would catch a whole hyper-connection slicing back only its first output (``post``, whose
    value comes from the stream through a weight) and not the branch input ``x`` (the next norm
    read the whole sequence as its shard: "size of tensor a (32) must match the size of tensor b
    (16)", as DeepSeek-V4's did), or a whole branch's plain output meeting the sliced ``post``
    behind an ``unsqueeze`` ("got mixed torch.Tensor and DTensor")."""
    model = NormedHyperModel()
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=True, verify=False)
    assert plan["layers.*.attn_hc"].outputs == "shard_all", plan["layers.*.attn_hc"]
    assert "layers.*.attn.c_attn" in plan, sorted(plan)
    verify_toy(model, plan, tp)


class QueryOverStates(nn.Module):
    """A learned query attending, at each position, over the earlier layers' states and the stream."""

    def __init__(self):
        super().__init__()
        self.query = nn.Parameter(0.1 * torch.randn(DIM))

    def forward(self, states, x):
        stacked = torch.cat([states, x.unsqueeze(-2)], dim=-2)
        query = self.query.view(1, DIM).expand(*stacked.shape[:-2], 1, DIM)
        return F.scaled_dot_product_attention(query, stacked, stacked).unbind(-2)


class StatesLayer(GPTBlock):
    def __init__(self):
        super().__init__()
        self.mix = QueryOverStates()

    def forward(self, x, states):
        return super().forward(self.mix(states, x)[0])


class StatesModel(nn.Module):
    """Every layer reads a learned mix of all the states before it: ``(b, t, layers, d)``."""

    def __init__(self):
        super().__init__()
        torch.manual_seed(0)
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(StatesLayer() for _ in range(2))
        self.norm, self.head = nn.LayerNorm(DIM), nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        states = x.unsqueeze(-2)
        for layer in self.layers:
            x, states = layer(x, states), torch.cat([states, x.unsqueeze(-2)], dim=-2)
        return self.head(self.norm(x))


@pytest.mark.parametrize("tp", [2, 4])
def test_attention_over_the_stream_with_a_learned_query_runs_whole(tp):
    """Would catch a module running attention over the sequence-sharded states with a parameter of
    its own, given replicated DTensor parameters and run on DTensors: DTensor took the sequence for
    the heads ("Attempted to unbind along the sharded dimension 2", or no sharding strategy for the
    attention's backward, as Inkling2's did). It is gathered whole at entry, its outputs sliced back."""
    model = StatesModel()
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=True, verify=False)
    assert plan["layers.*.mix"].outputs == "shard_all", plan["layers.*.mix"]
    verify_toy(model, plan, tp)


class PickedScaleBlock(GPTBlock):
    """modded-nanogpt's block: the stream mixed with the embeddings by two learned scalars picked
    from one parameter of the block's own, ``lambdas[0] * x + lambdas[1] * x0``."""

    def __init__(self):
        super().__init__()
        self.lambdas = nn.Parameter(torch.tensor([1.0, 0.5]))

    def forward(self, x, x0):
        x = self.lambdas[0] * x + self.lambdas[1] * x0
        return super().forward(x)


class PickedScaleModel(Stack):
    def __init__(self):
        super().__init__(PickedScaleBlock)

    def forward(self, ids):
        x = x0 = self.embed(ids)
        for layer in self.layers:
            x = layer(x, x0)
        return self.head(self.norm(x))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_scalars_picked_from_a_block_parameter_meet_the_stream_as_dtensors(sequence_parallel):
    """Would catch the block's parameter left plain under SP: ``lambdas[0]`` (a 0-dim pick) met the
    sequence-sharded stream as an implicitly replicated scalar and its gradient came back a DTensor
    on a plain parameter (the verifier crashed on it: "'Parameter' object has no attribute
    'placements'"; it now reports that gradient as a failure)."""
    model = PickedScaleModel()
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=2, sequence_parallel=sequence_parallel,
                      verify=False)
    if sequence_parallel:
        assert _dtensor_params(plan.get("layers.*")), plan.get("layers.*")
    verify_toy(model, plan, 2)


def test_a_plain_parameter_with_a_dtensor_gradient_is_a_failure_not_a_crash():
    """The SP plan without the block's ``ReplicatedWithGradAllReduce(dtensor=True)``: ``lambdas``
    stays a plain parameter and gets a DTensor gradient, which no optimizer can step; the verifier names it."""
    from autotp.verifier import verify

    model = PickedScaleModel()
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=2, sequence_parallel=True, verify=False)
    plan = {key: style for key, style in plan.items() if key != "layers.*"}
    report = verify(model, plan, tp_size=2, example_inputs=(example_tokens(),))
    assert not report.ok and report.worst_grad[0].endswith("lambdas") and report.worst_grad[1] == float("inf"), report
