"""Plan synthesis: trace a model, find how shards flow through it, and write the TP plan.

The pipeline is a literal sequence of passes::

    program, groups = trace(model)            # torch.export, one block per distinct type
    g = build_graph(program)                   # networkx view of the program
    flow, dropped = analyse(g)                 # shard propagation to a fixpoint
    roles = assign_roles(g, flow, dropped)     # one Role (with its reason) per module
    local = localize(model, ..., g, flow, roles, tp)  # fused outputs cut with global sizes:
                                               # ShardCounts names, or keep the Linear whole
    roles |= replicate_kv(...)                 # tp > kv heads: ReplicatedKVColwise + KVHeadCounts
    roles = sequence_parallel_roles(...)       # SP only
    plan = build_plan(roles, groups)           # one function maps roles to styles
"""

from __future__ import annotations

from autotp.synth.api import Analysis, ExplainRecord, analyse_model, explain, synthesize
from autotp.synth.build import build_plan

__all__ = ["Analysis", "ExplainRecord", "analyse_model", "build_plan", "explain", "synthesize"]
