"""Per-rank parameter memory read off a plan (autotp.memory)."""

import doctest

import pytest
import torch
from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel, SequenceParallel

from autotp import memory
from autotp.errors import PlanError
from autotp.memory import format_bytes, param_bytes_per_rank

F32 = 4


class TwoLinear(nn.Module):
    def __init__(self, dim=8, hidden=16, bias=True):
        super().__init__()
        self.up = nn.Linear(dim, hidden, bias=bias)
        self.down = nn.Linear(hidden, dim, bias=bias)
        self.norm = nn.LayerNorm(dim)


def test_colwise_then_rowwise_shards_both_weights_and_only_the_colwise_bias():
    model = TwoLinear()
    plan = {"up": ColwiseParallel(), "down": RowwiseParallel()}
    per_rank, total = param_bytes_per_rank(model, plan, 4)
    weights = 2 * 8 * 16
    replicated = 8 + 2 * 8  # down.bias, norm weight and bias
    assert total == (weights + 16 + replicated) * F32
    assert per_rank == (weights // 4 + 16 // 4 + replicated) * F32


def test_empty_plan_replicates_everything():
    model = TwoLinear()
    per_rank, total = param_bytes_per_rank(model, {}, 8)
    assert per_rank == total == sum(p.numel() for p in model.parameters()) * F32


def test_sequence_parallel_norm_stays_replicated():
    model = TwoLinear()
    assert param_bytes_per_rank(model, {"norm": SequenceParallel()}, 2) == param_bytes_per_rank(model, {}, 2)


@pytest.mark.parametrize(("style", "rows_per_rank", "cols_per_rank"), [
    (RowwiseParallel(), 3, 4),  # vocabulary (dim 0) split: ceil(10 / 4) rows on the largest rank
    (ColwiseParallel(), 10, 1),  # embedding dim (dim 1) split
])
def test_embedding_shards_the_dimension_its_style_names(style, rows_per_rank, cols_per_rank):
    model = nn.Sequential(nn.Embedding(10, 4))
    per_rank, total = param_bytes_per_rank(model, {"0": style}, 4)
    assert total == 40 * F32
    assert per_rank == rows_per_rank * cols_per_rank * F32


def test_tied_parameter_counts_once():
    model = nn.Module()
    model.embed = nn.Embedding(16, 4)
    model.head = nn.Linear(4, 16, bias=False)
    model.head.weight = model.embed.weight
    per_rank, total = param_bytes_per_rank(model, {"embed": RowwiseParallel(), "head": ColwiseParallel()}, 2)
    assert total == 64 * F32
    assert per_rank == 32 * F32


def test_style_that_declares_its_dims_is_honoured():
    """A MoE style sharding 3-D expert weights by expert (dim 0) says so itself."""

    class ExpertParallel(ColwiseParallel):
        def sharded_param_dims(self, module):
            return {"gate_up": 0}

    model = nn.Module()
    model.experts = nn.Module()
    model.experts.gate_up = nn.Parameter(torch.zeros(4, 6, 3, device="meta"))
    per_rank, total = param_bytes_per_rank(model, {"experts": ExpertParallel()}, 4)
    assert (per_rank, total) == (18 * F32, 72 * F32)


def test_key_matching_is_per_dot_atom_like_parallelize_module():
    model = nn.Sequential(TwoLinear(), TwoLinear())
    per_rank, _ = param_bytes_per_rank(model, {"*.up": ColwiseParallel()}, 2)
    whole, _ = param_bytes_per_rank(model, {}, 2)
    assert per_rank == whole - 2 * (8 * 16 + 16) // 2 * F32


def test_key_that_matches_nothing_is_an_error():
    with pytest.raises(PlanError, match="matches no module"):
        param_bytes_per_rank(TwoLinear(), {"layers.*.up": ColwiseParallel()}, 2)


def test_real_llama_plan_puts_about_an_eighth_on_each_rank(meta_llama):
    from handwritten_plans import plan_for

    per_rank, total = param_bytes_per_rank(meta_llama, plan_for(meta_llama), 8)
    assert total == 8_030_261_248 * F32
    norms = sum(p.numel() for n, p in meta_llama.named_parameters() if "norm" in n) * F32
    assert per_rank == (total - norms) // 8 + norms


def test_format_bytes_picks_a_binary_unit():
    assert format_bytes(512) == "512 B"
    assert format_bytes(2**30 * 15) == "15.00 GiB"


def test_doctests_pass():
    assert doctest.testmod(memory).failed == 0


@pytest.mark.parametrize("tp", [2, 4])
def test_group_copies_count_their_expanded_rows(tp):
    """A projection with one B / C group copied to every rank (GroupCopies around a packed column):
    the estimate must equal what the sharded model holds per rank, measured by the verifier.
    Would catch the copies' base style not read (the projection counted whole) or the copies left
    out (under the measurement)."""
    import warnings

    from synth_toy import example_tokens
    from test_grouped_parts import GroupedScanMixer, HEAD_DIM, HEADS, _model

    from autotp.synth import synthesize
    from autotp.verifier import verify

    model = _model(lambda: GroupedScanMixer(groups=1, norm_group=HEADS * HEAD_DIM))
    plan = synthesize(model, example_inputs=(example_tokens(),), tp_size=tp, verify=False)
    per_rank, total = param_bytes_per_rank(model, plan, tp)
    with warnings.catch_warnings():
        warnings.simplefilter("ignore")
        measured = max(verify(model, plan, tp_size=tp, example_inputs=(example_tokens(),)).param_fraction)
    assert per_rank / total == pytest.approx(measured, abs=1e-4), (per_rank / total, measured)


def test_a_region_counts_the_descendants_it_shards():
    """``DTensorRegion`` names its descendants' parameters (``"a.weight"``): they are sharded, and the
    per-rank bytes say so (before: counted whole, 0.71 of a RetNet-like model where 0.50 was held)."""
    from autotp.styles import DTensorRegion

    block = nn.Module()
    block.a, block.b = nn.Linear(8, 8, bias=False), nn.Linear(8, 8, bias=False)
    model = nn.Sequential(block)
    plan = {"0": DTensorRegion(params={"a.weight": 0, "b.weight": 1})}
    assert param_bytes_per_rank(model, plan, 2) == (256, 512)
