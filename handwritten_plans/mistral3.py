"""Mistral3 / Ministral3 vision-language models: a Llama-shaped text decoder behind a vision tower.

The text backbone lives at ``model.language_model`` and gets the Llama plan; the Pixtral vision
tower and the multi-modal projector stay replicated (small next to the decoder, and their output
is spliced into the replicated, or under SP sequence-sharded, token embeddings).
"""

from __future__ import annotations

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from handwritten_plans._blocks import vocab_head
from handwritten_plans.llama import decoder_plan

TEXT_PREFIX = "model.language_model"


def parallelize_mistral3(model: nn.Module, sequence_parallel: bool = False) -> dict[str, ParallelStyle]:
    """Plan for ``Mistral3ForConditionalGeneration``: same collectives as Llama's."""
    return decoder_plan(TEXT_PREFIX, sequence_parallel=sequence_parallel) | {
        "lm_head": vocab_head(sequence_parallel=sequence_parallel)
    }
