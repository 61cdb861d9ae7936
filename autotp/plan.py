"""A plan is data: ``dict[str, ParallelStyle]`` keyed by fnmatch patterns over module FQNs.

This module holds the small functions every other part uses to read plans: which modules a key
matches (with the same rule as ``parallelize_module``), a plain-data description of a style (for
tables, JSON and plan comparison), and the per-module difference of two plans.
"""

from __future__ import annotations

import difflib
import functools
import re

from torch import nn
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle

from autotp.errors import PlanError

Plan = dict[str, ParallelStyle]

# Options a style mutates when applied (RowwiseParallel sets desired_input_layouts in _apply;
# parallelize_module sets src_data_rank on every style), or that carry no layout meaning: left out
# of descriptions so that a plan compares equal before and after use.
_VOLATILE_OPTIONS = frozenset({"desired_input_layouts", "src_data_rank"})


def key_matches(key: str, fqn: str) -> bool:
    """Whether plan key ``key`` selects module ``fqn``, as ``parallelize_module`` decides it.

    ``parallelize_module`` splits the key on dots and fnmatches atom by atom, so ``*`` never
    crosses a dot.

    >>> key_matches("model.layers.*.mlp.up_proj", "model.layers.3.mlp.up_proj")
    True
    >>> key_matches("model.*.up_proj", "model.layers.3.mlp.up_proj")
    False
    """
    return _key_pattern(key).fullmatch(fqn) is not None


@functools.lru_cache(maxsize=4096)
def _key_pattern(key: str) -> re.Pattern:
    """``key`` as one regular expression over a whole FQN: its atoms fnmatch patterns (``*`` and
    ``?`` stay inside an atom, ``[...]`` is a class of one character), joined by literal dots."""
    atoms = []
    for atom in key.split("."):
        out, i = [], 0
        while i < len(atom):
            c = atom[i]
            end = atom.find("]", i + 2) if c == "[" else -1
            if c == "*":
                out.append("[^.]*")
            elif c == "?":
                out.append("[^.]")
            elif end > 0:  # fnmatch's class: [!...] negates, the rest is literal
                body = atom[i + 1:end]
                negate = body.startswith("!")
                body = re.escape(body[1:] if negate else body).replace("\\-", "-")
                out.append(f"[^.{body}]" if negate else f"(?!\\.)[{body}]")
                i = end
            else:
                out.append(re.escape(c))
            i += 1
        atoms.append("".join(out))
    return re.compile("\\.".join(atoms), re.DOTALL)


def matched_modules(model: nn.Module, key: str) -> list[str]:
    """FQNs of the modules of ``model`` that plan key ``key`` selects."""
    return [name for name, _ in model.named_modules() if name and key_matches(key, name)]


def resolve(model: nn.Module, plan: Plan) -> dict[str, tuple[str, ParallelStyle]]:
    """Map each module FQN the plan touches to ``(key, style)``.

    Raises:
        PlanError: a key matches no module of ``model`` (``parallelize_module`` only warns there,
            which leaves the module replicated and the plan silently weaker than written), or two
            keys give one module different styles.
    """
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, tuple[str, ParallelStyle]] = {}
    for key, style in plan.items():
        hits = [name for name in names if key_matches(key, name)]
        if not hits:
            raise PlanError(
                f"plan key {key!r} ({type(style).__name__}) matches no module of "
                f"{type(model).__name__}; close names: {_close_names(key, names)}. "
                "Fix the key or drop it from the plan."
            )
        for name in hits:
            if name in resolved and describe_style(resolved[name][1]) != describe_style(style):
                other_key, other = resolved[name]
                raise PlanError(
                    f"{name}: matched by plan keys {other_key!r} ({other!r}) and {key!r} ({style!r}) "
                    "with different styles; parallelize_module would apply both in turn. "
                    "Keep one key for this module."
                )
            resolved[name] = (key, style)
    return resolved


