"""``synthesize`` and ``explain``: the public entry points of plan synthesis."""

from __future__ import annotations

import logging
import re
from dataclasses import dataclass, replace

import networkx as nx
from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from autotp.errors import MeshError, working_tp_sizes
from autotp.synth.analysis import Flow, analyse
from autotp.synth.assign import assign_roles, foreign_reads, mutated_outputs, tie_conflicts
from autotp.synth.assign import tied_embedding_modules as _tied_embeddings
from autotp.synth.build import build_plan
from autotp.synth.graph import build_graph
from autotp.synth.kvheads import replicate_kv
from autotp.synth.localize import localize
from autotp.synth.roles import Role
from autotp.synth.sequence import sequence_parallel_roles
from autotp.synth.shared import shared_input_roles
from autotp.synth.trace import LayerGroups, repeated_lists, restored_module_state, trace
from autotp.synth.validate import require_language_model, require_repeated_block

log = logging.getLogger(__name__)


@dataclass
class Analysis:
    """Everything synthesis found about a model, keyed by traced FQNs."""

    graph: nx.DiGraph
    flow: Flow
    roles: dict[str, Role]
    groups: LayerGroups


@dataclass(frozen=True)
class ExplainRecord:
    """Why one plan key (or one replicated module) got its style."""

    key: str
    role: str
    style: str
    reason: str
    evidence: tuple[str, ...]

    def __str__(self) -> str:
        path = " -> ".join(self.evidence)
        return f"{self.key}: {self.role} -> {self.style}; {self.reason}" + (f" [{path}]" if path else "")


def analyse_model(model: nn.Module, *, example_inputs=None, sequence_parallel: bool = False,
                  tp_size: int | None = None) -> Analysis:
    """Trace, build the graph, propagate shards and assign roles (no styles yet).

    The model is left as it was: state a module writes while traced is restored
    (:func:`~autotp.synth.trace.restored_module_state`).
    """
    with restored_module_state(model):
        return _analyse(model, example_inputs=example_inputs, sequence_parallel=sequence_parallel, tp_size=tp_size)


def _analyse(model: nn.Module, *, example_inputs, sequence_parallel: bool, tp_size: int | None) -> Analysis:
    require_repeated_block(model, repeated_lists(model))
    program, groups = trace(model, example_inputs)
    g = build_graph(program)
    g.graph["layer_groups"] = groups  # later steps that run modules must collapse the model the same way
    require_language_model(model, g)
    foreign, forced = foreign_reads(g)  # weights read outside their modules stay whole
    one_kv = tp_size is not None  # one-kv-head k/v can be replicated per rank only for a known tp
    flow, dropped = analyse(g, foreign, unit_heads=one_kv)
    roles = assign_roles(g, flow, dropped, forced)
    conflicts = {**foreign, **tie_conflicts(g, roles, flow)}
    if len(conflicts) > len(foreign):  # keep tied weights whole on every user, and analyse again without them
        flow, dropped = analyse(g, conflicts, unit_heads=one_kv)
        forced = {**forced, **_tied_embeddings(g, conflicts)}
        roles = assign_roles(g, flow, dropped, forced)
    local = localize(model, example_inputs, g, flow, roles, tp_size or 2)
    if local.unlocal:  # fused outputs cut with global sizes: keep those Linears whole
        flow, dropped = analyse(g, {**conflicts, **local.unlocal}, unit_heads=one_kv)
        roles = assign_roles(g, flow, dropped, forced)
    for module, names in local.counts.items():
        if module in roles and roles[module].kind == "head_params":  # one style does both
            roles[module] = replace(roles[module], names=names, reason=roles[module].reason + f"; its attributes "
                                    f"{', '.join(names)} size its reshapes, divided by tp")
            continue
        roles[module] = Role("shard_counts", f"its attributes {', '.join(names)} size the cuts of a fused "
                             "output; divided by tp, the cuts are the per-rank parts", (module,), names=names)
    kv_handled: set[str] = set()
    if tp_size is not None:
        kv_roles, kv_handled = replicate_kv(model, example_inputs, g, flow, roles, tp_size)
        roles.update(kv_roles)
    if sequence_parallel:
        roles = sequence_parallel_roles(g, flow, roles)
    roles = shared_input_roles(g, flow, roles, sequence_parallel=sequence_parallel)
    if tp_size is not None:
        check_divisible(g, flow, roles, tp_size, skip=kv_handled)
    if tp_size is not None:
        roles.update(_indivisible_tables(g, roles, tp_size))
    for module in mutated_outputs(g) & roles.keys():
        roles[module] = replace(roles[module], owned_output=True)
    log.info("synthesis: %d graph nodes, %d roles", g.number_of_nodes(), len(roles))
    return Analysis(g, flow, roles, groups)


