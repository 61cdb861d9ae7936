"""Per-expert loops over 3-D expert parameters: weights picked by ``W[e]``, biases beside them, and
the running sum the experts' partial outputs are added into.

MoE code that loops over its experts (``for e in ...: y = x[tok] @ self.gate_up[e] + self.gate_up_bias[e]
... out.index_add_(0, tok, y * w)``) reads one expert's weight per step. Each such product is a
Linear on the 3-D parameter (:func:`selected_weight`): a column when it reads replicated tokens,
a row when it contracts the FFN features. All experts' products share one parameter, so they are
sharded, or kept whole, together.

Sharded on the FFN dim, a column's output holds each rank's FFN features: a per-expert bias added to
it (``gate_up_bias[e]``, or rows gathered by expert id, ``gate_up_bias[ids]``) is sharded along on its
feature dim (:func:`expert_bias`). A row's output is a per-rank partial sum, reduced once after the
experts module; until then only ops linear in it may read it (:func:`partial_sum_breaks`), and a bias
added to it (``down_bias[e]``) is added by one rank only (:func:`once_params`), as Megatron adds a
row's bias once after the reduction.

Terms whole on every rank may also be added into that running sum (:func:`partial_sum_reach` with
``whole``): zero-compute experts that add the routed tokens times their routing weight, any addend
computed from the module's replicated inputs only. The output is then ``P_r + W`` on rank ``r``, ``P_r``
linear in the rows' weight and ``W`` free of it: the experts style multiplies the rows' weight by tp
and divides the output by tp (``scale_rows``), so ``P_r`` is unchanged and the reduction adds ``W / tp``
tp times. An addend that reads a parameter of the module, or is added other than by a sum, is not
such a term: the experts stay whole.
"""

from __future__ import annotations

import networkx as nx

from autotp.synth.graph import Ref, refs
from autotp.synth.ops import INDEX_ADDS, SUMS, ZEROS
from autotp.synth.ops import PASSTHROUGH, SINKS, VIEW_LIKE
from autotp.synth.queries import _readers, linear_weight, module_of, part_sizes, raw_weight
from autotp.synth.stages import drop_check


# Ops that gather or view rows of a partial sum, or scale it: linear in their first argument when
# no other argument is a partial sum (the indices and scales are replicated).
_LINEAR_IN_FIRST = PASSTHROUGH | VIEW_LIKE | frozenset({
    "index", "index_select", "select", "slice", "unsqueeze", "squeeze", "transpose", "permute", "sum",
    "mul", "mul_", "div", "div_", "expand",
})


def expert_bias(g: nx.DiGraph, name: str, dim: int) -> tuple[str, int] | None:
    """``(2-D parameter, its dim)`` when node ``name`` is a per-expert bias ``B[e]`` or ``B[ids]`` of a
    parameter ``B`` (experts, features) whose dim ``dim`` of ``name`` is the features, and every
    reader of ``B`` picks experts so (its gradient is then each rank's slice); else None.

    >>> from autotp.synth.graph import add_node
    >>> g = nx.DiGraph()
    >>> _ = add_node(g, "b", "placeholder", kind="param", param="m.bias", shape=(4, 8))
    >>> _ = add_node(g, "s", "select", (Ref("b"), 0, 1), shape=(8,))
    >>> expert_bias(g, "s", 0)
    ('b', 1)
    """
    data = g.nodes[name]
    while data["kind"] == "call" and data["op"] in PASSTHROUGH and data["args"] and isinstance(data["args"][0], Ref):
        name = data["args"][0].name
        data = g.nodes[name]
    if data["kind"] != "call" or not data["args"] or not isinstance(data["args"][0], Ref):
        return None
    param = data["args"][0].name
    shape = g.nodes[param]["shape"]
    if g.nodes[param]["kind"] != "param" or shape is None or len(shape) != 2:
        return None
    if not all(_picks_experts(g, reader) for reader in _readers(g, param)):
        return None
    if data["op"] == "select" and dim == 0:
        return param, 1
    if data["op"] == "index" and dim == 1 and len(data["shape"] or ()) == 2:
        return param, 1
    return None


def _picks_experts(g: nx.DiGraph, name: str) -> bool:
    """``B[e]`` (select of dim 0 by a constant) or ``B[ids]`` (rows gathered by one index tensor)."""
    data = g.nodes[name]
    if data["op"] == "select":
        return data["args"][1:2] == (0,) and isinstance(data["args"][2], int)
    return data["op"] == "index" and len(data["args"]) > 1 and len(data["args"][1]) == 1 \
        and isinstance(data["args"][1][0], Ref)


def _partial_sum_walk(g: nx.DiGraph, rows: list[str], module: str) -> tuple[set[str], str | None]:
    """The parameters added to the partial sums of ``rows`` inside ``module`` (biases), and the first
    op that reads a partial sum other than linearly (None if none does); whole terms are accepted
    (:func:`whole_terms`)."""
    _, once, reason = partial_sum_reach(g, rows, module, whole=set())
    return once, reason


