"""A block that reads a value made once at the root reduces that value's gradient once per step.

Zamba's shared transformer reads ``concat(stream, embeddings)``, normalises it and hands it to its
query, key and value projections: the norm's output, twice the stream's width, had its gradient
all-reduced in every layer that runs the block. The backward of the norm and of the concatenation
is linear in the incoming gradient, so the columns' partial sums may run back through them; the
block then reduces its stream input in each layer and the root value once, after every layer has
added its share (``Boundary(inputs="reduce_grad")``).

Where the first layer normalises the embeddings themselves before its own columns, and the block
reads a copy of them, the first layer's norm takes them at its entry the same way: its partial
gradient and the block's meet in one all-reduce, and the backward moves the forward's bytes.

The toy is plain PyTorch, named after nothing. Every check verifies the logits and every gradient
against the unsharded model (1e-5).
"""

import pytest
import torch
import torch.nn.functional as F
from torch import nn

from autotp import styles
from autotp.synth import fronts, synthesize
from autotp.training import apply_activation_checkpointing
from synth_toy import verify_toy

VOCAB, DIM, HEADS, SEQ = 96, 32, 4, 8


class Mixer(nn.Module):
    """Attention over a norm of the stream concatenated with a side value."""

    def __init__(self):
        super().__init__()
        self.norm = nn.RMSNorm(2 * DIM)
        self.q, self.k, self.v = (nn.Linear(2 * DIM, DIM, bias=False) for _ in range(3))
        self.out = nn.Linear(DIM, DIM, bias=False)

    def forward(self, x, side):
        h = self.norm(torch.cat([x, side], dim=-1))
        b, t, _ = h.shape
        q, k, v = (p(h).view(b, t, -1, DIM // HEADS).transpose(1, 2) for p in (self.q, self.k, self.v))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True)
        return self.out(y.transpose(1, 2).reshape(b, t, -1))


class Layer(nn.Module):
    def __init__(self):
        super().__init__()
        self.mixer = Mixer()
        self.ln = nn.RMSNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x, side):
        x = x + self.mixer(x, side)
        return x + self.down(F.gelu(self.up(self.ln(x))))


class MLPLayer(nn.Module):
    def __init__(self):
        super().__init__()
        self.ln = nn.RMSNorm(DIM)
        self.up, self.down = nn.Linear(DIM, 4 * DIM), nn.Linear(4 * DIM, DIM)

    def forward(self, x, side):
        return x + self.down(F.gelu(self.up(self.ln(x))))


class SideInputModel(nn.Module):
    def __init__(self, layers: int, mlp_layers: int = 0):
        super().__init__()
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([*(Layer() for _ in range(layers)), *(MLPLayer() for _ in range(mlp_layers))])
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        side = torch.tanh(x)  # made once, read by every block
        for block in self.blocks:
            x = block(x, side)
        return self.head(self.norm(x))


class CopiedSideModel(nn.Module):
    """An MLP layer first (its norm reads the embeddings), then ``layers`` mixer layers that read the
    embeddings again as the side value: a ``clone()`` of them, or the tensor itself."""

    def __init__(self, layers: int, copy: bool = True):
        super().__init__()
        self.copy = copy
        self.embed = nn.Embedding(VOCAB, DIM)
        self.blocks = nn.ModuleList([MLPLayer(), *(Layer() for _ in range(layers))])
        self.norm = nn.RMSNorm(DIM)
        self.head = nn.Linear(DIM, VOCAB, bias=False)

    def forward(self, ids):
        x = self.embed(ids)
        side = torch.clone(x) if self.copy else x
        for block in self.blocks:
            x = block(x, side)
        return self.head(self.norm(x))


def _tokens():
    return torch.randint(0, VOCAB, (2, SEQ), generator=torch.Generator().manual_seed(0))


def _report(model, plan, tp):
    return verify_toy(model, plan, tp, inputs=(_tokens(),))


def _plan(model, tp):
    return synthesize(model, example_inputs=(_tokens(),), tp_size=tp, verify=False)


@pytest.mark.parametrize("tp", [2, 4])
def test_side_input_reduced_once_for_every_layer(tp, monkeypatch):
    """Three layers. Before, each layer all-reduced the norm's output (twice the stream's width) and
    the MLP's input: 3 stream widths per layer, + 1 at the head. Now each layer reduces its stream
    input and the MLP's, and the side value is reduced once: 2 per layer + 2. (The forward: 2 per
    layer + 1 at the embedding; the side value's one reduction has no forward twin.) Would catch
    the side value reduced in every layer, or a gradient left partial or reduced twice (a gradient
    differs from the unsharded model's)."""
    layers = 3
    model = SideInputModel(layers)
    plan = _plan(model, tp)
    mixer = plan["blocks.*.mixer"]  # shares the columns' input too
    assert mixer.columns and mixer.style.inputs == "reduce_grad", mixer
    assert isinstance(plan["blocks.*.mixer.norm"], styles.ReplicatedWithGradAllReduce), plan["blocks.*.mixer.norm"]
    report = _report(model, plan, tp)
    assert max(report.param_fraction) < 1.2 / tp, report.param_fraction
    assert report.collectives_backward == {"all_reduce": 2 * layers + 2}, report.collectives_backward
    monkeypatch.setattr(fronts, "_input_fronts", lambda *args, **kwargs: ({}, {}))  # the layout before
    before = _report(model, _plan(model, tp), tp)
    assert before.collectives_backward == {"all_reduce": 2 * layers + 1}, before.collectives_backward
    # in stream widths: 3 per layer + 1 before, 2 per layer + 2 now
    assert before.comm_volume_backward * (2 * layers + 2) == report.comm_volume_backward * (3 * layers + 1)
    assert report.comm_volume == before.comm_volume
    assert report.comm_volume_backward * (2 * layers + 1) == report.comm_volume * (2 * layers + 2)


def test_one_layer_keeps_the_norm_reduction():
    """With one layer reading it the side value's reduction serves nothing else: reducing both inputs
    costs what the norm's output does, and the plan keeps that one reduction."""
    model = SideInputModel(1, mlp_layers=2)
    plan = _plan(model, 2)
    assert not any("reduce_grad" in repr(style) for style in plan.values()), plan
    assert any(getattr(style, "outputs", None) == "replicate" for key, style in plan.items() if key.endswith("mixer.norm"))
    _report(model, plan, 2)


@pytest.mark.parametrize("tp, layers, copy", [(2, 1, True), (4, 3, True), (2, 3, False)],
                         ids=["tp2-one-clone", "tp4-three-clone", "tp2-three-same"])
def test_side_copy_of_the_first_layers_input_costs_nothing(tp, layers, copy, monkeypatch):
    """The side value is (a clone of) the embeddings, which the first layer's norm reads before its
    up projection. That norm takes the embeddings at entry (its weight's gradient left Partial()),
    so its partial gradient and the blocks' share of the side value's are summed and all-reduced
    once: the backward moves exactly the forward's bytes. Before, the side value cost one more
    reduction of a stream width per step (the norm's output with one mixer layer, its own wrapper
    with three). Would catch the fold not taken, the norm's parameter gradient left unreduced or
    reduced twice, or a side share reduced twice (gradients differ)."""
    model = CopiedSideModel(layers, copy=copy)
    plan = _plan(model, tp)
    first = plan["blocks.0.ln"]
    assert first.inputs == "reduce_grad" and isinstance(first.style, styles.ReplicatedWithGradAllReduce), first
    report = _report(model, plan, tp)
    assert max(report.param_fraction) < 1.2 / tp, report.param_fraction
    assert report.comm_volume_backward == report.comm_volume, (report.comm_volume, report.comm_volume_backward)
    assert report.collectives_backward == report.collectives == {"all_reduce": 2 * layers + 2}, report
    monkeypatch.setattr(fronts, "_folds", lambda *args, **kwargs: {})  # the layout before
    before = _report(model, _plan(model, tp), tp)
    assert before.comm_volume == report.comm_volume
    # one stream width per token more: (2 * layers + 2) widths forward, one more backward
    assert before.comm_volume_backward * (2 * layers + 2) == report.comm_volume_backward * (2 * layers + 3)


def test_side_copy_fold_survives_checkpointing():
    """Recomputed layers take their inputs as leaves: each reduces its own share then (no fold), and
    every gradient still matches the unsharded model's."""
    model = CopiedSideModel(2)
    plan = _plan(model, 2)
    apply_activation_checkpointing(list(model.blocks))
    _report(model, plan, 2)


def test_reduced_once_shares_a_wrapper_with_clones(monkeypatch):
    """A clone of a value takes the value's wrapper (autograd adds both partial gradients before the
    one all-reduce); a value written in place since gets a new one (its values changed), and so
    does a leaf. Would catch clones reduced apart (no fold) or a stale wrapper handed out."""
    from autotp.styles import boundaries

    monkeypatch.setattr(boundaries, "all_reduce_backward", lambda value, mesh: value.view_as(value))
    mesh = object()
    base = torch.randn(4, requires_grad=True) * 2
    wrapped = boundaries.reduced_once(base, mesh)
    assert boundaries.reduced_once(torch.clone(base), mesh) is wrapped
    assert boundaries.reduced_once(base.clone().clone(), mesh) is wrapped
    assert boundaries.reduced_once(base, object()) is not wrapped  # another mesh
    other = torch.randn(4, requires_grad=True) * 2
    assert boundaries.reduced_once(other, mesh) is not boundaries.reduced_once(other * 1, mesh)
    again = boundaries.reduced_once(other, mesh)
    again.add_(1)  # the wrapper shares the value's storage: its values changed
    assert boundaries.reduced_once(other, mesh) is not again
    leaf = torch.randn(4, requires_grad=True)
    assert boundaries.reduced_once(leaf, mesh) is not boundaries.reduced_once(leaf, mesh)


def test_reduced_input_grads_refuses_a_module_returning_its_input(monkeypatch):
    """A module that hands its input back as its output would pass the caller's whole gradient into
    the wrapper that all-reduces partial sums: tp times the gradient. It is refused, by name."""
    from autotp.errors import PlanError
    from autotp.styles import boundaries

    monkeypatch.setattr(boundaries, "all_reduce_backward", lambda value, mesh: value.view_as(value))
    module = styles.Boundary(inputs="reduce_grad")._apply(nn.Identity(), device_mesh=object())
    with pytest.raises(PlanError, match="Identity returns one of its inputs"):
        module(torch.randn(3, requires_grad=True) * 2)
    assert module(torch.randn(3)).shape == (3,)  # no gradient: nothing taken


def test_checkpointed_layers_keep_the_gradients():
    """Recomputing each layer in backward (non-reentrant checkpointing) reads the same inputs again:
    the side value's one wrapper must serve the recompute without reducing twice. Would catch a
    gradient scaled by tp or left partial."""
    model = SideInputModel(3)
    plan = _plan(model, 2)
    apply_activation_checkpointing(list(model.blocks))
    _report(model, plan, 2)


def test_reduced_input_grads_hooks_a_module_once():
    """One module object reached under two plan keys (a block several layers share) gets one hook:
    a second would all-reduce an already reduced gradient again (tp times the gradient)."""
    module = Mixer()
    for _ in range(2):
        styles.Boundary(inputs="reduce_grad")._apply(module, device_mesh=None)
    assert len(module._forward_pre_hooks) == 1
