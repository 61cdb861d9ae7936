"""How each op moves a sharded dimension: the shard algebra of the analysis, as tables and rules.

A rule gets the node and, for each of its inputs that is sharded, the sharded dimension of that
input. It returns :class:`Out` (the output is sharded on ``dim``), :class:`Parts` (a tuple output,
one state per element), ``None`` (the output is a replicated statistic), :class:`Split` (the
sharded dimension is cut into parts: a fused projection) or :class:`Break` (the op needs the whole
dimension on one rank).

Long because it is the shard algebra: one rule per op family, kept in one table so that
every op the analysis knows (and every one it refuses) is read in one place.
"""

from __future__ import annotations

import math
from dataclasses import dataclass

import networkx as nx

from autotp.synth.dtensor_rules import dtensor_rule
from autotp.synth.ref import Ref

# Ops that return their input's values in the same layout (casts, copies, no-op dropout at trace).
PASSTHROUGH = frozenset({
    "to", "_to_copy", "clone", "contiguous", "alias", "detach", "dropout", "lift_fresh_copy", "type_as",
    "float", "half", "bfloat16", "view_as_real", "view_as_complex", "feature_dropout", "alpha_dropout",
})

# Pointwise ops: output[i] depends on input[i] only (after broadcasting), so any dim can stay sharded.
ELEMENTWISE = frozenset({
    "add", "sub", "mul", "div", "pow", "neg", "exp", "log", "rsqrt", "sqrt", "reciprocal", "abs",
    "silu", "gelu", "relu", "tanh", "sigmoid", "sin", "cos", "erf", "softplus", "clamp", "clamp_min",
    "clamp_max", "maximum", "minimum", "where", "masked_fill", "eq", "ne", "lt", "le", "gt", "ge",
    "logical_and", "logical_or", "logical_not", "__and__", "__or__", "square", "rsub", "mish",
    "hardtanh", "leaky_relu", "elu", "gelu_tanh", "sign", "floor", "ceil", "round", "fill", "zeros_like",
    "ones_like", "full_like", "log1p", "expm1", "true_divide", "floor_divide", "fmod", "remainder",
    "relu6", "hardswish", "hardsigmoid", "selu", "celu", "logit", "sgn", "trunc", "nan_to_num",
    "log_sigmoid", "logsigmoid", "softsign", "tanhshrink", "exp2", "log2", "log10", "sinh", "cosh", "atan",
    "isnan", "isinf", "isfinite", "bitwise_not", "xlogy", "lerp", "addcmul", "addcdiv", "heaviside",
    "clip", "erfc", "sigmoid_", "tanh_", "exp_", "relu_", "fill_", "zero_",
    # ``dst.copy_(src)`` writes src into dst element by element (a slice of a fresh ``new_empty``).
    "copy_", "copy",
    # In place, the same values as out of place: ``x *= scale`` (the caller reading x after it is
    # the graph's next user of this node, so the shard follows as for ``mul``).
    "add_", "sub_", "mul_", "div_", "neg_", "clamp_", "masked_fill_",
    # Aliases export keeps under their own names.
    "multiply", "divide", "subtract", "negative",
})

# A fresh tensor shaped like its input (``x.new_empty(*x.shape[:-1], n)``): no values flow, but
# the dims it keeps are the input's, so a shard on one of them stays there.
NEW_LIKE = frozenset({"new_empty", "new_zeros", "new_ones", "new_full"})

# Ops whose output is a new view of the same elements, described by the input and output shapes.
VIEW_LIKE = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unflatten", "view_as", "reshape_as"})

# Reductions: (position of the dim argument, whether the output keeps the input's shape).
# A reduction over the sharded dimension needs the whole dimension (a norm statistic, a softmax).
REDUCTIONS = {
    "mean": (1, False), "sum": (1, False), "amax": (1, False), "amin": (1, False),
    "var": (1, False), "std": (1, False), "var_mean": (1, False), "std_mean": (1, False), "logsumexp": (1, False),
    "argmax": (1, False), "argmin": (1, False), "max": (1, False), "min": (1, False),
    "linalg_vector_norm": (2, False), "norm": (2, False), "prod": (1, False), "all": (1, False),
    "any": (1, False),
    "softmax": (1, True), "_softmax": (1, True), "log_softmax": (1, True), "_log_softmax": (1, True),
    "cumsum": (1, True), "cumprod": (1, True),
}

# Reductions that are sums of the reduced elements (or of their deviations from such a sum): over a
# sharded dim, each rank's partial sum all-reduced gives the statistic exactly (a block's
# per-token mean and std, :mod:`autotp.synth.statistics`). Not max, median, top-k or softmax.
STATISTICS = frozenset({"mean", "sum", "var", "std", "var_mean", "std_mean"})

# Fused norms over the trailing ``len(normalized_shape)`` dims (argument 1); the shape is kept.
FUSED_NORMS = frozenset({"layer_norm", "rms_norm", "native_layer_norm", "_fused_rms_norm"})

# Attention kernels: batch and head dims are independent; the last two (sequence, head_dim) mix.
ATTENTION = frozenset({
    "scaled_dot_product_attention", "_scaled_dot_product_flash_attention",
    "_scaled_dot_product_efficient_attention", "_scaled_dot_product_flash_attention_for_cpu",
})

# Batched matmuls: leading (batch) dims are independent, the last two take part in the product.
MATMULS = frozenset({"matmul", "bmm"})

# Convolutions -> position of their ``groups`` argument. A depthwise convolution (``groups`` equal
# to the input channels) makes output channel c from input channel c // multiplier alone, so a
# contiguous block of channels, with the matching rows of the weight and bias, is computed locally.
CONVOLUTIONS = {"conv1d": 6, "conv2d": 6, "conv3d": 6, "convolution": 8}

# Pads: the pad widths come in (before, after) pairs from the last dim backwards.
PADS = frozenset({"pad", "constant_pad_nd"})

# Triangular masks of the last two dims (a causal (time, time) decay matrix): other dims untouched.
TRIANGULAR = frozenset({"tril", "triu"})

# Ops that consume a tensor without producing one the analysis follows.
SINKS = frozenset({"_assert_tensor_metadata", "sym_size", "sym_numel", "_assert_scalar"})

# --- op families the passes read (one table per fact; the shard rules below use the ones above) ---

# Ops after which a row Linear's reduced output is still that output, scaled (``* scale``).
SCALINGS = PASSTHROUGH | VIEW_LIKE | {"mul", "div"}

# Ops whose tensor arguments after the first lend only a dtype or a shape.
FIRST_VALUE_ONLY = frozenset({"type_as", "view_as", "expand_as", "reshape_as"})

# Ops that read none of their input's values (only its shape, dtype, device).
NO_VALUES = NEW_LIKE | {"zeros_like", "ones_like", "empty_like", "full_like"}

# Grouped (per-expert) matmuls ``x @ W[e]``: weight argument (experts, in, out), possibly a
# transposed view of a stored (experts, out, in) parameter (transformers 5 MoE experts).
GROUPED_MATMULS = frozenset({"grouped_mm_fallback", "_grouped_mm", "grouped_mm"})

# Batched matmuls read the same way when the weight is a 3-D parameter (stacked per-expert or
# per-group weights: ``torch.bmm(x, self.w1)``); a raw parameter, so :func:`raw_weight`.
STACKED_MATMULS = frozenset({"bmm", "matmul"})

# Products that may read one expert's weight ``P[e]`` of a 3-D parameter (a per-expert loop,
# :mod:`autotp.synth.experts`).
SELECTING_PRODUCTS = frozenset({"matmul", "linear"})

# In-place writes: ``out[:, :, i] = x`` writes x's values into ``out``, read later through ``out``.
WRITES = frozenset({"copy_", "add_", "sub_", "mul_", "div_", "masked_fill_", "clamp_", "neg_"})

# Views a write may go through to the tensor it changes.
WRITE_VIEWS = VIEW_LIKE | {"slice", "select", "unsqueeze", "squeeze", "transpose", "permute", "narrow",
                            "expand", "alias", "t"}