def whole_terms(g: nx.DiGraph, rows: list[str], module: str) -> set[str]:
    """Nodes whole on every rank that ``module`` adds to its 3-D experts rows' partial sums (zero-compute
    experts' tokens times their weight): with any, the style scales the rows (``scale_rows``)."""
    found: set[str] = set()
    partial_sum_reach(g, rows, module, whole=found)
    return found


def partial_sum_reach(g: nx.DiGraph, rows: list[str], module: str,
                      whole: set[str] | None = None) -> tuple[set[str], set[str], str | None]:
    """:func:`_partial_sum_walk` with the nodes holding partial sums: ``(reached, once, reason)``;
    ``reached`` is complete only where ``reason`` is None.

    Args:
        whole: where given, terms whole on every rank added to a partial sum (:func:`whole_value`)
            are accepted and collected here; else such a sum is a reason.
    """
    reached, once = set(rows), set()
    inside = sorted((n for n, d in g.nodes(data=True) if d["kind"] == "call" and module in d["stack"]),
                    key=lambda n: g.nodes[n]["order"])
    for user in inside:  # program order: a node's inputs are decided before it
        data = g.nodes[user]
        inputs = [r.name for r in refs(data["args"], data["kwargs"])]
        partial = [n for n in inputs if n in reached]
        if user in reached or not partial or data["op"] in SINKS | ZEROS:
            continue  # zeros shaped like a partial sum read none of its values
        reason = _nonlinear(g, user, inputs, partial, once, whole, module)
        if reason:
            return reached, once, reason
        reached.add(user)
    return reached, once, None


def _nonlinear(g: nx.DiGraph, name: str, inputs: list[str], partial: list[str], once: set[str],
               whole: set[str] | None = None, module: str = "") -> str | None:
    """Why node ``name`` (in ``module``) is not linear in its ``partial`` inputs (None if it is);
    per-expert biases added to them are collected in ``once``, other whole addends in ``whole``
    (refused where None)."""
    data, op = g.nodes[name], g.nodes[name]["op"]
    if op in SUMS:
        if any(isinstance(a, (int, float)) and not isinstance(a, bool) and a != 0 for a in data["args"][:2]):
            if whole is None:  # ``y + 1.0``: every rank would add the constant
                return f"{op} adds a constant to a per-rank partial sum"
            whole.add(name)
        for other in (n for n in inputs if n not in partial and not _zero_valued(g, n)):
            bias = expert_bias(g, other, len(g.nodes[other]["shape"] or ()) - 1)
            if bias is not None:
                once.add(bias[0])
            elif whole is not None and whole_value(g, other, module):
                whole.add(other)
            else:
                return f"{op} adds {other} to a per-rank partial sum" + _whole_why(whole)
        return None
    if op in INDEX_ADDS:
        args = data["args"]
        target, index, source = args[0], args[2], args[3] if len(args) > 3 else None
        if not isinstance(source, Ref) or (isinstance(index, Ref) and index.name in partial):
            return f"{op} adds a partial sum into a tensor that is not one"
        # Into a partial sum (or zeros) a partial sum or a whole term; a partial sum into a whole term.
        for term in (target.name, source.name):
            if term in partial or (term == target.name and g.nodes[term]["op"] in ZEROS):
                continue
            if whole is None or not whole_value(g, term, module):
                what = "a whole term into a partial sum" if term == source.name else "a partial sum into a tensor that is not one"
                return f"{op} adds {what}" + _whole_why(whole)
            whole.add(term)
        return None
    if op in ("index_put", "index_put_"):  # rows of the target replaced by the values: linear in both
        target, indices, values = data["args"][:3]
        if any(isinstance(i, Ref) and i.name in partial for i in indices or ()) or not isinstance(values, Ref) \
                or not (values.name in partial or _zero_valued(g, values.name)) \
                or not (target.name in partial or _zero_valued(g, target.name)):
            return f"{op} writes a per-rank partial sum into a tensor that is not one"
        return None
    if op == "mul" and len(partial) == 1:
        return None  # ``w * y`` as ``y * w``: a product is linear in either factor
    if op == "cat":  # the experts' outputs joined (one block of rows each): linear in every piece
        pieces = [p.name for p in data["args"][0] if isinstance(p, Ref)]
        if all(p in partial or _zero_valued(g, p) for p in pieces):
            return None
        return "cat joins a per-rank partial sum with a tensor that is not one"
    if op not in _LINEAR_IN_FIRST or partial != [inputs[0]]:
        return f"{op} reads a per-rank partial sum other than linearly"
    return None


