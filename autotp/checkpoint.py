"""Checkpoints of a TP (+ FSDP2) model and its optimizer, and full safetensors export.

A checkpoint is a ``torch.distributed.checkpoint`` (DCP) directory written by every rank, each
its own shards. It holds the model's weights in the **model's own order**, not in the order a
style stores them: :class:`~autotp.styles.Colwise` (and the packed ``InOut`` and
expert styles) permute the rows of a fused ``[q | k | v]`` weight so that a contiguous shard holds
a slice of every part, and :class:`~autotp.styles.ReplicatedKVColwise` repeats each kv head's rows
``tp / kv_heads`` times. Both depend on tp, so the stored tensor is mapped back first (the
permutation undone, one copy of each head kept); the optimizer's per-parameter states (AdamW's
moments) likewise. DCP then reshards by offsets, so a checkpoint saved at one (dp, tp) layout
loads at any other: on load, the new model's own maps (for its tp) reorder what was read. Each
reordered tensor is gathered whole on every rank for that, one tensor at a time; the rest never is.

- :func:`save_checkpoint` / :func:`load_checkpoint`: the model, an optional optimizer, and a small
  JSON-able ``extra`` dict (the step, say).
- :func:`full_state_dict` / :func:`export_safetensors`: whole tensors with transformers' names
  (a file ``model.load_state_dict`` and ``from_pretrained`` read), written by rank 0 only.

Every rank must call each function (they run collectives). The map back is read from the
``_autotp_to_layout`` attribute the styles set on a parameter, or, after FSDP2 replaced the
parameter, from the copy :func:`autotp.apply.apply_plan` keeps on the module; a model sharded by
hand with ``parallelize_module`` and then FSDP2 has neither.

Long because saving, loading and exporting must each undo every style's row permutation and kv
repetition; kept in one module so the three stay consistent.
"""

from __future__ import annotations

import contextlib
import json
import os
import warnings
from collections.abc import Callable
from functools import partial
from pathlib import Path

import torch
import torch.distributed as dist
import torch.distributed.checkpoint as dcp
from torch import nn
from torch.distributed.checkpoint.state_dict import (
    get_model_state_dict,
    get_state_dict,
    set_model_state_dict,
    set_state_dict,
)
from torch.distributed.tensor import DTensor, Replicate, Shard, distribute_tensor
from torch.distributed.tensor import empty as dtensor_empty

from autotp.errors import AutoTPError
from autotp.styles.attention import expand_kv_rows
from autotp.styles.base import permute_rows
from autotp.styles.linear import copy_rows

__all__ = [
    "CheckpointError",
    "export_safetensors",
    "full_state_dict",
    "layout_transforms",
    "load_checkpoint",
    "save_checkpoint",
]

EXTRA_FILE = "autotp.json"  # the JSON ``extra`` dict, next to DCP's files
SAFETENSORS_FILE = "model.safetensors"  # the name transformers' from_pretrained looks for


class CheckpointError(AutoTPError):
    """A checkpoint is missing, or does not fit the model or optimizer it is loaded into."""


def _unpermute_rows(tensor: torch.Tensor, *, dim: int, order: torch.Tensor) -> torch.Tensor:
    """Inverse of ``permute_rows``: row ``order[i]`` of the result is row ``i`` of ``tensor``.

    >>> order = torch.tensor([0, 1, 4, 2, 3, 5])
    >>> _unpermute_rows(permute_rows(torch.arange(6), dim=0, order=order), dim=0, order=order).tolist()
    [0, 1, 2, 3, 4, 5]
    """
    return tensor.index_select(dim, torch.argsort(order).to(tensor.device))


