"""Sharding analysis: which Linears can be column-parallel, and where each shard is contracted.

Every Linear fed a replicated input is a candidate column: its output's last dim is sharded. That
dim is followed op by op (:mod:`autotp.synth.ops`) until a Linear contracts over it (a row) or the
graph output takes it (the head). A candidate whose shard meets an op that needs the whole dim is
dropped with the op as its reason, and the propagation is run again without it, until nothing
changes: what is left is sound by construction.

Long because propagation, its fixpoint and the checks that drop a candidate (packs that do
not tile, mixed parts, endless shards, a side giving way) share the Flow state they read.
"""

from __future__ import annotations

import dataclasses
import itertools
import logging
import math
from dataclasses import dataclass, field

import networkx as nx

from autotp.synth.graph import Ref, param_modules, refs
from autotp.synth.experts import bias_breaks, expert_bias, partial_sum_breaks
from autotp.synth.entries import entry_source, stray_entry_reads
from autotp.synth.head_loops import head_loop_breaks, head_step, reads_head, select_head
from autotp.synth.statistics import block_statistic, statistic_breaks, statistic_in_block
from autotp.synth.params import (broadcast_source, carries_grad, factory_dim, module_output_sources, param_dim,
                                 stray_param_reads, stray_tree_reads, tree_leaves)
from autotp.synth.ops import SCALINGS, WRITE_VIEWS, WRITES
from autotp.synth.ops import (ATTENTION, ELEMENTWISE, MATMULS, SINKS, VIEW_LIKE, Break, Given, Out, Parts,
                              Split, apply_rule)
# The graph queries and the shard value live below the analysis (and the idioms it calls); the names
# stay importable from here.
from autotp.synth.queries import (_only_params_behind, _value_inputs, is_linear, linear_weight, module_of,
                                  module_outputs, param_source, part_sizes, raw_like, raw_weight, upstream_linears,
                                  weight_of)
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


def _sharded_inputs(flow: Flow, data) -> dict[str, int]:
    found = {}
    for ref in refs(data["args"], data["kwargs"]):
        value = flow.state.get(ref.name)
        if isinstance(value, Shard):
            found[ref.name] = value.dim
    return found


def _kept_span(flow: Flow, name: str, dims: dict, dim: int):
    """The span a rule's output keeps: its inputs' common span, if the sharded dim keeps its size
    (every rule that returns the shard on a dim of the same size keeps the features in order)."""
    spans = {flow.span(src) for src in dims}
    if len(spans) != 1 or None in spans:
        return None
    span = spans.pop()
    return span if flow.g.nodes[name]["shape"][dim] == span[1] - span[0] else None


def _kept_pieces(flow: Flow, name: str, dims: dict, dim: int):
    """The pieces a rule's output keeps: its sharded inputs' common pieces, if the sharded dim
    keeps its total width (the features stay in place, as for :func:`_kept_span`)."""
    pieces = {flow.pieces(src) for src in dims}
    if len(pieces) != 1 or None in pieces:
        return None
    pieces = pieces.pop()
    return pieces if flow.g.nodes[name]["shape"][dim] == sum(width for _, width in pieces) else None


def _kept_fold(flow: Flow, name: str, dims: dict, dim: int):
    """The fold a rule's output keeps: its sharded inputs' common fold, if the sharded dim keeps
    its size and the op is not a view (a view decides its fold itself)."""
    folds = {flow.state[src].fold for src in dims if isinstance(flow.state.get(src), Shard)}
    if len(folds) != 1 or None in folds or flow.g.nodes[name]["op"] in VIEW_LIKE:
        return None
    fold = folds.pop()
    return fold if flow.g.nodes[name]["shape"][dim] == math.prod(fold[0]) else None


def _record(flow: Flow, name: str, result, origins: frozenset, prev: str, dims: dict | None = None):
    """Store a rule's result as the node's state."""
    if isinstance(result, Given):
        flow.state[name] = result.value
        if isinstance(result.value, Shard) and result.value.fold:  # the heads folded in must divide
            sizes, k = result.value.fold
            for o in origins:
                flow.extent[o] = math.gcd(flow.extent.get(o, 0), sizes[k])
    elif isinstance(result, Out):
        span = _kept_span(flow, name, dims or {}, result.dim)
        pieces = _kept_pieces(flow, name, dims or {}, result.dim)
        fold = _kept_fold(flow, name, dims or {}, result.dim)
        heads = _kept_head_span(flow, name, dims or {}, result.dim)
        flow.state[name] = Shard(result.dim, origins, result.intact, prev, span, pieces, fold, heads)
        size = flow.g.nodes[name]["shape"][result.dim]
        for o in origins:
            if not _holds_copies(flow, o, span):  # parts held whole are not divided: their width says nothing
                flow.extent[o] = math.gcd(flow.extent.get(o, 0), size)
    elif isinstance(result, Parts):
        flow.state[name] = tuple(Shard(p.dim, origins, p.intact, prev) if p else None for p in result.parts)
    elif isinstance(result, Split) and result.heads:
        _record_head_cut(flow, name, result, origins, prev)
    elif isinstance(result, Split):
        start = flow.span(prev)[0] if flow.span(prev) else 0
        ranges = tuple((start + a, start + b) for a, b in result.ranges)
        for o in origins:
            # A candidate read per group (Flow.group_view): the span is group 0's, each group cut alike.
            groups, inner = flow.group_views.get(o, (1, 0))
            flow.splits.setdefault(o, []).extend((a + i * inner, b + i * inner) for i in range(groups)
                                                 for a, b in ranges)
            flow.split_nodes.setdefault(o, []).append(name)
        shards = [None if _held_whole(flow, origins, r) else Shard(result.dim, origins, False, prev, r) for r in ranges]
        for index, (shard, r) in enumerate(zip(shards, ranges)):
            if shard is None:  # a part held whole on every rank: replicated from here on
                flow.copy_cuts.setdefault(name, {})[index if result.tuple_output else None] = (next(iter(origins)), r)
        if result.tuple_output:
            flow.state[name] = tuple(shards)
        elif shards[0] is not None:
            flow.state[name] = shards[0]


