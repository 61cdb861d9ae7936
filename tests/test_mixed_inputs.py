"""Column Linears that read learned mixes of their module's input reduce its gradient once, at entry.

A time-mixing layer shifts its input one token and mixes it with the unshifted input by a learned
per-channel weight, one per projection (``x * mix_k + shift(x) * (1 - mix_k)``), inside the module
that owns the projections. Each column Linear used to all-reduce its own input gradient (three per
layer where the forward reduces once); the mixes are pointwise and linear in their gradient, so
they run their backward on the partial sums and the input's gradient is reduced once at entry, the
mixes' gradients left ``Partial()``. These tests would catch a plan whose backward moves more bytes
than its forward again, or one that sums a whole gradient into partial ones (wrong gradients).
"""

import warnings

import pytest
import torch
from synth_toy import DIM, example_tokens
from test_ssm_mixer import SSMStack
from torch import nn

from autotp.synth import synthesize
from autotp.verifier import verify

INNER = 2 * DIM


class TokenShiftMixer(nn.Module):
    """k, v, r = Linears of three learned mixes of the input and its one-token shift; a per-channel
    decay on the sharded side; out(sigmoid(r) * tanh(k) * v * decay)."""

    def __init__(self, stray_read: bool = False):
        super().__init__()
        self.stray_read = stray_read
        self.shift = nn.ZeroPad2d((0, 0, 1, -1))
        self.mix_k = nn.Parameter(torch.rand(1, 1, DIM))
        self.mix_v = nn.Parameter(torch.rand(1, 1, DIM))
        self.mix_r = nn.Parameter(torch.rand(1, 1, DIM))
        self.decay = nn.Parameter(torch.randn(INNER))
        self.key = nn.Linear(DIM, INNER, bias=False)
        self.value = nn.Linear(DIM, INNER, bias=False)
        self.receptance = nn.Linear(DIM, INNER, bias=False)
        self.output = nn.Linear(INNER, DIM, bias=False)

    def forward(self, h):
        shifted = self.shift(h)
        k = self.key(h * self.mix_k + shifted * (1 - self.mix_k))
        v = self.value(h * self.mix_v + shifted * (1 - self.mix_v))
        r = self.receptance(h * self.mix_r + shifted * (1 - self.mix_r))
        out = self.output(torch.sigmoid(r) * torch.tanh(k) * v * self.decay)
        if self.stray_read:  # a mix read whole outside the columns' inputs too
            out = out + self.mix_k
        return out


def _verified(tp: int, sequence_parallel: bool, **kwargs):
    torch.manual_seed(0)
    model = SSMStack(mixer=lambda: TokenShiftMixer(**kwargs))
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=sequence_parallel,
                      verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp, example_inputs=(example_tokens(),))
    assert report.ok, str(report)
    return plan, report


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_mixed_column_inputs_cost_the_backward_no_more_than_the_forward(tp, sequence_parallel):
    plan, report = _verified(tp, sequence_parallel)
    assert report.comm_volume_backward <= report.comm_volume, (report.comm_volume, report.comm_volume_backward)
    mixer = plan["layers.*.mixer"]
    assert mixer.input_grad == "partial" and mixer.wrapped.reduce == ("mix_k", "mix_r", "mix_v"), mixer
    assert mixer.wrapped.shard_dims == {"decay": 0}, mixer  # sharded as before: same parameter fractions
    assert all(abs(f - 1 / tp) < 0.01 for f in report.param_fraction), report.param_fraction


def test_a_mix_also_read_whole_keeps_one_reduction_per_column():
    """``mix_k`` also added to the output: its gradient there is whole on every rank, so the mixes
    may not run on partial gradients; the columns reduce their own inputs, and the plan is exact."""
    plan, _ = _verified(2, False, stray_read=True)
    mixer = plan["layers.*.mixer"]
    assert getattr(mixer, "input_grad", "whole") == "whole" and not getattr(mixer, "partial_grad_inputs", False), mixer
