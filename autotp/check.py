"""Static plan checking: find what makes a plan wrong before any numerics run.

:func:`check_plan` reads any plan (handwritten, transformers', a user's dict) against the model's
dataflow graph, the same graph the synthesizer analyses: it starts a shard at every Linear the plan
shards column-wise (experts columns under ``ExpertsParallel`` included) and follows it with the
synthesizer's propagation rules (a ``repeat`` of the sharded heads folds them, as there). What the shard meets
says what the plan must do: a row-parallel Linear to close it, a packed style where the output is
cut into parts, an exact style for a norm that reduces over it or whose gradient becomes partial.
Each :class:`Finding` names the module, the problem and the fix.

The checker knows styles only by what they declare (:mod:`autotp.styles.declared`: a column or a
row, packed parts, per-head parameters, reduced gradients, divided counts, sliced entries): a new
style is checked once its ``declares()`` says what it shards, with no change here.

Where tp exceeds the kv heads, a k/v projection under :class:`~autotp.styles.ReplicatedKVColwise`
is read as the synthesizer reads it: its shard may view off one head, and each rank holds the kv
head its query heads read (its ``kv_heads`` must be the heads its output reaches attention with).
Grouped parts copied per rank (:class:`~autotp.styles.GroupCopies`) are read on the expanded model
their base styles shard, once the expansion is proven to compute what the model computes.

Only the traced representatives of repeated layers are checked (``layers.0`` of each distinct
layer type); per-layer overrides in a plan for other layers are checked for keys and sizes only.
Sequence-parallel layouts are not checked here; :func:`autotp.verify` covers them numerically.
"""

from __future__ import annotations

import logging
from collections import defaultdict
from dataclasses import dataclass
from functools import partial

from torch import nn
from torch.distributed.tensor.parallel.style import ParallelStyle

from autotp.apply import check_divisible, check_tied_styles
from autotp.check_cache import cached_findings
from autotp.copying import deep_copy
from autotp.styles.declared import NOTHING, Shards, chain_declaration, declaration
from autotp.styles.group_copies import Copies, expand_module
from autotp.errors import AutoTPError
from autotp.hf_plans import as_styles
from autotp.plan import Plan, base_style, describe_plan, describe_style, key_matches
from autotp.synth.fixpoint import bad_packs, endless_shards, mixed_parts, wider_attention
from autotp.synth.propagation import propagate_packed, unmet_scatters
from autotp.synth.queries import is_linear, linear_weight, part_sizes, raw_weight, weight_of
from autotp.synth.assign import expert_roles, norm_roles
from autotp.synth.copies import expanded_sizes
from autotp.synth.graph import build_graph
from autotp.synth.groups import _materialized, _random_like
from autotp.synth.local_run import capture_inputs, inner_roles
from autotp.synth.localize import candidate_names, with_rewrites, with_width_view
from autotp.synth.param_roles import param_roles
from autotp.synth.queries import reading_module
from autotp.synth.roles import Role
from autotp.synth.shape_proof import head_names, runs_into_other_shapes, shape_proof, shaped_roots, shaped_sizes
from autotp.synth.trace import LayerGroups, collapsed, example_args, on_meta, trace

log = logging.getLogger(__name__)

# What each role the graph demands needs from the plan: (whether a style's declaration meets it, fix).
_REQUIRED = {
    "head_norm": (
        lambda shards: shards.head_params,
        "its weight gradient is a per-rank partial sum over the heads each rank holds; "
        "use ReplicatedWithGradAllReduce() (replicated weight, gradient all-reduced)",
    ),
    "width_norm": (
        lambda shards: shards.width_norm,
        "it reduces over the sharded width (a norm over the full projected features); "
        "use WidthShardedNorm() or leave the projection before it replicated",
    ),
    "experts": (
        lambda shards: shards.experts is not None,
        "its experts read sharded activations; use ExpertsParallel()",
    ),
}


