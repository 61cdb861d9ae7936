"""What the plan benchmarks share: the families, their plans by source, and the two meters.

- :data:`FAMILIES`: every architecture with a handwritten plan, and four without one (Qwen3-Next,
  Nemotron-H, gpt-oss, Falcon: measured for the synthesized and transformers' plans only), with the
  real-size config each is measured at (a built-in checkpoint config where autotp has one, else
  transformers' default config of that family, which is also a released size, else a released
  checkpoint's widths).
- :func:`plan_from`: the handwritten, synthesized or transformers plan for a model at a tp size.
- :class:`CollectiveRecorder`: every collective the sharded model issues, with the bytes of its
  input, split into forward and backward.
- :class:`ActivationMeter`: the bytes autograd saves for backward inside the decoder layers, per rank.

Both meters work on meta models sharded over simulated ranks (``autotp._simulate``), so a
real-size layer is measured in a fraction of a second without any memory.
"""

from __future__ import annotations

import contextlib
import copy
from collections import defaultdict
from collections.abc import Callable, Iterator
from dataclasses import dataclass

import torch
import torch.nn.functional as F
import transformers
from torch import nn
from torch.autograd.graph import saved_tensors_hooks
from torch.distributed.tensor import DTensor, Replicate, Shard
from torch.multiprocessing.reductions import StorageWeakRef
from torch.utils._python_dispatch import TorchDispatchMode
from transformers import AutoConfig, PretrainedConfig

import handwritten_plans
from autotp import _simulate
from autotp.apply import apply_plan
from autotp.errors import AutoTPError, PlanError
from autotp.hf_plans import hf_plan
from autotp.models import build_model, load_config
from autotp.plan import Plan
from autotp.synth import synthesize
from autotp.training import next_token_loss

SOURCES = ("handwritten", "synthesized", "hf")


@dataclass(frozen=True)
class Family:
    """An architecture and the config it is benchmarked at.

    Whether it has a handwritten plan is not declared here but asked of ``handwritten_plans``
    (:func:`plan_from`), so a family without one gets a ``"no plan"`` handwritten row, not a crash.
    """

    config: Callable[[], PretrainedConfig]
    config_of: str  # which released model the numbers are
    model_class: str | None = None  # transformers class; default: what build_model picks


def _builtin(name: str) -> Callable[[], PretrainedConfig]:
    return lambda: load_config(name)


def _default(model_type: str, **options) -> Callable[[], PretrainedConfig]:
    return lambda: AutoConfig.for_model(model_type, **options)


def _qwen3_classifier() -> PretrainedConfig:
    config = load_config("qwen3")
    config.num_labels, config.pad_token_id = 3, 0
    return config


# nvidia/Nemotron-H-8B-Base-8K's config.json (the widths; 24 Mamba2, 4 attention, 24 MLP layers).
# Bamba is the other Mamba2 hybrid issue 12 names; it is not measured: its synthesis on meta stops
# at a ``Tensor.item()`` (transformers' ``_ignore_causal_mask_sdpa`` reads the padding mask's values,
# which meta tensors do not have), and transformers' default BambaConfig has no attention layer
# (``attn_layer_indices=None``). Nemotron-H synthesizes on meta, and its 8 B/C groups divide tp 2/4/8.
NEMOTRON_H_8B = dict(
    hybrid_override_pattern="M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M*-M-M-M-M-M-",
    hidden_size=4096, intermediate_size=21504, num_attention_heads=32, num_key_value_heads=8,
    mamba_num_heads=128, mamba_head_dim=64, n_groups=8, ssm_state_size=128, conv_kernel=4, expand=2,
    chunk_size=128, vocab_size=131072, mlp_hidden_act="relu2",
)


