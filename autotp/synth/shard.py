"""The sharded value the propagation records (:class:`Shard`), in a leaf module: the analysis
(:mod:`autotp.synth.fixpoint`) and the idioms' propagation steps it calls (head loops) make them."""

from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Shard:
    """A sharded value: its dim, the candidate Linears it comes from, and the path it took.

    ``span``: the features ``[start, end)`` of its origins' output that the sharded dim holds,
    in order, when it is such a range (the whole output, or a part cut from it): a part may be cut
    again (a packed projection whose part is itself packed), and its cuts are then placed in the
    origin's output.

    ``pieces``: for a ``cat`` of shards along their sharded dim, ``(shard, width)`` per joined
    tensor in order. Each rank then holds its share of every piece, one after another, so only ops
    that keep the dim's features in place (elementwise, a depthwise convolution with its weight
    packed alike) or cut it back at the pieces may follow.

    ``fold``: ``(sizes, k)`` when ``dim`` is several dims of these global sizes merged by a view,
    the sharded one at position ``k`` not the outermost (``(b, t, heads, hd) -> (b * t * heads,
    hd)``, a per-head norm over rows): each rank holds rows of every ``(b, t)``, not one block.
    Only ops that keep the rows in place, or a view that splits them back, may follow.

    ``head_span``: ``(start, end, unit)`` when ``dim`` holds the features ``[start, end)`` of its
    origins' output viewed into heads of ``unit`` features each (``(b, t, h * hd) -> (b, t, h, hd)``,
    then transposes and per-head ops): index ``i`` of ``dim`` is features ``start + i * unit`` on.
    A cut of the heads into equal parts (``chunk``) is then a cut of the output into parts, as a cut
    of the features is (``span`` is None there: its width is not the dim's size).
    """

    dim: int
    origins: frozenset
    intact: bool = False
    prev: str | None = None
    span: tuple[int, int] | None = None
    pieces: tuple[tuple[Shard, int], ...] | None = None
    fold: tuple[tuple[int, ...], int] | None = None
    head_span: tuple[int, int, int] | None = None

    @property
    def features(self) -> tuple[int, int] | None:
        """The features of the origins' output this shard holds: its span, or its heads' span."""
        return self.span or (self.head_span[:2] if self.head_span else None)
