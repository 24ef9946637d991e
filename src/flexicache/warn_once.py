"""Warnings a process gives once: a hint due at every decode step would otherwise drown the output.

:func:`warn_once` keys each warning by its message; tests reset :data:`GIVEN` for a fresh process's behaviour;
:func:`never_warn` is for a caller that does on purpose what a warning is about.
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


def never_warn(message: str) -> None:
    """Give ``message`` no more in this process (as if :func:`warn_once` had given it)."""
    GIVEN.add(message)
