"""Named building blocks of the handwritten plans, so that each family's plan reads as data."""

from __future__ import annotations

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from autotp.styles import Boundary, Rowwise, VocabParallelEmbedding


def vocab_embedding(*, sequence_parallel: bool) -> ParallelStyle:
    """Embedding sharded over the vocabulary; under SP its output is sequence-sharded and stays a
    DTensor, so that transformers builds position ids and masks from the global sequence length."""
    if sequence_parallel:
        return VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
    return VocabParallelEmbedding(input_layouts=Replicate())


def row_output(*, sequence_parallel: bool) -> ParallelStyle:
    """Row-parallel Linear closing a column/row pair: all-reduce, or reduce-scatter under SP."""
    if sequence_parallel:
        return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
    return RowwiseParallel()


def partial_row() -> ParallelStyle:
    """Row-parallel Linear of one branch of a parallel block: its output stays a ``Partial()``
    DTensor, summed with the other branch's before the residual add reduces both at once (an
    all-reduce, or a reduce-scatter onto the ``Shard(1)`` stream under SP)."""
    return Rowwise(output_layouts=Partial(), use_local_output=False)


def vocab_head(*, sequence_parallel: bool) -> ParallelStyle:
    """LM head sharded over the vocabulary; logits stay a ``Shard(-1)`` DTensor for a
    vocab-parallel loss (``loss_parallel``) or log-prob computation."""
    if sequence_parallel:
        return ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)


def shared_input(*, sequence_parallel: bool) -> ParallelStyle:
    """A norm whose output every column projection of a branch reads (q/k/v, gate/up): returned as
    one ``Replicate()`` DTensor (all-gathered under SP), so backward reduces the summed input
    gradient once per branch (an all-reduce; a reduce-scatter under SP), not once per projection."""
    if sequence_parallel:
        return Boundary(outputs="gather", local_outputs=False, style=SequenceParallel())
    return Boundary(outputs="replicate")
