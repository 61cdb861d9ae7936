"""Translate the plans transformers ships (style strings) into torch ``ParallelStyle`` objects.

transformers keeps ``base_model_tp_plan`` on the config (keys relative to the base model) and
``_tp_plan`` on the class (keys relative to the model), with style strings such as ``"colwise"`` or
``"packed_colwise"``. Some keys name a parameter rather than a module (the 3-D expert weights); they
are folded into their module's style. Every string transformers 5.23 uses is covered; an unknown one
is a :class:`PlanError` naming the key and the string.
"""

from __future__ import annotations

from collections.abc import Callable

from torch import nn
from torch.distributed.tensor import Replicate
from torch.distributed.tensor.parallel import ColwiseParallel, ParallelStyle, RowwiseParallel, SequenceParallel

from autotp import styles
from autotp.errors import PlanError
from autotp.plan import Plan, key_matches


def _packed_colwise(module: nn.Module, config) -> ParallelStyle | None:
    if isinstance(module, nn.Linear):
        half = module.out_features // 2
        return styles.Colwise(sizes=(half, half))
    return None  # a 3-D expert parameter: folded into ExpertsParallel on its owner


def _embedding_colwise(module: nn.Module, config) -> ParallelStyle:
    # Hidden-dim sharded table; the output is gathered so the residual stream stays replicated.
    return ColwiseParallel(input_layouts=Replicate(), output_layouts=Replicate())


def _mla_kv_a_proj(module: nn.Module, config) -> ParallelStyle:
    width = getattr(config, "qk_rope_head_dim", None)
    if width is None:
        raise PlanError(
            f"{type(module).__name__}: style 'mla_kv_a_proj' needs the rotary width "
            "(config.qk_rope_head_dim); the model's config has none. Use autotp.synthesize instead."
        )
    features = getattr(module, "out_features", None)  # the rotary part is the last ``width`` of them
    if features is None:
        raise PlanError(f"{type(module).__name__}: style 'mla_kv_a_proj' expects a Linear (out_features); "
                        "use autotp.synthesize instead.")
    return styles.Boundary(reduce_grad_features=((features - width, features),))


# style string -> factory(module, text config) -> ParallelStyle, or None for "leave replicated".
STYLE_FACTORIES: dict[str, Callable[[nn.Module], ParallelStyle | None]] = {
    "colwise": lambda m, c: ColwiseParallel(),
    # "rowwise" on an Embedding is read as vocab-parallel; transformers 5.23 itself accepts only
    # "embedding_rowwise" there, which is what ``autotp plan --emit hf`` writes.
    "rowwise": lambda m, c: (
        styles.VocabParallelEmbedding(input_layouts=Replicate()) if isinstance(m, nn.Embedding) else RowwiseParallel()
    ),
    "colwise_gather_output": lambda m, c: ColwiseParallel(output_layouts=Replicate()),
    "colwise_rep": lambda m, c: ColwiseParallel(output_layouts=Replicate()),
    "rowwise_split_input": lambda m, c: RowwiseParallel(input_layouts=Replicate()),
    "rowwise_rep": lambda m, c: RowwiseParallel(input_layouts=Replicate()),
    "embedding_rowwise": lambda m, c: styles.VocabParallelEmbedding(input_layouts=Replicate()),
    "embedding_colwise": _embedding_colwise,
    "packed_colwise": _packed_colwise,
    "packed_rowwise": lambda m, c: None,  # a 3-D expert parameter: folded into ExpertsParallel
    "sequence_parallel": lambda m, c: SequenceParallel(use_local_output=True),
    "replicated_with_grad_allreduce": lambda m, c: styles.ReplicatedWithGradAllReduce(),
    "mla_kv_a_proj": _mla_kv_a_proj,
    "all_reduce": lambda m, c: styles.Boundary(outputs="sum"),
    "moe_tp_experts": lambda m, c: styles.ExpertsParallel(),
    # transformers pre-divides an identity expert's input by tp to cancel the all-reduce of the experts'
    # sum; autotp's ExpertsParallel reduces only the experts' own output, so none is needed.
    "moe_identity_expert": lambda m, c: None,
    "local_params": lambda m, c: None,
    "replicate": lambda m, c: None,
}


def raw_hf_plan(model: nn.Module) -> dict[str, str]:
    """The style-string plan transformers would use for ``model``, keys relative to ``model``.

    ``base_model_tp_plan`` comes from the (text) config and is prefixed with the path of the module
    whose config it is; the class ``_tp_plan`` adds the head.
    """
    plan: dict[str, str] = {}
    for fqn, module in model.named_modules():
        config = getattr(module, "config", None)
        base = getattr(config, "base_model_tp_plan", None) if hasattr(module, "base_model_prefix") else None
        if not base or not _is_decoder_root(module):
            continue
        prefix = f"{fqn}." if fqn else ""
        for key, style in base.items():
            plan.setdefault(prefix + key, style)
    plan.update(getattr(type(model), "_tp_plan", None) or {})
    return plan


