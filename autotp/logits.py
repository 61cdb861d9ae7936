"""The logits in a model's output, however the model returns them (a leaf: the synthesizer, which
runs modules to prove its rewrites, and the verifier both read outputs this way)."""

from __future__ import annotations

import torch
from torch import nn

from autotp.errors import VerificationError


def model_logits(output, model: nn.Module | None = None) -> torch.Tensor:
    """The logits in a model's output: the tensor itself, its ``logits`` (an attribute, as in
    transformers' outputs, or a key of a plain dict), or the first element of a tuple or list."""
    if isinstance(output, dict) and "logits" in output:
        output = output["logits"]
    elif hasattr(output, "logits"):
        output = output.logits
    elif isinstance(output, (tuple, list)) and output:
        output = output[0]
    if not isinstance(output, torch.Tensor):
        name = type(model).__name__ if model is not None else "the model"
        raise VerificationError(
            f"{name}: its forward returned {type(output).__name__} where the logits were expected; return "
            "the logits as a tensor, as the first element of a tuple, or under the key or attribute 'logits'."
        )
    return output
