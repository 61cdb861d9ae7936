"""Models to plan and verify, built from configs alone (no weights are ever downloaded).

Three ways to name a model:

- a built-in short name (``llama``, ``qwen3-moe``, ...): the published config numbers of a public
  checkpoint, listed in :data:`BUILTIN`;
- any transformers ``model_type`` (``AutoConfig.for_model``): that family's default config, with
  a published checkpoint's values where the default builds no model (:data:`DEFAULT_CONFIG_FIXES`);
- a path to a ``config.json`` (or a folder holding one).

Real sizes are built on the meta device (parameters have shapes, no storage), which is all
planning and memory accounting need. :func:`shrink_config` keeps an architecture but makes it tiny,
so verification can run the sharded model against the unsharded one on CPU in seconds.

Long because of :data:`BUILTIN` (a table of published config numbers) and the config shrinker's
list of width and table fields; the code around them is short.
"""

from __future__ import annotations

import copy
import json
from dataclasses import dataclass, field
from pathlib import Path

import torch
from torch import nn
from transformers import AutoConfig, AutoModelForCausalLM, PretrainedConfig
from transformers.initialization import no_init_weights
from transformers.models.auto.configuration_auto import CONFIG_MAPPING_NAMES

from autotp.errors import AutoTPError


@dataclass(frozen=True)
class Builtin:
    """A public checkpoint's config: its hub id (for reference only), family, and numbers."""

    source: str
    model_type: str
    options: dict = field(default_factory=dict)


def _llama3_rope(factor: float) -> dict:
    return {
        "rope_type": "llama3",
        "rope_theta": 500000.0,
        "factor": factor,
        "low_freq_factor": 1.0,
        "high_freq_factor": 4.0,
        "original_max_position_embeddings": 8192,
    }


def _rope(theta: float) -> dict:
    return {"rope_type": "default", "rope_theta": theta}


