"""The synthesis pipeline: one :class:`~autotp.synth.stages.Analysis`, a constraint fixpoint, the
post-passes (:func:`~autotp.synth.stages.post_passes`: those of the idioms, registered in their
own modules, and the pipeline's own below: shard counts, kv replication, sequence parallel,
divisibility, owned outputs, untraced Linears and siblings), then the group-copy expansion.

::

    program, groups = trace(model)                 # torch.export, one block per distinct type
    g = build_graph(program)                        # networkx view of the program
    analysis = constraint_fixpoint(...)             # analyse -> roles -> constraints, until none is new
    for step in post_passes():                      # each Analysis -> Analysis, logging what it changed
        analysis = step(analysis)
    analysis = group_copy_expansion(analysis)       # parts with fewer groups than ranks, held as copies

The fixpoint's constraints are facts that keep Linears whole and that only a converged analysis
can reveal: weights read outside their module, a tied weight its users would shard two ways, a
fused output cut with global sizes (:func:`~autotp.synth.shape_proof.localize`). Each round analyses
again with every constraint found so far; the loop ends when a round adds none.
"""

from __future__ import annotations

import itertools
import logging
from functools import partial
import re
import warnings
from collections.abc import Callable
from dataclasses import dataclass, field, replace

import networkx as nx
from torch import nn

from autotp.errors import MeshError, working_tp_sizes
from autotp.synth.fixpoint import analyse
from autotp.synth.flow import Flow
from autotp.synth.queries import module_of
from autotp.synth.assign import assign_roles, foreign_reads, mutated_outputs, tie_conflicts, tied_embedding_modules
from autotp.synth.copies import copied_roles
from autotp.synth.graph import build_graph
from autotp.synth.groups import group_copies
from autotp.synth.groups_first import fewer_groups_than_tp
from autotp.synth.kvheads import replicate_kv
from autotp.synth.shape_proof import localize
from autotp.synth.params import readers
from autotp.synth.roles import Role
from autotp.synth.stages import Analysis, post_pass, post_passes
from autotp.synth.sequence import sequence_parallel_roles, unshardable_stream
from autotp.synth.trace import LayerGroups, block_signature, trace
from autotp.synth.validate import require_language_model

log = logging.getLogger(__name__)




def run(model: nn.Module, *, example_inputs=None, sequence_parallel: bool = False,
        tp_size: int | None = None, expand_groups: bool = True) -> Analysis:
    """The whole pipeline on ``model``: trace, graph, constraint fixpoint, the post-passes in order,
    then (``expand_groups``) the group-copy expansion."""
    program, groups = trace(model, example_inputs)
    g = build_graph(program)
    require_language_model(model, g)
    analysis = constraint_fixpoint(g, groups, model, example_inputs, tp_size)
    analysis = replace(analysis, sequence_parallel=sequence_parallel)
    for step in post_passes():
        analysis = _logged(step, analysis)
    log.info("synthesis: %d graph nodes, %d roles", g.number_of_nodes(), len(analysis.roles))
    if expand_groups:
        analysis = _logged(group_copy_expansion, analysis)
    return analysis


def group_copy_expansion(a: Analysis) -> Analysis:
    """The last stage: parts of a packed output with fewer groups than ranks (Mamba's B / C with
    one group, a k / v of fewer heads than ranks read per group) held as copies, each rank a share of
    one group (:func:`~autotp.synth.groups.group_copies`). The model with those parts expanded goes
    through this pipeline once more, without this stage; its roles are kept where they shard the
    parts, else ``a`` as it was."""
    return group_copies(a, partial(run, expand_groups=False))


