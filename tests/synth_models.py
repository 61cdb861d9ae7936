"""Tiny transformers configs (hidden 64, 4 heads, 2 kv heads, 2 layers, vocab 256) for synthesis tests."""

from __future__ import annotations

import torch
import transformers

TINY = dict(hidden_size=64, num_attention_heads=4, num_key_value_heads=2, intermediate_size=128,
            num_hidden_layers=2, vocab_size=256, max_position_embeddings=128)

# family -> (config class, model class, extra config options)
FAMILIES = {
    "llama": ("LlamaConfig", "LlamaForCausalLM", {}),
    "mistral": ("MistralConfig", "MistralForCausalLM", {}),
    "qwen2": ("Qwen2Config", "Qwen2ForCausalLM", {}),
    "qwen3": ("Qwen3Config", "Qwen3ForCausalLM", {"head_dim": 16}),
    "gemma3": ("Gemma3TextConfig", "Gemma3ForCausalLM", {"head_dim": 16, "sliding_window": 4}),
    "phi3": ("Phi3Config", "Phi3ForCausalLM", {"pad_token_id": 0}),
    "olmo2": ("Olmo2Config", "Olmo2ForCausalLM", {}),
    "gpt_neox": ("GPTNeoXConfig", "GPTNeoXForCausalLM", {}),
    "phi": ("PhiConfig", "PhiForCausalLM", {}),
    "starcoder2": ("Starcoder2Config", "Starcoder2ForCausalLM", {}),
    "cohere": ("CohereConfig", "CohereForCausalLM", {}),
    "granite": ("GraniteConfig", "GraniteForCausalLM", {}),
    "glm4": ("Glm4Config", "Glm4ForCausalLM", {"head_dim": 16, "pad_token_id": 0}),
    "qwen3_moe": ("Qwen3MoeConfig", "Qwen3MoeForCausalLM", {"head_dim": 16, "num_experts": 4,
                                                             "num_experts_per_tok": 2, "moe_intermediate_size": 32}),
    "mixtral": ("MixtralConfig", "MixtralForCausalLM", {"num_local_experts": 4, "num_experts_per_tok": 2}),
}


def tiny_model(family: str, device: str = "meta", **overrides) -> torch.nn.Module:
    """A 2-layer model of ``family`` on ``device`` (meta builds in milliseconds)."""
    config_name, model_name, extra = FAMILIES[family]
    config = getattr(transformers, config_name)(**{**TINY, **extra, **overrides})
    torch.manual_seed(0)
    with torch.device(device):
        return getattr(transformers, model_name)(config).eval()


def shardable_model(name: str, tp: int = 4) -> torch.nn.Module:
    """A 2-layer cpu model of ``name`` (a family above, or ``gemma3-vlm``) shardable at ``tp``:
    as many kv heads as heads where the family allows, so tp up to 4 splits every head count."""
    if name == "gemma3-vlm":
        from autotp.models import build_model

        return build_model(name, tiny=True, tp=tp, device="cpu").eval()
    return tiny_model(name, device="cpu", num_key_value_heads=4)
