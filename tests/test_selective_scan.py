"""A selective-scan mixer whose step sizes and state projections come out of a row Linear.

The mixer reads its sharded channels twice: once through a small row Linear ``x_proj``
(channels -> ``[dt | B | C]``, reduced over the ranks), and once in the scan, where ``B`` and ``C``
(the same for every channel) are broadcast against the channel-sharded state and ``dt`` is widened
back to the channels by a second column Linear ``dt_proj``. Sharded like an expert, every weight is
split: each rank's gradient of ``B`` and ``C`` then covers its own channels only, so the row must
all-reduce the gradient of those two spans of its output (and of no other: ``dt``'s gradient comes
back whole from ``dt_proj``'s input). The tests would catch a plan that forgets the reduction (the
gradients of ``x_proj`` and everything before it off), that reduces the whole output (``dt``'s
gradient counted tp times), or that keeps the mixer whole (parameter fraction far above 1/tp).
"""

import warnings

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp.synth import explain, synthesize
from autotp.verifier import verify
from synth_toy import DIM, example_tokens
from test_ssm_mixer import SSMStack

INNER, STATE, RANK, KERNEL = 2 * DIM, 8, 8, 3


class SelectiveScan(nn.Module):
    """in_proj -> [x | z]; depthwise causal conv on x; x_proj(x) -> [dt | B | C]; dt_proj(dt) ->
    per-channel steps; a recurrence over time with a per-(channel, state) decay; out_proj."""

    def __init__(self, loop: bool = True, read_b_whole: bool = False, state_norms: bool = False,
                 inline_scale: bool = False):
        super().__init__()
        self.loop, self.read_b_whole, self.inline_scale = loop, read_b_whole, inline_scale
        # Norms (with weights) on B and C between the row and the scan: the reduction moves to
        # their outputs, which makes their weights' gradients whole too.
        self.b_norm, self.c_norm = (nn.RMSNorm(STATE), nn.RMSNorm(STATE)) if state_norms else (nn.Identity(), nn.Identity())
        self.b_scale = nn.Parameter(1 + 0.1 * torch.randn(STATE))
        self.in_proj = nn.Linear(DIM, 2 * INNER, bias=False)
        self.conv1d = nn.Conv1d(INNER, INNER, KERNEL, groups=INNER, padding=KERNEL - 1)
        self.x_proj = nn.Linear(INNER, RANK + 2 * STATE, bias=False)
        self.dt_proj = nn.Linear(RANK, INNER)
        self.A_log = nn.Parameter(torch.log(torch.arange(1, STATE + 1.0)).repeat(INNER, 1))
        self.D = nn.Parameter(torch.randn(INNER))
        self.out_proj = nn.Linear(INNER, DIM, bias=False)

    def forward(self, h):
        b, t, _ = h.shape
        x, z = self.in_proj(h).transpose(1, 2).chunk(2, dim=1)  # (b, inner, t) each
        x = F.silu(self.conv1d(x)[..., :t])
        dt, B, C = self.x_proj(x.transpose(1, 2)).split([RANK, STATE, STATE], dim=-1)
        B, C = self.b_norm(B), self.c_norm(C)
        if self.inline_scale:  # a parameter of this module on B's way to the scan, in its own code
            B = B * self.b_scale
        dt = F.softplus(self.dt_proj(dt)).transpose(1, 2)  # (b, inner, t)
        A = -torch.exp(self.A_log)  # (inner, state)
        decay = torch.exp(A[None, :, None, :] * dt[..., None])  # (b, inner, t, state)
        drive = (dt[..., None] * B[:, None]) * x[..., None]  # B (b, t, state) broadcast over the channels
        if self.loop:
            state = torch.zeros(b, x.shape[1], STATE, dtype=x.dtype, device=x.device)
            ys = []
            for i in range(t):
                state = decay[:, :, i] * state + drive[:, :, i]
                ys.append(torch.matmul(state, C[:, i, :].unsqueeze(-1))[..., 0])  # C read once per step
            y = torch.stack(ys, dim=-1)
        else:  # the same recurrence in closed form (a cumulative log-decay), C read once
            log_decay = torch.cumsum(torch.log(decay), dim=2)
            states = torch.cumsum(drive * torch.exp(-log_decay), dim=2) * torch.exp(log_decay)
            y = torch.einsum("bits,bts->bit", states, C)
        y = (y + x * self.D[:, None]) * F.silu(z)
        if self.read_b_whole:  # B also read whole, outside the scan
            return self.out_proj(y.transpose(1, 2)) + B.mean(-1, keepdim=True)
        return self.out_proj(y.transpose(1, 2))


def _model(**kwargs):
    torch.manual_seed(0)
    return SSMStack(mixer=lambda: SelectiveScan(**kwargs))


def _verified(model, tp: int, sequence_parallel: bool = False):
    """The synthesized plan and its verification report (logits and every gradient)."""
    tokens = example_tokens()
    plan = synthesize(model, example_inputs=(tokens,), tp_size=tp, sequence_parallel=sequence_parallel, verify=False)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        report = verify(model, plan, tp_size=tp, example_inputs=(tokens,))
    assert report.ok, str(report)
    return plan, report


@pytest.mark.parametrize("loop", [True, False], ids=["loop", "closed"])
@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_selective_scan_is_sharded_and_exact(tp, sequence_parallel, loop):
    _, report = _verified(_model(loop=loop), tp, sequence_parallel)
    # Only the RMSNorms stay whole: under 1% of the model.
    assert all(abs(f - 1 / tp) < 0.01 for f in report.param_fraction), report.param_fraction


@pytest.mark.parametrize("tp", [2, 4])
def test_norms_on_the_state_projections_reduce_at_their_outputs(tp):
    """Would catch the norms' weight gradients (and the row's) left per-rank partial sums: the
    silently wrong plan a reduction at the row alone gives, since the norms sit between."""
    plan, report = _verified(_model(state_norms=True), tp)
    for name in ("b_norm", "c_norm"):
        assert plan[f"layers.*.mixer.{name}"].reduce_grad_features == ((0, STATE),), plan
    assert all(abs(f - 1 / tp) < 0.01 for f in report.param_fraction), report.param_fraction


def test_a_parameter_inline_on_the_broadcast_way_is_refused():
    """``B * self.b_scale`` in the mixer's own code: no module output to reduce at, and the scale's
    gradient would be partial: the scan's shards are refused and the plan stays exact."""
    _verified(_model(inline_scale=True), 2)


def test_row_reduces_the_gradient_of_the_broadcast_spans_only():
    """``x_proj`` is a row whose ``B`` and ``C`` spans are broadcast over the channels: exactly those
    two spans of its output have their gradient all-reduced, not ``dt``'s."""
    records = {r.key: r for r in explain(_model(), example_inputs=(example_tokens(),), tp_size=2)}
    row = records["layers.*.mixer.x_proj"]
    assert row.role == "row", row
    style = synthesize(_model(), example_inputs=(example_tokens(),), tp_size=2, verify=False)["layers.*.mixer.x_proj"]
    assert style.reduce_grad_features == ((RANK, RANK + STATE), (RANK + STATE, RANK + 2 * STATE)), style
    assert records["layers.*.mixer.dt_proj"].role == "column"


def test_a_span_also_read_whole_is_not_reduced():
    """Default-deny: when ``B`` also has a reader outside the sharded scan (its gradient part whole,
    part per-rank), no all-reduce of the span is right: the plan must still be exact."""
    plan, _ = _verified(_model(read_b_whole=True), 2)
    assert getattr(plan.get("layers.*.mixer.x_proj"), "reduce_grad_features", ()) == ()
