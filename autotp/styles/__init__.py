"""ParallelStyles that torch does not ship but LLM plans need.

Each style is a small class in the manner of ``torch.distributed.tensor.parallel.style``: keyword-only
options, static ``_prepare_input_fn`` / ``_prepare_output_fn``, and a comment on the shard algebra.

- :class:`VocabParallelEmbedding`: vocab-sharded embedding, looked up on the local shard (local-size gradient).
- :class:`RotaryEmbedParallel`: a rotary module whose output is a tuple ``(cos, sin)``.
- :class:`SequenceParallelAllGather`: a sequence-parallel norm that all-gathers its output once, so
  that every column-parallel consumer (q, k, v or gate, up) shares one all-gather.
- :class:`ReplicatedWithGradAllReduce` / :class:`HeadShardedNorm`: replicated parameters whose
  gradients are partial (a per-head norm such as Qwen3's QK-norm on head-sharded tensors).
- :class:`WidthShardedNorm`: a norm over a width that is sharded (OLMo2 QK-norm), kept exact by
  reducing its statistic across ranks.
- :class:`ShardedStatistics`: a block whose own code takes per-token statistics (mean, std) over its
  sharded width runs on DTensors, each statistic all-reduced where it is made.
- :class:`DTensorRegion`: a module whose code cannot run on per-rank tensors (a sum over heads before a
  top-k, a literal group count in a reshape) runs on DTensors with some Linears sharded.
- :class:`BroadcastRowwiseParallel`: a row-parallel Linear whose output spans are broadcast along a
  sharded dim downstream (a scan's state projections), their gradient all-reduced.
- :class:`PackedColwiseParallel`: a column-parallel Linear whose output is split into parts
  (fused ``qkv_proj`` / ``gate_up_proj``), sharded part by part.
- :class:`PackedRowwiseParallel`: a row-parallel Linear whose input features are parts with a share
  of each on every rank (heads merged back from a fixed number of groups).
- :class:`ShardCounts`: divide a module's head counts by tp, for code that sizes slices from them.
- :class:`LocalWidthInputs`: a module that reads its widths from an input's size (nanoGPT's ``C = x.size(-1)``)
  sees that input at its per-rank width; its column Linears read the real one.
- :class:`ReplicatedKVColwise`, :class:`KVHeadCounts`: tp larger than the number of kv heads; each
  rank computes the one kv head its query heads read, from a copy of its rows (copies' gradients
  summed) or, with ``gather=True``, from sharded rows gathered each forward.
- :class:`ExpertsParallel`, :class:`AllReduceOutput`, :class:`GradAllReduceOutputSlice`: MoE experts
  (3-D parameters) sharded on their FFN dim, and the reductions around them and around MLA.
- :class:`SharedReplicatedInput`: column projections reading one tensor at a module's entry share
  one ``Replicate()`` DTensor of it (no norm before them), so their input gradient is reduced once;
  :class:`PartialGradInput`: one column hands its input gradient back unreduced, reduced further back.
- :class:`ShardedInputs`: a module takes values made outside it (a per-head bias built at the root)
  cut to its own heads at entry.
- :class:`PartialGradRouter`: a router kept whole that runs backward on the experts' partial
  gradients, so the MoE block's input gradient is reduced once; :class:`ReplicatedInputs` hands
  such a block its input as a DTensor where no norm before it can.
- :class:`JoinPartialSums`: a sequence-parallel parallel block whose branches' ``Partial()`` sums meet the
  ``Shard(1)`` stream in its own code: reduce-scattered there, the gradient all-gathered once.
- :class:`PartialSumBlock`: a module that adds up row Linears' partial sums (a MoE loop over
  ``nn.Linear`` experts) reduces them once at its output, and its input gradient once at entry.
- :class:`OwnPositionsOutput`: under sequence parallel, a module computed whole from inputs without
  gradient (a learned position table) hands on only this rank's positions; its parameters'
  gradients are left ``Partial()``, so its output's gradient is never gathered.
- :class:`GatherSequenceInput`, :class:`SequenceParallelMoEBlock`, :class:`PartialExpertsParallel`:
  under sequence parallel, a module's sequence-sharded inputs gathered once at its entry, and a MoE
  block that takes whole tokens and reduce-scatters its experts' partial sums.
- :class:`HeadParams`, :class:`LinearParams`: a module's own parameters meeting a sharded activation
  (per-head vectors sharded with the heads, shared ones' gradients all-reduced), and raw weight
  parameters used as Linears (``x @ W.T``, ``F.linear``, einsum, bmm) sharded as their Linear would be.
- :class:`MultiheadAttentionParallel`: torch's ``nn.MultiheadAttention`` sharded by heads (packed q/k/v
  column-parallel part by part, ``out_proj`` row-parallel) with a per-rank forward.

Modules, by concern: :mod:`~autotp.styles.linear` (packed, ``(in, out)`` and partial rows),
:mod:`~autotp.styles.embedding`, :mod:`~autotp.styles.norms` and :mod:`~autotp.styles.params`
(norms, and a module's own parameters meeting a sharded activation: :class:`HeadParams`),
:mod:`~autotp.styles.raw_linear` (raw weight parameters used as Linears: :class:`LinearParams`),
:mod:`~autotp.styles.torch_attention` (``nn.MultiheadAttention``),
:mod:`~autotp.styles.experts`, :mod:`~autotp.styles.attention` (rotary, head counts, kv heads), :mod:`~autotp.styles.boundaries` (layouts at the edges of sharded regions),
and :mod:`~autotp.styles.base` (what they share). Every style is importable from ``autotp.styles``.
"""

