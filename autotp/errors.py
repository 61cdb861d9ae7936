"""The exceptions autotp raises: one small hierarchy rooted at :class:`AutoTPError`.

Every message names the module (FQN) it is about, what was found, what was required, and the fix.
"""

import math


class AutoTPError(Exception):
    """Base class of every error autotp raises on bad input or an unusable plan."""


class PlanError(AutoTPError):
    """A plan is malformed: a key matches no module, a style string is unknown, an import fails."""


class MeshError(AutoTPError):
    """The device mesh does not fit the model: wrong dimension, or sizes tp does not divide."""


class TraceError(AutoTPError):
    """torch.export could not trace the model, or the traced graph is not a language model."""


class VerificationError(AutoTPError):
    """The model or inputs cannot be verified (e.g. parameters on the meta device)."""


def working_tp_sizes(sizes, limit: int = 64) -> tuple[int, ...]:
    """tp sizes up to ``limit`` that divide every one of ``sizes``: the fix a MeshError suggests.

    >>> working_tp_sizes([8, 12])
    (1, 2, 4)
    """
    common = math.gcd(*sizes) if sizes else 1
    return tuple(t for t in range(1, limit + 1) if common % t == 0)


def one_line(error: BaseException, limit: int = 300) -> str:
    """``"TypeName: first line of the message"`` (cut at ``limit``), also for an empty message.

    >>> one_line(AssertionError())
    'AssertionError'
    >>> one_line(ValueError("bad width\\nmore detail"))
    'ValueError: bad width'
    """
    lines = str(error).strip().splitlines()
    return f"{type(error).__name__}: {lines[0][:limit]}" if lines else type(error).__name__
