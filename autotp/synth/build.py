"""Roles -> ParallelStyles (one function), and traced FQNs -> plan keys (``layers.*`` patterns)."""

from __future__ import annotations

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import (
    ColwiseParallel,
    PrepareModuleInput,
    PrepareModuleInputOutput,
    PrepareModuleOutput,
    RowwiseParallel,
    SequenceParallel,
)
from torch.distributed.tensor.parallel.style import ParallelStyle

from autotp import styles, styles_params
from autotp.plan import describe_style
from autotp.synth_styles import GatherSequenceInput, PartialExpertsParallel, SequenceParallelMoEBlock
from autotp.synth.roles import Role
from autotp.synth.trace import LayerGroups


def _seq_in(role: Role) -> dict:
    return {"input_layouts": Shard(1)} if role.seq_input else {}


def style_for(role: Role, *, loss_parallel: bool = True) -> ParallelStyle | None:
    """The ParallelStyle that realises ``role``, returning a copy where the caller writes the output."""
    style = _style_for(role, loss_parallel=loss_parallel)
    if style is not None and role.owned_output:
        return styles.OwnedOutput(style)
    return style


def _style_for(role: Role, *, loss_parallel: bool = True) -> ParallelStyle | None:
    """The ParallelStyle that realises ``role`` (``None``: leave the module replicated).

    Column Linears shard weight rows (Shard(0), as Linear is x @ W^T + b); rows shard weight
    columns and reduce (all-reduce, or reduce-scatter to Shard(1) when the residual stream is
    sequence-sharded). The head keeps its vocab-sharded logits as a DTensor for loss parallel.
    """
    kind = role.kind
    if role.weight_in_out and kind in ("column", "packed_column", "row", "head"):
        return _in_out_style(role, loss_parallel)
    if kind == "column":
        return ColwiseParallel(**_seq_in(role))
    if kind == "kv_column":
        return styles.ReplicatedKVColwise(kv_heads=role.kv_heads, head_dim=role.head_dim, **_seq_in(role))
    if kind == "kv_head_counts":
        return styles.KVHeadCounts(heads=role.heads, attribute=role.names[0])
    if kind == "packed_column":
        return styles.PackedColwiseParallel(sizes=role.sizes, **_seq_in(role))
    if kind == "row":
        if role.partial_output:  # one branch of a parallel block: reduced with the other at their sum
            return styles.PartialRowwiseParallel()
        if role.seq_output:
            return RowwiseParallel(output_layouts=Shard(1), use_local_output=False)
        return RowwiseParallel()
    if kind == "head":
        if loss_parallel:
            return ColwiseParallel(**_seq_in(role), output_layouts=Shard(-1), use_local_output=False)
        return ColwiseParallel(**_seq_in(role), output_layouts=Replicate())
    if kind == "vocab_embedding":
        if role.seq_output:
            return styles.VocabParallelEmbedding(input_layouts=Replicate(), output_layouts=Shard(1),
                                                 use_local_output=False)
        return styles.VocabParallelEmbedding(input_layouts=Replicate())
    if kind == "head_norm":
        return styles.HeadShardedNorm()
    if kind == "width_norm":
        return styles.WidthShardedNorm(shard_dim=role.shard_dim)
    if kind == "seq_norm":
        return SequenceParallel()
    if kind == "seq_params":
        return styles.ReplicatedParams()
    if kind == "seq_norm_gather":
        return styles.SequenceParallelAllGather(use_local_output=not role.dtensor_output)
    if kind == "shared_input":
        return styles.ReplicatedOutput()
    if kind == "whole_module":
        return styles.ReplicatedModule()
    if kind == "stream_block":
        return styles.ReplicatedStream()
    if kind == "stream_params":
        return styles.ReplicatedParams()
    if kind == "experts":
        experts = PartialExpertsParallel if role.seq_output else styles.ExpertsParallel
        return experts(shard_dims=dict(role.param_dims), packed=dict(role.param_parts))
    if kind == "seq_gather" and role.seq_output:
        return GatherSequenceInput(reshard_output=True)
    if kind == "seq_gather":
        return GatherSequenceInput(use_local_output=not role.dtensor_output)
    if kind == "moe_block":
        # Whole tokens in (the dispatch indexes them); the experts' partial sums reduce-scattered out.
        return SequenceParallelMoEBlock()
    if kind == "rotary":
        return styles.RotaryEmbedParallel()
    if kind == "shard_counts":
        return styles.ShardCounts(names=role.names)
    if kind == "head_params":
        return styles_params.HeadParams(shard_dims=dict(role.param_dims), reduce=role.grad_reduced, counts=role.names)
    if kind == "replicate":
        return _replicated_at_sequence_edge(role)
    raise ValueError(f"unknown role kind {kind!r}")


def _in_out_style(role: Role, loss_parallel: bool) -> ParallelStyle:
    """The styles of :func:`_style_for` for a weight stored ``(in, out)`` (transformers' Conv1D)."""
    if role.kind == "row":
        if role.seq_output:
            return styles.RowwiseParallelInOut(output_layouts=Shard(1), use_local_output=False)
        return styles.RowwiseParallelInOut()
    sizes = role.sizes if role.kind == "packed_column" else None
    if role.kind == "head":
        layout = dict(output_layouts=Shard(-1), use_local_output=False) if loss_parallel else dict(
            output_layouts=Replicate())
        return styles.ColwiseParallelInOut(**_seq_in(role), **layout)
    return styles.ColwiseParallelInOut(sizes=sizes, **_seq_in(role))


def _replicated_at_sequence_edge(role: Role) -> ParallelStyle | None:
    """A replicated module at the edge of the sequence-sharded stream converts its layout."""
    if role.seq_output:
        return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Shard(1),
                                   use_local_output=False)
    if role.seq_join and role.seq_input:  # a whole Linear between two points of the stream
        return PrepareModuleInputOutput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                        use_local_input=True, output_layouts=Replicate(),
                                        desired_output_layouts=Replicate(), use_local_output=False)
    if role.seq_join:
        return PrepareModuleOutput(output_layouts=Replicate(), desired_output_layouts=Replicate(),
                                   use_local_output=False)
    if role.seq_input:
        return PrepareModuleInput(input_layouts=Shard(1), desired_input_layouts=Replicate(),
                                  use_local_output=True)
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


def build_plan(roles: dict[str, Role], groups: LayerGroups, *, loss_parallel: bool = True) -> dict[str, ParallelStyle]:
    """The plan: a style for every role that needs one, with repeated layers folded into ``*``."""
    traced = {fqn: style_for(role, loss_parallel=loss_parallel) for fqn, role in roles.items()}
    traced = {fqn: style for fqn, style in traced.items() if style is not None}
    return generalise(expand(traced, groups), groups)