@dataclass(frozen=True)
class Finding:
    """One problem of a plan: where, what, and how to fix it."""

    module: str
    problem: str
    fix: str
    kind: str
    tp_sizes: tuple[int, ...] = ()  # tp sizes that clear it, when it is about tp (named in ``fix`` too)

    def __str__(self) -> str:
        return f"{self.module}: {self.problem.rstrip('.')}. Fix: {self.fix.rstrip('.')}."


def _resolve_findings(model: nn.Module, plan: Plan) -> tuple[dict[str, tuple[str, ParallelStyle]], list[Finding]]:
    """Plan keys per module, plus findings for keys matching nothing and keys in conflict."""
    names = [name for name, _ in model.named_modules() if name]
    resolved: dict[str, tuple[str, ParallelStyle]] = {}
    findings = []
    for key, style in plan.items():
        hits = [name for name in names if key_matches(key, name)]
        if not hits:
            findings.append(Finding(key, f"plan key matches no module ({type(style).__name__})",
                                    "correct the key or remove it", "unmatched_key"))
        for name in hits:
            if name in resolved and describe_style(resolved[name][1]) != describe_style(style):
                other_key, other = resolved[name]
                findings.append(Finding(name, f"matched by {other_key!r} ({other!r}) and {key!r} ({style!r})",
                                        "keep one key for this module", "conflicting_keys"))
            resolved[name] = (key, style)
    return resolved, findings


def _size_findings(model: nn.Module, plan: Plan, tp_size: int) -> list[Finding]:
    findings = []
    for check, kind in ((lambda: check_divisible(model, tp_size, plan), "indivisible"),
                        (lambda: check_tied_styles(model, plan), "tied_weights")):
        try:
            check()
        except AutoTPError as error:
            found = error.found + (f" ({error.required})" if error.required else "")
            findings.append(Finding(error.module, found, error.fix, kind, error.tp_sizes))
    return findings


def _raw_kind(g, node: str, shards: Shards) -> str | None:
    """``"column"`` / ``"row"`` when a style declaring ``shards`` (raw weights multiplied like a
    Linear's) shards the raw weight of Linear-like node ``node`` so; None otherwise."""
    if shards.raw_linear is None or not raw_weight(g, node):
        return None
    leaf = reading_module(g, linear_weight(g, node))[1]  # a child's weight read here is dotted
    columns, rows = shards.raw_linear
    return "column" if leaf in columns else "row" if leaf in rows else None


def _experts_kind(g, node: str, shards: Shards) -> str | None:
    """``"column"`` / ``"row"`` when a style declaring ``shards`` (per-expert weights) shards the
    3-D per-expert weight that node ``node`` multiplies by on its output / input features (the
    rank's share of every expert's FFN); None otherwise."""
    weight = weight_of(g, node)
    if shards.experts is None or weight is None or len(g.nodes[weight.node]["shape"]) != 3:
        return None
    dim = shards.experts.get(reading_module(g, weight.node)[1])
    return "column" if dim == weight.out_dim else "row" if dim == weight.in_dim else None


def _experts_parts(g, node: str, shards: Shards, sizes: tuple[int, ...]) -> Finding | None:
    """A finding when experts columns (node ``node``) whose output the graph cuts into the parts
    ``sizes`` are not packed alike by their per-expert style (which packs equal parts only: the
    rank's share of each)."""
    module, name = reading_module(g, linear_weight(g, node))
    given = shards.experts_packed.get(name, 1)
    if len(set(sizes)) == 1 and given == len(sizes):
        return None
    if len(set(sizes)) == 1:
        return Finding(module, f"its experts' output is split into {len(sizes)} equal parts {sizes}, but its "
                       f"style packs {name} as {given} part(s), so ranks get mixed parts",
                       f"use ExpertsParallel(..., packed={{{name!r}: {len(sizes)}}})", "fused_sizes")
    return Finding(module, f"its experts' output is split into unequal parts {sizes}, which ExpertsParallel "
                   "cannot pack", "keep this module's experts whole", "fused_sizes")


def _starts_shard(shards: Shards) -> bool:
    """Column styles whose output stays sharded (a gathered output ends the shard at once)."""
    return shards.linear == "column" and shards.output_sharded


