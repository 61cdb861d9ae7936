"""Roles -> ParallelStyles (one function), and traced FQNs -> plan keys (``layers.*`` patterns)."""

from __future__ import annotations

import copy
from collections.abc import Callable

from torch.distributed.tensor import Partial, Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from autotp import styles
from autotp.plan import describe_style
from autotp.styles.linear import gathered_param_sizes, gathered_sizes
from autotp.synth.roles import Role
from autotp.synth.stages import idiom_kind
from autotp.synth.copies import row_copies
from autotp.synth.trace import LayerGroups


def _seq_in(role: Role) -> dict:
    return {"input_layouts": Shard(1)} if role.seq_input else {}


# Linear roles that wrap a plain input as a Replicate() DTensor themselves: with ``partial_grad`` they
# take it with a partial gradient instead (``Boundary(inputs="replicate", input_grad="partial")``).
_INPUT_COLUMNS = frozenset({"column", "packed_column", "kv_column", "head"})


def style_for(role: Role, *, loss_parallel: bool = True) -> ParallelStyle | None:
    """The ParallelStyle that realises ``role``, returning a copy where the caller writes the output."""
    style = _style_for(role, loss_parallel=loss_parallel)
    if role.kv_counts and role.kind != "kv_head_counts":  # tp > kv heads, on a module with a style of its own
        style = _kv_head_counts(role, loss_parallel, base=style)
    if role.rewrites and role.kind == "shard_counts" and not role.names:
        style = None  # nothing divided: the rewrite stands alone
    for rewrite in role.rewrites:  # its code rewritten for per-rank shapes (stages.shape_fix)
        style = rewrite.around(style)
    edges = {}
    if style is not None and role.owned_output:  # the caller writes the output in place: a copy
        edges["copy_output"] = True
    if role.partial_grad and role.kind in _INPUT_COLUMNS:
        edges.update(inputs="replicate", input_grad="partial")
    if edges:
        style = styles.Boundary(**edges, style=style)
    if role.entry_inputs:
        style = styles.ShardedInputs(inputs=role.entry_inputs, style=style)
    if role.shared_columns:
        style = styles.Boundary(inputs="replicate", columns=role.shared_columns, style=style,
                                input_grad="partial" if role.partial_grad else "whole")
    if role.width_view:
        style = styles.LocalWidthInputs(inputs=role.width_view[0], readers=role.width_view[1], style=style)
    if role.statistics:
        style = styles.ShardedStatistics(style=style)
    if role.region:
        style = styles.DTensorRegion(params=dict(role.region), replicated_outputs=role.seq_join,
                                     partial_outputs=role.partial_output, style=style)
    return style


def _style_for(role: Role, *, loss_parallel: bool = True) -> ParallelStyle | None:
    """The ParallelStyle that realises ``role`` (``None``: leave the module replicated)."""
    if role.weight_in_out and role.kind in ("column", "packed_column", "row", "head"):
        return _in_out_style(role, loss_parallel)
    builder = _STYLES.get(role.kind) or idiom_kind(role.kind)[1]  # a kind one idiom registered
    return builder(role, loss_parallel)


def _row(role: Role, loss_parallel: bool) -> ParallelStyle:
    # Rows shard weight columns and reduce: all-reduce, or reduce-scatter to Shard(1) when the
    # residual stream is sequence-sharded; one branch of a parallel block stays Partial() and is
    # reduced with the other at their sum.
    # With ``sizes`` its input features are parts, a share of each on every rank: columns permuted.
    if role.scatter_heads:  # one value per head: the reduction scattered onto the heads each rank holds
        return RowwiseParallel(output_layouts=Shard(-1))
    if role.partial_output or role.partial_local:
        return styles.Rowwise(output_layouts=Partial(), use_local_output=bool(role.partial_local), sizes=role.sizes)
    layouts = dict(output_layouts=Shard(1), use_local_output=False) if role.seq_output else {}
    if role.grad_spans and not role.seq_output:  # output spans broadcast along a sharded dim downstream
        return styles.Rowwise(reduce_grad_features=role.grad_spans, sizes=role.sizes)
    return styles.Rowwise(sizes=role.sizes, **layouts) if role.sizes else RowwiseParallel(**layouts)


