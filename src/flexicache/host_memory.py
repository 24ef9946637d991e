"""Page-locked host memory for the host tier, registered with CUDA instead of allocated by it.

``torch.zeros(..., pin_memory=True)`` goes through ``cudaHostAlloc``, which is slow for blocks of a host tier's size
(most of a long prefill's time went there; ``eval/gpu_prefill_profile.py`` times both ways), and torch's pinned
allocator rounds every block up to a power of two. Here the memory is an anonymous mapping of exactly the bytes
asked for (transparent huge pages requested, its pages faulted in by torch's parallel fill), page-locked and mapped
into every device's address space with ``cudaHostRegister``: host-to-device copies and the zero-copy Triton kernels
use it like any pinned tensor.
"""

from __future__ import annotations

import math
import mmap
import os

import torch

_REGISTER_PORTABLE_MAPPED = 1 | 2  # cudaHostRegisterPortable | cudaHostRegisterMapped


class _RegisteredMapping(mmap.mmap):
    """An anonymous mapping page-locked for CUDA; unregistered just before it is unmapped.

    Tensors from ``torch.frombuffer`` keep it alive (through their storage), so it goes only when no view of it is
    left. Kernels that may still use it are waited for first on every device this process has started (not inside
    a CUDA graph capture, where waiting is not allowed: the host tier is never freed there). A forked child does not
    own the registration and leaves it alone.
    """

    address: int | None = None  # set once registered
    owner: int | None = None  # the process that registered it

    def register(self) -> None:
        address = torch.frombuffer(self, dtype=torch.uint8, count=1).data_ptr()
        result = torch.cuda.cudart().cudaHostRegister(address, len(self), _REGISTER_PORTABLE_MAPPED)
        if int(result):  # a cudaError enum; 0 is success
            _clear_last_cuda_error()  # else the next checked kernel launch would report this error as its own
        torch.cuda.check_error(result)
        self.address, self.owner = address, os.getpid()

    def __del__(self) -> None:
        if self.address is None or self.owner != os.getpid():
            return
        try:
            if not torch.cuda.is_current_stream_capturing():
                for device in started_cuda_devices():
                    try:
                        torch.cuda.synchronize(device)
                    except RuntimeError:  # e.g. a sticky error on that device: the others are still waited for
                        pass
        finally:  # never unmap memory that is still registered
            torch.cuda.cudart().cudaHostUnregister(self.address)


def started_cuda_devices() -> list[int]:
    """CUDA devices this process has a context on (synchronising another would start one, e.g. on every GPU a
    tensor-parallel rank can see)."""
    has_context = getattr(torch._C, "_cuda_hasPrimaryContext", lambda device: True)
    return [device for device in range(torch.cuda.device_count()) if has_context(device)]


def _clear_last_cuda_error() -> None:
    """Reset the CUDA runtime's last error after a failed call whose error was handled here."""
    get_last_error = getattr(torch.cuda.cudart(), "cudaGetLastError", None)
    if get_last_error is not None:
        get_last_error()


def pinned_mapping(nbytes: int) -> _RegisteredMapping:
    """An anonymous mapping of exactly ``nbytes`` (> 0), zero-filled, page-locked and mapped for every CUDA device;
    unregistered and unmapped when the last reference to it goes.

    Raises:
        RuntimeError: CUDA refused to page-lock the memory (e.g. the locked-memory limit); the message says so.
    """
    mapping = _RegisteredMapping(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
    if hasattr(mmap, "MADV_HUGEPAGE"):  # fewer pages to lock; ignored where huge pages are off
        try:
            mapping.madvise(mmap.MADV_HUGEPAGE)
        except OSError:
            pass
    tensor = torch.frombuffer(mapping, dtype=torch.uint8)
    tensor.zero_()  # faults the pages in on all of torch's threads: locking them then takes a fraction of the time
    del tensor  # a view would keep the mapping from closing below
    try:
        mapping.register()
    except RuntimeError as error:
        mapping.close()  # give the faulted-in memory back now, not when the traceback goes
        raise RuntimeError(f"Could not page-lock {nbytes / 2**30:.2f} GiB of host memory for FlexiCache's host tier "
                           f"({error}). Free host memory, raise the locked-memory limit (ulimit -l), or lower the "
                           "batch size, the context or the cache's max_cache_len.") from error
    return mapping


def pinned_zeros(shape: tuple[int, ...], dtype: torch.dtype) -> torch.Tensor:
    """A zero-filled, page-locked host tensor of ``shape`` (exactly its bytes), usable by every CUDA device.

    Raises:
        RuntimeError: CUDA refused to page-lock the memory (e.g. the locked-memory limit); the message says so.
    """
    nbytes = math.prod(shape) * dtype.itemsize
    if nbytes == 0:
        return torch.zeros(shape, dtype=dtype)
    if not anonymous_mappings():  # (Windows): torch's own pinned allocation
        return torch.zeros(shape, dtype=dtype, pin_memory=True)
    return torch.frombuffer(pinned_mapping(nbytes), dtype=dtype).view(shape)


def anonymous_mappings() -> bool:
    """Whether this platform has anonymous memory mappings (not on Windows)."""
    return hasattr(mmap, "MAP_ANONYMOUS")
