"""Tracing and the analysis graph: what the exported program turns into, and layer collapsing."""

import networkx as nx
import torch
from torch import nn

from autotp.synth.graph import Ref, add_node, build_graph
from autotp.synth.ops import view_dim
from autotp.synth.trace import LayerGroups, collapsed, group_entries, trace
from synth_toy import TitanLlama, TwoLinear, example_tokens


def test_build_graph_records_linear_modules_params_and_shapes():
    """Would catch losing nn_module_stack or parameter names: the analysis keys roles by them."""
    program, _ = trace(TwoLinear(), (torch.randn(2, 11, 64),))
    g = build_graph(program)
    linears = [d for _, d in g.nodes(data=True) if d["op"] == "linear"]
    assert [d["module"] for d in linears] == ["up", "down"]
    assert [d["shape"] for d in linears] == [(2, 11, 256), (2, 11, 64)]
    params = {d["param"] for _, d in g.nodes(data=True) if d["kind"] == "param"}
    assert params == {"up.weight", "up.bias", "down.weight", "down.bias"}
    assert nx.is_directed_acyclic_graph(g)


def test_add_node_links_every_ref_including_lists():
    g = nx.DiGraph()
    add_node(g, "a", "placeholder", kind="input", shape=(2,))
    add_node(g, "b", "placeholder", kind="input", shape=(2,))
    add_node(g, "c", "cat", ([Ref("a"), Ref("b")], 0), shape=(4,))
    assert set(g.predecessors("c")) == {"a", "b"}


def test_view_dim_follows_heads_split_and_merge_and_rejects_interleave():
    assert view_dim((2, 11, 64), (2, 11, 4, 16), 2) == 2
    assert view_dim((2, 11, 4, 16), (2, 11, 64), 2) == 2
    assert view_dim((2, 11, 4, 16), (2, 44, 16), 2) is None


def test_collapsed_keeps_one_layer_per_structure_and_restores():
    """Would catch tracing cost growing with depth, or the model left mutated after tracing."""
    model = TitanLlama(layers=5)
    with collapsed(model) as groups:
        assert len(model.layers) == 1
    assert len(model.layers) == 5
    assert groups.groups == {"layers": [[0, 1, 2, 3, 4]]}


def test_group_entries_separates_layers_that_differ():
    entries = nn.ModuleList([nn.Linear(4, 4), nn.Linear(4, 8), nn.Linear(4, 4)])
    assert group_entries(entries) == [[0, 2], [1]]


def test_layer_groups_map_traced_names_to_every_layer():
    groups = LayerGroups({"model.layers": [[0, 2], [1]]})
    assert groups.original("model.layers.1.mlp") == ["model.layers.1.mlp"]
    assert groups.original("model.layers.0.mlp") == ["model.layers.0.mlp", "model.layers.2.mlp"]
    assert groups.original("lm_head") == ["lm_head"]


def test_trace_on_meta_model_needs_no_storage():
    with torch.device("meta"):
        model = TitanLlama(layers=3)
    program, groups = trace(model, (example_tokens().to("meta"),))
    assert groups.groups == {"layers": [[0, 1, 2]]}
    assert any(n.target == torch.ops.aten.linear.default for n in program.graph.nodes)