from autotp.styles.attention import (KVHeadCounts, LocalWidthInputs, ReplicatedKVColwise, RotaryEmbedParallel,
                                    ShardCounts)
from autotp.styles.base import packed_row_order
from autotp.styles.boundaries import (
    AllReduceOutput,
    ShardedInputs,
    GradAllReduceOutputSlice,
    OwnedOutput,
    OwnPositionsOutput,
    PartialGradInput,
    PartialSumBlock,
    ReducedInputGrads,
    ReplicatedModule,
    ReplicatedInputs,
    ReplicatedOutput,
    ReplicatedParams,
    ReplicatedStream,
    GatherSequenceInput,
    SliceSequenceInput,
    SequenceParallelAllGather,
    SharedReplicatedInput,
)
from autotp.styles.embedding import VocabParallelEmbedding
from autotp.styles.region import DTensorRegion
from autotp.styles.experts import ExpertsParallel, PartialExpertsParallel, PartialGradRouter, SequenceParallelMoEBlock
from autotp.styles.linear import (
    BroadcastRowwiseParallel,
    ColwiseParallelInOut,
    GroupCopies,
    JoinPartialSums,
    PackedColwiseParallel,
    PackedRowwiseParallel,
    PartialRowwiseParallel,
    RowwiseParallelInOut,
)
from autotp.styles.params import HeadParams
from autotp.styles.statistics import ShardedStatistics
from autotp.styles.raw_linear import LinearParams
from autotp.styles.torch_attention import MultiheadAttentionParallel
from autotp.styles.norms import HeadShardedNorm, ReplicatedWithGradAllReduce, WidthShardedNorm

__all__ = [
    "BroadcastRowwiseParallel",
    "GatherSequenceInput",
    "SliceSequenceInput",
    "PartialExpertsParallel",
    "SequenceParallelMoEBlock",
    "HeadParams",
    "LinearParams",
    "MultiheadAttentionParallel",
    "LocalWidthInputs",
    "KVHeadCounts",
    "ReplicatedKVColwise",
    "AllReduceOutput",
    "ExpertsParallel",
    "GradAllReduceOutputSlice",
    "ReplicatedWithGradAllReduce",
    "HeadShardedNorm",
    "OwnedOutput",
    "OwnPositionsOutput",
    "GroupCopies",
    "PackedColwiseParallel",
    "PackedRowwiseParallel",
    "JoinPartialSums",
    "PartialRowwiseParallel",
    "PartialSumBlock",
    "ReducedInputGrads",
    "PartialGradRouter",
    "ColwiseParallelInOut",
    "RowwiseParallelInOut",
    "ReplicatedInputs",
    "ReplicatedOutput",
    "ReplicatedModule",
    "ReplicatedParams",
    "ReplicatedStream",
    "RotaryEmbedParallel",
    "SequenceParallelAllGather",
    "SharedReplicatedInput",
    "PartialGradInput",
    "ShardCounts",
    "ShardedInputs",
    "VocabParallelEmbedding",
    "WidthShardedNorm",
    "ShardedStatistics",
    "DTensorRegion",
    "packed_row_order",
]