FAMILIES: dict[str, Family] = {
    "llama": Family(_builtin("llama"), "Llama-3.1-8B"),
    "mistral": Family(_builtin("mistral"), "Mistral-7B-v0.3"),
    "qwen2": Family(_builtin("qwen2"), "Qwen2.5-7B"),
    "qwen3": Family(_builtin("qwen3"), "Qwen3-8B"),
    "gemma3": Family(_builtin("gemma3"), "Gemma-3-1B (text)"),
    "gemma3-vlm": Family(_builtin("gemma3-vlm"), "Gemma-3-4B (vision + text)"),
    "phi3": Family(_builtin("phi3"), "Phi-3-mini-4k"),
    "phi": Family(_default("phi"), "transformers' default PhiConfig (Phi-1.5 widths)"),
    "ministral3": Family(_default("ministral3"), "transformers' default Ministral3Config"),
    "mistral3": Family(_default("mistral3"), "transformers' default Mistral3Config (24B text + vision)",
                       model_class="Mistral3ForConditionalGeneration"),
    "qwen3-cls": Family(_qwen3_classifier, "Qwen3-8B widths, sequence classification head (3 labels)",
                        model_class="Qwen3ForSequenceClassification"),
    "falcon_h1": Family(_default("falcon_h1"), "transformers' default FalconH1Config (Falcon-H1-7B widths)"),
    "qwen3_5": Family(_default("qwen3_5_text"), "transformers' default Qwen3_5TextConfig"),
    "gemma4": Family(_default("gemma4_text"), "transformers' default Gemma4TextConfig"),
    # No handwritten plan (issue 12): the synthesized plan against transformers' own.
    "qwen3_next": Family(_default("qwen3_next"), "transformers' default Qwen3NextConfig (Qwen3-Next-80B-A3B widths)"),
    "nemotron_h": Family(_default("nemotron_h", **NEMOTRON_H_8B), "Nemotron-H-8B-Base-8K widths (transformers' "
                         "default NemotronHConfig is a 4-layer mix of 8B and MoE widths, no released model)"),
    "gpt_oss": Family(_default("gpt_oss"), "transformers' default GptOssConfig (gpt-oss-120b widths)"),
    "falcon": Family(_default("falcon"), "transformers' default FalconConfig (Falcon-7B: multi-query attention, "
                     "parallel block)"),
}


# --- building ----------------------------------------------------------------------------------


def layer_kinds(config: PretrainedConfig) -> list[str]:
    """One entry per distinct decoder-layer kind (``layer_types``), or ``["decoder"]``."""
    types = getattr(config.get_text_config(), "layer_types", None)
    if isinstance(types, list) and types:
        return list(dict.fromkeys(types))
    return ["decoder"]


def with_layers(config: PretrainedConfig, copies: int) -> PretrainedConfig:
    """``config`` with ``copies`` repeats of one layer of each kind, every width unchanged.

    Two depths of the same widths let a per-layer cost be read off as a difference, free of the
    embedding, head and loss. Per-layer lists (``layer_types``, or the field a config maps it to:
    Nemotron-H's ``layers_block_type``) and overrides keyed by layer index (Gemma4's
    ``per_layer_config``) follow the kept layers.
    """
    options = config.to_dict()
    text_key = "text_config" if isinstance(options.get("text_config"), dict) else None
    text = dict(options[text_key]) if text_key else options
    n = config.get_text_config().num_hidden_layers  # a property of Nemotron-H's config, not in to_dict()
    types_key = config.get_text_config().attribute_map.get("layer_types", "layer_types")
    types = text.get(types_key)
    keep = [types.index(t) for t in dict.fromkeys(types)] if isinstance(types, list) and len(types) == n else [0]
    keep.sort()
    order = keep * copies
    if isinstance(types, list) and len(types) == n:
        text[types_key] = [types[i] for i in order]
    overrides = text.get("per_layer_config")
    if isinstance(overrides, dict) and overrides:
        width = len(next(iter(overrides)))
        text["per_layer_config"] = {f"{j:0{width}d}": overrides[k] for j, i in enumerate(order)
                                    for k in overrides if int(k) == i}
    text["num_hidden_layers"] = len(order)
    if text_key:
        options[text_key] = text
    model_type = options.pop("model_type")
    options.pop("transformers_version", None)
    return AutoConfig.for_model(model_type, **options)


