"""FSDP2 + tensor parallelism for training a language model over one named ``DeviceMesh``.

:func:`fsdp2_strategy_parallelize` is the pipeline, a literal sequence of public steps:

1. tensor parallelism on the ``tp`` sub-mesh with the plan :func:`autotp.get_plan` chooses
   (skipped when tp is 1);
2. activation checkpointing of the decoder blocks :func:`get_lm_ac_layers` finds;
3. :func:`apply_fsdp2_sharding_recursively`: ``fully_shard`` on each block over the data-parallel
   dims (HSDP when ``dp_replicate`` > 1);
4. ``fully_shard`` on the root, which takes the embedding, head and final norm, tied ones included.

The mesh dims are named as in NeMo AutoModel: ``dp_replicate``, ``dp_shard_cp``, ``tp``; any may
be absent (size 1).
"""

from __future__ import annotations

import contextlib
import functools
import importlib
import logging
from collections.abc import Iterator
from typing import Any

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.fsdp import FSDPModule, MixedPrecisionPolicy, OffloadPolicy, fully_shard
from torch.utils.checkpoint import checkpoint

from autotp.apply import apply_plan, gather_logits, validate_tp_mesh
from autotp.dtensor_utils import get_logprobs_from_vocab_parallel_logits
from autotp.errors import AutoTPError, MeshError
from autotp.decision import decide_plan
from autotp.synth.trace import is_layer_stack, stack_entries

__all__ = [
    "apply_activation_checkpointing",
    "apply_fsdp2_sharding_recursively",
    "compile_blocks",
    "fsdp2_strategy_parallelize",
    "get_lm_ac_layers",
    "import_class_from_path",
    "next_token_loss",
    "unshard_fsdp2_model",
    "validate_tp_mesh",
]

logger = logging.getLogger(__name__)


def import_class_from_path(name: str) -> Any:
    """The object that ``package.module.Name`` (or ``package.module:Name``) names.

    >>> import_class_from_path("torch.nn.Linear").__name__
    'Linear'

    Raises:
        AutoTPError: the path has no module part, the module does not import, or lacks the name.
    """
    module_path, sep, attr = name.replace(":", ".").rpartition(".")
    if not sep:
        raise AutoTPError(f"{name!r} is not a dotted path; write it as 'package.module.ClassName'.")
    try:
        module = importlib.import_module(module_path)
    except ImportError as error:
        raise AutoTPError(f"{name!r}: cannot import module {module_path!r} ({error}).") from error
    if not hasattr(module, attr):
        raise AutoTPError(f"{name!r}: module {module_path!r} has no attribute {attr!r}.")
    return getattr(module, attr)


def _param_count(module: nn.Module) -> int:
    return sum(p.numel() for p in module.parameters())


def get_lm_ac_layers(model: nn.Module) -> list[nn.Module]:
    """The language model's repeated blocks: the items of the layer stack holding most parameters
    (an ``nn.ModuleList``, or an ``nn.ModuleDict`` / ``nn.Sequential`` of repeated blocks).

    Found by structure, not class name, so any architecture works: the decoder stack is the list
    of blocks that holds most of the weights (it contains any per-layer expert or head lists, so
    those never win; in a vision-language model it outweighs the vision tower). Ties go to the
    list met first in ``named_modules`` order, the outermost.

    >>> tiny = nn.Sequential(nn.Embedding(4, 2), nn.ModuleList([nn.Linear(2, 2), nn.Linear(2, 2)]))
    >>> len(get_lm_ac_layers(tiny))
    2

    Returns:
        The blocks, or ``[]`` when the model has no ``nn.ModuleList``.
    """
    best, best_size = None, 0
    for _, module in model.named_modules():
        # A ModuleDict / Sequential counts only as a stack of repeated blocks (torchtitan's layers).
        stack = (isinstance(module, nn.ModuleList) and len(module)) or is_layer_stack(module)
        if stack and (size := _param_count(module)) > best_size:
            best, best_size = module, size
    # An empty slot (``None``) is no block: nothing to checkpoint or shard.
    return [block for _, block in stack_entries(best) if block is not None] if best is not None else []


def _checkpointed_forward(forward, *args, **kwargs):
    # Non-reentrant: it supports keyword arguments (HF layers take most inputs as kwargs) and
    # composes with FSDP2's hooks, which run around __call__, outside this function.
    return checkpoint(forward, *args, use_reentrant=False, **kwargs)


