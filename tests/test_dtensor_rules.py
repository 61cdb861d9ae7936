"""Ops outside autotp's table keep the shard where DTensor's own strategy keeps it without moving data.

A mixer between a column and a row Linear runs ops autotp has no rule for: ``flip`` and ``roll``
along time, ``logcumsumexp`` and ``cummax`` along time, ``narrow`` along time, ``movedim``,
``logaddexp`` of two sharded tensors and ``erfinv``, each on channel-sharded activations. DTensor's
strategy for each, asked on shapes alone, keeps ``Shard`` on the channels with no redistribution,
so the shard goes on (:mod:`autotp.synth.dtensor_rules`). The near misses stay whole: the same ops
along the sharded channels (DTensor would gather them) and an op with no strategy at all. A whole
buffer DTensor would slice to the rank's channels gets no per-rank styles, but the mixer runs on
DTensors (:class:`autotp.styles.DTensorRegion`), where that slice is what DTensor does. Every plan
is verified on logits and every gradient at tp 2 and 4, plain and sequence-parallel.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

from tests.synth_toy import DIM
from tests.test_attention_variants import Model
from tests.test_split_experts import synthesize_and_verify

WIDTH = 64


class TimeOpsMixer(nn.Module):
    """Channel-wise ops along time on the column's output, then the row."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(DIM, WIDTH), nn.Linear(DIM, WIDTH)
        self.out = nn.Linear(WIDTH, DIM)

    def channels(self, x):
        h, g = self.a(x), self.b(x)  # (b, t, WIDTH), channels sharded
        t = h.shape[1]
        mixed = torch.logaddexp(h, g.flip(1)) + torch.roll(h, shifts=1, dims=1)
        running = torch.logcumsumexp(mixed, dim=1) + torch.cummax(g, dim=1).values
        head = torch.narrow(running, 1, 0, t - 1)
        running = torch.cat([running[:, :1], head], dim=1)
        return torch.movedim(torch.movedim(running, 2, 0), 0, 2) + torch.erfinv(torch.tanh(g) * 0.5)

    def forward(self, x):
        return self.out(self.channels(x))


class ChannelFlipMixer(TimeOpsMixer):
    """The near miss: the flip reverses the sharded channels (rank r would need rank tp-1-r's)."""

    def channels(self, x):
        return torch.logaddexp(self.a(x), self.b(x)).flip(-1)


class WholeOperandMixer(TimeOpsMixer):
    """The near miss: ``logaddexp`` of the sharded channels with a whole per-channel buffer: DTensor
    would slice the buffer to each rank's channels, which the per-rank code does not do."""

    def __init__(self):
        super().__init__()
        self.register_buffer("curve", torch.linspace(-1.0, 1.0, WIDTH))

    def channels(self, x):
        return torch.logaddexp(self.a(x) + self.b(x), self.curve)


class NoStrategyMixer(TimeOpsMixer):
    """The near miss: ``unfold`` has no DTensor strategy: unknown to both, the shard stops."""

    def channels(self, x):
        h = self.a(x) + self.b(x)
        return h.unfold(1, 2, 1).mean(-1).sum(1, keepdim=True).expand_as(h)


class MLP(nn.Module):
    def __init__(self):
        super().__init__()
        self.up, self.down = nn.Linear(DIM, 64), nn.Linear(64, DIM)

    def forward(self, x):
        return self.down(torch.relu(self.up(x)))


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_ops_outside_the_table_keep_the_shard_by_dtensor_strategy(tp_size, sequence_parallel):
    """Would catch the fallback refusing them (the mixer whole: fraction ~0.6 at tp 2) and a
    strategy taken though it moves data (logits off)."""
    torch.manual_seed(0)
    model = Model(TimeOpsMixer, MLP).eval()
    plan, report = synthesize_and_verify(model, tp_size, sequence_parallel)
    assert {"layers.*.mixer.a", "layers.*.mixer.b", "layers.*.mixer.out"} <= set(plan), plan
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding)))
    total = sum(p.numel() for p in model.parameters())
    bound = (total - linears + linears / tp_size) / total
    assert all(abs(f - bound) < 0.02 for f in report.param_fraction), (report.param_fraction, bound)


@pytest.mark.parametrize("mixer", [ChannelFlipMixer, NoStrategyMixer], ids=["flip_channels", "no_strategy"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_ops_that_would_move_data_keep_the_mixer_whole(mixer, tp_size):
    torch.manual_seed(0)
    model = Model(mixer, MLP).eval()
    plan, _ = synthesize_and_verify(model, tp_size, False)
    assert not {"layers.*.mixer.a", "layers.*.mixer.b", "layers.*.mixer.out"} & set(plan), plan
    assert "layers.*.mixer" not in plan, plan


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp_size", [2, 4])
def test_a_whole_buffer_meeting_the_shard_runs_the_mixer_on_dtensors(tp_size, sequence_parallel):
    """Per-rank code would add the whole buffer to a shard of the channels, so the Linears get no
    per-rank styles; on DTensors the mixer is sharded (DTensor slices the replicated buffer to each
    rank's channels). Would catch the buffer saved plain for the backward (a mixed Tensor/DTensor
    ``sub`` in logaddexp's backward) and a per-rank plan for a/b/out (logits off)."""
    torch.manual_seed(0)
    model = Model(WholeOperandMixer, MLP).eval()
    plan, report = synthesize_and_verify(model, tp_size, sequence_parallel)
    assert not {"layers.*.mixer.a", "layers.*.mixer.b", "layers.*.mixer.out"} & set(plan), plan
    region = plan["layers.*.mixer"]
    assert type(region).__name__ == "DTensorRegion", region
    assert region.params == {"a.weight": 0, "a.bias": 0, "b.weight": 0, "b.bias": 0, "out.weight": 1}, region
    linears = sum(m.weight.numel() for m in model.modules() if isinstance(m, (nn.Linear, nn.Embedding)))
    total = sum(p.numel() for p in model.parameters())
    bound = (total - linears + linears / tp_size) / total
    assert all(abs(f - bound) < 0.02 for f in report.param_fraction), (report.param_fraction, bound)
