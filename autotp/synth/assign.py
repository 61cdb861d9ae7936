"""Turn a converged :class:`~autotp.synth.flow.Flow` into one :class:`Role` per module.

Long because each role family (Linears, experts, embeddings, norms, raw weights, tie and
foreign-read constraints) is assigned here from the same converged flow.
"""

from __future__ import annotations

import networkx as nx

from autotp.synth.flow import Flow, weight_uses

from autotp.synth.queries import is_linear, linear_weight, module_of, param_source, part_sizes, raw_weight, weight_of

from autotp.synth.shard import Shard
from autotp.synth.experts import once_params, whole_terms
from autotp.synth.graph import Ref, param_modules, refs
from autotp.synth.ops import ALIASING, SINKS
from autotp.synth.head_mixers import mixer_roles
from autotp.synth.param_roles import broadcast_roles, param_roles
from autotp.synth.queries import reading_module
from autotp.synth.roles import WEIGHT_DIMS, Role, kind_of


def shard_path(g: nx.DiGraph, flow: Flow, name: str) -> list[str]:
    """Nodes a shard went through to reach ``name``, from the Linear that started it."""
    path = [name]
    value = flow.state.get(name)
    while isinstance(value, (Shard, tuple)):
        shard = value if isinstance(value, Shard) else next((v for v in value if v), None)
        if shard is None or shard.prev is None:
            break
        path.append(shard.prev)
        value = flow.state.get(shard.prev)
    return path[::-1]


def root_path(g: nx.DiGraph, flow: Flow, root: str, ends: set[str]) -> list[str]:
    """Shortest path of ``root``'s shard from ``root`` to one of ``ends`` (rows or the output)."""
    def carries(n):
        value = flow.state.get(n)
        values = value if isinstance(value, tuple) else (value,)
        head = flow.per_head.get(n)  # one head's value in a per-head loop carries it too
        return any(isinstance(v, Shard) and root in v.origins for v in values) or bool(head and root in head.origins)

    allowed = {n for n in g.nodes if carries(n)} | set(ends)
    carrying = nx.DiGraph(g.subgraph(allowed))
    carrying.add_edges_from((w, b) for w, b in flow.writes.items() if w in allowed and b in allowed)  # in place
    paths = nx.single_source_shortest_path(carrying, root)
    reached = [paths[e] for e in ends if e in paths]
    return min(reached, key=len) if reached else [root]


def _describe(g: nx.DiGraph, path: list[str], end: str) -> tuple[str, ...]:
    owner = module_of(g, path[0])
    return (owner, *[g.nodes[n]["op"] for n in path[1:]], end)


def linear_roles(g: nx.DiGraph, flow: Flow, dropped: dict[str, str]) -> dict[str, Role]:
    """Roles of every module that runs a Linear: column, packed, row, head or replicate."""
    roles: dict[str, Role] = {}
    in_out = {n for n in (*flow.rows, *flow.roots) if g.nodes[n].get("weight_in_out")}
    for row in flow.rows:
        if raw_weight(g, row):
            continue  # its module's raw_linear_roles
        x = g.nodes[row]["args"][0].name
        path = _describe(g, shard_path(g, flow, x), module_of(g, row))
        packs = flow.row_packs.get(row)
        reason = "contracts over the sharded input features" + (
            f", which hold {len(packs)} parts of {packs[0]} (each rank a share of every part)" if packs else "")
        if row in flow.head_scatters:
            reason += "; its output, reduce-scattered on its features, is the block of them its ranks' heads read"
        elif row in flow.scatters:
            reason += (f"; its {g.nodes[row]['shape'][-1]} output features are one value per head, "
                       "reduce-scattered onto the heads they meet again")
        roles[module_of(g, row)] = Role("row", reason, path, weight_in_out=row in in_out, sizes=packs,
                                        scatter_heads=row in flow.scatters)
    for root in sorted(flow.roots, key=lambda n: g.nodes[n]["order"]):
        owner = module_of(g, root)
        if raw_weight(g, root):
            continue
        if root in flow.heads:
            path = _describe(g, shard_path(g, flow, flow.heads[root]), "output")
            roles[owner] = Role("head", "its sharded output features are the model output", path,
                                weight_in_out=root in in_out)
            continue
        rows = {r for r, origins in flow.rows.items() if root in origins}
        path = root_path(g, flow, root, rows)
        evidence = (*_describe(g, path[:-1], module_of(g, path[-1])),)
        if root in flow.splits:
            sizes = part_sizes(flow.splits[root], g.nodes[root]["shape"][-1])
            groups = flow.group_views.get(root, (0,))[0]
            reason = f"its output is split into parts {sizes}" + (
                f", viewed as {groups} fixed groups: each rank holds its share of every part" if groups else "")
            roles[owner] = Role("packed_column", reason, evidence, sizes=sizes, weight_in_out=root in in_out)
        else:
            roles[owner] = Role("column", "its output features stay sharded until a row Linear", evidence,
                                weight_in_out=root in in_out)
    for name, reason in dropped.items():
        roles.setdefault(module_of(g, name), Role("replicate", reason))
    roles.update(expert_roles(g, flow, dropped, roles))
    return roles


