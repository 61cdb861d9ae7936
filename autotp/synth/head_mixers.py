"""Modules that mix the heads: run whole between a gather of their input and a slice of their output.

Talking heads mix the attention's heads with 1x1 convolutions over the scores ``(b, heads, i, j)``,
before the softmax and after it (``Conv2d(heads, heads, 1)``). Each output head reads every input
head, so no rank can compute its heads from its own: the convolution's input is all-gathered on the
heads, the convolution runs whole (its weight whole on every rank), and each rank keeps its heads of
the output (:func:`mixer_style`: ``PrepareModuleInputOutput``, input ``Shard(dim) -> Replicate()``,
output ``Replicate() -> Shard(dim)``). Everything around the mixer stays sharded by heads: the
softmax and masks between the two convolutions, the values, the output projection.

Exact both ways: the forward computes on the whole tensor, identical on every rank; in the backward
the slice's gradient is all-gathered (each rank's heads), so the convolution's input and weight
gradients are whole and identical on every rank, and the gather's backward takes this rank's heads
of the input gradient. The weight needs no reduction. Cost: one all-gather of the scores per mixer
in each direction, ``b x heads x i x j`` elements (the sequence squared), and the convolution
computed on every rank; ``explain`` says so.

Only where the mixer is a module of its own: an op whose module runs that op alone on a value
made outside it, keeps the shape of its input, and reads parameters of its own read nowhere else
(:func:`mixer_module`). Head mixing in a module's own code (``einsum`` with a ``(heads, heads)``
parameter) has no boundary to gather and slice at: it keeps the attention whole, as before.
"""

from __future__ import annotations

import networkx as nx
from torch.distributed.tensor import Replicate, Shard
from torch.distributed.tensor.parallel import PrepareModuleInputOutput

from autotp.synth.graph import Ref, refs
from autotp.synth.ops import SINKS
from autotp.synth.roles import Role
from autotp.synth.stages import role_kind


# The role kind this idiom assigns (stages.role_kind): what it means and its style.
HEAD_MIXER = role_kind(
    "head_mixer",
    "module mixing the sharded heads: input all-gathered, run whole, output sliced to this rank's heads",
    lambda role, lp: mixer_style(role))


def mixer_module(g: nx.DiGraph, name: str, src: str) -> str | None:
    """The module that op ``name`` (reading the sharded ``src``) is all of, if it can run whole
    between a gather and a slice: it runs ``name`` alone, a 1x1 convolution on a 4-D input (scores
    ``(b, heads, i, j)``), ``src`` is made outside it, the output has the input's shape, and every
    parameter ``name`` reads is the module's own and read only there. None otherwise."""
    data = g.nodes[name]
    module = data["module"]
    if not module or module in g.nodes[src]["stack"] or data["shape"] != g.nodes[src]["shape"]:
        return None
    # Pointwise over scores (b, heads, i, j): a 1x1 kernel on a 4-D input. A channel-mixing conv
    # over features (b, d, t) would gather activations as wide as the model: kept whole, as before.
    weight = data["args"][1] if len(data["args"]) > 1 else None
    shape = g.nodes[weight.name]["shape"] if isinstance(weight, Ref) else None
    if len(data["shape"] or ()) != 4 or not shape or len(shape) != 4 or tuple(shape[2:]) != (1, 1):
        return None
    own = [n for n, d in g.nodes(data=True) if d["kind"] == "call" and module in d["stack"] and d["op"] not in SINKS]
    if own != [name]:
        return None
    for ref in refs(data["args"], data["kwargs"]):
        if ref.name == src:
            continue
        param = g.nodes[ref.name]
        if param["kind"] != "param" or not param["param"].startswith(module + "."):
            return None
        if sum(1 for s in g.successors(ref.name) if g.nodes[s]["op"] not in SINKS) != 1:
            return None
    return module


def mixer_roles(g: nx.DiGraph, flow) -> dict[str, Role]:
    """``head_mixer`` roles for the modules in ``flow.mixers`` whose shard every origin kept."""
    out = {}
    for module, (dim, origins) in sorted(flow.mixers.items()):
        if any(o in flow.broken for o in origins):
            continue
        out[module] = Role("head_mixer", "mixes the sharded heads: its input is all-gathered on the heads, it runs "
                           "whole (weight whole on every rank), and each rank keeps its heads of the output "
                           "(one all-gather of its input forward and of its output's gradient backward)",
                           (module,), shard_dim=dim)
    return out


def mixer_style(role: Role) -> PrepareModuleInputOutput | None:
    """Gather the input on the heads, slice the output back to this rank's heads."""
    if role.shard_dim is None:
        return None  # a role without the heads' dim (only the pass above makes these): nothing to do
    return PrepareModuleInputOutput(input_layouts=Shard(role.shard_dim), desired_input_layouts=Replicate(),
                                    use_local_input=True, output_layouts=Replicate(),
                                    desired_output_layouts=Shard(role.shard_dim), use_local_output=True)
