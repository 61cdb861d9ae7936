"""What a style shards and communicates, declared by the style: the facts the checker reads.

A style class says what it does to the module it is applied to in :meth:`declares`, returning a
:class:`Shards`: how it shards a Linear's weight (column / row, packed parts, transposed storage,
kv heads repeated over the ranks), which parameters it shards with the heads and which gradients it
reduces, which attributes it divides by tp, and what it does at the module's boundary (slices
whole arguments to the heads, views inputs at per-rank width, reduces width statistics). torch's
own ``ColwiseParallel`` / ``RowwiseParallel`` (and any subclass that declares nothing more) are
read from their layouts by :func:`torch_shards`.

:func:`declaration` reads one style; :func:`chain_declaration` merges a wrapper's declaration with
the styles it wraps (``wrapped``), the outer one first.

    >>> from torch.distributed.tensor.parallel import ColwiseParallel
    >>> declaration(ColwiseParallel()).linear
    'column'
"""

from __future__ import annotations

from dataclasses import dataclass, fields

from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import ColwiseParallel, RowwiseParallel
from torch.distributed.tensor.parallel.style import ParallelStyle


@dataclass(frozen=True)
class Shards:
    """What one style does to its module. ``None`` (or False) is "not declared": a wrapper's field
    is filled from the style it wraps (:func:`chain_declaration`).

    Attributes:
        linear: ``"column"`` or ``"row"``: the style shards a Linear-like weight so (torch's
            ``ColwiseParallel`` / ``RowwiseParallel`` and their subclasses).
        output_sharded: a column whose output stays sharded (a gathered output ends the shard).
        input_sharded: a row that takes a sharded input (its input layout is not ``Replicate()``).
        scatters_heads: a row whose reduced output is scattered onto its last dim (one value per head).
        sizes: a column's packed output parts, or a row's packed input parts.
        weight_in_out: the weight is stored ``(in, out)`` (``Conv1D``).
        kv_repeat: ``(kv_heads, head_dim)`` of a k / v column each rank holds a whole kv head of.
        param_dims: parameter -> the dim it is sharded on with the heads (per-head parameters).
        param_packed: parameter -> the parts it is packed in like a packed Linear's.
        grads_reduced: parameters whose gradients are all-reduced (``("*",)``: every one).
        raw_linear: ``(columns, rows)``: parameters multiplied like a Linear's weight, by role.
        experts: per-expert weights: parameter -> sharded dim (the rank's share of every FFN).
        experts_packed: per-expert parameter -> number of equal parts fused along its sharded dim.
        counts: attributes divided by tp on each rank.
        width_view: ``(inputs, readers)``: arguments seen at per-rank width, and who reads them.
        rewrites: styles that rewrite the module's code for per-rank shapes; the shape proof runs
            each one's ``localize(module, tp)`` on its per-rank copy.
        slices_entries: whole arguments are sliced to the module's heads at entry.
        statistics: width statistics (a mean, a std) are reduced over the ranks.
        width_norm: a norm over the sharded width, reduced over the ranks.
        kv_counts: the kv-head counts of an attention whose kv heads are repeated over the ranks.
        copies: the :class:`~autotp.styles.GroupCopies` that expands the module before its base style.
    """

    linear: str | None = None
    output_sharded: bool = False
    input_sharded: bool = False
    scatters_heads: bool = False
    sizes: tuple[int, ...] | None = None
    weight_in_out: bool = False
    kv_repeat: tuple[int, int] | None = None
    param_dims: dict | None = None
    param_packed: dict | None = None
    grads_reduced: tuple[str, ...] | None = None
    raw_linear: tuple[tuple[str, ...], tuple[str, ...]] | None = None
    experts: dict | None = None
    experts_packed: dict | None = None
    counts: tuple[str, ...] | None = None
    width_view: tuple | None = None
    rewrites: tuple | None = None
    slices_entries: bool = False
    statistics: bool = False
    width_norm: bool = False
    kv_counts: bool = False
    copies: ParallelStyle | None = None

    @property
    def head_params(self) -> bool:
        """Parameters handled with the heads: sharded with them, or replicated with their gradients
        all-reduced (what a per-head norm needs)."""
        return self.param_dims is not None or self.grads_reduced == ("*",)

    def reduces(self, names) -> bool:
        """Whether the gradients of every parameter in ``names`` are all-reduced."""
        return self.grads_reduced == ("*",) or set(names) <= set(self.grads_reduced or ())


NOTHING = Shards()


def torch_shards(style: ParallelStyle, **more) -> Shards:
    """The declaration torch's ``ColwiseParallel`` / ``RowwiseParallel`` imply by their layouts
    (and a ``sizes`` attribute a packed subclass adds), plus ``more``; nothing for other styles."""
    if isinstance(style, ColwiseParallel):
        return Shards(linear="column", output_sharded=tuple(style.output_layouts) != (Replicate(),),
                      sizes=getattr(style, "sizes", None), **more)
    if isinstance(style, RowwiseParallel):
        return Shards(linear="row", input_sharded=tuple(style.input_layouts) != (Replicate(),),
                      scatters_heads=tuple(style.output_layouts) == (Shard(-1),), sizes=getattr(style, "sizes", None),
                      **more)
    return Shards(**more)


def declaration(style: ParallelStyle | None) -> Shards:
    """What ``style`` itself declares (its :meth:`declares`, else what torch's layouts imply)."""
    if style is None:
        return NOTHING
    declares = getattr(style, "declares", None)
    return declares() if declares is not None else torch_shards(style)


def chain_declaration(style: ParallelStyle | None) -> Shards:
    """``style``'s declaration merged with those of the styles it wraps, outer first: each field
    comes from the outermost style that declares it."""
    merged: dict = {}
    while style is not None:
        own = declaration(style)
        for f in fields(Shards):
            if f.name not in merged and getattr(own, f.name) not in (None, False):
                merged[f.name] = getattr(own, f.name)
        style = getattr(style, "wrapped", None)
    return Shards(**merged)
