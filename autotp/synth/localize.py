"""Fused outputs cut with fixed sizes: find the integer attributes that make the cuts local.

A packed column Linear (``qkv_proj``, nanoGPT's ``c_attn``) holds ``size / tp`` of every part on
each rank, but the code that cuts its output often computes the cut points from attributes that
hold global numbers (``qkv[..., : config.num_attention_heads * head_dim]``, ``split(self.n_embd)``).
The traced graph shows only the constants, not where they came from. This pass:

1. lists the parts' widths and head counts (head size from the view that follows each part);
2. takes as candidates the integer attributes of the module that cuts the output (and of the plain
   objects it holds, such as its ``config``, one level deep) equal to one of those numbers;
3. re-runs that module alone on meta tensors, with its Linears at their per-rank widths and a
   subset of the candidates divided by tp, and records where the fused output is cut. The smallest
   subset whose cuts are exactly the per-rank parts (and whose outputs keep their global shapes) is
   the answer, realised by :class:`~autotp.styles.ShardCounts`.

When no subset works, the search is repeated once more where the module's code may read its
widths from an input (nanoGPT's ``B, T, C = x.size()``, ``C // self.n_head``): an input that only
its column Linears read (:func:`width_view_of`) is given to the code at its per-rank width while
those Linears read the real one (:class:`~autotp.styles.LocalWidthInputs`). When that fails too
(module constants), the fused Linear is reported with the reason and stays replicated: never a
plan that runs and computes the wrong thing.
"""

from __future__ import annotations

import copy
import itertools
import logging
from dataclasses import dataclass, field, replace

import networkx as nx
import torch
from torch import nn

from autotp.synth.flow import Flow

from autotp.synth.queries import is_linear, module_of

from autotp.synth.shard import Shard
from autotp.synth.copies import local_point
from autotp.synth.entries import keys_of_shape
from autotp.synth.graph import Ref, common_module
from autotp.synth.ops import FIXED_SIZE_CUTS
from autotp.synth.local_run import argument_roles, capture_inputs, outputs_match, run_local, shapes_are_local
from autotp.synth.local_run import trace_local
from autotp.synth.ops import VIEW_LIKE
from autotp.synth.params import value_refs
from autotp.synth.ops import SINKS
from autotp.synth.roles import Role, kind_of
from autotp.synth.trace import LayerGroups

log = logging.getLogger(__name__)

# How many candidate attributes one module may need divided together (Phi3 needs 2; a packed
# projection whose part is cut again, into heads and groups, needs 4: both widths and both counts).
MAX_NAMES = 4


@dataclass
class Localization:
    """What the pass found: attribute names per module, and fused Linears that cannot be localized."""

    counts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    unlocal: dict[str, str] = field(default_factory=dict)  # linear node -> reason
    # module -> (argument, dim) of values made outside it that it takes sliced to its heads
    entries: dict[str, tuple] = field(default_factory=dict)
    # module -> ((argument, ...), (column Linear, ...)): arguments its code reads at per-rank width
    widths: dict[str, tuple] = field(default_factory=dict)
    # module -> rewrites of its code a shape fix found (stages.shape_fix)
    rewrites: dict[str, tuple] = field(default_factory=dict)


# Roles of Linears that may read an argument the module's code sees at per-rank width: they take
# a replicated input whole (the stand-in is swapped back to the real value before them).
_WIDTH_READERS = frozenset({"column", "packed_column", "kv_column"})


def width_view_of(g: nx.DiGraph, roles: dict[str, Role], fqn: str, call) -> tuple | None:
    """``((argument, ...), (reader, ...))`` for module ``fqn`` called with ``call`` (its captured
    ``(args, kwargs)``): the floating-point arguments it takes from outside whose every read inside
    it is the input of a column Linear (relative names in ``reader``), each found among the call's
    arguments by its shape alone; None if there is none.

    Only such an argument can be handed to the module's code as a size-only stand-in
    (:class:`~autotp.styles.LocalWidthInputs`): its code reads nothing from it but its size, and
    the Linears get the real value. A read by anything else (a residual add, a norm, a cast before
    the Linear) keeps the argument out.
    """
    if not fqn or call is None:
        return None
    inside = lambda n: g.nodes[n]["kind"] == "call" and fqn in g.nodes[n]["stack"]  # noqa: E731
    reads: dict[str, set[str]] = {}
    for name in g.nodes:
        if not inside(name) or g.nodes[name]["op"] in SINKS:
            continue
        for ref in value_refs(g.nodes[name]):
            if not inside(ref.name) and g.nodes[ref.name]["kind"] in ("call", "input"):
                reads.setdefault(ref.name, set()).add(name)
    keys, readers = [], set()
    for value, nodes in sorted(reads.items(), key=lambda item: g.nodes[item[0]]["order"]):
        modules = {module_of(g, n) for n in nodes}
        if not all(is_linear(g, n) and g.nodes[n]["args"][0] == Ref(value) and sum(
                r == Ref(value) for r in value_refs(g.nodes[n])) == 1 for n in nodes) or any(
                kind_of(roles, m) not in _WIDTH_READERS or not m.startswith(fqn + ".") for m in modules):
            continue
        found = keys_of_shape(call, tuple(g.nodes[value]["shape"] or ()))
        if len(found) != 1:
            continue
        args, kwargs = call
        argument = args[found[0]] if isinstance(found[0], int) else kwargs[found[0]]
        if not argument.is_floating_point():
            continue
        keys.append(found[0])
        readers |= {m[len(fqn) + 1:] for m in modules}
    return (tuple(keys), tuple(sorted(readers))) if keys else None