# Ops that return a view of their first argument: an in-place op on the view writes the original.
ALIASING = frozenset({"view", "_unsafe_view", "reshape", "transpose", "permute", "unsqueeze", "squeeze",
                       "slice", "select", "expand", "t", "alias", "as_strided", "narrow", "unflatten",
                       "flatten", "view_as", "reshape_as"})

# Products that read a selected expert weight as their second argument.
EXPERT_PRODUCTS = frozenset({"matmul", "mm", "linear"})

# Sums: a sum of partial sums is a partial sum.
SUMS = frozenset({"add", "add_", "sub", "sub_"})

# Scatter-adds into a running sum: ``out.index_add_(0, idx, y)`` (self, dim, index, source).
INDEX_ADDS = frozenset({"index_add", "index_add_"})

# Fresh tensors of zeros: a running sum may start from one (zero on every rank is a partial sum).
ZEROS = frozenset({"zeros_like", "new_zeros", "zeros"})

# Ops by which a module picks rows of a tensor by computed ids (routed tokens: ``x[token_idx]``).
DISPATCH = frozenset({"index", "index_select"})

# Ops by which a module's code masks or scales a value by another tensor.
MASKING = frozenset({"mul", "div", "masked_fill", "where"})

# Products: an operand's gradient is the other operand times the incoming gradient.
PRODUCTS = MATMULS | frozenset({"mul", "div", "mm", "einsum"})

# Single-tensor ops a partial sum may pass through and stay one: scalings by constants, casts,
# reshapes (a shared expert's output on its way to the experts').
LINEAR_CARRY = PASSTHROUGH | frozenset({"view", "reshape", "_unsafe_view", "flatten", "unsqueeze", "squeeze",
                                         "mul", "div", "neg", "clone", "contiguous", "dropout", "native_dropout"})

# Products that multiply by a weight matrix when one operand is a parameter (a Linear, or a raw
# weight: ``einsum`` on an ``nn.Parameter``); a module running one mixes features, so it is no norm.
WEIGHT_PRODUCTS = frozenset({"linear", "addmm", "mm", "bmm", "baddbmm", "matmul", "einsum"})

# Reshapes, which a Replicate() DTensor takes as a plain tensor would (an MoE block flattens tokens).
RESHAPES = frozenset({"view", "reshape", "_unsafe_view", "flatten", "unsqueeze", "squeeze"})

# Ops whose integer outputs pick experts; a value read only through these gets no gradient.
SELECTIONS = frozenset({"argmax", "argmin", "argsort"})

# Ops returning (values, indices): only the indices (item 1) select.
SELECTIONS_WITH_VALUES = frozenset({"topk", "sort", "max", "min"})

# Arguments that carry no gradient, by position and keyword: boolean masks and conditions, integer
# indices. A value read only through them (the top-k indices an indexer picks, turned into a mask)
# gets no gradient back from the op.
GRADLESS_ARGS = {
    "masked_fill": (1, "mask"), "masked_fill_": (1, "mask"), "where": (0, "condition"),
    "scatter": (2, "index"), "scatter_": (2, "index"), "gather": (2, "index"), "index_select": (2, "index"),
}

# Factories of constant tensors: every element the same, so a rank's block of any dim is the
# block of the whole one, as long as the code sizes it from the per-rank tensors it meets.
CONSTANT_FACTORIES = frozenset({"zeros", "ones", "full", "empty"})

# Ops that join tensors along a dim: where a loop over heads puts its results back together.
JOINS = frozenset({"cat", "concat", "concatenate", "stack"})

# Cuts of a tensor into consecutive parts of given sizes.
SPLITS = frozenset({"split", "split_with_sizes"})

# Cuts whose sizes are absolute numbers; ``chunk`` (a count of parts) is local-correct as it is.
FIXED_SIZE_CUTS = frozenset({"slice", "split", "split_with_sizes"})

# Ops a weight may pass through on its way to a product and stay the same matrix.
WEIGHT_CASTS = frozenset({"to", "_to_copy", "alias", "detach", "type_as", "clone", "contiguous", "lift_fresh_copy"})

# Ops that transpose a weight matrix (``x @ W.T``).
TRANSPOSES = frozenset({"t", "numpy_T", "transpose", "permute"})


@dataclass(frozen=True)
class Out:
    """The output is sharded on ``dim``; ``intact`` if that dim is still a whole Linear output."""

    dim: int
    intact: bool = False


@dataclass(frozen=True)
class Parts:
    """A tuple output: one ``Out`` (or ``None``) per element."""

    parts: tuple


@dataclass(frozen=True)
class Split:
    """The sharded dim is cut into pieces ``[start, end)`` (a fused projection's parts); with
    ``heads``, the ranges count heads of the input's ``head_span``, not features."""

    dim: int
    ranges: tuple[tuple[int, int], ...]
    tuple_output: bool
    heads: bool = False


@dataclass(frozen=True)
class Given:
    """The output's state, built by the context from its inputs' states: a ``cat`` of shards along
    their sharded dim (pieces side by side), a cut of such a join back at its pieces."""

    value: object


@dataclass(frozen=True)
class Break:
    """The op needs the whole sharded dimension; ``reason`` says why, for ``explain``."""

    reason: str
    reduction: bool = False
    # When given, only these candidates are dropped, and the others go on as ``then`` this round
    # (which is rerun without the dropped ones, so ``then`` only keeps them from breaking further on).
    only: frozenset = frozenset()
    then: Out | None = None


def _arg(g: nx.DiGraph, name: str, index: int, key: str, default=None):
    data = g.nodes[name]
    if len(data["args"]) > index:
        return data["args"][index]
    return data["kwargs"].get(key, default)


def _ndim(g, name):
    return len(g.nodes[name]["shape"] or ())


def _norm(dim: int, ndim: int) -> int:
    return dim % ndim if ndim else 0


def view_dim(in_shape: tuple, out_shape: tuple, dim: int, *, unit_heads: bool = False) -> int | None:
    """Where sharded ``dim`` of ``in_shape`` lands after a view to ``out_shape``; None if interleaved.

    The shard of dim d is a contiguous block of the flattened tensor only when d is the outermost
    varying dim of its output group: the output dim e that starts where d starts (same product of
    preceding sizes) and either splits d or merges it with inner dims.

    ``unit_heads`` reads a view that puts a size-1 dim before the whole of d (``(b, t, hd) ->
    (b, t, 1, hd)``) as a split into one head, the shard landing on that size-1 dim, and lets a
    size-1 sharded dim merge into the dims after it (the grouped-query repeat of that one head).
    That is the k/v projection of one-kv-head attention, whose one head each rank holds whole
    (:mod:`autotp.synth.kvheads`); the analysis tries it only for candidates it otherwise drops.

    >>> view_dim((2, 11, 64), (2, 11, 4, 16), 2)
    2
    >>> view_dim((2, 4, 11, 16), (2, 44, 16), 1)
    1
    >>> view_dim((2, 11, 4, 16), (2, 44, 16), 2) is None
    True
    >>> view_dim((2, 11, 16), (2, 11, 1, 16), 2), view_dim((2, 11, 16), (2, 11, 1, 16), 2, unit_heads=True)
    (3, 2)
    """
    size, before = in_shape[dim], math.prod(in_shape[:dim])
    if unit_heads:
        for e, out in enumerate(out_shape[:-1]):
            if out == 1 and math.prod(out_shape[:e]) == before and out_shape[e + 1] == size:
                return e
    elif size == 1:
        return None
    for e, out in enumerate(out_shape):
        if out > 1 and math.prod(out_shape[:e]) == before and (out % size == 0 or size % out == 0):
            return e
    return None


def fold_group(in_shape: tuple, out_shape: tuple, dim: int) -> tuple[int, tuple, int] | None:
    """``(output dim, merged sizes, position of dim among them)`` when a view merges a run of
    input dims holding sharded ``dim`` into one output dim (the others kept around it); else None.

    >>> fold_group((2, 11, 4, 16), (88, 16), 2)
    (0, (2, 11, 4), 2)
    >>> fold_group((2, 11, 4, 16), (2, 22, 32), 2) is None
    True
    """
    for start in range(dim, -1, -1):
        for stop in range(dim + 1, len(in_shape) + 1):
            size, before = math.prod(in_shape[start:stop]), math.prod(in_shape[:start])
            for e, out in enumerate(out_shape):
                if out == size and math.prod(out_shape[:e]) == before and \
                        tuple(out_shape[e + 1:]) == tuple(in_shape[stop:]):
                    return e, tuple(in_shape[start:stop]), dim - start
    return None


