"""References between graph nodes: the one type the graph and the op rules share (a leaf module,
so that :mod:`autotp.synth.graph` can read the op tables of :mod:`autotp.synth.ops`)."""

from __future__ import annotations

from typing import NamedTuple


class Ref(NamedTuple):
    """A reference to another graph node inside ``args`` / ``kwargs``."""

    name: str


def refs(args, kwargs=None):
    """Every :class:`Ref` in ``args`` and ``kwargs``, in argument order (lists included)."""
    found = []
    for value in list(args) + list((kwargs or {}).values()):
        if isinstance(value, Ref):
            found.append(value)
        elif isinstance(value, (list, tuple)):
            found.extend(v for v in value if isinstance(v, Ref))
    return found
