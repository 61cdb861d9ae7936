"""Each pass of the synthesizer alone, on hand-built graphs (``add_node``), after the analysis.

The graphs are the smallest that hold a pattern: one decoder layer with a norm read by two column
projections, a parallel block whose branch outputs are summed, a tied embedding and head, a
weight read outside its module, one square weight read by a column and a row, grouped-query
attention. Every step of :func:`~autotp.synth.pipeline.constraint_fixpoint` (foreign reads, tie
conflicts, fused outputs cut with global sizes) and every pass of
:func:`~autotp.synth.stages.post_passes` has a test here. Each test names the failure it would catch.
"""

from dataclasses import replace

import networkx as nx
import pytest
import torch
import torch.nn.functional as F
from torch import nn
from torch.distributed.tensor import Partial

from autotp.errors import MeshError
from autotp.synth import pipeline as pipeline_module
from autotp.synth.fixpoint import analyse
from autotp.synth.flow import Flow
from autotp.synth.assign import (
    assign_roles,
    foreign_reads,
    tie_conflicts,
    tied_embedding_modules,
)
from autotp.synth.build import build_plan, style_for
from autotp.synth.graph import Ref, add_node
from autotp.synth.kvheads import kv_roots
from autotp.synth.localize import Localization
from autotp.synth.partial_inputs import shared_inputs
from autotp.synth.pipeline import (constraint_fixpoint, divisibility, kv_replication, owned_outputs, sequence_parallel,
                                   shard_counts)
from autotp.synth.stages import Analysis, drop_checks, idiom_kinds, post_passes
from autotp.synth.roles import ROLE_KINDS, Kind, Role
from autotp.synth.sequence import gathers_before_masks, sequence_parallel_roles
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
    assert tuple(plan[f"{LAYER}.attn.down"].output_layouts) == (Partial(),)


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
    # A kind an idiom registers in its own module is known too, and stays a plain str.
    assert Role("multihead_attention", "registered by torch_attention").kind == "multihead_attention"
    with pytest.raises(ValueError, match="multihead_attention"):  # the message lists the registered kinds
        Role("colum", "a typo")


def test_idioms_register_their_own_role_kinds():
    """A kind only one idiom assigns lives in that idiom's module, with its meaning and its style."""
    kinds = idiom_kinds()
    assert not set(kinds) & set(ROLE_KINDS)
    owners = {kind: builder.__module__ for kind, (_, builder) in kinds.items()}
    assert owners["multihead_attention"] == "autotp.synth.torch_attention"
    assert owners["dtensor_region"] == owners["region_member"] == "autotp.synth.regions"
    assert all(meaning for meaning, _ in kinds.values())


@pytest.mark.parametrize("kind", sorted([*ROLE_KINDS, *idiom_kinds()]))
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
    """The idioms register their passes where they are defined (stages.post_pass); the order is one list."""
    assert [p.__name__ for p in post_passes()] == ["adapters", "shard_counts", "kv_replication", "torch_attention",
                                                  "sequence_parallel", "shared_inputs", "partial_sums", "whole_fronts",
                                                  "mixed_column_inputs", "width_statistics", "sliced_entries",
                                                  "dtensor_region_modules", "region_parallel_blocks", "divisibility", "owned_outputs", "untraced_linears",
                                                  "untraced_siblings"]


def test_idioms_register_their_drop_checks_in_order():
    assert [(c.__module__.rsplit(".", 1)[1], c.__name__) for c in drop_checks()] == [
        ("experts", "partial_sum_drops"), ("experts", "bias_breaks"), ("params", "stray_param_reads"),
        ("params", "stray_tree_reads"), ("entries", "stray_entry_reads"), ("head_loops", "head_loop_breaks")]


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
    _, roles = _analysed(g)
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


