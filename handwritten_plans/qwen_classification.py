"""Qwen3 (and Qwen2) sequence classification: the Qwen decoder with a ``score`` head.

``score`` maps hidden states to ``num_labels`` (often 1 for a reward model): too few outputs to
shard, and its output is pooled at each sequence's last non-pad token, so it stays replicated. Under
SP its input is all-gathered back to the full sequence first (1 all-gather), so that the pooling
indexes global positions.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from autotp.styles import Boundary, ReplicatedWithGradAllReduce
from handwritten_plans.llama import decoder_plan


def parallelize_qwen_classification(model: nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Plan for ``Qwen3ForSequenceClassification`` / ``Qwen2ForSequenceClassification``.

    Plain TP: 2 all-reduces per layer + 1 at the embedding. SP: 2 all-gathers and 2 reduce-scatters
    per layer, 1 reduce-scatter at the embedding and 1 all-gather before ``score``.
    """
    plan = decoder_plan("model", sequence_parallel=sequence_parallel)
    if hasattr(model.model.layers[0].self_attn, "q_norm"):
        plan |= {f"model.layers.*.self_attn.{n}": ReplicatedWithGradAllReduce() for n in ("q_norm", "k_norm")}
    if sequence_parallel:
        plan["score"] = Boundary(inputs="gather")  # the stream arrives as a Shard(1) DTensor
    return plan