def _close_names(key: str, names: list[str], limit: int = 3) -> list[str]:
    """Module names to suggest in an error: those sharing the key's last atom, else the most
    similar ones (a wildcard compared as layer 0).

    >>> _close_names("model.layers.*.mlp.gate_up_proj", ["model.layers.0.mlp", "model.layers.0.mlp.up_proj"])
    ['model.layers.0.mlp.up_proj', 'model.layers.0.mlp']
    """
    leaf = key.rsplit(".", 1)[-1]
    pattern = re.compile(re.escape(leaf).replace(r"\*", ".*"))
    close = [name for name in names if pattern.fullmatch(name.rsplit(".", 1)[-1])]
    similar = difflib.get_close_matches(key.replace("*", "0"), names, n=limit, cutoff=0.5)
    return close[:limit] or similar or names[:limit]


def describe_style(style: ParallelStyle) -> dict:
    """A plain-data description of ``style``: its class and every layout option (a wrapper's own
    ``style`` option as ``wrapped``, since ``style`` names the class).

    >>> from torch.distributed.tensor.parallel import ColwiseParallel
    >>> describe_style(ColwiseParallel())["style"]
    'ColwiseParallel'
    """
    options = {
        "wrapped" if name == "style" else name: _plain(value)
        for name, value in sorted(vars(style).items())
        if name not in _VOLATILE_OPTIONS and not name.startswith("_")
    }
    return {"style": type(style).__name__, **options}


def _plain(value):
    if isinstance(value, (tuple, list)):
        return [_plain(v) for v in value]
    if isinstance(value, dict):
        return {k: _plain(v) for k, v in value.items()}
    if isinstance(value, (int, float, str, bool)) or value is None:
        return value
    return repr(value)


def describe_plan(plan: Plan) -> dict[str, dict]:
    """``describe_style`` for every key of ``plan``."""
    return {key: describe_style(style) for key, style in plan.items()}


def plan_diff(model: nn.Module, left: Plan, right: Plan) -> dict[str, tuple[dict | None, dict | None]]:
    """Modules on which two plans disagree, as ``{fqn: (left description, right description)}``.

    Plans are compared per module, not per key, so ``layers.*.q_proj`` and ``layers.0.q_proj`` +
    ``layers.1.q_proj`` with the same style are equal.
    """
    a, b = resolve(model, left), resolve(model, right)
    diff = {}
    for fqn in sorted(set(a) | set(b)):
        da = describe_style(a[fqn][1]) if fqn in a else None
        db = describe_style(b[fqn][1]) if fqn in b else None
        if da != db:
            diff[fqn] = (da, db)
    return diff


def base_style(style: ParallelStyle) -> ParallelStyle:
    """The style that places the parameters: ``style`` itself, or the one a wrapper applies."""
    while hasattr(style, "wrapped"):
        style = style.wrapped
    return style


def sharded_param_dims(module: nn.Module, style: ParallelStyle) -> dict[str, int]:
    """Which dimension of each of ``module``'s parameters ``style`` shards (absent: replicated): its
    own, and for a style that places its descendants' (:class:`~autotp.styles.DTensorRegion`) their
    dotted names too.

    Colwise on a Linear shards ``weight`` (out, in) and ``bias`` on dim 0, since Linear computes
    x @ W^T + b and the output features are W's rows; Rowwise shards the contracted input features,
    ``weight`` dim 1, and keeps the bias whole (it is added once, after the reduction). On an
    Embedding (vocab, dim) the roles flip: rowwise shards the vocabulary, dim 0.
    """
    params = dict(module.named_parameters(recurse=False))
    style = base_style(style)
    own = style.sharded_param_dims(module) if hasattr(style, "sharded_param_dims") else None
    if own is not None:  # styles that know their own layout (e.g. MoE); None: as torch's layouts say
        return own
    is_embedding = isinstance(module, nn.Embedding)
    if isinstance(style, ColwiseParallel):
        return {"weight": 1} if is_embedding else {n: 0 for n in ("weight", "bias") if params.get(n) is not None}
    if isinstance(style, RowwiseParallel):
        return {"weight": 0 if is_embedding else 1}
    return {}