def raw_linear_roles(g: nx.DiGraph, flow: Flow) -> dict[str, Role]:
    """Modules whose own raw parameters are column / row Linear weights (:func:`raw_weight`): one
    ``linear_params`` role each, with every such weight's sharded dim (a column's bias: dim 0)."""
    dims: dict[str, dict[str, int]] = {}
    kinds: dict[str, dict[str, list[str]]] = {}
    for name in sorted(set(flow.rows) | set(flow.roots), key=lambda n: g.nodes[n]["order"]):
        if not raw_weight(g, name):
            continue
        weight, args = weight_of(g, name), g.nodes[name]["args"]
        module, pname = reading_module(g, weight.node)
        row = name in flow.rows
        dims.setdefault(module, {})[pname] = weight.in_dim if row else weight.out_dim
        kinds.setdefault(module, {"columns": [], "rows": []})["rows" if row else "columns"].append(pname)
        bias = param_source(g, args[2].name) if len(args) > 2 and isinstance(args[2], Ref) else None
        if bias is not None and not row:
            dims[module][reading_module(g, bias)[1]] = 0
    return {module: Role("linear_params", f"its raw parameters {', '.join(by_param)} are Linear weights "
                         f"(columns {kinds[module]['columns']}, rows {kinds[module]['rows']}), sharded like them",
                         (module,), param_dims=tuple(sorted(by_param.items())),
                         columns=tuple(kinds[module]["columns"]), rows=tuple(kinds[module]["rows"]))
            for module, by_param in dims.items()}


def _with_raw_linears(roles: dict[str, Role], raw: dict[str, Role]) -> dict[str, Role]:
    """``raw_linear_roles`` over ``roles``; a module's ``head_params`` (a per-head parameter beside
    its raw weights) folded into its ``linear_params``."""
    from dataclasses import replace

    out = dict(roles)
    for module, role in raw.items():
        current = roles.get(module)
        if current is not None and current.kind == "head_params":
            role = replace(role, param_dims=tuple(sorted({**dict(current.param_dims), **dict(role.param_dims)}.items())),
                           grad_reduced=current.grad_reduced, param_packed=current.param_packed)
        out[module] = role
    return out


