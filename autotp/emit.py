"""Export a plan as code: an importable Python plan module, or transformers' ``tp_plan`` strings.

:func:`emit_python` writes a module like those in ``handwritten_plans/``: one function
``f(model, sequence_parallel=False)`` returning the plan dict. Layout options are written as
literals (``Shard(1)``, ``Replicate()``); options that are *sizes of the model* (the parts of a
fused projection, head counts, a rotary width) are written as expressions of the model the function
gets, so the same file fits the real model and ``autotp verify``'s tiny one. The text is executed
on the model before it is returned and must rebuild the plan exactly.

:func:`emit_hf` maps each style back to the transformers style string that autotp translates into
the same style (``autotp.hf_plans.STYLE_FACTORIES``), and names the styles that have none.

Long because it writes two formats (Python modules and transformers' strings) and each style's
options as model expressions; splitting would separate a style's two spellings.
"""

from __future__ import annotations

import inspect
import keyword
import re

from torch import nn
from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel.style import ParallelStyle
from torch.distributed.tensor.placement_types import Placement

from autotp import styles
from autotp.errors import PlanError
from autotp.hf_plans import STYLE_FACTORIES, as_styles
from autotp.plan import Plan, describe_plan, describe_style, matched_modules

# Options that hold a size of the model rather than a layout: written as expressions of the model.
# ``sizes`` are the parts of a fused output (a tuple); the others are one integer each.
SIZE_OPTIONS = frozenset({"sizes", "kv_heads", "head_dim", "heads", "width"})

# Constructor options stored under another form: option -> reader(style). torch's SequenceParallel
# keeps ``sequence_dim`` as ``sequence_sharding = (Shard(sequence_dim),)``; PrepareModuleInput keeps
# ``input_kwarg_layouts`` as ``{}`` when it was not given (``with_kwargs`` says which).
_READERS = {
    "sequence_dim": lambda s: s.sequence_sharding[0].dim if hasattr(s, "sequence_sharding") else s.sequence_dim,
    "input_kwarg_layouts": lambda s: s.input_kwarg_layouts if getattr(s, "with_kwargs", True) else None,
    "desired_input_kwarg_layouts": lambda s: s.desired_input_kwarg_layouts if getattr(s, "with_kwargs", True) else None,
}
# transformers' strings for an nn.Embedding (its EmbeddingParallel). Its Linear strings ("rowwise",
# "colwise", ...) read in_features / out_features, which an Embedding lacks: from_pretrained(tp_plan=)
# fails with "Embedding has no `in_features`: rowwise shards linear layers."
_EMBEDDING_STRINGS = ("embedding_rowwise", "embedding_colwise")
# PrepareModuleInputOutput keeps its options on two inner styles: option -> (inner, inner option).
_INNER = {
    "input_layouts": ("prepare_module_input", "input_layouts"),
    "desired_input_layouts": ("prepare_module_input", "desired_input_layouts"),
    "input_kwarg_layouts": ("prepare_module_input", "input_kwarg_layouts"),
    "desired_input_kwarg_layouts": ("prepare_module_input", "desired_input_kwarg_layouts"),
    "use_local_input": ("prepare_module_input", "use_local_output"),
    "output_layouts": ("prepare_module_output", "output_layouts"),
    "desired_output_layouts": ("prepare_module_output", "desired_output_layouts"),
    "use_local_output": ("prepare_module_output", "use_local_output"),
}


# --- reading a style's constructor options ---------------------------------------------------------


def _parameters(cls: type) -> list[inspect.Parameter]:
    """Keyword options of ``cls(...)``, following ``**kwargs`` into the parent's ``__init__``."""
    params: dict[str, inspect.Parameter] = {}
    for klass in cls.__mro__:
        if "__init__" not in vars(klass) or klass in (object, ParallelStyle):
            continue
        forwards = False
        for p in list(inspect.signature(klass.__init__).parameters.values())[1:]:
            if p.kind is p.VAR_KEYWORD:
                forwards = True
            elif p.kind is not p.VAR_POSITIONAL:
                params.setdefault(p.name, p)
        if not forwards:
            break
    return list(params.values())


def _read(style: ParallelStyle, name: str):
    """The value of constructor option ``name`` as ``style`` holds it; 1-tuples of placements are
    unwrapped (every style accepts the single placement and wraps it again)."""
    if hasattr(style, "prepare_module_input") and name in _INNER:
        inner, name = _INNER[name]
        return _read(getattr(style, inner), name)
    if name in _READERS:
        value = _READERS[name](style)
    elif hasattr(style, name):
        value = getattr(style, name)
    else:
        raise PlanError(f"{type(style).__name__}: option {name!r} is not readable from the style, so it "
                        "cannot be exported; keep the option as an attribute of the same name.")
    if isinstance(value, tuple) and len(value) == 1 and isinstance(value[0], Placement):
        return value[0]
    return value