# Numbers copied from each checkpoint's config.json. Token ids are left at the family defaults:
# they change no shape.
BUILTIN: dict[str, Builtin] = {
    "llama": Builtin("meta-llama/Llama-3.1-8B", "llama", dict(
        vocab_size=128256, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=_llama3_rope(8.0), tie_word_embeddings=False)),
    "llama-70b": Builtin("meta-llama/Llama-3.1-70B", "llama", dict(
        vocab_size=128256, hidden_size=8192, intermediate_size=28672, num_hidden_layers=80,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=_llama3_rope(8.0), tie_word_embeddings=False)),
    "llama-1b": Builtin("meta-llama/Llama-3.2-1B", "llama", dict(
        vocab_size=128256, hidden_size=2048, intermediate_size=8192, num_hidden_layers=16,
        num_attention_heads=32, num_key_value_heads=8, head_dim=64, max_position_embeddings=131072,
        rms_norm_eps=1e-5, rope_parameters=_llama3_rope(32.0), tie_word_embeddings=True)),
    "mistral": Builtin("mistralai/Mistral-7B-v0.3", "mistral", dict(
        vocab_size=32768, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=32768,
        rms_norm_eps=1e-5, rope_parameters=_rope(1e6), sliding_window=None, tie_word_embeddings=False)),
    "qwen2": Builtin("Qwen/Qwen2.5-7B", "qwen2", dict(
        vocab_size=152064, hidden_size=3584, intermediate_size=18944, num_hidden_layers=28,
        num_attention_heads=28, num_key_value_heads=4, max_position_embeddings=131072,
        rms_norm_eps=1e-6, rope_parameters=_rope(1e6), use_sliding_window=False,
        tie_word_embeddings=False)),
    "qwen3": Builtin("Qwen/Qwen3-8B", "qwen3", dict(
        vocab_size=151936, hidden_size=4096, intermediate_size=12288, num_hidden_layers=36,
        num_attention_heads=32, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_parameters=_rope(1e6), tie_word_embeddings=False)),
    "qwen3-32b": Builtin("Qwen/Qwen3-32B", "qwen3", dict(
        vocab_size=151936, hidden_size=5120, intermediate_size=25600, num_hidden_layers=64,
        num_attention_heads=64, num_key_value_heads=8, head_dim=128, max_position_embeddings=40960,
        rms_norm_eps=1e-6, rope_parameters=_rope(1e6), tie_word_embeddings=False)),
    "qwen3-moe": Builtin("Qwen/Qwen3-30B-A3B", "qwen3_moe", dict(
        vocab_size=151936, hidden_size=2048, intermediate_size=6144, moe_intermediate_size=768,
        num_hidden_layers=48, num_attention_heads=32, num_key_value_heads=4, head_dim=128,
        num_experts=128, num_experts_per_tok=8, norm_topk_prob=True, decoder_sparse_step=1,
        mlp_only_layers=[], max_position_embeddings=40960, rms_norm_eps=1e-6,
        rope_parameters=_rope(1e6), tie_word_embeddings=False)),
    "mixtral": Builtin("mistralai/Mixtral-8x7B-v0.1", "mixtral", dict(
        vocab_size=32000, hidden_size=4096, intermediate_size=14336, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=8, num_local_experts=8, num_experts_per_tok=2,
        max_position_embeddings=32768, rms_norm_eps=1e-5, rope_parameters=_rope(1e6),
        sliding_window=None, tie_word_embeddings=False)),
    "phi3": Builtin("microsoft/Phi-3-mini-4k-instruct", "phi3", dict(
        vocab_size=32064, hidden_size=3072, intermediate_size=8192, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        rms_norm_eps=1e-5, rope_parameters=_rope(10000.0), sliding_window=2047,
        pad_token_id=32000, bos_token_id=1, eos_token_id=32000, tie_word_embeddings=False)),
    "olmo2": Builtin("allenai/OLMo-2-1124-7B", "olmo2", dict(
        vocab_size=100352, hidden_size=4096, intermediate_size=11008, num_hidden_layers=32,
        num_attention_heads=32, num_key_value_heads=32, max_position_embeddings=4096,
        rms_norm_eps=1e-6, rope_parameters=_rope(500000.0), pad_token_id=100277,
        eos_token_id=100257, tie_word_embeddings=False)),
    "gemma2": Builtin("google/gemma-2-2b", "gemma2", dict(
        vocab_size=256000, hidden_size=2304, intermediate_size=9216, num_hidden_layers=26,
        num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=4096, final_logit_softcapping=30.0, attn_logit_softcapping=50.0,
        max_position_embeddings=8192, rms_norm_eps=1e-6, tie_word_embeddings=True)),
    "gemma3": Builtin("google/gemma-3-1b-pt", "gemma3_text", dict(
        vocab_size=262144, hidden_size=1152, intermediate_size=6912, num_hidden_layers=26,
        num_attention_heads=4, num_key_value_heads=1, head_dim=256, query_pre_attn_scalar=256,
        sliding_window=512, max_position_embeddings=32768, rms_norm_eps=1e-6,
        tie_word_embeddings=True)),
    "gemma3-vlm": Builtin("google/gemma-3-4b-pt", "gemma3", dict(
        text_config=dict(
            vocab_size=262208, hidden_size=2560, intermediate_size=10240, num_hidden_layers=34,
            num_attention_heads=8, num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256,
            sliding_window=1024, max_position_embeddings=131072, rms_norm_eps=1e-6,
            rope_parameters={
                "full_attention": {"rope_type": "linear", "factor": 8.0, "rope_theta": 1e6},
                "sliding_attention": {"rope_type": "default", "rope_theta": 10000.0},
            }),
        vision_config=dict(
            hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
            image_size=896, patch_size=14, vision_use_head=False),
        mm_tokens_per_image=256, boi_token_index=255999, eoi_token_index=256000,
        image_token_index=262144)),
}


