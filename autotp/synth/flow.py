"""The state of one propagation: :class:`Flow`, what each candidate's shard met, and the queries
the op rules ask of it while it runs (:mod:`autotp.synth.propagation` fills it; the fixpoint and
the role assignment read it).

Long because every idiom's propagation state lives on it: the op rules read it through its
methods (``shard_param``, ``broadcast_from``, ``group_view``, ...).
"""

from __future__ import annotations

import logging
import math
from dataclasses import dataclass, field

import networkx as nx

from autotp.synth.graph import Ref, refs
from autotp.synth.experts import expert_bias
from autotp.synth.entries import entry_source
from autotp.synth.head_loops import select_head
from autotp.synth.statistics import block_statistic
from autotp.synth.params import (broadcast_source, carries_grad, factory_dim, module_output_sources, param_dim,
                                 tree_leaves)
from autotp.synth.ops import SCALINGS, SINKS
from autotp.synth.queries import (_only_params_behind, _value_inputs, is_linear, linear_weight, module_of,
                                  module_outputs, param_source, raw_like, upstream_linears, weight_of)
from autotp.synth.shard import Shard
from autotp.synth.head_mixers import mixer_module

log = logging.getLogger(__name__)


@dataclass
class Flow:
    """The result of one propagation, and the context the op rules query while it runs."""

    g: nx.DiGraph
    state: dict = field(default_factory=dict)
    broken: dict = field(default_factory=dict)  # root -> (reason, node)
    rows: dict = field(default_factory=dict)  # row linear node -> origins
    heads: dict = field(default_factory=dict)  # root -> output node's sharded input
    splits: dict = field(default_factory=dict)  # root -> list of (start, end)
    split_nodes: dict = field(default_factory=dict)  # root -> nodes that cut its output into parts
    part_views: set = field(default_factory=set)  # roots whose parts a view puts on a dim of their own
    head_cuts: set = field(default_factory=set)  # roots whose heads a chunk cuts into parts (Shard.head_span)
    width_norms: dict = field(default_factory=dict)  # module -> node that reduces
    width_stats: dict = field(default_factory=dict)  # block -> its statistics of the shard (statistics.py)
    extent: dict = field(default_factory=dict)  # root -> gcd of every sharded extent it reached
    roots: set = field(default_factory=set)  # candidates that started a shard this pass
    unit_heads: frozenset = frozenset()  # candidates whose views may split off one head (one-kv-head k/v)
    whole: dict = field(default_factory=dict)  # Linear node -> why its weight stays whole (no column, no row)
    param_shards: dict = field(default_factory=dict)  # parameter placeholder -> dim sharded with the heads
    param_uses: dict = field(default_factory=dict)  # parameter placeholder -> {(operand, node)} that met the heads
    param_spans: dict = field(default_factory=dict)  # parameter placeholder -> {(origins, span, pieces)} it met
    param_heads: dict = field(default_factory=dict)  # parameter placeholder -> {(origins, head_span)} it met
    piece_cuts: set = field(default_factory=set)  # nodes that cut a joined shard back into pieces, or unfold one
    factory_shards: dict = field(default_factory=dict)  # constant factory node -> (dim, origins it met)
    tree_dims: dict = field(default_factory=dict)  # pointwise node on parameters / constants -> dim met by the heads
    tree_uses: dict = field(default_factory=dict)  # such a node -> {(node, dim)} where it met the heads
    tree_origins: dict = field(default_factory=dict)  # such a node -> {origins of the shards it met}
    conv_groups: dict = field(default_factory=dict)  # candidate -> group counts of the grouped convolutions it met
    writes: dict = field(default_factory=dict)  # in-place write node -> the tensor it wrote a shard into
    meeting: tuple = ()  # the sharded inputs of the node a rule is deciding (for shard_param)
    deciding: str = ""  # the node a rule is deciding
    yielded: dict = field(default_factory=dict)  # root that gave way -> the candidates it gave way to
    broadcasts: dict = field(default_factory=dict)  # whole or row Linear -> output spans broadcast to the shard
    broadcast_starts: dict = field(default_factory=dict)  # (Linear, span) -> the node where the span begins
    broadcast_modules: dict = field(default_factory=dict)  # broadcast source node -> its module, when not a Linear
    expert_biases: dict = field(default_factory=dict)  # per-expert bias parameter -> dim sharded with the experts
    expert_bias_columns: dict = field(default_factory=dict)  # per-expert bias parameter -> the columns it met
    entry_shards: dict = field(default_factory=dict)  # (value made outside a module, module) -> dim sliced at entry
    entry_uses: dict = field(default_factory=dict)  # (value, module) -> {(operand, node)} that met the heads
    entry_origins: dict = field(default_factory=dict)  # (value, module) -> the candidates whose shard met it
    module_alone: bool = False  # the graph is one module exported alone (see propagate)
    mixers: dict = field(default_factory=dict)  # module mixing the sharded heads -> (dim, origins) (head_mixers.py)
    copied: dict = field(default_factory=dict)  # candidate -> spans of its output held whole on every rank
    copy_cuts: dict = field(default_factory=dict)  # cutting node -> {element index or None: (root, span)} held whole
    per_group: frozenset = frozenset()  # candidates whose views into fixed groups are read per group (group_view)
    groupable: dict = field(default_factory=dict)  # candidate whose whole output a view splits into groups -> G
    group_views: dict = field(default_factory=dict)  # candidate read per group -> (groups, width of a group)
    row_packs: dict = field(default_factory=dict)  # row Linear -> part widths of its input (a folded shard's)
    scatters: set = field(default_factory=set)  # rows whose reduced output stays sharded on the heads (per_head_row)
    scatters_met: set = field(default_factory=set)  # those whose output shard met the heads they read again
    revivable: dict = field(default_factory=dict)  # dropped candidate -> the op where its shard met a whole operand
    revived: set = field(default_factory=set)  # those this pass found met there by another shard (revives)
    head_scatters: frozenset = frozenset()  # rows reduce-scattered onto the heads they feed (scatters_onto_heads)
    scatter_requests: set = field(default_factory=set)  # rows this pass found feeding whole a product over heads
    per_head: dict = field(default_factory=dict)  # node -> HeadValue: one head's value in a per-head loop (head_loops.py)
    head_selects: set = field(default_factory=set)  # selects of one head from a sharded dim
    head_operands: dict = field(default_factory=dict)  # parameter select (and its chain) of one head -> HeadValue
    head_loops: dict = field(default_factory=dict)  # join of every head's value -> (heads, joined nodes)

    def select_head(self, name: str, src: str, dim: int) -> bool:
        """Whether ``select(src, dim, i)`` of the sharded ``dim`` is read as one head's value in a
        per-head loop (:func:`~autotp.synth.head_loops.select_head`)."""
        return select_head(self, name, src, dim)

    def sharded(self, name: str) -> bool:
        """Whether ``name``'s output (or an element of it) is sharded."""
        return isinstance(self.state.get(name), (Shard, tuple))

    def shard_param(self, other: str, dim: int) -> bool:
        """Whether replicated operand ``other`` can be sharded on its ``dim`` along with the tensor
        it meets: a chain of one-tensor ops on a parameter (a per-head scale, a sink, a per-channel
        decay read at every step of a recurrence). Recorded in ``param_shards``; one parameter
        sharded on two dims cannot be. Each read is recorded in ``param_uses``: a parameter with
        a reader that does not meet the heads there is refused after the pass
        (:func:`stray_param_reads`), since that reader would get a shard where it wants the whole."""
        found = param_dim(self.g, other, dim)
        if found is None or self.param_shards.get(found[0], found[1]) != found[1]:
            return False
        self.param_shards[found[0]] = found[1]
        self.param_uses.setdefault(found[0], set()).add((other, self.deciding))
        for shard in self.meeting:  # a part cut from a packed output: the parameter is packed alike
            self.param_spans.setdefault(found[0], set()).add((shard.origins, shard.span, shard.pieces))
            if shard.head_span:  # per head: must meet one contiguous part (mixed_parts)
                self.param_heads.setdefault(found[0], set()).add((shard.origins, shard.head_span))
        return True

    def shard_tree(self, other: str, dim: int) -> bool:
        """Whether replicated operand ``other`` is computed by pointwise ops from parameters, buffers
        and constant tensors alone (``torch.zeros(b, heads, dk, dv) * exp(-self.slope * n)``, a decayed
        initial state), each of which can meet the shard on its own: every chain at a leaf is sharded
        (:meth:`shard_param`) or made at the per-rank size (:meth:`sized_with`) on the dim that lines
        up with ``dim``. All or nothing: a leaf that cannot leaves every leaf as it was. The tree's
        nodes are recorded in ``tree_dims`` (the shape proof divides them); each may be read
        elsewhere only where it meets the heads too (:func:`~autotp.synth.params.stray_tree_reads`)."""
        nodes: dict[str, int] = {}
        leaves = tree_leaves(self.g, other, dim, nodes)
        if not leaves or any(self.tree_dims.get(node, at) != at for node, at in nodes.items()):
            return False
        # Feasible first, so a refusal records nothing; then each leaf meets the shard as a chain.
        if any(self.param_shards.get(source, at) != at or self.factory_shards.get(source, (at,))[0] != at
               for _, _, _, (source, at) in leaves):
            return False
        deciding = self.deciding
        try:
            for chain, at, parent, _ in leaves:
                self.deciding = parent
                self.shard_param(chain, at) or self.sized_with(chain, at)
        finally:
            self.deciding = deciding
        self.tree_dims.update(nodes)
        self.tree_uses.setdefault(other, set()).add((self.deciding, dim))
        origins = frozenset().union(*(shard.origins for shard in self.meeting))
        for node in nodes:
            self.tree_origins.setdefault(node, set()).add(origins)
        return True

    def sized_with(self, other: str, dim: int) -> bool:
        """Whether replicated operand ``other`` is a constant tensor made from sizes alone (a scan's
        zero initial state) whose ``dim`` meets the shard: it is made at the per-rank size on each
        rank, which the shape proof then requires. Recorded in ``factory_shards``."""
        found = factory_dim(self.g, other, dim)
        if found is None or self.factory_shards.get(found[0], (found[1],))[0] != found[1]:
            return False
        origins = frozenset().union(*(shard.origins for shard in self.meeting))
        previous = self.factory_shards.get(found[0], (found[1], frozenset()))[1]
        self.factory_shards[found[0]] = (found[1], previous | origins)
        return True

    def head_mixer(self, name: str, src: str) -> bool:
        """Whether op ``name``, which mixes the sharded channels of ``src``, is a module of its own
        that can run whole between a gather of its input and a slice of its output
        (:func:`autotp.synth.head_mixers.mixer_module`): talking heads' 1x1 convolutions. Recorded
        in ``mixers``."""
        module = mixer_module(self.g, name, src)
        if module is None or self.state[src].pieces or self.state[src].fold:
            return False
        dim = self.state[src].dim
        previous = self.mixers.get(module, (dim, frozenset()))
        if previous[0] != dim:
            return False
        self.mixers[module] = (dim, previous[1] | self.state[src].origins)
        return True

    def shard_entry(self, other: str, dim: int) -> bool:
        """Whether replicated operand ``other`` comes, through one-tensor ops inside the module that
        decides here, from a value made outside it (a per-head bias built at the root and passed
        in), which that module can take sliced to its heads on entry
        (:mod:`autotp.synth.entries`). Recorded in ``entry_shards``; a value sliced on two dims, or
        for two modules, cannot be. Shards joined from pieces hold no block of heads: refused.

        Heads folded into a merged dim (``(b, heads) -> b * heads`` rows of a batched matmul) meet
        the value's dim of the same size row for row: it is sliced as ``(-1, heads, inner)`` on the
        heads, which keeps the rows of the same indices as the shard's, recorded as ``(dim, heads,
        inner)``."""
        folds = {shard.fold for shard in self.meeting}
        if not self.deciding or any(shard.pieces for shard in self.meeting) or len(folds) > 1:
            return False
        found = entry_source(self.g, other, dim, self.deciding, at_root=self.module_alone)
        if found is None:
            return False
        source, module, source_dim = found
        fold = folds.pop()
        if fold is not None:
            sizes, k = fold
            if self.g.nodes[source]["shape"][source_dim] != math.prod(sizes):
                return False
            source_dim = (source_dim, sizes[k], math.prod(sizes[k + 1:]))
        key = (source, module)  # one value may enter several modules (each layer kind's attention)
        if self.entry_shards.get(key, source_dim) != source_dim:
            return False
        self.entry_shards[key] = source_dim
        self.entry_uses.setdefault(key, set()).add((other, self.deciding))
        origins = frozenset().union(*(shard.origins for shard in self.meeting))
        self.entry_origins[key] = self.entry_origins.get(key, frozenset()) | origins
        return True

    def grouped(self, groups: int, channels: int) -> str | None:
        """The shard meets an op over ``groups`` groups of its ``channels`` (a grouped convolution):
        each rank must hold whole groups, so tp must divide ``groups`` as it divides the heads.

        A shard joined from pieces holds a share of each piece, one after another: each piece must
        be whole groups (none straddles two pieces), and tp must divide each piece's group count
        (a rank's share of a piece is then whole groups, which start where a global group starts).
        Returns why a piece does not fit (nothing recorded), else None."""
        size = channels // groups
        pieces = [(shard, width) for m in self.meeting for shard, width in (m.pieces or ((m, channels),))]
        for shard, width in pieces:
            if width % size:
                modules = ", ".join(sorted({module_of(self.g, o) for o in shard.origins}))
                return f"its piece of {width} channels from {modules} is not whole groups"
        for shard, width in pieces:
            for origin in shard.origins:
                self.extent[origin] = math.gcd(self.extent.get(origin, 0), width // size)
        for origin in frozenset().union(*(m.origins for m in self.meeting)):
            self.conv_groups.setdefault(origin, set()).add(groups)
        return None

    def expert_bias(self, other: str, dim: int) -> bool:
        """Whether replicated operand ``other`` is a per-expert bias (``B[e]``, ``B[ids]``:
        :func:`~autotp.synth.experts.expert_bias`) added to the whole output of 3-D experts columns
        of the module that owns ``B``, its features on ``dim``: ``B`` is sharded on them with the
        experts. Recorded in ``expert_biases``."""
        found = expert_bias(self.g, other, dim)
        if found is None or self.expert_biases.get(found[0], found[1]) != found[1]:
            return False
        owner = self.g.nodes[found[0]]["param"].rpartition(".")[0]
        width = self.g.nodes[found[0]]["shape"][found[1]]
        for shard in self.meeting:
            if not shard.intact or shard.span != (0, width):
                return False
            for origin in shard.origins:
                weight = linear_weight(self.g, origin)
                if weight is None or len(self.g.nodes[weight]["shape"]) != 3 \
                        or self.g.nodes[weight]["param"].rpartition(".")[0] != owner:
                    return False
        self.expert_biases[found[0]] = found[1]
        columns = self.expert_bias_columns.setdefault(found[0], set())
        for shard in self.meeting:
            columns |= shard.origins
        return True

    def broadcast_from(self, other: str) -> bool:
        """Whether replicated operand ``other``, expanded along the sharded heads and computed from
        parameters, comes from one span of a Linear kept whole (or a row, whole after its
        reduction) whose gradient can be all-reduced there (:func:`~autotp.synth.params.broadcast_source`). Recorded in ``broadcasts``."""
        found = broadcast_source(self.g, other)
        # A candidate root there would have sharded ``other``; one whose shard broke this round is
        # dropped before the round that converges. A row's output is whole after its reduction.
        if found is None:
            return False
        self.broadcasts.setdefault(found[0], set()).add(found[1])
        self.broadcast_starts[found[0], found[1]] = found[2]
        return True

    def broadcast_grad_ok(self, other: str) -> bool:
        """Whether replicated operand ``other``, repeated along the sharded dim, gets a gradient
        that is made whole. On each rank it is that rank's share only, which is sound when no
        Linear's output is behind it (parameters met directly are their module's, whose gradient
        :func:`~autotp.synth.params.param_roles` all-reduces), when it is computed from the shard
        itself (a width norm's statistic, whose style reduces it), or when it comes from one span of a
        Linear kept whole (:meth:`broadcast_from`). A gate from a whole Linear broadcast over the
        heads is otherwise refused: its gradient would stay a per-rank partial sum."""
        if self.norm_statistic(other) or block_statistic(self, other):
            return True
        found = upstream_linears(self.g, other)
        if found is None:  # a parameter enters on the way: reduce at a whole module's output, or none is behind it
            return self.broadcast_from_module(other) or _only_params_behind(self.g, other)
        if not found[0] or any(self.sharded(n) for n in found[1] | found[0]):
            return True  # no Linear behind it, or a statistic of the shard (a width norm's, reduced by its style)
        return self.broadcast_from(other)

    def norm_statistic(self, other: str) -> bool:
        """Whether replicated operand ``other`` is a statistic a width-sharded norm computes from the
        shard (``rsqrt(mean(x ** 2))`` over a sharded width): computed inside that norm from sharded
        values and the norm's own constants only. Its style runs the norm on DTensors, which
        all-reduce the statistic and its gradient, whatever is upstream of the shard."""
        module = self.g.nodes[other]["module"]
        if not module or module not in self.width_norms:
            return False
        seen, todo, reached = {other}, [other], False
        while todo:
            for pred in _value_inputs(self.g, todo.pop()):
                data = self.g.nodes[pred]
                if pred in seen or data["op"] in SINKS:
                    continue
                seen.add(pred)
                if self.sharded(pred):
                    reached = True
                elif data["kind"] == "call" and module in data["stack"] and not is_linear(self.g, pred):
                    todo.append(pred)
                elif data["kind"] == "call" or data["kind"] == "input":
                    return False  # a value from outside the norm, or a Linear inside it
        return reached

    def broadcast_from_module(self, other: str) -> bool:
        """Whether replicated operand ``other`` is computed from the outputs of whole modules (a
        norm over a row's output; a block of whole Linears) whose output gradients can be all-
        reduced there (:func:`~autotp.synth.params.module_output_sources`): nothing in them is
        sharded, and each hands out no other value with a gradient (its style reduces its first
        output's). Recorded in ``broadcasts``."""
        found = module_output_sources(self.g, other)
        if found is None:
            return False
        memo: dict = {}
        for node, _, _, module in found:
            inside = [n for n, d in self.g.nodes(data=True) if module in d["stack"]]
            # A shard that broke this round is dropped before the round that converges, where the
            # check is exact (as for :meth:`broadcast_from`): it must not drop the shard met here.
            if not inside or any(self._live_shard(n) for n in inside):
                return False
            if [n for n in module_outputs(self.g, module)[0] if carries_grad(self.g, n, memo)] != [node]:
                return False
            if any(self.broadcast_modules.get(s, module) != module and module in self.g.nodes[s]["stack"]
                   for s in self.broadcast_modules):  # a module inside reduces its own output already
                return False
        for node, span, start, module in found:
            self.broadcasts.setdefault(node, set()).add(span)
            self.broadcast_starts[node, span] = start
            self.broadcast_modules[node] = module
        return True

    def _live_shard(self, name: str) -> bool:
        value = self.state.get(name)
        shards = value if isinstance(value, tuple) else (value,)
        return any(isinstance(v, Shard) and not v.origins <= set(self.broken) for v in shards)

    def gives_way(self, other: str, name: str) -> bool:
        """Whether replicated operand ``other`` of ``name``, the reduced output of a row Linear,
        yields to the shard it meets: one side must stay whole, and the row's shard covers fewer
        weights (LoRA: ``lora_B(lora_A(x)) * scale`` added to a column base Linear's output).
        The row's columns are then dropped; the next round decides again without them, and in the
        round that converges no operand gave way, so what is kept is sound as before. The row may
        also be further up, through the module's own ops (a low-rank gate ``f_b(f_a(x))`` turned
        into a per-head decay)."""
        rows = _row_sources(self.g, self, other) or _rows_within(self.g, self, other, name)
        rivals = frozenset().union(*(self.rows[r] for r in rows))
        mine = frozenset().union(*(s.origins for s in self.meeting))
        if not rivals or rivals & mine or _weight_numel(self.g, rivals) >= _weight_numel(self.g, mine):
            return False
        self._give_way(rivals, rows, mine, name, "the larger shard of")
        return True

    def gives_way_to_heads(self, other: str, name: str) -> bool:
        """Whether replicated query / key / value ``other`` of attention ``name`` is computed only from
        the reduced outputs of row Linears (a low-rank column / row pair in front of the heads: a
        query down- and up-projection), whose shard then yields to the heads' shard it meets, as
        Megatron shards the up-projection by heads. Should the heads' shard be dropped later, the
        pair is tried again (``yielded``)."""
        found = upstream_linears(self.g, other)
        rows = found[0] if found else set()
        if not rows or not rows <= set(self.rows):
            return False
        rivals = frozenset().union(*(self.rows[r] for r in rows))
        mine = frozenset().union(*(s.origins for s in self.meeting))
        if not rivals or rivals & mine or _rows_beside(self, rivals, rows):
            return False
        self._give_way(rivals, sorted(rows), mine, name, "the head-sharded attention of")
        return True

    def scatters_onto_heads(self, other: str, name: str) -> bool:
        """Whether replicated operand ``other`` of product ``name`` over the heads (an attention, a
        batched matmul) is computed only from the reduced outputs of row Linears whose columns'
        shard other rows contract too (a low-rank query down-projection that also feeds a second
        up-projection), so that it may not give way (:meth:`gives_way_to_heads`): those rows are
        then reduce-scattered on their output features instead, each rank taking the block that
        its heads read, and the next round follows that shard like a column's. Recorded in
        ``scatter_requests`` (once per row); the round that converges requests none, so what is
        kept is sound as before."""
        found = upstream_linears(self.g, other)
        rows = found[0] if found else set()
        if not rows or not rows <= set(self.rows) or rows & self.head_scatters \
                or not all(_packable_row(self.g, r) for r in rows):
            return False
        rivals = frozenset().union(*(self.rows[r] for r in rows))
        mine = frozenset().union(*(s.origins for s in self.meeting))
        if not rivals or rivals & mine or not _rows_beside(self, rivals, rows):
            return False
        self.scatter_requests |= rows
        return True

    def _give_way(self, rivals, rows, mine, name: str, what: str) -> None:
        def modules(nodes):
            return ", ".join(sorted({self.g.nodes[n]["module"] or "the root" for n in nodes}))

        for root in rivals:
            self.broken.setdefault(root, (f"its shard, reduced by {modules(rows)}, meets {what} "
                                          f"{modules(mine)}; the smaller side stays whole", name))
            self.yielded.setdefault(root, mine)

    def revives(self, other: str, name: str) -> bool:
        """Whether replicated operand ``other`` of ``name`` (elementwise, or a product over the heads)
        is computed only from candidates dropped because their shard met, at ``name`` itself, an
        operand that was whole then and is now sharded: a per-head gate ``attn * sigmoid(gate_proj(x))``
        dropped in a round where the attention it gates was whole, or a row's output scattered onto
        the heads before the keys it meets were. Each side then waits for the other; the candidates
        are recorded in ``revived`` and tried again (once) in the next round, which decides anew,
        and the round that converges revives none, so what is kept is sound as before."""
        found = upstream_linears(self.g, other)
        if not found or not found[0] or any(self.revivable.get(n) != name for n in found[0]):
            return False
        self.revived |= found[0]
        return True

    def unit_heads_of(self, name: str) -> bool:
        """Whether the shard of ``name`` comes only from candidates read as one-kv-head k/v."""
        value = self.state.get(name)
        return isinstance(value, Shard) and bool(value.origins) and value.origins <= self.unit_heads

    def span(self, name: str) -> tuple[int, int] | None:
        value = self.state.get(name)
        return value.span if isinstance(value, Shard) else None

    def head_span(self, name: str) -> tuple[int, int, int] | None:
        value = self.state.get(name)
        return value.head_span if isinstance(value, Shard) else None

    def intact(self, name: str) -> bool:
        value = self.state.get(name)
        return isinstance(value, Shard) and value.intact

    def part(self, name: str, index: int):
        value = self.state.get(name)
        return value[index] if isinstance(value, tuple) else None

    def join(self, name: str, tensors: list, dim: int) -> Shard | None:
        """The state of ``cat(tensors, dim)`` along the sharded ``dim`` of every one of them: their
        pieces, side by side (each rank holds its share of each); None if one is not so sharded."""
        pieces = []
        for ref in tensors:
            value = self.state.get(ref.name) if isinstance(ref, Ref) else None
            if not isinstance(value, Shard) or value.dim != dim:
                return None
            pieces.extend(value.pieces or ((value, self.g.nodes[ref.name]["shape"][dim]),))
        origins = frozenset().union(*(shard.origins for shard, _ in pieces))
        return Shard(dim, origins, False, tensors[0].name, None, tuple(pieces))

    def cut_pieces(self, name: str, src: str, ranges) -> tuple[Shard, ...] | None:
        """The states of ``src``'s joined shard cut into ``ranges`` of its sharded dim, if every cut
        falls between its pieces (each range then holds whole pieces); else None."""
        value = self.state[src]
        ends = [0]
        for _, width in value.pieces:
            ends.append(ends[-1] + width)
        cut = []
        for start, end in ranges:
            if start not in ends or end not in ends or end <= start:
                return None
            inside = value.pieces[ends.index(start):ends.index(end)]
            if len(inside) == 1:
                piece = inside[0][0]
                cut.append(Shard(value.dim, piece.origins, piece.intact, src, piece.span, piece.pieces,
                                 head_span=piece.head_span))
            else:
                origins = frozenset().union(*(shard.origins for shard, _ in inside))
                cut.append(Shard(value.dim, origins, False, src, None, inside))
        self.piece_cuts.add(name)
        return tuple(cut)

    def pieces(self, name: str):
        value = self.state.get(name)
        return value.pieces if isinstance(value, Shard) else None

    def unfolded(self, name: str, shape: tuple, dim: int) -> tuple[tuple, int]:
        """``name``'s shape and sharded dim with a folded dim (``fold``) split back into its dims."""
        value = self.state.get(name)
        if not isinstance(value, Shard) or value.fold is None:
            return shape, dim
        sizes, k = value.fold
        return tuple(shape[:dim]) + sizes + tuple(shape[dim + 1:]), dim + k

    def folded(self, name: str, src: str, dim: int, sizes: tuple, k: int) -> Shard:
        """The state of view ``name`` of ``src`` that merges dims of ``sizes`` into ``dim``, the
        sharded one at position ``k`` among them (see :class:`Shard`)."""
        value = self.state[src]
        return Shard(dim, value.origins, False, src, None, None, (tuple(sizes), k))

    def group_view(self, src: str, dim: int, groups: int) -> Shard | None:
        """The state of a view that splits ``src``'s whole, uncut shard on ``dim`` into ``(groups,
        width / groups)`` where its readers keep every group (``qkv.reshape(b, t, G, -1)`` then a
        split of each group into its own ``[q | v | k]``), for candidates read per group.

        Read plainly, the shard lands on the groups (rank r holds whole groups), which code with a
        fixed group count ``G`` cannot take at per-rank widths. Read per group, the output is ``G``
        parts of the Linear (a packed projection's), each rank holding its share of every group:
        the shard is on the group's own dim, its span group 0's features, and every cut of it
        below is made in each group alike (:func:`_record`). Tried only for the candidates in
        ``per_group`` (those whose plain reading failed the per-rank shape proof); every candidate
        that meets such a view is recorded in ``groupable`` with ``groups``."""
        value = self.state.get(src)
        width = self.g.nodes[src]["shape"][dim]
        if not isinstance(value, Shard) or value.span != (0, width) or value.pieces or value.fold or width % groups \
                or any(self.g.nodes[o]["shape"][-1] != width for o in value.origins):
            return None  # only a whole output, not one of its parts viewed into heads
        self.groupable.update(dict.fromkeys(value.origins, groups))
        if not value.origins <= self.per_group:
            return None
        inner = width // groups
        for origin in value.origins:
            self.group_views[origin] = (groups, inner)
            self.splits.setdefault(origin, []).extend(
                (value.span[0] + i * inner, value.span[0] + (i + 1) * inner) for i in range(groups))
            self.split_nodes.setdefault(origin, []).append(self.deciding)
        return Shard(dim + 1, value.origins, False, src, (value.span[0], value.span[0] + inner))

    def refolded(self, src: str, dim: int) -> Shard:
        """The state of a view that keeps ``src``'s folded dim whole at ``dim`` (``(b, t, heads,
        d / 2, 2) -> (b, t, heads, d)`` of folded heads): the same fold."""
        value = self.state[src]
        return Shard(dim, value.origins, False, src, None, None, value.fold)

    def viewed_into_parts(self, src: str) -> None:
        """``src``'s candidates are cut into parts by a view (:func:`~autotp.synth.ops._parts_view`)."""
        value = self.state.get(src)
        if isinstance(value, Shard):
            self.part_views |= value.origins

    def unfold(self, name: str) -> None:
        """Record that view ``name`` splits a folded dim back (its output is an ordinary shard)."""
        self.piece_cuts.add(name)

    def weight_of(self, origins) -> int:
        """How many weight elements the candidates ``origins`` hold (which side of a conflict goes on)."""
        return _weight_numel(self.g, origins)

    def shards_along(self, other: str, name: str) -> bool:
        """Whether replicated operand ``other`` of ``name`` is a width-sharded norm's own weight."""
        source = param_source(self.g, other)
        if source is None:
            return False
        owner = self.g.nodes[source]["param"].rpartition(".")[0]
        return owner in self.width_norms and owner in self.g.nodes[name]["stack"]


def _rows_beside(flow: Flow, columns: frozenset, rows) -> bool:
    """Whether the outputs of ``columns`` reach a Linear besides ``rows`` before any Linear (a second
    up-projection of a low-rank latent), wherever it comes in program order."""
    g, seen, todo = flow.g, set(columns), list(columns)
    while todo:
        for succ in g.successors(todo.pop()):
            if succ in seen or g.nodes[succ]["kind"] != "call":
                continue
            seen.add(succ)
            if is_linear(g, succ):
                if succ not in rows:
                    return True
            else:
                todo.append(succ)
    return False


def _row_sources(g: nx.DiGraph, flow: Flow, name: str) -> list[str]:
    """The row Linear that ``name`` is a one-tensor chain of casts, views and scalings of, if any."""
    while name not in flow.rows:
        data = g.nodes[name]
        inputs = refs(data["args"], data["kwargs"])
        if data["kind"] != "call" or data["op"] not in SCALINGS or len(inputs) != 1:
            return []
        name = inputs[0].name
    return [name]


def _rows_within(g: nx.DiGraph, flow: Flow, other: str, name: str) -> list[str]:
    """The row Linears that replicated ``other`` is computed from, walking back through the ops
    of the module that runs the Linears of the shard met at ``name`` (its parameters and buffers
    may enter), and of the modules it calls (one handed to it as an argument: a distance MLP shared
    by every layer); empty if the walk meets a sharded value, a Linear that is not a row, or leaves it."""
    scopes = {g.nodes[o]["module"].rpartition(".")[0] for s in flow.meeting for o in s.origins}
    module = scopes.pop() if len(scopes) == 1 else ""
    if not module or not (g.nodes[name]["module"] + ".").startswith(module + "."):
        return []
    seen, todo, rows = {other}, [other], set()
    while todo:
        node = todo.pop()
        data = g.nodes[node]
        inside = data["module"] == module or data["module"].startswith(module + ".") or module in (data["stack"] or ())
        if flow.sharded(node) or not inside:
            return []
        if is_linear(g, node):
            if node not in flow.rows:
                return []
            rows.add(node)
            continue
        for pred in g.predecessors(node):
            if pred not in seen and g.nodes[pred]["kind"] == "call" and g.nodes[pred]["op"] not in SINKS:
                seen.add(pred)
                todo.append(pred)
    return sorted(rows)


def _weight_numel(g: nx.DiGraph, linears) -> int:
    return sum(math.prod(g.nodes[w]["shape"]) for w in map(lambda n: linear_weight(g, n), linears) if w)


def _projects_down(g: nx.DiGraph, name: str) -> bool:
    """Whether Linear ``name`` has fewer output features than input features and is no vocabulary
    head (its outputs are not as many as a token table's rows): a classifier's labels, a value
    head. As a head at the model output, its few outputs are not worth sharding and gathering."""
    weight = weight_of(g, name)
    if weight is None:
        return False
    shape = g.nodes[weight.node]["shape"]
    vocab = {g.nodes[d["args"][0].name]["shape"][0] for _, d in g.nodes(data=True)
             if d["kind"] == "call" and d["op"] == "embedding" and isinstance(d["args"][0], Ref)
             and g.nodes[d["args"][0].name]["shape"]}
    return shape[weight.out_dim] < shape[weight.in_dim] and shape[weight.out_dim] not in vocab


def weight_uses(g: nx.DiGraph):
    """``(node, parameter placeholder)`` for every Linear-like node and token-embedding lookup
    that reads a parameter as its weight."""
    for name, data in g.nodes(data=True):
        if is_linear(g, name):
            weight = linear_weight(g, name)
        elif data["op"] == "embedding" and isinstance(data["args"][0], Ref):
            weight = param_source(g, data["args"][0].name)
        else:
            continue
        if weight:
            yield name, weight


def _packable_row(g: nx.DiGraph, name: str) -> bool:
    """Whether row ``name`` is an ``nn.Linear``-like product whose weight's input features a packed
    row style can permute: ``linear`` by an (out, in) weight of its own module."""
    data = g.nodes[name]
    weight = weight_of(g, name)
    return data["op"] == "linear" and weight is not None and (weight.out_dim, weight.in_dim) == (0, 1) \
        and not raw_like(g, name) and not data.get("raw_weight")
