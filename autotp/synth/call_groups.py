"""Layers of one structure that their stack calls differently are traced apart.

:func:`autotp.synth.trace.collapsed` traces one layer per structural group. That is right when every
layer of a group runs the same code, and wrong when the stack hands some layers a value it hands
others as ``None``: residual attention (layer ``i`` adds layer ``i - 1``'s pre-softmax scores), a
value residual (later layers mix the first layer's values into theirs), anything a layer returns
and the next receives. Traced from the first layer alone, the code that reads the handed-on value
is never seen: the plan for the later layers is a guess (a Linear only they call is never planned,
and a plan that crashed with "got mixed torch.Tensor and DTensor" was the result).

:func:`call_signatures` runs the model once on fake tensors, each layer stack cut to the first
entries of each structural group, and records, for every entry, which of its call's arguments are
tensors, which are ``None`` and which are other objects (no values, no shapes: a layer index passed
as an ``int`` does not split a group).
:func:`autotp.synth.trace.lockstep_groups` groups entries by structure and call together.
"""

from __future__ import annotations

import logging

import torch
from torch import nn
from torch.utils import _pytree as pytree

log = logging.getLogger(__name__)


def _leaf_kind(value) -> str:
    if isinstance(value, torch.Tensor):
        return "tensor"
    if value is None:
        return "none"
    return type(value).__name__


def call_signature(args: tuple, kwargs: dict) -> tuple:
    """The structure of one call: the pytree spec, each leaf a tensor / ``None`` / a type name.

    >>> call_signature((torch.ones(1), None), {}) == call_signature((torch.zeros(2), None), {})
    True
    >>> call_signature((torch.ones(1), None), {}) == call_signature((torch.ones(1), torch.ones(1)), {})
    False
    """
    leaves, spec = pytree.tree_flatten((args, dict(sorted(kwargs.items()))))
    return str(spec), tuple(_leaf_kind(leaf) for leaf in leaves)


# Entries of each structural group run by the fake forward: the first layers are where calls differ
# (the first layer gets no previous scores, no first values); the rest are taken to be called as the
# last of these. A stack of 80 layers costs 3 per group, not 80.
SAMPLED = 3


def call_signatures(model: nn.Module, example_inputs, stacks: dict[str, nn.Module]) -> dict[str, dict]:
    """For each stack in ``stacks`` (FQN -> container), ``{entry key: call signature}``, from one
    fake forward of the model with each structural group cut to its first :data:`SAMPLED` entries
    (first call of each); entries after those get the signature of the last one run. Empty when the
    forward cannot run on fake tensors: grouping then falls back to structure alone."""
    from autotp.synth.local_run import _fake_forward
    from autotp.synth.trace import LayerGroups, collapsed, example_args, lockstep_groups, stack_entries

    structural = lockstep_groups(stacks)
    found: dict[str, dict] = {name: {} for name in stacks}
    handles = []
    for name, stack in stacks.items():
        entries = dict(stack_entries(stack))
        for group in structural.get(name, []):
            for key in group[:SAMPLED]:
                if entries[key] is None:
                    continue

                def hook(module, args, kwargs, name=name, key=key):
                    found[name].setdefault(key, call_signature(args, kwargs))

                handles.append(entries[key].register_forward_pre_hook(hook, with_kwargs=True))
    order = {name: {key: i for i, (key, _) in enumerate(stack_entries(stack))} for name, stack in stacks.items()}
    # One group per sampled entry: collapsed() keeps the first entry of each group.
    sampled = LayerGroups({name: [[k] for k in sorted((k for g in groups for k in g[:SAMPLED]), key=order[name].get)]
                           for name, groups in structural.items()})
    try:
        args, kwargs = example_args(model, example_inputs)
        with collapsed(model, sampled):
            failed = _fake_forward(model, args, kwargs, real_values=False)
    except Exception as error:  # no inputs: the trace reports that itself
        failed = error
    finally:
        for handle in handles:
            handle.remove()
    if failed is not None:
        log.debug("call signatures of layer stacks unknown (%s): grouping by structure alone", failed)
        return {}
    for name, groups in structural.items():
        for group in groups:
            last = next((found[name][k] for k in reversed(group[:SAMPLED]) if k in found[name]), None)
            for key in group[SAMPLED:]:
                found[name][key] = last
    return found
