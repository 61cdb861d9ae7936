"""The exceptions autotp raises: one small hierarchy rooted at :class:`AutoTPError`.

Every message names the module (FQN) it is about, what was found, what was required, and the fix.
"""


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
