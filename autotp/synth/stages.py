"""The stages of synthesis an idiom plugs into, and the :class:`Analysis` they pass along.

An idiom (a way model code uses a shard: experts in a loop, a head loop, a value made outside a
module and sliced at its entry, statistics over a sharded width, ...) is one module under
``autotp/synth``. It registers, where it is defined, what it adds:

- :func:`drop_check`: after each round of the propagation, the candidates whose shard the idiom
  cannot carry, with the reason (read by :func:`autotp.synth.fixpoint.analyse`);
- :func:`post_pass`: after the fixpoint, the roles it gives or changes, at its place in the order
  (run by :func:`autotp.synth.pipeline.run`, each logged with the roles it changed);
- :func:`role_kind`: a kind of :class:`~autotp.synth.roles.Role` only this idiom assigns, with what
  it means and the function that builds its ParallelStyle (read by ``build.style_for``);
- :func:`shape_fix`: for a module whose code does not cut or shape its shard per rank as written
  (and no attribute divided by tp, nor an input seen at its per-rank width, makes it), a rewrite of
  its code that does, proven by the same per-rank runs (:class:`ShapeProblem`).

:func:`load_idioms` imports every module of the ``autotp.synth`` package before a stage or a kind is
read, so adding an idiom touches its own module, its style if it needs a new one, and a test. This
module imports nothing of the synthesizer, not even for types: the idioms import it.
"""

from __future__ import annotations

import importlib
import pkgutil
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
from torch import nn


@dataclass
class Analysis:
    """Everything synthesis found about a model, keyed by traced FQNs, and what it was asked.

    Attributes:
        graph: the traced program as a graph (:func:`~autotp.synth.graph.build_graph`).
        flow: the converged shard propagation.
        roles: one :class:`~autotp.synth.roles.Role` per module that needs a style, with its reason.
        groups: which original layers each traced layer stands for.
        model, example_inputs, tp_size, sequence_parallel: what the analysis was made for. Without a
            tp size, fused outputs are checked at tp=2 (any tp that divides the parts behaves alike)
            and nothing is checked for divisibility or replicated per kv head.
        counts: per module, the integer attributes that size the cuts of a fused output.
        kv_handled: k/v projection nodes replicated per kv head (not checked for divisibility).
        copies: grouped parts held as one group's copy per rank, by traced module FQN
            (:mod:`autotp.synth.groups`); the analysis is then that of the expanded model.
        entries: per module, the arguments of its call (position or keyword, dim) made outside it
            that meet its heads and are sliced to them on entry (:mod:`autotp.synth.entries`).
        widths: per module, the arguments its code reads its widths from (``C = x.size(-1)``) and
            the column Linears that read their values (:class:`~autotp.styles.LocalWidthInputs`).
        rewrites: per module, the rewrites of its code a :func:`shape_fix` found (each a style with
            ``localize(module, tp)`` and ``around(style)``).
    """

    # The flow, roles and groups are typed loosely: their modules (flow.py, roles.py, trace.py) import
    # the idioms, which import this registry, so naming their classes here would close a cycle.
    graph: nx.DiGraph
    flow: Any  # autotp.synth.flow.Flow
    roles: dict[str, Any]  # values: autotp.synth.roles.Role
    groups: Any  # autotp.synth.trace.LayerGroups
    model: nn.Module | None = field(default=None, repr=False)
    example_inputs: object = field(default=None, repr=False)
    tp_size: int | None = None
    sequence_parallel: bool = False
    counts: dict[str, tuple[str, ...]] = field(default_factory=dict)
    kv_handled: frozenset = frozenset()
    copies: dict = field(default_factory=dict)
    entries: dict = field(default_factory=dict)
    widths: dict = field(default_factory=dict)
    rewrites: dict = field(default_factory=dict)


@dataclass
class ShapeProblem:
    """A module whose per-rank run does not give the global shapes with the shard divided, handed
    to each :func:`shape_fix` in order.

    Attributes:
        fqn: the module's traced FQN; ``module``: the module, ``inputs``: its captured call.
        roles: the roles of the module's submodules, by relative name (``""``: the module itself).
        tp: the tp size the proof runs at.
        proves: ``proves(roles) -> bool``: whether the module, with these roles (the fix put on
            ``roles[""]``), passes the proof the fix is for (the fused output's per-rank cuts, or
            every shape per rank). Each call runs the module at per-rank widths and exports it.
        traced: ``traced() -> graph | None``: the module exported alone at global widths (once).
    """

    fqn: str
    module: nn.Module
    inputs: Any
    roles: dict[str, Any]
    tp: int
    proves: Callable[[dict[str, Any]], bool]
    traced: Callable[[], Any]