def split_fold_group(in_shape: tuple, out_shape: tuple, dim: int) -> tuple[int, tuple, int] | None:
    """:func:`fold_group` for a view that also splits sharded ``dim`` into (heads, head size) and
    merges the heads with the dims before it: ``(b, t, heads * hd) -> (b * t * heads, hd)``. The
    shard of a width is a block of whole heads (the divisibility check asks that tp divide them).

    >>> split_fold_group((2, 11, 64), (88, 16), 2)
    (0, (2, 11, 4), 2)
    """
    after = math.prod(in_shape[dim + 1:])
    for e in range(len(out_shape)):
        inner = math.prod(out_shape[e + 1:])
        if inner % after or in_shape[dim] % (inner // after) or inner // after in (1, in_shape[dim]):
            continue
        heads = in_shape[dim] // (inner // after)
        finer = tuple(in_shape[:dim]) + (heads, inner // after) + tuple(in_shape[dim + 1:])
        found = fold_group(finer, out_shape, dim)
        if found is not None and found[0] == e:
            return found
    return None


def _view(g, name, dims, ctx):
    args = g.nodes[name]["args"]
    like = args[1] if g.nodes[name]["op"] in ("view_as", "reshape_as") and len(args) > 1 else None
    src = args[0].name if isinstance(args[0], Ref) else None
    if src not in dims:  # ``x.view_as(y)`` with only y sharded: the whole x cannot take y's local shape
        return Break(f"{g.nodes[name]['op']} shapes a replicated tensor like a sharded one")
    out_shape = g.nodes[name]["shape"]
    folded = getattr(ctx.state.get(src), "fold", None)
    kept = _kept_dim(g.nodes[src]["shape"], out_shape, dims[src]) if folded else None
    if kept is not None and like is None:
        # The folded dim itself stays a dim of the output (the dims around it regrouped): same layout.
        return Given(ctx.refolded(src, kept))
    in_shape, dim = ctx.unfolded(src, g.nodes[src]["shape"], dims[src])
    if in_shape != g.nodes[src]["shape"]:
        ctx.unfold(name)
    e = view_dim(in_shape, out_shape, dim, unit_heads=ctx.unit_heads_of(src))
    parts = _parts_view(g, name, in_shape, out_shape, dim, e)
    span = ctx.span(src)
    if parts and like is None and span is not None and span[1] - span[0] == in_shape[dim] and not ctx.pieces(src):
        # Cuts of the candidates' outputs (a packed projection), each part sharded on its next dim;
        # the state kept is the first part's, as every reader takes one part alone.
        width = in_shape[dim] // parts
        ctx.viewed_into_parts(src)
        return Split(e + 1, tuple((i * width, (i + 1) * width) for i in range(parts)), False)
    groups = _groups_view(in_shape, out_shape, dim)
    if groups and like is None and not folded and _cut_inside(g, name, dim + 1):
        grouped = ctx.group_view(src, dim, groups)
        if grouped is not None:
            return Given(grouped)
    if e is None:
        group = fold_group(in_shape, out_shape, dim) or split_fold_group(in_shape, out_shape, dim)
        if group is not None and like is None:
            return Given(ctx.folded(name, src, *group))
        return Break(f"{g.nodes[name]['op']} {in_shape} -> {out_shape} interleaves sharded dim {dim}")
    if isinstance(like, Ref) and dims.get(like.name, e) != e:
        # The per-rank shape is the local shape of ``like``: it must be cut where x's shard lands.
        return Break(f"{g.nodes[name]['op']} takes the shape of a tensor sharded on dim {dims[like.name]}, "
                     f"not on dim {e}")
    if isinstance(like, Ref) and like.name not in dims:
        return Break(f"{g.nodes[name]['op']} takes the full shape of a replicated tensor")
    return Out(e, intact=out_shape[e] == in_shape[dim] and ctx.intact(src))


def _kept_dim(in_shape: tuple, out_shape: tuple, dim: int) -> int | None:
    """The output dim that is input ``dim`` unchanged (same size, same product of the dims before
    it) under a view that regroups only the dims around it; else None.

    >>> _kept_dim((2, 11, 8, 4, 2), (2, 11, 8, 8), 2), _kept_dim((2, 11, 8, 8), (2, 88, 8), 2)
    (2, None)
    """
    before = math.prod(in_shape[:dim])
    for e, out in enumerate(out_shape):
        if out == in_shape[dim] and math.prod(out_shape[:e]) == before:
            return e
    return None


def _groups_view(in_shape: tuple, out_shape: tuple, dim: int) -> int:
    """``G`` when a view splits ``dim`` alone into ``(G, size / G)``, the dims around it kept
    (``qkv.reshape(b, t, G, -1)``); else 0.

    >>> _groups_view((2, 11, 96), (2, 11, 4, 24), 2), _groups_view((2, 11, 96), (2, 11, 4, 8, 3), 2)
    (4, 0)
    """
    if len(out_shape) != len(in_shape) + 1 or tuple(out_shape[:dim]) != tuple(in_shape[:dim]) \
            or tuple(out_shape[dim + 2:]) != tuple(in_shape[dim + 1:]):
        return 0
    groups, inner = out_shape[dim], out_shape[dim + 1]
    return groups if groups > 1 and inner > 1 and groups * inner == in_shape[dim] else 0


# Ops that cut a dim into pieces (the parts of a group, ``[q | v | k]``) -> the position of their dim.
_CUT_DIMS = {"split": 2, "split_with_sizes": 2, "chunk": 2, "slice": 1, "narrow": 1, "unbind": 1}


def _cut_inside(g, name, dim) -> bool:
    """Whether every reader of ``name`` (through copies) cuts it along ``dim``: a fused output
    viewed as groups whose parts are then cut from each group, not heads viewed for attention."""
    readers = [s for s in g.successors(name) if g.nodes[s]["op"] not in SINKS]
    for reader in readers:
        op, args = g.nodes[reader]["op"], g.nodes[reader]["args"]
        if op in PASSTHROUGH and args and isinstance(args[0], Ref) and args[0].name == name:
            if not _cut_inside(g, reader, dim):
                return False
            continue
        at = _arg(g, reader, _CUT_DIMS[op], "dim", 0) if op in _CUT_DIMS else None
        if not isinstance(at, int) or _norm(at, _ndim(g, name)) != dim:
            return False
    return bool(readers)


def _parts_view(g, name, in_shape, out_shape, dim, e) -> int:
    """The number of parts, where view ``name`` splits the sharded ``dim`` into ``(parts, inner...)``
    at output dim ``e`` and every reader takes single parts along ``e`` (``qkv.view(b, t, 3, heads,
    hd).unbind(2)``, or through a ``permute`` first): the features are then parts side by side, a
    packed projection's, each sharded on its own next dim (its heads); else 0."""
    if e is None or e + 1 >= len(out_shape) or out_shape[e] < 2 or out_shape[e + 1] < 2:
        return 0
    inner = in_shape[dim] // out_shape[e]
    if in_shape[dim] % out_shape[e] or not any(math.prod(out_shape[e + 1:k]) == inner
                                               for k in range(e + 2, len(out_shape) + 1)):
        return 0
    taken = _parts_taken(g, name, e)
    return out_shape[e] if taken is not None and not _joined_again(g, taken, out_shape[e]) else 0


def _parts_taken(g, name, dim) -> list[str] | None:
    """The ``unbind`` / ``select`` nodes, if every reader of ``name`` takes single indices along
    ``dim`` with one, followed through copies, transposes and permutes that move it; else None."""
    todo, seen, taken = [(name, dim)], set(), []
    while todo:
        node, d = todo.pop()
        readers = [s for s in g.successors(node) if g.nodes[s]["op"] not in SINKS]
        if not readers or (node, d) in seen:
            return None
        seen.add((node, d))
        for reader in readers:
            data, ndim = g.nodes[reader], _ndim(g, node)
            op, args = data["op"], data["args"]
            if op in ("unbind", "select"):
                at = args[1] if len(args) > 1 else data["kwargs"].get("dim", 0)
                if not isinstance(at, int) or _norm(at, ndim) != d:
                    return None
                taken.append(reader)
            elif op in PASSTHROUGH and args and isinstance(args[0], Ref) and args[0].name == node:
                todo.append((reader, d))
            elif op == "permute":
                todo.append((reader, [_norm(x, ndim) for x in args[1]].index(d)))
            elif op == "transpose" and len(args) > 2:
                a, b = (_norm(x, ndim) for x in args[1:3])
                todo.append((reader, b if d == a else a if d == b else d))
            else:
                return None
    return taken


def _joined_again(g, taken: list[str], count: int) -> bool:
    """Whether ``taken``, the single indices selected along a dim of ``count``, are every index,
    each processed apart and joined back in order by one ``cat`` / ``stack``: a loop over heads
    (:mod:`autotp.synth.head_loops`), whose dim is the heads', not parts of a packed output read
    apart (``q, k, v = qkv.unbind(2)``)."""
    by_index: dict[int, set[str]] = {}
    for node in taken:
        index = g.nodes[node]["args"][2] if g.nodes[node]["op"] == "select" else None
        if not isinstance(index, int):
            return False
        by_index.setdefault(index % count, set()).add(node)
    if sorted(by_index) != list(range(count)):
        return False
    module = g.nodes[taken[0]]["module"]
    below = {k: set().union(*(_within(g, n, module) for n in nodes)) for k, nodes in by_index.items()}
    for join in set.intersection(*below.values()):
        tensors = g.nodes[join]["args"][0] if g.nodes[join]["op"] in JOINS and g.nodes[join]["args"] else None
        if isinstance(tensors, (list, tuple)) and len(tensors) == count and all(
                isinstance(t, Ref) and t.name in below[k] and sum(t.name in b for b in below.values()) == 1
                for k, t in enumerate(tensors)):
            return True
    return False


def _within(g, start: str, module: str) -> set[str]:
    """The nodes computed from ``start`` inside ``module`` (its own ops and its children's)."""
    seen, todo = set(), [start]
    while todo:
        for succ in g.successors(todo.pop()):
            if succ not in seen and (not module or module in (g.nodes[succ].get("stack") or ())):
                seen.add(succ)
                todo.append(succ)
    return seen


def _passthrough(g, name, dims, ctx):
    """The first argument's values in its layout. A second tensor argument (``type_as``'s dtype
    reference) lends only its dtype: sharded alone, it leaves the output unsharded."""
    source = g.nodes[name]["args"][0]
    if not isinstance(source, Ref) or source.name not in dims:
        return None
    return Out(dims[source.name], intact=ctx.intact(source.name))


def _broadcast_ok(g, name, other, out_dim, out_ndim, ctx) -> bool:
    """Whether unsharded input ``other`` can meet a tensor sharded on ``out_dim``: it must broadcast
    there (size 1 or absent), or be a parameter of a module that shards it along with the input."""
    shape = g.nodes[other]["shape"]
    if shape is None:
        return True
    offset = out_ndim - len(shape)
    if out_dim < offset or _same_along(g, other, out_dim - offset):
        return ctx.broadcast_grad_ok(other)
    return ctx.shards_along(other, name) or ctx.shard_param(other, out_dim - offset) \
        or ctx.sized_with(other, out_dim - offset) or ctx.expert_bias(other, out_dim - offset) \
        or ctx.shard_entry(other, out_dim - offset) or ctx.shard_tree(other, out_dim - offset)


def _broadcast_of(g, name, dim) -> bool:
    """Whether ``name`` is an ``expand`` of a tensor of size 1 at ``dim``: the same values for
    every index of that dim, so each rank may take as many as it holds heads (the per-rank run's
    shape proof checks that the expanded size is the per-rank one)."""
    while g.nodes[name]["op"] in PASSTHROUGH and g.nodes[name]["args"] and isinstance(g.nodes[name]["args"][0], Ref):
        name = g.nodes[name]["args"][0].name
    data = g.nodes[name]
    if data["op"] != "expand" or not isinstance(data["args"][0], Ref):
        return False
    source = g.nodes[data["args"][0].name]["shape"]
    offset = len(data["shape"] or ()) - len(source or ())
    return source is not None and (dim < offset or source[dim - offset] == 1)


def _aligned(dim: int, ndim: int, other_ndim: int) -> int | None:
    """Dim ``dim`` of an ``ndim``-d result in an operand of ``other_ndim`` dims broadcast from the end."""
    at = dim - (ndim - other_ndim)
    return at if at >= 0 else None


def _same_along(g, name, dim) -> bool:
    """Whether ``name`` holds the same values at every index of its ``dim`` (None: it lacks the dim):
    size 1 there, an ``expand`` of size 1 there, or a view that merges a size-1 dim into such an
    expand (the grouped-query repeat of one kv head, ``k[:, :, None].expand(b, 1, n, t, d).reshape(b,
    n, t, d)``). The shape proof checks that the per-rank run repeats it to the per-rank heads."""
    shape = g.nodes[name]["shape"]
    if dim is None or shape is None or not 0 <= dim < len(shape):
        return dim is None
    if shape[dim] == 1 or _broadcast_of(g, name, dim):
        return True
    data = g.nodes[name]
    moved = _moved_from(g, name, dim)
    if moved is not None:  # a transpose / permute: the same dim of its input, under another index
        return _same_along(g, data["args"][0].name, moved)
    if data["op"] not in VIEW_LIKE or not data["args"] or not isinstance(data["args"][0], Ref):
        return False
    source = g.nodes[data["args"][0].name]["shape"] or ()
    return any(tuple(source[:at]) == tuple(shape[:dim]) and source[at] == 1 and source[at + 1] == shape[dim]
               and tuple(source[at + 2:]) == tuple(shape[dim + 1:]) and _same_along(g, data["args"][0].name, at + 1)
               for at in range(len(source) - 1))


# Ops that only reorder their input's dims (:func:`_moved_from` reads each).
REORDERS = frozenset({"transpose", "swapaxes", "permute", "t"})


def _moved_from(g, name, dim) -> int | None:
    """The input dim that dim ``dim`` of ``name`` is, when ``name`` only reorders its input's dims
    (``transpose``, ``permute``, ``t``); else None."""
    data = g.nodes[name]
    if not data["args"] or not isinstance(data["args"][0], Ref):
        return None
    ndim = len(data["shape"] or ())
    if data["op"] in ("transpose", "swapaxes") and len(data["args"]) >= 3:
        a, b = (_norm(d, ndim) for d in data["args"][1:3])
        return b if dim == a else a if dim == b else dim
    if data["op"] == "t" and ndim == 2:
        return 1 - dim
    if data["op"] == "permute" and len(data["args"]) >= 2:
        order = [_norm(d, ndim) for d in data["args"][1]]
        return order[dim] if dim < len(order) else None
    return None


def _new_like(g, name, dims, ctx):
    (src, dim), = dims.items()
    in_shape, out_shape = g.nodes[src]["shape"], g.nodes[name]["shape"]
    if out_shape is None or len(out_shape) != len(in_shape) or out_shape[dim] != in_shape[dim]:
        return Break(f"{g.nodes[name]['op']} makes a tensor without the sharded dim {dim} of its input")
    return Out(dim)


def _elementwise(g, name, dims, ctx):
    out_ndim = _ndim(g, name)
    aligned = {src: out_ndim - _ndim(g, src) + d for src, d in dims.items()}
    if len(set(aligned.values())) > 1:
        return Break(f"{g.nodes[name]['op']} combines tensors sharded on different dims {sorted(set(aligned.values()))}")
    out_dim = next(iter(aligned.values()))
    data = g.nodes[name]
    for ref in _tensor_refs(data):
        if ref.name not in dims and not _broadcast_ok(g, name, ref.name, out_dim, out_ndim, ctx) \
                and not ctx.gives_way(ref.name, name) and not ctx.revives(ref.name, name):
            return Break(f"{data['op']} combines the sharded dim {out_dim} with the full-size tensor "
                         f"{ref.name} {g.nodes[ref.name]['shape']}")
    intact = all(ctx.intact(src) for src in dims) and g.nodes[name]["shape"][out_dim] == g.nodes[next(iter(dims))]["shape"][dims[next(iter(dims))]]
    return Out(out_dim, intact=intact)


def _tensor_refs(data):
    found = []
    for value in list(data["args"]) + list(data["kwargs"].values()):
        if isinstance(value, Ref):
            found.append(value)
    return found


def _reduction(g, name, dims, ctx):
    op = g.nodes[name]["op"]
    position, keeps_shape = REDUCTIONS[op]
    reduced = _arg(g, name, position, "dim")
    if isinstance(reduced, Ref) or len(dims) > 1:
        # ``torch.min(x, other)``: the elementwise form, a tensor where the dim would be.
        return _elementwise(g, name, dims, ctx) if op in ("max", "min") else \
            Break(f"{op} of several sharded tensors")
    src, dim = next(iter(dims.items()))
    ndim = _ndim(g, src)
    if reduced is None or (isinstance(reduced, (list, tuple)) and len(reduced) == 0):
        reduced = list(range(ndim))
    reduced = {_norm(r, ndim) for r in (reduced if isinstance(reduced, (list, tuple)) else [reduced])}
    if dim in reduced:
        return Break(f"{op} reduces over the sharded dim {dim}", reduction=True)
    shape = g.nodes[name]["shape"]
    kept = keeps_shape or (len(shape) == ndim if shape is not None else _arg(g, name, position + 1, "keepdim", False))
    out = Out(dim if kept else dim - sum(1 for r in reduced if r < dim))
    if g.nodes[name]["shape"] is None and op in _TUPLE_REDUCTIONS:
        # ``x.max(dim)`` -> (values, indices), ``var_mean`` -> (var, mean): both reduced alike.
        return Parts((out, out))
    return out


# Reductions that return two tensors of the reduced shape when given a dim.
_TUPLE_REDUCTIONS = frozenset({"max", "min", "var_mean", "std_mean"})


def _fused_norm(g, name, dims, ctx):
    src, dim = next(iter(dims.items()))
    normalized = _arg(g, name, 1, "normalized_shape")
    ndim = _ndim(g, src)
    if dim >= ndim - len(normalized):
        return Break(f"{g.nodes[name]['op']} normalises over the sharded dim {dim}", reduction=True)
    return Out(dim)


def _transpose(g, name, dims, ctx):
    (src, dim), = dims.items()
    ndim = _ndim(g, src)
    a, b = (_norm(x, ndim) for x in g.nodes[name]["args"][1:3]) if len(g.nodes[name]["args"]) > 2 else (0, 1)
    return Out(b if dim == a else a if dim == b else dim)


def _permute(g, name, dims, ctx):
    (src, dim), = dims.items()
    order = [_norm(d, _ndim(g, src)) for d in g.nodes[name]["args"][1]]
    return Out(order.index(dim))


def _unsqueeze(g, name, dims, ctx):
    (src, dim), = dims.items()
    at = _norm(g.nodes[name]["args"][1], _ndim(g, name))
    return Out(dim + 1 if at <= dim else dim, intact=ctx.intact(src))


def _squeeze(g, name, dims, ctx):
    (src, dim), = dims.items()
    in_shape, ndim = g.nodes[src]["shape"], _ndim(g, src)
    args = g.nodes[name]["args"]
    squeezed = args[1] if len(args) > 1 else list(range(ndim))
    squeezed = [_norm(d, ndim) for d in (squeezed if isinstance(squeezed, (list, tuple)) else [squeezed])]
    return Out(dim - sum(1 for d in squeezed if d < dim and in_shape[d] == 1), intact=ctx.intact(src))


def _expand(g, name, dims, ctx):
    (src, dim), = dims.items()
    return Out(dim + _ndim(g, name) - _ndim(g, src), intact=ctx.intact(src))


def _expand_as(g, name, dims, ctx):
    """``x.expand_as(y)`` (``F.normalize``'s denominator): x's shard must be y's; a replicated x
    expanded along y's sharded dim must have size 1 there (the same values for every index)."""
    src, like = g.nodes[name]["args"][:2]
    if not isinstance(src, Ref) or not isinstance(like, Ref) or like.name not in dims:
        return Break("expand_as of a sharded tensor to a replicated shape")
    dim, offset = dims[like.name], _ndim(g, name) - _ndim(g, src.name)
    if src.name in dims:
        return Out(dim) if dims[src.name] + offset == dim else Break("expand_as moves the sharded dim")
    if dim >= offset and g.nodes[src.name]["shape"][dim - offset] != 1:
        return Break(f"expand_as takes the full size of a replicated tensor along the sharded dim {dim}")
    if not ctx.broadcast_grad_ok(src.name):
        return Break("expand_as broadcasts a tensor whose gradient would stay a per-rank partial sum")
    return Out(dim)


def _repeat(g, name, dims, ctx):
    """``x.repeat(counts)`` tiles x. Along other dims the shard stays. Along the sharded dim, ``r``
    copies of a dim of size ``n`` are the dims ``(r, n)`` merged, sharded on ``n``: a fold (each
    rank holds its block of every copy, which is what the local ``repeat`` makes), so only readers
    of that same fold (attention whose query heads are folded alike) or a view splitting it back
    may follow (kv heads tiled to ``top_k`` query groups)."""
    (src, dim), = dims.items()
    counts = g.nodes[name]["args"][1]
    if isinstance(counts, int):
        counts = g.nodes[name]["args"][1:]
    out_dim = dim + len(counts) - _ndim(g, src)
    if counts[out_dim] == 1:
        return Out(out_dim)
    state = ctx.state.get(src)
    if not isinstance(counts[out_dim], int) or getattr(state, "fold", None) or getattr(state, "pieces", None):
        return Break(f"repeat copies the sharded dim {dim}")
    return Given(ctx.folded(name, src, out_dim, (counts[out_dim], g.nodes[src]["shape"][dim]), 1))


def _select(g, name, dims, ctx):
    (src, dim), = dims.items()
    at = _norm(g.nodes[name]["args"][1], _ndim(g, src))
    if at == dim:  # one head of a loop over every head (autotp.synth.head_loops), or a break
        if ctx.select_head(name, src, dim):
            return Given(None)
        return Break(f"select picks one index of the sharded dim {dim}")
    return Out(dim - 1 if at < dim else dim)


def _slice(g, name, dims, ctx):
    (src, dim), = dims.items()
    args = g.nodes[name]["args"]
    at = _norm(args[1] if len(args) > 1 else 0, _ndim(g, src))
    if at != dim:
        return Out(dim)
    size = g.nodes[src]["shape"][dim]
    start = args[2] if len(args) > 2 and args[2] is not None else 0
    start = max(start + size, 0) if start < 0 else start
    end = args[3] if len(args) > 3 and args[3] is not None else size
    end = min(max(end + size, 0) if end < 0 else end, size)  # ``[:-2]``: counted from the end
    step = args[4] if len(args) > 4 else 1
    if step != 1:
        return _strided_slice(g, name, src, dim, start, end, step, ctx)
    if ctx.pieces(src):
        cut = ctx.cut_pieces(name, src, [(start, end)])
        return Given(cut[0]) if cut else Break(f"slice [{start}:{end}] of joined pieces cuts one of them")
    if ctx.span(src) is None:  # cut points are features of the Linear's output (or a part of it)
        return Break(f"slice of the sharded dim {dim} [{start}:{end}:{step}]")
    return Split(dim, ((start, end),), tuple_output=False)


def _strided_slice(g, name, src, dim, start, end, step, ctx):
    """``h[..., k::s]`` of a whole Linear output (k < s, to the end): part k of features interleaved
    one by one (a gate/up fused feature by feature). Rank r holds the contiguous block r of ``h``;
    when that block's width is a multiple of s (the divisibility check asks that the output's
    size, size / s, splits over tp), its local ``[k::s]`` is exactly block r of the part, so the
    part stays sharded on the same dim (features no longer a range of the Linear's output)."""
    size = g.nodes[src]["shape"][dim]
    if not ctx.intact(src) or not 0 <= start < step or end < size or size % step:
        return Break(f"slice of the sharded dim {dim} [{start}:{end}:{step}] is not one of {step} "
                     f"interleaved parts of a whole Linear output")
    return Out(dim)


def _split_parts(g, name, dims, ctx, sizes, at):
    (src, dim), = dims.items()
    at = _norm(at, _ndim(g, src))
    if at != dim:
        return Parts(tuple(Out(dim) for _ in sizes))
    starts = [sum(sizes[:i]) for i in range(len(sizes))]
    if ctx.pieces(src):
        cut = ctx.cut_pieces(name, src, [(s, s + n) for s, n in zip(starts, sizes)])
        return Given(cut) if cut else Break(f"split into {list(sizes)} cuts joined pieces inside one")
    ranges = tuple((s, s + n) for s, n in zip(starts, sizes))
    if ctx.span(src) is None and ctx.head_span(src) is not None and len(set(sizes)) == 1 < len(sizes):
        # Heads viewed from an output (or a part of it) cut into equal parts: parts of that output,
        # laid out per part as a packed projection's (each rank its share of every part).
        return Split(dim, ranges, tuple_output=True, heads=True)
    if ctx.span(src) is None:  # a part cut again: its cuts are placed in the Linear's output
        return Break(f"split of the sharded dim {dim} into {list(sizes)}")
    return Split(dim, ranges, tuple_output=True)


def _split(g, name, dims, ctx):
    (src, dim), = dims.items()
    args = g.nodes[name]["args"]
    at = args[2] if len(args) > 2 else g.nodes[name]["kwargs"].get("dim", 0)
    size = g.nodes[src]["shape"][_norm(at, _ndim(g, src))]
    sizes = args[1]
    if not isinstance(sizes, (list, tuple)):
        sizes = [min(sizes, size - i) for i in range(0, size, sizes)]
    return _split_parts(g, name, dims, ctx, list(sizes), at)


def _chunk(g, name, dims, ctx):
    (src, dim), = dims.items()
    args = g.nodes[name]["args"]
    at = args[2] if len(args) > 2 else 0
    size = g.nodes[src]["shape"][_norm(at, _ndim(g, src))]
    step = -(-size // args[1])
    return _split_parts(g, name, dims, ctx, [min(step, size - i) for i in range(0, size, step)], at)


def _unbind(g, name, dims, ctx):
    (src, dim), = dims.items()
    args = g.nodes[name]["args"]
    at = _norm(args[1] if len(args) > 1 else g.nodes[name]["kwargs"].get("dim", 0), _ndim(g, src))
    if at == dim:
        return Break(f"unbind takes single indices of the sharded dim {dim}")
    return Parts(tuple(Out(dim - 1 if at < dim else dim) for _ in range(g.nodes[src]["shape"][at])))


def _cat(g, name, dims, ctx):
    data = g.nodes[name]
    tensors = data["args"][0]
    ndim = _ndim(g, name)
    at = _norm(_arg(g, name, 1, "dim", data["kwargs"].get("axis", 0)), ndim)
    if len(set(dims.values())) > 1:
        return _cat_conflict(dims, ctx)
    dim = next(iter(dims.values()))
    if at == dim:
        joined = ctx.join(name, tensors, dim)
        if joined is None:
            return Break(f"cat along the sharded dim {dim} of sharded and replicated tensors")
        return Given(joined)
    for ref in tensors:
        if isinstance(ref, Ref) and ref.name not in dims and _empty(g, ref.name):
            continue  # an empty piece (a cache's first ``cat`` onto ``tensor([])``) adds nothing
        # A replicated piece joins only if it can be sharded the same way (a per-head sink logit)
        # or is the same for every index of the dim (a rope part shared by all heads, expanded).
        if isinstance(ref, Ref) and ref.name not in dims and not ctx.shard_param(ref.name, dim):
            if not _broadcast_of(g, ref.name, dim):
                return Break(f"cat joins sharded and replicated tensors along dim {at}")
            if _from_params(g, ref.name) and not ctx.broadcast_from(ref.name):
                # Each rank would hold the gradient of its own heads only: a partial sum no style reduces.
                return Break(f"cat joins the sharded dim {dim} with a replicated tensor expanded along it "
                             f"whose gradient would stay a per-rank partial sum")
    return Out(dim)


def _empty(g, name) -> bool:
    """Whether ``name`` holds no elements (a size-0 dim in its traced shape)."""
    shape = g.nodes[name]["shape"]
    return shape is not None and 0 in shape


def _from_params(g, name) -> bool:
    """Whether ``name`` is computed from a parameter (its gradient flows back to one)."""
    return any(g.nodes[a].get("kind") == "param" for a in nx.ancestors(g, name))


def _cat_conflict(dims, ctx):
    """Pieces sharded on different dims (per-head q and a shared rope part sharded on its width):
    the candidates of the pieces on the dim holding the most weights go on, the others are dropped
    (whole, they are replicated pieces the next round reads again); all when that is a tie."""
    by_dim: dict[int, frozenset] = {}
    for src, dim in dims.items():
        by_dim[dim] = by_dim.get(dim, frozenset()) | ctx.state[src].origins
    weights = {dim: ctx.weight_of(origins) for dim, origins in by_dim.items()}
    best = max(weights.values())
    keep = [dim for dim, w in weights.items() if w == best]
    others = frozenset().union(*(o for dim, o in by_dim.items() if dim not in keep))
    if len(keep) > 1 or others & by_dim[keep[0]]:
        return Break("cat of tensors sharded on different dims")
    return Break(f"cat of tensors sharded on different dims {sorted(by_dim)}: the pieces on dim "
                 f"{keep[0]} hold more weights", only=others, then=Out(keep[0]))


def _stack(g, name, dims, ctx):
    data = g.nodes[name]
    at = _norm(_arg(g, name, 1, "dim", data["kwargs"].get("axis", 0)), _ndim(g, name))
    if len(set(dims.values())) > 1 or any(r.name not in dims for r in data["args"][0] if isinstance(r, Ref)):
        return Break("stack of tensors sharded on different dims, or of sharded and replicated ones")
    dim = next(iter(dims.values()))
    return Out(dim + 1 if at <= dim else dim)


def _attention(g, name, dims, ctx):
    q, k, v = (g.nodes[name]["args"][i] for i in range(3))
    ndim = _ndim(g, name)
    states = [dims.get(ref.name) for ref in (q, k, v)]
    sharded = {s for s in states if s is not None}
    if len(sharded) == 1 and all(ctx.gives_way_to_heads(ref.name, name) or ctx.scatters_onto_heads(ref.name, name)
                                 for ref in (q, k, v) if ref.name not in dims):
        states = [next(iter(sharded))] * 3  # the replicated side's candidates are dropped: decided next round
    elif len(sharded) == 1 and all(_same_along(g, ref.name, _aligned(next(iter(sharded)), ndim, _ndim(g, ref.name)))
                                   and ctx.broadcast_grad_ok(ref.name) for ref in (q, k, v) if ref.name not in dims):
        # One kv head read by every query head (multi-query): the same values at each head, so each
        # rank reads them with its own heads; their gradient is its heads' share (broadcast_grad_ok).
        states = [next(iter(sharded))] * 3
    if None in states or len(set(states)) > 1:
        return Break("attention mixes sharded and replicated query/key/value")
    dim = states[0]
    if dim >= ndim - 2:
        return Break(f"attention contracts over the sharded dim {dim}")
    mask = _arg(g, name, 3, "attn_mask")
    if isinstance(mask, Ref) and mask.name in dims:
        # A per-head bias computed from the sharded heads (a learned relative-position bias) holds
        # this rank's heads: it lines up with them from the end, as the mask broadcasts.
        if dims[mask.name] + ndim - _ndim(g, mask.name) != dim:
            return Break(f"attention mask is sharded on its dim {dims[mask.name]}, the heads on {dim}")
    elif isinstance(mask, Ref) and g.nodes[mask.name]["shape"]:
        shape = g.nodes[mask.name]["shape"]
        at = dim - (ndim - len(shape))  # the mask broadcasts from the end
        if at >= 0 and shape[at] != 1 and not ctx.shard_entry(mask.name, at):
            # Per-head values from parameters (a relative-bias table looked up per head, then masked):
            # sharded with the heads, each rank's its own, no gradient to reduce.
            if ctx.shard_param(mask.name, at) or ctx.shard_tree(mask.name, at):
                return Out(dim)
            return Break(f"attention mask holds all {shape[at]} heads of the sharded dim {dim} (a per-head bias "
                         "made outside the sharded region)")
        if not ctx.broadcast_grad_ok(mask.name):
            return Break("attention mask, the same for every head, is computed by a Linear: its gradient would "
                         "stay a per-rank partial sum")
    return Out(dim)


def _matmul(g, name, dims, ctx):
    """A batch dim sharded on both sides (or broadcast on the replicated one) stays sharded; so do
    the rows of the first matrix and the columns of the second (``state @ c`` with the state's
    channels sharded), the other operand then read whole by every rank: its gradient is each
    rank's share, which :meth:`~autotp.synth.flow.Flow.broadcast_grad_ok` must accept."""
    a, b = g.nodes[name]["args"][:2]
    return _product(g, name, dims, ctx, a, b)


def _product(g, name, dims, ctx, a, b):
    out_ndim = _ndim(g, name)
    if out_ndim < 2 or min(_ndim(g, a.name), _ndim(g, b.name)) < 2:
        return Break("matmul of a sharded vector")
    aligned = {}
    for ref, kept in ((a, -2), (b, -1)):  # the matrix dim of each operand that reaches the output
        if ref.name in dims:
            ndim, dim = _ndim(g, ref.name), dims[ref.name]
            if dim == ndim + kept:
                aligned[ref.name] = out_ndim + kept
            elif dim >= ndim - 2:
                return Break(f"matmul over the sharded dim {dim}")
            else:
                aligned[ref.name] = out_ndim - ndim + dim
    if len(set(aligned.values())) > 1:
        return Break("matmul of tensors sharded on different dims")
    out_dim = next(iter(aligned.values()))
    for ref in (a, b):
        if ref.name in dims:
            continue
        if out_dim >= out_ndim - 2:  # a matrix dim: the other operand has no such index
            if not ctx.broadcast_grad_ok(ref.name):
                return Break(f"matmul reads {ref.name} whole against sharded {'rows' if out_dim == out_ndim - 2 else 'columns'}, "
                             "and its gradient would stay a per-rank partial sum")
        elif not _broadcast_ok(g, name, ref.name, out_dim, out_ndim, ctx) and not ctx.gives_way_to_heads(ref.name, name) \
                and not ctx.scatters_onto_heads(ref.name, name) and not ctx.revives(ref.name, name):
            return Break("matmul of a sharded batch dim with a replicated one")
    return Out(out_dim)


def _baddbmm(g, name, dims, ctx):
    """``baddbmm(input, batch1, batch2)``: ``input`` plus the batched product, read as the matmul
    rule for the two matrices, then the elementwise rule for the sum with ``input``."""
    source, a, b = (_arg(g, name, i, key) for i, key in enumerate(("input", "batch1", "batch2")))
    product = {ref.name: dims[ref.name] for ref in (a, b) if isinstance(ref, Ref) and ref.name in dims}
    if not product:
        return Break("baddbmm adds a sharded tensor to a product of replicated ones")
    result = _product(g, name, product, ctx, a, b)
    if not isinstance(result, Out) or not isinstance(source, Ref):
        return result
    out_ndim = _ndim(g, name)
    if source.name in dims:
        if out_ndim - _ndim(g, source.name) + dims[source.name] != result.dim:
            return Break(f"baddbmm adds a tensor sharded on another dim than the product's {result.dim}")
    elif not _broadcast_ok(g, name, source.name, result.dim, out_ndim, ctx):
        return Break(f"baddbmm adds the full-size tensor {source.name} {g.nodes[source.name]['shape']} to a "
                     f"product sharded on dim {result.dim}")
    return Out(result.dim)


def _einsum(g, name, dims, ctx):
    """``einsum(equation, operands)``: the sharded dim's letter must survive to the output, and
    every operand with that letter must be sharded on it too (a batch or head index)."""
    equation, operands = g.nodes[name]["args"][0], list(g.nodes[name]["args"][1])
    inputs, _, output = equation.replace(" ", "").partition("->")
    subscripts = inputs.split(",")
    if "." in equation or not output or len(subscripts) != len(operands):
        return Break(f"einsum {equation!r} is not read (ellipsis or implicit output)")
    letters = {subscripts[i][d] for i, ref in enumerate(operands) if isinstance(ref, Ref) and ref.name in dims
               for d in [dims[ref.name]]}
    if len(letters) != 1:
        return Break(f"einsum {equation!r} has operands sharded on different indices")
    letter = letters.pop()
    if letter not in output:
        return Break(f"einsum {equation!r} contracts over the sharded index {letter!r}")
    for i, ref in enumerate(operands):
        if not isinstance(ref, Ref) or ref.name in dims:
            continue
        at = subscripts[i].index(letter) if letter in subscripts[i] else None
        if at is not None and g.nodes[ref.name]["shape"][at] != 1:
            if not ctx.shard_param(ref.name, at) and not ctx.sized_with(ref.name, at):
                return Break(f"einsum {equation!r} meets the sharded index {letter!r} with a replicated operand")
        elif not ctx.broadcast_grad_ok(ref.name):
            # The same values for every index of the sharded letter: each rank's gradient is its share.
            return Break(f"einsum {equation!r} broadcasts {ref.name} along the sharded index {letter!r}, and "
                         "its gradient would stay a per-rank partial sum")
    return Out(output.index(letter))


def _conv(g, name, dims, ctx):
    """A convolution over a channel-sharded input (dim 1) keeps the shard when it is grouped
    (depthwise: a group per channel) and tp divides the groups: each rank's channels are then whole
    groups, and its weight and bias (output channels on dim 0) are sharded with them. The group
    count joins the extents tp must divide, and the shape proof finds the ``groups`` attribute to
    divide per rank where it is not the channel count.

    A shard joined from pieces (``cat([q, k])``: each rank its share of every piece, one after
    another) keeps its groups when every piece is whole groups that tp divides
    (:meth:`~autotp.synth.flow.Flow.grouped`): a rank's local groups are then global groups, in
    order, and the weight's rows are packed like the pieces. A group straddling two pieces breaks,
    and so does a convolution that changes the channel count of such a layout."""
    data = g.nodes[name]
    op, x = data["op"], data["args"][0]
    weight, bias = _arg(g, name, 1, "weight"), _arg(g, name, 2, "bias")
    if not isinstance(x, Ref) or set(dims) != {x.name}:
        return Break(f"{op} with a sharded weight or bias")
    if dims[x.name] != 1 or _ndim(g, x.name) < 3:
        return Break(f"{op} over the sharded dim {dims[x.name]}, which is not the channel dim of a batched input")
    channels, groups = g.nodes[x.name]["shape"][1], _arg(g, name, CONVOLUTIONS[op], "groups", 1)
    if op == "convolution" and _arg(g, name, 6, "transposed", False):
        return Break(f"{op} is transposed")
    out_channels = g.nodes[name]["shape"][1] if g.nodes[name]["shape"] else None
    if groups == 1 and ctx.head_mixer(name, x.name):
        return Out(1)  # a module mixing the heads, gathered at entry and sliced at exit (head_mixers.py)
    if not isinstance(groups, int) or groups < 2 or channels % groups or not out_channels or out_channels % groups:
        return Break(f"{op} mixes the channels of the sharded dim 1 (groups={groups} for {channels} channels)")
    if not isinstance(weight, Ref) or not ctx.shard_param(weight.name, 0):
        return Break(f"{op}'s weight cannot be sharded with its channels (not a parameter read only here)")
    if isinstance(bias, Ref) and not ctx.shard_param(bias.name, 0):
        return Break(f"{op}'s bias cannot be sharded with its channels (not a parameter read only here)")
    state = ctx.state[x.name]
    if (state.pieces or state.fold) and out_channels != channels:  # the layout would not carry over
        return Break(f"{op} makes {out_channels} channels from {channels} of a shard joined from pieces")
    if groups != channels:
        if state.fold:
            return Break(f"{op} groups {channels // groups} channels of a shard folded into a merged dim")
        straddled = ctx.grouped(groups, channels)  # an output also cut into parts is refused after the pass
        if straddled:
            return Break(f"{op} groups {channels // groups} channels of a shard joined from pieces, and {straddled}")
    return Out(1)


def _repeat_interleave(g, name, dims, ctx):
    """``x.repeat_interleave(r, dim)`` with a fixed count: a block of rows [a, b) becomes the block
    [a r, b r), so a shard of that dim stays one (groups repeated to their heads)."""
    (src, dim), = dims.items()
    repeats, at = _arg(g, name, 1, "repeats"), _arg(g, name, 2, "dim")
    if not isinstance(repeats, int) or at is None:
        return Break("repeat_interleave by per-index counts or over the flattened tensor")
    return Out(dim)


def _triangular(g, name, dims, ctx):
    (src, dim), = dims.items()
    if dim >= _ndim(g, src) - 2:
        return Break(f"{g.nodes[name]['op']} masks the sharded dim {dim} against another")
    return Out(dim, intact=ctx.intact(src))


def _pad(g, name, dims, ctx):
    """A pad of other dims (a time axis, a chunk remainder) keeps the shard where it is."""
    (src, dim), = dims.items()
    widths, ndim = _arg(g, name, 1, "pad"), _ndim(g, src)
    if any(w != 0 and ndim - 1 - i // 2 == dim for i, w in enumerate(widths)):
        return Break(f"{g.nodes[name]['op']} widens the sharded dim {dim}")
    return Out(dim, intact=ctx.intact(src))


def _gather(g, name, dims, ctx):
    """``x.gather(d, index)`` (``take_along_dim``) picks along ``d`` only: a shard of x on another
    dim stays where it is when every index row it holds picks from its own rows. That is so when the
    index is sharded the same way, or is one row expanded along the sharded dim (the same picks for
    every head; the per-rank run's shape proof checks that the expanded size is the per-rank one)."""
    data = g.nodes[name]
    source, index = data["args"][0], _arg(g, name, 2, "index")
    at = _arg(g, name, 1, "dim")
    if not isinstance(source, Ref) or not isinstance(index, Ref) or source.name not in dims or at is None:
        return Break(f"{data['op']} picks from a tensor that is not the sharded one")
    dim, ndim = dims[source.name], _ndim(g, source.name)
    if _norm(at, ndim) == dim:
        return Break(f"{data['op']} picks along the sharded dim {dim}")
    if index.name in dims:
        if dims[index.name] != dim:
            return Break(f"{data['op']} index sharded on dim {dims[index.name]}, its source on {dim}")
    elif not (_broadcast_of(g, index.name, dim) and data["shape"][dim] == g.nodes[source.name]["shape"][dim]):
        return Break(f"{data['op']} index holds its own rows along the sharded dim {dim}")
    return Out(dim, intact=ctx.intact(source.name))


def _index_add(g, name, dims, ctx):
    """``out.index_add(d, index, src)``: rows of ``src`` added into rows of ``out`` along ``d``. A
    shard on another dim stays there when both hold the same block of it: both sharded on it, or
    ``out`` a constant made at the per-rank size (a fresh ``zeros`` the rows are scattered into,
    which the shape proof then requires, as for a scan's initial state). The index picks rows only."""
    data = g.nodes[name]
    target, at, index = data["args"][:3]
    source = data["args"][3] if len(data["args"]) > 3 else data["kwargs"].get("source")
    if not all(isinstance(x, Ref) for x in (target, index, source)) or isinstance(at, Ref):
        return Break(f"{data['op']} is called in a form its rule does not read")
    if index.name in dims:
        return Break(f"{data['op']} index is sharded")
    ndim = _ndim(g, name)
    sharded = {dims[x.name] for x in (target, source) if x.name in dims}
    if len(sharded) > 1:
        return Break(f"{data['op']} adds a tensor sharded on dim {dims[source.name]} into one sharded on "
                     f"{dims[target.name]}")
    dim = sharded.pop()
    if _norm(at, ndim) == dim:
        return Break(f"{data['op']} adds along the sharded dim {dim}")
    if source.name not in dims:
        return Break(f"{data['op']} adds a full-size tensor into one sharded on dim {dim}")
    if target.name not in dims and not ctx.sized_with(target.name, dim):
        return Break(f"{data['op']} adds a tensor sharded on dim {dim} into the full-size tensor {target.name} "
                     f"{g.nodes[target.name]['shape']}")
    return Out(dim, intact=ctx.intact(source.name) and data["shape"][dim] == g.nodes[source.name]["shape"][dim])


def _index(g, name, dims, ctx):
    """``x[..., idx, ...]`` (advanced indexing by index tensors on a run of dims): rows picked along
    those dims; a shard on a dim outside the run stays, moved by the dims the run becomes."""
    data = g.nodes[name]
    source, indices = data["args"][:2]
    if not isinstance(source, Ref) or source.name not in dims or not isinstance(indices, (list, tuple)):
        return Break(f"{data['op']} picks by a sharded index")
    used = [i for i, x in enumerate(indices) if x is not None]
    if not used or used != list(range(used[0], used[-1] + 1)) \
            or any(not isinstance(indices[i], Ref) or indices[i].name in dims for i in used):
        return Break(f"{data['op']} picks by sharded or scattered indices")
    dim = dims[source.name]
    if dim < used[0]:
        return Out(dim)
    if dim <= used[-1]:
        return Break(f"{data['op']} picks along the sharded dim {dim}")
    shapes = [g.nodes[indices[i].name]["shape"] for i in used]
    if any(s is None for s in shapes):
        return Break(f"{data['op']} picks by indices of unknown shape")
    picked = max(len(s) for s in shapes)
    return Out(used[0] + picked + dim - used[-1] - 1, intact=ctx.intact(source.name))


RULES = {
    "gather": _gather,
    "index": _index,
    **{op: _index_add for op in INDEX_ADDS},
    **{op: _passthrough for op in PASSTHROUGH},
    **{op: _elementwise for op in ELEMENTWISE},
    **{op: _view for op in VIEW_LIKE},
    **{op: _reduction for op in REDUCTIONS},
    **{op: _fused_norm for op in FUSED_NORMS},
    **{op: _attention for op in ATTENTION},
    **{op: _matmul for op in MATMULS},
    "baddbmm": _baddbmm,
    **{op: _new_like for op in NEW_LIKE},
    **{op: _conv for op in CONVOLUTIONS},
    **{op: _pad for op in PADS},
    **{op: _triangular for op in TRIANGULAR},
    "repeat_interleave": _repeat_interleave,
    "transpose": _transpose, "t": _transpose, "permute": _permute, "unsqueeze": _unsqueeze,
    "squeeze": _squeeze, "expand": _expand, "expand_as": _expand_as, "repeat": _repeat, "select": _select, "slice": _slice,
    "split": _split, "split_with_sizes": _split, "chunk": _chunk, "unbind": _unbind,
    "cat": _cat, "concat": _cat, "concatenate": _cat, "stack": _stack, "einsum": _einsum,
}


def _by_dtensor(g, name, dims, ctx, op):
    """An op outside the table: DTensor's own strategy for it (:mod:`autotp.synth.dtensor_rules`)."""
    found = dtensor_rule(g, name, dims, ctx)
    if found is None:
        return Break(f"{op} is not known to keep a sharded dim (neither autotp's rules nor DTensor's "
                     "strategy keep it without moving data)")
    if len(found) == 1 and g.nodes[name]["shape"] is not None:
        return Out(found[0])
    return Parts(tuple(Out(d) for d in found))


def apply_rule(g: nx.DiGraph, name: str, dims: dict[str, int], ctx):
    """The effect of node ``name`` on the sharded inputs ``dims`` (see the module docstring)."""
    op = g.nodes[name]["op"]
    if op in SINKS:
        return None
    rule = RULES.get(op)
    if rule is None:
        return _by_dtensor(g, name, dims, ctx, op)
    try:
        result = rule(g, name, dims, ctx)
    except (TypeError, ValueError, IndexError, KeyError) as error:
        # A call the rule's table does not describe (a dim given as a string, several sharded
        # inputs to a view): unknown, so the shard stops here and its Linears stay whole.
        return Break(f"{op} is called in a form its rule does not read ({type(error).__name__}: {error})")
    if isinstance(result, Out) and not g.nodes[name]["shape"]:
        return Break(f"{op} returns no single tensor to carry the sharded dim")
    return result