def constraint_fixpoint(g: nx.DiGraph, groups: LayerGroups, model: nn.Module, example_inputs,
                        tp_size: int | None) -> Analysis:
    """Analyse and assign roles until no round finds a new constraint; log what each round added.

    Constraints: Linears whose weights stay whole (read outside their module, tied weights their
    users would shard differently), embeddings kept whole with them, and column candidates whose
    fused output is cut with global sizes. A candidate whose output is viewed as fixed groups that
    its plain reading cannot take per rank (the shape proof fails, or tp does not divide the
    groups) is read once more per group (each rank a share of every group) before it is kept whole.
    """
    whole, forced = foreign_reads(g)
    unlocal: dict[str, str] = {}
    # One-kv-head k/v are read at any tp (every tp is above one head: the plan is the same at each,
    # see kv_replication); parts of a fused output held whole per rank need a known tp.
    copy_parts = tp_size is not None
    per_group = _PerGroup()
    for round_ in itertools.count(1):
        flow, dropped = analyse(g, unlocal, unit_heads=True, whole=whole, copy_parts=copy_parts,
                                per_group=frozenset(per_group.plain))
        broke = {n: dropped[n] for n in per_group.plain if n in dropped and n not in unlocal}
        if broke:  # read per group, the shard breaks: back to the plain reading, or whole
            log.info("constraints, round %d: no per-group reading at %s", round_, sorted(broke))
            unlocal = {**unlocal, **per_group.give_up(broke, broke=True)}
            continue
        roles = assign_roles(g, flow, dropped, forced)
        roles.update(copied_roles(g, flow, roles, tp_size) if tp_size else {})
        ties = {n: reason for n, reason in tie_conflicts(g, roles, flow).items() if n not in whole}
        if ties:  # keep tied weights whole on every user, and analyse again without them
            log.info("constraints, round %d: tied weights kept whole at %s", round_, sorted(ties))
            whole = {**whole, **ties}
            forced = {**forced, **tied_embedding_modules(g, whole)}
            continue
        if per_group.retry(_misfit_groups(flow, tp_size), misfit=True):  # G < tp: try shares of each
            log.info("constraints, round %d: fewer groups than ranks, read per group at %s", round_, per_group.last)
            continue
        indivisible = {n: reason for n, reason in _indivisible_parts(flow, tp_size).items() if n not in unlocal}
        indivisible.update({n: reason for n, reason in indivisible_vocab(g, flow, roles, tp_size).items()
                            if n not in unlocal})
        if indivisible:  # before the shape proofs: their modules run without these shards
            log.info("constraints, round %d: parts tp does not divide at %s", round_, sorted(indivisible))
            unlocal = {**unlocal, **per_group.give_up(indivisible)}
            continue
        local = localize(model, example_inputs, g, flow, roles, tp_size or 2, groups)
        new = {n: reason for n, reason in local.unlocal.items() if n not in unlocal}
        if per_group.retry({n: reason for n, reason in new.items() if n in flow.groupable}):
            log.info("constraints, round %d: outputs read per fixed group at %s", round_, per_group.last)
            continue
        if new:  # fused outputs cut with global sizes: keep those Linears whole
            log.info("constraints, round %d: fused outputs cut with global sizes at %s", round_, sorted(new))
            unlocal = {**unlocal, **per_group.give_up(new)}
            continue
        log.debug("constraints converged after %d rounds", round_)
        return Analysis(g, flow, roles, groups, model, example_inputs, tp_size, counts=dict(local.counts),
                        entries=dict(local.entries), widths=dict(local.widths), rewrites=dict(local.rewrites))
    raise AssertionError("unreachable")  # itertools.count never ends