def _indivisible_tables(g: nx.DiGraph, roles: dict[str, Role], tp_size: int) -> dict[str, Role]:
    """Vocab-parallel embeddings whose rows ``tp_size`` does not divide (OPT's 2050 positions at
    tp=4) stay whole: a small table costs less replicated than a plan that cannot be applied."""
    out = {}
    for name, data in g.nodes(data=True):
        role = roles.get(data["module"])
        if data["op"] != "embedding" or role is None or role.kind != "vocab_embedding":
            continue
        rows = g.nodes[data["args"][0].name]["shape"][0]
        if rows % tp_size:
            out[data["module"]] = Role("replicate", f"its {rows} rows do not split over tp={tp_size} (tp in "
                                       f"{working_tp_sizes([rows])} would); kept whole", role.evidence)
    return out


def check_divisible(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], tp_size: int,
                    skip: set[str] = frozenset()) -> None:
    """Every sharded extent (heads, features, parts) must split evenly over ``tp_size`` ranks.

    ``skip``: roots sharded another way (kv projections replicated per head).

    Raises:
        MeshError: naming the module, the extent found and the tp sizes that would work.
    """
    from autotp.synth.assign import _owner

    for root in sorted(set(flow.roots) - set(skip), key=lambda n: g.nodes[n]["order"]):
        extent = flow.extent.get(root, 0)
        sizes = roles.get(_owner(g, root)).sizes or () if _owner(g, root) in roles else ()
        for size in (extent, *sizes):
            if size > 0 and size % tp_size:
                raise MeshError(
                    f"{_owner(g, root)}: its sharded output reaches a dim of size {size} (heads or "
                    f"features), which tp={tp_size} does not divide; use tp in {working_tp_sizes([size])}"
                )


def synthesize(model: nn.Module, *, example_inputs=None, sequence_parallel: bool = False,
               loss_parallel: bool = True, tp_size: int | None = None,
               verify: bool = False) -> dict[str, ParallelStyle]:
    """Write a tensor-parallel plan for ``model`` from its traced graph.

    Keyword Args:
        example_inputs: a tuple of positional inputs, or a dict of keyword inputs; made from the
            config (``input_ids`` of shape (2, 11)) for transformers models when omitted.
        sequence_parallel: keep the residual stream sharded on the sequence between blocks.
        loss_parallel: leave the head's logits vocab-sharded (``Shard(-1)`` DTensor).
        tp_size: if given, check that every sharded extent divides evenly; k/v projections with
            fewer heads than ``tp_size`` (a multiple of them) get one kv head per rank.
        verify: check the plan numerically before returning it (:func:`autotp.self_check.self_check`:
            logits and every gradient at ``tp_size`` (2 if None) on simulated ranks, on the model
            itself or on a tiny copy built from its config). Off by default: it costs 2-5 s on a
            tiny model, several times the synthesis; ``autotp.parallelize`` turns it on.

    Returns:
        ``{fnmatch key: ParallelStyle}`` for ``parallelize_module``, keys relative to ``model``.

    Raises:
        VerificationError: (``verify=True``) the plan differs from the unsharded model; the
            message names the first differing parameter and the difference against the tolerance.

    Example::
        >>> plan = synthesize(model)  # doctest: +SKIP
        >>> plan["model.layers.*.self_attn.o_proj"]  # doctest: +SKIP
        RowwiseParallel(...)
    """
    analysis = analyse_model(model, example_inputs=example_inputs, sequence_parallel=sequence_parallel,
                             tp_size=tp_size)
    plan = build_plan(analysis.roles, analysis.groups, loss_parallel=loss_parallel)
    if verify:
        from autotp.self_check import self_check

        self_check(model, plan, tp_size=tp_size or 2, sequence_parallel=sequence_parallel,
                   loss_parallel=loss_parallel, example_inputs=example_inputs)
    return plan


