"""Plan synthesis: trace a model, find how shards flow through it, and write the TP plan.

The pipeline is a literal sequence of passes::

    program, groups = trace(model)            # torch.export, one block per distinct type
    g = build_graph(program)                   # networkx view of the program
    flow, dropped = analyse(g)                 # shard propagation to a fixpoint
    roles = assign_roles(g, flow, dropped)     # one Role (with its reason) per module
    plan = build_plan(roles, groups)           # one function maps roles to styles
"""

from __future__ import annotations

from autotp.synth.api import Analysis, ExplainRecord, analyse_model, explain, synthesize

__all__ = ["Analysis", "ExplainRecord", "analyse_model", "explain", "synthesize"]
