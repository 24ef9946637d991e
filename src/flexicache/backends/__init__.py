"""Sparse paged decode kernels behind one small interface (:class:`DecodeBackend`)."""

from __future__ import annotations

import functools
import warnings

import torch

from flexicache.backends.base import DecodeBackend, DecodeLayout, build_decode_layout
from flexicache.backends.reference import ReferenceBackend

__all__ = ["DecodeBackend", "DecodeLayout", "ReferenceBackend", "build_decode_layout", "resolve_backend",
           "triton_available"]


def triton_available() -> bool:
    """Whether Triton (for the fused decode-table kernel) can be imported."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


def resolve_backend(name: str, device: torch.device) -> DecodeBackend:
    """The backend called ``name``; ``"auto"`` is FlashInfer on CUDA when importable, else the torch reference."""
    if name == "reference" or (name == "auto" and device.type != "cuda"):
        return ReferenceBackend()
    if device.type != "cuda":
        raise ValueError(f"backend='flashinfer' needs a CUDA device, the cache is on {device}; use 'reference'.")
    from flexicache.backends.flashinfer import flashinfer_available

    if flashinfer_available():
        return _shared_flashinfer(device)
    if name == "flashinfer":
        raise ImportError("backend='flashinfer' needs FlashInfer: pip install 'flexicache[cuda]'.")
    warnings.warn("FlashInfer is not installed: FlexiCache decodes with the torch reference backend "
                  "(slower). pip install 'flexicache[cuda]' for the CUDA kernels.", stacklevel=3)
    return ReferenceBackend()


@functools.lru_cache(maxsize=None)
def _shared_flashinfer(device: torch.device) -> DecodeBackend:
    """One FlashInfer backend (workspace, wrappers, plan) per device, shared by every cache of the process."""
    from flexicache.backends.flashinfer import FlashInferBackend

    return FlashInferBackend(device)