def style_options(style: ParallelStyle) -> dict[str, object]:
    """The keyword options that rebuild ``style``, leaving out those at their default value.

    >>> from torch.distributed.tensor import Replicate
    >>> from torch.distributed.tensor.parallel import ColwiseParallel
    >>> style_options(ColwiseParallel(output_layouts=Replicate()))
    {'output_layouts': Replicate()}
    """
    params = _parameters(type(style))
    values = {p.name: _read(style, p.name) for p in params}
    required = {p.name: values[p.name] for p in params if p.default is p.empty}
    try:
        default = type(style)(**required)
    except Exception:  # a style that cannot be built from its required options alone: keep all
        return values
    return {n: v for n, v in values.items() if n in required or _differs(v, _read(default, n))}


def _differs(a, b) -> bool:
    return type(a) is not type(b) or a != b


# --- rendering values as Python ----------------------------------------------------------------


def render(value, names: set[str]) -> str:
    """Python source for an option value; class names it uses are added to ``names``.

    >>> names = set()
    >>> render((Shard(1), None), names), sorted(names)
    ('(Shard(1), None)', ['Shard'])
    """
    if isinstance(value, ParallelStyle):
        names.add(type(value).__name__)
        options = ", ".join(f"{k}={render(v, names)}" for k, v in style_options(value).items())
        return f"{type(value).__name__}({options})"
    if isinstance(value, Shard):
        names.add("Shard")
        return f"Shard({value.dim})"
    if isinstance(value, Replicate):
        names.add("Replicate")
        return "Replicate()"
    if isinstance(value, Partial):
        names.add("Partial")
        return "Partial()" if value.reduce_op == "sum" else f"Partial({value.reduce_op!r})"
    if isinstance(value, tuple):
        inner = ", ".join(render(v, names) for v in value)
        return f"({inner},)" if len(value) == 1 else f"({inner})"
    if isinstance(value, list):
        return "[" + ", ".join(render(v, names) for v in value) + "]"
    if isinstance(value, dict):
        return "{" + ", ".join(f"{k!r}: {render(v, names)}" for k, v in value.items()) + "}"
    if value is None or isinstance(value, (bool, int, float, str)):
        return repr(value)
    raise PlanError(f"cannot export option value {value!r} ({type(value).__name__}) as Python.")


# --- sizes as expressions of the model ------------------------------------------------------------


def _text_config(model: nn.Module):
    config = getattr(model, "config", None)
    return config.get_text_config() if hasattr(config, "get_text_config") else config


def size_expression(model: nn.Module, key: str, option: str, value) -> str | None:
    """An expression of ``model`` (and ``config``, its text config) equal to ``value``, or ``None``.

    ``sizes`` (the parts of a fused output) become the module's sharded width cut in the parts'
    ratio, which a shrunk config of the family keeps (head ratios, equal gate/up halves). An integer
    becomes the config attribute holding it, the one whose name is closest to ``option`` when
    several do, else ``hidden_size // num_attention_heads`` for a head size.
    """
    if option == "sizes" and isinstance(value, tuple):
        return _parts_expression(model, key, value)
    if not isinstance(value, int) or isinstance(value, bool):
        return None
    config = _text_config(model)
    if config is None:
        return None
    found = [n for n, v in config.to_dict().items() if v == value and type(v) is int and n.isidentifier()]
    if found:
        import difflib

        best = max(found, key=lambda n: (difflib.SequenceMatcher(None, option, n).ratio(), -len(n)))
        return f"config.{best}"
    heads = getattr(config, "num_attention_heads", None)
    if option == "head_dim" and heads and getattr(config, "hidden_size", 0) // heads == value:
        return "config.hidden_size // config.num_attention_heads"
    return None


def _parts_expression(model: nn.Module, key: str, sizes: tuple[int, ...]) -> str | None:
    """``_parts(model, key, ratio, dim)`` for sizes that sum to a dim of the matched module's weight."""
    hits = matched_modules(model, key)
    weight = getattr(model.get_submodule(hits[0]), "weight", None) if hits else None
    if weight is None:
        return None
    total = sum(sizes)
    dims = [d for d, n in enumerate(weight.shape) if n == total]
    if not dims:
        return None
    unit = _gcd(sizes)
    return f"_parts(model, {key!r}, {tuple(s // unit for s in sizes)}, dim={dims[0]})"


def _gcd(values) -> int:
    import math

    return math.gcd(*values)


# --- the Python module -------------------------------------------------------------------------