DropCheck = Callable[[Any], dict[str, str]]  # Flow -> {candidate: reason}
ShapeFix = Callable[[ShapeProblem], Any]  # -> a rewrite (localize(module, tp), around(style)) or None
PostPass = Callable[[Analysis], Analysis]

StyleBuilder = Callable[[Any, bool], Any]  # (Role, loss_parallel) -> ParallelStyle | None

_DROP_CHECKS: dict[str, tuple[float, DropCheck]] = {}
_POST_PASSES: dict[str, tuple[float, PostPass]] = {}
_ROLE_KINDS: dict[str, tuple[str, StyleBuilder]] = {}
_SHAPE_FIXES: dict[str, tuple[float, ShapeFix]] = {}


def _name(fn: Callable) -> str:
    return f"{fn.__module__}.{fn.__qualname__}"


def drop_check(order: float) -> Callable[[DropCheck], DropCheck]:
    """Register ``check(flow) -> {candidate: reason}``, run after each propagation round at ``order``
    (lower first; a candidate keeps the reason of the first check that names it)."""
    def register(check: DropCheck) -> DropCheck:
        _DROP_CHECKS[_name(check)] = (order, check)
        return check
    return register


def post_pass(order: float) -> Callable[[PostPass], PostPass]:
    """Register ``step(analysis) -> analysis``, run after the fixpoint at ``order`` (lower first)."""
    def register(step: PostPass) -> PostPass:
        _POST_PASSES[_name(step)] = (order, step)
        return step
    return register


def shape_fix(order: float) -> Callable[[ShapeFix], ShapeFix]:
    """Register ``fix(problem) -> rewrite | None``, tried at ``order`` (lower first) on a module whose
    shapes no divided attribute or per-rank input makes per rank; the first proven rewrite is kept.

    A rewrite is a ParallelStyle with ``localize(module, tp)`` (change a per-rank copy's code as the
    style changes the real module: the proofs and the checker run it) and ``around(style)`` (the
    style wrapping the module's own ``style``, or standing alone for ``None``), and declares itself in
    ``declares().rewrites``."""
    def register(fix: ShapeFix) -> ShapeFix:
        _SHAPE_FIXES[_name(fix)] = (order, fix)
        return fix
    return register


def shape_fixes() -> list[ShapeFix]:
    """The registered shape fixes, in order."""
    load_idioms()
    return [fix for _, fix in sorted(_SHAPE_FIXES.values(), key=lambda entry: entry[0])]


def role_kind(kind: str, meaning: str, style: StyleBuilder) -> str:
    """Register a role kind an idiom assigns: ``meaning`` (what a module of this kind is, as
    ``explain`` and the docs say it) and ``style(role, loss_parallel)``, its ParallelStyle (``None``:
    no style of its own). Returns ``kind``, for the idiom to assign."""
    _ROLE_KINDS[kind] = (meaning, style)
    return kind


def idiom_kinds() -> dict[str, tuple[str, StyleBuilder]]:
    """The role kinds registered by idioms: kind -> (meaning, style builder)."""
    load_idioms()
    return dict(_ROLE_KINDS)


def idiom_kind(kind: str) -> tuple[str, StyleBuilder] | None:
    """``(meaning, style builder)`` of a kind an idiom registered, or None (read for every Role made
    of such a kind: no copy of the table)."""
    load_idioms()
    return _ROLE_KINDS.get(kind)


_loaded = False


def load_idioms() -> None:
    """Import every module of the ``autotp.synth`` package once: each idiom registers its stages and
    kinds when imported, and so do the pipeline's own passes (divisibility, sequence parallel, ...)."""
    global _loaded
    if _loaded:
        return
    _loaded = True  # first: the idioms import this module, and may read a stage while importing
    try:
        package = importlib.import_module("autotp.synth")
        for module in pkgutil.iter_modules(package.__path__):
            importlib.import_module(f"autotp.synth.{module.name}")
    except BaseException:
        _loaded = False  # an idiom that failed to import is tried again, not skipped for good
        raise


def drop_checks() -> list[DropCheck]:
    """The registered drop checks, in order."""
    load_idioms()
    return [check for _, check in sorted(_DROP_CHECKS.values(), key=lambda entry: entry[0])]


def post_passes() -> list[PostPass]:
    """The registered post-passes, in order (the pipeline's own among them)."""
    load_idioms()
    return [step for _, step in sorted(_POST_PASSES.values(), key=lambda entry: entry[0])]