def _collapse_kv_rows(tensor: torch.Tensor, *, kv_heads: int, head_dim: int, tp_size: int) -> torch.Tensor:
    """Inverse of ``expand_kv_rows``: the first of each head's ``tp / kv_heads`` identical copies.

    The copies stay identical in training (their gradients are summed), so any one is the head.

    >>> _collapse_kv_rows(torch.tensor([0.0, 1.0, 0.0, 1.0, 2.0, 3.0, 2.0, 3.0]), kv_heads=2, head_dim=2,
    ...                   tp_size=4).tolist()
    [0.0, 1.0, 2.0, 3.0]
    """
    rest = tensor.shape[1:]
    return tensor.reshape(kv_heads, tp_size // kv_heads, head_dim, *rest)[:, 0].reshape(kv_heads * head_dim, *rest)


def _uncopy_rows(tensor: torch.Tensor, *, index: torch.Tensor) -> torch.Tensor:
    """Undo :func:`~autotp.styles.linear.copy_rows`: each original row from its first copy (the
    copies stay identical in training, their gradients summed).

    >>> _uncopy_rows(torch.tensor([0.0, 1.0, 1.0, 2.0]), index=torch.tensor([0, 1, 1, 2])).tolist()
    [0.0, 1.0, 2.0]
    """
    index = index.to(tensor.device)
    positions = torch.arange(len(index), device=tensor.device)
    first = torch.full((int(index.max()) + 1,), len(index), device=tensor.device).scatter_reduce(
        0, index, positions, reduce="amin")
    return tensor.index_select(0, first)


# The row maps styles store as ``_autotp_to_layout`` (a functools.partial of one of these keys),
# and the map that undoes each. A style with a new row map must add its inverse here.
_INVERSES: dict[Callable, Callable] = {
    permute_rows: _unpermute_rows,  # Colwise(sizes=...), Rowwise(sizes=...), ExpertsParallel
    expand_kv_rows: _collapse_kv_rows,  # ReplicatedKVColwise
    copy_rows: _uncopy_rows,  # GroupCopies
}


def layout_transforms(model: nn.Module) -> dict[str, partial]:
    """``state-dict name -> to_layout`` for every parameter a style stores reordered or repeated.

    Tied names are all listed. Read from the parameter, or from the module's copy that survives
    FSDP2 (see the module docstring).

    Raises:
        CheckpointError: a map that this module cannot invert (a style added without an inverse).
    """
    found = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        kept = module.__dict__.get("_autotp_layouts", {})
        for pname, param in module._parameters.items():
            to_layout = getattr(param, "_autotp_to_layout", None) or kept.get(pname)
            if to_layout is None:
                continue
            if getattr(to_layout, "func", None) not in _INVERSES:
                raise CheckpointError(
                    f"{fqn}.{pname}: stored in a layout made by {to_layout!r}, which autotp.checkpoint "
                    "cannot undo; add its inverse to autotp.checkpoint._INVERSES."
                )
            found[_state_dict_name(f"{fqn}.{pname}" if fqn else pname)] = to_layout
    return found


# Module names that wrappers insert and DCP's state dicts leave out (torch's checkpoint_wrapper,
# torch.compile, FSDP1), as torch.distributed.checkpoint.state_dict does.
_WRAPPER_PARTS = ("_checkpoint_wrapped_module.", "_orig_mod.", "_fsdp_wrapped_module.")


def _state_dict_name(fqn: str) -> str:
    """``fqn`` as the state dicts name it, wrapper modules left out.

    >>> _state_dict_name("model.layers.0._checkpoint_wrapped_module.mlp.gate_up_proj.weight")
    'model.layers.0.mlp.gate_up_proj.weight'
    """
    for part in _WRAPPER_PARTS:
        fqn = fqn.replace(part, "")
    return fqn


def _call(transform: partial, tensor: torch.Tensor, *, inverse: bool) -> torch.Tensor:
    """Apply ``transform`` (or its inverse) with its index tensors moved to ``tensor``'s device."""
    func = _INVERSES[transform.func] if inverse else transform.func
    kwargs = {k: v.to(tensor.device) if isinstance(v, torch.Tensor) else v for k, v in transform.keywords.items()}
    return func(tensor, *transform.args, **kwargs)


def _plain_placements(value: DTensor) -> list:
    """``value``'s placements with any strided shard (FSDP2 over TP) read as a plain ``Shard``.

    The model-order tensor is a different tensor from the stored one; any regular layout on the
    same mesh serves DCP, which addresses shards by offset.
    """
    return [Shard(p.dim) if isinstance(p, Shard) else Replicate() for p in value.placements]


def _to_model_order(value: torch.Tensor, transform: partial) -> torch.Tensor:
    """The checkpoint form of a stored tensor: the whole tensor mapped back, resharded plainly."""
    if not isinstance(value, DTensor):
        return _call(transform, value, inverse=True)
    full = _call(transform, value.full_tensor(), inverse=True)
    return distribute_tensor(full, value.device_mesh, _plain_placements(value), src_data_rank=None)


def _empty_model_order(like: torch.Tensor, transform: partial) -> torch.Tensor:
    """An empty tensor shaped and placed as :func:`_to_model_order` of ``like``, for DCP to fill."""
    shape = _call(transform, torch.empty(like.shape, device="meta"), inverse=True).shape
    if not isinstance(like, DTensor):
        return torch.empty(shape, dtype=like.dtype, device=like.device)
    return dtensor_empty(shape, dtype=like.dtype, device_mesh=like.device_mesh, placements=_plain_placements(like))


def _from_model_order(value: torch.Tensor, like: torch.Tensor, transform: partial) -> torch.Tensor:
    """Inverse of :func:`_to_model_order`: ``value`` in the stored order, placed like ``like``."""
    if not isinstance(like, DTensor):
        return _call(transform, value, inverse=False)
    full = _call(transform, value.full_tensor(), inverse=False)
    return distribute_tensor(full, like.device_mesh, like.placements, src_data_rank=None)


def _per_param_states(optim_sd: dict, name: str, param: torch.Tensor) -> dict[str, torch.Tensor]:
    """The optimizer states of reordered parameter ``name`` shaped like it (AdamW's moments).

    Raises:
        CheckpointError: a state tensor of another shape (a factored moment), which this module
            cannot reorder with its parameter.
    """
    states = optim_sd.get("state", {}).get(name, {})
    tensors = {k: v for k, v in states.items() if isinstance(v, torch.Tensor) and v.numel() > 1}
    odd = {k: tuple(v.shape) for k, v in tensors.items() if v.shape != param.shape}
    if odd:
        raise CheckpointError(
            f"{name}: optimizer state {odd} is not shaped like the parameter {tuple(param.shape)}, whose rows "
            "the plan reorders; use an optimizer with elementwise state (AdamW, SGD) or a plan without packed styles."
        )
    return tensors


def _state_dicts(model: nn.Module, optimizer: torch.optim.Optimizer | None) -> tuple[dict, dict | None]:
    """DCP's FQN-keyed model (and optimizer) state dicts; the optimizer's state is created if empty."""
    if optimizer is None:
        return get_model_state_dict(model), None
    return get_state_dict(model, optimizer)


def _checkpoint_state(model: nn.Module, optimizer, transforms: dict, *, empty: bool) -> tuple[dict, dict]:
    """``({"model": ..., "optim": ...}, the DCP state dicts)``, reordered tensors in model order.

    With ``empty`` the reordered entries are empty placeholders for a load to fill.
    """
    model_sd, optim_sd = _state_dicts(model, optimizer)
    convert = _empty_model_order if empty else _to_model_order
    saved_model = dict(model_sd)
    saved_optim = None if optim_sd is None else {**optim_sd, "state": dict(optim_sd["state"])}
    for name, transform in transforms.items():
        if name not in model_sd:
            raise CheckpointError(
                f"{name}: stored reordered, but the state dict names it differently (first names: "
                f"{list(model_sd)[:3]}); a wrapper module autotp.checkpoint._WRAPPER_PARTS does not list renamed it."
            )
        saved_model[name] = convert(model_sd[name], transform)
        if saved_optim is not None and name in saved_optim["state"]:
            moments = _per_param_states(optim_sd, name, model_sd[name])
            saved_optim["state"][name] = {**saved_optim["state"][name],
                                          **{k: convert(v, transform) for k, v in moments.items()}}
    state = {"model": saved_model} if saved_optim is None else {"model": saved_model, "optim": saved_optim}
    return state, {"model": model_sd, "optim": optim_sd}


def _rank() -> int:
    return dist.get_rank() if dist.is_initialized() else 0


def _barrier() -> None:
    if dist.is_initialized():
        dist.barrier()


@contextlib.contextmanager
def _single_process_ok():
    """Silence DCP's "no process group, assuming one process" warning: one process is supported."""
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", message="torch.distributed is disabled", category=UserWarning)
        yield


def save_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
    extra: dict | None = None,
) -> None:
    """Save ``model`` (and ``optimizer``) to the DCP directory ``path``; every rank writes its shards.

    Args:
        path: a directory, created if needed; DCP files there are overwritten.
        model: a model sharded by autotp (TP, FSDP2, both, or neither).
        optimizer: its optimizer, or None for the weights only.
        extra: JSON-able values to keep with it (step, data position), written by rank 0.

    Raises:
        CheckpointError: ``extra`` is not JSON-able, or a reordered weight has no known inverse.
    """
    path = Path(path)
    try:
        extra_text = json.dumps(extra or {})
    except TypeError as error:
        raise CheckpointError(
            f"save_checkpoint(extra=...): {error}; pass ints, floats, strings, lists, dicts."
        ) from None
    state, _ = _checkpoint_state(model, optimizer, layout_transforms(model), empty=False)
    with _single_process_ok():
        dcp.save(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    if _rank() == 0:
        (path / EXTRA_FILE).write_text(extra_text)
    _barrier()


def _saved_entries(path: Path) -> dict:
    """DCP's metadata of ``path``: flattened name -> storage metadata (``.size`` for tensors)."""
    if not (path / ".metadata").is_file():
        found = "does not exist" if not path.exists() else "has no DCP .metadata file"
        raise CheckpointError(
            f"checkpoint {str(path)!r} {found}; pass the directory save_checkpoint wrote (every rank "
            "must see it: a shared file system, or the same path copied to every node)."
        )
    return dcp.FileSystemReader(path).read_metadata().state_dict_metadata


def _check_fits(path: Path, entries: dict, state: dict) -> None:
    """Refuse a checkpoint whose model names or shapes differ from ``state``'s, naming them."""
    saved = {k[len("model."):]: v for k, v in entries.items() if k.startswith("model.")}
    wanted = state["model"]
    missing, unexpected = sorted(set(wanted) - set(saved)), sorted(set(saved) - set(wanted))
    if missing or unexpected:
        raise CheckpointError(
            f"checkpoint {str(path)!r} does not fit the model: {len(missing)} parameter(s) of the model are "
            f"not in it (first: {missing[:3]}), {len(unexpected)} in it are not in the model "
            f"(first: {unexpected[:3]}); load it into a model built from the same config and class."
        )
    for name, value in wanted.items():
        size = getattr(saved[name], "size", None)
        if isinstance(value, torch.Tensor) and size is not None and tuple(size) != tuple(value.shape):
            raise CheckpointError(
                f"{name}: the checkpoint holds shape {tuple(size)}, the model {tuple(value.shape)}; "
                "load it into a model built from the same config."
            )
    if "optim" in state and not any(k.startswith("optim.") for k in entries):
        raise CheckpointError(
            f"checkpoint {str(path)!r} holds no optimizer state; call load_checkpoint without optimizer=."
        )


def _in_stored_order(state: dict, live: dict, transforms: dict) -> tuple[dict, dict | None]:
    """The loaded ``state`` with each reordered entry mapped back to the order its parameter stores.

    ``live`` holds the model's own state dicts, whose tensors give each entry's placement.
    """
    model_sd = dict(state["model"])
    optim_sd = {**state["optim"], "state": dict(state["optim"]["state"])} if "optim" in state else None
    for name, transform in transforms.items():
        like = live["model"][name]
        model_sd[name] = _from_model_order(model_sd[name], like, transform)
        if optim_sd is not None and name in optim_sd["state"]:
            loaded = optim_sd["state"][name]  # step and scalars as loaded; the moments reordered
            moments = _per_param_states(live["optim"], name, like)
            optim_sd["state"][name] = {**loaded, **{k: _from_model_order(loaded[k], v, transform)
                                                    for k, v in moments.items()}}
    return model_sd, optim_sd


def load_checkpoint(
    path: str | os.PathLike,
    *,
    model: nn.Module,
    optimizer: torch.optim.Optimizer | None = None,
) -> dict:
    """Load a :func:`save_checkpoint` directory into ``model`` (and ``optimizer``), in place.

    The model may be sharded over another (dp, tp) layout than the saved one, or not at all; DCP
    reads each rank's part by offset. As with ``Optimizer.load_state_dict``, the optimizer's
    hyperparameters (``lr``, ...) are the saved ones afterwards.

    Args:
        path: the checkpoint directory.
        model: the model, sharded as it will be trained, built from the same config and class.
        optimizer: its optimizer (empty is fine), or None to load the weights only.

    Returns:
        The ``extra`` dict that was saved.

    Raises:
        CheckpointError: the directory is missing, or its names or shapes do not fit the model.
    """
    path = Path(path)
    entries = _saved_entries(path)
    transforms = layout_transforms(model)
    state, live = _checkpoint_state(model, optimizer, transforms, empty=True)
    _check_fits(path, entries, state)
    with _single_process_ok():
        dcp.load(state, checkpoint_id=path, no_dist=not dist.is_initialized())
    model_sd, optim_sd = _in_stored_order(state, live, transforms)
    if optim_sd is None:
        set_model_state_dict(model, model_sd)
    else:
        set_state_dict(model, optimizer, model_state_dict=model_sd, optim_state_dict=optim_sd)
    extra_file = path / EXTRA_FILE
    return json.loads(extra_file.read_text()) if extra_file.is_file() else {}


def full_state_dict(model: nn.Module, *, all_ranks: bool = True) -> dict[str, torch.Tensor]:
    """Whole tensors under the model's own names and in its own row order, on the CPU.

    Every rank must call it: each DTensor is all-gathered, one at a time. Tied names each get
    their own copy, so the dict loads with ``load_state_dict(strict=True)`` and saves to
    safetensors.

    Args:
        model: a model sharded by autotp, or not sharded.
        all_ranks: every rank keeps the result; False: only rank 0 does (the others get ``{}``
            and never hold more than one whole tensor).

    Raises:
        CheckpointError: a reordered weight has no known inverse.
    """
    transforms = layout_transforms(model)
    keep = all_ranks or _rank() == 0
    full = {}
    for name, value in model.state_dict().items():
        value = value.full_tensor() if isinstance(value, DTensor) else value
        if not keep:
            continue
        name = _state_dict_name(name)
        if name in transforms:
            value = _call(transforms[name], value, inverse=True)
        full[name] = value.detach().to("cpu", copy=True).contiguous()
    return full


def export_safetensors(model: nn.Module, path: str | os.PathLike, *, save_config: bool = True) -> Path:
    """Write the whole model to ``path/model.safetensors`` (and ``config.json``), from rank 0.

    The directory loads with transformers' ``from_pretrained`` into an unsharded model, or its
    file with ``safetensors.torch.load_file`` + ``load_state_dict``. Every rank must call it.

    Args:
        path: the directory; created if needed.
        save_config: also write ``model.config`` (when the model has one) as ``config.json``.

    Returns:
        The path of the safetensors file (written on rank 0 only; others return the same path).
    """
    from safetensors.torch import save_file

    path = Path(path)
    tensors = full_state_dict(model, all_ranks=False)
    if _rank() == 0:
        path.mkdir(parents=True, exist_ok=True)
        save_file(tensors, str(path / SAFETENSORS_FILE), metadata={"format": "pt"})
        config = getattr(model, "config", None)
        if save_config and hasattr(config, "save_pretrained"):
            config.save_pretrained(path)
    _barrier()
    return path / SAFETENSORS_FILE