_HEADER = '''"""Tensor-parallel plan for {model_class}, exported by autotp ({origin}).

Sizes are computed from the model {function}() gets, so the same plan fits the real model and
`autotp verify`'s tiny one. Use it with `autotp check/verify MODEL --plan THIS_FILE.py:{function}`
or `autotp.parallelize(model, mesh, tp_shard_plan=plan_dict)`.
"""

from __future__ import annotations

'''

_HELPERS = '''

def _parts(model, key, ratio, dim=0):
    """The widths of a fused projection's parts: the matched module's weight dim ``dim`` cut in ``ratio``."""
    atoms = key.split(".")
    for name, module in model.named_modules():
        if len(name.split(".")) == len(atoms) and all(fnmatch(n, a) for n, a in zip(name.split("."), atoms)):
            width = module.weight.shape[dim]
            return tuple(width * part // sum(ratio) for part in ratio)
    raise KeyError(f"plan key {key!r} matches no module of {type(model).__name__}")
'''


def function_name(text: str) -> str:
    """A Python identifier for the plan function of model ``text``.

    >>> function_name("qwen3-moe"), function_name("configs/my_model/config.json")
    ('qwen3_moe_plan', 'config_plan')
    """
    stem = re.sub(r"\.json$", "", text.rstrip("/").rsplit("/", 1)[-1])
    name = re.sub(r"\W+", "_", stem).strip("_").lower() or "model"
    name = f"{name}_plan"
    return f"_{name}" if name[0].isdigit() or keyword.iskeyword(name) else name


def emit_python(model: nn.Module, plan: Plan, *, name: str = "plan", sequence_parallel: bool = False,
                origin: str = "") -> str:
    """The source of a Python module defining ``name(model, sequence_parallel=...)`` -> ``plan``.

    Args:
        model: the model the plan is for (meta is fine): sizes are read from it.
        plan: the plan to export.
        name: the function's name.
        sequence_parallel: which variant ``plan`` is; the function refuses the other one.
        origin: a note for the docstring (the command and the plan source).

    Returns:
        The module's text.

    Raises:
        PlanError: a style or option cannot be written as Python, or the text does not rebuild
            ``plan`` on ``model``.
    """
    plan = as_styles(model, plan)  # a plan of transformers' strings is written as its styles
    names: set[str] = set()
    uses_config = uses_parts = False
    lines = []
    for key, style in plan.items():
        expr, sized = _style_expression(model, key, style, names)
        uses_config |= "config." in sized
        uses_parts |= "_parts(" in sized
        lines.append(f"        {key!r}: {expr},")
    body = [
        f"def {name}(model, sequence_parallel={sequence_parallel}):",
        f'    """The {"sequence-parallel" if sequence_parallel else "plain"} tp plan of '
        f'{type(model).__name__}, keyed by module patterns."""',
        "    if sequence_parallel is not " + str(sequence_parallel) + ":",
        "        raise ValueError(",
        f'            "this file holds the {"sequence-parallel" if sequence_parallel else "plain"} '
        f'plan only; export the other with{"out" if sequence_parallel else ""} --sp"',
        "        )",
    ]
    if uses_config:
        body.append("    config = model.config.get_text_config() if hasattr(model.config, "
                    "'get_text_config') else model.config")
    body += ["    return {", *lines, "    }"]
    text = _HEADER.format(model_class=type(model).__name__, origin=origin or "autotp.emit", function=name)
    text += "\n".join(_imports(names, uses_parts)) + "\n\n\n" + "\n".join(body) + "\n"
    if uses_parts:
        text += _HELPERS
    _check_round_trip(model, plan, text, name, sequence_parallel)
    return text


def _style_expression(model: nn.Module, key: str, style: ParallelStyle, names: set[str]) -> tuple[str, str]:
    """``(expression, the size part of it)`` building ``style`` for plan key ``key``."""
    names.add(type(style).__name__)
    parts, comments, sized = [], [], []
    for option, value in style_options(style).items():
        expr = size_expression(model, key, option, value) if option in SIZE_OPTIONS else None
        parts.append(f"{option}={expr if expr is not None else render(value, names)}")
        comments.append(f"  # a fixed size: no size of {type(model).__name__} gives {value!r}"
                        if option in SIZE_OPTIONS and expr is None else "")
        sized.append(expr or "")
    if any(comments):  # a comment must end its line, after the argument's comma
        inner = "".join(f"\n            {p},{c}" for p, c in zip(parts, comments))
        return f"{type(style).__name__}({inner}\n        )", " ".join(sized)
    return f"{type(style).__name__}({', '.join(parts)})", " ".join(sized)