def expert_roles(g: nx.DiGraph, flow: Flow, dropped: dict[str, str], roles: dict[str, Role]) -> dict[str, Role]:
    """Modules whose 3-D (per-expert) weights are a column/row pair: one ``experts`` role each."""
    dims: dict[str, dict[str, int]] = {}
    parts: dict[str, dict[str, int]] = {}
    evidence: dict[str, tuple] = {}
    row_params: dict[str, set[str]] = {}
    column_params: dict[str, set[str]] = {}
    for name in set(flow.rows) | set(flow.roots) | set(dropped):
        weight = weight_of(g, name)
        if weight is None or len(g.nodes[weight.node]["shape"]) != 3 or raw_weight(g, name):
            continue  # raw stacked weights (a bmm in the module's own code): raw_linear_roles
        module, pname = reading_module(g, weight.node)
        dims.setdefault(module, {})
        if name in flow.rows:
            dims[module][pname] = weight.in_dim
            row_params.setdefault(module, set()).add(pname)
        elif name in flow.roots:
            dims[module][pname] = weight.out_dim
            column_params.setdefault(module, set()).add(pname)
            if name in flow.splits:
                parts.setdefault(module, {})[pname] = len(part_sizes(flow.splits[name], g.nodes[name]["shape"][-1]))
        else:
            dims[module][pname] = -1
        evidence[module] = evidence.get(module, ()) + roles[module].evidence
    out = {}
    for module, by_param in dims.items():
        if -1 in by_param.values():
            out[module] = roles[module]
            continue
        biases, bias_parts = _expert_bias_dims(g, flow, module)
        by_param.update(biases)
        parts.setdefault(module, {}).update(bias_parts)
        once, scaled, note = _whole_addends(g, flow, module, row_params.get(module, set()))
        side = "" if module in row_params and module in column_params else \
            "rows" if module in row_params else "columns"
        what = {"": "per-expert column/row pair over the FFN dim",
                "columns": "per-expert columns over the FFN dim (their rows are another module's): its "
                           "output, this rank's FFN features, stays local",
                "rows": "per-expert rows over the FFN dim (their columns are another module's): takes this "
                        "rank's FFN features, its output all-reduced"}[side]
        out[module] = Role("experts", what + note,
                           evidence[module], param_dims=tuple(sorted(by_param.items())),
                           param_parts=tuple(sorted(parts.get(module, {}).items())), once=once,
                           scale_rows=scaled, experts_side=side)
    return out


def _expert_bias_dims(g: nx.DiGraph, flow: Flow, module: str) -> tuple[dict[str, int], dict[str, int]]:
    """Per-expert biases of ``module`` sharded with its columns (``Flow.expert_biases``), and the
    number of fused parts of those cut into parts (packed like the columns' weight; every column a
    bias meets is cut alike, :func:`~autotp.synth.experts.bias_breaks`)."""
    dims, parts = {}, {}
    for param, dim in flow.expert_biases.items():
        owner, pname = reading_module(g, param)
        if owner != module:
            continue
        dims[pname] = dim
        counts = {len(part_sizes(flow.splits[c], g.nodes[c]["shape"][-1])) if c in flow.splits else 1
                  for c in flow.expert_bias_columns.get(param, ())}
        if len(counts) == 1 and counts != {1}:
            parts[pname] = counts.pop()
    return dims, parts


def _whole_addends(g: nx.DiGraph, flow: Flow, module: str,
                   rows: set[str]) -> tuple[tuple[str, ...], tuple[str, ...], str]:
    """``(once, scale_rows, note)`` of an experts ``module``: the per-expert biases added to its rows'
    partial sums by one rank; or, where other terms whole on every rank are added to them too
    (:func:`~autotp.synth.experts.whole_terms`), its row parameters scaled by tp (the biases are
    then whole terms as well). ``note`` says which, for the role's reason."""
    once = _once_params(g, flow, module)
    whole = whole_terms(g, [r for r in flow.rows if module_of(g, r) == module], module)
    if not whole:
        return once, (), f"; {', '.join(once)} added to the partial sum by one rank" if once else ""
    terms = ", ".join(sorted(whole)[:3]) + (", ..." if len(whole) > 3 else "")
    return (), tuple(sorted(rows)), (f"; terms whole on every rank ({terms}) added to the partial sum: "
                                     f"{', '.join(sorted(rows))} times tp, the output divided by tp, so they count once")


