"""Qwen3.5: hybrid layers, gated full attention on some, Gated DeltaNet linear attention on the rest.

Full-attention layers and every MLP are sharded as in Qwen3 (q_proj holds ``[query | gate]`` per
head, so a column split by heads keeps each head's gate with its query). The linear-attention
mixer (``linear_attn``: fused qkv in-projection, causal conv over the channels, the delta-rule scan)
stays replicated, as NeMo and transformers' plan leave it: there is no stock kernel for a sharded
scan. Plan keys name ``self_attn`` / ``linear_attn`` with a wildcard layer index, so each matches
only the layers of its kind.

Under SP the residual stays sequence-sharded: each pre-norm all-gathers once, the replicated
``linear_attn`` runs on the whole sequence, and its replicated output is sliced back to this rank's
positions (no collective forward; an all-gather of its gradient backward). The pre-norms hand
their output on as one replicated DTensor (:func:`handwritten_plans._blocks.shared_input`), which
the whole mixer takes as a plain tensor (:class:`~autotp.styles.ReplicatedModule`).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Shard
from torch.distributed.tensor.parallel import ParallelStyle

from autotp.styles import HeadShardedNorm, ReplicatedModule
from handwritten_plans._blocks import shared_input, vocab_head
from handwritten_plans.gemma3 import text_prefix
from handwritten_plans.llama import decoder_plan


def parallelize_qwen3_5(model: nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Plan for ``Qwen3_5ForCausalLM`` and ``Qwen3_5ForConditionalGeneration`` (vision replicated).

    Plain TP: 2 all-reduces per full-attention layer, 1 per linear-attention layer (its MLP), + 1
    at the embedding. SP: per layer 2 all-gathers and 2 reduce-scatters (1 reduce-scatter on a
    linear-attention layer), + 1 of each at the embedding and head.
    """
    prefix = text_prefix(model)
    layer = f"{prefix}.layers.*"
    plan = decoder_plan(prefix, sequence_parallel=sequence_parallel) | {
        f"{layer}.self_attn.q_norm": HeadShardedNorm(),
        f"{layer}.self_attn.k_norm": HeadShardedNorm(),
        "lm_head": vocab_head(sequence_parallel=sequence_parallel),
    }
    if sequence_parallel:
        # Every pre-norm all-gathers; the whole mixer takes the gathered DTensor as a plain tensor
        # and its replicated output is sliced back to this rank's positions.
        plan[f"{layer}.linear_attn"] = ReplicatedModule(output_layouts=Shard(1))
        return plan
    # Plain TP: only the full-attention layers' pre-norms feed column projections (q/k/v); the
    # linear-attention layers' pre-norm feeds the whole mixer and stays a plain tensor.
    del plan[f"{layer}.input_layernorm"]
    types = model.config.get_text_config().layer_types
    plan |= {f"{prefix}.layers.{i}.input_layernorm": shared_input(sequence_parallel=False)
             for i, kind in enumerate(types) if kind == "full_attention"}
    return plan