def build(family: str, *, copies: int | None = None, dtype: torch.dtype = torch.bfloat16) -> nn.Module:
    """The family's real-size model on the meta device; ``copies`` cuts the depth (see :func:`with_layers`)."""
    spec = FAMILIES[family]
    config = spec.config()
    if copies is not None:
        config = with_layers(config, copies)
    if spec.model_class is None:
        return build_model(config, device="meta", dtype=dtype)
    with torch.device("meta"):
        model = getattr(transformers, spec.model_class)._from_config(config, dtype=dtype)
    return model.eval()


def decoder_layers(model: nn.Module) -> nn.ModuleList:
    """The text decoder's layer list (not a vision tower's): ``...layers``, or Falcon's ``transformer.h``."""
    n = model.config.get_text_config().num_hidden_layers
    for name, module in model.named_modules():
        last = name.rsplit(".", 1)[-1]
        if isinstance(module, nn.ModuleList) and len(module) == n and last in ("layers", "h") and "vision" not in name:
            return module
    raise AutoTPError(f"{type(model).__name__}: no ModuleList of {n} decoder layers")


def kv_heads(model: nn.Module) -> int | None:
    return getattr(model.config.get_text_config(), "num_key_value_heads", None)


# --- plans -------------------------------------------------------------------------------------


class NoPlan(Exception):
    """The source has no plan of this kind for the model (not a failure of the plan)."""


def plan_from(model: nn.Module, source: str, *, tp: int, sequence_parallel: bool) -> Plan:
    """The ``source`` plan for ``model`` at ``tp``.

    The handwritten plan opts in to replicated kv heads when tp exceeds them, as the synthesizer
    does given ``tp_size``; transformers' plans have no such option and no SP variant.

    Raises:
        NoPlan: the source has no plan (or no SP variant) for this model.
    """
    if source == "handwritten":
        try:
            plan = handwritten_plans.plan_for(model, sequence_parallel=sequence_parallel)
        except PlanError as error:  # a TP-only plan refusing SP by name
            raise NoPlan(str(error).splitlines()[0]) from error
        if plan is None:
            raise NoPlan(f"no handwritten plan for {type(model).__name__}")
        kv = kv_heads(model)
        if kv and tp > kv:  # divisibility errors here are failures, not a missing plan
            plan = handwritten_plans.plan_for(model, sequence_parallel=sequence_parallel, replicate_kv_for_tp=tp)
        return plan
    if source == "synthesized":
        return synthesize(model, sequence_parallel=sequence_parallel, tp_size=tp, verify=False)
    if source == "hf":
        if sequence_parallel:
            raise NoPlan("transformers plans have no sequence-parallel variant")
        plan = hf_plan(model)
        if plan is None:
            raise NoPlan(f"{type(model).__name__} ships no transformers tp plan")
        return plan
    raise ValueError(f"unknown source {source!r}")


# --- the loss each plan is trained with --------------------------------------------------------


def _is_vocab_sharded(logits: torch.Tensor) -> bool:
    return isinstance(logits, DTensor) and any(
        isinstance(p, Shard) and p.dim in (-1, logits.ndim - 1) for p in logits.placements
    )


def plan_loss(output, input_ids: torch.Tensor) -> torch.Tensor:
    """The loss a plan is trained with: next-token cross-entropy, vocab-parallel if the head leaves
    the logits vocab-sharded (no rank gathers the vocabulary), else on the replicated logits.
    A sequence-classification head gets a mean square of its (few) logits."""
    logits = output.logits if hasattr(output, "logits") else output
    if isinstance(logits, DTensor) and not _is_vocab_sharded(logits):
        logits = logits.redistribute(logits.device_mesh, [Replicate()]).to_local()
    if logits.ndim == 2:
        full = logits.full_tensor() if isinstance(logits, DTensor) else logits
        return full.float().pow(2).mean()
    return next_token_loss(logits, input_ids)


