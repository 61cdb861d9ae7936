"""ParallelStyles that torch does not ship but LLM plans need (28 of them).

Each style is a small class in the manner of ``torch.distributed.tensor.parallel.style``: keyword-only
options, a comment on the shard algebra, and :meth:`declares` saying what it shards for the checker.

- :class:`Colwise`, :class:`Rowwise`: torch's two Linear styles with options: a fused output or
  input cut part by part (``sizes``), a weight stored ``(in, out)`` (``weight_in_out``), a row whose
  output stays a partial sum (``output_layouts=Partial()``) or whose output spans have their
  gradient reduced (``reduce_grad_features``).
- :class:`Boundary`: every conversion at the edge of a sharded region, per side (``inputs``:
  replicate, gather, slice, whole; ``outputs``: replicate, local, sum, shard, shard_all, sum_shard;
  the gradient each way; a copy of the output).
- :class:`VocabParallelEmbedding`: vocab-sharded embedding, looked up on the local shard (local-size gradient).
- :class:`RotaryEmbedParallel`: a rotary module whose output is a tuple ``(cos, sin)``.
- :class:`SequenceParallelAllGather`: a sequence-parallel norm that all-gathers its output once, so
  that every column-parallel consumer (q, k, v or gate, up) shares one all-gather.
- :class:`ReplicatedWithGradAllReduce`: replicated parameters whose gradients are partial (a per-head
  norm such as Qwen3's QK-norm on head-sharded tensors).
- :class:`WidthShardedNorm`: a norm over a width that is sharded (OLMo2 QK-norm), kept exact by
  reducing its statistic across ranks.
- :class:`ShardedStatistics`: a block whose own code takes per-token statistics (mean, std) over its
  sharded width runs on DTensors, each statistic all-reduced where it is made.
- :class:`DTensorRegion`: a module whose code cannot run on per-rank tensors (a sum over heads before a
  top-k) runs on DTensors with some Linears sharded.
- :class:`ShardCounts`: divide a module's head counts by tp, for code that sizes slices from them
  (attributes), or rewrite the sizes its code writes as constants (``literals``).
- :class:`LocalWidthInputs`: a module that reads its widths from an input's size (nanoGPT's ``C = x.size(-1)``)
  sees that input at its per-rank width; its column Linears read the real one.
- :class:`ReplicatedKVColwise`, :class:`KVHeadCounts`: tp larger than the number of kv heads; each
  rank computes the one kv head its query heads read, from a copy of its rows (copies' gradients
  summed) or, with ``gather=True``, from sharded rows gathered each forward.
- :class:`GroupCopies`: parts of a packed output with fewer groups than tp, held as copies or gathered.
- :class:`ExpertsParallel`, :class:`PartialGradRouter`: MoE experts (3-D parameters) sharded on their
  FFN dim, and a router kept whole that runs backward on the experts' partial gradients.
- :class:`SharedReplicatedInput`: column projections reading one tensor at a module's entry share
  one ``Replicate()`` DTensor of it (no norm before them), so their input gradient is reduced once.
- :class:`ShardedInputs`: a module takes values made outside it (a per-head bias built at the root)
  cut to its own heads at entry.
- :class:`ReducedInputGrads`: a block whose inputs reach column Linears through replicated ops only
  reduces their gradients at entry.
- :class:`JoinPartialSums`: a sequence-parallel parallel block whose branches' ``Partial()`` sums meet the
  ``Shard(1)`` stream in its own code: reduce-scattered there, the gradient all-gathered once.
- :class:`ReplicatedStream`, :class:`ReplicatedParams`: a parallel block run on its residual stream
  as a ``Replicate()`` DTensor, and a module's own parameters as replicated DTensors.
- :class:`PartialSumBlock`: a module that adds up row Linears' partial sums (a MoE loop over
  ``nn.Linear`` experts) reduces them once at its output, and its input gradient once at entry.
- :class:`OwnPositionsOutput`: under sequence parallel, a module computed whole from inputs without
  gradient (a learned position table) hands on only this rank's positions.
- :class:`HeadParams`, :class:`LinearParams`: a module's own parameters meeting a sharded activation
  (per-head vectors sharded with the heads, shared ones' gradients all-reduced), and raw weight
  parameters used as Linears (``x @ W.T``, ``F.linear``, einsum, bmm) sharded as their Linear would be.
- :class:`MultiheadAttentionParallel`: torch's ``nn.MultiheadAttention`` sharded by heads.

Modules, by concern: :mod:`~autotp.styles.linear`, :mod:`~autotp.styles.boundaries`,
:mod:`~autotp.styles.embedding`, :mod:`~autotp.styles.norms`, :mod:`~autotp.styles.params`,
:mod:`~autotp.styles.raw_linear`, :mod:`~autotp.styles.torch_attention`, :mod:`~autotp.styles.experts`,
:mod:`~autotp.styles.attention` (rotary, head counts, kv heads), and :mod:`~autotp.styles.base` (what
they share). Every style is importable from ``autotp.styles``; a name folded into another style's
options (see ``RENAMED``) raises an ``AttributeError`` that gives the new spelling.
"""