# Corrections to transformers' *default* config of a model type whose default builds no model (a
# transformers bug, not a choice of ours), applied by load_config to a bare model type only: the
# values a published checkpoint of the family has for the fields the default leaves broken. Built-in
# names and config files are taken as they are. Checked against transformers 5.23.
DEFAULT_CONFIG_FIXES: dict[str, dict] = {
    # rope_parameters is keyed by layer type, but the default has no entry for any type (KeyError
    # 'full_attention' in the rotary embedding). CohereLabs/North-Micro-Vision-Instruct: three
    # sliding-window layers then one full one; sliding layers carry M-RoPE, full ones no rope (NoPE).
    "cohere_compass_text": {
        "layer_types": ["sliding_attention", "sliding_attention", "sliding_attention", "full_attention"] * 10,
        "rope_parameters": {
            "sliding_attention": {"rope_type": "default", "rope_theta": 50000.0, "mrope_interleaved": True,
                                  "mrope_section": [24, 20, 20]},
            "full_attention": None,
        },
    },
    # The expert counts are None (torch.empty gets no width in Dots1Experts). rednote-hilab/dots.llm1.
    "dots1": {"n_routed_experts": 128, "n_shared_experts": 2, "num_experts_per_tok": 6, "first_k_dense_replace": 1},
    # layer_types is None (each layer reads its kind from it). LiquidAI/LFM2-8B-A1B: 24 layers, 6 attention.
    "lfm2_moe": {"num_hidden_layers": 24, "layer_types": [
        "conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv", "conv",
        "full_attention", "conv", "conv", "conv", "full_attention", "conv", "conv", "conv", "full_attention",
        "conv", "conv", "full_attention", "conv", "conv"]},
    # The attention layers are indexed (QSA) but the indexer's sizes are None (token_budget //
    # compress_ratio). Qwen4-Exp's indexer, and its partial rotary, which must fit the index head.
    "qwen4_exp_text": {
        "indexer_n_heads": 4, "indexer_kv_heads": 1, "indexer_head_dim": 128, "indexer_budget": 2048,
        "indexer_compress_ratio": 4,
        "rope_parameters": {"rope_type": "default", "rope_theta": 1e7, "partial_rotary_factor": 0.25},
    },
}
# Not correctable by config in transformers 5.23: gemma4_assistant and gemma4_unified_assistant share
# every layer's kv cache (their config insists on it), and the text config's kv_sharing_modes raises
# when no layer produces a cache, the published google/gemma-4-E2B-it-assistant config included.


def builtin_names() -> list[str]:
    """The short names :func:`load_config` accepts, sorted."""
    return sorted(BUILTIN)


def load_config(name_or_path: str | Path) -> PretrainedConfig:
    """The config that ``name_or_path`` names: a built-in, a transformers model type, or a file.

    A model type gets transformers' default config, corrected by :data:`DEFAULT_CONFIG_FIXES` where
    that default builds no model; a built-in or a file is taken as it is.

    Raises:
        AutoTPError: the name is none of those (the message lists the built-in names), or the
            file is not a transformers config.
    """
    name = str(name_or_path)
    if name in BUILTIN:
        entry = BUILTIN[name]
        return AutoConfig.for_model(entry.model_type, **entry.options)
    path = Path(name)
    if path.is_dir():
        path = path / "config.json"
    if path.is_file():
        return _config_from_file(path)
    if name in CONFIG_MAPPING_NAMES:
        # A copy: the config keeps the lists it is given.
        return AutoConfig.for_model(name, **copy.deepcopy(DEFAULT_CONFIG_FIXES.get(name, {})))
    if _looks_like_path(name):  # a mistyped path: "unknown model, closest names: ..." would mislead
        raise AutoTPError(
            f"no such file: {str(path)!r} (a path to a config.json, or to a folder holding one, was "
            "expected; autotp reads no Hub repository)."
        )
    raise AutoTPError(
        f"unknown model {name!r}: not a built-in name, a transformers model type, or a config.json "
        f"path. Built-in names: {', '.join(builtin_names())}."
    )


def _looks_like_path(name: str) -> bool:
    """Whether ``name`` can only be a path: no model type has a path separator or ends in ``.json``.

    >>> _looks_like_path("llama"), _looks_like_path("./llama"), _looks_like_path("ckpt/config.json")
    (False, True, True)
    """
    return "/" in name or "\\" in name or name.endswith(".json") or name.startswith((".", "~"))


def _config_from_file(path: Path) -> PretrainedConfig:
    try:
        options = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError) as err:
        raise AutoTPError(f"{path}: cannot read a JSON config ({err}).") from err
    model_type = options.pop("model_type", None) if isinstance(options, dict) else None
    if model_type not in CONFIG_MAPPING_NAMES:
        raise AutoTPError(
            f"{path}: 'model_type' is {model_type!r}, which transformers does not know; "
            "a Hugging Face config.json names its family there (e.g. \"llama\")."
        )
    return AutoConfig.for_model(model_type, **options)


# The tiny sizes. Every width is a multiple of 8 so a tiny model shards at tp 2, 4 and 8.
TINY_HIDDEN = 64
TINY_INTERMEDIATE = 128
TINY_HEAD_DIM = 16
TINY_VOCAB = 256
TINY_LAYERS = 2
TINY_EXPERTS = 4
TINY_SSM_HEADS = 8
TINY_VISION = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=1, num_attention_heads=2,
                   image_size=28, patch_size=14)