def _once_params(g: nx.DiGraph, flow: Flow, module: str) -> tuple[str, ...]:
    """Per-expert biases ``module`` adds to its rows' partial sums (:func:`~autotp.synth.experts.once_params`)."""
    rows = [r for r in flow.rows if module_of(g, r) == module]
    return tuple(sorted(reading_module(g, p)[1] for p in once_params(g, rows, module)))


def tie_conflicts(g: nx.DiGraph, roles: dict[str, Role], flow: Flow | None = None) -> dict[str, str]:
    """Linear nodes whose tied weight another user shards differently: node -> reason.

    A row Linear is kept whole only if its input is: with ``flow``, the column Linears its input
    shard comes from (OPT's ``project_out`` before a tied head) are returned as well. Where such a
    row is the user that disagrees, those columns alone are returned first: kept whole, they hand
    the tied user a replicated input, and it shards the weight like the others (a tied head after a
    small projection is sharded over the vocabulary with its embedding, rather than both whole).
    """
    users: dict[str, list[tuple[str, str]]] = {}
    for name, weight in weight_uses(g):
        users.setdefault(weight, []).append((name, g.nodes[name]["module"]))
    conflicts = {}
    for weight, nodes in users.items():
        if len(nodes) < 2:
            continue
        dims = {WEIGHT_DIMS.get(kind_of(roles, module)) for _, module in nodes}  # None: kept whole
        if len(dims) > 1:
            names = ", ".join(m for _, m in nodes)
            origins = {o: why for name, module in nodes if kind_of(roles, module) == "row"
                       for o, why in _shard_origins(g, flow, name, names).items()}
            if origins:
                conflicts.update({o: f"its output reaches a Linear whose weight is tied ({names}); kept whole so "
                                     "that the tied users shard the weight alike" for o in origins})
                continue
            for name, _ in nodes:
                if is_linear(g, name):
                    conflicts[name] = f"its weight {g.nodes[weight]['param']} is tied ({names}) and the users would shard it differently"
                    conflicts.update(_shard_origins(g, flow, name, names))
    return conflicts


def _shard_origins(g: nx.DiGraph, flow: Flow | None, name: str, names: str) -> dict[str, str]:
    """The Linears whose shard reaches ``name``'s input: they must stay whole for it to stay whole."""
    data = g.nodes[name]
    source = data["args"][0] if data["args"] else None
    state = flow.state.get(source.name) if flow is not None and isinstance(source, Ref) else None
    if not isinstance(state, Shard):
        return {}
    owner = module_of(g, name)
    return {o: f"its output reaches {owner}, whose weight is tied ({names}) and must stay whole" for o in state.origins}


def foreign_reads(g: nx.DiGraph) -> tuple[dict[str, str], dict[str, str]]:
    """Linear and embedding weights that code outside their modules reads directly.

    A sharded weight is a DTensor; an op outside the module that owns it (Gemma4's
    ``embed_tokens.weight[pad_token_id]`` in the model's forward) then mixes it with plain tensors,
    or reads a shard as the whole. Such weights stay whole on every user.

    Returns:
        ``(linear node -> reason, embedding module -> reason)``, in the shapes
        :func:`~autotp.synth.fixpoint.analyse` (``dropped``) and :func:`assign_roles` (``forced``) take.
    """
    weight_users: dict[str, list[tuple[str, str]]] = {}  # placeholder -> (node, module) using it as a weight
    for name, weight in weight_uses(g):
        weight_users.setdefault(weight, []).append((name, g.nodes[name]["module"]))
    linears, embeddings = {}, {}
    for weight, users in weight_users.items():
        owners = {g.nodes[weight]["param"].rpartition(".")[0], *(module for _, module in users)}
        used = {node for node, _ in users}
        outside = [s for s in g.successors(weight) if s not in used and not owners & set(g.nodes[s]["stack"])]
        # A cast on the way to a weight use (``weight.to(dtype)`` then linear) is not a foreign read.
        outside = [s for s in outside if not used & nx.descendants(g, s)]
        if not outside:
            continue
        node = g.nodes[outside[0]]
        reason = (f"its weight {g.nodes[weight]['param']} is also read by {node['op']} in "
                  f"{node['module'] or 'the root'}, outside the module: a shard there would be read as the whole")
        for user, module in users:
            if is_linear(g, user):
                linears[user] = reason
            else:
                embeddings[module] = reason
    return linears, embeddings


