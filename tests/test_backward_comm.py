"""Backward communication at the forward's count: one reduction per shared input, one per parallel block.

Each test counts the collectives of one forward and of its backward (``VerifyReport.collectives`` /
``collectives_backward``) on 2 simulated ranks and checks the numerics against the unsharded model
(logits and every gradient, 1e-5). Would catch a plan whose column projections reduce their input
gradients one by one (q, k, v, gate, up: 5 all-reduces per layer where 2 suffice), or a parallel
block that reduces each branch separately.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial

import handwritten_plans
from autotp import styles
from autotp.models import build_model
from autotp.synth import synthesize
from autotp.verifier import verify
from synth_models import tiny_model
from synth_toy import SeparateQKVAttention, StackedExperts, train_step_runs

LAYERS = 2


def _gathers(style) -> bool:
    """A block that all-gathers its sequence-sharded inputs once at entry."""
    return isinstance(style, styles.Boundary) and style.inputs == "gather"


def _partial_row(style) -> bool:
    """A row Linear whose output stays a partial sum."""
    return isinstance(style, styles.Rowwise) and tuple(style.output_layouts) == (Partial(),)


def _report(model, plan, tp_size=2, inputs=None):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp_size, example_inputs=inputs)
    assert report.ok, str(report)
    return report


def _mirrored(forward: dict[str, int]) -> dict[str, int]:
    """The backward a forward's collectives imply at the limit: an all-reduce's backward is an
    all-reduce, a reduce-scatter's an all-gather and the other way round."""
    swap = {"reduce_scatter_tensor": "all_gather_into_tensor", "all_gather_into_tensor": "reduce_scatter_tensor"}
    return {swap.get(op, op): n for op, n in forward.items() if op != "allreduce"}


@pytest.fixture(scope="module")
def models():
    return {name: build_model(name, tiny=True, tp=2, device="cpu") for name in ("llama", "qwen3", "phi3", "phi")}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("source", ["handwritten", "synthesized"])
@pytest.mark.parametrize("name", ["llama", "qwen3", "phi3"])
def test_branch_inputs_reduced_once(models, name, source, sequence_parallel):
    """Llama-shaped (separate q/k/v, gate/up) and fused (Phi3's qkv_proj, gate_up_proj): 2 per layer
    + 1 at the vocabulary boundary, in each direction."""
    model = models[name]
    plan = (handwritten_plans.plan_for(model, sequence_parallel=sequence_parallel) if source == "handwritten"
            else synthesize(model, sequence_parallel=sequence_parallel, tp_size=2, verify=False))
    report = _report(model, plan)
    per_direction = 2 * LAYERS + 1
    if sequence_parallel:
        assert report.collectives == {"all_gather_into_tensor": per_direction, "reduce_scatter_tensor": per_direction}
    else:
        assert report.collectives == {"all_reduce": per_direction}
    assert report.collectives_backward == _mirrored(report.collectives)
    # In bytes: each collective moves the whole fp32 hidden state, (batch, seq, hidden); an all-reduce
    # counts twice (a reduce-scatter and an all-gather), SP's pair once each.
    hidden_state = 2 * 16 * model.config.hidden_size * 4
    assert report.comm_volume == report.comm_volume_backward == 2 * per_direction * hidden_state


@pytest.mark.parametrize("source", ["handwritten", "synthesized"])
def test_parallel_block_reduces_once_per_layer(models, source):
    """Phi: attention and MLP read one norm and their partial outputs are summed before one
    all-reduce per layer, forward and backward (+ 1 at the embedding / head)."""
    model = models["phi"]
    plan = handwritten_plans.plan_for(model) if source == "handwritten" else synthesize(model, tp_size=2, verify=False)
    report = _report(model, plan)
    assert report.collectives == {"all_reduce": LAYERS + 1}
    assert report.collectives_backward == {"all_reduce": LAYERS + 1}


def test_parallel_block_under_sp_reduce_scatters_once_per_layer(models):
    """SP: one all-gather (the shared norm) and one reduce-scatter (the summed branches) per layer,
    and the mirror in backward: the reduce-scatter's sequence-sharded gradient reaches both
    branches from the add that joins them, and is all-gathered once for the two (not per branch)."""
    model = models["phi"]
    for plan in (handwritten_plans.plan_for(model, sequence_parallel=True),
                 synthesize(model, sequence_parallel=True, tp_size=2, verify=False)):
        report = _report(model, plan)
        assert report.collectives == {"all_gather_into_tensor": LAYERS + 1, "reduce_scatter_tensor": LAYERS + 1}
        assert report.collectives_backward == _mirrored(report.collectives)


