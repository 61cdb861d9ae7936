"""Row Linears whose partial sums one module adds up and returns: reduced once, at its output.

A MoE written as a loop over ``nn.Linear`` experts (``for i, expert in enumerate(self.experts): tok,
k = torch.where(sel == i); out.index_add_(0, tok, w[tok, k, None] * expert(x[tok]))``) shards each
expert as a column / row pair. Each row reducing its own output costs one collective per expert and
``top_k`` times the bytes of the block's output. The sum over experts is linear in their outputs, so
each rank may add up its partial sums and the block reduce the result once
(:class:`~autotp.styles.PartialSumBlock`).

The backward is then partial everywhere inside the block: a backward is linear in its incoming
gradient, so the routing weights (multiplied by partial outputs), the router computing them, and the
columns' inputs all get per-rank partial gradients. The block reduces its inputs' gradient once at
entry, the columns hand theirs back unreduced, and the parameters of whole modules inside it are
all-reduced. One reduction each way per block, as for grouped experts.

Sound only where (:func:`_refusal`): every op between the rows and the block's output is linear in
the partial sums (:func:`~autotp.synth.experts.partial_sum_reach`: scaling by replicated values,
gathers and scatter-adds of rows, sums of partial sums, starting from zeros), the block's one output
is that sum and no partial value leaves it otherwise, and inside it there are only these rows,
columns reading replicated values, and modules kept whole (no other role, no parameter of the block
itself, no bias on a row). Anything else keeps each row's own reduction.
"""

from __future__ import annotations

import logging
from dataclasses import replace

import networkx as nx

from autotp import styles
from autotp.synth.flow import Flow

from autotp.synth.queries import is_linear, module_of
from autotp.synth.experts import partial_sum_reach
from autotp.synth.graph import Ref
from autotp.synth.roles import Role, kind_of
from autotp.synth.sequence import module_outputs
from autotp.synth.shared import shared_columns
from autotp.synth.stages import Analysis, post_pass, role_kind


# The role kind this idiom assigns (stages.role_kind): what it means and its style.
PARTIAL_SUM_BLOCK = role_kind(
    "partial_sum_block",
    "module adding up row Linears' partial sums (a loop over nn.Linear experts): reduced once at its "
    "output, its input gradient once at entry",
    lambda role, lp: styles.PartialSumBlock(columns=role.names, sequence_parallel=role.seq_output))

log = logging.getLogger(__name__)

# Roles a module inside such a block may have (besides its rows).
_INSIDE = frozenset({"column", "packed_column", "replicate", "shared_entry", "seq_gather"})
# Roles whose module reads its input whole and is sharded column-wise: their input gradient is partial.
_COLUMNS = frozenset({"column", "packed_column"})


def partial_sum_blocks(g: nx.DiGraph, flow: Flow, roles: dict[str, Role], *,
                       sequence_parallel: bool) -> dict[str, Role]:
    """Roles for each block whose rows' partial sums it adds up and returns (see the module docstring).

    Returns:
        New roles: the block (``partial_sum_block``), its rows (``partial_local``), the modules with
        parameters kept whole inside it (``partial_grad_module``); other roles inside it (a gather, a
        shared entry) are set to ``replicate``: the block's style takes their place. A module above
        the block that shares the block's columns' input loses those columns (None: no role left;
        :func:`_outer_shares`).
    """
    rows = [n for n, d in g.nodes(data=True) if d["kind"] == "call" and is_linear(g, n)
            and kind_of(roles, module_of(g, n)) == "row"]
    blocks: dict[str, list[str]] = {}
    for row in rows:
        for container in reversed(g.nodes[row]["stack"][:-1]):
            inside = [r for r in rows if container in g.nodes[r]["stack"]]
            if len(inside) > 1:
                blocks.setdefault(container, inside)
                break
    found: dict[str, Role] = {}
    for block, inside in sorted(blocks.items()):
        modules = _inside_modules(g, block)
        reason = _refusal(g, roles, block, inside, modules)
        if reason:
            log.debug("partial sums: %s reduces each row (%s)", block, reason)
            continue
        columns = sorted(m for m in modules if kind_of(roles, m) in _COLUMNS)
        names = tuple(m[len(block) + 1:] for m in columns)
        found[block] = Role("partial_sum_block", f"adds up the partial sums of {len(inside)} row Linears and "
                            "returns them: reduced once at its output, its input gradient once at entry",
                            (block, *sorted(module_of(g, r) for r in inside)), names=names,
                            seq_input=sequence_parallel, seq_output=sequence_parallel)
        for row in inside:
            module = module_of(g, row)
            found[module] = replace(roles[module], partial_local=True, reason=roles[module].reason
                                    + f"; its partial sum is added up by {block} and reduced there once")
        for module in modules:
            kind = kind_of(roles, module)
            if kind in ("shared_entry", "seq_gather"):
                found[module] = Role("replicate", f"inside {block}, whose style takes its inputs", (block, module))
            elif kind in (None, "replicate") and _owns_params(g, module):
                found[module] = Role("partial_grad_module", f"kept whole inside {block}: runs on replicated "
                                     "values with partial gradients, its parameters' gradients all-reduced",
                                     (block, module))
    found.update(_outer_shares(roles, set(blocks) & set(found)))
    return found


