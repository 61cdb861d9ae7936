"""Each pass of the synthesizer alone, on hand-built graphs (``add_node``), after the analysis.

The graphs are the smallest that hold a pattern: one decoder layer with a norm read by two column
projections, a parallel block whose branch outputs are summed, a tied embedding and head, a
weight read outside its module. Each test names the failure it would catch.
"""

import networkx as nx
import pytest

from autotp.errors import MeshError
from autotp.synth.analysis import Flow, analyse
from autotp.synth.assign import assign_roles, foreign_reads, tie_conflicts
from autotp.synth.build import build_plan, style_for
from autotp.synth.graph import Ref, add_node
from autotp.synth.pipeline import (
    POST_PASSES,
    Analysis,
    constraint_fixpoint,
    divisibility,
    kv_replication,
    owned_outputs,
    shard_counts,
)
from autotp.synth.roles import ROLE_KINDS, Kind, Role
from autotp.synth.sequence import sequence_parallel_roles
from autotp.synth.shared import shared_input_roles
from autotp.synth.trace import LayerGroups

LAYER = "layers.0"


def _param(g, name, fqn, shape):
    add_node(g, name, "placeholder", kind="param", param=fqn, shape=shape)


def _call(g, name, op, args, shape, module):
    """A node of ``module``; its stack is every prefix of the module below the root."""
    parts = module.split(".")
    stack = tuple(".".join(parts[:i]) for i in range(2 if module.startswith("layers.") else 1, len(parts) + 1))
    add_node(g, name, op, args, shape=shape, module=module, stack=stack)


def block_graph(*, tied: bool = False, extra_reader: bool = False) -> nx.DiGraph:
    """ids -> embed -> norm -> (q, k) -> q * k -> o -> + residual -> head -> logits.

    ``tied``: the head reads the embedding table; ``extra_reader``: the norm output is also added
    to the residual (a reader that is not a column Linear).
    """
    g = nx.DiGraph()
    add_node(g, "ids", "placeholder", kind="input", shape=(2, 3))
    _param(g, "w_emb", "embed.weight", (32, 8))
    _call(g, "emb", "embedding", (Ref("w_emb"), Ref("ids")), (2, 3, 8), "embed")
    _param(g, "w_n", f"{LAYER}.norm.weight", (8,))
    _call(g, "n", "rms_norm", (Ref("emb"), [8], Ref("w_n")), (2, 3, 8), f"{LAYER}.norm")
    for p in "qk":
        _param(g, f"w_{p}", f"{LAYER}.attn.{p}.weight", (16, 8))
        _call(g, p, "linear", (Ref("n"), Ref(f"w_{p}")), (2, 3, 16), f"{LAYER}.attn.{p}")
    _call(g, "m", "mul", (Ref("q"), Ref("k")), (2, 3, 16), f"{LAYER}.attn")
    _param(g, "w_o", f"{LAYER}.attn.o.weight", (8, 16))
    _call(g, "o", "linear", (Ref("m"), Ref("w_o")), (2, 3, 8), f"{LAYER}.attn.o")
    _call(g, "r", "add", (Ref("n" if extra_reader else "emb"), Ref("o")), (2, 3, 8), LAYER)
    _param(g, "w_h", "head.weight", (32, 8))
    _call(g, "logits", "linear", (Ref("r"), Ref("w_emb" if tied else "w_h")), (2, 3, 32), "head")
    add_node(g, "out", "output", ((Ref("logits"),),), kind="output")
    return g