# --- meters ------------------------------------------------------------------------------------

# Functional collectives (what DTensor issues) and c10d ones (what the vocab-parallel loss calls).
_COLLECTIVE_NAMESPACES = frozenset({"_c10d_functional", "c10d_functional", "_c10d_functional_autograd", "c10d"})
_NOT_COLLECTIVES = frozenset({"wait_tensor", "_wrap_tensor_autograd", "barrier", "monitored_barrier_"})


def ring_bytes(op: str, payload: int, world: int) -> float:
    """Bytes one rank sends for a collective whose per-rank input is ``payload`` bytes, with ring
    algorithms (the NCCL "bus bandwidth" convention).

    all-reduce sends ``2 (W-1)/W x input``; reduce-scatter ``(W-1)/W x input`` (the full tensor);
    all-gather ``(W-1) x input`` (the shard); all-to-all ``(W-1)/W x input``; broadcast ``input``.

    >>> ring_bytes("all_reduce", 800, 8), ring_bytes("all_gather_into_tensor", 100, 8)
    (1400.0, 700.0)
    """
    op = op.rstrip("_")
    if op in ("all_reduce", "allreduce", "all_reduce_coalesced", "allreduce_coalesced"):
        return 2 * (world - 1) / world * payload
    if op in ("reduce_scatter_tensor", "reduce_scatter_tensor_coalesced", "reduce_scatter", "_reduce_scatter_base"):
        return (world - 1) / world * payload
    if op in ("all_gather_into_tensor", "all_gather_into_tensor_coalesced", "allgather", "_allgather_base"):
        return float((world - 1) * payload)
    if op in ("all_to_all_single", "alltoall_base", "all_to_all"):
        return (world - 1) / world * payload
    if op == "broadcast":
        return float(payload)
    raise ValueError(f"no ring-algorithm byte count for collective {op!r}")


def _tensor_bytes(value) -> int:
    if isinstance(value, torch.Tensor):
        return value.numel() * value.element_size()
    if isinstance(value, (list, tuple)):
        return sum(_tensor_bytes(v) for v in value)
    return 0


class CollectiveRecorder(TorchDispatchMode):
    """Each collective dispatched while active: ``{phase: {op: [count, payload bytes, ring bytes]}}``.

    ``payload`` is the per-rank input of the collective (one rank's tensor, also under simulated
    ranks); set :attr:`phase` to ``"backward"`` before calling ``backward()``.
    """

    def __init__(self, world: int):
        super().__init__()
        self.world = world
        self.phase = "forward"
        self.ops: dict[str, dict[str, list[float]]] = defaultdict(lambda: defaultdict(lambda: [0, 0, 0.0]))

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        if isinstance(func, torch._ops.HigherOrderOperator):
            return func(*args, **(kwargs or {}))
        if any(issubclass(t, DTensor) for t in types):
            return NotImplemented  # DTensor desugars into collectives, which come back here
        name = func._schema.name.split("::")[-1]
        if func.namespace in _COLLECTIVE_NAMESPACES and name not in _NOT_COLLECTIVES:
            payload = _tensor_bytes(args[0] if args else None)
            entry = self.ops[self.phase][name.rstrip("_")]
            entry[0] += 1
            entry[1] += payload
            entry[2] += ring_bytes(name, payload, self.world)
        return func(*args, **(kwargs or {}))

    def as_dict(self) -> dict:
        return {phase: {op: list(v) for op, v in ops.items()} for phase, ops in self.ops.items()}