@dataclass
class _PerGroup:
    """Candidates read per fixed group (:meth:`~autotp.synth.flow.Flow.group_view`), each
    tried once: ``plain`` holds, for each read so now, why its plain reading fails; ``misfit``
    those whose plain reading failed only because tp does not divide their groups (it may still
    hold a group per rank, as a k / v replicated per kv head does); ``last`` the ones the last
    :meth:`retry` added."""

    plain: dict[str, str] = field(default_factory=dict)
    misfit: set[str] = field(default_factory=set)
    tried: set[str] = field(default_factory=set)
    last: list[str] = field(default_factory=list)

    def retry(self, candidates: dict[str, str], *, misfit: bool = False) -> bool:
        """Read ``candidates`` (-> why their plain reading fails) not tried yet per group; whether
        there was any."""
        self.last = sorted(set(candidates) - self.tried)
        self.plain.update({n: candidates[n] for n in self.last})
        self.tried.update(self.last)
        if misfit:
            self.misfit.update(self.last)
        return bool(self.last)

    def give_up(self, reasons: dict[str, str], *, broke: bool = False) -> dict[str, str]:
        """The constraints for the Linears ``reasons`` keep whole. Those read per group stay whole
        with both readings' reasons, except where the per-group shard ``broke`` and the plain
        reading had failed only on its groups: that reading is taken back (nothing added)."""
        out = {}
        for n, reason in reasons.items():
            if n not in self.plain:
                out[n] = reason
                continue
            plain = self.plain.pop(n)
            if not (broke and n in self.misfit):
                out[n] = f"{plain.removesuffix('; kept whole')}; read per fixed group (each rank a share of every " \
                         f"group): {reason}"
        return out


def _misfit_groups(flow: Flow, tp_size: int | None) -> dict[str, str]:
    """Candidates whose plain reading shards fixed groups (:meth:`~autotp.synth.flow.Flow.group_view`)
    that ``tp_size`` does not divide (a rank would hold part of a group), with that reason."""
    if not tp_size:
        return {}
    return {r: f"its output is viewed as {groups} fixed groups, which tp={tp_size} does not divide"
            for r, groups in flow.groupable.items() if r in flow.roots and groups % tp_size}


def _indivisible_parts(flow: Flow, tp_size: int | None) -> dict[str, str]:
    """Candidates cut into parts by a view whose heads tp does not divide (a fused k / v with
    fewer kv heads than ranks; fixed groups of too few heads each; heads chunked into parts of
    too few heads each; a fused q / k / v viewed groups first with fewer groups than ranks; a loop
    over fewer heads than ranks, or heads tp does not divide): kept whole, as the cut alone would
    leave them, rather than the whole plan refused."""
    if not tp_size:
        return {}
    found = {root: f"its output is viewed into parts of {flow.extent[root]} heads each, which tp={tp_size} does "
                   "not divide; kept whole" for root in flow.part_views if flow.extent.get(root, 0) % tp_size}
    found.update({root: f"its heads are cut into parts with {flow.extent[root]} heads in common, which tp={tp_size} "
                        "does not divide (each rank would hold a share of every part); kept whole"
                  for root in flow.head_cuts if root not in found and flow.extent.get(root, 0) % tp_size})
    found.update({root: f"its output is viewed into {groups} fixed groups of parts, {flow.extent[root]} heads "
                        f"each, which tp={tp_size} does not divide (each rank would hold a share of every group); "
                        "kept whole" for root, (groups, _) in flow.group_views.items()
                  if root in flow.roots and flow.extent.get(root, 0) % tp_size})
    found.update({row: f"its {flow.extent[row]} per-head output features, left sharded on the heads, do not split "
                       f"over tp={tp_size}; reduced whole" for row in flow.scatters if flow.extent.get(row, 0) % tp_size})
    found.update({root: f"its shard reaches a loop over {heads} heads one at a time, which tp={tp_size} does not "
                        "divide (a rank would hold part of a head); kept whole"
                  for join, (heads, _) in flow.head_loops.items() if heads % tp_size
                  for root in flow.state[join].origins if root in flow.roots})
    found.update(fewer_groups_than_tp(flow, tp_size))
    return found


# --- post-passes: each Analysis -> Analysis -------------------------------------------------------