def parallel_graph() -> nx.DiGraph:
    """x -> norm -> attn (up, gelu, down) and mlp (up, gelu, down) side by side; their outputs summed,
    then added to the residual."""
    g = nx.DiGraph()
    add_node(g, "x", "placeholder", kind="input", shape=(2, 3, 8))
    _param(g, "w_n", f"{LAYER}.norm.weight", (8,))
    _call(g, "n", "rms_norm", (Ref("x"), [8], Ref("w_n")), (2, 3, 8), f"{LAYER}.norm")
    for branch in ("attn", "mlp"):
        _param(g, f"w_{branch}_up", f"{LAYER}.{branch}.up.weight", (16, 8))
        _call(g, f"{branch}_up", "linear", (Ref("n"), Ref(f"w_{branch}_up")), (2, 3, 16), f"{LAYER}.{branch}.up")
        _call(g, f"{branch}_act", "gelu", (Ref(f"{branch}_up"),), (2, 3, 16), f"{LAYER}.{branch}")
        _param(g, f"w_{branch}_down", f"{LAYER}.{branch}.down.weight", (8, 16))
        _call(g, f"{branch}_down", "linear", (Ref(f"{branch}_act"), Ref(f"w_{branch}_down")), (2, 3, 8),
              f"{LAYER}.{branch}.down")
    _call(g, "sum", "add", (Ref("attn_down"), Ref("mlp_down")), (2, 3, 8), LAYER)
    _call(g, "r", "add", (Ref("sum"), Ref("x")), (2, 3, 8), LAYER)
    add_node(g, "out", "output", ((Ref("r"),),), kind="output")
    return g


def _analysed(g):
    flow, dropped = analyse(g)
    return flow, assign_roles(g, flow, dropped)


def _kinds(roles):
    return {module: role.kind for module, role in roles.items()}


def test_analysis_of_the_block_gives_the_megatron_roles():
    _, roles = _analysed(block_graph())
    assert _kinds(roles) == {"embed": "vocab_embedding", f"{LAYER}.attn.q": "column", f"{LAYER}.attn.k": "column",
                             f"{LAYER}.attn.o": "row", "head": "head"}


def test_shared_input_pass_shares_a_norm_read_only_by_column_projections():
    """Would catch q and k each all-reducing their input gradient (two reductions where one suffices)."""
    g = block_graph()
    flow, roles = _analysed(g)
    out = shared_input_roles(g, flow, roles, sequence_parallel=False)
    assert out[f"{LAYER}.norm"].kind == "shared_input"
    assert {m: r for m, r in out.items() if m != f"{LAYER}.norm"} == roles  # nothing else changes


def test_shared_input_pass_leaves_a_norm_with_another_reader():
    """The residual add reads the norm output too: a Replicate() DTensor there would mix a DTensor
    into plain code, so the norm keeps no role."""
    g = block_graph(extra_reader=True)
    flow, roles = _analysed(g)
    assert f"{LAYER}.norm" not in shared_input_roles(g, flow, roles, sequence_parallel=False)


def test_sequence_pass_shards_the_stream_between_the_rows_and_the_columns():
    """Would catch a row that all-reduces under SP (it must reduce-scatter onto the sequence) or a
    head that reads the sequence-sharded stream as if replicated."""
    g = block_graph()
    flow, roles = _analysed(g)
    sp = sequence_parallel_roles(g, flow, roles)
    assert sp["embed"].seq_output and sp[f"{LAYER}.attn.o"].seq_output
    assert sp["head"].seq_input
    assert sp[f"{LAYER}.norm"].kind == "seq_norm_gather"
    assert not sp[f"{LAYER}.attn.q"].seq_input  # it reads the gathered norm output
    shared = shared_input_roles(g, flow, sp, sequence_parallel=True)
    assert shared[f"{LAYER}.norm"].dtensor_output  # one gather, one reduce-scatter of its gradient


def test_parallel_block_pass_reduces_the_summed_branches_once():
    """Would catch attention and MLP rows each all-reducing before their outputs are added."""
    g = parallel_graph()
    flow, roles = _analysed(g)
    out = shared_input_roles(g, flow, roles, sequence_parallel=False)
    assert out[f"{LAYER}.attn.down"].partial_output and out[f"{LAYER}.mlp.down"].partial_output
    assert out[LAYER].kind == "stream_block" and out[f"{LAYER}.norm"].kind == "stream_params"
    plan = build_plan(out, LayerGroups())
    assert type(plan[f"{LAYER}.attn.down"]).__name__ == "PartialRowwiseParallel"


