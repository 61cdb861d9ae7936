"""Named building blocks of the handwritten plans, so that each family's plan reads as data."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel

from autotp.styles import VocabParallelEmbedding


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


def vocab_head(*, sequence_parallel: bool) -> ParallelStyle:
    """LM head sharded over the vocabulary; logits stay a ``Shard(-1)`` DTensor for a
    vocab-parallel loss (``loss_parallel``) or log-prob computation."""
    if sequence_parallel:
        return ColwiseParallel(input_layouts=Shard(1), output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(output_layouts=Shard(-1), use_local_output=False)
