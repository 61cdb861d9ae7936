"""Column projections that read their block input through a padding mask reduce its gradient once.

A mixer that zeroes padded positions before its projections (``h * mask``, as linear-attention and
state-space mixers do) cannot take a ``Replicate()`` DTensor from the norm before it: the DTensor
would meet the plain mask. Each column then wrapped the masked value itself and all-reduced its own
input gradient (4 per layer for 4 projections, where the forward pays 1). The plan now shares one
wrapper among the columns (plain TP: one all-reduce), or under SP hands their partial gradients to
the norm's all-gather, whose backward reduce-scatters once.

Every test verifies logits and every gradient against the unsharded model (1e-5) on a padded batch,
counts the collectives of both directions, and asserts the parameter fraction near 1/tp.
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp import styles
from autotp.synth import synthesize
from autotp.verifier import verify
from synth_toy import DIM, MLP, example_tokens
from test_sp_stream import MaskedModel

HEADS, LAYERS = 4, 2  # LAYERS: MaskedModel's


class MaskedGatedMixer(nn.Module):
    """Masks its input, then four column projections (value, gate, per-head decay, per-head mix),
    a per-head recurrence-free combination, and a row projection. With ``learned_scale`` the masked
    input is also scaled by a learned vector before the projections (a value with a gradient of its
    own on the way: the columns' partial gradients must then be reduced before it)."""

    def __init__(self, learned_scale: bool = False):
        super().__init__()
        self.heads, self.head_dim = HEADS, DIM // HEADS
        self.v_proj, self.g_proj = nn.Linear(DIM, DIM, bias=False), nn.Linear(DIM, DIM, bias=False)
        self.a_proj, self.b_proj = nn.Linear(DIM, HEADS, bias=False), nn.Linear(DIM, HEADS, bias=False)
        self.out_proj = nn.Linear(DIM, DIM, bias=False)
        self.scale = nn.Parameter(1 + 0.1 * torch.randn(DIM)) if learned_scale else None

    def forward(self, h, mask):
        h = (h * mask[:, :, None]).to(h.dtype)
        if self.scale is not None:
            h = h * self.scale
        b, t, _ = h.shape
        v = self.v_proj(h).view(b, t, -1, self.head_dim)
        gate = torch.sigmoid(self.a_proj(h))[..., None] * torch.tanh(self.b_proj(h))[..., None]
        mixed = (v * gate).cumsum(1).reshape(b, t, -1) * F.silu(self.g_proj(h))
        return self.out_proj(mixed)


class Layer(nn.Module):
    def __init__(self, learned_scale: bool):
        super().__init__()
        self.norm_1, self.norm_2 = nn.LayerNorm(DIM), nn.LayerNorm(DIM)
        self.mixer, self.mlp = MaskedGatedMixer(learned_scale), MLP()

    def forward(self, x, mask):
        x = x + self.mixer(self.norm_1(x), mask)
        return x + self.mlp(self.norm_2(x))


def Model(learned_scale: bool = False) -> MaskedModel:  # noqa: N802 (a model constructor)
    return MaskedModel(lambda: Layer(learned_scale))


def _inputs():
    tokens = example_tokens()[:, :8]
    mask = torch.ones_like(tokens)
    mask[0, :3] = 0
    return tokens, mask


def _report(model, plan, tp):
    report = verify(model, plan, tp_size=tp, example_inputs=_inputs())
    assert report.ok, str(report)
    return report


def _sharing(plan) -> styles.Boundary:
    """The one style that shares the mixer's four columns' input."""
    found = [(key, style) for key, style in plan.items() if getattr(style, "columns", None)
             and isinstance(style, styles.Boundary)]
    assert len(found) == 1, found
    key, style = found[0]
    assert {f"{key}.{c}".removeprefix("layers.*.") for c in style.columns} == {f"mixer.{p}_proj" for p in "vgab"}
    return style


def _mirrored(forward: dict[str, int]) -> dict[str, int]:
    swap = {"reduce_scatter_tensor": "all_gather_into_tensor", "all_gather_into_tensor": "reduce_scatter_tensor"}
    return {swap.get(op, op): n for op, n in forward.items()}


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
@pytest.mark.parametrize("tp", [2, 4])
def test_masked_columns_reduce_their_input_gradient_once(tp, sequence_parallel):
    """Would catch the four columns reducing their input gradients one by one (backward 4 + 1 per
    layer where the forward has 2), or a partial gradient left unreduced (gradients differ)."""
    model = Model()
    plan = synthesize(model, example_inputs=_inputs(), tp_size=tp, sequence_parallel=sequence_parallel, verify=False)
    shared = _sharing(plan)
    assert (shared.input_grad == "partial") is sequence_parallel
    report = _report(model, plan, tp)
    assert report.collectives_backward == _mirrored(report.collectives)
    assert report.comm_volume_backward == report.comm_volume
    assert max(report.param_fraction) < 1 / tp + 0.03, report.param_fraction


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_a_learned_scale_before_the_columns_keeps_the_gradient_reduced(sequence_parallel):
    """The masked input is scaled by a learned vector before the columns: its gradient would be a
    partial sum if the columns handed theirs back unreduced. Would catch the partial route taken
    anyway (the scale's gradient is then off by the other ranks' share)."""
    model = Model(learned_scale=True)
    plan = synthesize(model, example_inputs=_inputs(), tp_size=2, sequence_parallel=sequence_parallel, verify=False)
    assert _sharing(plan).input_grad == "whole"
    report = _report(model, plan, 2)
    if sequence_parallel:  # the columns' summed gradient all-reduced once per layer; the rest mirrored
        assert report.collectives_backward == {"all_reduce": LAYERS, "all_gather_into_tensor": 2 * LAYERS + 1,
                                               "reduce_scatter_tensor": LAYERS + 1}
    else:
        assert report.collectives_backward == report.collectives