def with_width_view(roles: dict[str, Role], view: tuple) -> dict[str, Role]:
    """Inner ``roles`` (relative names) with the module itself (``""``) reading ``view``."""
    return _with_own(roles, "its code reads widths from its inputs", width_view=view)


def with_rewrites(roles: dict[str, Role], rewrites: tuple) -> dict[str, Role]:
    """Inner ``roles`` (relative names) with the module itself (``""``) running ``rewrites``."""
    return _with_own(roles, "its code is rewritten for per-rank shapes", rewrites=tuple(rewrites))


def _with_own(roles: dict[str, Role], reason: str, **changes) -> dict[str, Role]:
    """``roles`` with the module's own role (``""``; a ``shard_counts`` one if it has none) changed."""
    own = roles.get("") or Role("shard_counts", reason)
    return {**roles, "": replace(own, **changes)}


def fixed_size_roots(g: nx.DiGraph, flow: Flow) -> dict[str, list[str]]:
    """Packed candidates whose output is cut by a fixed-size op: root -> the cutting nodes.

    Outputs read per fixed group (:meth:`~autotp.synth.flow.Flow.group_view`) are left to the
    shape proof: their cuts are made in the groups' view, not on the output this pass watches."""
    found = {}
    for root, nodes in flow.split_nodes.items():
        if root in flow.group_views:
            continue
        if root in flow.roots and any(g.nodes[n]["op"] in FIXED_SIZE_CUTS for n in nodes):
            found[root] = nodes
    return found


def cutting_module(g: nx.DiGraph, root: str, nodes: list[str]) -> str:
    """Innermost module that ran the Linear and every cut: the one whose code computes the cuts."""
    return common_module([g.nodes[n]["stack"] for n in (root, *nodes)])


def part_numbers(g: nx.DiGraph, flow: Flow, root: str) -> set[int]:
    """Widths of ``root``'s parts and, where a view splits a part into heads, its head count."""
    numbers = set()
    for start, end in set(flow.splits[root]) - set(flow.copied.get(root, ())):  # held whole: not divided
        numbers.add(end - start)
    for node in flow.split_nodes[root]:
        numbers.update(heads for _, heads in head_splits(g, flow, root, node))
    return {n for n in numbers if n > 1}


def head_splits(g: nx.DiGraph, flow: Flow, root: str, start: str, depth: int = 4):
    """``(view node, heads)`` for the views within ``depth`` hops of ``start`` that split ``root``'s
    shard into heads: the sharded dim after the view is narrower than the features before it."""
    for node in nx.bfs_tree(g, start, depth_limit=depth):
        data = g.nodes[node]
        state = flow.state.get(node)
        if data["op"] not in VIEW_LIKE or not isinstance(state, Shard) or root not in state.origins:
            continue
        source = data["args"][0]
        in_shape = g.nodes[source.name]["shape"] if isinstance(source, Ref) else None
        if in_shape and data["shape"] and data["shape"][state.dim] < in_shape[-1]:
            yield node, data["shape"][state.dim]


def candidate_names(module: nn.Module, values: set[int]) -> list[str]:
    """Integer attributes in ``values`` of ``module``, of the plain objects it holds and of its child
    modules, one level down; and integers a child module keeps in a dict attribute (an einops
    layer's ``axes_lengths``), named through the key (``"split.axes_lengths.h"``).

    A child's count is what its own forward reads (``nn.Conv1d.groups`` of a depthwise convolution
    over the sharded channels, a gate module's head count); a Linear child's sizes are not read
    by its forward and are skipped. Sorted module attributes first, then dotted ones, so the result
    is stable and readable.
    """
    names = []
    for name, value in vars(module).items():
        if is_count(value) and value in values:
            names.append(name)
        elif _plain_object(value):
            names += [f"{name}.{sub}" for sub, inner in vars(value).items() if is_count(inner) and inner in values]
    for name, child in module.named_children():
        if type(child) in (nn.Linear, nn.Embedding):  # a subclass may hold counts (a grouped Linear's groups)
            continue
        names += [f"{name}.{sub}" for sub, inner in vars(child).items()
                  if not sub.startswith("_") and is_count(inner) and inner in values]
        names += [f"{name}.{sub}.{key}" for sub, inner in vars(child).items()
                  if not sub.startswith("_") and isinstance(inner, dict)
                  for key, count in inner.items() if _count_key(key) and is_count(count) and count in values]
    return sorted(names, key=lambda n: (n.count("."), n))


