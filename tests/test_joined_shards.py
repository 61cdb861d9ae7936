"""Layouts of a shard that are not one contiguous block per rank, and the ops that make them.

The mixer here is the pattern of gated delta-rule linear attention, written with separate q, k, v
projections: their outputs are joined by ``cat`` along the features (each rank then holds its
share of each piece), convolved depthwise (the conv weight packed like the pieces), cut back at
the pieces by fixed widths, run through a chunked recurrence whose state starts from
``torch.zeros`` and whose output is written chunk by chunk into a ``zeros_like`` buffer, then
normalised per head on a ``reshape(-1, head_dim)`` (heads folded into the rows) and projected
out. A low-rank gate (``g_b(g_a(x))``) meets the heads' shard deep inside, and a per-channel
bias is viewed into heads with a head-count attribute. Every wrong reading of these layouts
changes the logits or a gradient, which the verifier compares with the unsharded model.
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp.synth import explain, synthesize
from autotp.synth.ops import fold_group, split_fold_group
from autotp.verifier import verify
from synth_toy import DIM, example_tokens
from test_ssm_mixer import SSMStack

KERNEL, CHUNK = 3, 4


class JoinedDeltaMixer(nn.Module):
    """q|k|v joined -> depthwise conv -> split -> chunked recurrence -> per-head gated norm -> out."""

    def __init__(self, heads: int = 4, k_dim: int = 8, v_dim: int = 16):
        super().__init__()
        self.heads, self.k_dim, self.v_dim = heads, k_dim, v_dim
        self.key_dim, self.value_dim = heads * k_dim, heads * v_dim
        self.q = nn.Linear(DIM, self.key_dim, bias=False)
        self.k = nn.Linear(DIM, self.key_dim, bias=False)
        self.v = nn.Linear(DIM, self.value_dim, bias=False)
        conv = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(conv, conv, KERNEL, groups=conv, bias=True)
        self.a = nn.Linear(DIM, self.key_dim, bias=False)
        self.dt_bias = nn.Parameter(0.1 * torch.randn(self.key_dim))
        self.g_a, self.g_b = nn.Linear(DIM, 8, bias=False), nn.Linear(8, self.value_dim, bias=False)
        self.norm_weight = nn.Parameter(1 + 0.1 * torch.randn(v_dim))
        self.out = nn.Linear(self.value_dim, DIM, bias=False)

    def forward(self, h):
        b, t, _ = h.shape
        qkv = torch.cat([self.q(h), self.k(h), self.v(h)], dim=-1).transpose(1, 2)
        weight = self.conv1d.weight.squeeze(1)
        qkv = F.conv1d(F.pad(qkv, (KERNEL - 1, 0)), weight.unsqueeze(1), self.conv1d.bias, groups=qkv.shape[1])
        q, k, v = torch.split(F.silu(qkv).transpose(1, 2), [self.key_dim, self.key_dim, self.value_dim], dim=-1)
        q = F.normalize(q.reshape(b, t, -1, self.k_dim), dim=-1).transpose(1, 2)
        k = F.normalize(k.reshape(b, t, -1, self.k_dim), dim=-1).transpose(1, 2)
        v = v.reshape(b, t, -1, self.v_dim).transpose(1, 2)
        decay = -F.softplus(self.a(h).view(b, t, self.heads, self.k_dim) + self.dt_bias.view(1, 1, self.heads, self.k_dim))
        decay = decay.mean(-1).transpose(1, 2).exp()  # (b, heads, t)
        state = torch.zeros(b, k.shape[1], self.k_dim, self.v_dim, device=h.device, dtype=h.dtype)
        out = torch.zeros_like(v)
        for start in range(0, t, CHUNK):
            stop = min(start + CHUNK, t)
            for i in range(start, stop):
                state = state * decay[:, :, i, None, None] + k[:, :, i, :, None] * v[:, :, i, None, :]
                out[:, :, i] = (q[:, :, i, :, None] * state).sum(-2)
        gate = self.g_b(self.g_a(h))  # a low-rank gate, replicated: it meets the heads in the norm
        rows = out.transpose(1, 2).reshape(-1, self.v_dim)
        rows = rows * torch.rsqrt(rows.pow(2).mean(-1, keepdim=True) + 1e-6) * self.norm_weight
        rows = rows * torch.sigmoid(gate.reshape(-1, self.v_dim))
        return self.out(rows.reshape(b, t, -1))


def _plan_and_report(model, tp, sequence_parallel=False):
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, sequence_parallel=sequence_parallel,
                      verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp, example_inputs=(example_tokens(),))
    return plan, report


@pytest.fixture(scope="module")
def model():
    torch.manual_seed(0)
    return SSMStack(mixer=JoinedDeltaMixer)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_joined_delta_mixer_is_sharded_and_exact(model, tp, sequence_parallel):
    """Would catch: the conv weight over q|k|v sharded contiguously, the split at global widths,
    the zero state at the global head count, the chunk writes lost (q's Linear left whole), the
    per-head norm over folded rows read as mixing heads, or the mixer left whole."""
    plan, report = _plan_and_report(model, tp, sequence_parallel)
    assert report.ok, str(report)
    # Whole by design: the low-rank g_a (its row g_b gave way to the heads), the norms: ~3%.
    assert all(abs(f - 1 / tp) < 0.04 for f in report.param_fraction), report.param_fraction
    mixer = plan["layers.*.mixer"]
    assert mixer.packed["conv1d.weight"] == (32, 32, 64), mixer
    assert set(mixer.counts) >= {"key_dim", "value_dim", "heads"}, mixer


class JoinedIntoHeads(nn.Module):
    """Two projections joined, then viewed into heads straight away (no cut back at the pieces):
    rank r's heads would be half of a's block and half of b's, not heads of the joined tensor."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(DIM, 32), nn.Linear(DIM, 32), nn.Linear(64, DIM)

    def forward(self, h):
        b, t, _ = h.shape
        x = torch.cat([self.a(h), self.b(h)], dim=-1).view(b, t, 4, 16)
        return self.out((x * x.softmax(-1)).reshape(b, t, -1))


class JoinedIntoRow(nn.Module):
    """Two projections joined and contracted by one row Linear (its rows would need packing)."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.out = nn.Linear(DIM, 32), nn.Linear(DIM, 64), nn.Linear(96, DIM)

    def forward(self, h):
        return self.out(F.silu(torch.cat([self.a(h), self.b(h)], dim=-1)))


class JoinedCutInside(nn.Module):
    """Two projections joined, then cut at a width inside the first piece."""

    def __init__(self):
        super().__init__()
        self.a, self.b = nn.Linear(DIM, 32), nn.Linear(DIM, 32)
        self.o1, self.o2 = nn.Linear(16, DIM), nn.Linear(48, DIM)

    def forward(self, h):
        x, y = torch.cat([self.a(h), self.b(h)], dim=-1).split([16, 48], dim=-1)
        return self.o1(x) + self.o2(y)


class JoinedTimesContiguous(nn.Module):
    """A joined shard multiplied by a contiguously sharded one of the same width."""

    def __init__(self):
        super().__init__()
        self.a, self.b, self.c = nn.Linear(DIM, 32), nn.Linear(DIM, 32), nn.Linear(DIM, 64)
        self.out = nn.Linear(64, DIM)

    def forward(self, h):
        return self.out(torch.cat([self.a(h), self.b(h)], dim=-1) * self.c(h))


class ConstantSizedState(JoinedDeltaMixer):
    """The recurrence state sized by a literal head count: no attribute can make it per-rank."""

    def forward(self, h):
        b, t, _ = h.shape
        q, k, v = (p(h).view(b, t, self.heads, -1).transpose(1, 2) for p in (self.q, self.k, self.v))
        state = torch.zeros(b, 4, self.k_dim, self.v_dim, device=h.device, dtype=h.dtype)
        out = torch.zeros_like(v)
        for i in range(t):
            state = 0.9 * state + k[:, :, i, :, None] * v[:, :, i, None, :]
            out[:, :, i] = (q[:, :, i, :, None] * state).sum(-2)
        return self.out(out.transpose(1, 2).reshape(b, t, -1))


class FoldedRowsReduced(nn.Module):
    """Heads folded into rows, then a statistic over the rows (it mixes the heads)."""

    def __init__(self):
        super().__init__()
        self.v, self.out = nn.Linear(DIM, 64), nn.Linear(64, DIM)

    def forward(self, h):
        b, t, _ = h.shape
        rows = self.v(h).reshape(-1, 16)
        rows = rows - rows.mean(0, keepdim=True)
        return self.out(rows.reshape(b, t, -1))


@pytest.mark.parametrize("mixer", [JoinedIntoHeads, JoinedIntoRow, JoinedCutInside, JoinedTimesContiguous,
                                   ConstantSizedState, FoldedRowsReduced])
def test_layouts_it_cannot_realise_keep_their_projections_whole(mixer):
    """Would catch a joined, folded or constant-sized layout sharded where the ranks' blocks are
    not what the code reads: the plan would run and give other numbers (the verifier compares
    logits and every gradient); keeping the projections whole with a reason is the right answer."""
    torch.manual_seed(0)
    model = SSMStack(mixer=mixer)
    plan, report = _plan_and_report(model, 2)
    assert report.ok, str(report)
    assert not any(key.startswith("layers.*.mixer.") for key in plan), sorted(plan)
    reasons = [r.reason for r in explain(model, example_inputs=(example_tokens(),), tp_size=2)
               if r.key.startswith("layers.*.mixer.")]
    assert reasons and all(reasons), reasons


def test_fold_groups():
    """Would catch a view that merges the heads with the rows read as a contiguous block."""
    assert fold_group((2, 11, 4, 16), (88, 16), 2) == (0, (2, 11, 4), 2)
    assert fold_group((2, 11, 4, 16), (2, 44, 16), 2) == (1, (11, 4), 1)
    assert split_fold_group((2, 11, 64), (88, 16), 2) == (0, (2, 11, 4), 2)
    assert fold_group((2, 11, 4, 16), (2, 22, 32), 2) is None