def test_shard_counts_pass_extends_a_params_role_rather_than_replacing_it():
    """A module that both holds per-head parameters and sizes a fused cut gets one role with both:
    replacing its ``head_params`` role by ``shard_counts`` would leave its parameters whole."""
    a = _fixpoint(block_graph())
    params = Role("head_params", "its scale meets the heads", (f"{LAYER}.attn",), param_dims=(("scale", 0),))
    a.roles = {**a.roles, f"{LAYER}.attn": params}
    a.counts = {f"{LAYER}.attn": ("n_heads",)}
    role = shard_counts(a).roles[f"{LAYER}.attn"]
    assert role.kind == "head_params" and role.param_dims == (("scale", 0),) and role.names == ("n_heads",)
    assert role.reason.startswith("its scale meets the heads; its attributes n_heads size its reshapes")


def square_tie_graph() -> nx.DiGraph:
    """x -> a (column) -> gelu -> b (row), both Linears reading one square weight ``w``: a shards its
    rows, b its columns."""
    g = nx.DiGraph()
    add_node(g, "x", "placeholder", kind="input", shape=(2, 3, 8))
    _param(g, "w", f"{LAYER}.a.weight", (8, 8))
    _call(g, "a", "linear", (Ref("x"), Ref("w")), (2, 3, 8), f"{LAYER}.a")
    _call(g, "act", "gelu", (Ref("a"),), (2, 3, 8), LAYER)
    _call(g, "b", "linear", (Ref("act"), Ref("w")), (2, 3, 8), f"{LAYER}.b")
    _call(g, "r", "add", (Ref("x"), Ref("b")), (2, 3, 8), LAYER)
    add_node(g, "out", "output", ((Ref("r"),),), kind="output")
    return g


def test_tie_conflicts_keep_the_origin_of_a_tied_rows_shard_whole_first():
    """Would catch a tied weight sharded on its rows by one user and its columns by the other (each
    copy would then hold a different half of one tensor). The row user's input shard comes from the
    column user: that column is kept whole first (the row then reads a replicated input and may
    shard the weight as the others do)."""
    g = square_tie_graph()
    flow, roles = _analysed(g)
    assert roles[f"{LAYER}.a"].kind == "column" and roles[f"{LAYER}.b"].kind == "row"
    conflicts = tie_conflicts(g, roles, flow)
    assert set(conflicts) == {"a"}
    assert "whose weight is tied (layers.0.a, layers.0.b)" in conflicts["a"]
    del flow.state[g.nodes["b"]["args"][0].name]  # no shard reaches the row: both users named
    conflicts = tie_conflicts(g, roles, flow)
    assert set(conflicts) == {"a", "b"}
    assert "its weight layers.0.a.weight is tied (layers.0.a, layers.0.b)" in conflicts["b"]


def test_constraint_fixpoint_keeps_conflicting_tied_weights_whole_in_later_rounds(caplog):
    """Would catch the fixpoint returning the first round's roles (a column and a row on one
    weight) instead of analysing again with the tie kept whole, or not saying so in its log."""
    with caplog.at_level("INFO", logger="autotp.synth.pipeline"):
        a = _fixpoint(square_tie_graph())
    assert a.roles[f"{LAYER}.a"].kind == "replicate" and a.roles[f"{LAYER}.b"].kind == "replicate"
    assert "is tied" in a.roles[f"{LAYER}.a"].reason
    assert "round 1: tied weights kept whole at ['a']" in caplog.text


def test_tied_embedding_modules_keep_the_lookup_of_a_conflicting_weight_whole():
    """Would catch a head kept whole for a tie conflict while the embedding that shares its table
    stays vocab-parallel (the two copies of the table would differ)."""
    g = block_graph(tied=True)
    assert tied_embedding_modules(g, {"logits": "tied, sharded two ways"}) == {"embed": "tied, sharded two ways"}
    assert tied_embedding_modules(g, {"o": "not the table"}) == {}


