"""``key=value,key=value`` settings as the command lines take them (``flexicache eval --method``, the settings after
a ``flexicache bench`` system name's colon): each value becomes an int, a float, a bool or ``None`` where it reads as
one (``true``/``false``/``none`` in any case), else stays a string."""

from __future__ import annotations

from typing import Any


def parse_boolean(text: str) -> bool:
    """``true`` or ``false`` (any case) as a bool, for command-line options; anything else raises ``ValueError``."""
    if text.lower() not in ("true", "false"):
        raise ValueError(f"expected true or false, got {text!r}")
    return text.lower() == "true"


def parse_value(text: str) -> Any:
    """A setting's value: an int, a float, true/false, none, else the string itself."""
    lowered = text.lower()
    if lowered in ("true", "false"):
        return lowered == "true"
    if lowered == "none":
        return None
    for kind in (int, float):
        try:
            return kind(text)
        except ValueError:
            pass
    return text


def parse_settings(text: str, what: str, example: str) -> dict[str, Any]:
    """``"page_size=8, rerank_interval=2"`` -> ``{"page_size": 8, "rerank_interval": 2}`` (spaces around items,
    keys and values ignored, order kept). An item that is not ``key=value``, or a key given twice, raises
    ``ValueError`` naming ``what`` and showing ``example``."""
    settings: dict[str, Any] = {}
    for item in filter(None, (part.strip() for part in text.split(","))):
        key, sep, value = (part.strip() for part in item.partition("="))
        if not sep or not key:
            raise ValueError(f"{what}: {item!r} is not key=value (e.g. {example})")
        if key in settings:
            raise ValueError(f"{what}: {key} is given twice in {text!r}; give each setting once")
        settings[key] = parse_value(value)
    return settings