from autotp.styles.attention import (KVHeadCounts, LocalWidthInputs, ReplicatedKVColwise, RotaryEmbedParallel,
                                    ShardCounts)
from autotp.styles.base import packed_row_order
from autotp.styles.boundaries import (
    Boundary,
    OwnPositionsOutput,
    PartialSumBlock,
    ReducedInputGrads,
    ReplicatedParams,
    ReplicatedStream,
    SequenceParallelAllGather,
    ShardedInputs,
    SharedReplicatedInput,
)
from autotp.styles.embedding import VocabParallelEmbedding
from autotp.styles.region import DTensorRegion
from autotp.styles.experts import ExpertsParallel, PartialGradRouter
from autotp.styles.linear import Colwise, GroupCopies, JoinPartialSums, Rowwise
from autotp.styles.params import HeadParams
from autotp.styles.statistics import ShardedStatistics
from autotp.styles.raw_linear import LinearParams
from autotp.styles.torch_attention import MultiheadAttentionParallel
from autotp.styles.norms import ReplicatedWithGradAllReduce, WidthShardedNorm

__all__ = [
    "Boundary",
    "HeadParams",
    "LinearParams",
    "MultiheadAttentionParallel",
    "LocalWidthInputs",
    "KVHeadCounts",
    "ReplicatedKVColwise",
    "ExpertsParallel",
    "ReplicatedWithGradAllReduce",
    "OwnPositionsOutput",
    "GroupCopies",
    "Colwise",
    "Rowwise",
    "JoinPartialSums",
    "PartialSumBlock",
    "ReducedInputGrads",
    "PartialGradRouter",
    "ReplicatedParams",
    "ReplicatedStream",
    "RotaryEmbedParallel",
    "SequenceParallelAllGather",
    "SharedReplicatedInput",
    "ShardCounts",
    "ShardedInputs",
    "VocabParallelEmbedding",
    "WidthShardedNorm",
    "ShardedStatistics",
    "DTensorRegion",
    "packed_row_order",
]


# Names folded into another style's options (issue 40): old name -> its new spelling.
RENAMED = {
    "PackedColwiseParallel": "Colwise(sizes=...)",
    "ColwiseParallelInOut": "Colwise(weight_in_out=True)",
    "PackedRowwiseParallel": "Rowwise(sizes=...)",
    "BroadcastRowwiseParallel": "Rowwise(reduce_grad_features=...)",
    "RowwiseParallelInOut": "Rowwise(weight_in_out=True)",
    "PartialRowwiseParallel": "Rowwise(output_layouts=Partial(), use_local_output=False) (local=True: use_local_output=True)",
    "HeadShardedNorm": "ReplicatedWithGradAllReduce()",
    "PartialExpertsParallel": "ExpertsParallel(partial_output=True)",
    "ReplicatedOutput": "Boundary(outputs='replicate') (partial_grad=True: Boundary(output_grad='partial'))",
    "AllReduceOutput": "Boundary(outputs='sum')",
    "GradAllReduceOutputSlice": "Boundary(reduce_grad_features=((out_features - width, out_features),))",
    "ReplicatedInputs": "Boundary(inputs='replicate', outputs='local')",
    "PartialGradInput": "Boundary(inputs='replicate', input_grad='partial', style=...)",
    "GatherSequenceInput": "Boundary(inputs='gather') (reshard_output=True: outputs='shard'; use_local_output: local_inputs)",
    "SequenceParallelMoEBlock": "Boundary(inputs='gather', outputs='sum_shard')",
    "SliceSequenceInput": "Boundary(inputs='slice')",
    "ReplicatedModule": "Boundary(inputs='whole')",
    "OwnedOutput": "Boundary(copy_output=True, style=...)",
}


def __getattr__(name: str):
    if name in RENAMED:
        raise AttributeError(f"autotp.styles.{name} was folded into another style's options: use {RENAMED[name]} "
                             "(docs/plans.md lists every rename)")
    raise AttributeError(f"module 'autotp.styles' has no attribute {name!r}")