# Per-head widths that must follow head_dim (Gemma scales scores by query_pre_attn_scalar**-0.5).
_HEAD_DIM_TIED = ("query_pre_attn_scalar",)
# Config attributes that are widths of an expert's MLP.
_EXPERT_WIDTHS = ("moe_intermediate_size", "shared_expert_intermediate_size")
# LongCat's zero experts (identity experts routed alongside the real ones) count like experts.
_EXPERT_COUNTS = ("num_experts", "num_local_experts", "n_routed_experts", "zero_expert_num")
# Widths that equal hidden_size in a checkpoint because they are the residual width under another
# name (xLSTM's embedding_dim, RWKV's attention_hidden_size; Zamba's is twice it, a concat).
_HIDDEN_TIED = ("embedding_dim", "attention_hidden_size")
# The layer count under other names: the only one (LongCat's num_layers), or a copy (xLSTM's num_blocks).
_LAYER_COUNTS = ("num_layers", "num_blocks")
# SSM mixers whose heads x head width must equal expand x hidden_size: (heads, head width, expand).
_SSM_HEADS = (("mamba_n_heads", "mamba_d_head", "mamba_expand"), ("n_mamba_heads", "mamba_headdim", "mamba_expand"),
              ("num_heads", "head_dim", "expand"))
# Widths that are the sum of two others in a checkpoint (multi-head latent attention's query/key
# head is its non-rotary part plus its rotary part).
_SUM_WIDTHS = (("qk_head_dim", "qk_nope_head_dim", "qk_rope_head_dim"),
               ("head_dim", "qk_nope_head_dim", "qk_rope_head_dim"))
# Multi-head latent attention widths (DeepSeek-V3; its rotary part is head_dim), expert-group
# routing that must fit in TINY_EXPERTS experts, one dense layer before the MoE one (DeepSeek's
# first_k_dense_replace, LFM2-MoE's and AfMoE's num_dense_layers), and Gemma4's per-layer input
# embeddings (a vocabulary-sized table per layer).
_TINY_EXTRAS = dict(q_lora_rank=32, kv_lora_rank=32, qk_rope_head_dim=TINY_HEAD_DIM, qk_nope_head_dim=8,
                    v_head_dim=16, n_group=1, topk_group=1, first_k_dense_replace=1, num_dense_layers=1,
                    vocab_size_per_layer_input=TINY_VOCAB, hidden_size_per_layer_input=16)
_TOKEN_IDS = ("pad_token_id", "bos_token_id", "eos_token_id")
# Lists of layer indices (Qwen-MoE's dense layers; Zamba2's hybrid layers, which the config stores
# next to the layer kinds it derives them from), renumbered to the kept layers.
_LAYER_INDEX_LISTS = ("mlp_only_layers", "hybrid_layer_ids")
# Lists that happen to be as long as the layer stack but are not one entry per layer.
_NOT_PER_LAYER = ("architectures", *_LAYER_INDEX_LISTS)


def shrink_config(config: PretrainedConfig, *, tp: int = 8, keep_kv_heads: bool = False) -> PretrainedConfig:
    """A tiny config of the same architecture, shardable at tensor-parallel size ``tp``.

    Kept: the family (so the same module tree and code paths), the query/kv head ratio, every
    distinct entry of per-layer lists such as ``layer_types`` (Gemma's sliding and full layers
    both stay), MoE routing (with few experts), and sub-configs (``text_config`` shrinks like a
    text model, ``vision_config`` to a one-layer encoder). ``tp`` key-value heads make every
    head count divisible by ``tp``.

    ``keep_kv_heads``: where the config has fewer kv heads than ``tp``, keep that many (the query
    heads in ratio), so the tiny model repeats each kv head over ``tp / kv`` ranks as the real one
    must: what is verified is what will run. Default False: ``tp`` kv heads.

    >>> small = shrink_config(load_config("llama"), tp=2)
    >>> small.num_attention_heads // small.num_key_value_heads, small.num_key_value_heads
    (4, 2)
    >>> small = shrink_config(load_config("gemma3"), tp=4, keep_kv_heads=True)  # 4 query heads, 1 kv head
    >>> small.num_attention_heads, small.num_key_value_heads
    (4, 1)
    """
    if tp < 1:
        raise AutoTPError(f"tp must be a positive integer, got {tp}.")
    options = config.to_dict()
    options.pop("model_type", None)
    options.pop("transformers_version", None)
    if "text_config" in options and options["text_config"] is not None:
        options["text_config"] = _shrink_text(options["text_config"], tp, config.text_config.attribute_map,
                                              keep_kv_heads)
        if options.get("vision_config") is not None:
            options["vision_config"] = {**options["vision_config"], **TINY_VISION}
        if "mm_tokens_per_image" in options:
            options["mm_tokens_per_image"] = 4  # a 2x2 grid of 14-pixel patches
    else:
        options = _shrink_text(options, tp, config.attribute_map, keep_kv_heads)
    try:
        return AutoConfig.for_model(config.model_type, **options)
    except Exception as error:  # a family that checks hidden % heads at a head count 64 is no multiple of
        if "multiple of the number of attention heads" not in str(error):
            raise
        text = options["text_config"] if options.get("text_config") is not None else options
        _widen_to_heads(text, (config.get_text_config() if hasattr(config, "get_text_config") else config).attribute_map)
        return AutoConfig.for_model(config.model_type, **options)


