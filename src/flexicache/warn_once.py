"""Warnings a process gives once: a hint due at every decode step would otherwise drown the output.

:func:`warn_once` keys each warning by its message; tests reset :data:`GIVEN` for a fresh process's behaviour.
"""

from __future__ import annotations

import warnings

GIVEN: set[str] = set()  # the messages given so far in this process


def warn_once(message: str, category: type[Warning], stacklevel: int) -> None:
    """``warnings.warn(message, category)`` the first time this process sees ``message`` (``stacklevel`` as for
    ``warnings.warn``, counted from the caller of this function)."""
    if message not in GIVEN:
        GIVEN.add(message)
        warnings.warn(message, category, stacklevel=stacklevel + 1)