def _is_decoder_root(module: nn.Module) -> bool:
    """Whether ``module`` directly owns a ``layers`` ModuleList (the base model a plan is relative to)."""
    return isinstance(getattr(module, "layers", None), nn.ModuleList)


def translate(model: nn.Module, hf_plan: dict[str, str], *, dropped: list[str] | None = None) -> Plan:
    """Turn a style-string plan into torch styles for ``model``.

    transformers plans are written for a whole family, so some keys match nothing in a given config
    (dense-MLP keys of an all-MoE model, ``q_proj`` of an MLA model with a q LoRA): those are left out
    and, when ``dropped`` is given, appended to it.

    Raises:
        PlanError: a style string is unknown.
    """
    modules = dict(model.named_modules())
    config = model.config.get_text_config() if hasattr(getattr(model, "config", None), "get_text_config") else None
    plan: Plan = {}
    for key, name in hf_plan.items():
        factory = STYLE_FACTORIES.get(name)
        if factory is None:
            raise PlanError(
                f"transformers plan key {key!r} has style {name!r}, which autotp cannot translate; "
                f"known styles: {sorted(STYLE_FACTORIES)}. Pass tp_shard_plan= or use autotp.synthesize."
            )
        hits = [fqn for fqn in modules if fqn and key_matches(key, fqn)]
        if not hits:
            if not _matches_parameter(model, key) and dropped is not None:
                dropped.append(key)
            continue  # a parameter-level key (3-D experts) is carried by its module's key
        style = factory(modules[hits[0]], config)
        if style is not None:
            plan[key] = style
    return plan


def as_styles(model: nn.Module, plan) -> Plan:
    """``plan`` with each transformers style string (``"colwise"``) replaced by its ``ParallelStyle``.

    Every entry point that takes a plan (:func:`autotp.get_plan`, :func:`autotp.check_plan`,
    :func:`autotp.verify`, ``--plan FILE.py:NAME``) passes it through here, so a plan written for
    ``from_pretrained(tp_plan=...)`` works wherever a plan of styles does. A plan of styles is returned
    as it is (the same object); a plan may mix both. A string key that matches nothing in ``model`` is
    kept, translated as for a Linear, so that it is reported as any unmatched key is.

    Raises:
        PlanError: the plan is not a dict, or a value is neither a ``ParallelStyle`` nor a string
            transformers uses.

    >>> from torch import nn
    >>> model = nn.Sequential(nn.Linear(4, 8), nn.Linear(8, 4))
    >>> {k: type(v).__name__ for k, v in as_styles(model, {"0": "colwise", "1": "rowwise"}).items()}
    {'0': 'ColwiseParallel', '1': 'RowwiseParallel'}
    """
    if not isinstance(plan, dict):
        raise PlanError(f"a plan is a dict of plan keys to styles, got a {type(plan).__name__}.")
    for key, style in plan.items():
        if isinstance(style, str) and style not in STYLE_FACTORIES:
            raise PlanError(f"plan key {key!r}: {style!r} is not a transformers style string; use one of "
                            f"{', '.join(STYLE_FACTORIES)}, or a ParallelStyle.")
        if not isinstance(style, (str, ParallelStyle)):
            raise PlanError(
                f"plan key {key!r}: {type(style).__name__} {style!r:.60} is neither a ParallelStyle nor a "
                f"transformers style string such as 'colwise'."
            )
    strings = {key: style for key, style in plan.items() if isinstance(style, str)}
    if not strings:
        return plan
    dropped: list[str] = []
    translated = translate(model, strings, dropped=dropped)
    for key in dropped:  # built with no module: a module-specific string would fail on None
        try:
            style = STYLE_FACTORIES[strings[key]](None, None)
        except Exception:
            style = None
        if style is not None:
            translated[key] = style
    return {key: translated[key] if key in strings else style for key, style in plan.items()
            if key not in strings or key in translated}


def _matches_parameter(model: nn.Module, key: str) -> bool:
    return any(key_matches(key, name) for name, _ in model.named_parameters())


def hf_plan(model: nn.Module) -> Plan | None:
    """transformers' own plan for ``model``, translated; ``None`` if it ships none."""
    raw = raw_hf_plan(model)
    return translate(model, raw) if raw else None
