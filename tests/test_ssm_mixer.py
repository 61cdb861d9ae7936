"""State-space style mixers are sharded like experts' heads: by channel, with their per-channel parameters.

The mixer here is the pattern of selective state-space layers: one packed input projection
``[gate | x | B | C | dt]``, a depthwise convolution over ``[x | B | C]`` (a packed part cut again),
per-head parameters (``dt_bias``, ``A_log``, ``D``), a per-channel scale buffer on the packed output,
a scan along time (``cumsum``), a gated norm
over groups of channels and an output projection. Sharding it needs every rule of the conv / scan
analysis at once: a wrong packing of the conv weight, a per-head parameter left whole or a norm
over the full width would change the logits or a gradient, which the verifier compares with the
unsharded model at tp 2 and 4, plain and sequence parallel.
"""

import warnings

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp.synth import explain, synthesize
from autotp.synth.fixpoint import analyse
from autotp.synth.queries import part_sizes
from autotp.synth.graph import Ref, add_node
from autotp.synth.ops import Break, _pad
from autotp.verifier import verify
from synth_toy import DIM, MLP, VOCAB, example_tokens

HEADS, HEAD_DIM, GROUPS, STATE, KERNEL = 8, 8, 4, 4, 3


class GroupedGatedNorm(nn.Module):
    """RMSNorm over groups of ``group_size`` channels, gated by ``silu(gate)``."""

    def __init__(self, width: int, group_size: int):
        super().__init__()
        self.weight = nn.Parameter(1 + 0.1 * torch.randn(width))
        self.group_size = group_size

    def forward(self, x, gate):
        x = x * F.silu(gate)
        grouped = x.view(*x.shape[:-1], -1, self.group_size)
        grouped = grouped * torch.rsqrt(grouped.pow(2).mean(-1, keepdim=True) + 1e-6)
        return self.weight * grouped.view(x.shape)