class _SideBySide(nn.Module):
    """A block whose two branches read one norm and are summed before the residual."""

    def __init__(self, dim, heads):
        super().__init__()
        self.norm = nn.LayerNorm(dim)
        self.attn = SeparateQKVAttention(dim, heads)
        self.up, self.down = nn.Linear(dim, 4 * dim), nn.Linear(4 * dim, dim)

    def forward(self, x):
        h = self.norm(x)
        return self.attn(h) + self.down(F.gelu(self.up(h))) + x


class _ScaledSideBySide(_SideBySide):
    """The same block with each branch scaled by its own constant before the sum."""

    def forward(self, x):
        h = self.norm(x)
        return x + (self.attn(h) * 0.5 + self.down(F.gelu(self.up(h))) * 2.0)


class _Decoder(nn.Module):
    def __init__(self, vocab=128, dim=64, heads=4, block=_SideBySide):
        super().__init__()
        self.embed = nn.Embedding(vocab, dim)
        self.blocks = nn.ModuleList(block(dim, heads) for _ in range(LAYERS))
        self.norm = nn.LayerNorm(dim)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def test_plain_pytorch_parallel_block_found_from_the_graph():
    """A parallel block written in plain PyTorch, named after nothing: the synthesizer finds the two
    rows whose outputs are added and reduces them once per layer in each direction."""
    torch.manual_seed(0)
    model = _Decoder()
    ids = torch.randint(0, 128, (2, 8))
    plan = synthesize(model, example_inputs=(ids,), tp_size=2, verify=False)
    assert _partial_row(plan["blocks.*.down"])
    assert repr(plan["blocks.*"]) == "Boundary(inputs='replicate', outputs='local', stream=0)"
    report = _report(model, plan, inputs=(ids,))
    assert report.collectives == {"all_reduce": LAYERS + 1}
    assert report.collectives_backward == {"all_reduce": LAYERS + 1}  # + the head's input gradient


@pytest.mark.parametrize("tp_size", [2, 4])
def test_scaled_parallel_branches_under_sp_gather_their_gradient_once(tp_size):
    """SP, branches scaled by different constants before their sum: the reduce-scatter's gradient
    reaches each branch as a different tensor, and without :class:`~autotp.styles.JoinPartialSums`
    on the block each branch all-gathered its own (2 all-gathers per layer in backward, not 1)."""
    torch.manual_seed(0)
    model = _Decoder(block=_ScaledSideBySide)
    ids = torch.randint(0, 128, (2, 8))
    plan = synthesize(model, example_inputs=(ids,), sequence_parallel=True, tp_size=tp_size, verify=False)
    assert type(plan["blocks.*"]).__name__ == "JoinPartialSums", plan.get("blocks.*")
    report = _report(model, plan, tp_size=tp_size, inputs=(ids,))
    assert max(report.logits_max_abs_diff) <= 1e-5 and report.worst_grad[1] <= 1e-5, report
    assert report.collectives == {"all_gather_into_tensor": LAYERS + 1, "reduce_scatter_tensor": LAYERS + 1}
    assert report.collectives_backward == _mirrored(report.collectives)
    assert report.comm_volume_backward == report.comm_volume


