"""A per-channel recurrence whose parameters are read at every step, and a Linear the trace never calls.

The mixer is the pattern of time-mixing RNN layers written as a plain loop over time: a token
shift mixed into the key's input, key, value and receptance projections, a per-channel ``decay`` and ``bonus`` read at each of the ``t`` unrolled
steps (so the traced graph has ``t`` readers of each), running states made with ``zeros_like`` of
the first step's key, a ``log_sigmoid`` gate and an output projection. Sharded like an expert,
the three projections are columns, the output a row, and ``decay`` / ``bonus`` are sharded with the
channels; a plan that shards them while one reader still reads them whole would be wrong, so
that case (the decay also read outside the loop) must keep the mixer exact.

The last tests are about a Linear outside the traced forward (an image projection a text-only
trace never reaches): it is column-sharded with its output all-gathered, which the verifier checks
by feeding the image too.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from synth_toy import DIM, example_tokens
from test_ssm_mixer import SSMStack
from torch import nn

from autotp.errors import MeshError
from autotp.synth import explain, synthesize
from autotp.synth.api import plan_with_analysis
from autotp.verifier import verify

INNER = 2 * DIM


class PerChannelRecurrence(nn.Module):
    """k, v, r = Linears(h); a numerically stable weighted running average over time with a
    per-channel decay and bonus; out(sigmoid(r) * wkv)."""

    def __init__(self, stray_read: bool = False):
        super().__init__()
        self.stray_read = stray_read
        self.key = nn.Linear(DIM, INNER, bias=False)
        self.value = nn.Linear(DIM, INNER, bias=False)
        self.receptance = nn.Linear(DIM, INNER, bias=False)
        self.gate = nn.Linear(DIM, INNER, bias=False)
        self.decay = nn.Parameter(0.5 * torch.randn(INNER))
        self.bonus = nn.Parameter(0.5 * torch.randn(INNER))
        self.mix = nn.Parameter(torch.rand(DIM))
        self.output = nn.Linear(INNER, DIM, bias=False)

    def forward(self, h):
        # A token shift mixed into the key's input: this module's own code reads the stream (under
        # sequence parallel, its style gathers it whole at entry).
        shifted = F.pad(h, (0, 0, 1, -1))
        k, v = self.key(h * self.mix + shifted * (1 - self.mix)), self.value(h)
        w = -torch.exp(self.decay)
        num = torch.zeros_like(k[:, 0])
        den = torch.zeros_like(k[:, 0])
        peak = torch.zeros_like(k[:, 0]) - 1e30
        outs = []
        for i in range(h.shape[1]):
            kt, vt = k[:, i], v[:, i]
            top = torch.maximum(peak, kt + self.bonus)
            a, b = torch.exp(peak - top), torch.exp(kt + self.bonus - top)
            outs.append((a * num + b * vt) / (a * den + b))
            top = torch.maximum(peak + w, kt)
            a, b = torch.exp(peak + w - top), torch.exp(kt - top)
            num, den, peak = a * num + b * vt, a * den + b, top
        wkv = torch.stack(outs, dim=1)
        gated = torch.sigmoid(self.receptance(h)) * wkv * torch.exp(F.logsigmoid(self.gate(h)))
        out = self.output(gated)
        if self.stray_read:  # the decay read whole too, outside the channel-sharded loop
            out = out + self.decay.mean()
        return out


def _model(**kwargs):
    torch.manual_seed(0)
    return SSMStack(mixer=lambda: PerChannelRecurrence(**kwargs))


def _verified(model, tp: int, sequence_parallel: bool = False, inputs=None):
    inputs = inputs or (example_tokens(),)
    plan = synthesize(model, example_inputs=inputs[:1], tp_size=tp, sequence_parallel=sequence_parallel, verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp, example_inputs=inputs)
    assert report.ok, str(report)
    return plan, report


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_recurrence_parameters_read_every_step_are_sharded(tp, sequence_parallel):
    plan, report = _verified(_model(), tp, sequence_parallel)
    # The key reads a learned mix of the stream: the mixer takes it with a partial gradient
    # (a Boundary with columns around its HeadParams, autotp.synth.mixes), one reduction per layer.
    mixer = plan["layers.*.mixer"].wrapped
    assert mixer.shard_dims == {"bonus": 0, "decay": 0} and mixer.gather_inputs == sequence_parallel, plan
    assert mixer.reduce == ("mix",) and mixer.partial_grad_inputs, plan
    assert report.comm_volume_backward <= report.comm_volume, (report.comm_volume, report.comm_volume_backward)
    # Only the RMSNorms stay whole: under 1% of the model.
    assert all(abs(f - 1 / tp) < 0.01 for f in report.param_fraction), report.param_fraction


def test_a_parameter_also_read_whole_is_not_sharded():
    """Default-deny: ``decay`` read whole after the row (``out + decay.mean()``) as well as per step
    inside the loop: sharding it would hand that reader a slice, so the mixer's projections that
    meet it stay whole, the plan stays exact, and the reason names the stray reader."""
    model = _model(stray_read=True)
    plan, analysis = plan_with_analysis(model, example_inputs=(example_tokens(),), tp_size=2)  # traced once
    assert "layers.*.mixer.key" not in plan, plan
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=2, example_inputs=(example_tokens(),))
    assert report.ok, str(report)
    records = {r.key: r for r in explain(analysis=analysis)}
    assert "reads it whole" in records["layers.*.mixer.key"].reason, records["layers.*.mixer.key"]


class WithImageProjection(nn.Module):
    """A token model with an image projection its text forward does not call."""

    def __init__(self, tied: bool = False):
        super().__init__()
        self.body = _model()
        self.image_proj = nn.Linear(3 * DIM, DIM)
        if tied:  # a weight shared by two modules: kept as it is
            self.other = nn.Linear(3 * DIM, DIM)
            self.other.weight = self.image_proj.weight

    def forward(self, tokens, image=None):
        h = self.body.embed(tokens)
        if image is not None:
            h = h + self.image_proj(image)[:, None]
        for layer in self.body.layers:
            h = layer(h)
        return self.body.head(self.body.norm(h))


@pytest.mark.parametrize("tp", [2, 4])
def test_an_untraced_linear_is_a_gathered_column(tp):
    torch.manual_seed(0)
    model = WithImageProjection()
    image = torch.randn(example_tokens().shape[0], 3 * DIM)
    plan, report = _verified(model, tp, inputs=(example_tokens(), image))  # the image reaches it here
    style = plan["image_proj"]
    assert type(style).__name__ == "ColwiseParallel" and str(style.output_layouts[0]) == "R", style
    assert all(abs(f - 1 / tp) < 0.01 for f in report.param_fraction), report.param_fraction


def test_an_untraced_linear_sharing_its_weight_stays_whole():
    torch.manual_seed(0)
    plan = synthesize(WithImageProjection(tied=True), example_inputs=(example_tokens(),), tp_size=2, verify=False)
    assert "image_proj" not in plan and "other" not in plan, plan


class GroupedConvMixer(nn.Module):
    """in_proj -> a causal convolution over groups of channels (not depthwise) -> silu -> out_proj."""

    def __init__(self, groups: int = 8, gated: str = ""):
        super().__init__()
        # "before": in_proj packs [x | gate] and the conv runs over x; "after": the conv runs over
        # the whole packed output, cut into x and gate after it.
        self.gated = gated
        self.in_proj = nn.Linear(DIM, 2 * INNER if gated else INNER, bias=False)
        width = 2 * INNER if gated == "after" else INNER
        self.conv = nn.Conv1d(width, width, 3, groups=groups, padding=2)
        self.out_proj = nn.Linear(INNER, DIM, bias=False)

    def forward(self, h):
        x = self.in_proj(h)
        if self.gated == "before":
            x, gate = x.chunk(2, dim=-1)
        x = F.silu(self.conv(x.transpose(1, 2))[..., : h.shape[1]]).transpose(1, 2)
        if self.gated == "after":
            x, gate = x.chunk(2, dim=-1)
        return self.out_proj(x * F.silu(gate) if self.gated else x)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_a_grouped_convolution_keeps_whole_groups_per_rank(tp, sequence_parallel):
    """8 groups of 16 channels: each rank holds 8 / tp whole groups, the conv's weight and bias
    sharded with them and its ``groups`` divided per rank."""
    torch.manual_seed(0)
    plan, report = _verified(SSMStack(mixer=GroupedConvMixer), tp, sequence_parallel)
    assert plan["layers.*.mixer"].names == ("conv.groups",), plan
    assert all(abs(f - 1 / tp) < 0.01 for f in report.param_fraction), report.param_fraction


def test_a_grouped_convolution_tp_does_not_divide_is_refused():
    """2 groups at tp=4: a rank would hold half a group; the plan is refused with the module named."""
    torch.manual_seed(0)
    with pytest.raises(MeshError, match="mixer"):
        synthesize(SSMStack(mixer=lambda: GroupedConvMixer(groups=2)), example_inputs=(example_tokens(),), tp_size=4,
                   verify=False)


@pytest.mark.parametrize("gated", ["before", "after"])
def test_a_grouped_convolution_of_a_packed_projection_stays_exact(gated):
    """Default-deny: the projection is cut into parts (before or after the conv), so a rank's
    channels are its shares of the parts; grouped (not depthwise), that is not proven to keep
    whole groups, so the projection stays whole and the plan exact."""
    torch.manual_seed(0)
    plan, _ = _verified(SSMStack(mixer=lambda: GroupedConvMixer(gated=gated)), 2)
    assert "layers.*.mixer.in_proj" not in plan, plan


BLOCKS, BLOCK = 8, INNER // 8


class BlockDiagonalGate(nn.Module):
    """in_proj -> a gate computed per block of channels by ``baddbmm(bias, x, W)`` with ``W`` of
    shape (blocks, block, block) (a block-diagonal Linear, one matrix per head) -> out_proj. With
    ``across``, the gate is one full (inner, inner) matrix applied by ``baddbmm`` instead: it mixes
    every channel."""

    def __init__(self, across: bool = False):
        super().__init__()
        self.across, self.blocks = across, BLOCKS
        self.in_proj = nn.Linear(DIM, INNER, bias=False)
        shape = (1, INNER, INNER) if across else (BLOCKS, BLOCK, BLOCK)
        self.gate_weight = nn.Parameter(torch.randn(shape) / BLOCK**0.5)
        self.gate_bias = nn.Parameter(torch.randn(shape[0], shape[2]))
        self.out_proj = nn.Linear(INNER, DIM, bias=False)

    def forward(self, h):
        b, t, _ = h.shape
        x = self.in_proj(h)
        if self.across:
            weight = self.gate_weight.expand(b, -1, -1)
            gate = torch.baddbmm(self.gate_bias[:, None, :], x, weight)
        else:
            blocks = x.reshape(b * t, self.blocks, -1).permute(1, 0, 2)  # (blocks, b * t, block)
            gate = torch.baddbmm(self.gate_bias[:, None, :], blocks, self.gate_weight)
            gate = gate.permute(1, 0, 2).reshape(b, t, -1)
        return self.out_proj(torch.sigmoid(gate) * x)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_a_block_diagonal_baddbmm_is_sharded_with_its_blocks(tp, sequence_parallel):
    """The per-block weight and bias meet the block-sharded input on their block dim: both are
    sharded with it, and the mixer's projections are a column / row pair."""
    torch.manual_seed(0)
    plan, report = _verified(SSMStack(mixer=BlockDiagonalGate), tp, sequence_parallel)
    mixer = plan["layers.*.mixer"]
    assert mixer.shard_dims == {"gate_bias": 0, "gate_weight": 0} and mixer.counts == ("blocks",), plan
    assert all(abs(f - 1 / tp) < 0.01 for f in report.param_fraction), report.param_fraction


