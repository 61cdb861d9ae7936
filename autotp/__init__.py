"""autotp: tensor-parallel plans for PyTorch language models, synthesized and verified.

The API:

- :func:`get_plan` chooses a plan (explicit, handwritten, transformers', or synthesized), skipping
  a source whose plan the checker rejects.
- :func:`parallelize` shards a model over a tp mesh with it; :func:`fsdp2_strategy_parallelize`
  adds FSDP2 on a 2-D mesh.
- :func:`synthesize` / :func:`explain` build a plan from the model's dataflow graph.
- :func:`from_pretrained` loads a saved checkpoint straight into the plan, each rank reading its shards.
- :func:`check_plan` finds what makes a plan wrong, statically.
- :func:`verify` checks a plan numerically against the unsharded model on simulated ranks;
  :func:`verify_multiprocess` does it on real gloo processes.

Each name is imported from its module on first use (PEP 562), so ``import autotp`` (and the
``autotp`` command's ``--help``) does not load torch; ``autotp.synthesize`` *is*
:func:`autotp.facade.synthesize` (as is ``autotp.synth.synthesize``), so ``help()`` and
``inspect.signature`` show its keywords.
"""

from __future__ import annotations

import importlib
from typing import TYPE_CHECKING

# Exported name -> the module defining it.
_EXPORTS = {
    "AutoTPError": "autotp.errors",
    "Finding": "autotp.check",
    "check_plan": "autotp.check",
    "explain": "autotp.synth",
    "from_pretrained": "autotp.loading",
    "fsdp2_strategy_parallelize": "autotp.training",
    "get_plan": "autotp.selection",
    "parallelize": "autotp.facade",
    "PlanChoice": "autotp.selection",
    "synthesize": "autotp.facade",
    "validate_tp_mesh": "autotp.apply",
    "verify": "autotp.verifier",
    "verify_multiprocess": "autotp.multiprocess",
    "VerifyReport": "autotp.verifier",
}

__all__ = [
    "AutoTPError",
    "Finding",
    "PlanChoice",
    "VerifyReport",
    "check_plan",
    "explain",
    "from_pretrained",
    "fsdp2_strategy_parallelize",
    "get_plan",
    "parallelize",
    "synthesize",
    "validate_tp_mesh",
    "verify",
    "verify_multiprocess",
]

if TYPE_CHECKING:  # for type checkers and IDEs: the same names, imported eagerly
    from autotp.apply import validate_tp_mesh
    from autotp.check import Finding, check_plan
    from autotp.errors import AutoTPError
    from autotp.facade import parallelize, synthesize
    from autotp.loading import from_pretrained
    from autotp.multiprocess import verify_multiprocess
    from autotp.selection import PlanChoice, get_plan
    from autotp.synth import explain
    from autotp.training import fsdp2_strategy_parallelize
    from autotp.verifier import VerifyReport, verify


def __getattr__(name: str):
    """Import an exported name from its module on first access, and keep it here."""
    if name not in _EXPORTS:
        raise AttributeError(f"module 'autotp' has no attribute {name!r}")
    value = getattr(importlib.import_module(_EXPORTS[name]), name)
    globals()[name] = value
    return value


def __dir__() -> list[str]:
    return sorted({*globals(), *_EXPORTS})
