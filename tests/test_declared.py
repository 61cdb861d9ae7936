"""Styles declare what they shard; the checker reads the declarations, not the style classes."""

from __future__ import annotations

import pytest
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from autotp import styles
from autotp.check import check_plan
from autotp.models import build_model
from autotp.styles.declared import NOTHING, Shards, chain_declaration, declaration, torch_shards


def test_torch_styles_are_read_from_their_layouts():
    assert declaration(ColwiseParallel()) == Shards(linear="column", output_sharded=True)
    assert declaration(ColwiseParallel(output_layouts=Replicate())).output_sharded is False
    assert declaration(RowwiseParallel()) == Shards(linear="row", input_sharded=True)
    assert declaration(RowwiseParallel(output_layouts=Shard(-1))).scatters_heads
    assert declaration(RowwiseParallel(input_layouts=Replicate())).input_sharded is False
    assert declaration(None) is NOTHING


def test_autotp_styles_declare_their_own_layouts():
    assert declaration(styles.Colwise(sizes=(8, 4, 4))).sizes == (8, 4, 4)
    assert declaration(styles.Colwise(weight_in_out=True)).weight_in_out
    assert declaration(styles.ReplicatedKVColwise(kv_heads=1, head_dim=16)).kv_repeat == (1, 16)
    head = declaration(styles.HeadParams(shard_dims={"scale": 0}, reduce=("bias",), counts=("n_heads",)))
    assert (head.param_dims, head.grads_reduced, head.counts) == ({"scale": 0}, ("bias",), ("n_heads",))
    assert head.head_params and head.reduces(["bias"]) and not head.reduces(["scale"])
    norm = declaration(styles.ReplicatedWithGradAllReduce())
    assert norm.head_params and norm.reduces(["weight", "bias"]) and norm.param_dims is None
    experts = declaration(styles.ExpertsParallel())
    assert experts.experts == {"gate_up_proj": 1, "down_proj": 2} and experts.experts_packed == {"gate_up_proj": 2}
    assert declaration(styles.WidthShardedNorm()).width_norm
    assert declaration(styles.ShardCounts(names=("num_heads",))).counts == ("num_heads",)


def test_a_wrapper_adds_its_boundary_to_what_it_wraps():
    """The outer style's fields first, then the wrapped one's: a column under sliced entries is
    both."""
    wrapped = styles.ShardedInputs(inputs=((0, 1),), style=ColwiseParallel())
    merged = chain_declaration(wrapped)
    assert merged.slices_entries and merged.linear == "column" and merged.output_sharded
    assert declaration(wrapped) == Shards(slices_entries=True)


class _ColumnByAnotherName(ParallelStyle):
    """A user's column style that is not a ``ColwiseParallel``: it applies one and says so."""

    def _apply(self, module, device_mesh):
        return ColwiseParallel()._apply(module, device_mesh)

    def declares(self) -> Shards:
        return torch_shards(ColwiseParallel())


class _Undeclared(_ColumnByAnotherName):
    declares = None  # declares nothing: the checker cannot know it shards


@pytest.fixture(scope="module")
def tiny_llama():
    return build_model("llama", tiny=True, tp=2, device="cpu")


def _plan(column: ParallelStyle) -> dict:
    layer = "model.layers.*"
    return {f"{layer}.self_attn.{p}_proj": column for p in "qkv"} | {
        f"{layer}.self_attn.o_proj": RowwiseParallel(),
        f"{layer}.mlp.gate_proj": ColwiseParallel(), f"{layer}.mlp.up_proj": ColwiseParallel(),
        f"{layer}.mlp.down_proj": RowwiseParallel()}


def test_the_checker_reads_a_new_style_by_its_declaration(tiny_llama):
    """A style class the checker has never seen is checked by what it declares: declared as a
    column, the plan is read as with torch's ColwiseParallel (no finding); declaring nothing, the
    row after it has no sharded input (the finding names o_proj). Would catch the checker testing
    classes again."""
    assert check_plan(tiny_llama, _plan(ColwiseParallel()), tp_size=2) == []
    assert check_plan(tiny_llama, _plan(_ColumnByAnotherName()), tp_size=2) == []
    found = check_plan(tiny_llama, _plan(_Undeclared()), tp_size=2)
    assert {(f.module, f.kind) for f in found} == {("model.layers.0.self_attn.o_proj", "row_without_shard")}, found
