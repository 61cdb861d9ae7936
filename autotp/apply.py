"""Apply a plan to a model: the one place where plans meet ``parallelize_module``.

Everything that can be checked before sharding is checked first: the mesh is 1-D, every plan key
matches a module, no two keys disagree on a module, and every size the plan splits is divisible by
the tp size. Tied parameters stay tied after sharding.

autotp's plans keep the logits vocabulary-sharded (loss parallel). Code that indexes them
(serving, evaluation, ``generate``) gets them whole on every rank from :func:`gathered_logits`; a
sharded model's ``generate`` always runs inside it, and ``loss_parallel=False`` makes it permanent.
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Mapping

from torch import nn
from torch.distributed.device_mesh import DeviceMesh
from torch.distributed.tensor import DTensor
from torch.distributed.tensor.parallel import parallelize_module
from torch.utils.hooks import RemovableHandle

from autotp.errors import MeshError, PlanError, working_tp_sizes
from autotp.hf_plans import as_styles
from autotp.kv import config_head_dim
from autotp.loss import install_vocab_parallel_loss
from autotp.plan import Plan, resolve, sharded_param_dims
from autotp.styles import ReplicatedKVColwise

# Config attributes whose value counts attention heads: a tp size must divide each, or heads are
# cut in half across ranks.
_HEAD_COUNTS = ("num_attention_heads", "num_key_value_heads", "n_head", "num_heads")


def _text_configs(model: nn.Module) -> list:
    config = getattr(model, "config", None)
    if config is None:
        return []
    subs = [getattr(config, name, None) for name in ("text_config", "language_config")]
    return [config, *[c for c in subs if c is not None]]


def validate_tp_mesh(model: nn.Module, tp_mesh: DeviceMesh, plan: Plan | None = None) -> None:
    """Check that ``tp_mesh`` fits ``model`` (and ``plan``, when given) before any sharding.

    Raises:
        MeshError: the mesh is not 1-D, a head count is not divisible by its size, or a parameter
            dimension the plan shards is not. The message names the module, the sizes, and the tp
            sizes that would work.
    """
    if tp_mesh.ndim != 1:
        raise MeshError(
            f"the tp mesh must be 1-D, got a {tp_mesh.ndim}-D mesh {tuple(tp_mesh.shape)} "
            f"(dims {tp_mesh.mesh_dim_names}); pass the tp sub-mesh, e.g. device_mesh['tp']."
        )
    tp = tp_mesh.size()
    check_divisible(model, tp, plan)


def check_divisible(model: nn.Module, tp: int, plan: Plan | None = None) -> None:
    """Raise :class:`MeshError` if ``tp`` does not divide a head count or a dimension ``plan`` shards.

    Head counts are checked when there is no plan, or when the plan shards a dimension as wide as
    some heads (q, k, v or o projections): a plan that keeps attention whole (a one-kv-head model
    whose synthesized plan shards only the MLP) does not need them to divide. ``plan`` may hold
    transformers' style strings.
    """
    plan = as_styles(model, plan) if plan is not None else None
    sharded = _sharded_sizes(model, plan) if plan is not None else None
    kv_replicated = plan is not None and any(isinstance(s, ReplicatedKVColwise) for s in plan.values())
    for config in _text_configs(model):
        counts = {a: getattr(config, a) for a in _HEAD_COUNTS if isinstance(getattr(config, a, None), int)}
        if sharded is not None and not _shards_heads(model, config, counts, sharded):
            continue
        bad = {a: n for a, n in counts.items() if n % tp}
        if kv_replicated:  # kv heads may be fewer than tp; each is repeated over tp / kv ranks
            bad = {a: n for a, n in bad.items() if not (a == "num_key_value_heads" and tp % n == 0)}
        if bad:
            attr, n = next(iter(bad.items()))
            hint = ""
            if attr == "num_key_value_heads" and tp % n == 0:
                hint = " or replicate kv heads across ranks (autotp.kv.replicate_kv_heads / synthesize(tp_size=...))"
            sizes = working_tp_sizes(list(counts.values()))
            raise MeshError(module=type(model).__name__, found=f"{attr}={n} cannot be split over tp={tp}",
                            required=f"config {type(config).__name__}: {counts}",
                            fix=f"use tp in {sizes}{hint}.", tp_sizes=sizes)
    for where, size in (sharded or {}).items():
        if size % tp:
            module, _, found = where.partition(": ")
            raise MeshError(module=module, found=f"{found} of size {size}, which tp={tp} does not divide",
                            fix=f"use tp in {working_tp_sizes([size])}.", tp_sizes=working_tp_sizes([size]))


def _sharded_sizes(model: nn.Module, plan: Plan) -> dict[str, int]:
    """``"fqn.param: Style (plan key ...) shards dim d"`` -> size, for every dimension ``plan`` shards."""
    modules = dict(model.named_modules())
    sizes = {}
    for fqn, (key, style) in resolve(model, plan).items():
        module = modules[fqn]
        for pname, dim in sharded_param_dims(module, style).items():
            where = f"{fqn}.{pname}: {type(style).__name__} (plan key {key!r}) shards dim {dim}"
            sizes[where] = module.get_parameter(pname).shape[dim]
    return sizes


def _shards_heads(model: nn.Module, config, counts: dict[str, int], sharded: dict[str, int]) -> bool:
    """Whether a sharded size is a whole number of heads of ``config`` (head sizes from the config
    and from the modules' own ``head_dim``)."""
    head_dims = {config_head_dim(config)} | {
        m.head_dim for m in model.modules() if isinstance(getattr(m, "head_dim", None), int)}
    widths = {n * d for n in counts.values() for d in head_dims if d}
    return bool(widths & set(sharded.values()))


def _tied_groups(model: nn.Module) -> list[list[tuple[str, str]]]:
    """Groups of ``(module fqn, param name)`` that share one Parameter object."""
    owners: dict[int, list[tuple[str, str]]] = {}
    for fqn, module in model.named_modules():
        for pname, param in module.named_parameters(recurse=False):
            owners.setdefault(id(param), []).append((fqn, pname))
    return [group for group in owners.values() if len(group) > 1]


def _retie(model: nn.Module, groups: list[list[tuple[str, str]]]) -> None:
    """Make each group share one Parameter again after ``parallelize_module`` replaced some."""
    for group in groups:
        params = [model.get_submodule(fqn).get_parameter(p) for fqn, p in group]
        layouts = {getattr(p, "placements", None) for p in params}
        if len(layouts) > 1:
            names = [f"{fqn}.{p}" if fqn else p for fqn, p in group]
            raise PlanError(
                f"tied parameters {names} were sharded differently ({sorted(map(str, layouts))}); "
                "give their modules styles that place the shared weight the same way "
                "(vocab-parallel embedding + colwise head both shard the vocabulary), or shard neither."
            )
        # Prefer the one that was sharded, so a replicated leftover does not win.
        keep = next((p for p in params if hasattr(p, "placements")), params[0])
        for fqn, pname in group:
            setattr(model.get_submodule(fqn), pname, keep)


def apply_plan(model: nn.Module, tp_mesh: DeviceMesh, plan: Plan, *, loss_parallel: bool = True) -> nn.Module:
    """Validate ``plan`` against ``model`` and ``tp_mesh``, shard ``model`` in place, and return it.

    A transformers causal LM also gets :func:`autotp.loss.install_vocab_parallel_loss`, so that
    ``model(input_ids=..., labels=...).loss`` works on the vocabulary-sharded logits, and a
    ``generate`` that gathers the logits it samples from (:func:`gathered_logits`).

    Keyword Args:
        loss_parallel: leave the logits as the plan makes them (a vocabulary-sharded DTensor for
            autotp's plans). False: every forward returns them whole on every rank, as a plain tensor.

    ``plan`` may hold transformers' style strings (``"colwise"``): they are translated first
    (:func:`autotp.hf_plans.as_styles`).
    """
    plan = as_styles(model, plan)
    validate_tp_mesh(model, tp_mesh, plan)
    groups = _tied_groups(model)
    check_tied_styles(model, plan, groups)
    parallelize_module(model, tp_mesh, plan)
    _retie(model, groups)
    _keep_layouts(model)  # FSDP2 drops parameter attributes; autotp.checkpoint reads these
    # Plans leave the logits vocab-sharded; let transformers' own labels= loss read them so.
    install_vocab_parallel_loss(model)
    if not loss_parallel:
        gather_logits(model)
    elif callable(getattr(type(model), "generate", None)):
        model.generate = _GatheringGenerate(model)
    return model


def _gather_logits_hook(module: nn.Module, args, output):
    """Forward hook: the output's ``logits`` (a transformers ``ModelOutput``) or the output itself
    (a model that returns its logits), all-gathered into a plain tensor if it is a DTensor.
    ``full_tensor`` is differentiable, so training on the gathered logits still works."""
    if isinstance(output, Mapping):
        if isinstance(output.get("logits"), DTensor):
            output["logits"] = output["logits"].full_tensor()
        return output
    return output.full_tensor() if isinstance(output, DTensor) else output


def gather_logits(model: nn.Module) -> RemovableHandle:
    """Make every forward of ``model`` return its logits whole on every rank, as a plain tensor.

    What ``loss_parallel=False`` installs; ``handle.remove()`` returns to sharded logits. Register
    it after ``fully_shard`` on an FSDP2 model, so that FSDP2's own output hook sees the head's
    DTensor, not the gathered view (it warns that an in-place op on a view skips its backward).
    """
    return model.register_forward_hook(_gather_logits_hook)


@contextlib.contextmanager
def gathered_logits(model: nn.Module) -> Iterator[nn.Module]:
    """Within the block, ``model``'s forward returns its logits whole on every rank (a plain tensor).

    For code that indexes or samples from the logits of a loss-parallel model (each rank holds
    ``vocab / tp`` columns of a ``Shard(-1)`` DTensor): evaluation, serving, ``generate``. The
    vocabulary is all-gathered once per forward, so every rank holds ``[batch, seq, vocab]``; the
    ``labels=`` loss inside the forward is still computed on the sharded logits.

    Example::

        with gathered_logits(model):  # model sharded by autotp.parallelize
            next_ids = model(input_ids=ids).logits[:, -1].argmax(-1)
    """
    handle = gather_logits(model)
    try:
        yield model
    finally:
        handle.remove()


class _GatheringGenerate:
    """The model's own ``generate``, run inside :func:`gathered_logits`.

    transformers' decoding mixes the logits with plain tensors (``next_tokens *
    unfinished_sequences``), which a DTensor refuses. ``generate`` asks the forward for the last
    position's logits only (``logits_to_keep=1``), so gathering them costs ``[batch, 1, vocab]``
    per step. Every rank then samples from the same logits: with the same seed on every rank they
    pick the same tokens. Stored on the instance as an object holding the model, not a closure, so
    ``copy.deepcopy`` and pickling give the copy a ``generate`` of its own.
    """

    def __init__(self, model: nn.Module) -> None:
        self.model = model

    def __call__(self, *args, **kwargs):
        with gathered_logits(self.model):
            return type(self.model).generate(self.model, *args, **kwargs)


def _keep_layouts(model: nn.Module) -> None:
    """Copy each parameter's ``_autotp_to_layout`` onto its module as ``_autotp_layouts[name]``.

    FSDP2 replaces parameters with new objects and drops their attributes; modules survive it, so
    :mod:`autotp.checkpoint` can still map reordered or repeated rows back to the model's own order.
    """
    for module in model.modules():
        for pname, param in module.named_parameters(recurse=False):
            if (to_layout := getattr(param, "_autotp_to_layout", None)) is not None:
                module.__dict__.setdefault("_autotp_layouts", {})[pname] = to_layout


def check_tied_styles(model: nn.Module, plan: Plan, groups=None) -> None:
    """Refuse, before sharding, a plan that shards one copy of a tied weight and not the other.

    Raises:
        PlanError: naming the tied parameters and the dims each copy would be sharded on.
    """
    groups = _tied_groups(model) if groups is None else groups
    resolved = resolve(model, plan)
    modules = dict(model.named_modules())
    for group in groups:
        dims = []
        for fqn, pname in group:
            style = resolved.get(fqn, (None, None))[1]
            dims.append(sharded_param_dims(modules[fqn], style).get(pname) if style else None)
        if len(set(dims)) > 1:
            names = [f"{fqn}.{p}" for fqn, p in group]
            raise PlanError(
                module=names[0], found=f"tied parameters {names} would be sharded on dims {dims} (None = replicated)",
                fix="a tied weight must be placed the same way everywhere: shard both (vocab-parallel "
                "embedding + colwise head) or neither.")
