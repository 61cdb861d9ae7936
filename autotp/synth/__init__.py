"""Plan synthesis: trace a model, find how shards flow through it, and write the TP plan.

The pipeline (:mod:`autotp.synth.pipeline`) is one :class:`Analysis` made by a constraint fixpoint
and then passed through a literal list of passes::

    program, groups = trace(model)            # torch.export, one block per distinct type
    g = build_graph(program)                   # networkx view of the program
    analysis = constraint_fixpoint(...)        # analyse (shard propagation) -> assign_roles ->
                                               # new constraints (foreign reads, tie conflicts,
                                               # fused outputs cut with global sizes), until none
    for step in POST_PASSES:                   # adapters, shard_counts, kv_replication, torch_attention,
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

from autotp.synth.api import Analysis, ExplainRecord, analyse_model, explain, synthesize
from autotp.synth.build import build_plan

__all__ = ["Analysis", "ExplainRecord", "analyse_model", "build_plan", "explain", "synthesize"]
