"""Gemma3: tied embeddings, four norms per layer, per-head q_norm / k_norm.

Embeddings and head stay replicated because they are tied (as NeMo ships it; ``autotp.synthesize``
makes the tied pair vocab-parallel). The norm before each branch (``input_layernorm``,
``pre_feedforward_layernorm``) hands q/k/v or gate/up one replicated input, all-gathered once under
SP, so backward reduces the branch's input gradient once; the two post-norms act on the row outputs
and stay sequence-sharded.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    ParallelStyle,
    PrepareModuleInput,
    PrepareModuleOutput,
    SequenceParallel,
)

from autotp.styles import ReplicatedWithGradAllReduce, RotaryEmbedParallel
from handwritten_plans._blocks import row_output, shared_input

_PRE_NORMS = ("input_layernorm", "pre_feedforward_layernorm")  # read by the column projections
_POST_NORMS = ("post_attention_layernorm", "post_feedforward_layernorm")  # on the row outputs


def text_prefix(model: nn.Module) -> str:
    """Where the text decoder lives: ``model`` (causal LM) or ``model.language_model`` (VLM)."""
    return "model.language_model" if hasattr(model.model, "language_model") else "model"


def parallelize_gemma3(model: nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Plan for ``Gemma3ForCausalLM`` and ``Gemma3ForConditionalGeneration`` (vision tower replicated)."""
    prefix = text_prefix(model)
    layer = f"{prefix}.layers.*"
    plan: dict[str, ParallelStyle] = {
        **{f"{layer}.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
        f"{layer}.self_attn.o_proj": row_output(sequence_parallel=sequence_parallel),
        f"{layer}.self_attn.q_norm": ReplicatedWithGradAllReduce(),
        f"{layer}.self_attn.k_norm": ReplicatedWithGradAllReduce(),
        f"{layer}.mlp.gate_proj": ColwiseParallel(),
        f"{layer}.mlp.up_proj": ColwiseParallel(),
        f"{layer}.mlp.down_proj": row_output(sequence_parallel=sequence_parallel),
    }
    plan |= {f"{layer}.{norm}": shared_input(sequence_parallel=sequence_parallel) for norm in _PRE_NORMS}
    if sequence_parallel:
        plan |= {
            f"{prefix}.embed_tokens": PrepareModuleOutput(
                output_layouts=Replicate(), desired_output_layouts=Shard(1), use_local_output=False
            ),
            f"{prefix}.rotary_emb": RotaryEmbedParallel(),
            **{f"{layer}.{norm}": SequenceParallel() for norm in _POST_NORMS},
            f"{prefix}.norm": SequenceParallel(),
            "lm_head": PrepareModuleInput(
                input_layouts=(Shard(1),), desired_input_layouts=(Replicate(),), use_local_output=True
            ),
        }
    return plan