def test_constraint_fixpoint_keeps_a_fused_output_cut_with_global_sizes_whole(monkeypatch, caplog):
    """Would catch the fixpoint ignoring what localization found (a fused output cut with global
    sizes left column-parallel: every rank would cut its shard at the global offsets), or looping
    on a constraint it already has. Localization itself needs a module to run (see
    ``test_synth_localize.py``); here it reports q once."""
    calls = []

    def fake_localize(model, example_inputs, g, flow, roles, tp, groups):
        calls.append(tp)
        found = Localization()
        if roles[f"{LAYER}.attn.q"].kind == "column":
            found.unlocal["q"] = "its output is cut with fixed sizes; kept whole"
        return found

    monkeypatch.setattr(pipeline_module, "localize", fake_localize)
    with caplog.at_level("INFO", logger="autotp.synth.pipeline"):
        a = _fixpoint(block_graph())
    assert a.roles[f"{LAYER}.attn.q"].kind == "replicate" and "fixed sizes" in a.roles[f"{LAYER}.attn.q"].reason
    assert a.roles[f"{LAYER}.attn.k"].kind == "replicate"  # it meets q's output, now whole
    assert "round 1: fused outputs cut with global sizes at ['q']" in caplog.text
    assert calls == [2, 2]  # without a tp size the cuts are checked at 2; the second round adds nothing


def test_sequence_parallel_pass_runs_only_when_the_analysis_asks_for_it():
    """Would catch sequence-parallel roles leaking into a plain plan, or the pass not running under SP."""
    a = _fixpoint(block_graph())
    assert sequence_parallel(a) is a
    sp = sequence_parallel(replace(a, sequence_parallel=True))
    assert sp.roles[f"{LAYER}.norm"].kind == "seq_norm_gather" and sp.roles[f"{LAYER}.attn.o"].seq_output
    assert f"{LAYER}.norm" not in a.roles


def test_shared_inputs_pass_reads_sequence_parallel_from_the_analysis():
    """Plain: the norm returns one Replicate() DTensor for q and k. Under SP the norm's gather keeps
    its output a DTensor instead; would catch the pass applying the plain rule under SP."""
    a = _fixpoint(block_graph())
    assert shared_inputs(a).roles[f"{LAYER}.norm"].kind == "shared_input"
    sp = shared_inputs(sequence_parallel(replace(a, sequence_parallel=True)))
    assert sp.roles[f"{LAYER}.norm"].kind == "seq_norm_gather" and sp.roles[f"{LAYER}.norm"].dtensor_output


def test_divisibility_pass_keeps_a_vocab_table_tp_does_not_divide_whole():
    """30 embedding rows at tp=4 (everything else divides): the table stays whole with the tp sizes
    that would split it; would catch a plan that cannot be applied (30 rows over 4 ranks)."""
    g = block_graph()
    g.nodes["w_emb"]["shape"] = (30, 8)
    a = _fixpoint(g, tp_size=4)
    assert a.roles["embed"].kind == "vocab_embedding"
    role = divisibility(a).roles["embed"]
    assert role.kind == "replicate" and "its 30 rows do not split over tp=4 (tp in (1, 2, 3, 5, 6, 10, 15, 30) would)" in role.reason


def test_a_whole_vocab_table_that_starts_the_sequence_parallel_stream_slices_its_output():
    """Under SP the table kept whole still starts the sequence-sharded stream: its output is sliced
    to this rank's positions. Would catch the plain output a SequenceParallel norm then reads as
    this rank's shard (the sequence doubled: a crash, or wrong logits)."""
    g = block_graph()
    g.nodes["w_emb"]["shape"] = (30, 8)
    a = sequence_parallel(replace(_fixpoint(g, tp_size=4), sequence_parallel=True))
    assert a.roles["embed"].seq_output
    role = divisibility(a).roles["embed"]
    assert role.kind == "replicate" and role.seq_output
    assert "desired_output_layouts=(Shard(dim=1),)" in repr(style_for(role)), style_for(role)


