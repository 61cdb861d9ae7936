"""The stages of synthesis an idiom plugs into, and the :class:`Analysis` they pass along.

An idiom (a way model code uses a shard: experts in a loop, a head loop, a value made outside a
module and sliced at its entry, statistics over a sharded width, ...) is one module under
``autotp/synth``. It registers, where it is defined, what it adds:

- :func:`drop_check`: after each round of the propagation, the candidates whose shard the idiom
  cannot carry, with the reason (read by :func:`autotp.synth.fixpoint.analyse`);
- :func:`post_pass`: after the fixpoint, the roles it gives or changes, at its place in the order
  (run by :func:`autotp.synth.pipeline.run`, each logged with the roles it changed).

The idioms' modules are named in :data:`IDIOMS` and imported by :func:`load_idioms` before a
stage is read, so adding an idiom touches its own module, :data:`IDIOMS`, its style if it needs a
new one, and a test. This module imports nothing of the synthesizer, not even for types: the
idioms import it.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass, field
from typing import Any

import networkx as nx
from torch import nn

# The modules that register drop checks or post-passes, imported (by name) before any stage runs.
IDIOMS = (
    "autotp.synth.adapters",
    "autotp.synth.entries",
    "autotp.synth.experts",
    "autotp.synth.fronts",
    "autotp.synth.head_loops",
    "autotp.synth.mixes",
    "autotp.synth.params",
    "autotp.synth.partial_inputs",
    "autotp.synth.partial_sums",
    "autotp.synth.regions",
    "autotp.synth.shared",
    "autotp.synth.statistics",
    "autotp.synth.torch_attention",
)


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


DropCheck = Callable[[Any], dict[str, str]]  # Flow -> {candidate: reason}
PostPass = Callable[[Analysis], Analysis]

_DROP_CHECKS: dict[str, tuple[float, DropCheck]] = {}
_POST_PASSES: dict[str, tuple[float, PostPass]] = {}


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


def load_idioms() -> None:
    """Import every module of :data:`IDIOMS` (each registers its stages when imported), and the
    pipeline, whose own passes (divisibility, sequence parallel, ...) register the same way."""
    for name in (*IDIOMS, "autotp.synth.pipeline"):
        importlib.import_module(name)


def drop_checks() -> list[DropCheck]:
    """The registered drop checks, in order."""
    load_idioms()
    return [check for _, check in sorted(_DROP_CHECKS.values(), key=lambda entry: entry[0])]


def post_passes() -> list[PostPass]:
    """The registered post-passes, in order (the pipeline's own among them)."""
    load_idioms()
    return [step for _, step in sorted(_POST_PASSES.values(), key=lambda entry: entry[0])]
