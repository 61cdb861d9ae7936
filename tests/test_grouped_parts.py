"""Parts with fewer groups than ranks are held as one group's copy per rank, the rest sharded.

A packed projection whose part is split into ``G < tp`` groups broadcast to the heads (B and C of
a state-space mixer with one or two state groups; the k / v of a fused qkv with one kv head)
cannot be cut over tp ranks. Each rank instead holds the group its heads read, the copies'
gradients summed. Each model is checked against the unsharded one on the logits and every
gradient, at tp 2 and 4, plain and sequence parallel, and must hold about 1/tp of the parameters.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp.styles import GroupCopies
from autotp.synth import explain, synthesize
from autotp.styles.group_copies import copy_index
from autotp.verifier import verify
from synth_toy import DIM, VOCAB, example_tokens
from test_ssm_mixer import GroupedGatedNorm as GatedNorm
from test_ssm_mixer import SSMStack

HEADS, HEAD_DIM, STATE, KERNEL = 8, 8, 4, 3


class GroupedScanMixer(nn.Module):
    """in_proj ``[gate | x | B | C | dt]`` -> depthwise conv over ``[x | B | C]`` -> B, C in ``groups``
    groups repeated to the heads -> a scan along time -> gated norm -> out_proj."""

    def __init__(self, groups: int, norm_group: int):
        super().__init__()
        self.inner, self.heads, self.n_groups, self.state = HEADS * HEAD_DIM, HEADS, groups, STATE
        self.conv_dim = self.inner + 2 * groups * STATE
        self.in_proj = nn.Linear(DIM, self.inner + self.conv_dim + HEADS, bias=False)
        self.conv1d = nn.Conv1d(self.conv_dim, self.conv_dim, KERNEL, groups=self.conv_dim, padding=KERNEL - 1)
        self.dt_bias = nn.Parameter(torch.randn(HEADS))
        self.A_log = nn.Parameter(0.1 * torch.randn(HEADS))
        self.D = nn.Parameter(torch.randn(HEADS))
        self.norm = GatedNorm(self.inner, norm_group)
        self.out_proj = nn.Linear(self.inner, DIM, bias=False)

    def forward(self, h):
        b, t, _ = h.shape
        gate, xbc, dt = self.in_proj(h).split([self.inner, self.conv_dim, self.heads], dim=-1)
        xbc = F.conv1d(xbc.transpose(1, 2), self.conv1d.weight, self.conv1d.bias, padding=KERNEL - 1,
                       groups=xbc.shape[-1])
        xbc = F.silu(xbc[..., :t].transpose(1, 2))
        x, B, C = xbc.split([self.inner, self.n_groups * self.state, self.n_groups * self.state], dim=-1)
        x = x.reshape(b, t, -1, HEAD_DIM)
        B = B.reshape(b, t, -1, self.state).repeat_interleave(self.heads // self.n_groups, dim=2)
        C = C.reshape(b, t, -1, self.state).repeat_interleave(self.heads // self.n_groups, dim=2)
        dt = F.softplus(dt + self.dt_bias)
        decay = torch.cumsum(-torch.exp(self.A_log) * dt, dim=1)
        state = torch.cumsum((B * torch.exp(-decay)[..., None]).unsqueeze(-1) * x.unsqueeze(-2), dim=1)
        y = torch.einsum("bthn,bthnp->bthp", C, state) * torch.exp(decay)[..., None] + self.D[:, None] * x
        return self.out_proj(self.norm(y.reshape(b, t, -1), gate))


class FusedQKVAttention(nn.Module):
    """One fused ``[q | k | v]`` Linear with ``kv_heads`` kv heads, repeated to the query heads."""

    def __init__(self, kv_heads: int = 1):
        super().__init__()
        self.heads, self.kv_heads = HEADS, kv_heads
        self.qkv = nn.Linear(DIM, (HEADS + 2 * kv_heads) * HEAD_DIM)
        self.o_proj = nn.Linear(HEADS * HEAD_DIM, DIM, bias=False)

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = self.qkv(h).split([self.heads * HEAD_DIM, self.kv_heads * HEAD_DIM, self.kv_heads * HEAD_DIM], -1)
        q = q.view(b, t, -1, HEAD_DIM).transpose(1, 2)
        k = k.view(b, t, self.kv_heads, HEAD_DIM).transpose(1, 2).repeat_interleave(self.heads // self.kv_heads, dim=1)
        v = v.view(b, t, self.kv_heads, HEAD_DIM).transpose(1, 2).repeat_interleave(self.heads // self.kv_heads, dim=1)
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.o_proj(y.transpose(1, 2).reshape(b, t, -1))


def _model(mixer):
    torch.manual_seed(0)
    return SSMStack(mixer=mixer)


def _verify_near(model, tp, sequence_parallel, fraction, gather_copies=True, report_out=None, tokens=None):
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=sequence_parallel,
                      gather_copies=gather_copies, verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp, example_inputs=(example_tokens() if tokens is None else tokens,))
    assert report.ok, str(report)
    assert all(abs(f - fraction) < 0.02 for f in report.param_fraction), (report.param_fraction, fraction)
    if report_out is not None:
        report_out.append(report)
    return plan


def _copied_fraction(model, tp, copied: int) -> float:
    """1/tp of the parameters, plus the ``copied`` parameters each rank holds beyond its 1/tp
    share of them (a group's copy: ``copied`` is the grouped rows' parameters, held 1/G each)."""
    total = sum(p.numel() for p in model.parameters())
    return (total / tp + copied) / total


MODES = [pytest.param(False, id="plain"), pytest.param(True, id="sp")]


@pytest.mark.parametrize("sequence_parallel", MODES)
@pytest.mark.parametrize("tp", [2, 4])
def test_one_state_group_is_copied_per_rank(tp, sequence_parallel):
    """Would catch: B / C of one group cut over the state dim (the scan contracting over a sharded
    index), a copy's gradient left as its ranks' share (copies drifting apart), the conv's B / C
    channels not expanded like the projection's rows, the norm over the whole width left local,
    or the mixer kept whole (parameter fraction far above 1/tp)."""
    model = _model(lambda: GroupedScanMixer(groups=1, norm_group=HEADS * HEAD_DIM))
    plan = _verify_near(model, tp, sequence_parallel, 1 / tp)  # B and C: 2 of 152 rows per layer
    assert isinstance(plan["layers.*.mixer.in_proj"], GroupCopies)


@pytest.mark.parametrize("sequence_parallel", MODES)
def test_two_state_groups_at_tp4_are_copied_per_rank(sequence_parallel):
    """Would catch: two groups over four ranks cut in halves, or each rank given the wrong group
    (rank r must read group r * G // tp, the one its heads are repeated from)."""
    model = _model(lambda: GroupedScanMixer(groups=2, norm_group=HEAD_DIM))
    _verify_near(model, 4, sequence_parallel, 1 / 4)


@pytest.mark.parametrize("sequence_parallel", MODES)
@pytest.mark.parametrize("tp", [2, 4])
def test_fused_qkv_with_one_kv_head_is_copied_per_rank(tp, sequence_parallel):
    """``gather_copies=False``: would catch the one kv head's rows cut over ranks (a head in
    pieces), its copies' weight and bias gradients not summed, or the fused projection kept whole."""
    model = _model(FusedQKVAttention)
    # Each rank holds the whole kv head (k and v rows with their biases), not 1/tp of it.
    kv = 2 * HEAD_DIM * (DIM + 1) * len(model.layers)
    plan = _verify_near(model, tp, sequence_parallel, _copied_fraction(model, tp, kv - kv / tp), gather_copies=False)
    assert isinstance(plan["layers.*.mixer.qkv"], GroupCopies) and not plan["layers.*.mixer.qkv"].gather


@pytest.mark.parametrize("sequence_parallel", MODES)
@pytest.mark.parametrize("groups, tp", [pytest.param(0, 2, id="one-kv-head-tp2"), pytest.param(0, 4, id="one-kv-head-tp4"),
                                        pytest.param(1, 2, id="one-state-group-tp2"),
                                        pytest.param(1, 4, id="one-state-group-tp4"),
                                        pytest.param(2, 4, id="two-state-groups-tp4")])
@pytest.mark.parametrize("long", [pytest.param(False, id="few-tokens"), pytest.param(True, id="many-tokens")])
def test_gathered_group_parts_move_as_many_bytes_back_as_forward(groups, tp, sequence_parallel, long):
    """By default a Linear's parts with fewer groups than ranks are sharded like its other parts
    and gathered each forward, each rank cutting its group (``GroupCopies(gather=True)``): the
    backward reduce-scatters the part's gradient instead of all-reducing the copies' weight
    gradients. The depthwise conv's B / C channels are sharded the same way, their weight rows
    gathered each forward (a few kernel taps per channel), so the backward moves exactly the
    forward's bytes. Would catch a rank cutting the wrong group, the gathered gradient taken whole
    (only this rank's heads' share reaching the weights), or the rows still copied (the fraction
    above 1/tp, the backward above the forward). ``groups=0``: the fused qkv with one kv head.
    ``long``: a batch with more tokens than the model width, where the parts' weight rows are
    gathered (and the parts recomputed from them) rather than their outputs."""
    mixer = FusedQKVAttention if not groups else (lambda: GroupedScanMixer(groups=groups, norm_group=HEAD_DIM))
    model = _model(mixer)
    tokens = torch.randint(0, VOCAB, (DIM // 8, 12)) if long else example_tokens()  # 96 tokens: sequences short
    assert (tokens.numel() > DIM) == long
    reports = []
    plan = _verify_near(model, tp, sequence_parallel, 1 / tp, report_out=reports, tokens=tokens)
    linear = plan["layers.*.mixer.in_proj" if groups else "layers.*.mixer.qkv"]
    assert isinstance(linear, GroupCopies) and linear.gather, linear
    if groups:  # the depthwise conv's B / C channels: sharded and gathered too, not copies
        conv = plan["layers.*.mixer"]
        assert isinstance(conv, GroupCopies) and conv.gather and conv.expanded_sizes(tp) == {}, conv
    assert reports[0].comm_volume_backward == reports[0].comm_volume, reports[0]


def test_gathered_part_that_tp_cannot_cut_is_held_as_copies():
    """``GroupCopies(gather=True)`` where tp does not divide a grouped part's rows (6-row k and v
    heads beside 24 query rows, tp=4) holds each rank's copy instead, as ``gather=False`` does: would
    catch the plan failing at apply, or rows cut unevenly (a piece of a head per rank)."""
    from autotp._simulate import simulated_mesh
    from autotp.apply import apply_plan
    from autotp.styles import Colwise

    rows = (0, 36, ((24, 30, 1), (30, 36, 1)))
    style = GroupCopies(base=Colwise(sizes=(24, 24, 24)), rows={"weight": rows, "bias": rows},
                        gather=True)
    assert style.expanded_sizes(4) == {"weight": 72, "bias": 72} and style.expanded_sizes(2) == {}
    model = nn.Sequential(nn.Linear(DIM, 36))
    with simulated_mesh(4) as mesh:
        apply_plan(model, mesh, {"0": style})
        assert tuple(model[0].weight.to_local().shape) == (6 + 6 + 6, DIM)  # 6 query rows, whole k and v


def test_copy_index_gives_each_rank_its_group():
    """Rank r's block of the expanded rows is group r * G // tp of the part; other rows untouched."""
    assert copy_index(6, ((2, 6, 2),), 4).tolist() == [0, 1, 2, 3, 2, 3, 4, 5, 4, 5]


class GroupsReadWhole(GroupedScanMixer):
    """Also reads B whole (its mean scales the output): a rank holding one group's copy would
    read only that group there, so the projection must stay whole."""

    def forward(self, h):
        _, xbc, _ = self.in_proj(h).split([self.inner, self.conv_dim, self.heads], dim=-1)
        B = xbc[..., self.inner:self.inner + self.n_groups * self.state]
        return super().forward(h) * B.mean(-1, keepdim=True)


@pytest.mark.parametrize("groups", [1, 2])
def test_group_read_other_than_by_its_heads_keeps_the_projection_whole(groups):
    """Default-deny: a part read whole by a second call of the projection keeps the projection whole,
    copied (one group) or cut (two groups, tp=2). Would catch the second call's shard being dropped
    while the first call's kept the module sharded (was silently wrong: in_proj's gradient off)."""
    model = _model(lambda: GroupsReadWhole(groups=groups, norm_group=HEAD_DIM))
    records = {r.key: r for r in explain(model, example_inputs=(example_tokens(),), tp_size=2)}
    assert records["layers.*.mixer.in_proj"].role == "replicate"


# Hand-built graphs: which parts the rule finds.

def _grouped_graph(extra_reader: bool = False):
    """x -> up (Linear 8 -> 12) -> split [8, 4] -> the 4-wide part viewed into (1 group, 4) ->
    repeat_interleave(2) to the heads of the 8-wide part -> mul -> down."""
    from autotp.synth.graph import Ref, add_node
    import networkx as nx

    g = nx.DiGraph()
    add_node(g, "x", "placeholder", kind="input", shape=(2, 3, 8))
    add_node(g, "w_up", "placeholder", kind="param", param="up.weight", shape=(12, 8))
    add_node(g, "w_down", "placeholder", kind="param", param="down.weight", shape=(8, 8))
    add_node(g, "up", "linear", (Ref("x"), Ref("w_up")), shape=(2, 3, 12), module="up")
    add_node(g, "s", "split_with_sizes", (Ref("up"), [8, 4], -1))
    add_node(g, "h", "getitem", (Ref("s"), 0), shape=(2, 3, 8))
    add_node(g, "b", "getitem", (Ref("s"), 1), shape=(2, 3, 4))
    add_node(g, "hv", "view", (Ref("h"), [2, 3, 2, 4]), shape=(2, 3, 2, 4))
    add_node(g, "bv", "view", (Ref("b"), [2, 3, 1, 4]), shape=(2, 3, 1, 4))
    add_node(g, "br", "repeat_interleave", (Ref("bv"), 2, 2), shape=(2, 3, 2, 4))
    add_node(g, "m", "mul", (Ref("hv"), Ref("br")), shape=(2, 3, 2, 4))
    add_node(g, "mv", "view", (Ref("m"), [2, 3, 8]), shape=(2, 3, 8))
    add_node(g, "down", "linear", (Ref("mv"), Ref("w_down")), shape=(2, 3, 8), module="down")
    outputs = [Ref("down")]
    if extra_reader:
        add_node(g, "bs", "sum", (Ref("bv"), [-1]), shape=(2, 3, 1))
        outputs.append(Ref("bs"))
    add_node(g, "out", "output", (tuple(outputs),), kind="output")
    return g


def test_part_viewed_into_fewer_groups_than_tp_is_found():
    """The 4-wide part in one group, repeated to the heads, is a grouped part at tp 2 and 4."""
    from autotp.synth.groups import GroupedPart, grouped_parts

    assert grouped_parts(_grouped_graph(), 2) == [GroupedPart("up", 8, 12, 1)]
    assert grouped_parts(_grouped_graph(), 4) == [GroupedPart("up", 8, 12, 1)]


def test_group_read_by_more_than_its_broadcast_is_not_a_grouped_part():
    """Default-deny: a group also reduced elsewhere is not copied (a copy read whole there)."""
    from autotp.synth.groups import grouped_parts

    assert grouped_parts(_grouped_graph(extra_reader=True), 2) == []


@pytest.mark.parametrize("tp", [2, 4])
def test_group_copies_are_proven_on_a_meta_model(tp):
    """A model on meta (a real size planned without weights) has no values for the equivalence
    proof: the mixer alone is made real with random weights, on random inputs of its shapes. The
    plan must be the one the same model gets on the CPU; would catch the mixer kept whole on meta
    (real-size Bamba and Falcon-H1 stayed at 0.67 / 0.90 of the parameters per rank at tp=2)."""
    make = lambda: _model(lambda: GroupedScanMixer(groups=1, norm_group=HEADS * HEAD_DIM))  # noqa: E731
    on_cpu = synthesize(make(), example_inputs=(example_tokens(),), tp_size=tp, verify=False)
    with torch.device("meta"):
        meta = make()
    on_meta = synthesize(meta, example_inputs=(example_tokens().to("meta"),), tp_size=tp, verify=False)
    assert isinstance(on_meta["layers.*.mixer.in_proj"], GroupCopies), on_meta
    assert {k: repr(v) for k, v in on_meta.items()} == {k: repr(v) for k, v in on_cpu.items()}


def test_the_expansion_is_the_pipelines_last_logged_stage(caplog):
    """The group-copy expansion runs inside the pipeline as its last stage, logged with the roles it
    changed; without it (``expand_groups=False``) the grouped projection keeps no column role."""
    import logging

    from autotp.synth.pipeline import run

    model = _model(lambda: GroupedScanMixer(groups=1, norm_group=HEADS * HEAD_DIM))
    with caplog.at_level(logging.INFO, logger="autotp.synth.pipeline"):
        expanded = run(model, example_inputs=(example_tokens(),), tp_size=2)
    assert any(r.getMessage().startswith("group_copy_expansion: ") for r in caplog.records), caplog.text
    assert expanded.copies and expanded.roles["layers.0.mixer.in_proj"].kind == "packed_column", expanded.roles
    plain = run(model, example_inputs=(example_tokens(),), tp_size=2, expand_groups=False)
    assert not plain.copies and getattr(plain.roles.get("layers.0.mixer.in_proj"), "kind", None) != "packed_column"