class ActivationMeter:
    """Bytes autograd saves for backward inside ``layers``, as one rank holds them.

    Counts each storage once (q, k and v saving the same normed input is one tensor) and leaves
    out parameters (a Linear saves its weight, which is not an activation). Simulated ranks hold
    equal shapes, so rank 0 stands for all.
    """

    def __init__(self, model: nn.Module, layers: nn.ModuleList, tp: int):
        self.tp = tp
        self.bytes = 0
        self._seen: set = set()
        self._params = {self._key(p) for p in model.parameters()}
        self._contexts: list = []
        self._handles = []
        for layer in layers:
            self._handles.append(layer.register_forward_pre_hook(self._enter))
            self._handles.append(layer.register_forward_hook(self._exit))

    def _local(self, t: torch.Tensor) -> torch.Tensor:
        with torch.no_grad():
            if isinstance(t, DTensor):
                t = t.to_local()
            return _simulate.per_rank(t, self.tp)[0]

    def _key(self, t: torch.Tensor):
        return StorageWeakRef(self._local(t).untyped_storage())

    def _pack(self, t: torch.Tensor):
        key = self._key(t)
        if key not in self._params and key not in self._seen:
            self._seen.add(key)
            self.bytes += self._local(t).untyped_storage().nbytes()
        return t

    def _enter(self, module, args):
        context = saved_tensors_hooks(self._pack, lambda t: t)
        context.__enter__()
        self._contexts.append(context)

    def _exit(self, module, args, output):
        self._contexts.pop().__exit__(None, None, None)

    def remove(self) -> None:
        """Remove the hooks, and close the saved-tensor hooks a failed forward left open: they are
        thread-global and would otherwise count (and break) every later run in this process."""
        for handle in self._handles:
            handle.remove()
        while self._contexts:
            self._contexts.pop().__exit__(None, None, None)


def _fused_sdpa(query, key, value, attn_mask=None, dropout_p=0.0, is_causal=False, scale=None, enable_gqa=False):
    """``scaled_dot_product_attention`` through the fused (flash) kernel's op, which has a meta kernel.

    The op takes fewer kv heads than query heads as they are (``enable_gqa``), as sdpa does on CPU.
    """
    if attn_mask is not None and attn_mask.dtype == torch.bool:  # as sdpa converts it
        attn_mask = torch.zeros(attn_mask.shape, dtype=query.dtype, device=query.device).masked_fill(
            ~attn_mask, float("-inf"))
    return torch.ops.aten._scaled_dot_product_flash_attention_for_cpu(
        query, key, value, dropout_p, is_causal, attn_mask=attn_mask, scale=scale)[0]


@contextlib.contextmanager
def fused_attention_on_meta(model: nn.Module) -> Iterator[None]:
    """On the meta device, route sdpa to the fused kernel that real CPUs and GPUs run.

    On meta, ``scaled_dot_product_attention`` always decomposes into its math path, which saves
    the seq x seq attention probabilities for backward; CPU and CUDA pick a fused (flash) kernel
    that saves q, k, v, the output and the log-sum-exp. Without this the activation figures
    would be those of a kernel nobody trains with. Off meta, nothing changes.
    """
    if next(model.parameters()).device.type != "meta":
        yield
        return
    original = F.scaled_dot_product_attention
    F.scaled_dot_product_attention = _fused_sdpa
    try:
        yield
    finally:
        F.scaled_dot_product_attention = original


def measure(model: nn.Module, plan: Plan, tp: int, *, batch: int, seq: int, activations: bool) -> dict:
    """Shard a copy of the meta ``model`` with ``plan`` over ``tp`` simulated ranks, run one
    forward and backward of :func:`plan_loss`, and return the collectives by phase and (if asked)
    the activation bytes per rank saved inside the decoder layers."""
    with _simulate.simulated_mesh(tp) as mesh:
        sharded = copy.deepcopy(model)
        apply_plan(sharded, mesh, plan)
        input_ids = torch.zeros(batch, seq, dtype=torch.long, device=next(model.parameters()).device)
        meter = ActivationMeter(sharded, decoder_layers(sharded), tp) if activations else None
        recorder = CollectiveRecorder(tp)
        try:
            with recorder, fused_attention_on_meta(sharded):
                loss = plan_loss(sharded(input_ids=input_ids), input_ids)
                recorder.phase = "backward"
                loss.backward()
        finally:
            if meter is not None:
                meter.remove()
    return {"collectives": recorder.as_dict(), "activation_bytes": meter.bytes if meter else None}