class ConvScanMixer(nn.Module):
    """in_proj (packed) -> depthwise conv1d -> per-head parameters -> cumsum scan -> gated grouped norm -> out_proj.

    The conv weight is read by this module's code (``F.conv1d(x, self.conv1d.weight)``), not by
    the conv module's forward; B and C have ``GROUPS`` groups shared by ``HEADS / GROUPS`` heads;
    ``scale`` is a fixed per-channel multiplier of the packed projection (a buffer).
    """

    def __init__(self, groups: int = GROUPS):
        super().__init__()
        self.inner, self.heads, self.groups = HEADS * HEAD_DIM, HEADS, groups
        self.conv_dim = self.inner + 2 * groups * STATE
        self.in_proj = nn.Linear(DIM, self.inner + self.conv_dim + HEADS, bias=False)
        self.register_buffer("scale", 0.5 + torch.rand(self.inner + self.conv_dim + HEADS))
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, KERNEL, groups=self.conv_dim, padding=KERNEL - 1)
        self.dt_bias = nn.Parameter(torch.randn(HEADS))
        self.A_log = nn.Parameter(0.1 * torch.randn(HEADS))
        self.D = nn.Parameter(torch.randn(HEADS))
        self.norm = GroupedGatedNorm(self.inner, self.inner // groups)
        self.out_proj = nn.Linear(self.inner, DIM, bias=False)

    def forward(self, h):
        b, t, _ = h.shape
        gate, xbc, dt = (self.in_proj(h) * self.scale).split([self.inner, self.conv_dim, self.heads], dim=-1)
        xbc = F.conv1d(xbc.transpose(1, 2), self.conv1d.weight, self.conv1d.bias,
                       padding=KERNEL - 1, groups=xbc.shape[-1])[..., :t]
        x, B, C = F.silu(xbc).transpose(1, 2).split([self.inner, self.groups * STATE, self.groups * STATE], dim=-1)
        x = x.reshape(b, t, -1, HEAD_DIM)
        B = B.reshape(b, t, -1, STATE).repeat_interleave(self.heads // self.groups, dim=2)
        C = C.reshape(b, t, -1, STATE).repeat_interleave(self.heads // self.groups, dim=2)
        dt = F.softplus(dt + self.dt_bias)  # (b, t, heads)
        decay = torch.cumsum(-torch.exp(self.A_log) * dt, dim=1)  # the scan's log-decay along time
        state = torch.cumsum((B * torch.exp(-decay)[..., None]).unsqueeze(-1) * x.unsqueeze(-2), dim=1)
        y = (C.unsqueeze(-1) * state).sum(-2) * torch.exp(decay)[..., None] + self.D[:, None] * x
        return self.out_proj(self.norm(y.reshape(b, t, -1), gate))


class ConvLinearAttention(nn.Module):
    """Linear attention with a data-dependent decay: packed qkv -> depthwise causal conv -> split
    into heads -> per-head decay (a ``(t, t)`` mask, ``tril``) -> gated grouped norm -> out.

    ``decay`` is per head; the decay rate comes from its own column Linear ``a``.
    """

    def __init__(self, heads: int = 4, head_dim: int = 16):
        super().__init__()
        self.width, self.head_dim = heads * head_dim, head_dim
        self.qkv = nn.Linear(DIM, 3 * self.width, bias=False)
        self.z, self.a = nn.Linear(DIM, self.width, bias=False), nn.Linear(DIM, heads, bias=False)
        self.conv1d = nn.Conv1d(3 * self.width, 3 * self.width, KERNEL, groups=3 * self.width, bias=False)
        self.decay = nn.Parameter(0.1 * torch.randn(heads))
        self.norm = GroupedGatedNorm(self.width, head_dim)
        self.out = nn.Linear(self.width, DIM, bias=False)

    def forward(self, h):
        b, t, _ = h.shape
        qkv = F.pad(self.qkv(h).transpose(1, 2), (KERNEL - 1, 0))
        qkv = F.silu(F.conv1d(qkv, self.conv1d.weight, groups=qkv.shape[1])).transpose(1, 2)
        q, k, v = (x.reshape(b, t, -1, self.head_dim) for x in qkv.split(self.width, dim=-1))
        log_decay = torch.cumsum(-F.softplus(self.a(h)) * self.decay.exp(), dim=1)  # (b, t, heads)
        mask = torch.tril(torch.exp(log_decay[:, :, None] - log_decay[:, None]).permute(0, 3, 1, 2))
        scores = torch.einsum("bthd,bshd->bhts", q, k) * mask
        y = torch.einsum("bhts,bshd->bthd", scores, v)
        return self.out(self.norm(y.reshape(b, t, -1), self.z(h)))


class SSMBlock(nn.Module):
    def __init__(self, mixer=ConvScanMixer):
        super().__init__()
        self.norm, self.mixer = nn.RMSNorm(DIM), mixer()

    def forward(self, x):
        return x + self.mixer(self.norm(x))


class SideBySideBlock(nn.Module):
    """A mixer and an MLP side by side on one norm, their sum added to the stream; with ``tail`` a
    sequential MLP follows on a second norm (a hybrid layer: parallel mixer and attention, then the
    feed-forward)."""

    def __init__(self, mixer=ConvScanMixer, tail: bool = True):
        super().__init__()
        self.norm, self.mixer, self.mlp = nn.RMSNorm(DIM), mixer(), MLP()
        self.tail_norm, self.tail = (nn.RMSNorm(DIM), MLP()) if tail else (None, None)

    def forward(self, x):
        h = self.norm(x)
        x = x + (self.mixer(h) + self.mlp(h))
        return x if self.tail is None else x + self.tail(self.tail_norm(x))


class SSMStack(nn.Module):
    def __init__(self, layers: int = 2, mixer=ConvScanMixer, block=SSMBlock):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.layers = nn.ModuleList(block(mixer) for _ in range(layers))
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, tokens):
        h = self.embed(tokens)
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return SSMStack()


@pytest.fixture(scope="module")
def attention_model():
    torch.manual_seed(0)
    return SSMStack(mixer=ConvLinearAttention)


def _verify_near_one_over_tp(model, tp, sequence_parallel):
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp,
                      sequence_parallel=sequence_parallel, verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp, example_inputs=(example_tokens(),))
    assert report.ok, str(report)
    # Only the two small RMSNorms per layer and the final one stay whole: under 1% of the model.
    assert all(abs(f - 1 / tp) < 0.01 for f in report.param_fraction), report.param_fraction


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_conv_scan_mixer_is_sharded_and_exact(model, tp, sequence_parallel):
    """Would catch: the conv weight sharded contiguously instead of part by part ([x|B|C] mixed
    across ranks), a per-head parameter or the grouped norm's weight left whole, B/C groups cut
    unlike the heads that read them, or the mixer left whole (parameter fraction far above 1/tp)."""
    _verify_near_one_over_tp(model, tp, sequence_parallel)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_conv_linear_attention_is_sharded_and_exact(attention_model, tp, sequence_parallel):
    """Would catch: the conv over packed q|k|v sharded contiguously, the per-head decay left whole
    or cut unlike the decay-rate Linear's heads, or the causal (t, t) mask read as head-mixing."""
    _verify_near_one_over_tp(attention_model, tp, sequence_parallel)


def _sharded_fraction(model, tp: int) -> float:
    """1/tp of the parameters, plus what every rank holds whole beyond that: the stream's norms and
    the row Linears' biases. One-group B and C hold nothing more: their in_proj rows and conv
    channels are sharded like the other parts and gathered each forward."""
    total = sum(p.numel() for p in model.parameters())
    whole = sum(p.numel() for name, p in model.named_parameters()
                if name.endswith("c_proj.bias") or isinstance(model.get_submodule(name.rpartition(".")[0]), nn.RMSNorm))
    return (total / tp + whole * (1 - 1 / tp)) / total


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
@pytest.mark.parametrize("tail", [True, False], ids=["tail", "no_tail"])
def test_mixer_beside_an_mlp_with_one_state_group_is_sharded_and_exact(tp, sequence_parallel, tail):
    """A scaled packed projection (a per-feature buffer times in_proj before the split) with B and C
    in one group, in a layer whose mixer and MLP run side by side. Would catch: the sum of the two
    branches kept a DTensor stream (plain TP) that a sequential MLP's reduced output is then added
    to (the sharded run raised), the scale not expanded and packed like the projection's rows, the
    B / C rows or conv channels held as copies (above the fraction; the backward summing their
    gradients beyond the forward's bytes), or the mixer kept whole (it was, at 0.9 of the
    parameters per rank on a hybrid model)."""
    torch.manual_seed(0)
    model = SSMStack(mixer=lambda: ConvScanMixer(groups=1), block=lambda mixer: SideBySideBlock(mixer, tail))
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=sequence_parallel,
                      verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp, example_inputs=(example_tokens(),))
    assert report.ok, str(report)
    expected = _sharded_fraction(model, tp)
    assert all(abs(f - expected) < 1e-6 for f in report.param_fraction), (report.param_fraction, expected)
    assert report.comm_volume_backward <= report.comm_volume, report  # no copies' gradients summed
    if not sequence_parallel:  # one reduction for both branches only where nothing plain joins the stream later
        assert (getattr(plan.get("layers.*"), "stream", None) == 0) is not tail