@post_pass(order=20)
def shard_counts(a: Analysis) -> Analysis:
    """Modules whose integer attributes size the cuts of a fused output get them divided by tp."""
    roles = dict(a.roles)
    for module, names in a.counts.items():
        current = roles.get(module)
        if current is not None and current.kind in ("head_params", "linear_params"):  # one style does both
            roles[module] = replace(current, names=names, reason=current.reason + f"; its attributes "
                                    f"{', '.join(names)} size its reshapes, divided by tp")
            continue
        roles[module] = Role("shard_counts", f"its attributes {', '.join(names)} size the cuts of a fused "
                             "output; divided by tp, the cuts are the per-rank parts", (module,), names=names)
    for module, view in a.widths.items():
        _noted(roles, module, f"its code reads widths from its argument(s) {', '.join(map(str, view[0]))}, which it "
               f"sees at the per-rank width while {', '.join(view[1])} read the real value", width_view=view)
    for module, rewrites in a.rewrites.items():
        _noted(roles, module, f"its code is rewritten to cut and shape its shard per rank "
               f"({'; '.join(map(repr, rewrites))})", rewrites=rewrites)
    return replace(a, roles=roles)


def _noted(roles: dict[str, Role], module: str, note: str, **changes) -> None:
    """``module``'s role (a ``shard_counts`` one if it has none) with ``changes``, ``note`` added to
    its reason."""
    current = roles.get(module) or Role("shard_counts", note, (module,))
    roles[module] = replace(current, **changes,
                            reason=current.reason if current.reason == note else f"{current.reason}; {note}")


@post_pass(order=30)
def kv_replication(a: Analysis) -> Analysis:
    """tp > kv heads: k/v projections hold the kv head their ranks' query heads read.

    Without ``tp_size`` only k/v of one head are handled: every tp is above them, and their plan
    (each rank holds the head, the attention's counts set per rank from the mesh when applied) is
    the same at every tp that divides the query heads, so it is found at tp=2 and holds at any.
    """
    tp = a.tp_size or ANY_TP_ABOVE_ONE_HEAD
    try:
        kv_roles, handled = replicate_kv(a.model, a.example_inputs, a.graph, a.flow, a.roles, tp, a.groups)
    except MeshError as error:
        if a.tp_size is not None:
            raise
        raise MeshError(module=error.module, found=f"its k/v have one head, so every rank holds it and the "
                        f"query heads are split over tp, and without tp_size that failed at tp={tp}: {error.found}",
                        fix="pass tp_size= (the tp you will shard with) to synthesize") from error
    if a.tp_size is None:
        _no_unhandled_unit_heads(a, handled)
    if not kv_roles and not handled:
        return a  # nothing to replicate (and, without tp_size, no k/v of one head)
    roles = dict(a.roles)
    for module, role in kv_roles.items():
        current = roles.get(module)
        if role.kind == "kv_head_counts" and current is not None and current.kind != "kv_head_counts":
            # The attention has a style of its own (per-head parameters sharded with the heads): the
            # per-rank counts are set first, then that style applies (one plan key, both styles).
            roles[module] = replace(current, kv_counts=role.kv_counts, heads=role.heads,
                                    reason=f"{current.reason}; {role.reason}")
        else:
            roles[module] = role
    return replace(a, roles=roles, kv_handled=frozenset(handled))


# The tp the one-kv-head reading is found at when no tp_size is given (any tp above one head).
ANY_TP_ABOVE_ONE_HEAD = 2


def _no_unhandled_unit_heads(a: Analysis, handled: set[str]) -> None:
    """Without ``tp_size``: every sharded root of one head must be a k/v that ranks hold whole.

    Raises:
        MeshError: a root of one head is left sharded (its plan would depend on tp), asking for tp_size.
    """
    for root in sorted(set(a.flow.roots) - set(handled), key=lambda n: a.graph.nodes[n]["order"]):
        if a.flow.extent.get(root) == 1:
            raise MeshError(module=module_of(a.graph, root), found="its output is one head read by a wider "
                            "attention, which no tp splits, and without tp_size the plan that holds it on "
                            "every rank cannot be written", fix="pass tp_size= (the tp you will shard with) to synthesize")