def _packed_column(role: Role) -> ParallelStyle:
    style = styles.Colwise(sizes=role.sizes, **_seq_in(role))
    if not role.copied:
        return style
    # Parts held whole on every rank: expanded to tp copies of one group, then packed-column
    # sharded, so rank r holds its share of each sharded part and a whole copy of each held part.
    rows = row_copies(role)
    return styles.GroupCopies(base=style, rows={"weight": (0, *rows), "bias": (0, *rows)})


def _gathered(style: ParallelStyle | None) -> ParallelStyle | None:
    """``style`` with copied parts gathered (:class:`~autotp.styles.GroupCopies` or
    :class:`~autotp.styles.ReplicatedKVColwise` with ``gather=True``: a Linear's, or the rows of
    parameters packed like it, a depthwise conv's) where its form allows; otherwise as it is."""
    if isinstance(style, styles.ReplicatedKVColwise) and not style.gather:
        gathered = copy.copy(style)
        gathered.gather = True
        return gathered
    if (not isinstance(style, styles.GroupCopies) or style.gather
            or (gathered_sizes(style) is None and gathered_param_sizes(style) is None)):
        return style
    return styles.GroupCopies(base=style.base, rows=style.rows, values=style.values, gather=True)


def _kv_head_counts(role: Role, loss_parallel: bool, base: ParallelStyle | None = None) -> ParallelStyle:
    # The ratio and the query heads both become heads / tp per rank: one ratio attribute is named
    # as such (the common case, ``num_key_value_groups``), any other is set with the head counts.
    ratios = [n for n, k in role.kv_counts if k == "ratio"]
    return styles.ShardCounts(query_heads=role.heads, ratio=ratios[0] if ratios else None,
                              kv_names=tuple(n for n, k in role.kv_counts if k == "kv"),
                              head_names=tuple(ratios[1:] + [n for n, k in role.kv_counts if k == "heads"]),
                              base=base)


def _head(role: Role, loss_parallel: bool) -> ParallelStyle:
    # The head keeps its vocab-sharded logits as a DTensor for loss parallel.
    if loss_parallel:
        return ColwiseParallel(**_seq_in(role), output_layouts=Shard(-1), use_local_output=False)
    return ColwiseParallel(**_seq_in(role), output_layouts=Replicate())


def _vocab_embedding(role: Role, loss_parallel: bool) -> ParallelStyle:
    if role.seq_output:
        return styles.VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=Shard(1), use_local_output=False)
    return styles.VocabParallelEmbedding(input_layouts=Replicate())


def _seq_gather(role: Role, loss_parallel: bool) -> ParallelStyle:
    outputs = ("shard_all" if role.all_outputs else "shard") if role.seq_output else None
    style = styles.Boundary(inputs="gather", outputs=outputs, local_inputs=not role.dtensor_output)
    # Counts the block divides (a ``shard_counts`` role the sequence pass gathered): one style for both.
    return styles.ShardCounts(names=role.names, base=style) if role.names else style


def _experts(role: Role, loss_parallel: bool) -> ParallelStyle:
    return styles.ExpertsParallel(shard_dims=dict(role.param_dims), packed=dict(role.param_parts),
                   partial_grad_inputs=role.partial_grad_inputs, once=role.once,
                   scale_rows=role.scale_rows, **({"side": role.experts_side} if role.experts_side else {}),
                   **({"partial_grad_plain": True} if role.partial_grad else {}),
                   **({"partial_output": True} if role.seq_output else {}))


