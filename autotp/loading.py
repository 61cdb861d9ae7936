"""Load a saved checkpoint straight into autotp's plan, each rank reading only its own shards.

transformers' ``from_pretrained(dir, tp_plan=...)`` takes a plan of style strings, and only the styles
transformers has a string for (``autotp plan MODEL --emit hf`` writes those, and names the keys it
leaves out). For any autotp plan (packed parts, kv heads fewer than tp, per-head norms,
sequence-parallel norms, ...) :func:`from_pretrained` does what ``from_pretrained`` would:

1. the config is read and the model built with its parameters on the meta device (no memory, no
   random init; buffers such as rotary tables are computed as usual);
2. :func:`autotp.parallelize` chooses and applies the plan on that model (shapes only);
3. :func:`load_sharded_safetensors` fills each sharded parameter with the rows this rank holds, read
   from the ``*.safetensors`` files one tensor at a time: a plain shard is read as a slice of the
   file (memory-mapped, the rest never read), a reordered one (packed parts, repeated kv heads) as
   the whole tensor, mapped to the style's order, then sliced.

No rank ever holds the whole model; the largest transient is one whole tensor, and only for the
styles that reorder rows. :func:`load_sharded_safetensors` also loads into a model a user built and
sharded on the meta device themselves.

Checkpoints whose tensor names are not the model's own (transformers' weight conversions, e.g.
MoE experts stored one per file entry) are refused with the names missing.
"""

from __future__ import annotations

import contextlib
import json
import os
from collections.abc import Iterator
from pathlib import Path

import torch
from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor

from autotp.checkpoint import _call, layout_transforms
from autotp.errors import AutoTPError
from autotp.facade import parallelize

__all__ = ["from_pretrained", "load_sharded_safetensors", "empty_model"]


class LoadingError(AutoTPError):
    """A checkpoint directory is missing, or does not hold the tensors the model needs."""


@contextlib.contextmanager
def _parameters_on_meta() -> Iterator[None]:
    """Put every parameter registered inside on the meta device; buffers stay where they are made
    (a rotary table computed in ``__init__`` keeps its values, as the checkpoint does not hold it).
    What accelerate's ``init_empty_weights(include_buffers=False)`` does, without the dependency."""
    original = nn.Module.register_parameter

    def register(module: nn.Module, name: str, param: nn.Parameter | None) -> None:
        original(module, name, param)
        if param is not None and not param.is_meta:
            moved = nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
            moved.__dict__.update(param.__dict__)
            module._parameters[name] = moved

    nn.Module.register_parameter = register
    try:
        yield
    finally:
        nn.Module.register_parameter = original


def _local_dir(name_or_dir: str | os.PathLike) -> Path:
    """A local checkpoint directory, or a Hub repository downloaded (configs and safetensors only)."""
    path = Path(name_or_dir)
    if path.is_dir():
        return path
    if path.exists() or str(name_or_dir).startswith((".", "/")):
        raise LoadingError(f"{name_or_dir}: not a directory; give the folder that holds config.json and "
                           "the *.safetensors files (what save_pretrained writes).")
    from huggingface_hub import snapshot_download

    return Path(snapshot_download(str(name_or_dir), allow_patterns=["*.json", "*.safetensors"]))


def empty_model(config, *, dtype: torch.dtype | None = None) -> nn.Module:
    """The causal LM of ``config`` with its parameters on the meta device, in eval mode.

    ``dtype``: default the config's ``dtype`` when it names one, else float32.
    """
    from transformers import AutoModelForCausalLM

    dtype = dtype or _config_dtype(config)
    with _parameters_on_meta():
        model = AutoModelForCausalLM.from_config(config, dtype=dtype)
    return model.eval()


def _config_dtype(config) -> torch.dtype:
    """The dtype the config was saved in (a ``torch.dtype`` or its name), else float32."""
    value = getattr(config, "dtype", None) or getattr(config, "torch_dtype", None)
    if isinstance(value, str):
        value = getattr(torch, value, None)
    return value if isinstance(value, torch.dtype) else torch.float32