def apply_activation_checkpointing(layers: list[nn.Module]) -> None:
    """Recompute each layer's activations in the backward pass instead of storing them.

    The layer's ``forward`` is wrapped in place rather than the layer in a wrapper module, so
    parameter names, plans and state-dict keys stay exactly as they were. Wrapping twice is a no-op.
    """
    for layer in layers:
        if not getattr(layer, "_autotp_checkpointed", False):
            layer.forward = functools.partial(_checkpointed_forward, layer.forward)
            layer._autotp_checkpointed = True


def apply_fsdp2_sharding_recursively(
    module: nn.Module,
    mesh: DeviceMesh,
    mp_policy: MixedPrecisionPolicy | None,
    offload_policy: OffloadPolicy | None = None,
) -> None:
    """``fully_shard`` every item of every ``nn.ModuleList`` under ``module`` (not ``module`` itself).

    Each block becomes one FSDP unit: its parameters are all-gathered just before its forward and
    freed after. The last block of a list keeps its parameters after forward, because the
    backward needs them first. Lists inside a sharded block are left to that block.
    """
    for child in module.children():
        if isinstance(child, nn.ModuleList) or is_layer_stack(child):
            blocks = [block for _, block in stack_entries(child) if block is not None]  # skip empty slots
            for index, block in enumerate(blocks):
                fully_shard(
                    block,
                    mesh=mesh,
                    mp_policy=mp_policy or MixedPrecisionPolicy(),
                    offload_policy=offload_policy or OffloadPolicy(),
                    reshard_after_forward=index < len(blocks) - 1,
                )
        else:
            apply_fsdp2_sharding_recursively(child, mesh, mp_policy, offload_policy)


def _sub_meshes(
    device_mesh: DeviceMesh, replicate: str, shard: str, tp: str
) -> tuple[DeviceMesh | None, DeviceMesh | None]:
    """``(data-parallel mesh or None, tp mesh or None)`` from the named dims of ``device_mesh``."""
    names = device_mesh.mesh_dim_names
    if not names:
        raise MeshError(
            f"device_mesh {tuple(device_mesh.shape)} has no dim names; build it with "
            f"init_device_mesh(..., mesh_dim_names=({shard!r}, {tp!r}))."
        )
    unknown = [n for n in names if n not in (replicate, shard, tp)]
    if unknown:
        raise MeshError(
            f"device_mesh dims {names}: {unknown} are none of {replicate!r}, {shard!r}, {tp!r}; "
            "flatten dp and cp into one dim, or pass dp_replicate_mesh_name / dp_shard_cp_mesh_name / tp_mesh_name."
        )
    size = {n: device_mesh[n].size() for n in names}
    if size.get(replicate, 1) > 1 and shard not in size:
        raise MeshError(
            f"device_mesh dims {names}: {replicate!r} has size {size[replicate]} but there is no {shard!r} dim; "
            f"HSDP needs both (add {shard!r} of size 1 for plain replication)."
        )
    if shard not in size:
        dp_mesh = None
    elif size.get(replicate, 1) > 1:
        dp_mesh = device_mesh[(replicate, shard)]
    else:
        dp_mesh = device_mesh[shard]
    tp_mesh = device_mesh[tp] if size.get(tp, 1) > 1 else None
    return dp_mesh, tp_mesh


