"""Shard propagation on hand-built graphs: each test isolates one rule of the analysis."""

import networkx as nx

from autotp.synth.fixpoint import analyse
from autotp.synth.assign import assign_roles
from autotp.synth.graph import Ref, add_node


def _mlp_graph(middle, down_in=16):
    """x -> up (Linear 8->16) -> middle ops -> down (Linear down_in->8) -> output."""
    g = nx.DiGraph()
    add_node(g, "x", "placeholder", kind="input", shape=(2, 3, 8))
    add_node(g, "w_up", "placeholder", kind="param", param="up.weight", shape=(16, 8))
    add_node(g, "w_down", "placeholder", kind="param", param="down.weight", shape=(8, down_in))
    add_node(g, "up", "linear", (Ref("x"), Ref("w_up")), shape=(2, 3, 16), module="up")
    last = middle(g, "up")
    add_node(g, "down", "linear", (Ref(last), Ref("w_down")), shape=(2, 3, 8), module="down")
    add_node(g, "out", "output", ((Ref("down"),),), kind="output")
    return g


def _roles(g):
    flow, dropped = analyse(g)
    return {m: r.kind for m, r in assign_roles(g, flow, dropped).items()}


def test_pointwise_path_gives_column_then_row():
    def middle(g, x):
        add_node(g, "act", "gelu", (Ref(x),), shape=(2, 3, 16), module="")
        return "act"

    assert _roles(_mlp_graph(middle)) == {"up": "column", "down": "row"}


def test_head_split_and_merge_keeps_the_shard():
    def middle(g, x):
        add_node(g, "v", "view", (Ref(x), [2, 3, 4, 4]), shape=(2, 3, 4, 4))
        add_node(g, "t", "transpose", (Ref("v"), 1, 2), shape=(2, 4, 3, 4))
        add_node(g, "t2", "transpose", (Ref("t"), 1, 2), shape=(2, 3, 4, 4))
        add_node(g, "r", "reshape", (Ref("t2"), [2, 3, 16]), shape=(2, 3, 16))
        return "r"

    assert _roles(_mlp_graph(middle)) == {"up": "column", "down": "row"}


def test_reduction_over_the_sharded_dim_replicates_with_reason():
    """Would catch a softmax over the features being run on a shard (wrong normaliser)."""
    def middle(g, x):
        add_node(g, "sm", "_softmax", (Ref(x), -1, False), shape=(2, 3, 16))
        return "sm"

    g = _mlp_graph(middle)
    flow, dropped = analyse(g)
    roles = assign_roles(g, flow, dropped)
    assert roles["up"].kind == "replicate" and "reduces over the sharded dim" in roles["up"].reason
    assert roles["down"].kind != "row"  # its input is now replicated; it is the output head here


def test_split_of_a_fused_output_is_packed_with_part_sizes():
    """Would catch a fused [gate | up] getting plain ColwiseParallel (rank 0 would hold all of gate)."""
    def middle(g, x):
        add_node(g, "sp", "split_with_sizes", (Ref(x), [8, 8], -1))
        add_node(g, "a", "getitem", (Ref("sp"), 0), shape=(2, 3, 8))
        add_node(g, "b", "getitem", (Ref("sp"), 1), shape=(2, 3, 8))
        add_node(g, "m", "mul", (Ref("a"), Ref("b")), shape=(2, 3, 8))
        return "m"

    g = _mlp_graph(middle, down_in=8)
    flow, dropped = analyse(g)
    roles = assign_roles(g, flow, dropped)
    assert (roles["up"].kind, roles["up"].sizes) == ("packed_column", (8, 8))
    assert roles["down"].kind == "row"


def test_view_that_interleaves_the_shard_makes_a_packed_row():
    """Would catch the row reading an interleaved shard as contiguous: after ``(4, 4)`` -> transpose
    -> merge, each rank's features are a share of each of 4 parts of 4, so the row's input columns
    are permuted to match (a plain row would contract the wrong features)."""
    def middle(g, x):
        add_node(g, "v", "view", (Ref(x), [2, 3, 4, 4]), shape=(2, 3, 4, 4))
        add_node(g, "t", "transpose", (Ref("v"), 2, 3), shape=(2, 3, 4, 4))
        add_node(g, "r", "reshape", (Ref("t"), [2, 3, 16]), shape=(2, 3, 16))
        return "r"

    g = _mlp_graph(middle)
    flow, dropped = analyse(g)
    roles = assign_roles(g, flow, dropped)
    assert roles["up"].kind == "column"
    assert (roles["down"].kind, roles["down"].sizes) == ("row", (4, 4, 4, 4))


def test_full_size_replicated_operand_breaks_the_shard():
    """Would catch adding a replicated full-width tensor to a shard (each rank adds the wrong slice)."""
    def middle(g, x):
        add_node(g, "bias", "placeholder", kind="input", shape=(16,))
        add_node(g, "a", "add", (Ref(x), Ref("bias")), shape=(2, 3, 16))
        return "a"

    assert _roles(_mlp_graph(middle))["up"] == "replicate"


def test_linear_reaching_the_output_is_a_head():
    g = nx.DiGraph()
    add_node(g, "x", "placeholder", kind="input", shape=(2, 3, 8))
    add_node(g, "w", "placeholder", kind="param", param="head.weight", shape=(32, 8))
    add_node(g, "h", "linear", (Ref("x"), Ref("w")), shape=(2, 3, 32), module="head")
    add_node(g, "f", "to", (Ref("h"),), shape=(2, 3, 32))
    add_node(g, "out", "output", ((Ref("f"),),), kind="output")
    assert _roles(g) == {"head": "head"}