def _tensor_files(directory: Path) -> dict[str, Path]:
    """Tensor name -> the safetensors file holding it (a sharded checkpoint's index, or every file)."""
    index = directory / "model.safetensors.index.json"
    if index.is_file():
        weight_map = json.loads(index.read_text())["weight_map"]
        return {name: directory / file for name, file in weight_map.items()}
    files = sorted(directory.glob("*.safetensors"))
    if not files:
        raise LoadingError(f"{directory}: no *.safetensors file; save the model with save_pretrained "
                           "(safe_serialization, the default) or autotp.checkpoint.export_safetensors.")
    from safetensors import safe_open

    names = {}
    for file in files:
        with safe_open(str(file), framework="pt") as handle:
            names.update({name: file for name in handle.keys()})
    return names


def _local_index(param: DTensor) -> tuple[slice, ...]:
    """The slice of the whole (stored-order) tensor that this rank holds of ``param``."""
    from torch.distributed.tensor._utils import compute_local_shape_and_global_offset

    shape, offset = compute_local_shape_and_global_offset(param.shape, param.device_mesh, param.placements)
    return tuple(slice(start, start + size) for start, size in zip(offset, shape))


def load_sharded_safetensors(model: nn.Module, directory: str | os.PathLike, *,
                             device: torch.device | str | None = None) -> nn.Module:
    """Fill ``model``'s parameters on the meta device (whole, or sharded by autotp) from the
    ``*.safetensors`` files in ``directory``, each rank reading only what it holds.

    Every rank calls it (no collective runs: each reads the files itself). Tied parameters are
    loaded once, under whichever of their names the file has. Non-persistent buffers are left as
    they are; a persistent buffer on meta is read like a parameter.

    Args:
        model: the model, its parameters on meta (see :func:`empty_model`), sharded or not.
        directory: a folder of ``*.safetensors`` files (and ``model.safetensors.index.json``).
        device: where the parameters go; default the tp mesh's device (``cuda`` on the current
            device), else the CPU.

    Returns:
        ``model``, loaded in place.

    Raises:
        LoadingError: a tensor the model needs is not in the files, or has another shape.
    """
    from safetensors import safe_open

    directory = Path(directory)
    files = _tensor_files(directory)
    transforms = layout_transforms(model)
    device = torch.device(device) if device is not None else _default_device(model)
    owners: dict[int, list[tuple[nn.Module, str, str]]] = {}
    for fqn, module in model.named_modules(remove_duplicate=False):
        for name, value in [*module._parameters.items(), *module._buffers.items()]:
            if value is None or not value.is_meta:
                continue
            full = f"{fqn}.{name}" if fqn else name
            if name in module._buffers and name in module._non_persistent_buffers_set:
                raise LoadingError(f"{full}: a buffer no checkpoint holds (computed in __init__) is on the meta "
                                   "device; build the model with autotp.loading.empty_model, which puts only "
                                   "the parameters there.")
            owners.setdefault(id(value), []).append((module, name, full))
    missing = [entries[0][2] for entries in owners.values() if not any(full in files for *_, full in entries)]
    if missing:
        raise LoadingError(f"{directory}: {len(missing)} tensor(s) the model needs are not in its safetensors "
                           f"files, e.g. {missing[:3]}; the checkpoint was saved under other names (a "
                           "transformers weight conversion) or for another model. Load it with "
                           "from_pretrained and pass the model to autotp.parallelize instead.")
    handles: dict[Path, object] = {}
    with contextlib.ExitStack() as stack:
        for entries in owners.values():
            module, name, _ = entries[0]
            value = module._parameters[name] if name in module._parameters else module._buffers[name]
            stored = next(full for *_, full in entries if full in files)
            file = files[stored]
            if file not in handles:
                handles[file] = stack.enter_context(safe_open(str(file), framework="pt", device="cpu"))
            loaded = _read(handles[file], stored, value, transforms.get(stored) or next(
                (transforms[full] for *_, full in entries if full in transforms), None), _call)
            loaded = _materialised(value, loaded.to(device=device, dtype=value.dtype))
            for owner, owner_name, _ in entries:
                if owner_name in owner._parameters:
                    owner._parameters[owner_name] = loaded
                else:
                    owner._buffers[owner_name] = loaded
    return model