def whole_value(g: nx.DiGraph, name: str, module: str) -> bool:
    """Whether node ``name`` is the same on every rank under the experts style of ``module``: its
    value inside ``module`` reads no parameter (those of the module are sharded, or added once), only
    the module's inputs (replicated tokens and routing weights), buffers and constants.

    >>> from autotp.synth.graph import add_node
    >>> g = nx.DiGraph()
    >>> _ = add_node(g, "x", "placeholder", kind="input", shape=(4, 8))
    >>> _ = add_node(g, "w", "placeholder", kind="param", param="m.scale", shape=(8,))
    >>> _ = add_node(g, "y", "mul", (Ref("x"), 2.0), stack=("m",), module="m")
    >>> _ = add_node(g, "z", "mul", (Ref("y"), Ref("w")), stack=("m",), module="m")
    >>> whole_value(g, "y", "m"), whole_value(g, "z", "m")
    (True, False)
    """
    seen, todo = set(), [name]
    while todo:
        node = todo.pop()
        if node in seen:
            continue
        seen.add(node)
        data = g.nodes[node]
        if data["kind"] == "param":
            return False
        if data["kind"] == "call" and module in data["stack"]:
            todo.extend(r.name for r in refs(data["args"], data["kwargs"]))
    return True


def _whole_why(whole: set[str] | None) -> str:
    """Why a term was not taken as whole (empty where whole terms were not sought)."""
    return "" if whole is None else " that reads a parameter of the module (not the same on every rank)"


def _zero_valued(g: nx.DiGraph, name: str) -> bool:
    """Whether ``name`` holds zeros only: a fresh tensor of zeros, or rows, views or copies of one
    (``out[idx]`` of ``out = zeros_like(x)`` before anything is added into it)."""
    while g.nodes[name]["kind"] == "call" and g.nodes[name]["op"] in _ZERO_KEEPING:
        source = g.nodes[name]["args"][0]
        if not isinstance(source, Ref):
            return False
        name = source.name
    return g.nodes[name]["kind"] == "call" and g.nodes[name]["op"] in ZEROS


# Ops whose output is zeros wherever their first input is.
_ZERO_KEEPING = PASSTHROUGH | VIEW_LIKE | frozenset({"index", "index_select", "select", "slice", "unsqueeze", "squeeze",
                                                      "transpose", "permute", "expand"})


def partial_sum_breaks(g: nx.DiGraph, rows: dict[str, frozenset], module_of) -> dict[str, str]:
    """Candidates whose shard a 3-D experts row contracts and whose partial sum is then read, in
    the experts module, by an op not linear in it (a norm, ``out + f(out)`` inside the loop, a bias
    other than a per-expert one): it would be computed on a per-rank share. Candidate -> reason."""
    by_module: dict[str, list[str]] = {}
    for row in rows:
        weight = _weight_node(g, row)
        # A raw stacked weight's row (``torch.bmm`` in the module's own code) is reduced at the
        # product by its style (``HeadParams`` with ``rows``): only the experts style leaves partial sums.
        if weight is not None and len(g.nodes[weight]["shape"]) == 3 and not raw_weight(g, row):
            by_module.setdefault(module_of(g, row), []).append(row)
    bad = {}
    for module, found in by_module.items():
        _, reason = _partial_sum_walk(g, found, module)
        if reason:
            for row in found:
                for root in rows[row]:
                    bad.setdefault(root, f"{reason} in {module}, before the experts' output is reduced")
    return bad


@drop_check(order=10)
def partial_sum_drops(flow) -> dict[str, str]:
    """:func:`partial_sum_breaks` of a propagation round."""
    return partial_sum_breaks(flow.g, flow.rows, module_of)


@drop_check(order=20)
def bias_breaks(flow) -> dict[str, str]:
    """Columns whose per-expert bias cannot be sharded with them: the columns a bias meets are cut
    into different numbers of parts (one packing for one parameter), or the bias is also added to
    the rows' partial sums (sharded and added once at the same time). Candidate -> reason."""
    g, bad = flow.g, {}
    for param, columns in flow.expert_bias_columns.items():
        counts = {len(part_sizes(flow.splits[c], g.nodes[c]["shape"][-1])) if c in flow.splits else 1 for c in columns}
        if len(counts) > 1:
            for column in columns:
                bad.setdefault(column, f"its per-expert bias {g.nodes[param]['param']} meets columns cut into "
                                       f"different numbers of parts {sorted(counts)}")
    owners = {g.nodes[p]["param"].rpartition(".")[0] for p in flow.expert_biases}
    rows_by_module: dict[str, list[str]] = {}
    for row in flow.rows:
        if module_of(g, row) in owners:
            rows_by_module.setdefault(module_of(g, row), []).append(row)
    for module, rows in rows_by_module.items():
        for param in once_params(g, rows, module) & set(flow.expert_biases):
            for column in flow.expert_bias_columns[param]:
                bad.setdefault(column, f"its per-expert bias {g.nodes[param]['param']} is also added to the "
                                       "experts' partial sums")
    return bad


def once_params(g: nx.DiGraph, rows: list[str], module: str) -> set[str]:
    """Parameter placeholders added to the partial sums of ``rows`` (3-D experts rows of ``module``):
    per-expert biases, to be added by one rank only."""
    return _partial_sum_walk(g, rows, module)[0]


def _weight_node(g: nx.DiGraph, name: str) -> str | None:
    return linear_weight(g, name)
