"""What analysis decides about a module: its :class:`Role`, with the reason and the graph evidence."""

from __future__ import annotations

from dataclasses import dataclass
from enum import StrEnum

from autotp.synth.stages import idiom_kind, idiom_kinds

# The role kinds every idiom shares, and what each means; ``build.style_for`` turns them into
# ParallelStyles. A kind only one idiom assigns is registered in that idiom's module
# (:func:`~autotp.synth.stages.role_kind`, read through :func:`idiom_kinds`).
ROLE_KINDS = {
    "column": "Linear whose output features are sharded; consumers keep the shard until a row",
    "packed_column": "column Linear whose output is split into parts (fused qkv / gate_up)",
    "kv_column": "k/v projection with fewer heads than ranks: each kv head repeated to the ranks that read it",
    "kv_head_counts": "attention whose grouped-query ratio must be the per-rank one (tp > kv heads)",
    "row": "Linear contracting over a sharded dim; partial sums are reduced after it",
    "head": "column Linear whose sharded output is the model output (vocab-sharded logits)",
    "vocab_embedding": "Embedding looked up by input ids, sharded over the vocabulary",
    "head_norm": "norm on a head-sharded tensor, reducing over unsharded dims only",
    "width_norm": "norm reducing over a sharded width; its statistic is all-reduced",
    "seq_norm": "sequence-parallel norm on the residual stream (output stays sequence-sharded)",
    "seq_norm_gather": "sequence-parallel norm whose output is all-gathered once for column Linears",
    "experts": "grouped experts (3-D parameters) sharded on the FFN dim; output all-reduced after the module",
    "seq_gather": "module whose column Linears read the sequence-sharded stream directly: gathered once at entry",
    "seq_slice": "block whose stream input arrives replicated (joined with plain tensors before it): sliced to "
                 "the sequence shard at entry",
    "moe_block": "module around grouped experts; under sequence parallel it reduce-scatters their partial sum",
    "rotary": "parameter-free module producing position tables for the sharded region",
    "shard_counts": "module whose integer attributes size the cuts of a fused output; divided by tp",
    "seq_params": "module holding sharded children whose own parameters act on the sequence-sharded stream",
    "head_params": "module whose own parameters meet a sharded activation: sharded with it, or gradient all-reduced",
    "linear_params": "module whose code uses its raw parameters as column / row Linear weights: sharded like them",
    "shared_input": "module whose output only column Linears read: a Replicate() DTensor, gradient reduced once "
                    "(with partial_grad: a plain output whose partial gradient is all-reduced once)",
    "whole_module": "module kept whole that reads a shared input's DTensor: runs on its local value",
    "shared_entry": "module whose column Linears read one tensor from outside it: they share one Replicate() "
                    "DTensor of it, gradient reduced once",
    "replicated_entry": "MoE block whose input no norm hands over as a DTensor: wrapped as a Replicate() DTensor "
                        "at entry, so its experts', router's and shared expert's input gradients are reduced once",
    "router": "module kept whole that routes tokens to grouped experts: its backward runs on their partial "
              "gradient, so the block input's gradient is reduced once",
    "stream_block": "parallel block run on a Replicate() DTensor stream: its branches reduced once together",
    "stream_params": "module on a stream block's DTensor stream: its parameters are replicated DTensors",
    "broadcast_source": "Linear kept whole whose output span is expanded across sharded heads (a rope key shared "
                        "by all heads): that span's gradient is all-reduced",
    "gathered_column": "Linear the traced forward never calls (an image patch projection in a text run): "
                       "column-sharded with its output all-gathered, right for any input the ranks share",
    "partial_grad_module": "module kept whole whose backward runs on partial gradients (inside a partial-sum "
                           "block, or between a norm and column Linears): its parameters' gradients are partial "
                           "sums, left Partial()",
    "reduced_inputs": "module kept whole whose inputs feed column Linears through replicated computation only: "
                      "their partial gradients all-reduced at entry, an input shared by every layer once per step",
    "replicate": "kept whole on every rank",
}

# The kinds as an enum: a ``str`` (``Kind.COLUMN == "column"``), checked when a Role is made, so an
# unknown kind fails where it is written rather than where a style is built for it.
Kind = StrEnum("Kind", {kind.upper(): kind for kind in ROLE_KINDS})

# Which dim of its weight a role shards (kinds not here keep their weight whole, or name their
# parameters' dims themselves in ``param_dims``). Read by the tie check (tied users must agree)
# and by the per-rank runs of localization (the weight's per-rank shape).
WEIGHT_DIMS = {Kind.COLUMN: 0, Kind.GATHERED_COLUMN: 0, Kind.PACKED_COLUMN: 0, Kind.KV_COLUMN: 0, Kind.HEAD: 0, Kind.VOCAB_EMBEDDING: 0,
               Kind.WIDTH_NORM: 0, Kind.ROW: 1}