def _imports(names: set[str], uses_parts: bool) -> list[str]:
    """Import lines for the classes ``names``: placements, torch's styles, autotp's styles."""
    import torch.distributed.tensor.parallel as torch_styles

    placements = sorted(names & {"Shard", "Replicate", "Partial"})
    classes = names - set(placements)
    groups = {
        "torch.distributed.tensor.parallel": sorted(n for n in classes if hasattr(torch_styles, n)),
        "autotp.styles": sorted(n for n in classes if hasattr(styles, n) and not hasattr(torch_styles, n)),
    }
    unknown = classes - {n for g in groups.values() for n in g}
    if unknown:
        raise PlanError(f"cannot export styles {sorted(unknown)}: only torch's and autotp.styles' styles "
                        "can be imported by name.")
    lines = ["from fnmatch import fnmatch", ""] if uses_parts else []
    if placements:
        lines.append(f"from torch.distributed.tensor import {', '.join(placements)}")
    lines += [f"from {module} import {', '.join(group)}" for module, group in groups.items() if group]
    return lines


def _check_round_trip(model: nn.Module, plan: Plan, text: str, name: str, sequence_parallel: bool) -> None:
    """Run ``text`` on ``model``; its plan must describe equal to ``plan``, key by key."""
    namespace: dict = {"__name__": "autotp_emitted_plan"}
    exec(compile(text, f"<emitted plan {name}>", "exec"), namespace)  # noqa: S102: our own output
    rebuilt = namespace[name](model, sequence_parallel=sequence_parallel)
    want, got = describe_plan(plan), describe_plan(rebuilt)
    bad = [k for k in want if want[k] != got.get(k)]
    if bad or set(got) != set(want):
        key = (bad or sorted(set(got) ^ set(want)))[0]
        raise PlanError(f"{key}: the exported plan rebuilds {got.get(key)} instead of {want.get(key)}; "
                        "this style cannot be exported faithfully yet.")


# --- transformers' style strings ------------------------------------------------------------------


def emit_hf(model: nn.Module, plan: Plan) -> tuple[dict[str, str], dict[str, str]]:
    """``plan`` as transformers ``tp_plan`` strings, and the keys whose style has none.

    A style gets the string that autotp's own translation (``autotp.hf_plans.STYLE_FACTORIES``)
    turns back into an equal style on the same module, so the round trip is exact; an
    ``nn.Embedding`` gets only an ``embedding_*`` string, the one kind transformers applies to it.

    Keys of transformers' own plan that this plan does not name are added as ``"replicate"`` (see
    :func:`_overridden_defaults`): ``from_pretrained`` merges a plan into its own.

    Returns:
        ``(tp_plan, missing)``: ``{key: "colwise", ...}`` and ``{key: style repr}`` for styles no
        transformers string expresses (sequence-parallel norms that gather, packed parts of
        unequal sizes, kv replication, ...).
    """
    plan = as_styles(model, plan)
    config = _text_config(model)
    tp_plan, missing = {}, {}
    for key, style in plan.items():
        hits = matched_modules(model, key)
        module = model.get_submodule(hits[0]) if hits else None
        want = describe_style(style)
        found = None
        for string, factory in STYLE_FACTORIES.items():
            if (string in _EMBEDDING_STRINGS) != isinstance(module, nn.Embedding):
                continue
            try:
                candidate = factory(module, config)
            except Exception:  # a factory that does not apply to this module (needs a config field)
                continue
            if candidate is not None and describe_style(candidate) == want:
                found = string
                break
        if found is None:
            missing[key] = repr(style)
        else:
            tp_plan[key] = found
    return {**tp_plan, **_overridden_defaults(model, tp_plan)}, missing


def _overridden_defaults(model: nn.Module, tp_plan: dict[str, str]) -> dict[str, str]:
    """Keys of transformers' own plan for ``model`` that ``tp_plan`` does not name, set so that the
    plan loaded is ``tp_plan`` and nothing else.

    transformers 5.23 merges a ``tp_plan`` dict *into* the model's own plan (``DistributedConfig``:
    "a dictionary overrides individual rules"), and shards an ``embed_tokens`` the plan does not name:
    a module this plan leaves whole (a vocabulary tp does not divide, a style with no string) would be
    sharded by the default rule. Each such module key gets the string this plan gives the module under
    another pattern, else ``"replicate"`` (transformers' no-op style). Parameter-level keys (3-D
    experts) are kept: the experts module's own string reads them."""
    defaults = getattr(model, "tp_plan", None)
    if not isinstance(defaults, dict):
        return {}
    ours = {fqn: string for key, string in tp_plan.items() for fqn in matched_modules(model, key)}
    out = {}
    for key in defaults:
        if key in tp_plan:
            continue
        hits = matched_modules(model, key)
        if hits:
            out[key] = ours.get(hits[0], "replicate")
    return out