# Role kind -> style, one entry per kind of ``ROLE_KINDS`` (``None``: the module stays replicated); a
# kind one idiom registered (``stages.role_kind``) carries its style builder with it.
# Column Linears shard weight rows (Shard(0), as Linear is x @ W^T + b).
_STYLES: dict[str, Callable[[Role, bool], ParallelStyle | None]] = {
    "column": lambda role, lp: ColwiseParallel(**_seq_in(role), use_local_output=not role.dtensor_output),
    "gathered_column": lambda role, lp: ColwiseParallel(output_layouts=Replicate()),
    "kv_column": lambda role, lp: styles.ReplicatedKVColwise(kv_heads=role.kv_heads, head_dim=role.head_dim,
                                                             **_seq_in(role)),
    "kv_head_counts": _kv_head_counts,
    "packed_column": lambda role, lp: _packed_column(role),
    "row": _row,
    "head": _head,
    "vocab_embedding": _vocab_embedding,
    "head_norm": lambda role, lp: styles.ReplicatedWithGradAllReduce(),
    "width_norm": lambda role, lp: styles.WidthShardedNorm(shard_dim=role.shard_dim),
    "seq_norm": lambda role, lp: SequenceParallel(),
    "seq_params": lambda role, lp: styles.ReplicatedWithGradAllReduce(dtensor=True),
    "seq_norm_gather": lambda role, lp: styles.Boundary(
        outputs="gather", local_outputs=not role.dtensor_output, output_grad="partial" if role.partial_grad else "whole",
        style=SequenceParallel()),
    "shared_input": lambda role, lp: styles.Boundary(**({"output_grad": "partial"} if role.partial_grad
                                                        else {"outputs": "replicate"})),
    "whole_module": lambda role, lp: styles.Boundary(inputs="whole"),
    "broadcast_source": lambda role, lp: styles.Boundary(inputs="whole", reduce_grad_features=role.grad_spans),
    "router": lambda role, lp: styles.PartialGradRouter(partial_grad_plain=role.partial_grad),
    "shared_entry": lambda role, lp: styles.Boundary(inputs="replicate", columns=role.names,
                                                     input_grad="partial" if role.partial_grad else "whole"),
    "stream_block": lambda role, lp: styles.Boundary(inputs="replicate", outputs="local", stream=0),
    "stream_params": lambda role, lp: styles.ReplicatedWithGradAllReduce(dtensor=True),
    "experts": _experts,
    "seq_gather": _seq_gather,
    "seq_slice": lambda role, lp: styles.Boundary(inputs="slice"),
    # Whole tokens in (the dispatch indexes them); the experts' partial sums reduce-scattered out.
    "moe_block": lambda role, lp: styles.Boundary(inputs="gather", outputs="sum_shard",
                                                  local_inputs=not role.dtensor_output),
    "replicated_entry": lambda role, lp: styles.Boundary(inputs="replicate", outputs="local"),
    "rotary": lambda role, lp: styles.RotaryEmbedParallel(),
    "shard_counts": lambda role, lp: styles.ShardCounts(names=role.names),
    "head_params": lambda role, lp: styles.HeadParams(
        shard_dims=dict(role.param_dims), reduce=role.grad_reduced, counts=role.names, packed=dict(role.param_packed),
        gather_inputs=role.seq_input, partial_grad_inputs=role.partial_grad_inputs),
    "linear_params": lambda role, lp: styles.HeadParams(
        shard_dims=dict(role.param_dims), columns=role.columns, rows=role.rows, reduce=role.grad_reduced,
        counts=role.names, packed=dict(role.param_packed), seq_output=role.seq_output),
    "partial_grad_module": lambda role, lp: styles.ReplicatedWithGradAllReduce(),
    "reduced_inputs": lambda role, lp: styles.Boundary(
        inputs="reduce_grad", style=styles.ReplicatedWithGradAllReduce() if role.partial_params else None),
    "replicate": lambda role, lp: _replicated_at_sequence_edge(role),
}


def _in_out_style(role: Role, loss_parallel: bool) -> ParallelStyle:
    """The styles of :func:`_style_for` for a weight stored ``(in, out)`` (transformers' Conv1D)."""
    if role.kind == "row":
        if role.seq_output:
            return styles.Rowwise(weight_in_out=True, output_layouts=Shard(1), use_local_output=False)
        return styles.Rowwise(weight_in_out=True, reduce_grad_features=role.grad_spans)
    sizes = role.sizes if role.kind == "packed_column" else None
    if role.kind == "head":
        layout = dict(output_layouts=Shard(-1), use_local_output=False) if loss_parallel else dict(
            output_layouts=Replicate())
        return styles.Colwise(weight_in_out=True, **_seq_in(role), **layout)
    return styles.Colwise(weight_in_out=True, sizes=sizes, **_seq_in(role))


