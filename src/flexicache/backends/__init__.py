"""Sparse paged decode kernels behind one small interface (:class:`DecodeBackend`)."""

from __future__ import annotations

import functools
import warnings

import torch

from flexicache.backends.base import DecodeBackend, DecodeLayout, PreparedBackend, build_decode_layout
from flexicache.backends.reference import ReferenceBackend

__all__ = ["DecodeBackend", "DecodeLayout", "PreparedBackend", "ReferenceBackend", "build_decode_layout",
           "flashinfer_unsupported", "layer_backend", "require_flashinfer_support", "resolve_backend",
           "triton_available"]


def triton_available() -> bool:
    """Whether Triton (for the fused decode-table kernel) can be imported."""
    try:
        import triton  # noqa: F401
    except ImportError:
        return False
    return True


FLASHINFER_DTYPES = (torch.float16, torch.bfloat16)
FLASHINFER_HEAD_DIMS = (64, 128, 256)


def flashinfer_unsupported(dtype: torch.dtype | None, head_dim: int) -> str | None:
    """Why FlashInfer's decode kernels cannot serve KV of this dtype and head dim, or ``None`` (``dtype=None``: not
    known yet, only the head dim is checked)."""
    if dtype is not None and dtype not in FLASHINFER_DTYPES:
        return f"FlashInfer decodes float16/bfloat16 KV, this KV is {dtype}"
    if head_dim not in FLASHINFER_HEAD_DIMS:
        return f"FlashInfer decodes head dims {FLASHINFER_HEAD_DIMS}, this model's is {head_dim}"
    return None


def require_flashinfer_support(dtype: torch.dtype | None, head_dim: int) -> None:
    """Refuse ``backend="flashinfer"`` for KV that FlashInfer cannot decode, saying what to change."""
    unsupported = flashinfer_unsupported(dtype, head_dim)
    if unsupported is not None:
        raise ValueError(f"backend='flashinfer': {unsupported}. Use backend='auto' or 'reference' (torch).")


def resolve_backend(name: str, device: torch.device, dtype: torch.dtype, head_dim: int) -> DecodeBackend:
    """The backend called ``name`` for KV of ``dtype`` and ``head_dim`` on ``device``; ``"auto"`` is FlashInfer on
    CUDA when importable and able to serve that KV, else the torch reference (with a warning on CUDA)."""
    if name == "reference" or (name == "auto" and device.type != "cuda"):
        return ReferenceBackend()
    if device.type != "cuda":
        raise ValueError(f"backend='flashinfer' needs a CUDA device, the cache is on {device}; use 'reference'.")
    if name == "flashinfer":
        require_flashinfer_support(dtype, head_dim)
    unsupported = flashinfer_unsupported(dtype, head_dim)
    if unsupported is not None:
        warnings.warn(f"{unsupported}: FlexiCache decodes with the torch reference backend (slower).", stacklevel=3)
        return ReferenceBackend()
    from flexicache.backends.flashinfer import flashinfer_available

    if flashinfer_available():
        return _shared_flashinfer(device)
    if name == "flashinfer":
        raise ImportError("backend='flashinfer' needs FlashInfer: pip install 'flexicache-kv[cuda]'.")
    warnings.warn("FlashInfer is not installed: FlexiCache decodes with the torch reference backend "
                  "(slower). pip install 'flexicache-kv[cuda]' for the CUDA kernels.", stacklevel=3)
    return ReferenceBackend()


def layer_backend(backends: dict[torch.device, DecodeBackend], name: str, device: torch.device, dtype: torch.dtype,
                  head_dim: int) -> DecodeBackend:
    """The decode backend of a layer with KV of ``dtype`` and ``head_dim`` on ``device``: the one ``backends`` holds
    for the device (resolved by its first layer and shared, so the plan is made once per step), unless that one is
    FlashInfer and cannot decode this layer's KV (a model whose layers differ): then this layer's own fallback."""
    backend = backends.get(device)
    if backend is None:
        backend = backends[device] = resolve_backend(name, device, dtype, head_dim)
    elif (device.type == "cuda" and not isinstance(backend, ReferenceBackend)
          and flashinfer_unsupported(dtype, head_dim) is not None):
        backend = resolve_backend(name, device, dtype, head_dim)
    return backend


@functools.cache
def _shared_flashinfer(device: torch.device) -> DecodeBackend:
    """One FlashInfer backend (workspace, wrappers, plan) per device, shared by every cache of the process."""
    from flexicache.backends.flashinfer import FlashInferBackend

    return FlashInferBackend(device)