def gqa_graph() -> nx.DiGraph:
    """x -> q (4 heads of 8), k and v (2 heads of 8) -> grouped-query attention -> o."""
    g = nx.DiGraph()
    add_node(g, "x", "placeholder", kind="input", shape=(2, 3, 32))
    for p, heads in (("q", 4), ("k", 2), ("v", 2)):
        _param(g, f"w_{p}", f"{LAYER}.attn.{p}.weight", (heads * 8, 32))
        _call(g, p, "linear", (Ref("x"), Ref(f"w_{p}")), (2, 3, heads * 8), f"{LAYER}.attn.{p}")
        _call(g, f"{p}_heads", "view", (Ref(p), [2, 3, heads, 8]), (2, 3, heads, 8), f"{LAYER}.attn")
        _call(g, f"{p}_t", "transpose", (Ref(f"{p}_heads"), 1, 2), (2, heads, 3, 8), f"{LAYER}.attn")
    add_node(g, "att", "scaled_dot_product_attention", (Ref("q_t"), Ref("k_t"), Ref("v_t")),
             kwargs={"enable_gqa": True}, shape=(2, 4, 3, 8), module=f"{LAYER}.attn", stack=(LAYER, f"{LAYER}.attn"))
    _call(g, "att_t", "transpose", (Ref("att"), 1, 2), (2, 3, 4, 8), f"{LAYER}.attn")
    _call(g, "merged", "reshape", (Ref("att_t"), [2, 3, 32]), (2, 3, 32), f"{LAYER}.attn")
    _param(g, "w_o", f"{LAYER}.attn.o.weight", (32, 32))
    _call(g, "o", "linear", (Ref("merged"), Ref("w_o")), (2, 3, 32), f"{LAYER}.attn.o")
    add_node(g, "out", "output", ((Ref("o"),),), kind="output")
    return g


class _Attention(nn.Module):
    """The module behind :func:`gqa_graph`: k/v repeated to the query heads by ``groups``
    (``num_key_value_groups``) or from the shapes (``enable_gqa``)."""

    def __init__(self, by_attribute: bool, repeat: int | None = None):
        super().__init__()
        self.q, self.k, self.v, self.o = nn.Linear(32, 32), nn.Linear(32, 16), nn.Linear(32, 16), nn.Linear(32, 32)
        self.num_key_value_groups = 2 if by_attribute else None
        self.repeat = repeat  # a constant repeat (not an int attribute: nothing can be divided)

    def forward(self, x):
        b, t, _ = x.shape
        q, k, v = (p(x).view(b, t, -1, 8).transpose(1, 2) for p in (self.q, self.k, self.v))
        groups = self.num_key_value_groups or (self.repeat and self.repeat[0])
        if groups:
            k, v = (z.repeat_interleave(groups, dim=1) for z in (k, v))
        y = F.scaled_dot_product_attention(q, k, v, enable_gqa=not groups)
        return self.o(y.transpose(1, 2).reshape(b, t, -1))


class _Stack(nn.Module):
    def __init__(self, by_attribute: bool, repeat: tuple[int] | None = None):
        super().__init__()
        self.layers = nn.ModuleList([nn.Module()])
        self.layers[0].attn = _Attention(by_attribute, repeat)

    def forward(self, x):
        return self.layers[0].attn(x)


def _gqa_analysis(tp_size: int, *, by_attribute: bool = True, repeat: tuple[int] | None = None) -> Analysis:
    """The fixpoint on :func:`gqa_graph` with its module (localization runs it to check the head
    views at per-rank shapes)."""
    model = _Stack(by_attribute, repeat)
    return constraint_fixpoint(gqa_graph(), LayerGroups(), model, (torch.randn(2, 3, 32),), tp_size)


