"""Modules with parameters whose forward branches or loops on tensor values are traced with real values.

``torch.export`` on fake tensors cannot decide ``if idx.numel() == 0`` or iterate over the experts
that ``nonzero`` found: it stops with a data-dependent guard. Synthesis now exports such a
materialised model again with real values propagated (the graph follows the branches its example
inputs take), and checks the plan numerically before handing it out, since other inputs take other
branches. A meta-device model cannot be run on values: it still gets a TraceError naming the module.
"""

from __future__ import annotations

import pytest
import torch
from torch import nn

import autotp
from autotp import styles
from autotp.errors import TraceError
from autotp.synth.trace import VALUE_BRANCHES, export_model
from tests.synth_toy import example_tokens, verify_toy
from tests.test_loop_experts import LoopExperts, Model, megatron_bound


class HitExperts(LoopExperts):
    """Loops over only the experts some token picked (``nonzero`` of the per-expert counts), reads
    each expert's index with ``.item()`` and skips an expert whose token list is empty: the number of
    steps, and every step's weight, depend on the routing values."""

    def forward(self, x, index, weights):
        out = torch.zeros_like(x)
        counts = torch.nn.functional.one_hot(index, self.gate_up.shape[0]).sum(dim=(0, 1))
        for hit in (counts > 0).nonzero():
            e = int(hit.item())
            token, slot = torch.where(index == e)
            if token.numel() == 0:
                continue
            out = self.accumulate(out, token, self.expert(x[token], e) * weights[token, slot, None])
        return out


def _model() -> Model:
    torch.manual_seed(0)
    return Model(HitExperts).eval()


def test_value_dependent_expert_loop_is_traced_with_real_values_and_marked():
    """Would catch the retry being lost (a TraceError) or the program not naming the module whose
    branches it followed (the plan would then be handed out unchecked)."""
    program = export_model(_model(), (example_tokens(),))
    assert program.graph_module.meta[VALUE_BRANCHES] == "layers.0.mlp.experts, layers.1.mlp.experts"


class Clip(nn.Module):
    """Halves a large input: a branch on a value in a module without parameters."""

    def forward(self, h):
        return h / 2 if h.abs().max() > 1e6 else h


class ClippedFirst(Model):
    """:class:`Clip` runs on the embedding before the experts' loop: the first guard export meets
    is in a module without parameters."""

    def __init__(self, experts):
        super().__init__(experts)
        self.clip = Clip()

    def forward(self, tokens):
        h = self.clip(self.embed(tokens))
        for layer in self.layers:
            h = layer(h)
        return self.head(self.norm(h))


def test_every_module_whose_branch_values_decide_is_marked_not_only_the_first():
    """Would catch only the first failing module being judged: it holds no parameters, so the
    experts' loop behind it would go out unmarked and its plan unchecked."""
    torch.manual_seed(0)
    program = export_model(ClippedFirst(HitExperts).eval(), (example_tokens(),))
    assert program.graph_module.meta[VALUE_BRANCHES] == "layers.0.mlp.experts, layers.1.mlp.experts"


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["plain", "sp"])
def test_value_dependent_expert_loop_is_sharded_and_exact(sequence_parallel):
    """Before real-value tracing this raised a TraceError (``Eq(u0, 0)`` in the experts). Would
    catch the experts left whole (fraction near 0.8), or a plan made from the traced branches that
    is wrong (logits or a gradient off)."""
    model = _model()
    plan = autotp.synthesize(model, example_inputs=(example_tokens(),), tp_size=2,
                             sequence_parallel=sequence_parallel, verify=False)
    assert isinstance(plan["layers.*.mlp.experts"], styles.ExpertsParallel), plan
    report = verify_toy(model, plan, tp_size=2)
    bound = megatron_bound(model, 2)
    assert all(abs(f - bound) < 0.03 for f in report.param_fraction), (report.param_fraction, bound)


def test_value_dependent_plan_that_cannot_be_checked_is_refused(monkeypatch):
    """A plan traced on one input's branches goes out only once checked: when no check can run,
    synthesize raises a TraceError naming the module instead of returning it unchecked."""
    import autotp.self_check

    monkeypatch.setattr(autotp.self_check, "self_check", lambda *a, **k: None)
    with pytest.raises(TraceError, match=r"layers\.\d\.mlp\.experts branches on tensor values.*write the plan by hand"):
        autotp.synthesize(_model(), example_inputs=(example_tokens(),), tp_size=2, verify=False)


def test_value_dependent_loop_on_meta_still_names_the_module():
    """Real values need real weights: on the meta device the guard stays an error naming the module."""
    model = _model().to("meta")
    with pytest.raises(TraceError, match=r"inside layers\.\d\.mlp\.experts.*materialised model"):
        autotp.synthesize(model, example_inputs=(example_tokens().to("meta"),), tp_size=2, verify=False)


def test_nonzero_tuples_are_rewritten_only_under_real_values():
    """``torch.where(c)`` under real-value tracing is spelled ``c.nonzero().unbind(1)``: the same
    tensors. Would catch the rewrite changing values, or applying to the three-argument where."""
    from autotp.synth.trace import _NonzeroTuples

    c = torch.tensor([[True, False], [False, True]])
    with _NonzeroTuples():
        rows, cols = torch.where(c)
        again = c.nonzero(as_tuple=True)
        picked = torch.where(c, 1, 0)
    assert torch.equal(rows, torch.tensor([0, 1])) and torch.equal(cols, torch.tensor([0, 1]))
    assert all(torch.equal(a, b) for a, b in zip(again, (rows, cols)))
    assert torch.equal(picked, c.long())



class ParamDecidedCount(nn.Module):
    """Keeps as many scores as are positive (a router's choice, in small): the graph's shapes depend
    on the parameter's values, not only on the input's."""

    def __init__(self):
        super().__init__()
        self.weight = nn.Parameter(torch.randn(3, 4))

    def forward(self, x):
        scores = torch.nn.functional.linear(x, self.weight.type(torch.float32)).flatten()
        kept = int((scores > 0).sum().item())
        return scores[: kept + 1] * 2


@pytest.mark.parametrize("sign", [1.0, -1.0], ids=["positive", "negative"])
def test_real_value_trace_reads_the_parameters_own_values(sign):
    """Would catch torch's real-value export giving an ``nn.Parameter`` uninitialised memory as its
    value (it copies only exact ``torch.Tensor``s): the graph then follows a branch the model does
    not take (LongCat-Flash's router sent every traced token to two zero-compute experts)."""
    torch.manual_seed(0)
    module = ParamDecidedCount()
    x = torch.ones(2, 4)
    with torch.no_grad():
        module.weight.copy_(sign * (torch.rand(3, 4) + 0.1))
        expected = module(x).shape
    program = export_model(module, (x,))
    output = next(n for n in program.graph.nodes if n.op == "output").args[0][0]
    assert tuple(output.meta["val"].shape) == tuple(expected), (output.meta["val"].shape, expected)