class _DroppedSideBySide(_SideBySide):
    """The same block with each branch passed through its own dropout before the sum (GPT-J, Phi)."""

    def __init__(self, dim, heads, p=0.25):
        super().__init__(dim, heads)
        self.attn_drop, self.mlp_drop = nn.Dropout(p), nn.Dropout(p)

    def forward(self, x):
        h = self.norm(x)
        return self.attn_drop(self.attn(h)) + self.mlp_drop(self.down(F.gelu(self.up(h)))) + x


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_branches_through_live_dropout_reduce_before_it(sequence_parallel):
    """A parallel block whose branches pass through dropout before their sum: in eval (dropout an
    identity) the branches' partial sums are reduced once, and verified; in training (p > 0) each
    partial sum is reduced before its dropout (a mask drawn on a partial sum would be wrong, and
    DTensor refuses it: the step crashed with "bernoulli_ ... Partial(sum)" before)."""
    torch.manual_seed(0)
    model = _Decoder(block=_DroppedSideBySide).eval()
    ids = torch.randint(0, 128, (2, 8))
    plan = synthesize(model, example_inputs=(ids,), sequence_parallel=sequence_parallel, tp_size=2, verify=False)
    assert _partial_row(plan["blocks.*.down"]), plan
    report = _report(model, plan, inputs=(ids,))
    assert max(report.logits_max_abs_diff) <= 1e-5 and report.worst_grad[1] <= 1e-5, report
    once = ({"all_gather_into_tensor": LAYERS + 1, "reduce_scatter_tensor": LAYERS + 1} if sequence_parallel
            else {"all_reduce": LAYERS + 1})
    assert report.collectives == once, report.collectives
    train_step_runs(model, plan, 2, ids)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_handwritten_phi_trains_with_residual_dropout(sequence_parallel):
    """Phi-2 ships ``resid_pdrop=0.1``: the handwritten plan's branches pass through it before their
    sum; a training step must run (it crashed on the partial sum before)."""
    torch.manual_seed(0)
    model = build_model("phi", tiny=True, tp=2, device="cpu")
    for module in model.modules():
        if isinstance(module, nn.Dropout):
            module.p = 0.1
    plan = handwritten_plans.plan_for(model, sequence_parallel=sequence_parallel)
    train_step_runs(model, plan, 2, torch.randint(0, model.config.vocab_size, (2, 8)))


def test_partial_sum_meets_dropout_whole():
    """The mode's unit: a partial sum (1 on each of 2 ranks) through a live dropout comes out
    ``Replicate()``, each element 0 or 2 / (1 - p), equal on every rank (a mask drawn per partial
    would leave some at 1 / (1 - p)); through an identity dropout it stays ``Partial()``."""
    from torch.distributed.tensor import DTensor, Partial, Replicate

    from autotp import _simulate
    from autotp.styles.base import ReduceBeforeLiveDropout

    with _simulate.simulated_mesh(2) as mesh:
        x = DTensor.from_local(torch.ones(256), mesh, [Partial()], run_check=False)
        with ReduceBeforeLiveDropout():
            live, idle = F.dropout(x, 0.5, True), F.dropout(x, 0.0, True)
        assert live.placements == (Replicate(),) and idle.placements == (Partial(),)
        ranks = _simulate.per_rank(live.to_local(), 2)
    assert torch.equal(ranks[0], ranks[1])
    assert set(ranks[0].unique().tolist()) == {0.0, 4.0}


def _counts(report, sequence_parallel: bool, per_direction: int) -> None:
    if sequence_parallel:
        assert report.collectives == {"all_gather_into_tensor": per_direction, "reduce_scatter_tensor": per_direction}
    else:
        assert report.collectives == {"all_reduce": per_direction}
    assert report.collectives_backward == _mirrored(report.collectives)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("family", ["qwen3_moe", "mixtral"])
def test_moe_block_input_reduced_once(family, sequence_parallel):
    """MoE: the norm hands the block one DTensor; the experts' and the router's input gradients are
    summed before one reduction (plain: all-reduce, SP: reduce-scatter), and the router runs its
    backward on the experts' partial gradient of the routing weights. Was 7 all-reduces in backward
    (the routing weights' gradient reduced apart) where the forward has 5."""
    model = tiny_model(family, device="cpu")
    plan = synthesize(model, sequence_parallel=sequence_parallel, tp_size=2, verify=False)
    assert type(plan["model.layers.*.mlp.gate"]).__name__ == "PartialGradRouter"
    assert plan["model.layers.*.mlp.experts"].partial_grad_inputs
    _counts(_report(model, plan), sequence_parallel, 2 * LAYERS + 1)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_moe_block_input_reduced_once_at_tp4(sequence_parallel):
    model = tiny_model("qwen3_moe", device="cpu", num_key_value_heads=4)
    plan = synthesize(model, sequence_parallel=sequence_parallel, tp_size=4, verify=False)
    _counts(_report(model, plan, tp_size=4), sequence_parallel, 2 * LAYERS + 1)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_columns_reading_the_stream_share_one_reduction(tp_size, sequence_parallel):
    """OLMo2 (no pre-norm: q/k/v and gate/up read the residual stream as it enters attention / MLP):
    one reduction per module entry in backward. Plain TP was 3 + 2 all-reduces per layer. The QK
    norms over the sharded width add one all-reduce of their ``(batch, seq, 1)`` statistic in each
    direction (the backward used to reduce-scatter the statistic's gradient broadcast over the
    whole width: 1.38 times the forward's bytes)."""
    model = tiny_model("olmo2", device="cpu", num_key_value_heads=4)
    plan = synthesize(model, sequence_parallel=sequence_parallel, tp_size=tp_size, verify=False)
    report = _report(model, plan, tp_size=tp_size)
    norms = 2 * LAYERS
    if sequence_parallel:
        assert _gathers(plan["model.layers.*.self_attn"])
        assert report.collectives == {"all_gather_into_tensor": 2 * LAYERS + 1,
                                      "reduce_scatter_tensor": 2 * LAYERS + 1, "all_reduce": norms}
    else:
        assert plan["model.layers.*.self_attn"].columns == ("k_proj", "q_proj", "v_proj"), plan
        assert report.collectives == {"all_reduce": 2 * LAYERS + 1 + norms}
    assert report.collectives_backward == _mirrored(report.collectives)
    assert report.comm_volume_backward == report.comm_volume