def test_plain_output_after_side_by_side_branches_keeps_one_reduction_per_branch():
    """Default-deny for the one-reduction stream: where a sequential MLP's reduced (plain) output
    joins the stream after the side-by-side branches, the layer does not run on a DTensor stream
    and each branch reduces its own output. Would catch the stream block kept there (plain tp=2:
    the sharded run raised on the tail's residual add), with groups tp divides (no copies)."""
    torch.manual_seed(0)
    model = SSMStack(block=SideBySideBlock)
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=2, verify=False)
    assert "layers.*" not in plan
    assert {type(plan[f"layers.*.{m}"]).__name__ for m in ("mixer.out_proj", "mlp.c_proj")} == {"RowwiseParallel"}
    _verify_near_one_over_tp(model, 2, False)


def test_conv_weight_is_packed_with_the_parts_it_convolves(model):
    """The depthwise conv over ``[x | B | C]`` is sharded part by part, with the mixer (whose code
    reads it), and the per-head parameters are sharded on their only dim."""
    style = synthesize(model, example_inputs=(example_tokens(),), tp_size=2, verify=False)["layers.*.mixer"]
    part = (HEADS * HEAD_DIM, GROUPS * STATE, GROUPS * STATE)
    assert style.packed == {"conv1d.weight": part, "conv1d.bias": part, "scale": (HEADS * HEAD_DIM, *part, HEADS)}
    assert style.shard_dims == {"A_log": 0, "D": 0, "dt_bias": 0, "conv1d.weight": 0, "conv1d.bias": 0, "scale": 0}


class GroupMixingConv(ConvScanMixer):
    """The same mixer with a convolution that mixes channels (``groups=1``): not shardable by channel."""

    def __init__(self):
        super().__init__()
        self.mix = nn.Conv1d(self.conv_dim, self.conv_dim, 1)

    def forward(self, h):
        gate, xbc, dt = self.in_proj(h).split([self.inner, self.conv_dim, self.heads], dim=-1)
        xbc = self.mix(xbc.transpose(1, 2)).transpose(1, 2)
        x, _, _ = xbc.split([self.inner, self.groups * STATE, self.groups * STATE], dim=-1)
        return self.out_proj(self.norm(x * self.dt_bias.repeat_interleave(HEAD_DIM), gate))