def _replicated_at_sequence_edge(role: Role) -> ParallelStyle | None:
    """A replicated module at the edge of the sequence-sharded stream converts its layout."""
    if role.seq_output:
        return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                   use_local_output=False)
    # Every sequence-sharded argument is gathered (a module called as ``attn(h, h, h)`` takes the
    # stream three times: a layout per argument would have to match each call's arity).
    if role.seq_join and role.seq_input:  # a whole Linear between two points of the stream
        return styles.Boundary(inputs="gather", outputs="shard")
    if role.seq_join and role.seq_cut is not None:  # its own positions only, gradients partial
        return styles.Boundary(outputs="slice", output_grad="partial", sequence_dim=role.seq_cut,
                               style=styles.ReplicatedWithGradAllReduce())
    if role.seq_join:  # its (first) output a Replicate() DTensor that the sharded stream can meet
        return styles.Boundary(outputs="replicate")
    if role.seq_input:
        return styles.Boundary(inputs="gather")
    return None


def expand(traced: dict[str, object], groups: LayerGroups) -> dict[str, object]:
    """Values keyed by traced FQN -> keyed by every model FQN they stand for."""
    out = {}
    for fqn, value in traced.items():
        for original in groups.original(fqn):
            out[original] = value
    return out


def generalise(per_module: dict[str, ParallelStyle], groups: LayerGroups) -> dict[str, ParallelStyle]:
    """Fold per-layer keys into ``prefix.*.rest`` where every layer has the same style.

    Layers are named as their stack names them: list positions, or an ``nn.ModuleDict``'s keys.

    >>> from torch.distributed.tensor.parallel import ColwiseParallel
    >>> g = LayerGroups({"layers": [[0, 1]]})
    >>> sorted(generalise({"layers.0.q": ColwiseParallel(), "layers.1.q": ColwiseParallel()}, g))
    ['layers.*.q']
    >>> g = LayerGroups({"layers": [["first"], ["second"]]})
    >>> sorted(generalise({"layers.first.q": ColwiseParallel()}, g))
    ['layers.first.q']
    """
    plan: dict[str, ParallelStyle] = {}
    by_tail: dict[tuple[str, str], dict[str, ParallelStyle]] = {}
    for fqn, style in per_module.items():
        prefix = next((p for p in groups.groups if fqn.startswith(p + ".")), None)
        if prefix is None:
            plan[fqn] = style
            continue
        key, _, tail = fqn[len(prefix) + 1:].partition(".")
        by_tail.setdefault((prefix, tail), {})[key] = style
    for (prefix, tail), styles_at in by_tail.items():
        entries = [str(entry) for group in groups.groups[prefix] for entry in group]
        described = {repr(describe_style(s)) for s in styles_at.values()}
        suffix = "." + tail if tail else ""
        if len(styles_at) == len(entries) and len(described) == 1:
            plan[f"{prefix}.*{suffix}"] = next(iter(styles_at.values()))
        else:  # layer by layer, numbered keys by value ("10" after "9")
            for key in sorted(styles_at, key=_stack_order):
                plan[f"{prefix}.{key}{suffix}"] = styles_at[key]
    return plan


def _stack_order(entry: str) -> tuple:
    """Sort key of a stack entry: numbers by value (``"10"`` after ``"9"``), then other keys."""
    return (0, int(entry), "") if entry.isdigit() else (1, 0, entry)


def build_plan(roles: dict[str, Role], groups: LayerGroups, *, loss_parallel: bool = True,
               copies: dict | None = None, gather_copies: bool = True) -> dict[str, ParallelStyle]:
    """The plan: a style for every role that needs one, with repeated layers folded into ``*``.

    ``copies``: modules whose grouped parts are held as copies per rank (:mod:`autotp.synth.groups`):
    their style is wrapped in :class:`~autotp.styles.GroupCopies`, which expands them first.
    ``gather_copies``: a Linear's copied parts are sharded and gathered instead where they can be
    (``GroupCopies(gather=True)``; see :func:`autotp.synth.api.synthesize`)."""
    traced = {fqn: style_for(role, loss_parallel=loss_parallel) for fqn, role in roles.items()}
    for join in sorted({role.partial_join for role in roles.values() if role.partial_output and role.partial_join}):
        traced[join] = styles.JoinPartialSums(style=traced.get(join))
    for fqn, spec in (copies or {}).items():
        traced[fqn] = styles.GroupCopies(base=traced.get(fqn), rows=spec.rows, values=spec.values)
    if gather_copies:
        traced = {fqn: _gathered(style) for fqn, style in traced.items()}
    traced = {fqn: style for fqn, style in traced.items() if style is not None}
    return generalise(expand(traced, groups), groups)