def test_replicated_kv_heads_sum_copies_with_one_all_reduce_each():
    """tp > kv heads, copies held (``gather_copies=False``): activations at the limit; each k / v
    weight gradient's copies are summed by one all-reduce of the kv-head-sized gradient (was an
    all-gather of the tp-times-expanded one)."""
    model = tiny_model("llama", device="cpu", num_key_value_heads=1)
    plan = synthesize(model, tp_size=4, gather_copies=False, verify=False)
    assert type(plan["model.layers.*.self_attn.k_proj"]).__name__ == "ReplicatedKVColwise"
    report = _report(model, plan, tp_size=4)
    assert report.collectives == {"all_reduce": 2 * LAYERS + 1}
    assert report.collectives_backward == {"all_reduce": 2 * LAYERS + 1 + 2 * LAYERS}


class _Router(nn.Module):
    def __init__(self, dim, experts, top_k=2):
        super().__init__()
        self.weight, self.top_k = nn.Parameter(torch.randn(experts, dim) / dim**0.5), top_k

    def forward(self, x):
        logits = F.linear(x, self.weight)
        top, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), index


class _RoutedLM(nn.Module):
    """Norm -> router + grouped experts, with the router logits also reaching the output (as an
    auxiliary loss would): their gradient is full on every rank, not a partial sum."""

    def __init__(self, vocab=64, dim=32, experts=4, ffn=16):
        super().__init__()
        self.embed, self.norm = nn.Embedding(vocab, dim), nn.LayerNorm(dim)
        self.router, self.experts = _Router(dim, experts), StackedExperts(dim, experts, ffn)
        self.head = nn.Linear(dim, vocab, bias=False)

    def forward(self, ids):
        x = self.embed(ids).flatten(0, 1)
        h = self.norm(x)
        logits, weights, index = self.router(h)
        y = x + self.experts(h, index, weights)
        return (self.head(y) + logits.square().mean(-1, keepdim=True)).unflatten(0, ids.shape)


@pytest.mark.parametrize("tp_size", [2, 4])
def test_router_on_partial_gradients_is_exact_with_another_reader(tp_size):
    """The router's outputs get the experts' partial gradient and a full one from elsewhere; the
    sum over ranks must count the full one once (would fail without the 1/tp and tp scalings)."""
    torch.manual_seed(0)
    model = _RoutedLM()
    plan = {"norm": styles.Boundary(outputs="replicate"), "router": styles.PartialGradRouter(),
            "experts": styles.ExpertsParallel(partial_grad_inputs=True)}
    report = _report(model, plan, tp_size=tp_size, inputs=(torch.randint(0, 64, (2, 8)),))
    assert report.collectives == {"all_reduce": 1}
    assert report.collectives_backward == {"all_reduce": 1}


class _Mlp(nn.Module):
    def __init__(self, dim):
        super().__init__()
        self.gate, self.up, self.down = nn.Linear(dim, 2 * dim), nn.Linear(dim, 2 * dim), nn.Linear(2 * dim, dim)

    def forward(self, x):
        return self.down(F.silu(self.gate(x)) * self.up(x))


