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

from autotp.kv import replicate_kv_heads
from handwritten_plans import falcon_h1, gemma3, gemma4, llama, mistral3, phi, phi3, qwen, qwen3_5, qwen_classification

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
    f"{_TRANSFORMERS}.phi.modeling_phi.PhiForCausalLM": phi.parallelize_phi,
    f"{_TRANSFORMERS}.ministral3.modeling_ministral3.Ministral3ForCausalLM": llama.parallelize_llama,
    f"{_TRANSFORMERS}.mistral3.modeling_mistral3.Mistral3ForConditionalGeneration": mistral3.parallelize_mistral3,
    f"{_TRANSFORMERS}.qwen2.modeling_qwen2.Qwen2ForSequenceClassification": (
        qwen_classification.parallelize_qwen_classification
    ),
    f"{_TRANSFORMERS}.qwen3.modeling_qwen3.Qwen3ForSequenceClassification": (
        qwen_classification.parallelize_qwen_classification
    ),
    f"{_TRANSFORMERS}.falcon_h1.modeling_falcon_h1.FalconH1ForCausalLM": falcon_h1.parallelize_falcon_h1,
    f"{_TRANSFORMERS}.qwen3_5.modeling_qwen3_5.Qwen3_5ForCausalLM": qwen3_5.parallelize_qwen3_5,
    f"{_TRANSFORMERS}.qwen3_5.modeling_qwen3_5.Qwen3_5ForConditionalGeneration": qwen3_5.parallelize_qwen3_5,
    f"{_TRANSFORMERS}.gemma4.modeling_gemma4.Gemma4ForCausalLM": gemma4.parallelize_gemma4,
    f"{_TRANSFORMERS}.gemma4.modeling_gemma4.Gemma4ForConditionalGeneration": gemma4.parallelize_gemma4,
}


def class_qualname(cls: type) -> str:
    """``module.qualname`` of ``cls``: the registry key."""
    return f"{cls.__module__}.{cls.__qualname__}"


def plan_function(model: nn.Module) -> PlanFunction | None:
    """The registered plan function for ``model``'s class, or ``None``."""
    return PARALLELIZE_FUNCTIONS.get(class_qualname(type(model)))


def plan_for(
    model: nn.Module, *, sequence_parallel: bool = False, replicate_kv_for_tp: int | None = None,
    gather_kv: bool = True,
) -> dict[str, ParallelStyle] | None:
    """The handwritten plan for ``model``, or ``None`` if its class has none.

    ``replicate_kv_for_tp=N`` opts in to tp sizes larger than the kv heads: the k/v projections
    are rewritten by :func:`autotp.kv.replicate_kv_heads` for tp=N (``gather_kv``: its ``gather``).
    """
    function = plan_function(model)
    if function is None:
        return None
    plan = function(model, sequence_parallel=sequence_parallel)
    if replicate_kv_for_tp is not None:
        plan = replicate_kv_heads(model, plan, replicate_kv_for_tp, gather=gather_kv)
    return plan
