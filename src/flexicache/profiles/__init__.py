"""Head profiles shipped with FlexiCache (JSON, with their plots beside them)."""

from __future__ import annotations

import os

PROFILES_DIR = os.path.dirname(__file__)


def shipped_profile_path(name: str) -> str | None:
    """Path of the shipped profile ``<name>.json``, or ``None`` if there is none."""
    path = os.path.join(PROFILES_DIR, f"{name}.json")
    return path if os.path.exists(path) else None