class _PostNormBlock(nn.Module):
    """Norms after each branch: q/k/v and gate/up read the residual stream as it enters their module."""

    def __init__(self, dim, heads):
        super().__init__()
        self.attn, self.mlp = SeparateQKVAttention(dim, heads), _Mlp(dim)
        self.attn_norm, self.mlp_norm = nn.LayerNorm(dim), nn.LayerNorm(dim)

    def forward(self, x):
        x = x + self.attn_norm(self.attn(x))
        return x + self.mlp_norm(self.mlp(x))


@pytest.mark.parametrize("tp_size", [2, 4])
def test_plain_pytorch_post_norm_columns_share_their_entry(tp_size):
    """Found from the graph: the columns of each module reading its input share one DTensor, one
    all-reduce per module in backward as in forward (+ the head's input gradient / the embedding)."""
    torch.manual_seed(0)
    model = _Decoder()
    model.blocks = nn.ModuleList(_PostNormBlock(64, 4) for _ in range(LAYERS))
    ids = torch.randint(0, 128, (2, 8))
    plan = synthesize(model, example_inputs=(ids,), tp_size=tp_size, verify=False)
    assert repr(plan["blocks.*.attn"]) == "Boundary(inputs='replicate', columns=('k', 'q', 'v'))"
    assert repr(plan["blocks.*.mlp"]) == "Boundary(inputs='replicate', columns=('gate', 'up'))"
    report = _report(model, plan, tp_size=tp_size, inputs=(ids,))
    assert report.collectives == {"all_reduce": 2 * LAYERS + 1}
    assert report.collectives_backward == {"all_reduce": 2 * LAYERS + 1}


class _ChildGateRouter(nn.Module):
    """A router whose scores come from a child Linear (``self.gate``), as transformers' AFMoE has."""

    def __init__(self, dim, experts, top_k=2):
        super().__init__()
        self.gate, self.top_k = nn.Linear(dim, experts, bias=False), top_k

    def forward(self, x):
        logits = self.gate(x)
        top, index = torch.topk(logits.softmax(-1), self.top_k, dim=-1)
        return logits, top / top.sum(-1, keepdim=True), index


@pytest.mark.parametrize("tp_size", [2, 4])
def test_router_whose_weight_is_a_childs_is_exact(tp_size):
    """The child's weight gets its Partial() gradient too (it was left a per-rank partial sum no
    one reduced: 0.04 off at tp=4 before the style covered children)."""
    torch.manual_seed(0)
    model = _RoutedLM()
    model.router = _ChildGateRouter(32, 4)
    plan = {"norm": styles.Boundary(outputs="replicate"), "router": styles.PartialGradRouter(),
            "experts": styles.ExpertsParallel(partial_grad_inputs=True)}
    report = _report(model, plan, tp_size=tp_size, inputs=(torch.randint(0, 64, (2, 8)),))
    assert report.collectives == {"all_reduce": 1}
    assert report.collectives_backward == {"all_reduce": 1}


def test_synthesized_router_with_a_child_linear_and_a_selection_bias():
    """AFMoE: the router's scores come from a child ``gate`` Linear and a block parameter biases
    the top-k choice only (its values dropped): the router runs its backward on the experts'
    partial gradients. Plain TP backward was 7 all-reduces for 6 forward; now 5 (the forward's
    sixth is the shared expert reduced apart from the experts)."""
    from autotp.models import build_model

    model = build_model("afmoe", tiny=True, tp=2, device="cpu")
    plan = synthesize(model, tp_size=2, verify=False)
    assert type(plan["model.layers.1.mlp.router"]).__name__ == "PartialGradRouter"
    report = _report(model, plan)
    assert report.collectives == {"all_reduce": 6}
    assert report.collectives_backward == {"all_reduce": 5}


@pytest.mark.parametrize("tp_size", [2, 4])
def test_shared_expert_reduce_scattered_with_the_experts_under_sp(tp_size):
    """GLM-4.5 MoE (``experts(x).view(shape) + shared_experts(x)``, one MoE layer after a dense
    one): the shared expert's partial sum is added to the experts' and the block reduce-scatters
    once; the block input's gradient (router, experts, shared gate / up) is reduce-scattered once.
    Was forward 4 RS + 5 AG + 2 all-reduces, backward 4 RS + 5 AG + 4 all-reduces."""
    from autotp.models import build_model

    model = build_model("glm4_moe", tiny=True, tp=tp_size, device="cpu")
    plan = synthesize(model, sequence_parallel=True, tp_size=tp_size, verify=False)
    assert getattr(plan["model.layers.1.mlp"], "outputs", None) == "sum_shard"
    assert _partial_row(plan["model.layers.1.mlp.shared_experts.down_proj"])
    _counts(_report(model, plan, tp_size=tp_size), True, 2 * LAYERS + 1)