def test_channel_mixing_conv_keeps_its_projection_whole():
    """Default-deny: a convolution with groups < channels needs every channel, so the projection
    feeding it is left whole, with the conv named in the reason."""
    torch.manual_seed(0)
    model = SSMStack()
    for layer in model.layers:
        layer.mixer = GroupMixingConv()
    records = {r.key: r for r in explain(model, example_inputs=(example_tokens(),), tp_size=2)}
    assert records["layers.*.mixer.in_proj"].role == "replicate"
    assert "mixes the channels" in records["layers.*.mixer.in_proj"].reason


class RowOverPackedParts(ConvScanMixer):
    """Also reads ``[x | B | C]`` whole with a row Linear: each rank holds its share of every part
    there, not one contiguous block, so a contiguous row split would pair inputs with the wrong
    weight columns."""

    def __init__(self):
        super().__init__()
        self.side = nn.Linear(self.conv_dim, DIM, bias=False)

    def forward(self, h):
        gate, xbc, dt = self.in_proj(h).split([self.inner, self.conv_dim, self.heads], dim=-1)
        x, B, C = xbc.split([self.inner, self.groups * STATE, self.groups * STATE], dim=-1)
        mixed = x * (B * C).repeat_interleave(self.inner // (self.groups * STATE), dim=-1)
        return self.out_proj(self.norm(mixed, gate)) + self.side(xbc)


def test_row_over_several_packed_parts_keeps_the_projection_whole():
    """Default-deny: a tensor holding several parts of a packed output may be cut at the parts or
    kept as it is, never read by an op that assumes one contiguous block (here a row Linear)."""
    torch.manual_seed(0)
    model = SSMStack()
    for layer in model.layers:
        layer.mixer = RowOverPackedParts()
    records = {r.key: r for r in explain(model, example_inputs=(example_tokens(),), tp_size=2)}
    assert records["layers.*.mixer.in_proj"].role == "replicate"
    assert "packed parts" in records["layers.*.mixer.in_proj"].reason


class ModuleConvMixer(ConvScanMixer):
    """Calls the conv module itself: its ``groups`` attribute holds the global channel count."""

    def forward(self, h):
        t = h.shape[1]
        gate, xbc, dt = self.in_proj(h).split([self.inner, self.conv_dim, self.heads], dim=-1)
        xbc = F.silu(self.conv1d(xbc.transpose(1, 2))[..., :t]).transpose(1, 2)
        x, B, C = xbc.split([self.inner, self.groups * STATE, self.groups * STATE], dim=-1)
        return self.out_proj(self.norm(x * (B * C).repeat_interleave(self.inner // (self.groups * STATE), dim=-1), gate))


def test_conv_module_with_global_groups_is_not_sharded():
    """Default-deny: ``nn.Conv1d`` run at per-rank channels with its global ``groups`` cannot work,
    and no attribute of the cutting module fixes it, so the projection stays whole."""
    torch.manual_seed(0)
    model = SSMStack()
    for layer in model.layers:
        layer.mixer = ModuleConvMixer()
    records = {r.key: r for r in explain(model, example_inputs=(example_tokens(),), tp_size=2)}
    assert records["layers.*.mixer.in_proj"].role == "replicate"


# Hand-built graphs: one rule each.

def _conv_graph(groups: int, time_pad: int = 0):
    """x -> up (Linear 8->16) -> transpose -> conv1d(groups) -> pad(time) -> transpose -> down."""
    g = nx.DiGraph()
    time = 4 + time_pad
    add_node(g, "x", "placeholder", kind="input", shape=(2, 3, 8))
    add_node(g, "w_up", "placeholder", kind="param", param="up.weight", shape=(16, 8))
    add_node(g, "w_conv", "placeholder", kind="param", param="conv.weight", shape=(16, 16 // groups, 2))
    add_node(g, "w_down", "placeholder", kind="param", param="down.weight", shape=(8, 16))
    add_node(g, "up", "linear", (Ref("x"), Ref("w_up")), shape=(2, 3, 16), module="up")
    add_node(g, "t", "transpose", (Ref("up"), 1, 2), shape=(2, 16, 3))
    add_node(g, "c", "conv1d", (Ref("t"), Ref("w_conv"), None, [1], [1], [1], groups), shape=(2, 16, 4))
    add_node(g, "p", "pad", (Ref("c"), [time_pad, 0]), shape=(2, 16, time))
    add_node(g, "t2", "transpose", (Ref("p"), 1, 2), shape=(2, time, 16))
    add_node(g, "down", "linear", (Ref("t2"), Ref("w_down")), shape=(2, time, 8), module="down")
    add_node(g, "out", "output", ((Ref("down"),),), kind="output")
    return g


def test_depthwise_conv_keeps_the_channel_shard_and_shards_its_weight():
    flow, dropped = analyse(_conv_graph(groups=16, time_pad=1))
    assert not dropped and flow.state["c"].dim == 1 and flow.state["p"].dim == 1
    assert flow.param_shards == {"w_conv": 0}


def test_grouped_conv_keeps_whole_groups_and_a_full_conv_breaks():
    """4 groups of 4 channels keep the shard, with the group count among the extents tp must
    divide; one group (every output channel reads every input channel) mixes the shard."""
    flow, dropped = analyse(_conv_graph(groups=4))
    assert "up" not in dropped and flow.extent["up"] == 4 and flow.param_shards == {"w_conv": 0}
    _, dropped = analyse(_conv_graph(groups=1))
    assert "mixes the channels" in dropped["up"]


def test_pad_of_the_sharded_dim_breaks():
    """Padding the channel dim would add channels on one rank only."""
    g = nx.DiGraph()
    add_node(g, "x", "placeholder", kind="input", shape=(2, 16, 3))
    add_node(g, "p", "pad", (Ref("x"), [0, 0, 1, 1]), shape=(2, 18, 3))
    assert isinstance(_pad(g, "p", {"x": 1}, None), Break)


def test_nested_cuts_are_placed_in_the_projection_output():
    """A part cut again: its cuts land at the part's offset, and the finest parts are the sizes."""
    g = nx.DiGraph()
    add_node(g, "x", "placeholder", kind="input", shape=(2, 3, 8))
    add_node(g, "w_up", "placeholder", kind="param", param="up.weight", shape=(24, 8))
    add_node(g, "w_down", "placeholder", kind="param", param="down.weight", shape=(8, 8))
    add_node(g, "up", "linear", (Ref("x"), Ref("w_up")), shape=(2, 3, 24), module="up")
    add_node(g, "s", "split_with_sizes", (Ref("up"), [8, 16], -1))
    add_node(g, "gate", "getitem", (Ref("s"), 0), shape=(2, 3, 8))
    add_node(g, "rest", "getitem", (Ref("s"), 1), shape=(2, 3, 16))
    add_node(g, "s2", "split_with_sizes", (Ref("rest"), [8, 8], -1))
    add_node(g, "a", "getitem", (Ref("s2"), 0), shape=(2, 3, 8))
    add_node(g, "b", "getitem", (Ref("s2"), 1), shape=(2, 3, 8))
    add_node(g, "m", "mul", (Ref("a"), Ref("b")), shape=(2, 3, 8))
    add_node(g, "m2", "mul", (Ref("m"), Ref("gate")), shape=(2, 3, 8))
    add_node(g, "down", "linear", (Ref("m2"), Ref("w_down")), shape=(2, 3, 8), module="down")
    add_node(g, "out", "output", ((Ref("down"),),), kind="output")
    flow, dropped = analyse(g)
    assert not dropped
    assert sorted(set(flow.splits["up"])) == [(0, 8), (8, 16), (8, 24), (16, 24)]
    assert part_sizes(flow.splits["up"], 24) == (8, 8, 8)


def test_fewer_groups_than_ranks_keep_the_projection_whole_with_the_reason():
    """B and C in 2 groups cannot be cut over 4 ranks (a rank would hold half a group): default-deny,
    and the reason names the group count and tp rather than only the cut sizes."""
    torch.manual_seed(0)
    model = SSMStack(mixer=lambda: ConvScanMixer(groups=2))
    records = {r.key: r for r in explain(model, example_inputs=(example_tokens(),), tp_size=4)}
    assert records["layers.*.mixer.in_proj"].role == "replicate"
    assert "only 2 (heads or groups), which tp=4 does not divide" in records["layers.*.mixer.in_proj"].reason