def _outer_shares(roles: dict[str, Role], blocks: set[str]) -> dict[str, Role | None]:
    """Shares of column inputs made by modules above the partial-sum ``blocks``, without the
    blocks' columns.

    The block's style shares its columns' input itself, handing back each rank's partial gradient,
    which the block reduces once at entry. A shared entry chosen above the block (the block's own
    role, a gather at entry, left no room for its hooks when the shares were found) would wrap the
    same input first and all-reduce the columns' gradient, which the block's entry then reduces
    again: the columns' share of the input gradient counted tp times, so the norm before the block
    gets a wrong gradient though the logits are exact. Each column is shared by one style: the block's.

    Returns:
        The changed roles: fewer shared columns, or None where a ``shared_entry`` keeps none.
    """
    found: dict[str, Role | None] = {}
    for scope, role in roles.items():
        if any(scope == b or scope.startswith(b + ".") for b in blocks):
            continue  # the block itself, or a module inside it: its role is the block's to set
        columns = shared_columns(role) if role is not None else ()
        left = tuple(c for c in columns if not any(f"{scope}.{c}".startswith(b + ".") for b in blocks))
        if len(left) == len(columns):
            continue
        log.info("partial sums: %s no longer shares %s (its partial-sum block shares them)", scope,
                 ", ".join(c for c in columns if c not in left))
        if role.kind == "shared_entry":
            found[scope] = replace(role, names=left) if len(left) > 1 else None
        else:
            found[scope] = replace(role, shared_columns=left)
    return found


def _refusal(g: nx.DiGraph, roles: dict[str, Role], block: str, rows: list[str], modules: set[str]) -> str | None:
    """Why ``block`` cannot add up ``rows``' partial sums itself (None if it can); ``modules``: those
    that run inside it."""
    if not block:
        return "the model's root"
    for row in rows:
        role, args = roles[module_of(g, row)], g.nodes[row]["args"]
        if role.partial_output or role.weight_in_out or role.seq_output or (len(args) > 2 and isinstance(args[2], Ref)):
            return f"{module_of(g, row)} is no plain row (a bias, a layout of its own)"
    reached, once, reason = partial_sum_reach(g, rows, block)
    if reason or once:
        return reason or "per-expert biases"
    outputs, _ = module_outputs(g, block)
    if len(outputs) != 1 or outputs[0] not in reached:
        return "its output is not one partial sum"
    leaks = [n for n in reached - set(outputs) if any(block not in g.nodes[s]["stack"] for s in g.successors(n))]
    if leaks:
        return f"a partial sum leaves it at {leaks[0]}"
    row_modules = {module_of(g, r) for r in rows}
    for module in modules - row_modules:
        kind = kind_of(roles, module)
        if kind not in (None, *_INSIDE):
            return f"{module} has a role of its own ({kind})"
    if _owns_params(g, block):
        return "it reads parameters of its own"
    return None


def _inside_modules(g: nx.DiGraph, block: str) -> set[str]:
    """Modules that run inside ``block``."""
    return {m for _, d in g.nodes(data=True) if block in d["stack"]
            for m in d["stack"][d["stack"].index(block) + 1:]}


def _owns_params(g: nx.DiGraph, module: str) -> bool:
    """Whether ``module``'s forward reads a parameter it owns itself (not a child's)."""
    return any(d["kind"] == "param" and d["param"].rpartition(".")[0] == module and any(g.successors(n))
               for n, d in g.nodes(data=True))


@post_pass(order=70)
def partial_sums(a: Analysis) -> Analysis:
    """Modules adding up row Linears' partial sums (a loop over ``nn.Linear`` experts) reduce them once."""
    found = partial_sum_blocks(a.graph, a.flow, a.roles, sequence_parallel=a.sequence_parallel)
    return replace(a, roles={m: r for m, r in {**a.roles, **found}.items() if r is not None})