def reads_model_input(g: nx.DiGraph, name: str) -> bool:
    """Whether node ``name`` is computed from a model input (token ids, possibly masked or
    remapped), rather than from shapes alone (positions from ``arange``)."""
    if g.nodes[name]["kind"] == "input":
        return True
    return any(g.nodes[a]["kind"] == "input" for a in nx.ancestors(g, name))


def _other_table_read(g: nx.DiGraph, weight: str, lookup: str, owner: str) -> str | None:
    """The first op inside module ``owner`` that reads table ``weight`` other than on its way to the
    lookup ``lookup`` (``rows + self.weight.mean(0)``), if any: the vocab-parallel style swaps the
    table for this rank's rows during the module's forward, so such a read would see a shard."""
    chain = (nx.ancestors(g, lookup) & nx.descendants(g, weight)) | {weight}  # the table on its way in
    for node in chain:
        for reader in g.successors(node):
            data = g.nodes[reader]
            if reader not in chain and reader != lookup and owner in data["stack"] and data["op"] not in SINKS:
                return data["op"]
    return None


def embedding_roles(g: nx.DiGraph, forced: dict[str, str]) -> dict[str, Role]:
    """Embeddings looked up by a model input are vocab-parallel (``forced``: module -> why not).

    What the module does to the looked-up rows afterwards (a scale, a norm of its own) needs no
    rule: :class:`~autotp.styles.VocabParallelEmbedding` reduces the rows at the lookup, so the
    rest of the module reads whole rows."""
    roles = {}
    for name, data in g.nodes(data=True):
        if data["op"] != "embedding":
            continue
        weight = param_source(g, data["args"][0].name) if isinstance(data["args"][0], Ref) else None
        if weight is None:
            continue
        owner = data["module"]
        ids = data["args"][1].name
        if owner in forced:
            roles[owner] = Role("replicate", forced[owner])
        elif not owner or g.nodes[weight]["param"].rpartition(".")[2] != "weight":
            # (A tied table may carry another module's name; its leaf is still ``weight``.)
            roles[owner] = Role("replicate", f"looks up {g.nodes[weight]['param']}, not an embedding's "
                                "weight: the vocab-parallel style shards an nn.Embedding's table")
        elif not reads_model_input(g, ids):
            roles[owner] = Role("replicate", f"looked up by {ids}, computed in the model (positions), not input ids")
        elif (op := _other_table_read(g, weight, name, owner)) is not None:
            roles[owner] = Role("replicate", f"the module reads its table other than by the lookup ({op}); a "
                                "vocab-sharded table would give that read only this rank's rows")
        else:
            roles[owner] = Role("vocab_embedding", f"looked up by model input {ids}", (ids, "embedding", owner))
    return roles


def norm_roles(g: nx.DiGraph, flow: Flow, taken: set[str]) -> dict[str, Role]:
    """Parametrised non-Linear modules that read a shard: head-sharded or width-sharded norms."""
    roles, owners = {}, param_modules(g)
    for name, data in sorted(g.nodes(data=True), key=lambda item: item[1]["order"]):
        if data["kind"] != "call":
            continue
        for ref in refs(data["args"], data["kwargs"]):
            shard = flow.state.get(ref.name)
            if not isinstance(shard, Shard):
                continue
            for module in data["stack"]:
                if module in taken or module in roles or module in g.nodes[ref.name]["stack"]:
                    continue
                if module not in owners or not _params_meet_shard(g, flow, module):
                    continue
                dim = shard.dim - len(g.nodes[ref.name]["shape"])
                path = _describe(g, shard_path(g, flow, ref.name), module)
                if module in flow.width_norms:
                    roles[module] = Role("width_norm", "reduces over the sharded width; the statistic is all-reduced",
                                         path, shard_dim=dim)
                else:
                    roles[module] = Role("head_norm", f"reads a tensor sharded on dim {dim} and reduces over other dims",
                                         path, shard_dim=dim)
    return roles


