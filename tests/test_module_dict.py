"""Model code as other training codebases write it: layer stacks in ``nn.ModuleDict`` /
``nn.Sequential``, and forwards with regions torch.export wraps in higher-order ops (autocast,
grad mode). Numerical checks compare with the unsharded model (logits and every gradient)."""


import pytest
import torch
from synth_toy import DIM, VOCAB, TitanBlock, TitanLlama, example_tokens, verify_toy
from torch import nn

from autotp.errors import TraceError
from autotp.synth import synthesize
from autotp.synth.graph import build_graph
from autotp.synth.trace import LayerGroups, collapsed, repeated_lists, trace
from autotp.training import get_lm_ac_layers


class DictStack(TitanLlama):
    """Layers in an ``nn.ModuleDict`` keyed by their index, iterated with ``.values()``."""

    def __init__(self, keys=("0", "1", "2")):
        super().__init__(layers=len(keys))
        self.layers = nn.ModuleDict(dict(zip(keys, self.layers)))

    def forward(self, tokens):
        h = self.tok_embeddings(tokens)
        for layer in self.layers.values():
            h = layer(h)
        return self.output(self.norm(h))


class SequentialStack(TitanLlama):
    """Layers in an ``nn.Sequential`` called as one module."""

    def __init__(self):
        super().__init__(layers=3)
        self.layers = nn.Sequential(*self.layers)

    def forward(self, tokens):
        return self.output(self.norm(self.layers(self.tok_embeddings(tokens))))


def _verify(model, plan, tp_size=2):
    return verify_toy(model, plan, tp_size)


@pytest.mark.parametrize("sequence_parallel", [False, True], ids=["tp", "sp"])
def test_module_dict_layers_are_planned_under_the_dict_keys(sequence_parallel):
    """Would catch torchtitan / olmo-core layer dicts not read as a layer stack (plan keys per layer,
    no ``layers.*``), or plan keys that name traced positions instead of the dict's keys."""
    model = DictStack()
    plan = synthesize(model, example_inputs=(example_tokens(),), sequence_parallel=sequence_parallel, tp_size=2,
                      verify=False)
    assert {"layers.*.attention.wq", "layers.*.attention.wo", "layers.*.feed_forward.w2"} <= set(plan)
    report = _verify(model, plan)
    assert all(abs(f - 0.5) < 0.05 for f in report.param_fraction), report.param_fraction


def test_module_dict_with_named_keys_collapses_and_restores():
    """Would catch a collapsed dict that renames its entries (traced FQNs then name no module) or
    is left collapsed after tracing."""
    model = DictStack(keys=("first", "second", "third"))
    with collapsed(model) as groups:
        assert list(model.layers.keys()) == ["first"]
        assert isinstance(model.layers, nn.ModuleDict)
    assert list(model.layers.keys()) == ["first", "second", "third"]
    assert groups.groups == {"layers": [["first", "second", "third"]]}
    assert groups.original("layers.first.attention.wq") == [
        "layers.first.attention.wq", "layers.second.attention.wq", "layers.third.attention.wq"]


def test_sequential_layers_are_planned_and_verified():
    model = SequentialStack()
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=2, verify=False)
    assert "layers.*.feed_forward.w1" in plan
    _verify(model, plan)


def test_containers_of_unrelated_parts_are_not_layer_stacks():
    """nanoGPT keeps ``transformer = ModuleDict(wte=..., h=ModuleList, ln_f=...)``, and an MLP is
    often ``Sequential(Linear, GELU, Linear)``: neither holds repeated blocks, the ModuleList does.
    Would catch the outer dict taken as the stack (the real layers then never collapse)."""
    model = nn.Module()
    model.transformer = nn.ModuleDict({
        "wte": nn.Embedding(VOCAB, DIM),
        "h": nn.ModuleList(TitanBlock() for _ in range(2)),
        "mlp": nn.Sequential(nn.Linear(DIM, DIM), nn.GELU(), nn.Linear(DIM, DIM)),
    })
    assert list(repeated_lists(model)) == ["transformer.h"]


def test_activation_checkpointing_finds_module_dict_blocks():
    model = DictStack()
    assert get_lm_ac_layers(model) == list(model.layers.values())


class AutocastRouterBlock(TitanBlock):
    """A block whose feed-forward runs under ``autocast(enabled=False)`` and whose attention
    output is scaled under ``set_grad_enabled``: both become higher-order ops in the export."""

    def forward(self, x):
        with torch.set_grad_enabled(torch.is_grad_enabled()):
            x = x + self.attention(self.attention_norm(x))
        with torch.autocast("cpu", enabled=False):
            return x + self.feed_forward(self.ffn_norm(x).float())


class AutocastLlama(TitanLlama):
    def __init__(self):
        super().__init__(layers=2)
        self.layers = nn.ModuleList(AutocastRouterBlock() for _ in range(2))


def test_autocast_and_grad_mode_regions_are_read_through():
    """Would catch ``KeyError: 'args'`` on the region's ``get_attr`` node, or the region's Linears
    missing from the graph (left replicated)."""
    model = AutocastLlama()
    program, _ = trace(model, (example_tokens(),))
    g = build_graph(program)
    linears = {d["module"] for _, d in g.nodes(data=True) if d["op"] == "linear"}
    assert {"layers.0.feed_forward.w1", "layers.0.attention.wq"} <= linears
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=2, verify=False)
    assert {"layers.*.feed_forward.w1", "layers.*.attention.wo"} <= set(plan)
    _verify(model, plan)


class Branching(nn.Module):
    def __init__(self):
        super().__init__()
        self.proj = nn.Linear(DIM, DIM)

    def forward(self, x):
        return torch.cond(x.sum() > 0, lambda t: self.proj(t), lambda t: -t, (x,))


class CondLlama(TitanLlama):
    def __init__(self):
        super().__init__(layers=2)
        self.branch = Branching()

    def forward(self, tokens):
        return self.output(self.branch(self.tok_embeddings(tokens)))


def test_unknown_higher_order_op_is_a_trace_error_naming_op_and_module():
    with pytest.raises(TraceError, match=r"branch: .*higher-order op 'cond'"):
        synthesize(CondLlama(), example_inputs=(example_tokens(),), verify=False)


def test_layer_groups_of_a_dict_map_keys_not_positions():
    groups = LayerGroups({"layers": [["0", "2"], ["1"]]})
    assert groups.original("layers.1.mlp") == ["layers.1.mlp"]
    assert groups.original("layers.0.mlp") == ["layers.0.mlp", "layers.2.mlp"]
    assert groups.original("layers.5.mlp") == ["layers.5.mlp"]