def _scatters_heads(shards: Shards) -> bool:
    """Row styles whose reduced output is scattered onto its last dim (one value per head)."""
    return shards.linear == "row" and shards.scatters_heads


def _held_whole(style: ParallelStyle | None) -> tuple[tuple[int, int], ...]:
    """The output features ``(start, end)`` a :class:`~autotp.styles.GroupCopies` holds whole on
    every rank (parts of one group: the one kv head of a fused multi-query qkv) around a column
    style; empty for any other style, or for copies of several groups (which the graph of the
    unexpanded model cannot place)."""
    copies = declaration(style).copies
    if copies is None or declaration(copies.base).linear != "column":
        return ()
    parts = copies.rows.get("weight", (0, 0, ()))[2]
    if not parts or any(part[2] != 1 or len(part) > 3 for part in parts):
        return ()
    return tuple(sorted((part[0], part[1]) for part in parts))


def _expanded_copies(resolved: dict) -> dict[str, ParallelStyle]:
    """The :class:`~autotp.styles.GroupCopies` of a plan (by module FQN) that the graph of the
    unexpanded model cannot place: copies of several groups, of a module's parameters, or with
    attribute values, and every copy under a module that has one. Their plan is read on the
    expanded model (where the copies are groups like the others), as the synthesizer analyses it
    (:mod:`autotp.synth.groups`); copies of one group of a Linear alone are read as parts held whole
    (:func:`_held_whole`)."""
    copies = {fqn: style for fqn, (_, style) in resolved.items() if declaration(style).copies is not None}
    unplaced = {fqn for fqn, style in copies.items() if style.values or not _held_whole(style)}
    return {fqn: style for fqn, style in copies.items()
            if any(fqn == top or fqn.startswith(top + ".") for top in unplaced)}


def _expanded_model(model: nn.Module, resolved: dict, expanded: dict, tp_size: int) -> tuple[nn.Module, dict]:
    """A copy of ``model`` with each of ``expanded``'s copies made (rows copied, attributes set:
    :func:`autotp.synth.groups.expand_module`), and ``resolved`` with each such style replaced by its
    base, the style the expanded module gets."""
    out = deep_copy(model)
    for fqn, style in expanded.items():
        expand_module(out.get_submodule(fqn), Copies(dict(style.rows), dict(style.values)), tp_size)
    return out, {fqn: (key, style.base if fqn in expanded else style) for fqn, (key, style) in resolved.items()
                 if fqn not in expanded or style.base is not None}


def _unproven_copies(model: nn.Module, expanded: dict, keys: dict[str, str], tp_size: int,
                     example_inputs) -> list[Finding]:
    """A finding for each plan key (``keys``: by module FQN) of ``expanded`` copies whose expansion
    changes what the model computes: the smallest module holding them (the copies' module, else its
    parent, and so on up to a layer) must give the unexpanded module's output on the inputs it gets
    in a forward, as the synthesizer proves its own copies (:func:`autotp.synth.groups.plan_copies`).
    A plan key's first module stands for the others (one proof per repeated layer)."""
    tops = [fqn for fqn in expanded if not any(fqn.startswith(o + ".") for o in expanded)]
    firsts = {}  # one module per plan key: repeated layers are checked by their first
    for fqn in tops:
        firsts.setdefault(keys[fqn], fqn)
    chains = {fqn: [a for a in _ancestors(fqn) if a] for fqn in firsts.values()}
    inputs = _module_inputs(model, example_inputs, {a for chain in chains.values() for a in chain})
    findings = []
    for top, chain in chains.items():
        for holder in chain:
            if holder not in inputs:
                continue
            target, args = inputs[holder]
            inner = {fqn[len(holder) + 1:] if fqn != holder else "": Copies(dict(s.rows), dict(s.values))
                     for fqn, s in expanded.items() if fqn == holder or fqn.startswith(holder + ".")}
            if _same_output(target, inner, tp_size, args):
                log.info("check: GroupCopies under %s proven at %s; the plan is read on the expanded model",
                         top, holder)
                break
        else:
            findings.append(Finding(top, "its GroupCopies change what it computes: no module holding the copies "
                                    "gives the unexpanded output once they are made, so the ranks hold other groups "
                                    "than their heads read", "correct the copied rows and attribute values (as "
                                    "synthesize(tp_size=...) writes them) or keep the module whole", "group_copies"))
    return findings