@dataclass(frozen=True)
class Role:
    """One module's role in the plan.

    Attributes:
        kind: a :class:`Kind` (a key of :data:`ROLE_KINDS` is converted to one).
        reason: why, in words (what ``explain`` prints).
        evidence: the graph path that decided it (producer -> ops -> consumer).
        sizes: part widths of a ``packed_column``; of a ``row``, of its input features when they
            hold parts (a folded shard: each rank a share of every part), else None.
        shard_dim: the sharded input dim of a norm (negative, from the end).
        seq_input: under sequence parallel, the input arrives sharded on the sequence.
        seq_output: under sequence parallel, the output leaves sharded on the sequence.
        seq_join: under sequence parallel, the replicated output is combined with the
            sequence-sharded stream (a position embedding, a Linear kept whole), so it must be a
            ``Replicate()`` DTensor there.
        seq_cut: of a ``seq_join`` module whose output depends only on its own parameters and on
            inputs without gradient (a position table looked up by positions): the output's dim that
            lines up with the stream's sequence. Each rank keeps its own positions of the output
            (``Boundary(outputs="slice", output_grad="partial")``: no all-gather of its gradient), the
            parameters' gradients left ``Partial()``.
        param_dims: of ``experts`` and ``head_params``, (parameter name, sharded dim) pairs.
        grad_reduced: of ``head_params``, parameters kept whole whose gradient is all-reduced.
        grad_spans: of ``broadcast_source``, ``(start, stop)`` output features whose gradient is
            all-reduced.
        param_parts: of ``experts``, (parameter name, number of fused parts) pairs.
        param_packed: of ``head_params``, (parameter name, part widths along its sharded dim) pairs:
            parameters sharded with a packed Linear's parts, each rank holding its share of each.
        names: of ``shard_counts`` (and of a ``seq_gather`` that was one), the attribute paths
            divided by tp; of ``shared_entry``, the column Linears (relative names).
        kv_counts: of ``kv_head_counts``, ``(attribute, kind)`` pairs, kind ``"ratio"`` / ``"kv"`` /
            ``"heads"`` (its per-rank value: heads / tp, 1, heads / tp).
        kv_heads, head_dim: of ``kv_column``, its kv heads and head size.
        heads: of ``kv_head_counts``, the query heads of the attention.
        owned_output: the calling code modifies the output in place, so the style returns a copy
            rather than a view of a DTensor's local shard.
        dtensor_output: of ``seq_norm_gather`` / ``seq_gather`` / ``moe_block``, the gathered value
            stays a ``Replicate()`` DTensor: every reader is a column Linear, or the experts, router
            and modules kept whole of a MoE block, whose input gradients are then reduce-scattered once;
            of a ``column``, its output stays a ``Shard(-1)`` DTensor (read by a ``statistics`` block).
        partial_output: of a ``row`` (or a ``dtensor_region``), its output stays ``Partial()``: a
            parallel block adds it to another branch's before one reduction.
        partial_join: of a ``partial_output`` row under sequence parallel, the module whose code adds
            the branches' sums to the ``Shard(1)`` stream (:class:`~autotp.styles.JoinPartialSums`).
        partial_local: of a ``row``, its output is the plain per-rank partial sum, added up by a
            ``partial_sum_block`` around it before one reduction.
        partial_grad_inputs: of ``experts``, the block input arrives as a ``Replicate()`` DTensor and
            the routing weights from a ``router``: their gradients are left partial sums, reduced
            once with the block input's; of ``head_params``, its inputs are taken with partial
            gradients, reduced once at entry (:mod:`autotp.synth.mixes`).
        columns, rows: of ``linear_params``, the raw parameters used as column / row Linear weights.
        once: of ``experts``, parameters added to the per-rank partial sum (a per-expert bias after
            the down projection): added by one rank only, so the reduction counts them once.
        scale_rows: of ``experts``, its row parameters (the down projections), where terms whole on
            every rank are added to the partial sum (zero-compute experts' tokens): multiplied by tp
            while the output is divided by tp, so the reduction counts each whole term once
            (``once`` is then empty: a per-expert bias is such a term too).
        experts_side: of ``experts``, ``"columns"`` or ``"rows"`` where the module holds one side of
            the pair only (the other side's stacked weights are another module's): its output is
            then this rank's features, left local, or its inputs are, taken as they are; empty
            where it holds both.
        weight_in_out: of a Linear-like role, the weight is stored ``(in, out)`` (transformers'
            ``Conv1D``), so its sharded dims are swapped.
        entry_inputs: of any role, ``(argument position or keyword, dim)`` of the module's call
            (``(..., dim, heads, inner)`` where the heads are merged into ``dim``): values made
            outside it that meet its heads, sliced to this rank's heads on entry.
        partial_grad: of a ``seq_norm_gather``, its plain gathered output's gradient is a partial
            sum, reduce-scattered; of a ``shared_input``, its plain output's gradient is a partial
            sum, all-reduced; of a ``shared_entry``, the columns' summed input gradient is handed
            back unreduced (every path from such a norm ends in such columns, or in a front of
            ``partial_grad_module`` modules, :mod:`autotp.synth.fronts`); of a column Linear
            (``column``, ``packed_column``, ``kv_column``, ``head``), it takes its plain input with
            a partial gradient, handed back unreduced, where no module above it can share the input
            (``Boundary(input_grad="partial")``); of ``experts`` (columns) and a ``router``,
            their plain inputs' gradients are handed back as this rank's share, reduced once by a
            ``shared_input`` norm (:mod:`autotp.synth.partial_inputs`).
        partial_params: of a ``reduced_inputs`` module, its own parameters run in the replicated
            computation between its inputs and the column Linears (a norm heading a branch): their
            gradients are left ``Partial()`` (:mod:`autotp.synth.fronts`).
        scatter_heads: of a ``row``, its output holds one value per head of its input's shard and
            stays sharded on them (reduce-scattered onto its last dim), for the heads it meets again
            (:func:`~autotp.synth.propagation.per_head_row`).
        copied: of a ``packed_column``, the features ``[start, end)`` of its output held whole on
            every rank (:mod:`autotp.synth.copies`); ``sizes`` then holds each such part expanded
            to tp copies, as :class:`~autotp.styles.GroupCopies` lays them out before the shard.
        width_view: of any role, ``((argument position or keyword, ...), (reader, ...))``: the module's
            code reads its widths from those arguments' sizes (``C = x.size(-1)``), so it sees them at
            the per-rank width, and the column Linears ``reader`` (relative names) read the real ones.
        rewrites: of any role, rewrites of the module's code that make it cut and shape its shard
            per rank (found by a :func:`~autotp.synth.stages.shape_fix`): each a style with
            ``localize(module, tp)``, replayed on the per-rank copies of the proofs, wrapped around
            the module's own style in the plan.
        shared_columns: of a ``shard_counts``, column Linears inside it (relative names) that read one
            tensor and share one ``Replicate()`` DTensor of it, as a ``shared_entry``'s ``names`` do.
        statistics: of any role, the module's own code reduces its sharded width to per-token
            statistics (:mod:`autotp.synth.statistics`): its style runs that code on DTensors
            (:class:`~autotp.styles.ShardedStatistics`); of a ``column`` inside such a module,
            ``dtensor_output`` hands its output on as a ``Shard(-1)`` DTensor.
        region: of ``dtensor_region`` (or a ``seq_gather`` that is one), (parameter name relative to
            the module, sharded dim) pairs: the module runs on DTensors
            (:class:`~autotp.styles.DTensorRegion`, :mod:`autotp.synth.regions`).
        region_partial: of a ``dtensor_region``, its output nodes that leave it as ``Partial()`` sums
            (all-reduced at its output; with ``partial_output`` a parallel block adds them to another
            branch's partial sum before one reduction).
        all_outputs: of a ``seq_gather`` with ``seq_output``, the stream reads several of the
            module's outputs (a hyper-connection's branch input and output weights): each
            per-position output is sliced back, not only the first.
    """

    kind: Kind
    reason: str
    evidence: tuple[str, ...] = ()
    sizes: tuple[int, ...] | None = None
    shard_dim: int | None = None
    seq_input: bool = False
    seq_output: bool = False
    seq_join: bool = False
    seq_cut: int | None = None
    param_dims: tuple[tuple[str, int], ...] = ()
    param_parts: tuple[tuple[str, int], ...] = ()
    param_packed: tuple[tuple[str, tuple[int, ...]], ...] = ()
    grad_reduced: tuple[str, ...] = ()
    grad_spans: tuple[tuple[int, int], ...] = ()
    names: tuple[str, ...] = ()
    kv_heads: int = 0
    head_dim: int = 0
    heads: int = 0
    owned_output: bool = False
    weight_in_out: bool = False
    dtensor_output: bool = False
    partial_output: bool = False
    partial_join: str | None = None
    partial_local: bool = False
    partial_grad_inputs: bool = False
    columns: tuple[str, ...] = ()
    rows: tuple[str, ...] = ()
    once: tuple[str, ...] = ()
    scale_rows: tuple[str, ...] = ()
    experts_side: str = ""
    all_outputs: bool = False
    partial_grad: bool = False
    partial_params: bool = False
    entry_inputs: tuple = ()
    kv_counts: tuple = ()
    width_view: tuple = ()
    rewrites: tuple = ()
    shared_columns: tuple[str, ...] = ()
    copied: tuple[tuple[int, int], ...] = ()
    scatter_heads: bool = False
    statistics: bool = False
    region: tuple[tuple[str, int], ...] = ()
    region_partial: tuple[str, ...] = ()

    def __post_init__(self):
        if self.kind in ROLE_KINDS:
            object.__setattr__(self, "kind", Kind(self.kind))
        elif idiom_kind(self.kind) is None:  # an idiom's own kind stays a plain str
            raise ValueError(f"unknown role kind {self.kind!r}; one of {', '.join([*ROLE_KINDS, *idiom_kinds()])}")


def kind_of(roles: dict[str, Role], module: str, default: Kind | None = None) -> Kind | None:
    """The kind of ``module``'s role, ``default`` if it has none."""
    role = roles.get(module)
    return role.kind if role is not None else default
