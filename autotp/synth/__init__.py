"""Plan synthesis: trace a model, find how shards flow through it, and write the TP plan.

The pipeline (:mod:`autotp.synth.pipeline`) is one :class:`Analysis` made by a constraint fixpoint
and then passed through the post-passes, in the order each registered with
(:func:`~autotp.synth.stages.post_pass`: the idioms' modules register theirs)::

    program, groups = trace(model)            # torch.export, one block per distinct type
    g = build_graph(program)                   # networkx view of the program
    analysis = constraint_fixpoint(...)        # analyse (shard propagation) -> assign_roles ->
                                               # new constraints (foreign reads, tie conflicts,
                                               # fused outputs cut with global sizes), until none
    for step in post_passes():                 # adapters, shard_counts, kv_replication, torch_attention,
        analysis = step(analysis)              # sequence_parallel, shared_inputs, partial_sums,
                                               # whole_fronts, mixed_column_inputs,
                                               # width_statistics, sliced_entries,
                                               # dtensor_region_modules,
                                               # region_parallel_blocks, divisibility,
                                               # owned_outputs, untraced_linears,
                                               # untraced_siblings
    plan = build_plan(analysis.roles, groups)  # one table maps role kinds to styles

``synthesize``, ``explain``, ``check_plan`` (``analysis=``) and the CLI share one Analysis.
"""

from __future__ import annotations

import importlib

from autotp.synth.api import Analysis, ExplainRecord, analyse_model, explain
from autotp.synth.build import build_plan

__all__ = ["Analysis", "ExplainRecord", "analyse_model", "build_plan", "explain", "synthesize"]

# ``synthesize`` checks its plan numerically (``verify=True``, and always after a trace through
# value-dependent branches), which the verifier above synth does: it is :func:`autotp.synthesize`
# from the facade, imported on first use (PEP 562) so that no synth module imports upward.
_EXPORTS = {"synthesize": "autotp.facade"}


def __getattr__(name: str):
    """Import a name of :data:`_EXPORTS` from its module on first access, and keep it here."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'autotp.synth' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
