"""Falcon-H1: every layer runs attention and a Mamba2 mixer side by side, then ``feed_forward``.

Attention and the MLP (named ``feed_forward``) are sharded column/row as in Llama. The Mamba2
mixer stays replicated: its fused ``in_proj`` output is split into gate, conv channels (x, B, C) and
per-head dt, the depthwise conv and the SSM scan mix those groups, and stock kernels take the whole
tensor, so there is no column split it survives. Its output is already replicated and is added to
the (all-reduced) attention output, so it costs no collective.

The µP multipliers (embedding, attention in/out, key, SSM out, MLP gate/down, head) are scalars,
exact on any shard.
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle

from autotp.errors import PlanError
from autotp.styles import Boundary
from handwritten_plans._blocks import row_output, shared_input, vocab_embedding, vocab_head


def parallelize_falcon_h1(model: nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Plan for ``FalconH1ForCausalLM``: 2 all-reduces per layer + 1 at the embedding.

    Raises:
        PlanError: ``sequence_parallel=True``. The replicated Mamba2 branch needs the whole
            sequence and returns a replicated tensor, which would have to be re-sliced before it
            meets the sequence-sharded attention output; this plan does not offer that.
    """
    if sequence_parallel:
        raise PlanError(
            f"{type(model).__name__}: no sequence-parallel handwritten plan (the replicated Mamba2 "
            "mixer runs on the whole sequence and returns a replicated tensor). Use "
            "sequence_parallel=False, or autotp.synthesize(model, sequence_parallel=True)."
        )
    layer = "model.layers.*"
    return {
        "model.embed_tokens": vocab_embedding(sequence_parallel=False),
        # One replicated input for q/k/v and the whole Mamba mixer beside them (which takes it
        # local), one for gate/up: each branch's input gradient is reduced once.
        f"{layer}.input_layernorm": shared_input(sequence_parallel=False),
        f"{layer}.pre_ff_layernorm": shared_input(sequence_parallel=False),
        f"{layer}.mamba": Boundary(inputs="whole"),
        **{f"{layer}.self_attn.{p}_proj": ColwiseParallel() for p in "qkv"},
        f"{layer}.self_attn.o_proj": row_output(sequence_parallel=False),
        f"{layer}.feed_forward.gate_proj": ColwiseParallel(),
        f"{layer}.feed_forward.up_proj": ColwiseParallel(),
        f"{layer}.feed_forward.down_proj": row_output(sequence_parallel=False),
        "lm_head": vocab_head(sequence_parallel=False),
    }