def _ancestors(fqn: str) -> list[str]:
    """``fqn`` and the modules above it, innermost first (the root, ``""``, last)."""
    parts = fqn.split(".")
    return [".".join(parts[:i]) for i in range(len(parts), -1, -1)]


def _module_inputs(model: nn.Module, example_inputs, fqns: set[str]) -> dict:
    """``fqn -> (module, (args, kwargs))`` for each module of ``fqns`` that runs in a forward of
    ``model``: the real module and its inputs, or, on meta, a copy with random weights and random
    inputs of the shapes it gets (:func:`autotp.synth.local_run.capture_inputs`)."""
    import torch

    if on_meta(model):
        captured = capture_inputs(model, example_inputs, fqns, LayerGroups())
        made = {fqn: (_materialized(model.get_submodule(fqn)), _random_like(captured[fqn])) for fqn in captured}
        return {fqn: pair for fqn, pair in made.items() if pair[0] is not None}
    found, handles = {}, []

    def keep(module, args, kwargs, fqn):
        found.setdefault(fqn, (module, (args, kwargs)))  # returns None: the inputs go on unchanged

    for fqn in fqns:
        handles.append(model.get_submodule(fqn).register_forward_pre_hook(partial(keep, fqn=fqn), with_kwargs=True))
    args, kwargs = example_args(model, example_inputs)
    try:
        with torch.no_grad():
            model(*args, **kwargs)
    except Exception:  # noqa: BLE001 - a model that does not run proves nothing: the modules reached count
        pass
    finally:
        for handle in handles:
            handle.remove()
    return found


def _same_output(module: nn.Module, copies: dict, tp_size: int, inputs) -> bool:
    """Whether ``module`` gives the same output (every tensor in it) with ``copies`` (relative
    path -> :class:`~autotp.synth.groups.Copies`) expanded in a copy of it as without."""
    import torch
    from torch.utils import _pytree as pytree

    def run(mod):
        with torch.no_grad():
            out = mod(*inputs[0], **inputs[1])
        return [t for t in pytree.tree_leaves(out) if isinstance(t, torch.Tensor)]

    training = module.training
    module.eval()  # dropout would make the two runs differ
    try:
        reference = run(module)
        trial = deep_copy(module)
        for path, spec in copies.items():
            expand_module(trial.get_submodule(path), spec, tp_size)
        output = run(trial)
    except Exception:  # noqa: BLE001 - a shape the copies leave inconsistent: not proven here
        return False
    finally:
        module.train(training)
    return len(output) == len(reference) and all(
        a.shape == b.shape and (not a.is_floating_point() or torch.allclose(a, b, atol=1e-5, rtol=1e-4))
        for a, b in zip(output, reference))