@post_pass(order=50)
def sequence_parallel(a: Analysis) -> Analysis:
    """Under sequence parallel: the residual stream sharded on the sequence between blocks."""
    if not a.sequence_parallel:
        return a
    reason = unshardable_stream(a.graph, a.flow, a.roles, a.groups)
    if reason is not None:
        log.warning("sequence parallel: %s", reason)
        return replace(a, sequence_parallel=False)
    roles = sequence_parallel_roles(a.graph, a.flow, a.roles, a.groups)
    for module, before in a.roles.items():
        after = roles.get(module)
        if before.kind != "shard_counts" or after is None or after.kind == "shard_counts":
            continue
        # A block gathered whole at entry keeps its counts divided (one style does both); any
        # other role would drop them, and the module would cut its shards with global sizes.
        if after.kind != "seq_gather" or after.names:
            reason = (f"{module} divides {', '.join(before.names) or 'the sizes in its code'} by tp, and its "
                      f"sequence-parallel role ({after.kind}) cannot do that too")
            log.warning("sequence parallel: %s; planned without it", reason)
            return replace(a, sequence_parallel=False)
        why = [f"its attributes {', '.join(before.names)} divided by tp"] if before.names else []
        why += ["its code rewritten for per-rank shapes"] if before.rewrites else []
        roles[module] = replace(after, names=before.names, rewrites=before.rewrites,
                                reason="; ".join([after.reason, *why]))
    return replace(a, roles=roles)


@post_pass(order=140)
def divisibility(a: Analysis) -> Analysis:
    """With a tp size: every sharded extent must divide (else MeshError); vocab tables it does not
    divide stay whole."""
    if a.tp_size is None:
        return a
    check_divisible(a.graph, a.flow, a.roles, a.tp_size, skip=a.kv_handled)
    _warn_whole_heads(a.roles, a.tp_size)
    return replace(a, roles={**a.roles, **indivisible_tables(a.graph, a.roles, a.tp_size)})


@post_pass(order=150)
def owned_outputs(a: Analysis) -> Analysis:
    """Modules whose output the calling code modifies in place return a copy, not a shard's view."""
    roles = dict(a.roles)
    for module in mutated_outputs(a.graph) & roles.keys():
        roles[module] = replace(roles[module], owned_output=True)
    return replace(a, roles=roles)


@post_pass(order=160)
def untraced_linears(a: Analysis) -> Analysis:
    """``nn.Linear`` modules the traced forward never calls (an image patch projection when the
    trace is text-only) are column-sharded with their output all-gathered: for any input the ranks
    share, that gives the whole module's output and input gradient, at ``1/tp`` of its weight.

    Only plain ``nn.Linear`` (its forward is known), outside the layer stacks, whose parameters are
    no other module's (tied), whose parent the trace runs (a projection beside the traced model, not
    a Linear inside a whole untraced sub-network such as a vision tower, where a gather per Linear
    would be a poor plan) and has no role (it might read the weight itself), and whose output
    features ``tp`` divides (every tp when the tp size is unknown: even ones are taken).
    """
    if a.model is None:
        return a
    traced = {d["param"] for n, d in a.graph.nodes(data=True) if d["kind"] in ("param", "buffer") and readers(a.graph, n)}
    owners = {}
    for module_name, module in a.model.named_modules(remove_duplicate=False):
        for param in module.parameters(recurse=False):
            owners.setdefault(id(param), set()).add(module_name)
    stacks = tuple(prefix + "." for prefix in a.groups.groups)
    ran = {m for _, d in a.graph.nodes(data=True) for m in d.get("stack") or ()} | {""}
    roles = dict(a.roles)
    for fqn, module in a.model.named_modules():
        if type(module) is not nn.Linear or not fqn or fqn.startswith(stacks) or fqn in roles:
            continue
        if f"{fqn}.weight" in traced or any(len(owners[id(p)]) > 1 for p in module.parameters()):
            continue
        if any(fqn.startswith(m + ".") for m in roles) or module.out_features % (a.tp_size or 2):
            continue
        if fqn.rpartition(".")[0] not in ran:
            continue
        roles[fqn] = Role("gathered_column", "the traced forward never calls it; column-sharded with its "
                          "output all-gathered, which is right for any input the ranks share", (fqn,))
    return replace(a, roles=roles)