def test_a_baddbmm_mixing_every_channel_stays_whole():
    """Default-deny: the channel-sharded input is the contracted dim of the product, so the mixer's
    projections stay whole, the plan stays exact, and the reason names the contraction."""
    torch.manual_seed(0)
    model = SSMStack(mixer=lambda: BlockDiagonalGate(across=True))
    plan, _ = _verified(model, 2)
    assert "layers.*.mixer.in_proj" not in plan, plan
    records = {r.key: r for r in explain(model, example_inputs=(example_tokens(),), tp_size=2)}
    assert "over the sharded dim" in records["layers.*.mixer.in_proj"].reason, records["layers.*.mixer.in_proj"]


HEADS, CHUNK = 4, 4


class DecayedChunkState(nn.Module):
    """Linear attention over chunks: a ``(b, heads, d, d)`` state made with ``torch.ones``, scaled
    by a per-head rate, ``ones(...) * exp(-rate) * 0.01``, and decayed by it at each chunk,
    ``state * exp(-rate) + k^T v``; with ``stray_read`` the initial state is also summed over every
    head into the output."""

    def __init__(self, stray_read: bool = False):
        super().__init__()
        self.heads, self.head_dim, self.inner, self.stray_read = HEADS, INNER // HEADS, INNER, stray_read
        self.qkv = nn.Linear(DIM, 3 * INNER, bias=False)
        self.rate = nn.Parameter(torch.rand(HEADS, 1, 1))
        self.out = nn.Linear(INNER, DIM, bias=False)

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = (z.view(b, t, self.heads, self.head_dim).transpose(1, 2) for z in self.qkv(h).split(self.inner, -1))
        decay = torch.exp(-self.rate.sigmoid() * CHUNK)
        first = torch.ones(b, self.heads, self.head_dim, self.head_dim) * decay * 0.01  # a tree of two leaves
        state, outputs = first, []
        for start in range(0, t, CHUNK):
            qc, kc, vc = (z[:, :, start:start + CHUNK] for z in (q, k, v))
            outputs.append(qc @ state + (qc @ kc.transpose(-1, -2)).tril() @ vc)
            state = state * decay + kc.transpose(-1, -2) @ vc
        out = self.out(torch.cat(outputs, dim=2).transpose(1, 2).reshape(b, t, -1))
        return out + first.sum((1, 2, 3))[:, None, None] if self.stray_read else out


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_a_state_decayed_by_a_per_head_rate_is_sharded_with_the_heads(tp, sequence_parallel):
    """``zeros(...) * exp(-rate)`` meets the heads as one operand computed from a constant and a
    parameter: the rate is sharded with the heads and the zeros made at the per-rank head count.
    Would catch the mixer kept whole again (the state holds every head) or a rate left whole."""
    torch.manual_seed(0)
    plan, report = _verified(SSMStack(mixer=DecayedChunkState), tp, sequence_parallel)
    mixer = plan["layers.*.mixer"]
    assert mixer.shard_dims == {"rate": 0} and mixer.counts == ("heads", "inner"), plan
    assert all(abs(f - 1 / tp) < 0.01 for f in report.param_fraction), report.param_fraction


def test_a_decayed_state_also_read_whole_keeps_the_mixer_exact():
    """Default-deny: the initial state is also summed over every head, so making it per rank would
    hand that reader a slice (a partial sum, off by the other ranks' heads). The mixer's projections
    stay whole, the plan stays exact, and the reason names the reader."""
    torch.manual_seed(0)
    model = SSMStack(mixer=lambda: DecayedChunkState(stray_read=True))
    plan, _ = _verified(model, 2)
    assert "layers.*.mixer.qkv" not in plan, plan
    records = {r.key: r for r in explain(model, example_inputs=(example_tokens(),), tp_size=2)}
    assert "reads it whole" in records["layers.*.mixer.qkv"].reason, records["layers.*.mixer.qkv"]
