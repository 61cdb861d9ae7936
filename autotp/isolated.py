"""Run one verification in a child process, so that a crash of the simulated runtime is a result.

The simulated ranks of :func:`autotp.verify` live in torch's private ``LocalTensorMode``; when its
memory is corrupted (seen with a fake tensor a trace left in a recurrent block's state, now dropped
by :func:`autotp.verifier.clean_copy`) the process aborts (``malloc(): corrupted double-linked
list``) or runs on with bad numbers. :func:`~autotp.verifier.verify_isolated` runs the same check
in a fresh interpreter (``python -m autotp.isolated``, this module's :func:`_child`):
the model, plan and inputs go over by pickle, the :class:`~autotp.verifier.VerifyReport` comes back
the same way, and a child killed by a signal becomes a failed report that names the signal.

A fresh interpreter (not a fork) also means the parent's process group, threads and CUDA context
are left alone: the self-check of :func:`autotp.parallelize` uses it under a real process group.
"""

from __future__ import annotations

import pickle
import sys
from pathlib import Path

from autotp.errors import VerificationError, one_line
from autotp.verifier import crash_name, model_payload, verify, verify_isolated

__all__ = ["crash_name", "model_payload", "verify_isolated"]  # the parent's side, kept in autotp.verifier


def _child(source: str, result: str) -> None:
    """The child's side: load the payload, verify on simulated ranks, write the report."""
    data = pickle.loads(Path(source).read_bytes())
    kind, *rest = data["model"]
    if kind == "model":
        model = rest[0]
    else:
        from autotp.models import build_model  # local: imports transformers (a model sent as its config)

        config, dtype = rest
        model = build_model(config, device="cpu", **({"dtype": dtype} if dtype is not None else {}))
    try:
        outcome = ("report", verify(model, data["plan"], isolated=False, **data["options"]))
    except Exception as error:  # bad input (a plan key matching nothing): the parent raises it
        outcome = ("raised", error)
        try:
            pickle.dumps(error)
        except Exception:
            outcome = ("raised", VerificationError(f"the isolated verification raised {one_line(error)}"))
    Path(result).write_bytes(pickle.dumps(outcome))


if __name__ == "__main__":
    _child(sys.argv[1], sys.argv[2])