def _read(handle, name: str, value: torch.Tensor, transform, call) -> torch.Tensor:
    """This rank's part of tensor ``name``: a slice of the file for a plain shard, the whole
    tensor mapped to the style's row order (``transform``) and then sliced for a reordered one."""
    shape = tuple(handle.get_slice(name).get_shape())
    want = tuple(value.shape)
    if transform is not None:
        whole = call(transform, handle.get_tensor(name), inverse=False)
    else:
        whole = None
        if shape != want:
            raise LoadingError(f"{name}: the file holds shape {shape}, the model {want}; a checkpoint of "
                               "another config, or of another model.")
    if not isinstance(value, DTensor):
        return handle.get_tensor(name) if whole is None else whole
    index = _local_index(value)
    if whole is None:
        return handle.get_slice(name)[index] if index else handle.get_tensor(name)
    if tuple(whole.shape) != want:
        raise LoadingError(f"{name}: the file holds shape {shape}, which the plan's layout maps to "
                           f"{tuple(whole.shape)}, not the model's {want}.")
    return whole[index].contiguous()


def _materialised(value: torch.Tensor, local: torch.Tensor) -> torch.Tensor:
    """A parameter (or buffer) like ``value``, holding ``local``: a DTensor keeps its mesh,
    placements and global shape; attributes the styles set (``_autotp_to_layout``) are kept."""
    if isinstance(value, DTensor):
        local = DTensor.from_local(local, value.device_mesh, value.placements, run_check=False,
                                   shape=value.shape, stride=value.stride())
    if not isinstance(value, nn.Parameter):
        return local
    new = nn.Parameter(local, requires_grad=value.requires_grad)
    new.__dict__.update(value.__dict__)
    return new


def _default_device(model: nn.Module) -> torch.device:
    for value in model.parameters():
        if isinstance(value, DTensor):
            kind = value.device_mesh.device_type
            if kind == "cuda":
                return torch.device("cuda", torch.cuda.current_device())
            return torch.device(kind)
    return torch.device("cpu")


def from_pretrained(name_or_dir: str | os.PathLike, tp_mesh: DeviceMesh, *, sequence_parallel: bool = False,
                    tp_shard_plan=None, loss_parallel: bool = True, verify_synthesized: bool = True,
                    dtype: torch.dtype | None = None, device: torch.device | str | None = None) -> nn.Module:
    """A causal LM from a saved checkpoint, sharded over ``tp_mesh`` with autotp's plan, each rank
    reading only its own shards (no rank builds or loads the whole model).

    Every rank calls it (under ``torchrun``). The options are :func:`autotp.parallelize`'s; a plan
    of transformers' strings is accepted too.

    Args:
        name_or_dir: a folder with ``config.json`` and ``*.safetensors`` (what ``save_pretrained``
            or :func:`autotp.checkpoint.export_safetensors` writes), or a Hub repository name.
        tp_mesh: a 1-D device mesh.
        dtype: the parameters' dtype; default the config's, else float32.
        device: where the shards go; default the mesh's device.

    Returns:
        The sharded model, in eval mode (``model.train()`` for training).

    Raises:
        LoadingError: no such folder, or its files lack a tensor the model needs.

    Example (``torchrun --nproc-per-node 2 script.py``)::

        mesh = init_device_mesh("cuda", (2,), mesh_dim_names=("tp",))
        model = autotp.from_pretrained("path/to/checkpoint", mesh)
    """
    from transformers import AutoConfig

    directory = _local_dir(name_or_dir)
    if not (directory / "config.json").is_file():
        raise LoadingError(f"{directory}: no config.json; give the folder save_pretrained wrote.")
    model = empty_model(AutoConfig.from_pretrained(directory), dtype=dtype)
    parallelize(model, tp_mesh, sequence_parallel=sequence_parallel, tp_shard_plan=tp_shard_plan,
                loss_parallel=loss_parallel, verify_synthesized=verify_synthesized)
    return load_sharded_safetensors(model, directory, device=device)