def test_tied_embedding_and_head_agree_without_conflicts():
    """The table is sharded on its rows by both users (vocab-parallel lookup, vocab-sharded head)."""
    g = block_graph(tied=True)
    assert foreign_reads(g) == ({}, {})
    flow, roles = _analysed(g)
    assert tie_conflicts(g, roles, flow) == {}
    assert roles["embed"].kind == "vocab_embedding" and roles["head"].kind == "head"


def test_foreign_read_of_a_weight_keeps_it_whole():
    """A weight read outside its own module (``layers.0`` multiplies by o's weight) would be read
    sharded there if o were row-parallel: foreign_reads names its Linear, and the analysis keeps
    the pair whole."""
    g = block_graph()
    _call(g, "peek", "mul", (Ref("r"), Ref("w_o")), (8, 16), LAYER)
    foreign, forced = foreign_reads(g)
    assert set(foreign) == {"o"} and "read by mul in layers.0" in foreign["o"] and forced == {}
    flow, dropped = analyse(g, whole=foreign)
    roles = assign_roles(g, flow, dropped, forced)
    assert roles[f"{LAYER}.attn.o"].kind == "replicate"
    assert roles[f"{LAYER}.attn.q"].kind == "replicate"  # its shard would have reached o
    assert "whose weight stays whole" in roles[f"{LAYER}.attn.q"].reason


def test_role_kinds_are_checked_when_a_role_is_made():
    """An unknown kind fails where it is written, not later when a style is built for it."""
    with pytest.raises(ValueError, match="unknown role kind 'colum'"):
        Role("colum", "a typo")
    role = Role("column", "fine")
    assert role.kind is Kind.COLUMN and role.kind == "column"
    assert set(Kind) == set(ROLE_KINDS)


@pytest.mark.parametrize("kind", sorted(ROLE_KINDS))
def test_every_role_kind_builds_a_style_or_none(kind):
    """Every kind maps to a style (or to none: kept whole) without raising."""
    role = Role(kind, "test", sizes=(8, 8), names=("n_head",), kv_heads=1, head_dim=4, heads=2)
    style_for(role)


# --- the pipeline: the constraint fixpoint and each post-pass on an Analysis ---------------------

def _fixpoint(g, tp_size=None) -> Analysis:
    return constraint_fixpoint(g, LayerGroups(), None, None, tp_size)


def test_constraint_fixpoint_keeps_a_foreign_read_whole_in_one_round():
    g = block_graph()
    _call(g, "peek", "mul", (Ref("r"), Ref("w_o")), (8, 16), LAYER)
    a = _fixpoint(g)
    assert a.roles[f"{LAYER}.attn.o"].kind == "replicate" and a.roles[f"{LAYER}.attn.q"].kind == "replicate"


def test_post_passes_run_in_the_documented_order():
    assert [p.__name__ for p in POST_PASSES] == ["shard_counts", "kv_replication", "sequence_parallel",
                                                  "shared_inputs", "divisibility", "owned_outputs"]


def test_shard_counts_pass_gives_a_counting_role_or_extends_a_params_role():
    a = _fixpoint(block_graph())
    a.counts = {f"{LAYER}.attn": ("n_heads",)}
    out = shard_counts(a)
    assert out.roles[f"{LAYER}.attn"].kind == "shard_counts" and out.roles[f"{LAYER}.attn"].names == ("n_heads",)
    assert f"{LAYER}.attn" not in a.roles  # the input Analysis is not changed


def test_passes_that_need_a_tp_size_leave_the_analysis_alone_without_one():
    a = _fixpoint(block_graph())
    assert kv_replication(a) is a and divisibility(a) is a


