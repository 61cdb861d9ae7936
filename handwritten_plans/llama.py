"""Llama and Mistral: separate q/k/v and gate/up projections, RMSNorm before each branch."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, SequenceParallel

from autotp.styles import RotaryEmbedParallel
from handwritten_plans._blocks import row_output, shared_input, vocab_embedding, vocab_head


def decoder_plan(prefix: str, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The Llama-shaped decoder: attention and MLP column/row pairs, SP norms that gather once."""
    layer = f"{prefix}.layers.*"
    plan: dict[str, ParallelStyle] = {
        f"{prefix}.embed_tokens": vocab_embedding(sequence_parallel=sequence_parallel),
        **{f"{layer}.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
        f"{layer}.self_attn.o_proj": row_output(sequence_parallel=sequence_parallel),
        f"{layer}.mlp.gate_proj": ColwiseParallel(),
        f"{layer}.mlp.up_proj": ColwiseParallel(),
        f"{layer}.mlp.down_proj": row_output(sequence_parallel=sequence_parallel),
    }
    # The norms before each branch hand their column projections one replicated input (an all-gather
    # under SP), so the projections' input gradients are summed and reduced once per branch.
    plan |= {f"{layer}.{norm}": shared_input(sequence_parallel=sequence_parallel)
             for norm in ("input_layernorm", "post_attention_layernorm")}
    if sequence_parallel:
        plan |= {f"{prefix}.rotary_emb": RotaryEmbedParallel(), f"{prefix}.norm": SequenceParallel()}
    return plan


def parallelize_llama(model: nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Plan for ``LlamaForCausalLM`` / ``MistralForCausalLM``.

    Plain TP: 2 all-reduces per layer, plus 1 for the vocab-parallel embedding. SP: 2 all-gathers and
    2 reduce-scatters per layer, plus 1 of each at the embedding and head.
    """
    return decoder_plan("model", sequence_parallel=sequence_parallel) | {
        "lm_head": vocab_head(sequence_parallel=sequence_parallel)
    }
