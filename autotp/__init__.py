"""autotp: tensor-parallel plans for PyTorch language models, synthesized and verified.

The API:

- :func:`get_plan` chooses a plan (explicit, handwritten, transformers', or synthesized).
- :func:`parallelize` shards a model over a tp mesh with it.
- :func:`synthesize` / :func:`explain` build a plan from the model's dataflow graph.
- :func:`verify` checks a plan numerically against the unsharded model on simulated ranks.
"""

from autotp.apply import parallelize, validate_tp_mesh
from autotp.check import Finding, check_plan
from autotp.errors import AutoTPError
from autotp.selection import PlanChoice, get_plan
from autotp.verifier import VerifyReport, verify


def synthesize(model, **kwargs):
    """Synthesize a plan for ``model`` from its dataflow graph; see :func:`autotp.synth.synthesize`."""
    from autotp.synth import synthesize as _synthesize

    return _synthesize(model, **kwargs)


def verify_multiprocess(model, plan, **kwargs):
    """Verify ``plan`` on real gloo processes; see :func:`autotp.multiprocess.verify_multiprocess`."""
    from autotp.multiprocess import verify_multiprocess as _verify_multiprocess

    return _verify_multiprocess(model, plan, **kwargs)


def explain(model, **kwargs):
    """Per-module styles of the synthesized plan with their graph evidence; see :mod:`autotp.synth`."""
    from autotp.synth import explain as _explain

    return _explain(model, **kwargs)


def fsdp2_strategy_parallelize(model, device_mesh, **kwargs):
    """TP (plan from :func:`get_plan`) then FSDP2; see :func:`autotp.training.fsdp2_strategy_parallelize`."""
    from autotp.training import fsdp2_strategy_parallelize as _fsdp2

    return _fsdp2(model, device_mesh, **kwargs)


__all__ = [
    "AutoTPError",
    "Finding",
    "check_plan",
    "fsdp2_strategy_parallelize",
    "PlanChoice",
    "VerifyReport",
    "explain",
    "get_plan",
    "parallelize",
    "synthesize",
    "validate_tp_mesh",
    "verify",
    "verify_multiprocess",
]
