"""Gemma4 text backbone (``Gemma4ForCausalLM``, and ``Gemma4ForConditionalGeneration`` whose vision
and audio towers stay replicated): Gemma3's layer plus per-layer token inputs.

Attention and MLP are sharded as in Gemma3, with q_norm / k_norm per head (``v_norm`` has no
weight). Unlike NeMo's Gemma3 plan, the tied embedding and head are both vocab-parallel: they shard
the same weight on the same dim (vocabulary rows), so the tie survives, and the largest tensors of
the model are no longer replicated. The per-layer token table ``embed_tokens_per_layer``
(vocab x layers * per-layer width; 2.3B parameters in gemma-4-E2B, more than the decoder) is
vocab-parallel too, at the price of one all-reduce. The small per-layer gate and projection stay
replicated: they act on the replicated residual.

Exception: ``Gemma4ForConditionalGeneration`` with per-layer inputs reads the pad row of
``embed_tokens.weight`` directly (to blank multimodal positions before the per-layer lookup), which
a vocab-sharded weight cannot serve; there the tied embedding and head stay replicated, as in
NeMo's Gemma3 plan.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from autotp.errors import PlanError
from autotp.styles import ReplicatedWithGradAllReduce, VocabParallelEmbedding
from handwritten_plans._blocks import row_output, shared_input, vocab_embedding, vocab_head
from handwritten_plans.gemma3 import text_prefix


def parallelize_gemma4(model: nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Plan for Gemma4 text models: 2 all-reduces per layer + 1 per vocab-parallel table.

    Raises:
        PlanError: ``sequence_parallel=True`` (the per-layer input tail multiplies the residual by
            a replicated, model-level tensor; no SP variant is written), or a config with MoE
            blocks (``enable_moe_block``), which this plan does not cover.
    """
    config = model.config.get_text_config()
    if sequence_parallel:
        raise PlanError(
            f"{type(model).__name__}: no sequence-parallel handwritten plan (each layer's per-layer "
            "input tail mixes the residual with a replicated model-level tensor). Use "
            "sequence_parallel=False, or autotp.synthesize(model, sequence_parallel=True)."
        )
    if getattr(config, "enable_moe_block", False):
        raise PlanError(
            f"{type(model).__name__}: enable_moe_block=True; this plan covers dense Gemma4 only. "
            "Use autotp.synthesize(model) for the MoE variant."
        )
    prefix = text_prefix(model)
    layer = f"{prefix}.layers.*"
    plan: dict[str, ParallelStyle] = {
        **{f"{layer}.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
        f"{layer}.self_attn.o_proj": row_output(sequence_parallel=False),
        f"{layer}.self_attn.q_norm": ReplicatedWithGradAllReduce(),
        f"{layer}.self_attn.k_norm": ReplicatedWithGradAllReduce(),
        f"{layer}.mlp.gate_proj": ColwiseParallel(),
        f"{layer}.mlp.up_proj": ColwiseParallel(),
        f"{layer}.mlp.down_proj": row_output(sequence_parallel=False),
        # q/k/v and gate/up read one replicated input each: their input gradients reduced once.
        f"{layer}.input_layernorm": shared_input(sequence_parallel=False),
        f"{layer}.pre_feedforward_layernorm": shared_input(sequence_parallel=False),
    }
    per_layer_inputs = bool(getattr(config, "hidden_size_per_layer_input", 0))
    if per_layer_inputs:
        plan[f"{prefix}.embed_tokens_per_layer"] = VocabParallelEmbedding(input_layouts=Replicate())
    if not (per_layer_inputs and prefix != "model"):  # see the module docstring
        plan[f"{prefix}.embed_tokens"] = vocab_embedding(sequence_parallel=False)
        plan["lm_head"] = vocab_head(sequence_parallel=False)
    return plan