def test_gated_shared_expert_still_reduces_inside_under_sp():
    """Qwen2-MoE scales its shared expert by ``sigmoid(shared_expert_gate(x))``: the gate's weight
    gradient reads the shared expert's output, which must not be a partial sum."""
    from autotp.models import build_model

    model = build_model("qwen2_moe", tiny=True, tp=2, device="meta")
    plan = synthesize(model, sequence_parallel=True, tp_size=2, verify=False)
    assert not any(_partial_row(style) for style in plan.values())
    assert getattr(plan["model.layers.*.mlp"], "outputs", None) != "sum_shard"


class ScaledPositions(nn.Module):
    """A position table whose rows are scaled by a vector it is handed: that input carries a
    gradient (to a parameter outside), so each rank keeping its own positions would leave it partial."""

    def __init__(self):
        super().__init__()
        self.table = nn.Parameter(torch.randn(64, 64) * 0.02)

    def forward(self, pos, scale):
        return self.table[pos] * scale


def _nano_gpt_with_positions(form: str):
    """nanoGPT with its learned positions read as ``(t, d)``, as ``(1, t, d)``, or through a table
    module handed a scale computed from a root parameter (``"scaled"``)."""
    from synth_toy import NanoGPT

    class Positions(NanoGPT):
        def __init__(self):
            super().__init__()
            if form == "scaled":
                self.wpe = ScaledPositions()
                self.pos_scale = nn.Parameter(torch.linspace(0.5, 1.5, 64))

        def forward(self, idx):
            pos = torch.arange(idx.shape[1], device=idx.device)
            if form == "(1, t, d)":
                x = self.wte(idx) + self.wpe(pos.unsqueeze(0))
            elif form == "scaled":
                x = self.wte(idx) + self.wpe(pos, self.pos_scale * 2)
            else:
                x = self.wte(idx) + self.wpe(pos)
            for block in self.h:
                x = block(x)
            return self.lm_head(self.ln_f(x))

    return Positions()


@pytest.mark.parametrize("tp_size", [2, 4])
@pytest.mark.parametrize("form", ["(t, d)", "(1, t, d)"])
def test_position_table_keeps_own_positions_under_sp(tp_size, form):
    """nanoGPT's learned positions ``wpe(arange(t))`` added to the sequence-sharded stream: each rank
    keeps its own positions (``Boundary(outputs="slice", output_grad="partial")``), so the backward moves no more than the forward
    (was one all-gather of the table's ``(t, d)`` gradient per step, 1.05 times the forward's bytes
    on the GPT-2 family), and the table's gradient is exact once its partial sums are added."""
    from synth_toy import example_tokens

    model = _nano_gpt_with_positions(form)
    plan = synthesize(model, example_inputs=(example_tokens(),), sequence_parallel=True, tp_size=tp_size, verify=False)
    assert repr(plan["wpe"]) == repr(styles.Boundary(outputs="slice", output_grad="partial",
                                                     sequence_dim=0 if form == "(t, d)" else 1,
                                                     style=styles.ReplicatedWithGradAllReduce()))
    report = _report(model, plan, tp_size=tp_size, inputs=(example_tokens(),))
    assert "wpe.weight" in report.grad_max_abs_diff
    assert report.collectives_backward == _mirrored(report.collectives)
    assert report.comm_volume_backward == report.comm_volume


def test_position_table_reading_a_gradient_is_handed_on_whole():
    """A table whose module reads a tensor with a gradient (a scale computed from a root parameter)
    is not cut per rank: its output stays a ``Replicate()`` DTensor and the plan is exact. Would
    catch the cut applied there (the root parameter's gradient left a per-rank partial sum)."""
    from synth_toy import example_tokens

    model = _nano_gpt_with_positions("scaled")
    plan = synthesize(model, example_inputs=(example_tokens(),), sequence_parallel=True, tp_size=2, verify=False)
    assert isinstance(plan["wpe"], styles.Boundary) and plan["wpe"].outputs == "replicate"
    report = _report(model, plan, inputs=(example_tokens(),))
    assert "pos_scale" in report.grad_max_abs_diff