def _params_meet_shard(g: nx.DiGraph, flow: Flow, module: str) -> bool:
    """Whether a parameter of ``module`` itself flows, inside ``module``, into a sharded value.

    Only then is its gradient a per-rank partial sum. A module that merely passes a shard to its
    children (an attention's compressor owning a bias added to replicated gates) needs no style:
    all-reducing a full gradient would multiply it by tp.
    """
    starts = [n for n, d in g.nodes(data=True) if d["kind"] == "param" and d["param"].rpartition(".")[0] == module]
    seen, todo = set(starts), list(starts)
    while todo:
        for succ in g.successors(todo.pop()):
            if succ in seen or module not in g.nodes[succ]["stack"]:
                continue
            if isinstance(flow.state.get(succ), (Shard, tuple)):
                return True
            seen.add(succ)
            todo.append(succ)
    return False


def assign_roles(g: nx.DiGraph, flow: Flow, dropped: dict[str, str],
                 forced: dict[str, str] | None = None) -> dict[str, Role]:
    """Every module's role (modules absent from the result run replicated with no style).

    Args:
        forced: embedding modules that must stay replicated (a tie conflict), with the reason.
    """
    roles = linear_roles(g, flow, dropped)
    roles.update(embedding_roles(g, forced or {}))
    roles.update(norm_roles(g, flow, set(roles)))
    roles.update(param_roles(g, flow, roles))
    roles.update(mixer_roles(g, flow))
    roles.update(broadcast_roles(g, flow, roles))
    return _with_raw_linears(roles, raw_linear_roles(g, flow))


def tied_embedding_modules(g: nx.DiGraph, conflicts: dict[str, str]) -> dict[str, str]:
    """Embedding modules sharing a weight with a conflicting Linear: module -> reason."""
    weights = {linear_weight(g, n): reason for n, reason in conflicts.items()}
    out = {}
    for name, data in g.nodes(data=True):
        if data["op"] == "embedding" and isinstance(data["args"][0], Ref):
            weight = param_source(g, data["args"][0].name)
            if weight in weights:
                out[data["module"]] = weights[weight]
    return out




def mutated_outputs(g: nx.DiGraph) -> set[str]:
    """Modules whose output the calling code modifies in place (``x *= scale``, ``out.add_(y)``).

    A style that returns its output local hands back ``DTensor.to_local()``, a view autograd forbids
    writing in place; those modules' styles return a copy instead (see ``Boundary(copy_output=True)``).

    >>> from autotp.synth.graph import add_node
    >>> g = nx.DiGraph()
    >>> _ = add_node(g, "e", "embedding", stack=("m", "m.embed"), module="m.embed")
    >>> _ = add_node(g, "s", "mul_", (Ref("e"), 8.0), stack=("m",), module="m")
    >>> sorted(mutated_outputs(g))
    ['m.embed']
    """
    found: set[str] = set()
    for name, data in g.nodes(data=True):
        op = data["op"]
        if data["kind"] != "call" or not op.endswith("_") or op.startswith("_") or not data["args"]:
            continue
        target = data["args"][0]
        while isinstance(target, Ref) and g.nodes[target.name]["op"] in ALIASING \
                and g.nodes[target.name]["stack"] == data["stack"]:
            target = g.nodes[target.name]["args"][0]
        if isinstance(target, Ref) and g.nodes[target.name]["kind"] == "call":
            found.update(set(g.nodes[target.name]["stack"]) - set(data["stack"]))
    return found
