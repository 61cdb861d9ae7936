"""The exceptions autotp raises: one small hierarchy rooted at :class:`AutoTPError`.

Every message names the module (FQN) it is about, what was found, what was required, and the fix.
"""

import math


class AutoTPError(Exception):
    """Base class of every error autotp raises on bad input or an unusable plan.

    Raised with a message, or with its parts as fields (the message is then made from them, as
    ``"module: found (required); fix"``), so callers such as :func:`autotp.check_plan` read the
    parts without parsing text.

    Attributes:
        module: the module (FQN or class name) the error is about, or None.
        found: what was found there.
        required: what was required instead, or None.
        fix: what to do about it.
        tp_sizes: the tp sizes that would clear this error when it is about tp (``()`` otherwise),
            as data: the ``fix`` text names them for people.

    >>> error = AutoTPError(module="layers.0.attn", found="12 heads", required="tp divides them",
    ...                     fix="use tp in (1, 2, 3, 4, 6, 12)")
    >>> str(error)
    'layers.0.attn: 12 heads (tp divides them); use tp in (1, 2, 3, 4, 6, 12)'
    >>> error.fix
    'use tp in (1, 2, 3, 4, 6, 12)'
    """

    def __init__(self, message: str = "", *, module: str | None = None, found: str | None = None,
                 required: str | None = None, fix: str | None = None, tp_sizes: tuple[int, ...] = ()):
        self.module, self.found, self.required, self.fix = module, found, required, fix
        self.tp_sizes = tuple(tp_sizes)
        if not message:
            message = f"{module}: {found}" if module else str(found or "")
            message += f" ({required})" if required else ""
            message += f"; {fix}" if fix else ""
        super().__init__(message)


class PlanError(AutoTPError):
    """A plan is malformed: a key matches no module, a style string is unknown, an import fails."""


class MeshError(AutoTPError):
    """The device mesh does not fit the model: wrong dimension, or sizes tp does not divide."""


class TraceError(AutoTPError):
    """torch.export could not trace the model, or the traced graph is not a language model."""


class VerificationError(AutoTPError):
    """The model or inputs cannot be verified (parameters on the meta device), or a plan failed
    its numerical check (``parameter`` differs by ``difference`` where ``allowed`` was the bound).

    Attributes:
        parameter: the first differing parameter (``"logits"`` for the output), or None.
        difference: its max abs difference from the unsharded model, or None.
        allowed: the tolerance it was held to, or None.
        crash: how the verification worker died (``"SIGABRT"``, ``"exit code 3"``), or None.
        report: the :class:`autotp.verifier.VerifyReport`, when one was measured.
    """

    def __init__(self, message: str, *, parameter: str | None = None, difference: float | None = None,
                 allowed: float | None = None, crash: str | None = None, report=None):
        super().__init__(message)
        self.parameter = parameter
        self.difference = difference
        self.allowed = allowed
        self.crash = crash
        self.report = report


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


class NoPlanError(PlanError, MeshError):
    """Every plan source was rejected for this model and tp size.

    Also a :class:`MeshError`: most often the tp size is one the model cannot be split by (every
    source's plan cuts some heads), and callers that catch ``MeshError`` for that keep working.

    The message lists every source's reason; the parts (``module``, ``found``, ``fix``) say it in one
    short line, with one list of tp sizes to try (what the ``autotp`` command prints).

    Attributes:
        skipped: ``(source, reason)`` for each source tried, in the order tried.
        tp_sizes: tp sizes that clear the sources' first obstacles (``()``: none is about tp).
    """

    def __init__(self, message: str, *, skipped: list[tuple[str, str]] | tuple = (),
                 tp_sizes: tuple[int, ...] = (), **parts):
        super().__init__(message, tp_sizes=tp_sizes, **parts)
        self.skipped = list(skipped)



class WholeAttentionWarning(UserWarning):
    """A synthesized plan keeps an attention whole (its projections replicated on every rank):
    the message names the module and why. The plan is right, at up to ``tp`` times the memory."""
