"""Phi (Phi-1.5 / Phi-2): attention and MLP side by side on one LayerNorm, partial rotary.

Each layer computes ``x + dense(attn(ln(x))) + fc2(gelu(fc1(ln(x))))``: the one ``input_layernorm``
feeds both branches, so under SP a single all-gather serves q, k, v and fc1, and the branches'
partial sums are added before one reduction (an all-reduce; a reduce-scatter under SP). Partial
rotary touches the first ``rotary_ndims`` features of every head: a per-head operation, exact on
sharded heads.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, SequenceParallel

from autotp.styles import Boundary, ReplicatedWithGradAllReduce, JoinPartialSums, RotaryEmbedParallel
from handwritten_plans._blocks import partial_row, shared_input, vocab_embedding, vocab_head


def parallelize_phi(model: nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Plan for ``PhiForCausalLM``.

    Plain TP: 1 all-reduce per layer (dense and fc2 summed) + 1 for the vocab-parallel embedding.
    SP: 1 all-gather per layer (the shared LayerNorm) + 1 before the head; 1 reduce-scatter per
    layer + 1 at the embedding. The backward mirrors both.
    """
    layer = "model.layers.*"
    plan: dict[str, ParallelStyle] = {
        "model.embed_tokens": vocab_embedding(sequence_parallel=sequence_parallel),
        **{f"{layer}.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
        f"{layer}.self_attn.dense": partial_row(),
        f"{layer}.mlp.fc1": ColwiseParallel(),
        f"{layer}.mlp.fc2": partial_row(),
        f"{layer}.input_layernorm": shared_input(sequence_parallel=sequence_parallel),
        "lm_head": vocab_head(sequence_parallel=sequence_parallel),
    }
    if getattr(model.config, "qk_layernorm", False):  # LayerNorm over head_dim, on sharded heads
        plan |= {f"{layer}.self_attn.{n}": ReplicatedWithGradAllReduce() for n in ("q_layernorm", "k_layernorm")}
    if sequence_parallel:
        # Each branch passes through ``resid_dropout`` before the sum: in training each then gets its
        # own sequence-sharded gradient from the add, gathered once for both by the layer's join
        # (which all-reduces a branch's partial sum before a live dropout, as the stream's Boundary does without SP).
        plan |= {"model.rotary_emb": RotaryEmbedParallel(), "model.final_layernorm": SequenceParallel(),
                 layer: JoinPartialSums()}
    else:
        # The stream is a plain tensor between layers: a Replicate() DTensor inside each, so the
        # residual add reduces the branches' summed partial outputs (the norm's weights join it).
        plan |= {layer: Boundary(inputs="replicate", outputs="local", stream=0),
                 f"{layer}.input_layernorm": ReplicatedWithGradAllReduce(dtensor=True)}
    return plan