def explain(model: nn.Module | None = None, *, example_inputs=None, sequence_parallel: bool = False,
            loss_parallel: bool = True, tp_size: int | None = None,
            analysis: Analysis | None = None) -> list[ExplainRecord]:
    """Why the plan :func:`synthesize` writes (same arguments) looks as it does.

    One record per plan key, in the plan's order, with that key's style; then one per module left
    whole (folded to ``layers.*`` where every layer leaves it whole), with the reason.

    Keyword Args:
        analysis: an :class:`Analysis` already made (``get_plan`` keeps the one behind a
            synthesized choice), so the model is not traced again; ``model`` may then be None.
    """
    if analysis is None:
        analysis = analyse_model(model, example_inputs=example_inputs, sequence_parallel=sequence_parallel,
                                 tp_size=tp_size)
    plan = build_plan(analysis.roles, analysis.groups, loss_parallel=loss_parallel)
    return describe(analysis, plan)


def describe(analysis: Analysis, plan: dict[str, ParallelStyle]) -> list[ExplainRecord]:
    """Records for ``plan`` (built from ``analysis``): its keys, then the modules it leaves whole."""
    originals = {fqn: role for traced, role in analysis.roles.items() for fqn in analysis.groups.original(traced)}
    records = []
    for key, style in plan.items():
        fqn = next(f for f in originals if _key_matches(key, f))
        role = originals[fqn]
        fold = "*" in key
        records.append(ExplainRecord(key, role.kind, repr(style), _fold(role.reason, analysis.groups, fold),
                                     tuple(_fold(e, analysis.groups, fold) for e in role.evidence)))
    whole: dict[tuple[str, str], list[str]] = {}
    for fqn, role in originals.items():
        if not any(_key_matches(key, fqn) for key in plan):
            whole.setdefault((_fold(fqn, analysis.groups, True), role.kind), []).append(fqn)
    for (pattern, kind), fqns in whole.items():
        role = originals[fqns[0]]
        entries = _entries(analysis.groups, pattern)
        every = "*" not in pattern or len(fqns) == entries
        key = pattern if every else f"{pattern} ({len(fqns)} of {entries} layers)"
        records.append(ExplainRecord(key, kind, "replicated", _fold(role.reason, analysis.groups, every),
                                     tuple(_fold(e, analysis.groups, every) for e in role.evidence)))
    return records


def _key_matches(key: str, fqn: str) -> bool:
    """Whether plan key ``key`` (``*`` for one stack entry) names module ``fqn``."""
    parts, names = key.split("."), fqn.split(".")
    return len(parts) == len(names) and all(p in ("*", n) for p, n in zip(parts, names))


def _fold(text: str, groups: LayerGroups, fold: bool) -> str:
    """``text`` with stack entries (``layers.3.``) written ``layers.*.`` when ``fold``."""
    if not fold:
        return text
    for prefix in groups.groups:
        text = re.sub(rf"(?<![\w.]){re.escape(prefix)}\.[^.\s]+(?=\.|\b)", f"{prefix}.*", text)
    return text


def _entries(groups: LayerGroups, pattern: str) -> int:
    prefix = next((p for p in groups.groups if pattern.startswith(p + ".*")), None)
    return sum(len(group) for group in groups.groups[prefix]) if prefix else 1