@post_pass(order=170)
def untraced_siblings(a: Analysis) -> Analysis:
    """Entries of an ``nn.ModuleList`` inside a traced layer that the trace never calls, shaped like
    an entry it does call, get that entry's roles.

    A layer that stands for several may pick one entry of a list by its layer index: Zamba2's shared
    block holds one low-rank adapter per hybrid layer (``gate_up_proj_adapter_list[layer_idx]``),
    and the traced layer runs only its own. The other layers run theirs the same way, so those are
    planned like the one traced; left whole, they would add a full-width output to a sharded one.
    Where a role names the traced entry's modules (the column Linears whose input a module shares),
    the siblings' are named with them: each layer's pre-hook then finds the one its layer calls.
    """
    if a.model is None:
        return a
    ran = {m for _, d in a.graph.nodes(data=True) for m in d.get("stack") or ()}
    stacks = set(a.groups.groups)
    copies: dict[str, list[str]] = {}  # a called entry -> its uncalled siblings of the same shape
    for fqn in a.roles:
        parts = fqn.split(".")
        for i in range(1, len(parts)):
            parent, entry = ".".join(parts[:i]), f"{'.'.join(parts[:i])}.{parts[i]}"
            if parent in stacks or entry in copies or entry not in ran:
                continue
            try:
                container = a.model.get_submodule(a.groups.original(parent)[0])
            except AttributeError:
                continue
            if not isinstance(container, nn.ModuleList) or not parts[i].isdigit():
                continue
            signature = block_signature(container[int(parts[i])])
            # An empty slot (``None``) has nothing to plan; block_signature tells it from any module.
            siblings = [f"{parent}.{j}" for j, other in enumerate(container)
                        if f"{parent}.{j}" not in ran and other is not None
                        and block_signature(other) == signature]
            if siblings:
                copies[entry] = siblings
    if not copies:
        return a
    roles = dict(a.roles)
    for fqn, role in a.roles.items():
        for entry, siblings in copies.items():
            if fqn == entry or fqn.startswith(entry + "."):
                for sibling in siblings:
                    roles.setdefault(sibling + fqn[len(entry):], role)

    def widened(module: str, names: tuple[str, ...]) -> tuple[str, ...]:
        out = list(names)
        for name in names:
            full = f"{module}.{name}"
            for entry, siblings in copies.items():
                if entry.startswith(module + ".") and full.startswith(entry + "."):  # names below the module
                    out += [(sibling + full[len(entry):])[len(module) + 1:] for sibling in siblings]
        return tuple(dict.fromkeys(out))

    for fqn, role in list(roles.items()):
        if role is not None and (role.names or role.shared_columns):
            roles[fqn] = replace(role, names=widened(fqn, role.names), shared_columns=widened(fqn, role.shared_columns))
    log.info("untraced siblings: %d list entries planned like the one traced", sum(map(len, copies.values())))
    return replace(a, roles=roles)




def _logged(step: Callable[[Analysis], Analysis], a: Analysis) -> Analysis:
    out = step(a)
    changed = sorted(m for m in out.roles.keys() | a.roles.keys() if out.roles.get(m) != a.roles.get(m))
    if changed:
        log.info("%s: %d roles changed (%s)", step.__name__, len(changed), ", ".join(changed[:8]))
    return out


