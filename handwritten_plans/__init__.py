"""Handwritten optimized tensor-parallel plans: the default for the architectures they cover.

Plans are registered by the model class's ``module.qualname`` string, not by the class object, so a
subclass that another framework creates with ``type(...)`` (copying ``__module__`` and
``__qualname__``, as checkpointing mixins do) still finds its plan.

>>> from handwritten_plans import PARALLELIZE_FUNCTIONS
>>> "transformers.models.llama.modeling_llama.LlamaForCausalLM" in PARALLELIZE_FUNCTIONS
True
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.tensor.parallel import ParallelStyle

from handwritten_plans import gemma3, llama, phi3, qwen

PlanFunction = Callable[..., dict[str, ParallelStyle]]

_TRANSFORMERS = "transformers.models"

PARALLELIZE_FUNCTIONS: dict[str, PlanFunction] = {
    f"{_TRANSFORMERS}.llama.modeling_llama.LlamaForCausalLM": llama.parallelize_llama,
    f"{_TRANSFORMERS}.mistral.modeling_mistral.MistralForCausalLM": llama.parallelize_llama,
    f"{_TRANSFORMERS}.qwen2.modeling_qwen2.Qwen2ForCausalLM": qwen.parallelize_qwen,
    f"{_TRANSFORMERS}.qwen3.modeling_qwen3.Qwen3ForCausalLM": qwen.parallelize_qwen,
    f"{_TRANSFORMERS}.gemma3.modeling_gemma3.Gemma3ForCausalLM": gemma3.parallelize_gemma3,
    f"{_TRANSFORMERS}.gemma3.modeling_gemma3.Gemma3ForConditionalGeneration": gemma3.parallelize_gemma3,
    f"{_TRANSFORMERS}.phi3.modeling_phi3.Phi3ForCausalLM": phi3.parallelize_phi3,
}


def class_qualname(cls: type) -> str:
    """``module.qualname`` of ``cls``: the registry key."""
    return f"{cls.__module__}.{cls.__qualname__}"


def plan_function(model: nn.Module) -> PlanFunction | None:
    """The registered plan function for ``model``'s class, or ``None``."""
    return PARALLELIZE_FUNCTIONS.get(class_qualname(type(model)))


def plan_for(model: nn.Module, *, sequence_parallel: bool = False) -> dict[str, ParallelStyle] | None:
    """The handwritten plan for ``model``, or ``None`` if its class has none."""
    function = plan_function(model)
    return None if function is None else function(model, sequence_parallel=sequence_parallel)