def test_kv_roots_are_the_projections_with_fewer_heads_than_tp():
    """At tp=4 the 2-head k and v cannot be split by heads; q (4 heads) can. At tp=2 none is a kv root."""
    g = gqa_graph()
    flow, roles = _analysed(g)
    assert kv_roots(g, flow, roles, 4) == {"k": (2, "att"), "v": (2, "att")}
    assert kv_roots(g, flow, roles, 2) == {}


@pytest.mark.parametrize("by_attribute", [True, False], ids=["ratio-attribute", "enable-gqa"])
def test_kv_replication_pass_repeats_kv_heads_and_sets_the_per_rank_ratio(by_attribute):
    """tp=4 over 2 kv heads: k and v hold one kv head per rank (``kv_column``) and, where the module
    repeats kv heads by an attribute, it becomes the per-rank ratio (1). Would catch k/v left
    column-parallel (each rank a half head) or the ratio left at 2 (shapes that do not match)."""
    out = kv_replication(_gqa_analysis(4, by_attribute=by_attribute))
    assert out.kv_handled == {"k", "v"}
    for p in "kv":
        role = out.roles[f"{LAYER}.attn.{p}"]
        assert (role.kind, role.kv_heads, role.head_dim) == ("kv_column", 2, 8)
    counts = out.roles.get(f"{LAYER}.attn")
    if by_attribute:
        assert counts.kind == "kv_head_counts" and counts.kv_counts == (("num_key_value_groups", "ratio"),) \
            and counts.heads == 4
    else:
        assert counts is None  # the module repeats from the shapes: nothing to set
    divisibility(out)  # the kv roots, replicated per head, are not checked for divisibility


def test_kv_replication_pass_refuses_a_tp_that_is_not_a_multiple_of_the_kv_heads():
    """tp=3 over 2 kv heads: no even repetition; the error names k's module and the fix."""
    a = replace(_gqa_analysis(4), tp_size=3)  # the same analysis; q's 4 heads do not split over 3 either
    with pytest.raises(MeshError, match=r"layers\.0\.attn\.k: 2 kv heads cannot be shared evenly by tp=3") as error:
        kv_replication(a)
    assert error.value.module == f"{LAYER}.attn.k" and error.value.fix == "use tp a divisor or a multiple of 2"


def test_kv_replication_pass_refuses_an_attention_whose_ratio_no_attribute_holds():
    """The attention repeats kv heads by a constant inside a tuple: at per-rank shapes it would still
    repeat twice. Would catch a plan whose attention then fails (or repeats the wrong heads) on
    every rank; the error carries its parts as fields, as ``check_plan`` reads them."""
    a = _gqa_analysis(4, by_attribute=False, repeat=(2,))
    with pytest.raises(MeshError, match=r"layers\.0\.attn: tp=4 exceeds its 2 kv heads .* grouped-query ratio .*; "
                       "use tp <= 2") as error:
        kv_replication(a)
    assert error.value.module == f"{LAYER}.attn" and error.value.fix.startswith("use tp <= 2")
    assert "heads / kv_heads = 2" in error.value.found


def test_build_plan_folds_layers_into_a_star_only_where_every_layer_agrees():
    """Two layer types, traced as layers 0 and 1, standing for the even and odd layers of 12. q has
    one style everywhere: one ``layers.*`` key. ``up`` is a column in one type and a row in the
    other, and ``mixer.in`` exists in the even layers only: one key per layer, in layer order
    ("10" after "9"). Would catch a ``*`` key that gives the odd layers the even layers' style, or
    a mixer style on layers that have no mixer."""
    groups = LayerGroups({"layers": [[0, 2, 4, 6, 8, 10], [1, 3, 5, 7, 9, 11]]})
    roles = {"layers.0.attn.q": Role("column", ""), "layers.1.attn.q": Role("column", ""),
             "layers.0.mlp.up": Role("column", ""), "layers.1.mlp.up": Role("row", ""),
             "layers.0.mixer.in": Role("column", "")}
    plan = build_plan(roles, groups)
    assert type(plan.pop("layers.*.attn.q")).__name__ == "ColwiseParallel"
    assert list(plan) == [f"layers.{i}.mlp.up" for i in range(12)] + [f"layers.{i}.mixer.in" for i in range(0, 12, 2)]
    assert {type(plan[f"layers.{i}.mlp.up"]).__name__ for i in (1, 11)} == {"RowwiseParallel"}