def _count_key(key) -> bool:
    """Whether a dict key can be a step of a count's dotted path (einops' ``axes_lengths`` keys:
    ``"h"`` of ``Rearrange("b t (h d) -> b h t d", h=8)``)."""
    return isinstance(key, str) and key.isidentifier()


def is_count(value) -> bool:
    return isinstance(value, int) and not isinstance(value, bool)


def _plain_object(value) -> bool:
    return (hasattr(value, "__dict__") and not isinstance(value, (nn.Module, torch.Tensor, type))
            and not callable(value) and _assignable(value))


def _assignable(value) -> bool:
    """Whether a copy of ``value`` takes new attribute values (a frozen dataclass does not, so
    :class:`~autotp.styles.ShardCounts` could not divide anything it holds)."""
    name = next(iter(vars(value)), None)
    if name is None:
        return False
    try:
        setattr(copy.copy(value), name, getattr(value, name))
    except Exception:  # FrozenInstanceError, a read-only property, a __setattr__ that refuses
        return False
    return True

def local_ranges(sizes: tuple[int, ...], tp: int) -> set[tuple[int, int]]:
    """The per-rank parts of a fused output of parts ``sizes``.

    >>> sorted(local_ranges((64, 32, 32), 2))
    [(0, 32), (32, 48), (48, 64)]
    """
    local = [s // tp for s in sizes]
    return {(sum(local[:i]), sum(local[: i + 1])) for i in range(len(local))}


def find_names(module: nn.Module, inputs, roles: dict[str, Role], fused: dict[str, tuple[int, ...]],
               candidates: list[str], tp: int) -> tuple[str, ...] | None:
    """The smallest set of ``candidates`` that makes every fused output's cuts per-rank, or None."""
    roles = {**roles, **argument_roles(inputs)}  # modules handed in run at per-rank shapes too
    names_of = list(fused)
    reference = run_local(module, inputs, roles, names_of, (), 1)
    if reference is None:
        return None
    # Each global cut at its per-rank place: every part is divided by tp, so every cut point is.
    # (A part cut again is cut on another tensor; the shape proof below checks those cuts.)
    held = {i: roles.get(name) for i, name in enumerate(names_of)}  # parts held whole are not divided
    at_rank = lambda i, p: local_point(held[i], p, tp) if held[i] is not None and held[i].copied else p // tp  # noqa: E731
    expected = {i: {(at_rank(i, start), at_rank(i, end)) for start, end in cuts} for i, cuts in reference[1].items()}
    traced = None
    for count in range(min(MAX_NAMES, len(candidates)) + 1):
        for names in itertools.combinations(candidates, count):
            result = run_local(module, inputs, roles, names_of, names, tp)
            if result is None or not outputs_match(result[0], reference[0], tp) or result[1] != expected:
                continue
            # Right cuts, right outputs; now every intermediate shape must be the per-rank one
            # (a head size halved instead of the head count would pass the checks above).
            if traced is None:
                traced = trace_local(module, inputs, roles, (), 1)
                if traced is None:
                    return None
            local = trace_local(module, inputs, roles, names, tp)
            if local is not None and shapes_are_local(traced, local, roles, tp):
                return names
    return None


def resolve_entries(model: nn.Module, example_inputs, g: nx.DiGraph, flow,
                    groups: LayerGroups | None) -> tuple[dict[str, tuple], dict[str, str]]:
    """Which argument of each module's call carries each value it takes sliced
    (:func:`~autotp.synth.entries.entry_source`).

    Returns:
        ``({module: ((position or keyword, dim), ...)}, {candidate: reason})``: the candidates whose
        value cannot be placed among the arguments (several of the same shape, inside a tuple, a
        module the fake forward never reached) are to be kept whole.
    """
    if not flow.entry_shards:
        return {}, {}
    modules = {module for _, module in flow.entry_shards if module}
    captured = capture_inputs(model, example_inputs, modules, groups)
    entries: dict[str, list] = {}
    unplaced: dict[str, str] = {}
    for (source, module), dim in sorted(flow.entry_shards.items()):
        shape = tuple(g.nodes[source]["shape"])
        keys = keys_of_shape(captured.get(module), shape) if module else []
        if len(keys) == 1:
            entries.setdefault(module, []).append((keys[0], *dim) if isinstance(dim, tuple) else (keys[0], dim))
            continue
        why = (f"{module or 'the root'} takes a value of shape {shape} that meets its heads, but "
               + (f"{len(keys)} of its arguments have that shape" if keys else "no argument of its call is it")
               + ": it cannot be sliced at entry; kept whole")
        for origin in flow.entry_origins.get((source, module), ()):
            unplaced.setdefault(origin, why)
    return {m: tuple(sorted(set(v), key=str)) for m, v in entries.items()}, unplaced
