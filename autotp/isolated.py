"""Run one verification in a child process, so that a crash of the simulated runtime is a result.

The simulated ranks of :func:`autotp.verify` live in torch's private ``LocalTensorMode``; when its
memory is corrupted (seen with a fake tensor a trace left in a recurrent block's state, now dropped
by :func:`autotp.verifier.clean_copy`) the process aborts (``malloc(): corrupted double-linked
list``) or runs on with bad numbers. :func:`verify_isolated` runs the same check in a fresh
interpreter (``python -m autotp.isolated``):
the model, plan and inputs go over by pickle, the :class:`~autotp.verifier.VerifyReport` comes back
the same way, and a child killed by a signal becomes a failed report that names the signal.

A fresh interpreter (not a fork) also means the parent's process group, threads and CUDA context
are left alone: the self-check of :func:`autotp.parallelize` uses it under a real process group.
"""

from __future__ import annotations

import logging
import os
import pickle
import signal
import subprocess
import sys
import tempfile
from pathlib import Path

from torch import nn

from autotp.errors import VerificationError, one_line

log = logging.getLogger(__name__)

# Lines of the child's stderr kept in the report of a crash: the runtime's last words.
_STDERR_TAIL = 3


def crash_name(returncode: int) -> str:
    """``"SIGABRT"`` for a child killed by a signal (a negative return code), else ``"exit code N"``.

    >>> crash_name(-6), crash_name(3)
    ('SIGABRT', 'exit code 3')
    """
    if returncode < 0:
        try:
            return signal.Signals(-returncode).name
        except ValueError:
            return f"signal {-returncode}"
    return f"exit code {returncode}"


def model_payload(model: nn.Module) -> tuple:
    """What the child needs to have ``model``: ``("model", model)`` when it pickles, else
    ``("config", config, dtype)`` to rebuild it from its transformers config (fresh weights:
    the check then compares the rebuilt model with its own unsharded copy).

    Raises:
        VerificationError: the model neither pickles nor has a transformers config.
    """
    from autotp.verifier import clean_copy

    try:
        model = clean_copy(model)  # without a trace's leftover fake tensors, which do not pickle
        pickle.dumps(model)
        return ("model", model)
    except Exception as error:  # local classes, lambdas in hooks, open handles
        config = getattr(model, "config", None)
        if config is None or not hasattr(config, "model_type"):
            raise VerificationError(
                f"{type(model).__name__}: an isolated verification sends the model to a child process by "
                f"pickle, which failed ({type(error).__name__}: {error}); define the class at module level "
                "(importable by the child), or call verify(..., isolated=False)."
            ) from error
        log.info("%s does not pickle (%s); the isolated check rebuilds it from its config",
                 type(model).__name__, type(error).__name__)
        dtype = next((p.dtype for p in model.parameters()), None)
        return ("config", config, dtype)


def verify_isolated(model: nn.Module, plan, *, timeout: float = 600.0, **options):
    """:func:`autotp.verify` in a fresh child interpreter; a crash or a hang is a failed report.

    Args:
        model: the model (pickled to the child; see :func:`model_payload`).
        plan: the plan; it must pickle (styles defined at module level do).
        timeout: seconds before the child is killed and the run reported as timed out.
        **options: the keyword arguments of :func:`autotp.verify` (``tp_size``, ``inputs``, ...).

    Returns:
        The child's :class:`~autotp.verifier.VerifyReport`, or a failed one whose ``crash`` names
        the signal (``"SIGABRT"``), the exit code or the timeout, and whose ``error`` quotes the
        child's last stderr lines.

    Raises:
        VerificationError: the model or the plan cannot be sent to the child.
    """
    from autotp.verifier import DEFAULT_TOLERANCE, VerifyReport

    try:
        payload = pickle.dumps({"model": model_payload(model), "plan": plan, "options": options})
    except VerificationError:
        raise
    except Exception as error:
        raise VerificationError(
            f"an isolated verification sends the plan to a child process by pickle, which failed "
            f"({type(error).__name__}: {error}); use styles defined at module level, or isolated=False."
        ) from error
    with tempfile.TemporaryDirectory(prefix="autotp-verify-") as tmp:
        source, result, errors = Path(tmp, "in.pkl"), Path(tmp, "out.pkl"), Path(tmp, "stderr.txt")
        source.write_bytes(payload)
        crash = _run_child(source, result, errors, timeout)
        if crash is None and result.is_file():
            kind, value = pickle.loads(result.read_bytes())
            if kind == "raised":  # as verify would have raised in this process
                raise value
            return value
        tail = _tail(errors)
    crash = crash or "exit without a report"
    tp_size = options.get("tp_size", 2)
    tolerance = options.get("tolerance", DEFAULT_TOLERANCE)
    message = f"the verification worker died ({crash})" + (f": {tail}" if tail else "")
    return VerifyReport(tp_size=tp_size, tolerance=tolerance, logits_max_abs_diff=[float("inf")],
                        error=message, crash=crash)


def _run_child(source: Path, result: Path, errors: Path, timeout: float) -> str | None:
    """Run the child on ``source``; None when it exited cleanly, else how it died."""
    env = dict(os.environ)
    # The child must import what the parent imported (test modules, a user's model classes).
    env["PYTHONPATH"] = os.pathsep.join(p for p in [*sys.path, env.get("PYTHONPATH", "")] if p)
    command = [sys.executable, "-m", "autotp.isolated", str(source), str(result)]
    with open(errors, "wb") as stderr:
        try:
            done = subprocess.run(command, stdin=subprocess.DEVNULL, stdout=stderr, stderr=stderr,
                                  env=env, timeout=timeout, check=False)
        except subprocess.TimeoutExpired:  # run() has killed the child
            return f"timeout after {timeout:g} s"
    return None if done.returncode == 0 else crash_name(done.returncode)


def _tail(path: Path) -> str:
    """The last few non-empty lines of the child's output, joined with ' | '."""
    try:
        lines = [line.strip() for line in path.read_text(errors="replace").splitlines() if line.strip()]
    except OSError:
        return ""
    return " | ".join(lines[-_STDERR_TAIL:])[-600:]


def _child(source: str, result: str) -> None:
    """The child's side: load the payload, verify on simulated ranks, write the report."""
    from autotp.verifier import verify

    data = pickle.loads(Path(source).read_bytes())
    kind, *rest = data["model"]
    if kind == "model":
        model = rest[0]
    else:
        from autotp.models import build_model

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
