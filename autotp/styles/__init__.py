"""ParallelStyles that torch does not ship but LLM plans need (20 of them).

Each style is a small class in the manner of ``torch.distributed.tensor.parallel.style``: keyword-only
options, a comment on the shard algebra, and :meth:`declares` saying what it shards for the checker.

- :class:`Colwise`, :class:`Rowwise`: torch's two Linear styles with options: a fused output or
  input cut part by part (``sizes``), a weight stored ``(in, out)`` (``weight_in_out``), a row whose
  output stays a partial sum (``output_layouts=Partial()``) or whose output spans have their
  gradient reduced (``reduce_grad_features``).
- :class:`Boundary`: every conversion at the edge of a sharded region, per side (``inputs``:
  replicate (all, one ``stream``, or at some ``columns``, shared), gather, slice, whole,
  reduce_grad; ``outputs``: replicate, local, sum, shard, shard_all, sum_shard, gather (a
  sequence-parallel norm's output all-gathered once for its column readers), slice (a module
  computed whole handing on its own positions); the gradient each way; a copy of the output).
- :class:`VocabParallelEmbedding`: vocab-sharded embedding, looked up on the local shard (local-size gradient).
- :class:`RotaryEmbedParallel`: a rotary module whose output is a tuple ``(cos, sin)``.
- :class:`ReplicatedWithGradAllReduce`: replicated parameters whose gradients are partial (a per-head
  norm such as Qwen3's QK-norm on head-sharded tensors), or kept replicated DTensors for a module on
  a DTensor stream (``dtensor=True``).
- :class:`WidthShardedNorm`: a norm over a width that is sharded (OLMo2 QK-norm), kept exact by
  reducing its statistic across ranks.
- :class:`ShardedStatistics`: a block whose own code takes per-token statistics (mean, std) over its
  sharded width runs on DTensors, each statistic all-reduced where it is made.
- :class:`DTensorRegion`: a module whose code cannot run on per-rank tensors (a sum over heads before a
  top-k) runs on DTensors with some Linears sharded.
- :class:`ShardCounts`: divide a module's head counts by tp, for code that sizes slices from them
  (attributes), rewrite the sizes its code writes as constants (``literals``), or set one rank's
  counts where kv heads are repeated over the ranks (``query_heads``).
- :class:`LocalWidthInputs`: a module that reads its widths from an input's size (nanoGPT's ``C = x.size(-1)``)
  sees that input at its per-rank width; its column Linears read the real one.
- :class:`ReplicatedKVColwise` (with ``ShardCounts(query_heads=...)`` on the attention): tp larger
  than the number of kv heads; each rank computes the one kv head its query heads read, from a copy
  of its rows (copies' gradients summed) or, with ``gather=True``, from sharded rows gathered each forward.
- :class:`GroupCopies`: parts of a packed output with fewer groups than tp, held as copies or gathered.
- :class:`ExpertsParallel`, :class:`PartialGradRouter`: MoE experts (3-D parameters) sharded on their
  FFN dim, and a router kept whole that runs backward on the experts' partial gradients.
- :class:`ShardedInputs`: a module takes values made outside it (a per-head bias built at the root)
  cut to its own heads at entry.
- :class:`JoinPartialSums`: a sequence-parallel parallel block whose branches' ``Partial()`` sums meet the
  ``Shard(1)`` stream in its own code: reduce-scattered there, the gradient all-gathered once.
- :class:`PartialSumBlock`: a module that adds up row Linears' partial sums (a MoE loop over
  ``nn.Linear`` experts) reduces them once at its output, and its input gradient once at entry.
- :class:`HeadParams`: a module's own parameters meeting a sharded activation (per-head vectors
  sharded with the heads, shared ones' gradients all-reduced), and raw weight parameters used as
  Linears (``x @ W.T``, ``F.linear``, einsum, bmm; ``columns`` / ``rows``) sharded as their Linear would be.
- :class:`MultiheadAttentionParallel`: torch's ``nn.MultiheadAttention`` sharded by heads.

Modules, by concern: :mod:`~autotp.styles.linear`, :mod:`~autotp.styles.boundaries`,
:mod:`~autotp.styles.embedding`, :mod:`~autotp.styles.norms`, :mod:`~autotp.styles.params`,
:mod:`~autotp.styles.raw_linear`, :mod:`~autotp.styles.torch_attention`, :mod:`~autotp.styles.experts`,
:mod:`~autotp.styles.attention` (rotary, head counts, kv heads), and :mod:`~autotp.styles.base` (what
they share). Every style is importable from ``autotp.styles``; a name folded into another style's
options (see ``RENAMED``) raises an ``AttributeError`` that gives the new spelling.
"""

from autotp.styles.attention import LocalWidthInputs, ReplicatedKVColwise, RotaryEmbedParallel, ShardCounts
from autotp.styles.base import packed_row_order
from autotp.styles.boundaries import Boundary, PartialSumBlock, ShardedInputs
from autotp.styles.embedding import VocabParallelEmbedding
from autotp.styles.region import DTensorRegion
from autotp.styles.experts import ExpertsParallel, PartialGradRouter
from autotp.styles.linear import Colwise, GroupCopies, JoinPartialSums, Rowwise
from autotp.styles.params import HeadParams
from autotp.styles.statistics import ShardedStatistics
from autotp.styles.torch_attention import MultiheadAttentionParallel
from autotp.styles.norms import ReplicatedWithGradAllReduce, WidthShardedNorm

__all__ = [
    "Boundary",
    "HeadParams",
    "MultiheadAttentionParallel",
    "LocalWidthInputs",
    "ReplicatedKVColwise",
    "ExpertsParallel",
    "ReplicatedWithGradAllReduce",
    "GroupCopies",
    "Colwise",
    "Rowwise",
    "JoinPartialSums",
    "PartialSumBlock",
    "PartialGradRouter",
    "RotaryEmbedParallel",
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
    "LinearParams": "HeadParams(shard_dims=..., columns=..., rows=...)",
    "ReplicatedParams": "ReplicatedWithGradAllReduce(dtensor=True)",
    "SequenceParallelAllGather": "Boundary(outputs='gather', style=SequenceParallel()) (use_local_output=False: "
                                 "local_outputs=False; partial_grad=True: output_grad='partial')",
    "OwnPositionsOutput": "Boundary(outputs='slice', output_grad='partial', style=ReplicatedWithGradAllReduce())",
    "SharedReplicatedInput": "Boundary(inputs='replicate', columns=..., input_grad='partial' if partial_grad, style=...)",
    "ReducedInputGrads": "Boundary(inputs='reduce_grad') (partial_params=True: style=ReplicatedWithGradAllReduce())",
    "ReplicatedStream": "Boundary(inputs='replicate', outputs='local', stream=0)",
    "KVHeadCounts": "ShardCounts(query_heads=heads, ratio=attribute, kv_names=kv_attributes, head_names=head_attributes)",
}


def __getattr__(name: str):
    if name in RENAMED:
        raise AttributeError(f"autotp.styles.{name} was folded into another style's options: use {RENAMED[name]} "
                             "(docs/plans.md lists every rename)")
    raise AttributeError(f"module 'autotp.styles' has no attribute {name!r}")
