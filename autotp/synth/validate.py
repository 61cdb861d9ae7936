"""Checks that a model is something synthesis can plan, with errors that say what to do instead."""

from __future__ import annotations

import networkx as nx
from torch import nn

from autotp.errors import TraceError


def require_language_model(model: nn.Module, g: nx.DiGraph) -> None:
    """Raise unless the traced forward looks up token ids in an embedding table.

    Raises:
        TraceError: no embedding lookup of the inputs (an image or audio model, say).
    """
    if not any(data.get("op") == "embedding" for _, data in g.nodes(data=True)):
        raise TraceError(
            f"{type(model).__name__}: the traced forward has no embedding lookup of token ids, so it is "
            "not a language model autotp can plan. Pass example_inputs with the token ids if the model "
            "takes them, or write the plan by hand (tp_shard_plan=...)."
        )


def failing_module(model: nn.Module, error: BaseException) -> str | None:
    """FQN of the innermost module of ``model`` whose code was running when ``error`` was raised
    (its forward, or a method or decorator wrapper with the module as ``self``)."""
    names = {id(module): name for name, module in model.named_modules()}
    found = None
    tb = error.__traceback__
    while tb is not None:
        owner = tb.tb_frame.f_locals.get("self")
        if id(owner) in names and not tb.tb_frame.f_code.co_name.startswith("_"):
            found = names[id(owner)] or "<root>"
        tb = tb.tb_next
    if found is None and error.__cause__ is not None and error.__cause__ is not error:
        return failing_module(model, error.__cause__)
    return found
