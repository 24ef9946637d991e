"""Sparse paged decode kernels behind one small interface (:class:`DecodeBackend`)."""

from __future__ import annotations

import torch

from flexicache.backends.base import DecodeBackend
from flexicache.backends.reference import ReferenceBackend

__all__ = ["DecodeBackend", "ReferenceBackend", "resolve_backend"]


def resolve_backend(name: str, device: torch.device) -> DecodeBackend:
    """The backend called ``name`` (``"auto"``: FlashInfer on CUDA when importable, else the torch reference)."""
    if name == "reference" or (name == "auto" and device.type != "cuda"):
        return ReferenceBackend()
    raise ValueError(
        f"backend={name!r} on device {device} is not available in this build; use backend='reference'."
    )
