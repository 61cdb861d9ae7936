"""Qwen3.5: hybrid layers, gated full attention on some, Gated DeltaNet linear attention on the rest.

Full-attention layers and every MLP are sharded as in Qwen3 (q_proj holds ``[query | gate]`` per
head, so a column split by heads keeps each head's gate with its query). The linear-attention
mixer (``linear_attn``) is sharded by heads, as autotp's synthesizer derives it from the graph:
the fused ``in_proj_qkv`` part by part (``[q | k | v]``), ``in_proj_z`` / ``in_proj_b`` /
``in_proj_a`` as columns, the depthwise causal conv over the joined q|k|v channels with its
weight packed like the parts, the per-head ``A_log`` / ``dt_bias`` with the heads, the gated norm
per head, and ``out_proj`` as the row. The delta-rule scan runs per head, so each rank runs it on
its own heads with no collective; ``key_dim`` / ``value_dim`` (the split sizes) are per rank. The
linear key and value head counts must be divisible by tp. NeMo and transformers' own plans keep
this mixer whole on every rank (0.95 of the parameters per rank at tp=2 on the tiny test config,
against 0.50 here).

Plan keys name ``self_attn`` / ``linear_attn`` with a wildcard layer index, so each matches only
the layers of its kind. The mixer multiplies its input by the padding mask before its projections,
so the pre-norm cannot hand them one shared DTensor (it would meet the plain mask): its output stays
a plain tensor (under SP, all-gathered once to the whole sequence) and each column wraps it. Under
SP ``out_proj`` reduce-scatters back onto the sequence-sharded stream.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, SequenceParallel

from autotp.styles import Boundary, Colwise, HeadParams, ReplicatedWithGradAllReduce
from handwritten_plans._blocks import row_output, shared_input, vocab_head
from handwritten_plans.gemma3 import text_prefix
from handwritten_plans.llama import decoder_plan


def linear_attention(layer: str, model: nn.Module, *, sequence_parallel: bool) -> dict[str, ParallelStyle]:
    """The Gated DeltaNet mixer of ``layer`` sharded by heads (see the module docstring)."""
    text = model.config.get_text_config()
    key_dim = text.linear_num_key_heads * text.linear_key_head_dim
    value_dim = text.linear_num_value_heads * text.linear_value_head_dim
    parts = (key_dim, key_dim, value_dim)
    mixer = f"{layer}.linear_attn"
    # The mixer zeroes its input's padded positions (a plain mask) before the projections: it gets
    # the norm's output as a plain tensor (whole sequence under SP); the layer shares one wrapper
    # of the masked value among the columns (see parallelize_qwen3_5).
    return {
        f"{mixer}.in_proj_qkv": Colwise(sizes=parts),
        **{f"{mixer}.in_proj_{p}": ColwiseParallel() for p in "zba"},
        f"{mixer}.norm": ReplicatedWithGradAllReduce(),
        f"{mixer}.out_proj": row_output(sequence_parallel=sequence_parallel),
        mixer: HeadParams(shard_dims={"A_log": 0, "conv1d.weight": 0, "dt_bias": 0}, counts=("key_dim", "value_dim"),
                          packed={"conv1d.weight": parts}),
    }


def parallelize_qwen3_5(model: nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Plan for ``Qwen3_5ForCausalLM`` and ``Qwen3_5ForConditionalGeneration`` (vision replicated).

    Plain TP: 2 all-reduces per layer of either kind (the linear-attention mixer's ``out_proj`` and
    the MLP's; the full attention's ``o_proj`` and the MLP's), + 1 at the embedding; the backward
    the same. SP: per layer 2 all-gathers (the pre-norms) and 2 reduce-scatters, + 1 of each at the
    head and the embedding, in each direction.
    """
    prefix = text_prefix(model)
    layer = f"{prefix}.layers.*"
    plan = decoder_plan(prefix, sequence_parallel=sequence_parallel) | {
        f"{layer}.self_attn.q_norm": ReplicatedWithGradAllReduce(),
        f"{layer}.self_attn.k_norm": ReplicatedWithGradAllReduce(),
        "lm_head": vocab_head(sequence_parallel=sequence_parallel),
    } | linear_attention(layer, model, sequence_parallel=sequence_parallel)
    # Only the full-attention layers' pre-norm hands its readers (q/k/v) one shared DTensor; the
    # linear-attention layers' output stays plain (under SP, all-gathered to the whole sequence,
    # its gradient taken as the columns' partial sums) and the layer shares the masked value.
    del plan[f"{layer}.input_layernorm"]
    types = model.config.get_text_config().layer_types
    columns = tuple(f"linear_attn.in_proj_{p}" for p in ("a", "b", "qkv", "z"))
    for i, kind in enumerate(types):
        if kind == "full_attention":
            plan[f"{prefix}.layers.{i}.input_layernorm"] = shared_input(sequence_parallel=sequence_parallel)
            continue
        plan[f"{prefix}.layers.{i}"] = Boundary(inputs="replicate", columns=columns,
                                                input_grad="partial" if sequence_parallel else "whole")
        if sequence_parallel:
            plan[f"{prefix}.layers.{i}.input_layernorm"] = Boundary(outputs="gather", output_grad="partial",
                                                                     style=SequenceParallel())
    return plan