def moe_graph(*, scale: str) -> nx.DiGraph:
    """x -> moe: router ``gate`` Linear -> softmax; grouped ``experts`` (3-D w1, w2 as bmm) whose
    output the block's own code multiplies by ``scale``: the routing weights (``"router"``, as
    torchtitan's combine does) or a constant buffer (``"buffer"``)."""
    g = nx.DiGraph()
    block = f"{LAYER}.moe"
    add_node(g, "x", "placeholder", kind="input", shape=(6, 8))
    _param(g, "w_gate", f"{block}.gate.weight", (4, 8))
    _call(g, "logits", "linear", (Ref("x"), Ref("w_gate")), (6, 4), f"{block}.gate")
    _call(g, "probs", "softmax", (Ref("logits"), -1), (6, 4), block)
    _call(g, "top", "narrow", (Ref("probs"), -1, 0, 1), (6, 1), block)
    _param(g, "w1", f"{block}.experts.w1", (4, 16, 8))
    _param(g, "w2", f"{block}.experts.w2", (4, 8, 16))
    _call(g, "h", "bmm", (Ref("w1"), Ref("x")), (6, 16), f"{block}.experts")
    _call(g, "y", "bmm", (Ref("w2"), Ref("h")), (6, 8), f"{block}.experts")
    if scale == "buffer":
        add_node(g, "s", "placeholder", kind="buffer", param=f"{block}.scale", shape=(6, 1))
    _call(g, "scaled", "mul", (Ref("y"), Ref("top" if scale == "router" else "s")), (6, 8), block)
    add_node(g, "out", "output", ((Ref("scaled"),),), kind="output")
    return g


@pytest.mark.parametrize("scale", ["router", "buffer"])
def test_moe_block_scaling_the_experts_output_by_routing_weights_reduces_inside(scale):
    """The experts' per-rank partial sum may leave the block unreduced (one reduce-scatter under SP)
    unless the block multiplies it by a value that carries a gradient: the routing weights'
    gradient would then be a partial sum no style reduces (torchtitan's Qwen3-MoE under SP: the
    router weight's gradient 65% off). A constant scale keeps the partial path."""
    from autotp.synth.sequence import partial_blocks

    g = moe_graph(scale=scale)
    roles = {f"{LAYER}.moe.experts": Role("experts", "")}
    expected = {} if scale == "router" else {f"{LAYER}.moe": set()}
    assert partial_blocks(g, roles, {f"{LAYER}.moe"}) == expected


def test_masked_module_after_a_block_gathers_at_entry():
    """A module that masks the stream right after a MoE block reads the block's output, which the
    residual region starts after (the block reduce-scatters it): none of its inputs is in the
    region, yet it reads the sequence-sharded stream and must gather it at entry (without this, a
    ``Shard(1)`` DTensor met the plain mask: "got mixed torch.Tensor and DTensor")."""
    g = nx.DiGraph()
    add_node(g, "x", "placeholder", kind="input", shape=(2, 3, 8))
    add_node(g, "mask", "placeholder", kind="input", shape=(2, 3, 1))
    _call(g, "moe_out", "view", (Ref("x"), [2, 3, 8]), (2, 3, 8), f"{LAYER}.moe")
    _call(g, "masked", "mul", (Ref("moe_out"), Ref("mask")), (2, 3, 8), f"{LAYER}.mix")
    region = {"masked"}
    found = gathers_before_masks(g, region, {}, {f"{LAYER}.mix"})
    assert found[f"{LAYER}.mix"].kind == "seq_gather" and found[f"{LAYER}.mix"].seq_output, found
