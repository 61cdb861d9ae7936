"""A grouped convolution over a ``cat`` of separately sharded projections keeps its groups local.

The mixer joins its query and key projections along the features (each rank then holds its share
of q, then its share of k), mixes them in time by a causal depthwise convolution and then by a
grouped one with a group per head, cuts the result back at the pieces and attends. When every
group lies inside one piece and tp divides each piece's groups, a rank's channels are whole
groups, in order, and both convolutions' weights are packed like the pieces. A group that
straddles the two pieces (or a convolution that changes the channel count of such a layout) keeps
the projections whole. Every plan is verified on logits and every gradient against the unsharded
model.
"""


import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp.synth import explain
from synth_toy import DIM, example_tokens
from test_joined_shards import _plan_and_report  # synthesize, then verify (not asserted)
from test_ssm_mixer import SSMStack

HEAD_DIM, Q_HEADS, K_HEADS, KERNEL = 8, 8, 4, 2


class JoinedGroupedConvMixer(nn.Module):
    """q | k joined -> depthwise conv -> grouped conv (``groups`` of the joined channels) -> cut
    back -> grouped-query attention with a plain v -> out."""

    def __init__(self, groups: int = Q_HEADS + K_HEADS, multiplier: int = 1):
        super().__init__()
        self.q_width, self.k_width = Q_HEADS * HEAD_DIM, K_HEADS * HEAD_DIM
        channels = self.q_width + self.k_width
        self.q = nn.Linear(DIM, self.q_width, bias=False)
        self.k = nn.Linear(DIM, self.k_width, bias=False)
        self.v = nn.Linear(DIM, self.k_width, bias=False)
        self.depthwise = nn.Conv1d(channels, channels, KERNEL, groups=channels)
        self.grouped = nn.Conv1d(channels, channels * multiplier, KERNEL, groups=groups)
        self.out = nn.Linear(self.q_width, DIM, bias=False)

    def forward(self, h):
        b, t, _ = h.shape
        q, k = self.q(h), self.k(h)
        qk = F.pad(torch.cat([q, k], dim=-1).transpose(1, 2), (2 * (KERNEL - 1), 0))
        qk = self.grouped(self.depthwise(qk)).transpose(1, 2)
        width = q.shape[-1]  # read from the tensor: the per-rank width on each rank
        q = (qk[..., :width] + q).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        k = (qk[..., width:width + k.shape[-1]] + k).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        v = self.v(h).view(b, t, -1, HEAD_DIM).transpose(1, 2)
        repeat = Q_HEADS // K_HEADS
        k, v = k.repeat_interleave(repeat, dim=1), v.repeat_interleave(repeat, dim=1)
        out = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(out.transpose(1, 2).reshape(b, t, -1))


class StraddlingGroups(JoinedGroupedConvMixer):
    """Groups of 24 channels over pieces of 64 and 32: one group holds the end of q and the start
    of k, which no rank holds side by side."""

    def __init__(self):
        super().__init__(groups=4)


class WidenedJoin(JoinedGroupedConvMixer):
    """A grouped convolution making twice the channels of the joined pieces (its extra channels are
    dropped by the cut back), so the pieces' layout does not carry over to its output."""

    def __init__(self):
        super().__init__(multiplier=2)


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return SSMStack(mixer=JoinedGroupedConvMixer)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_grouped_conv_over_joined_pieces_is_sharded_and_exact(model, tp, sequence_parallel):
    """Would catch: the grouped conv's weight sharded contiguously instead of packed like q | k, its
    group count left global on each rank, the cut back made at the global width, or the mixer
    left whole (the joined shard refused at the grouped convolution)."""
    plan, report = _plan_and_report(model, tp, sequence_parallel)
    assert report.ok, str(report)
    assert all(abs(f - 1 / tp) < 0.03 for f in report.param_fraction), report.param_fraction
    assert {"layers.*.mixer.q", "layers.*.mixer.k", "layers.*.mixer.out"} <= set(plan), sorted(plan)
    pieces = (Q_HEADS * HEAD_DIM, K_HEADS * HEAD_DIM)
    assert plan["layers.*.mixer.grouped"].packed == {"weight": pieces, "bias": pieces}, plan
    assert set(plan["layers.*.mixer"].names) == {"depthwise.groups", "grouped.groups"}, plan


@pytest.mark.parametrize("mixer, why", [(StraddlingGroups, "from layers.*.mixer.q is not whole groups"),
                                        (WidenedJoin, "makes 192 channels from 96")])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_groups_that_do_not_fit_the_pieces_keep_q_and_k_whole(mixer, why, sequence_parallel):
    """Default-deny: a group straddling q and k (or a conv whose output channels are not the
    joined ones) has no per-rank layout; sharded anyway, the plan would mix other channels than
    the model does (the verifier compares logits and every gradient)."""
    torch.manual_seed(0)
    model = SSMStack(mixer=mixer)
    plan, report = _plan_and_report(model, 2, sequence_parallel)
    assert report.ok, str(report)
    assert not {"layers.*.mixer.q", "layers.*.mixer.k"} & set(plan), sorted(plan)
    reasons = {r.key: r.reason for r in explain(model, example_inputs=(example_tokens(),), tp_size=2)}
    assert why in reasons["layers.*.mixer.q"], reasons