def fsdp2_strategy_parallelize(
    model: nn.Module,
    device_mesh: DeviceMesh,
    *,
    mp_policy: MixedPrecisionPolicy | None = None,
    offload_policy: OffloadPolicy | None = None,
    sequence_parallel: bool = False,
    activation_checkpointing: bool = False,
    tp_shard_plan=None,
    dp_replicate_mesh_name: str = "dp_replicate",
    dp_shard_cp_mesh_name: str = "dp_shard_cp",
    tp_mesh_name: str = "tp",
    verify_synthesized: bool = True,
    loss_parallel: bool = True,
    example_inputs=None,
    cache: bool = True,
) -> nn.Module:
    """Shard ``model`` in place for training: TP inside each data-parallel replica, FSDP2 across them.

    Args:
        model: a materialised model on the mesh's device (or on meta, to be materialised after).
        device_mesh: a mesh whose dims are named ``dp_replicate`` / ``dp_shard_cp`` / ``tp`` (or
            the names given below); missing dims count as size 1.
        mp_policy: FSDP2 mixed precision (parameter and reduce dtypes); default: none.
        offload_policy: FSDP2 CPU offload; default: none.
        sequence_parallel: use the plan's sequence-parallel variant.
        activation_checkpointing: recompute each decoder block's activations in backward.
        tp_shard_plan: an explicit plan (dict, registered name, or import path), as for
            :func:`autotp.get_plan`; by default the handwritten, transformers' or synthesized plan.
        verify_synthesized: check a synthesized plan numerically before sharding (see
            :func:`autotp.parallelize`).
        loss_parallel: keep the logits a vocabulary-sharded DTensor (the default: no rank holds
            ``[batch, seq, vocab]``); False returns them whole on every rank, as
            :func:`autotp.parallelize` describes. ``generate`` works either way.
        example_inputs: inputs for one forward, to trace a model without a transformers config
            with (as for :func:`autotp.parallelize`).
        cache: read and write the on-disk plan cache (as for :func:`autotp.parallelize`).

    Returns:
        The same model: parameters are DTensors on the (dp..., tp) mesh, tied weights still tied.

    Raises:
        MeshError: unknown dim names, or a tp size the model cannot be split by.
        PlanError: the plan cannot be resolved or does not fit the model.
        AutoTPError: activation checkpointing was asked for and no block list exists.
    """
    dp_mesh, tp_mesh = _sub_meshes(device_mesh, dp_replicate_mesh_name, dp_shard_cp_mesh_name, tp_mesh_name)
    if tp_mesh is not None:
        choice = decide_plan(model, tp_mesh, sequence_parallel=sequence_parallel, tp_shard_plan=tp_shard_plan,
                             verify_synthesized=verify_synthesized, example_inputs=example_inputs, cache=cache)
        size, source, entries = tp_mesh.size(), choice.source, len(choice.plan)
        logger.info("tensor parallel over %d ranks with the %s plan (%d entries)", size, source, entries)
        apply_plan(model, tp_mesh, choice.plan)
    if activation_checkpointing:
        layers = get_lm_ac_layers(model)
        if not layers:
            raise AutoTPError(
                f"{type(model).__name__}: activation_checkpointing found no nn.ModuleList of blocks to "
                "checkpoint; pass activation_checkpointing=False or call apply_activation_checkpointing(blocks)."
            )
        apply_activation_checkpointing(layers)
    if dp_mesh is not None:
        apply_fsdp2_sharding_recursively(model, dp_mesh, mp_policy, offload_policy)
        # The root's parameters (embedding, head, final norm) are used first and last: keep them.
        fully_shard(
            model,
            mesh=dp_mesh,
            mp_policy=mp_policy or MixedPrecisionPolicy(),
            offload_policy=offload_policy or OffloadPolicy(),
            reshard_after_forward=False,
        )
    if tp_mesh is not None and not loss_parallel:
        gather_logits(model)  # after fully_shard: FSDP2's output hook must see the head's DTensor
    return model


@contextlib.contextmanager
def unshard_fsdp2_model(model: nn.Module) -> Iterator[None]:
    """Within the block, every FSDP2 unit of ``model`` holds its full (dp-gathered) parameters.

    For work that reads whole parameters outside a training step: generation, export, weight
    sync. TP shards stay sharded (they are a layout, not a memory saving to undo). Parameters are
    resharded on exit, also on error.
    """
    units = [m for m in model.modules() if isinstance(m, FSDPModule)]
    for unit in units:
        unit.unshard()
    try:
        yield
    finally:
        for unit in units:
            unit.reshard()


def next_token_loss(logits: torch.Tensor, input_ids: torch.Tensor) -> torch.Tensor:
    """Mean cross-entropy of ``input_ids[:, t + 1]`` under ``logits[:, t]``, vocab-parallel when sharded.

    With a ``Shard(-1)`` DTensor (the vocab-parallel head) no rank gathers the vocabulary; see
    :func:`autotp.dtensor_utils.get_logprobs_from_vocab_parallel_logits`.
    """
    return -get_logprobs_from_vocab_parallel_logits(logits, input_ids).mean()


def compile_blocks(model: nn.Module, **compile_options) -> list[nn.Module]:
    """``torch.compile`` each decoder block of ``model`` in place, torchtitan's way.

    Each block :func:`get_lm_ac_layers` finds is compiled with ``nn.Module.compile``: the module
    stays where it is (parameter names, state-dict keys, plans and FSDP units are unchanged) and
    its TP hooks (input and output redistributions) are captured in the same graph.
    Call it after tensor parallelism and activation checkpointing and before FSDP2
    (torchtitan's order, the one tested).

    Args:
        model: the (sharded) model.
        compile_options: passed to ``torch.compile`` (``backend="aot_eager"``, ``fullgraph=True``...).

    Returns:
        The compiled blocks.

    Raises:
        AutoTPError: the model has no list of blocks.
    """
    layers = get_lm_ac_layers(model)
    if not layers:
        raise AutoTPError(
            f"{type(model).__name__}: compile_blocks found no nn.ModuleList of decoder blocks; "
            "compile the model whole (torch.compile(model)) or call block.compile() on your blocks."
        )
    for block in layers:
        block.compile(**compile_options)
    return layers