def _graph_findings(model: nn.Module, resolved: dict, example_inputs, tp_size: int = 2,
                    analysis=None) -> list[Finding]:
    if analysis is not None:
        g, groups = analysis.graph, analysis.groups
    else:
        program, groups = trace(model, example_inputs)
        g = build_graph(program)
    # What each module's style declares: the style that places its parameters (``base``), and the
    # whole wrapper chain (``chain``: what wrappers add at the boundary: sliced entries, width views,
    # reduced statistics).
    style_of = {fqn: base_style(style) for fqn, (_, style) in resolved.items()}
    held = {fqn: _held_whole(style) for fqn, style in style_of.items()}
    held = {fqn: spans for fqn, spans in held.items() if spans}
    style_of.update({fqn: style_of[fqn].base for fqn in held})
    base = {fqn: declaration(style) for fqn, style in style_of.items()}
    chain = {fqn: chain_declaration(style) for fqn, (_, style) in resolved.items()}

    def of(module) -> Shards:
        return base.get(module, NOTHING)

    linears = {n: g.nodes[n]["module"] for n in g.nodes if is_linear(g, n)}
    linear_modules = set(linears.values())
    active = {n for n, module in linears.items()
              if _starts_shard(of(module)) or _raw_kind(g, n, of(module)) == "column"
              or _experts_kind(g, n, of(module)) == "column" or _scatters_heads(of(module))}
    packed = {n for n in active if of(linears[n]).sizes}
    copied = {n: frozenset(held[linears[n]]) for n in active if linears[n] in held}
    scattered = frozenset(n for n in active if _scatters_heads(of(linears[n])))
    kv = frozenset(n for n in active if of(linears[n]).kv_repeat is not None)
    flow = propagate_packed(g, active, packed, unit_heads=kv, copied=copied, head_scatters=scattered)
    findings = []

    def where(node):
        return f"{g.nodes[node]['op']} in {g.nodes[node]['module'] or 'the root'}"

    findings += _kv_findings(g, flow, kv, {n: of(linears[n]).kv_repeat for n in kv}, tp_size)
    for root, (reason, node) in flow.broken.items():
        findings.append(Finding(linears[root], f"its column-sharded output meets {where(node)}: {reason}",
                                "replicate this Linear, gather its output, or shard what follows it exactly",
                                "breaks_shard"))
    for source, module in sorted(flow.entry_shards):
        if not chain.get(module, NOTHING).slices_entries:
            findings.append(Finding(module, f"its sharded heads meet a value made outside it that holds every head "
                                    f"({g.nodes[source]['shape']}), handed over whole",
                                    "slice that argument to the module's heads at entry (ShardedInputs), or "
                                    "replicate the head projections", "entry_not_sliced"))
    for row in sorted(n for n in active if _scatters_heads(of(linears[n])) and n not in flow.scatters):
        findings.append(Finding(linears[row], "its output is scattered onto its last dim, but it does not make one "
                                "value per head of a sharded input (a row whose output features number its heads)",
                                "use RowwiseParallel() (output reduced whole)", "scatter_not_per_head"))
    for row, reason in unmet_scatters(flow).items():
        findings.append(Finding(linears[row], reason, "use RowwiseParallel() (output reduced whole)", "unmet_scatter"))
    for root, reason in {**mixed_parts(flow), **bad_packs(flow), **endless_shards(flow)}.items():
        findings.append(Finding(linears[root], f"column-sharded, but {reason}",
                                "pair it with a row-parallel Linear or gather its output", "unclosed_column"))
    for root, ranges in flow.splits.items():
        module, shards = linears[root], of(linears[root])
        sizes = part_sizes(ranges, g.nodes[root]["shape"][-1])
        if root in copied:  # the style's sizes count each part held whole tp times
            sizes = expanded_sizes(sizes, tuple(copied[root]), tp_size)
        packed = shards.sizes if shards.linear == "column" else None
        if shards.experts is not None:  # one finding per module, not per expert's product
            found = _experts_parts(g, root, shards, sizes)
            findings += [found] if found is not None and found not in findings else []
            continue
        if not packed:
            findings.append(Finding(module, f"its output is split into parts {sizes} but it is sharded "
                                    "contiguously, so ranks get mixed parts and the logits are wrong",
                                    f"use Colwise(sizes={sizes})", "fused_contiguous"))
        elif packed != sizes:
            findings.append(Finding(module, f"Colwise sizes {packed} differ from the parts "
                                    f"{sizes} the graph cuts", f"use sizes={sizes}", "fused_sizes"))
    for row in flow.rows:
        shards, sizes = of(linears[row]), flow.row_packs.get(row)
        given = shards.sizes if shards.linear == "row" else sizes
        if given != sizes:  # its weight's columns would not be the features each rank holds
            held = f"hold parts {sizes} with a share of each on every rank" if sizes else "are one contiguous block"
            findings.append(Finding(linears[row], f"its input features {held}, but its style takes them as "
                                    f"{f'parts {given}' if given else 'one contiguous block'}, so each rank multiplies "
                                    "its features by other features' weights",
                                    f"use sizes={sizes}" if sizes else "drop its sizes", "packed_row"))
    reached_rows = {linears[r] for r in flow.rows}
    rowwise = {linears[r] for r in flow.rows if of(linears[r]).linear == "row"
               or "row" in (_raw_kind(g, r, of(linears[r])), _experts_kind(g, r, of(linears[r])))}
    for row in reached_rows:
        if row not in rowwise:
            findings.append(Finding(row, "receives a column-sharded input but is not row-parallel, so it "
                                    "reads a slice of the features as if it were all of them",
                                    "make it RowwiseParallel() (or gather the producer's output)", "missing_row"))
    for module, shards in base.items():
        expects_shard = shards.linear == "row" and shards.input_sharded
        if expects_shard and module in linear_modules and module not in reached_rows:
            findings.append(Finding(module, "row-parallel, but its input is not column-sharded by the plan",
                                    "shard the Linear that produces its input column-wise, or use "
                                    "RowwiseParallel(input_layouts=Replicate())", "row_without_shard"))
    # Every experts module reached is the plan's own (its evidence unused here).
    reached = defaultdict(lambda: Role("experts", ""))
    demanded = {**norm_roles(g, flow, linear_modules), **expert_roles(g, flow, {}, reached)}
    for module, role in demanded.items():
        need = _REQUIRED.get(role.kind)
        if need and not need[0](of(module)):
            problem, _, fix = need[1].partition("; ")
            findings.append(Finding(module, problem, fix, f"{role.kind}_style"))
    for module in flow.width_stats:
        if not chain.get(module, NOTHING).statistics:
            findings.append(Finding(module, "its code takes statistics (a mean, a std) over the width its column "
                                    "Linears shard, so each rank would read only its own slice",
                                    "use ShardedStatistics() on it and ColwiseParallel(use_local_output=False) on "
                                    "its columns, or leave those columns replicated", "width_stats_style"))
    findings += _param_findings(g, flow, base, {**{m: None for m in linears.values()}, **demanded})
    roles = _plan_roles(base, linear_modules)
    views = {fqn: shards.width_view for fqn, shards in chain.items() if shards.width_view is not None}
    rewrites = {fqn: shards.rewrites for fqn, shards in chain.items() if shards.rewrites}
    findings += _reshape_findings(model, g, flow, roles, base, (groups, example_inputs), tp_size, views, rewrites)
    return findings


