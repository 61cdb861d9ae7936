"""Qwen2 (Llama-shaped with q/k/v biases) and Qwen3 (adds per-head q_norm / k_norm)."""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from autotp.styles import ReplicatedWithGradAllReduce
from handwritten_plans.llama import parallelize_llama


def parallelize_qwen(model: nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Plan for ``Qwen2ForCausalLM`` / ``Qwen3ForCausalLM``.

    Qwen3's q_norm / k_norm normalise each head of the head-sharded q and k: exact locally, but their
    weight gradients are per-rank partial sums, which :class:`ReplicatedWithGradAllReduce` all-reduces.
    """
    plan = parallelize_llama(model, sequence_parallel=sequence_parallel)
    if hasattr(model.model.layers[0].self_attn, "q_norm"):
        plan |= {f"model.layers.*.self_attn.{n}": ReplicatedWithGradAllReduce() for n in ("q_norm", "k_norm")}
    return plan