def test_divisibility_pass_names_the_module_tp_does_not_divide():
    """16 features over tp=3: MeshError naming q's module and the sizes that would work."""
    a = _fixpoint(block_graph(), tp_size=3)
    with pytest.raises(MeshError, match=r"layers\.0\.attn\.[qk]: .*size 16.*tp=3") as error:
        divisibility(a)
    assert error.value.fix == "use tp in (1, 2, 4, 8, 16)"


def test_owned_outputs_pass_marks_a_module_whose_output_is_written_in_place():
    """Would catch a style handing the caller a view of a DTensor's local shard that it then
    modifies in place (the shard changes under the DTensor)."""
    g = block_graph()
    _call(g, "bump", "add_", (Ref("q"), 1.0), (2, 3, 16), f"{LAYER}.attn")
    out = owned_outputs(_fixpoint(g))
    assert out.roles[f"{LAYER}.attn.q"].owned_output


def test_a_pair_that_gave_way_to_a_shard_dropped_later_is_tried_again():
    """q -> o (a row pair) meets, at an add, the output of a larger column candidate ``big`` that a
    softmax over its features drops later. q gave way to ``big`` (the smaller side of a LoRA-like
    meeting stays whole); once ``big`` is dropped, q and o must be sharded again, not kept whole
    for nothing (a hybrid block's attention was left whole this way)."""
    g = nx.DiGraph()
    add_node(g, "x", "placeholder", kind="input", shape=(2, 3, 8))
    _param(g, "w_q", f"{LAYER}.attn.q.weight", (4, 8))
    _call(g, "q", "linear", (Ref("x"), Ref("w_q")), (2, 3, 4), f"{LAYER}.attn.q")
    _call(g, "act", "gelu", (Ref("q"),), (2, 3, 4), f"{LAYER}.attn")
    _param(g, "w_o", f"{LAYER}.attn.o.weight", (8, 4))
    _call(g, "o", "linear", (Ref("act"), Ref("w_o")), (2, 3, 8), f"{LAYER}.attn.o")
    _param(g, "w_big", f"{LAYER}.big.weight", (8, 8))
    _call(g, "big", "linear", (Ref("x"), Ref("w_big")), (2, 3, 8), f"{LAYER}.big")
    _call(g, "sum", "add", (Ref("o"), Ref("big")), (2, 3, 8), LAYER)
    _call(g, "sm", "_softmax", (Ref("sum"), -1, False), (2, 3, 8), LAYER)
    add_node(g, "out", "output", ((Ref("sm"),),), kind="output")
    flow, roles = _analysed(g)
    assert roles[f"{LAYER}.big"].kind == "replicate"
    assert roles[f"{LAYER}.attn.q"].kind == "column" and roles[f"{LAYER}.attn.o"].kind == "row"


def test_attention_with_a_per_head_mask_made_outside_breaks_the_shard():
    """A replicated (b, heads, q, k) bias meeting head-sharded q/k/v: per rank the mask would still
    hold every head (a crash at best). Default-deny: the shard stops there, with the reason; a
    mask broadcast over the heads (size 1) is fine."""
    from autotp.synth.ops import Break, Out, apply_rule

    for heads_in_mask, expected in ((4, Break), (1, Out)):
        g = nx.DiGraph()
        for n in "qkv":
            add_node(g, n, "placeholder", kind="input", shape=(2, 4, 3, 8))
        add_node(g, "mask", "placeholder", kind="input", shape=(2, heads_in_mask, 3, 3))
        add_node(g, "att", "scaled_dot_product_attention", (Ref("q"), Ref("k"), Ref("v"), Ref("mask")),
                 shape=(2, 4, 3, 8))
        flow = Flow(g)
        result = apply_rule(g, "att", {"q": 1, "k": 1, "v": 1}, flow)
        assert isinstance(result, expected), result
        if expected is Break:
            assert "holds all 4 heads" in result.reason