def _kv_findings(g, flow, roots: frozenset, repeats: dict, tp_size: int) -> list[Finding]:
    """k/v projections a :class:`~autotp.styles.ReplicatedKVColwise` repeats over the ranks whose
    heads do not reach attention as that style says: it must be the k or v of an attention with more
    query heads than its kv heads (:func:`~autotp.synth.fixpoint.wider_attention`), and its
    ``kv_heads`` / ``head_dim`` must be the heads its output is viewed into there (the shard's
    extent), as the synthesizer reads them (:mod:`autotp.synth.kvheads`); else each rank copies
    rows that are not the head its query heads read."""
    findings = []
    for root in sorted(roots, key=lambda n: g.nodes[n]["order"]):
        (kv_heads, head_dim), module = repeats[root], g.nodes[root]["module"]
        if root in flow.broken:
            continue  # its shard breaks: that finding says more
        width, heads = g.nodes[root]["shape"][-1], flow.extent.get(root, 0)
        declared = f"ReplicatedKVColwise(kv_heads={kv_heads}, head_dim={head_dim})"
        if wider_attention(flow, root) is None:
            findings.append(Finding(module, f"{declared}, but its output is not the keys or values of an attention "
                                    "with more query heads than its heads, so no rank's query heads read the head "
                                    "it is given", "use ColwiseParallel() (or keep it whole)", "kv_not_grouped"))
        elif (kv_heads, head_dim) != (heads, width // max(heads, 1)) or tp_size % kv_heads:
            fix = (f"use ReplicatedKVColwise(kv_heads={heads}, head_dim={width // heads})" if heads and
                   tp_size % heads == 0 else f"use tp a multiple of its {heads} kv heads")
            findings.append(Finding(module, f"{declared}, but its {width} output features reach attention as "
                                    f"{heads} head(s) of {width // max(heads, 1)} features (tp={tp_size})",
                                    fix, "kv_heads"))
    return findings


def _param_findings(g, flow, declared: dict, taken: dict) -> list[Finding]:
    """Parameters of a module that meet a sharded activation without a style that shards them with
    the heads or reduces their gradient (:func:`autotp.synth.params.param_roles`)."""
    findings = []
    roles = {m: r if r is not None else Role("column", "") for m, r in taken.items()}
    for module, role in param_roles(g, flow, roles).items():
        shards = declared.get(module, NOTHING)
        shard_dims = shards.param_dims or {}
        for name, dim in role.param_dims:
            if shard_dims.get(name) != dim:
                findings.append(Finding(
                    module, f"its parameter {name} meets the sharded heads along its dim {dim} but is not "
                    "sharded with them, so each rank reads entries of other ranks' heads or fails on the shape",
                    f"use HeadParams(shard_dims={dict(role.param_dims)}, reduce={role.grad_reduced})", "head_params_style"))
        packed = shards.param_packed or {}
        for name, sizes in role.param_packed:
            if packed.get(name) != sizes:
                findings.append(Finding(
                    module, f"its parameter {name} is sharded with the parts {sizes} of a packed Linear but not "
                    "packed like them, so each rank reads entries of other parts",
                    f"use HeadParams(..., packed={dict(role.param_packed)})", "packed_params_style"))
        reduced = shards.reduces(role.grad_reduced)
        if role.grad_reduced and not reduced:
            findings.append(Finding(
                module, f"its parameters {', '.join(role.grad_reduced)} meet a sharded activation, so each "
                "rank's gradient covers only its own heads (a partial sum) and the replicas drift apart",
                f"use HeadParams(shard_dims={dict(role.param_dims)}, reduce={role.grad_reduced})", "partial_grad"))
    return findings


def _plan_roles(declared: dict, linear_modules: set[str]) -> dict:
    """The roles the styles' declarations (``declared``, by module) give the traced modules, as the
    per-rank shape proof reads them."""
    roles = {}
    for module, shards in declared.items():
        in_out, sizes = shards.weight_in_out, shards.sizes
        if module in linear_modules and shards.kv_repeat is not None:
            roles[module] = Role("kv_column", "", head_dim=shards.kv_repeat[1])
        elif module in linear_modules and _starts_shard(shards):
            roles[module] = Role("packed_column" if sizes else "column", "", sizes=sizes, weight_in_out=in_out)
        elif module in linear_modules and shards.linear == "row":
            roles[module] = Role("row", "", weight_in_out=in_out, scatter_heads=_scatters_heads(shards))
        elif shards.width_norm:
            roles[module] = Role("width_norm", "")
        elif shards.raw_linear is not None:
            roles[module] = Role("linear_params", "", param_dims=tuple(shards.param_dims.items()),
                                 columns=shards.raw_linear[0], rows=shards.raw_linear[1])
        elif shards.param_dims is not None:
            roles[module] = Role("head_params", "", param_dims=tuple(shards.param_dims.items()))
    return roles


def _reshape_findings(model: nn.Module, g, flow, roles: dict, declared: dict, context, tp_size: int,
                      views: dict | None = None, rewrites: dict | None = None) -> list[Finding]:
    """Modules that, run alone at per-rank widths with the attributes the plan divides, reshape a
    column shard into other shapes than the global ones with the heads divided (a fixed head count
    with an inferred head size): the per-rank shape proof of :mod:`autotp.synth.localize`. ``views``:
    per module, the arguments it sees at per-rank width and their readers (its ``LocalWidthInputs``);
    ``rewrites``: per module, the styles that rewrite its code (each replayed on the per-rank copy)."""
    views, rewrites = views or {}, rewrites or {}
    groups, example_inputs = context
    by_module = {m: r for m, r in shaped_roots(g, flow, roles).items()
                 if m and not declared.get(m, NOTHING).kv_counts}
    if not by_module:
        return []
    findings = []
    captured = capture_inputs(model, example_inputs, set(by_module), groups)
    for fqn, roots in by_module.items():
        sizes = shaped_sizes(g, flow, roots)
        if fqn not in captured or any(v % tp_size for v in sizes):
            continue
        view = views.get(fqn)
        names = declared.get(fqn, NOTHING).counts or ()
        inner = inner_roles(roles, fqn) if view is None else with_width_view(inner_roles(roles, fqn), view)
        inner = with_rewrites(inner, rewrites[fqn]) if fqn in rewrites else inner
        with collapsed(model, groups):
            module = model.get_submodule(fqn)
            traces: dict = {}  # the block's global trace, exported once for the three steps
            if not runs_into_other_shapes(module, captured[fqn], inner, tp_size, tuple(names), traces):
                continue
            main = shape_proof(module, captured[fqn], inner, tp_size, traces=traces)
            fix_names = head_names(module, captured[fqn], inner, candidate_names(module, {v for v in sizes if v > 1}),
                                   tp_size, main, traces=traces)
        linears = ", ".join(sorted({g.nodes[r]["module"] for r in roots}))
        divided = f" with {', '.join(names)} divided by tp" if names else ""
        fix = (f"divide {', '.join(fix_names)} by tp: ShardCounts(names={fix_names})" if fix_names else
               f"replicate {linears}: no integer attribute divided by tp makes the per-rank shapes right")
        findings.append(Finding(fqn, f"run at per-rank widths{divided}, it reshapes the column-sharded output of "
                                f"{linears} into other shapes than the global ones with the heads divided (a head "
                                "count or width fixed in the code), so each rank computes with other heads",
                                fix, "reshape_heads"))
    return findings


def check_plan(model: nn.Module, plan: Plan, *, tp_size: int, example_inputs=None, analysis=None) -> list[Finding]:
    """Problems of ``plan`` for ``model`` at ``tp_size``, found statically (no numerics run).

    Args:
        model: the model (meta device is fine).
        plan: the plan to check (styles, or transformers' style strings: see :func:`autotp.hf_plans.as_styles`).
        tp_size: the tensor-parallel size the plan is meant for.
        example_inputs: inputs to trace a non-transformers model with (as for ``synthesize``).
        analysis: the synthesizer's :class:`~autotp.synth.Analysis` of this model, when one was made
            (a synthesized choice carries it): its graph is checked, without tracing again.

    Returns:
        The findings, empty when the plan is consistent with the graph.
    """
    plan = as_styles(model, plan)
    if example_inputs is None and analysis is None:  # the command line keeps answers (check_cache.py)
        compute = lambda: _findings(model, plan, tp_size, None, None)  # noqa: E731
        return cached_findings(model, describe_plan(plan), tp_size, compute, Finding)
    return _findings(model, plan, tp_size, example_inputs, analysis)


def _findings(model: nn.Module, plan: Plan, tp_size: int, example_inputs, analysis) -> list[Finding]:
    """:func:`check_plan` of a plan of styles."""
    resolved, findings = _resolve_findings(model, plan)
    if any(f.kind == "conflicting_keys" for f in findings):
        return findings
    unmatched = {f.module for f in findings if f.kind == "unmatched_key"}
    findings += _size_findings(model, {k: v for k, v in plan.items() if k not in unmatched}, tp_size)
    if any(f.kind == "indivisible" for f in findings):
        return findings  # heads cut in pieces: every graph finding would repeat this one
    expanded = _expanded_copies(resolved)
    if expanded:
        unproven = _unproven_copies(model, expanded, {fqn: key for fqn, (key, _) in resolved.items()}, tp_size,
                                    example_inputs)
        if unproven:
            return findings + unproven
        model, resolved = _expanded_model(model, resolved, expanded, tp_size)
    if analysis is not None and bool(analysis.copies) != bool(expanded):
        analysis = None  # its graph is of the other model (expanded or not): trace this one
    findings += _graph_findings(model, resolved, example_inputs, tp_size, analysis)
    return findings