def _warn_whole(module: str, what: str, size: int, tp_size: int) -> None:
    """The warning for a module kept whole because ``tp_size`` does not divide its ``size``: the plan
    is still given (the rest sharded), and the user learns what each rank holds whole, and why."""
    sizes = working_tp_sizes([size])
    hint = f"tp in {sizes} would split it" if len(sizes) > 1 else "no tp above 1 divides it"
    warnings.warn(f"autotp: {module} kept whole on every rank: its {size} {what} do not split over tp={tp_size} "
                  f"({hint})", UserWarning, stacklevel=2)


def indivisible_vocab(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], tp_size: int | None) -> dict[str, str]:
    """The output head (vocab-sharded logits) when ``tp_size`` does not divide the vocabulary
    (GPT-2's 50257 at any even tp): kept whole, with a warning, rather than the model refused.
    Padding the vocabulary to a multiple of tp would shard it, but changes the logits' shape that
    ``labels=`` losses and ``generate`` read; whole is exact. A tied embedding follows through the
    tie constraint."""
    if not tp_size:
        return {}
    found = {}
    for root in flow.roots:
        module, size = module_of(g, root), flow.extent.get(root, 0)
        role = roles.get(module)
        if role is not None and role.kind == "head" and size % tp_size:
            found[root] = f"its {size} {_VOCAB_WHOLE}{tp_size}; kept whole"
    return found


# The reason indivisible_vocab gives; the divisibility pass warns for the modules it finds it in.
_VOCAB_WHOLE = "output features (the vocabulary) do not split over tp="
_VOCAB_REASON = re.compile(r"its (\d+) output features \(the vocabulary\) do not split over tp=")


def _warn_whole_heads(roles: dict[str, Role], tp_size: int) -> None:
    """Warn for each output head :func:`indivisible_vocab` kept whole, once the plan stands (a model
    refused for another size gets the refusal alone)."""
    for module, role in sorted(roles.items()):
        found = _VOCAB_REASON.search(role.reason or "") if role is not None else None
        if found and role.kind == "replicate":
            _warn_whole(module, "output features (the vocabulary)", int(found.group(1)), tp_size)


def indivisible_tables(g: nx.DiGraph, roles: dict[str, Role], tp_size: int) -> dict[str, Role]:
    """Vocab-parallel embeddings whose rows ``tp_size`` does not divide (OPT's 2050 positions at
    tp=4) stay whole: a small table costs less replicated than a plan that cannot be applied."""
    out = {}
    for name, data in g.nodes(data=True):
        role = roles.get(data["module"])
        if data["op"] != "embedding" or role is None or role.kind != "vocab_embedding":
            continue
        rows = g.nodes[data["args"][0].name]["shape"][0]
        if rows % tp_size:
            _warn_whole(data["module"], "rows (the vocabulary)", rows, tp_size)
            # Under SP a whole table that starts the stream hands each rank its positions' slice.
            out[data["module"]] = Role("replicate", f"its {rows} rows do not split over tp={tp_size} (tp in "
                                       f"{working_tp_sizes([rows])} would); kept whole", role.evidence,
                                       seq_output=role.seq_output)
    return out


def check_divisible(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], tp_size: int,
                    skip: set[str] = frozenset()) -> None:
    """Every sharded extent (heads, features, parts) must split evenly over ``tp_size`` ranks.

    ``skip``: roots sharded another way (kv projections replicated per head).

    Raises:
        MeshError: naming the module, the extent found and the tp sizes that would work.
    """
    for root in sorted(set(flow.roots) - set(skip), key=lambda n: g.nodes[n]["order"]):
        module = module_of(g, root)
        sizes = roles[module].sizes or () if module in roles else ()
        for size in (flow.extent.get(root, 0), *sizes):
            if size > 0 and size % tp_size:
                raise MeshError(module=module, found=f"its sharded output reaches a dim of size {size} (heads or "
                                f"features), which tp={tp_size} does not divide",
                                fix=f"use tp in {working_tp_sizes([size])}", tp_sizes=working_tp_sizes([size]))