def _kept_head_span(flow: Flow, name: str, dims: dict, dim: int) -> tuple[int, int, int] | None:
    """The heads' span (:attr:`Shard.head_span`) a rule's output keeps: its sharded inputs hold the
    same features (a span, or a heads' span), on dims of one size ``n``; the output's dim has that
    size (the heads kept in place), or is a view's split of it into ``m`` outer indices (each then
    ``n / m`` of the input's units: a view of features into heads)."""
    g, found, sizes = flow.g, set(), set()
    for src, at in dims.items():
        value, size = flow.state.get(src), g.nodes[src]["shape"][at]
        if not isinstance(value, Shard) or value.pieces or value.fold:
            return None
        if value.span is not None and value.span[1] - value.span[0] == size:
            found.add((value.span, 1))
        elif value.head_span is not None:
            found.add((value.head_span[:2], value.head_span[2]))
        else:
            return None
        sizes.add(size)
    if len(found) != 1 or len(sizes) != 1:
        return None
    ((start, end), unit), n, m = found.pop(), sizes.pop(), g.nodes[name]["shape"][dim]
    if m == n:
        return (start, end, unit) if unit > 1 else None  # unit 1: the span itself (_kept_span)
    if g.nodes[name]["op"] in VIEW_LIKE and m < n and n % m == 0:
        return start, end, unit * (n // m)
    return None


def _record_head_cut(flow: Flow, name: str, result: Split, origins: frozenset, prev: str) -> None:
    """Store a cut of heads (:attr:`Shard.head_span`) into equal parts: each part is a range of the
    origins' output features, which are cut there as by a split of the features (``splits``); each
    part's heads must split over tp (``extent``, checked for ``head_cuts``)."""
    start, _, unit = flow.head_span(prev)
    ranges = tuple((start + a * unit, start + b * unit) for a, b in result.ranges)
    for o in origins:
        groups, inner = flow.group_views.get(o, (1, 0))
        flow.splits.setdefault(o, []).extend((a + i * inner, b + i * inner) for i in range(groups)
                                             for a, b in ranges)
        flow.split_nodes.setdefault(o, []).append(name)
        flow.head_cuts.add(o)
        for a, b in result.ranges:
            flow.extent[o] = math.gcd(flow.extent.get(o, 0), b - a)
    shards = []
    for index, (a, b) in enumerate(ranges):
        if _held_whole(flow, origins, (a, b)):
            flow.copy_cuts.setdefault(name, {})[index] = (next(iter(origins)), (a, b))
            shards.append(None)
        else:
            shards.append(Shard(result.dim, origins, False, prev, head_span=(a, b, unit)))
    flow.state[name] = tuple(shards)


def _held_whole(flow: Flow, origins: frozenset, span: tuple[int, int]) -> bool:
    """Whether the part ``span`` of one candidate's output lies within the spans it holds whole."""
    if len(origins) != 1:
        return False
    spans = flow.copied.get(next(iter(origins)), ())
    return sum(min(e, span[1]) - max(s, span[0]) for s, e in spans if s < span[1] and span[0] < e) == span[1] - span[0]


def _holds_copies(flow: Flow, origin: str, span: tuple[int, int] | None) -> bool:
    """Whether a shard of ``origin`` over ``span`` (None: unknown) holds parts kept whole per rank."""
    spans = flow.copied.get(origin, ())
    return bool(spans) and (span is None or any(s < span[1] and span[0] < e for s, e in spans))


def _linear_step(flow: Flow, name: str, data, dims: dict, active: set):
    """A Linear: contracts a shard of its last input dim (row), or starts one (column candidate)."""
    g = flow.g
    x = data["args"][0].name
    if x in dims and linear_weight(g, name):
        if dims[x] == len(g.nodes[x]["shape"]) - 1:
            if name in flow.whole:  # a row would shard its weight: the shard must stop before it
                for o in flow.state[x].origins:
                    flow.broken.setdefault(o, (f"it reaches {data['module']}, whose weight stays whole: "
                                               f"{flow.whole[name]}", name))
                return
            flow.rows[name] = flow.state[x].origins
            packs = _folded_parts(flow.state[x].fold)
            if packs and _packable_row(g, name):
                flow.row_packs[name] = packs
            if name in active and (per_head_row(flow, name, x) or name in flow.head_scatters):  # onto the heads
                width = data["shape"][-1]
                flow.state[name] = Shard(len(data["shape"]) - 1, frozenset({name}), True, None, (0, width))
                flow.scatters.add(name)
                flow.extent[name] = width
            return
        _record(flow, name, Out(dims[x]), flow.state[x].origins, x)  # per-position: shard passes
    elif x not in dims and name in active:
        flow.state[name] = Shard(len(data["shape"]) - 1, frozenset({name}), True, None, (0, data["shape"][-1]))
        flow.roots.add(name)
        flow.extent[name] = 0 if name in flow.copied else data["shape"][-1]  # its divided parts set it


def per_head_row(flow: Flow, name: str, x: str) -> bool:
    """Whether row ``name`` (its input ``x`` sharded on its features) makes one value per head of
    that shard, so that its reduced output may stay sharded on its last dim, reduce-scattered: each
    rank then gets the values of its own heads (a per-head gate or mask computed from the values).

    Its output features must be fewer than its input features and equal to a size the sharded dim
    had on its way to ``x`` (the head count where a view split the heads off); its input one
    contiguous block of heads (no pieces, no fold); it an ``nn.Linear``-like product by an (out, in)
    weight. Only a candidate: the shard it starts must meet those heads again (:func:`unmet_scatters`)
    and survive propagation like any other; tp must divide it.
    """
    g, shard = flow.g, flow.state[x]
    width = g.nodes[name]["shape"][-1]
    if shard.pieces or shard.fold or not 1 < width < g.nodes[x]["shape"][-1] or not _packable_row(g, name):
        return False
    sizes, node, value = set(), x, shard
    while isinstance(value, Shard):
        sizes.add(g.nodes[node]["shape"][value.dim])
        if value.prev is None:
            break
        node, value = value.prev, flow.state.get(value.prev)
    return width in sizes


def unmet_scatters(flow: Flow) -> dict[str, str]:
    """Rows left sharded on the heads (:func:`per_head_row`) whose output shard never met a shard of
    the heads they read: nothing is gained by leaving it sharded, so it is reduced whole."""
    return {row: "its per-head output, left sharded, never meets the heads it reads again"
            for row in flow.scatters - flow.scatters_met - set(flow.broken)}


def _meets_heads(flow: Flow, dims: dict) -> None:
    """Record the rows left sharded on the heads whose shard meets, at one op, a shard of the
    heads they read (:attr:`Flow.scatters_met`)."""
    held = [flow.state[s].origins for s in dims]
    for row in flow.scatters & frozenset().union(*held):  # a row scattered onto the heads it feeds: any heads
        if any(row not in origins and (origins & flow.rows[row] or row in flow.head_scatters) for origins in held):
            flow.scatters_met.add(row)


def _folded_parts(fold) -> tuple[int, ...] | None:
    """The parts of a row's input features that hold a folded shard: dims of ``sizes`` merged, the
    sharded one at position ``k`` (each rank its slice of it for every index of the dims before):
    ``prod(sizes[:k])`` parts of ``prod(sizes[k:])`` features, each rank a share of every part.

    >>> _folded_parts(((4, 2, 8), 1))
    (16, 16, 16, 16)
    """
    if fold is None:
        return None
    sizes, k = fold
    return (math.prod(sizes[k:]),) * math.prod(sizes[:k])


def _packable_row(g: nx.DiGraph, name: str) -> bool:
    """Whether row ``name`` is an ``nn.Linear``-like product whose weight's input features a packed
    row style can permute: ``linear`` by an (out, in) weight of its own module."""
    data = g.nodes[name]
    weight = weight_of(g, name)
    return data["op"] == "linear" and weight is not None and (weight.out_dim, weight.in_dim) == (0, 1) \
        and not raw_like(g, name) and not data.get("raw_weight")


def _getitem_step(flow: Flow, name: str, data) -> None:
    """``getitem`` of a tuple output takes that element's state (tuple outputs hold one per element)."""
    source, index = data["args"][0], data["args"][1]
    value = flow.state.get(source.name) if isinstance(source, Ref) else None
    if isinstance(value, tuple) and isinstance(index, int) and value[index] is not None:
        part = value[index]
        flow.state[name] = Shard(part.dim, part.origins, part.intact, source.name, part.span, part.pieces,
                                 part.fold, part.head_span)


def _reduction_in_norm(flow: Flow, data, origins, owners: set[str], callers: set[str]) -> bool:
    """A reduction over the shard inside a parametrised, non-Linear module: a width-sharded norm.
    A module that calls Linears (``callers``: an attention with a per-head parameter reducing over
    its heads) is no norm: the width-norm style could not be given to it."""
    module = data["module"]
    roots = {flow.g.nodes[o]["module"] for o in origins}
    if module in owners and module not in roots and module and module not in callers:
        flow.width_norms.setdefault(module, data)
        return True
    return False


def _written(flow: Flow, name: str, data) -> None:
    """An in-place write: the tensor it changes (through the views of its first argument) now
    also holds the written shard, so its later readers carry that shard's candidates too (a
    recurrence that fills ``out`` chunk by chunk: the query's candidate reaches the output
    projection through ``out``)."""
    written = flow.state.get(name)
    base = data["args"][0] if data["args"] else None
    while isinstance(base, Ref) and flow.g.nodes[base.name]["op"] in WRITE_VIEWS and flow.g.nodes[base.name]["args"]:
        base = flow.g.nodes[base.name]["args"][0]
    if not isinstance(written, Shard) or not isinstance(base, Ref):
        return
    target = flow.state.get(base.name)
    if isinstance(target, Shard) and not written.origins <= target.origins:
        flow.state[base.name] = dataclasses.replace(target, origins=target.origins | written.origins)
        flow.writes[name] = base.name


def propagate(g: nx.DiGraph, active: set[str], unit_heads: frozenset = frozenset(),
              whole: dict[str, str] | None = None, *, module_alone: bool = False,
              copied: dict[str, frozenset] | None = None, per_group: frozenset = frozenset(),
              revivable: dict[str, str] | None = None, head_scatters: frozenset = frozenset()) -> Flow:
    """Follow the shard of every active candidate Linear through ``g`` (one pass, program order).

    Args:
        g: the analysis graph.
        active: ``linear`` node names allowed to start a shard.
        unit_heads: candidates whose views may split off a single head (see :func:`analyse`).
        whole: Linear nodes whose weight must stay whole (read outside their module, tied
            differently): neither a column nor a row; a shard reaching one breaks, with the reason.
        module_alone: ``g`` is one module exported alone (the shape proof): its inputs may be
            values its caller slices to its heads (:meth:`Flow.shard_entry`).
        copied: candidate -> spans of its output cut off as parts held whole on every rank (the
            one kv head of a fused multi-query qkv): replicated from the cut on (:func:`copy_leaks`).
        per_group: candidates whose views into fixed groups are read per group (:meth:`Flow.group_view`).
        revivable: dropped candidates -> the op (elementwise, or a product over the heads) where their
            shard met a whole operand (:meth:`Flow.revives`).
        head_scatters: rows whose reduced output is reduce-scattered onto the heads it feeds
            (:meth:`Flow.scatters_onto_heads`).
    Returns:
        The :class:`Flow`: node states, rows, heads, splits and the candidates that broke.
    """
    flow = Flow(g, unit_heads=frozenset(unit_heads), whole=dict(whole or {}), module_alone=module_alone,
                copied=dict(copied or {}), per_group=frozenset(per_group), revivable=dict(revivable or {}),
                head_scatters=frozenset(head_scatters))
    owners = param_modules(g)
    callers = {m for n in g.nodes if g.nodes[n]["kind"] == "call" and is_linear(g, n) for m in g.nodes[n]["stack"]
               if m != g.nodes[n]["module"]}
    for name in sorted(g.nodes, key=lambda n: g.nodes[n]["order"]):
        data = g.nodes[name]
        if data["kind"] == "output":
            for value in (flow.per_head[r.name] for r in refs(data["args"]) if r.name in flow.per_head):
                for o in value.origins:
                    flow.broken.setdefault(o, ("one head's values, selected from the sharded dim, are a graph "
                                               "output", name))
            for src, dim in _sharded_inputs(flow, data).items():
                for o in flow.state[src].origins:
                    if _projects_down(g, o):
                        flow.broken.setdefault(o, ("it projects down to the model output (fewer features than it "
                                                   "reads: a classifier's labels, a pooler); kept whole, as "
                                                   "Megatron keeps such a head", name))
                        continue
                    flow.heads[o] = src
            continue
        if data["kind"] != "call":
            continue
        if flow.per_head and reads_head(flow, data):
            head_step(flow, name, data, _sharded_inputs(flow, data))
            continue
        if data["op"] == "getitem":
            _getitem_step(flow, name, data)
            continue
        dims = _sharded_inputs(flow, data)
        if is_linear(g, name):
            _linear_step(flow, name, data, dims, active)
            continue
        if not dims:
            continue
        origins = frozenset().union(*(flow.state[s].origins for s in dims))
        if flow.scatters and len(dims) > 1:
            _meets_heads(flow, dims)
        flow.meeting, flow.deciding = tuple(flow.state[s] for s in dims), name
        result = apply_rule(g, name, dims, flow)
        if isinstance(result, Break):
            if result.reduction and (_reduction_in_norm(flow, data, origins, owners, callers)
                                     or statistic_in_block(flow, name, data, origins)):
                continue
            for o in result.only or origins:
                flow.broken.setdefault(o, (result.reason, name))
            if result.only and result.then:
                kept = {s: d for s, d in dims.items() if not flow.state[s].origins & result.only}
                _record(flow, name, result.then, origins - result.only, next(iter(kept)), kept)
            continue
        _record(flow, name, result, origins, next(iter(dims)), dims)
        if data["op"] in WRITES:
            _written(flow, name, data)
    for root, why in statistic_breaks(flow).items():
        flow.broken.setdefault(root, why)
    return flow


def propagate_packed(g: nx.DiGraph, active: set[str], packed: set[str], **options) -> Flow:
    """:func:`propagate` as a plan shards ``active``: the packed columns among them (``packed``)
    whose output the plain reading never cuts into parts, but views into fixed groups, are read
    per group (:meth:`Flow.group_view`), the one reading in which a packed style fits them."""
    flow = propagate(g, active, **options)
    uncut = frozenset(r for r in set(packed) & set(flow.groupable) if r not in flow.splits)
    return propagate(g, active, per_group=uncut, **options) if uncut else flow


def bad_packs(flow: Flow) -> dict[str, str]:
    """Candidates whose output is cut into pieces that do not tile it exactly once: the outermost
    pieces must tile it, and a piece cut again must be tiled by its own pieces (nested, never
    overlapping: each rank then holds its share of every finest part)."""
    bad = {}
    for root, ranges in flow.splits.items():
        width = flow.g.nodes[root]["shape"][-1]
        if not _tiles(sorted(set(ranges)), 0, width):
            bad[root] = f"its output is sliced into {sorted(set(ranges))}, which do not tile {width} features"
    return bad


def _tiles(ranges: list, start: int, end: int) -> bool:
    """Whether the outermost of ``ranges`` inside ``[start, end)`` tile it, each of them tiled in
    turn by the ranges inside it, and no range crosses another (a laminar family).

    >>> _tiles([(0, 4), (4, 12), (4, 8), (8, 12)], 0, 12), _tiles([(0, 8), (4, 12)], 0, 12)
    (True, False)
    """
    ranges = sorted({r for r in ranges if r != (start, end)})
    if not ranges:
        return True  # the whole, taken as one piece
    at, pieces = start, []
    while at < end:
        widest = max((r for r in ranges if r[0] == at), key=lambda r: r[1], default=None)
        if widest is None or widest[1] > end:
            return False
        pieces.append(widest)
        at = widest[1]
    for a, b in pieces:
        inner = [r for r in ranges if a <= r[0] and r[1] <= b and r != (a, b)]
        if inner and not _tiles(inner, a, b):
            return False
    return all(any(a <= r[0] and r[1] <= b for a, b in pieces) for r in ranges)


def inner_parts(flow: Flow, origins, span) -> tuple[int, ...] | None:
    """The finest parts of ``origins``' outputs inside ``span`` (one part: a contiguous shard), or
    None if the origins are cut differently there."""
    if span is None:
        return None
    found = set()
    for root in origins:
        points = sorted({span[0], span[1], *(p for r in flow.splits.get(root, ()) for p in r if span[0] < p < span[1])})
        found.add(tuple(b - a for a, b in zip(points, points[1:])))
    return found.pop() if len(found) == 1 else None


def packing(flow: Flow, origins, span, pieces) -> tuple[int, ...] | None:
    """The widths of the parts each rank holds a share of, in order, for a shard of ``origins``
    over ``span`` (:func:`inner_parts`), or joined from ``pieces`` (each piece's own parts, or its
    width when it is one contiguous shard); None if they cannot be told."""
    if not pieces:
        return inner_parts(flow, origins, span)
    parts = []
    for shard, width in pieces:
        if shard.head_span is not None and not shard.pieces:  # its parts in heads, the piece's units
            start, end, unit = shard.head_span
            inner = inner_parts(flow, shard.origins, (start, end))
            if inner is None or any(p % unit for p in inner):
                return None
            parts.extend(p // unit for p in inner)
        elif shard.pieces or shard.span is not None:
            inner = packing(flow, shard.origins, shard.span, shard.pieces)
            if inner is None:
                return None
            parts.extend(inner)
        else:
            parts.append(width)  # a shard that kept no span: one contiguous block per rank
    return tuple(parts)


def packed_params(flow: Flow) -> dict[str, tuple[int, ...]]:
    """Co-sharded parameters that met a shard holding several parts of a packed output (a
    depthwise conv over ``[x | B | C]``, or over a ``cat`` of q, k and v): parameter placeholder ->
    those parts' widths. Each rank holds its share of every part, so the parameter is permuted
    like the packed Linear's rows."""
    found = {}
    for param, meetings in flow.param_spans.items():
        parts = {packing(flow, origins, span, pieces) for origins, span, pieces in meetings
                 if span is not None or pieces}
        parts = {p for p in parts if p is not None and len(p) > 1}
        if parts:
            found[param] = parts.pop()
    return found


def mixed_parts(flow: Flow) -> dict[str, str]:
    """Candidates with a shard holding several parts of their packed output (each rank has its
    share of every part, not one contiguous block) that reaches an op that does not keep it whole
    or cut it at the parts (a view merging heads back, a row Linear, a parameter met with two
    packings, or per head); viewed into heads, the parts must be whole heads, and heads of several
    outputs met at one op must be cut alike."""
    g, bad = flow.g, {}
    for name, state in flow.state.items():
        for index, shard in enumerate(state if isinstance(state, tuple) else (state,)):
            if not isinstance(shard, Shard) or shard.features is None:
                continue
            parts = inner_parts(flow, shard.origins, shard.features)
            if parts is None and shard.head_span:  # heads of origins cut differently: not one layout
                for root in shard.origins:
                    bad.setdefault(root, f"its heads meet heads of {len(shard.origins) - 1} other output(s) cut "
                                         f"differently into parts, in {g.nodes[name]['module'] or 'the root'}")
                continue
            if parts is None or len(parts) < 2:
                continue
            if shard.head_span and any(p % shard.head_span[2] for p in parts):
                for root in shard.origins:  # a head would hold features of two parts
                    bad.setdefault(root, f"its packed parts {parts} are viewed into heads of {shard.head_span[2]} "
                                         f"features in {g.nodes[name]['module'] or 'the root'}, which they do not tile")
                continue
            for succ in g.successors(name):
                data = g.nodes[succ]
                if data["op"] in SINKS or (isinstance(state, tuple) and data["args"][1:2] != (index,)):
                    continue  # a metadata assert, or the getitem of another element
                out = flow.state.get(succ)
                outs = out if isinstance(out, tuple) else (out,)
                held = shard.features
                if not any(isinstance(o, Shard) and o.features and held[0] <= o.features[0] and o.features[1] <= held[1]
                           for o in outs):
                    for root in shard.origins:
                        bad.setdefault(root, f"its packed parts {parts} meet {g.nodes[succ]['op']} in "
                                             f"{g.nodes[succ]['module'] or 'the root'}, which does not keep them apart")
    bad.update({r: reason for r, reason in _mixed_pieces(flow).items() if r not in bad})
    for param, meetings in flow.param_heads.items():  # a per-head parameter sharded contiguously
        for origins, (start, end, _) in meetings:
            parts = inner_parts(flow, origins, (start, end))
            if parts is None or len(parts) > 1:
                for root in origins:
                    bad.setdefault(root, f"parameter {g.nodes[param]['param']} meets heads holding several parts of "
                                         "its output, which a contiguous shard of it would not line up with")
    for param, meetings in flow.param_spans.items():
        packings = {packing(flow, o, s, p) for o, s, p in meetings}
        unknown = any(p is not None and packing(flow, o, s, p) is None for o, s, p in meetings)
        if unknown or len({p if p and len(p) > 1 else None for p in packings}) > 1:  # one part: contiguous
            for origins, _, _ in meetings:
                for root in origins:
                    bad.setdefault(root, f"parameter {g.nodes[param]['param']} meets shards of different packings")
    return bad


def _mixed_pieces(flow: Flow) -> dict[str, str]:
    """Candidates whose shard was joined with others by a ``cat`` along the sharded dim, or folded
    into a merged dim, and then reaches an op that neither keeps that layout nor undoes it (a view
    into heads, a row Linear, a tensor sharded contiguously): each rank's block is not what it reads."""
    g, bad = flow.g, {}
    for name, state in flow.state.items():
        for index, shard in enumerate(state if isinstance(state, tuple) else (state,)):
            if not isinstance(shard, Shard) or not (shard.pieces or shard.fold):
                continue
            for succ in g.successors(name):
                data = g.nodes[succ]
                if data["op"] in SINKS or (isinstance(state, tuple) and data["args"][1:2] != (index,)):
                    continue
                out = flow.state.get(succ)
                if succ in flow.piece_cuts or (isinstance(out, Shard) and (out.pieces, out.fold) == (shard.pieces, shard.fold)):
                    continue
                if succ in flow.row_packs and not shard.pieces:  # a row taking the folded parts (packed)
                    continue
                what = "joined with others along the sharded dim" if shard.pieces else "folded into a merged dim"
                for root in shard.origins:
                    bad.setdefault(root, f"its shard, {what}, meets {data['op']} in {data['module'] or 'the root'}, "
                                         "which does not keep that layout")
    return bad


def _raw_limits(flow: Flow) -> dict[str, str]:
    """Raw-parameter Linears (:func:`raw_weight`) sharded in a way their style does not realise:
    cut into parts, giving the model output, or a product by another module's parameter."""
    g, bad = flow.g, {}
    for root in flow.roots:
        if raw_weight(g, root) and (root in flow.splits or root in flow.heads):
            bad[root] = "a raw parameter used as a Linear weight is sharded whole, not cut into parts or as the output"
        elif raw_like(g, root) and not raw_weight(g, root):
            bad[root] = "its raw weight parameter is also read elsewhere, which would read a shard as the whole"
        elif g.nodes[root].get("raw_weight") and not raw_weight(g, root):
            bad[root] = "it multiplies by a parameter of another module, which that module's style would not shard"
    for row in flow.rows:
        if (g.nodes[row].get("raw_weight") or raw_like(g, row)) and not raw_weight(g, row):
            for root in flow.rows[row]:
                bad.setdefault(root, "it is contracted by a parameter of another module, which stays whole")
    return bad


def broadcast_leaks(flow: Flow) -> dict[str, str]:
    """Candidates whose shard met a broadcast span (:meth:`Flow.broadcast_from`) whose gradient
    would not be only per-rank shares: the values computed from the span, followed until they
    meet a shard, must reach no Linear, no output and no parameter. Each rank's gradient of the
    span is then the sum of its shares at the meetings, and their all-reduce is the whole one; a
    reader outside (``b.mean()`` added to the result) would be counted tp times."""
    g, bad = flow.g, {}
    for (linear, span), start in sorted(flow.broadcast_starts.items()):
        seen, todo, meets, leaks = {start}, [start], set(), []
        while todo:
            for succ in g.successors(todo.pop()):
                data = g.nodes[succ]
                if succ in seen or data["op"] in SINKS:
                    continue
                seen.add(succ)
                if data["kind"] != "call" or is_linear(g, succ):
                    leaks.append(succ)
                elif flow.sharded(succ):  # parameters met there are their module's (param_roles)
                    meets.add(succ)
                elif any(g.nodes[p]["kind"] == "param" for p in g.predecessors(succ)):
                    leaks.append(succ)
                else:
                    todo.append(succ)
        if not leaks:
            continue
        leak = min(leaks, key=lambda n: g.nodes[n]["order"])
        at = g.nodes[leak]["module"] or "the root"
        reason = (f"its shard meets output features {span[0]}:{span[1]} of {g.nodes[linear]['module']}, broadcast "
                  f"along the sharded dim, which {g.nodes[leak]['op']} in {at} also reads: their gradient would be "
                  "partly whole, partly a per-rank partial sum")
        for meet in meets:
            for origin in flow.state[meet].origins if isinstance(flow.state[meet], Shard) else ():
                bad.setdefault(origin, reason)
    return bad


def copy_leaks(flow: Flow) -> dict[str, str]:
    """Candidates with a part held whole on every rank (:attr:`Flow.copied`) whose gradient would
    not be only per-rank shares: as for :func:`broadcast_leaks`, the values computed from the part,
    followed until they meet a shard, must reach no Linear, no output and no parameter. Each rank's
    output gradient of the part is then its heads' share, which the column's input-gradient
    reduction and the copies' summed weight gradients (:class:`~autotp.styles.GroupCopies`) add up
    to the whole; a reader outside would be counted once per rank."""
    g, bad = flow.g, {}
    for cut, parts in sorted(flow.copy_cuts.items()):
        for index, (root, span) in sorted(parts.items(), key=lambda item: item[1][1]):
            starts = [cut] if index is None else [s for s in g.successors(cut) if g.nodes[s]["op"] == "getitem"
                                                  and g.nodes[s]["args"][1:2] == (index,)]
            seen, todo, meets, leak = set(starts), list(starts), 0, None
            while todo and leak is None:
                for succ in g.successors(todo.pop()):
                    data = g.nodes[succ]
                    if succ in seen or data["op"] in SINKS:
                        continue
                    seen.add(succ)
                    if data["kind"] != "call" or is_linear(g, succ) or (not flow.sharded(succ) and any(
                            g.nodes[p]["kind"] == "param" for p in g.predecessors(succ))):
                        leak = succ
                        break
                    if flow.sharded(succ):
                        meets += 1
                    else:
                        todo.append(succ)
            if leak is not None or not meets:
                at = f"{g.nodes[leak]['op']} in {g.nodes[leak]['module'] or 'the root'}" if leak else "nothing sharded"
                bad.setdefault(root, f"its part {span[0]}:{span[1]}, held whole on every rank, is also read by {at}: "
                                     "its gradient would be partly whole, partly a per-rank share")
    return bad


def same_weight(g: nx.DiGraph, bad: dict[str, str], active: set[str]) -> dict[str, str]:
    """Candidates that multiply by the weight of a dropped one (a module called twice): one weight
    has one style, so if one call needs it whole, every call keeps it whole."""
    weights = {linear_weight(g, n) for n in bad if is_linear(g, n)} - {None}
    return {n: f"another call of {module_of(g, n)} keeps its weight whole" for n in active
            if n not in bad and linear_weight(g, n) in weights}


def packed_groups(flow: Flow) -> dict[str, str]:
    """Candidates whose shard met a grouped convolution and whose output is also cut into parts
    (before or after it): each rank's channels are then shares of several parts, which need not be
    whole groups in order. Depthwise convolutions, one group per channel, are not concerned."""
    return {r: "its output is cut into parts and also read by a grouped convolution, whose groups a "
               "per-part shard would not keep whole" for r in flow.conv_groups if flow.splits.get(r)}


def endless_shards(flow: Flow) -> dict[str, str]:
    """Candidates whose shard never reaches a row-parallel Linear or the output."""
    reached = set(flow.heads)
    for origins in flow.rows.values():
        reached |= origins
    return {r: "its output is never contracted by a Linear" for r in flow.roots - reached - set(flow.broken)}


def analyse(g: nx.DiGraph, forbidden: dict[str, str] | None = None, *, unit_heads: bool = False,
            whole: dict[str, str] | None = None, copy_parts: bool = False,
            per_group: frozenset = frozenset()) -> tuple[Flow, dict[str, str]]:
    """Run :func:`propagate` to a fixpoint, dropping candidates that break.

    Args:
        forbidden: Linear nodes that may not start a shard, with the reason (tie conflicts).
        whole: Linear nodes whose weight stays whole, as a column and as a row (weights read outside
            their module, tie conflicts); they are forbidden as columns too.
        unit_heads: when candidates were dropped, try once more reading their views as splits into
            a single head (the k/v of one-kv-head attention, whose shard then has extent 1). Kept
            only for candidates that reach an attention with more heads than that; for a tp size
            is then needed to replicate them per rank (:mod:`autotp.synth.kvheads`).
        copy_parts: when packed candidates were dropped, try holding some of their parts whole on
            every rank (:func:`copied_parts`); a tp size is needed to expand those parts.
        per_group: candidates whose views into fixed groups are read per group (:meth:`Flow.group_view`).
    Returns:
        The final :class:`Flow` and, for each dropped candidate, why it was dropped.
    """
    whole = dict(whole or {})
    forbidden = {**whole, **(forbidden or {})}
    flow, dropped = _analyse_once(g, forbidden, whole, unit_heads, copy_parts, per_group)
    pairs = low_rank_pairs(g, flow)
    if not pairs:
        return flow, dropped
    # The up-projections may shard by what they feed (heads) once their down-projections stay whole,
    # as Megatron keeps a query down-projection whole: the reading that shards more weight is kept.
    kept = {c: f"a down-projection ({_out_in(g, c)}) whose up-projection {module_of(g, r)} shards more weight "
               "as a column of its own; kept whole, as Megatron keeps a low-rank down-projection"
            for c, r in pairs.items()}
    other, other_dropped = _analyse_once(g, {**forbidden, **kept}, whole, unit_heads, copy_parts, per_group)
    if sharded_numel(g, other) > sharded_numel(g, flow):
        log.debug("low-rank down-projections kept whole: %s", sorted(module_of(g, c) for c in kept))
        return other, other_dropped
    return flow, dropped


def _analyse_once(g, forbidden, whole, unit_heads, copy_parts, per_group):
    flow, dropped = _one_head_reading(g, forbidden, whole, unit_heads, per_group)
    if copy_parts and set(dropped) - set(forbidden):
        return copied_parts(g, flow, dropped, forbidden, whole, per_group)
    return flow, dropped


def low_rank_pairs(g: nx.DiGraph, flow: Flow) -> dict[str, str]:
    """Column roots that project down (fewer output features than input ones) whose shard ends
    at row Linears that project up, each its row alone: a low-rank pair ``up(down(x))`` (a query
    compressed to a rank), its down-projection -> its (first) up-projection. Such up-projections
    could instead start shards of their own (by the heads they feed), the down-projection whole."""
    rows_of: dict[str, list[str]] = {}
    for row, origins in flow.rows.items():
        for o in origins:
            rows_of.setdefault(o, []).append(row)
    pairs = {}
    for root in sorted(flow.roots):
        rows = rows_of.get(root, [])
        if not rows or not _narrows(g, root) or not all(_widens(g, r) and flow.rows[r] == {root} for r in rows):
            continue
        pairs[root] = rows[0]
    return pairs


def _features(g: nx.DiGraph, name: str) -> tuple[int, int] | None:
    weight = weight_of(g, name)
    if weight is None or weight.out_dim is None:
        return None
    shape = g.nodes[weight.node]["shape"]
    return shape[weight.out_dim], shape[weight.in_dim]


def _narrows(g: nx.DiGraph, name: str) -> bool:
    found = _features(g, name)
    return found is not None and found[0] < found[1]


def _widens(g: nx.DiGraph, name: str) -> bool:
    found = _features(g, name)
    return found is not None and found[0] > found[1]


def _out_in(g: nx.DiGraph, name: str) -> str:
    out, inp = _features(g, name)
    return f"{inp} -> {out} features"


def sharded_numel(g: nx.DiGraph, flow: Flow) -> int:
    """The weights a reading shards: its columns' and rows', and the parameters sharded with them."""
    params = sum(math.prod(g.nodes[p]["shape"] or ()) for p in flow.param_shards)
    return _weight_numel(g, set(flow.roots) | set(flow.rows)) + params


def _one_head_reading(g: nx.DiGraph, forbidden: dict[str, str], whole: dict[str, str],
                      unit_heads: bool, per_group: frozenset) -> tuple[Flow, dict[str, str]]:
    flow, dropped = _fixpoint(g, dict(forbidden), frozenset(), whole, per_group=per_group)
    retry = frozenset(dropped) - set(forbidden)
    if not unit_heads or not retry:
        return flow, dropped
    forbidden_now = dict(forbidden or {})
    for _ in range(2):  # the second round drops extent-1 roots that feed no wider attention
        second, second_dropped = _fixpoint(g, dict(forbidden_now), retry, whole, per_group=per_group)
        stray = {r: dropped[r] for r in second.roots & retry
                 if second.extent.get(r) == 1 and wider_attention(second, r) is None}
        if not stray:
            break
        forbidden_now.update(stray)
    else:
        return flow, dropped
    if len(second.roots) > len(flow.roots):
        log.debug("one-kv-head reading rescued %s", sorted(second.roots - flow.roots))
        return second, second_dropped
    return flow, dropped


# The most finest parts of one packed output among which parts held whole are searched (each
# proper subset is one trial of the analysis).
MAX_COPY_PARTS = 4


def copied_parts(g: nx.DiGraph, flow: Flow, dropped: dict[str, str], forbidden: dict[str, str],
                 whole: dict[str, str], per_group: frozenset = frozenset()) -> tuple[Flow, dict[str, str]]:
    """Packed candidates kept whole that shard once some of their parts are held whole on every
    rank: a fused q / k / v whose k and v are one head each (multi-query attention), read by every
    query head through a broadcast, while the query part is sharded by heads.

    For each dropped candidate cut into at most :data:`MAX_COPY_PARTS` finest parts, the proper
    subsets of its parts are tried, the narrowest first, until its shard survives the analysis
    with them held whole (:func:`copy_leaks` asks that each such part meet the shard only as a
    broadcast). Returns ``(flow, dropped)`` with the choices that held, or the inputs unchanged.
    """
    trial_flow = propagate(g, {n for n in g.nodes if is_linear(g, n)} - set(forbidden))
    choices: dict[str, list[frozenset]] = {}
    for root in sorted(set(dropped) - set(forbidden), key=lambda n: g.nodes[n]["order"]):
        width = g.nodes[root]["shape"][-1]
        ranges = trial_flow.splits.get(root)
        if not ranges or g.nodes[root].get("weight_in_out") or raw_like(g, root) \
                or not _tiles(sorted(set(ranges)), 0, width):
            continue
        sizes = part_sizes(ranges, width)
        spans = [(sum(sizes[:i]), sum(sizes[:i + 1])) for i in range(len(sizes))]
        if not 1 < len(spans) <= MAX_COPY_PARTS:
            continue
        # Copies cost memory on every rank: only parts narrower than half the output are held whole.
        subsets = [frozenset(c) for n in range(1, len(spans)) for c in itertools.combinations(spans, n)
                   if 2 * sum(e - s for s, e in c) < width]
        if subsets:
            choices[root] = sorted(subsets, key=lambda c: (sum(e - s for s, e in c), sorted(c)))
    chosen: dict[str, frozenset] = {}
    while choices:
        trial = {**chosen, **{root: options[0] for root, options in choices.items()}}
        second, _ = _fixpoint(g, dict(forbidden), flow.unit_heads, whole, trial, per_group=per_group)
        for root in list(choices):
            first, *rest = choices.pop(root)
            if root in second.roots:
                chosen[root] = first
            elif rest:
                choices[root] = rest
    if not chosen:
        return flow, dropped
    second, second_dropped = _fixpoint(g, dict(forbidden), flow.unit_heads, whole, chosen, per_group=per_group)
    if not set(chosen) <= second.roots or len(second.roots) <= len(flow.roots):
        return flow, dropped
    log.debug("parts held whole per rank: %s", {r: sorted(s) for r, s in chosen.items()})
    return second, second_dropped


def _fixpoint(g: nx.DiGraph, dropped: dict[str, str], unit_heads: frozenset, whole: dict[str, str],
              copied: dict[str, frozenset] | None = None,
              per_group: frozenset = frozenset()) -> tuple[Flow, dict[str, str]]:
    active = {name for name in g.nodes if is_linear(g, name)} - set(dropped)
    rounds, yielded, retried = 0, {}, set()
    met_whole: dict[str, str] = {}  # dropped candidate -> the op where it broke, until revived once
    scattered: set[str] = set()  # rows asked to reduce-scatter onto the heads they feed (each once)
    while True:
        rounds += 1
        flow = propagate(g, active, unit_heads, whole, copied=copied, per_group=per_group, revivable=met_whole,
                         head_scatters=frozenset(scattered))
        asked = flow.revived | (flow.scatter_requests - scattered)
        if asked:  # the round read them as sharded where they are not: try them, decide anew
            log.debug("round %d: revived %s, scattered onto the heads %s", rounds, sorted(flow.revived),
                      sorted(flow.scatter_requests - scattered))
            for r in flow.revived:
                met_whole[r] = ""
            scattered |= flow.scatter_requests
            for r in asked:
                dropped.pop(r, None)
            active |= asked
            continue
        bad = {r: f"{reason} (at {g.nodes[node]['op']} in {g.nodes[node]['module'] or 'the root'})"
               for r, (reason, node) in flow.broken.items()}
        bad.update(bad_packs(flow))
        bad.update({r: reason for r, reason in mixed_parts(flow).items() if r not in bad})
        bad.update(endless_shards(flow))
        bad.update({r: reason for r, reason in unmet_scatters(flow).items() if r not in bad})
        bad.update({r: reason for r, reason in packed_groups(flow).items() if r not in bad})
        bad.update({r: reason for r, reason in _raw_limits(flow).items() if r not in bad})
        bad.update({r: reason for r, reason in broadcast_leaks(flow).items() if r not in bad})
        bad.update({r: reason for r, reason in copy_leaks(flow).items() if r not in bad})
        bad.update({r: reason for r, reason in partial_sum_breaks(g, flow.rows, module_of).items() if r not in bad})
        bad.update({r: reason for r, reason in bias_breaks(flow).items() if r not in bad})
        bad.update({r: reason for r, reason in stray_param_reads(flow).items() if r not in bad})
        bad.update({r: reason for r, reason in stray_tree_reads(flow).items() if r not in bad})
        bad.update({r: reason for r, reason in stray_entry_reads(flow).items() if r not in bad})
        bad.update({r: reason for r, reason in head_loop_breaks(flow).items() if r not in bad})
        bad.update({r: reason for r, reason in same_weight(g, bad, active).items() if r not in bad})
        yielded.update({r: mine for r, mine in flow.yielded.items() if r in bad})
        met_whole.update({r: node for r, (_, node) in flow.broken.items()
                          if r in bad and r not in met_whole and g.nodes[node]["op"] in ELEMENTWISE | MATMULS})
        if not bad:
            # A candidate that gave way to shards which were all dropped later gave way for nothing:
            # it is tried again (once), and the rounds go on.
            back = {r for r, mine in yielded.items() if r not in retried and not (mine & flow.roots)}
            if not back:
                log.debug("analysis converged after %d rounds, %d candidates dropped", rounds, len(dropped))
                return flow, dropped
            retried |= back
            for r in back:
                dropped.pop(r, None)
            active |= back
            continue
        dropped.update(bad)
        active -= set(bad)


def wider_attention(flow: Flow, root: str) -> str | None:
    """The first attention or batched matmul ``root``'s shard reaches, if its sharded dim there
    holds more heads than ``root``'s extent (the k/v of grouped-query attention), else None."""
    g = flow.g
    extent = flow.extent.get(root, 0)
    for name in sorted(g.nodes, key=lambda n: g.nodes[n]["order"]):
        data = g.nodes[name]
        if data["op"] not in ATTENTION | MATMULS:
            continue
        if any(isinstance(flow.state.get(r.name), Shard) and root in flow.state[r.name].origins
               for r in refs(data["args"])):
            state = flow.state.get(name)
            heads = data["shape"][state.dim] if isinstance(state, Shard) else 0
            return name if extent < heads else None
    return None