def _widen_to_heads(options: dict, attribute_map: dict[str, str]) -> None:
    """The smallest multiple of the query head count at least the tiny hidden size, as hidden_size
    (24 heads at tp=4 in a 6:1 family: 72). Only for a family whose config checks hidden % heads
    while it keeps a head_dim of its own, where :func:`_shrink_heads` left the tiny width."""
    hidden, heads = attribute_map.get("hidden_size", "hidden_size"), attribute_map.get("num_attention_heads", "num_attention_heads")
    options[hidden] = options[heads] * -(-options[hidden] // options[heads])


def _shrink_text(options: dict, tp: int, attribute_map: dict[str, str], keep_kv_heads: bool = False) -> dict:
    """Shrink the text-model part of a config given as a dict (see :func:`shrink_config`).

    ``attribute_map`` is the config class's alias table (GPT-2 stores ``hidden_size`` as
    ``n_embd``): keys are read and written under the standard names, then put back.
    """
    aliases = {actual: standard for standard, actual in attribute_map.items()}
    options = {aliases.get(k, k): v for k, v in options.items() if k not in ("model_type", "transformers_version")}
    original = dict(options)
    options["vocab_size"] = TINY_VOCAB
    renamed = _layer_count_as_standard(options)
    _shrink_heads(options, tp, keep_kv_heads)
    _keep_tied_widths(original, options)
    for name in _HEAD_DIM_TIED:
        if options.get(name) is not None:
            options[name] = TINY_HEAD_DIM
    if options.get("intermediate_size") is not None:
        options["intermediate_size"] = TINY_INTERMEDIATE
    for name in _EXPERT_WIDTHS:
        if options.get(name):
            options[name] = TINY_INTERMEDIATE // 4
    for name in _EXPERT_COUNTS:
        if options.get(name):
            options[name] = TINY_EXPERTS
            if "num_experts_per_tok" in options:  # None in some configs that route top-k anyway
                options["num_experts_per_tok"] = min(options["num_experts_per_tok"] or 2, 2)
    options.update({k: v for k, v in _TINY_EXTRAS.items() if options.get(k)})
    _shrink_rotary_and_ssm(options, original)
    _keep_width_sums(original, options)
    _shrink_layers(options, tp, original, keep_kv_heads)
    for name, moved in renamed.items():  # the family's own names for the layer count
        options[name] = options.pop("num_hidden_layers") if moved else options["num_hidden_layers"]
    _clamp_token_ids(options)
    return {attribute_map.get(k, k): v for k, v in options.items()}


def _tiny_kv_heads(kv, tp: int, keep_kv_heads: bool) -> int:
    """The tiny model's kv heads: ``tp``, or with ``keep_kv_heads`` the real count where it is below tp.

    >>> _tiny_kv_heads(8, 4, True), _tiny_kv_heads(1, 4, True), _tiny_kv_heads(1, 4, False)
    (4, 1, 4)
    """
    return kv if keep_kv_heads and isinstance(kv, int) and 0 < kv < tp else tp


def _shrink_heads(options: dict, tp: int, keep_kv_heads: bool = False) -> None:
    """``tp`` kv heads (query heads in the checkpoint's ratio), and hidden_size to match; with
    ``keep_kv_heads``, the checkpoint's kv heads where they are fewer than ``tp``.

    Families that check hidden % heads (with a head_dim of their own) get a multiple, unless that is
    large (MQA with 64 query heads per kv head keeps hidden 64). Where the checkpoint has
    hidden == heads * head_dim, the family may use either width for the other (Helium's o_proj is
    hidden -> hidden), so that stays true while hidden stays small. Attention-free families (RWKV,
    Mamba, xLSTM) just get the tiny hidden size.
    """
    # Head counts of a family's linear-attention layers: tp for the fewest, the others in ratio.
    linear = {k: v for k, v in options.items() if k.startswith("linear_num_") and k.endswith("_heads")
              and isinstance(v, int) and v > 0}
    for key, value in linear.items():
        options[key] = tp * max(1, value // min(linear.values()))
    heads = options.get("num_attention_heads")
    if not heads:
        if isinstance(options.get("hidden_size"), int):
            options["hidden_size"] = TINY_HIDDEN
        return
    ratio = max(1, heads // (options.get("num_key_value_heads") or heads))
    kv = _tiny_kv_heads(options.get("num_key_value_heads"), tp, keep_kv_heads)
    tiny_heads = kv * ratio
    options["num_attention_heads"] = tiny_heads
    if "num_key_value_heads" in options:
        options["num_key_value_heads"] = kv
    if "head_dim" in options:
        multiple = tiny_heads * TINY_HEAD_DIM
        exact = bool(options["head_dim"]) and options["head_dim"] * heads == options.get("hidden_size")
        hidden = TINY_HIDDEN if TINY_HIDDEN % tiny_heads == 0 or multiple > 4 * TINY_HIDDEN else multiple
        if exact and multiple <= 2 * TINY_HIDDEN:
            hidden = multiple
        options.update(head_dim=TINY_HEAD_DIM, hidden_size=hidden)
    else:  # the family derives head_dim = hidden / heads: an even head_dim in [8, 32]
        head_dim = max(8, min(2 * TINY_HEAD_DIM, 2 * (2 * TINY_HIDDEN // tiny_heads // 2)))
        options["hidden_size"] = tiny_heads * head_dim


def _shrink_rotary_and_ssm(options: dict, original: dict) -> None:
    """Widths tied to the (shrunk) head size or hidden size: a rotary part, Mamba heads.

    ``rotary_dim`` (GPT-J, CodeGen) rotates part of each head, so it cannot exceed head_dim. Mamba-2
    mixers need ``heads * head width == expand * hidden_size`` (``_SSM_HEADS``) unless the family
    sizes the mixer itself (``mamba_d_ssm``); ``original`` is the config before shrinking.
    """
    heads = options.get("num_attention_heads")
    head_dim = options.get("head_dim") or (options["hidden_size"] // heads if heads and options.get("hidden_size") else None)
    if isinstance(options.get("rotary_dim"), int) and head_dim and options["rotary_dim"] > head_dim:
        options["rotary_dim"] = head_dim // 2 - head_dim // 2 % 2
    for heads_name, width_name, expand_name in _SSM_HEADS:
        heads, width, expand = (original.get(k) for k in (heads_name, width_name, expand_name))
        if (all(isinstance(v, int) for v in (heads, width, expand)) and not options.get("mamba_d_ssm")
                and heads * width == expand * original.get("hidden_size", 0)):
            options[heads_name] = TINY_SSM_HEADS
            options[width_name] = expand * options["hidden_size"] // TINY_SSM_HEADS
            for name in ("mamba_d_state", "state_size"):
                if isinstance(options.get(name), int):
                    options[name] = min(options[name], TINY_HEAD_DIM)
            if isinstance(options.get("n_groups"), int):  # SSM groups must divide the SSM heads
                options["n_groups"] = min(options["n_groups"], TINY_SSM_HEADS)
    hidden = original.get("hidden_size")
    if isinstance(options.get("time_step_rank"), int) and hidden and options["time_step_rank"] == -(-hidden // 16):
        options["time_step_rank"] = -(-options["hidden_size"] // 16)  # Mamba's default: ceil(hidden / 16)


def _layer_count_as_standard(options: dict) -> dict[str, bool]:
    """Read a layer count kept under another name (``_LAYER_COUNTS``) as ``num_hidden_layers``.

    Returns:
        Each such name, with whether it was the only layer count (moved to ``num_hidden_layers``)
        rather than a copy of it; the caller writes the shrunk count back under those names.
    """
    renamed = {}
    for name in _LAYER_COUNTS:
        value = options.get(name)
        if not isinstance(value, int) or isinstance(value, bool):
            continue
        if not options.get("num_hidden_layers"):
            options["num_hidden_layers"] = options.pop(name)
            renamed[name] = True
        elif value == options["num_hidden_layers"]:
            renamed[name] = False
    return renamed


def _keep_tied_widths(original: dict, options: dict) -> None:
    """Widths that are a multiple of hidden_size (or the per-head width) in the checkpoint stay so.

    ``_HIDDEN_TIED`` widths keep their multiple of hidden_size, a ``*_width`` equal to it stays equal;
    a per-head width spelled ``d_head`` (XLNet checks ``d_head == d_model // n_head``) keeps
    hidden / heads when it had it.
    """
    hidden = original.get("hidden_size")
    for name in _HIDDEN_TIED:
        value = original.get(name)
        if isinstance(value, int) and hidden and value % hidden == 0:
            options[name] = value // hidden * options["hidden_size"]
    for name, value in original.items():  # a mixer width equal to hidden_size (an RG-LRU's ``lru_width``)
        if name.endswith("_width") and isinstance(value, int) and value == hidden and name not in _HIDDEN_TIED:
            options[name] = options["hidden_size"]
    heads = original.get("num_attention_heads")
    if isinstance(original.get("d_head"), int) and heads and original["d_head"] * heads == hidden:
        options["d_head"] = options["hidden_size"] // options["num_attention_heads"]


def _keep_width_sums(original: dict, options: dict, *, base: dict | None = None) -> None:
    """A width that is the sum of two others in the checkpoint stays their sum (``_SUM_WIDTHS``).

    ``base`` is the shrunk config an override (``options``) falls back to for widths it does not set.
    """
    shrunk = {**(base or {}), **options}
    for total, *parts in _SUM_WIDTHS:
        values = [original.get(k) for k in (total, *parts)]
        if all(isinstance(v, int) for v in values) and values[0] == sum(values[1:]):
            options[total] = sum(shrunk[k] for k in parts)


def _shrink_layers(options: dict, tp: int, original: dict, keep_kv_heads: bool = False) -> None:
    """Keep ``TINY_LAYERS`` layers (more if needed to keep one of each ``layer_types`` entry).

    Per-layer lists are cut to the kept layers; per-layer override dicts keyed by layer index
    (Gemma4's ``per_layer_config``) are renumbered, with their widths shrunk like the rest. The last
    ``num_kv_shared_layers`` layers (Gemma3n) reuse an earlier layer's cache: one of each kind is
    kept among them too, after one of each kind that produces a cache.
    """
    n = options.get("num_hidden_layers")
    if not n:
        return
    shared = options.get("num_kv_shared_layers")
    shared = shared if isinstance(shared, int) and 0 < shared < n else 0
    layer_types = options.get("layer_types")
    keep = []
    if isinstance(layer_types, list) and len(layer_types) == n:
        for start, stop in ((0, n - shared), (n - shared, n)):  # the second run is empty without sharing
            part = layer_types[start:stop]
            keep += [start + part.index(t) for t in dict.fromkeys(part)]  # first of each kind
    keep += [i for i in range(n - shared) if i not in keep][: max(0, _layers_needed(options, n) - len(keep))]
    keep.sort()
    for name, value in list(options.items()):
        if isinstance(value, list) and len(value) == n and name not in _NOT_PER_LAYER:
            options[name] = [value[i] for i in keep]
        elif isinstance(value, dict) and value and all(str(k).isdigit() for k in value):
            options[name] = {
                keep.index(int(k)): _shrink_override(v, tp, (original, options), keep_kv_heads)
                for k, v in value.items() if int(k) in keep
            }
    for name in _LAYER_INDEX_LISTS:
        if isinstance(options.get(name), list):
            options[name] = [keep.index(i) for i in options[name] if i in keep]
    if shared:
        options["num_kv_shared_layers"] = sum(i >= n - shared for i in keep)
    options["num_hidden_layers"] = len(keep)


def _layers_needed(options: dict, n: int) -> int:
    """``TINY_LAYERS``, or more where a layer pattern needs more layers to show each kind once.

    A repeating pattern shorter than the stack (RecurrentGemma's ``block_types``: recurrent,
    recurrent, attention) and a period with an offset (Jamba's ``attn_layer_period`` 8, offset 4)
    place a layer kind past the first ``TINY_LAYERS`` layers. Periods are shortened to fit instead.
    """
    needed = TINY_LAYERS
    for name, value in options.items():
        if (isinstance(value, list) and 1 < len(value) < n and all(isinstance(v, str) for v in value)
                and name not in _NOT_PER_LAYER):
            needed = max(needed, max(value.index(v) for v in set(value)) + 1)
        if name.endswith("_period") and isinstance(value, int) and value > TINY_LAYERS:
            offset = name[: -len("period")] + "offset"
            options[name] = TINY_LAYERS
            if isinstance(options.get(offset), int):
                options[offset] = options[offset] % TINY_LAYERS
    return min(n, needed)


def _shrink_override(override, tp: int, bases: tuple[dict, dict], keep_kv_heads: bool = False):
    """A per-layer override's head widths, tiny (a wider head_dim stays wider than the default).

    ``bases`` are the model's config before and after shrinking, for widths the override inherits.
    """
    if not isinstance(override, dict):
        return override
    shrunk = dict(override)
    if "head_dim" in shrunk:
        shrunk["head_dim"] = 2 * TINY_HEAD_DIM
    if shrunk.get("num_key_value_heads"):
        kv = _tiny_kv_heads(shrunk["num_key_value_heads"], tp, keep_kv_heads)
        if shrunk.get("num_attention_heads"):  # keep the layer's query/kv ratio, as for the model
            shrunk["num_attention_heads"] = kv * max(1, shrunk["num_attention_heads"] // shrunk["num_key_value_heads"])
        shrunk["num_key_value_heads"] = kv
    shrunk.update({k: v for k, v in _TINY_EXTRAS.items() if shrunk.get(k)})
    _keep_width_sums({**bases[0], **override}, shrunk, base=bases[1])
    return shrunk


def _clamp_token_ids(options: dict) -> None:
    """Token ids past the tiny vocabulary would index out of the embedding (``padding_idx``)."""
    vocab = options["vocab_size"]
    for name in _TOKEN_IDS:
        value = options.get(name)
        if isinstance(value, int) and value >= vocab:
            options[name] = vocab - 1
        elif isinstance(value, list):
            options[name] = [min(v, vocab - 1) for v in value]


def build_model(
    name_or_path: str | Path | PretrainedConfig,
    *,
    tiny: bool = False,
    tp: int = 8,
    keep_kv_heads: bool = False,
    device: str | torch.device = "meta",
    seed: int = 0,
    dtype: torch.dtype = torch.float32,
    attn_implementation: str = "sdpa",
) -> nn.Module:
    """Build a causal LM (``...ForCausalLM``, or ``...ForConditionalGeneration`` for VLMs), in eval mode.

    Args:
        name_or_path: a built-in name, a model type, a config.json path, or a config.
        tiny: shrink the config first (:func:`shrink_config`), shardable at ``tp``.
        tp: the tensor-parallel size the tiny model must shard at.
        keep_kv_heads: keep the real config's kv heads where they are fewer than ``tp`` (see
            :func:`shrink_config`): the tiny model then repeats kv heads over ranks as the real one does.
        device: ``"meta"`` (shapes only, milliseconds at any size) or ``"cpu"``.
        seed: seeds the random initialisation, so two builds are equal.
        dtype: parameter dtype.
        attn_implementation: ``"sdpa"`` or ``"eager"``; sdpa falls back to eager for families
            that refuse it (Gemma2).
    """
    config = name_or_path if isinstance(name_or_path, PretrainedConfig) else load_config(name_or_path)
    if tiny:
        config = shrink_config(config, tp=tp, keep_kv_heads=keep_kv_heads)
    device = torch.device(device)
    if device.type == "meta":
        # No initialisation on meta: there is nothing to fill, and HF's init walk costs ~0.5 s.
        with torch.device("meta"), no_init_weights():
            model = _from_config(config, dtype, attn_implementation)
        model.tie_weights()  # skipped with the initialisation; tied parameters must stay one
    else:
        torch.manual_seed(seed)
        with torch.device(device):
            model = _from_config(config, dtype, attn_implementation)
    return model.eval()


def _from_config(config: PretrainedConfig, dtype: torch.dtype, attn_implementation: str) -> nn.Module:
    """``AutoModelForCausalLM.from_config``, falling back to eager attention where sdpa is refused."""
    try:
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation=attn_implementation)
    except ValueError as err:
        # Gemma2's logit soft-capping has no sdpa kernel; transformers refuses rather than ignore it.
        if attn_implementation == "eager" or "attention implementation" not in str(err):
            raise
        return AutoModelForCausalLM.from_config(config, dtype=dtype, attn_implementation="eager")
