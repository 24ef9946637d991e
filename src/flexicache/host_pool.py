"""A process-wide pool of page-locked host memory that host tiers borrow from and give back to.

Page-locking costs time in proportion to the bytes (``cudaHostRegister`` walks and pins every page; a
Llama-3.1-8B-shaped cache at batch 8 and 32k tokens holds 37.5 GiB of host tier), and a long-running process that
locks and unlocks tiers of ever other sizes fragments its address space. The pool keeps the blocks a cache gave back
registered, and hands them to the next cache that asks for about as much: repeated requests of one shape lock their
memory once per process.

A borrowed block is a ``uint8`` tensor of exactly the bytes asked for, viewing a block of whole huge pages; it goes
back to the pool when no view of it is left (reference counting: a cache that nobody refers to gives its host tier
back at once, without the cyclic garbage collector). A block given back once may still be read or written by queued
kernels of its previous owner: the pool waits for every started device before handing it out again. Its contents
are whatever the previous owner left (a fresh block is zeros).

The pool is bounded by a limit on the bytes it keeps registered, in use or not: ``FLEXICACHE_HOST_POOL_GIB`` (read
when the pool is made) or :func:`set_limit`; unused blocks are unregistered oldest first to make room, and
:func:`release` unregisters all of them (``FLEXICACHE_HOST_POOL_KEEP=0`` unregisters each block as soon as it is
given back: no reuse). Without a limit the pool takes what the system can give
(:mod:`flexicache.host_limits`): before registering a new block it checks what the process can still take and raises
:class:`~flexicache.host_limits.HostMemoryError` instead of growing into the OOM killer.
"""

from __future__ import annotations

import ctypes
import functools
import math
import os
import threading
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

import torch

from flexicache.host_limits import Limit, check_room, gib, system_limits
from flexicache.host_memory import pinned_mapping, started_cuda_devices

ENV_LIMIT = "FLEXICACHE_HOST_POOL_GIB"
ENV_KEEP = "FLEXICACHE_HOST_POOL_KEEP"
BLOCK_BYTES = 2 * 2**20  # blocks are whole (huge) pages: a block given back fits later requests of about its size
REUSE_SLACK = 0.25  # a free block serves a request at most this fraction smaller than it (else the bytes idle)
REMEDY = ("Lower the batch size or the context (prompt + max_new_tokens, or max_cache_len), or use a profile with more "
          "unstable heads (their KV stays on the GPU); the token budget does not change the host tier's size.")


@dataclass(eq=False)
class _Block:
    """A registered mapping of ``nbytes`` at ``address``; ``used``: it was handed out before (queued kernels of its
    previous owner may still use it)."""

    mapping: Any
    address: int
    nbytes: int
    used: bool = False


def block_size(nbytes: int) -> int:
    """Bytes of the block the pool hands out for a request of ``nbytes``: whole :data:`BLOCK_BYTES`."""
    return -(-nbytes // BLOCK_BYTES) * BLOCK_BYTES


def _wait_for_devices() -> None:
    """Wait for the kernels of every CUDA device this process started (they may use a block given back)."""
    if not torch.cuda.is_available() or torch.cuda.is_current_stream_capturing():
        return
    for device in started_cuda_devices():
        torch.cuda.synchronize(device)


class HostPool:
    """Page-locked blocks handed out as ``uint8`` tensors and taken back when their last view goes.

    Args:
        limit_bytes: most bytes kept registered (in use or free); ``None``: what the system can give.
        keep_free: keep the blocks given back for reuse (``False``: unregister each at once, as if unpooled).
        allocate: makes a registered block of ``n`` bytes, an object with the buffer protocol that unregisters when
            it is deleted (:func:`~flexicache.host_memory.pinned_mapping`; tests pass ordinary mappings).
        wait: waits for queued device work before a block is handed out again.
    """

    def __init__(self, limit_bytes: int | None = None, keep_free: bool = True,
                 allocate: Callable[[int], Any] = pinned_mapping, wait: Callable[[], None] = _wait_for_devices) -> None:
        self.limit_bytes = _checked_limit(limit_bytes)
        self.keep_free = keep_free
        self._allocate = allocate
        self._wait = wait
        self._lock = threading.RLock()  # re-entrant: a lease may be given back while this thread holds the lock
        self._free: list[_Block] = []  # oldest first
        self.in_use_bytes = 0
        self.reserved_bytes = 0
        self.pid = os.getpid()

    # ------------------------------------------------------------------------------------------------ borrowing

    def borrow(self, nbytes: int) -> torch.Tensor:
        """``nbytes`` of page-locked memory as a ``uint8`` tensor (contents unspecified), back to the pool when no
        view of it is left.

        Raises:
            HostMemoryError: a new block would not fit under the pool's limit or what the system can give.
            RuntimeError: CUDA refused to page-lock a new block.
        """
        if nbytes <= 0:
            return torch.empty(0, dtype=torch.uint8)
        size = block_size(nbytes)
        with self._lock:
            block = self._take_free(size)
            if block is None:
                check_room(size, self.limits(), f"a host tier of {gib(nbytes)}", REMEDY)
                self._evict_for(size)
                mapping = self._allocate(size)
                address = torch.frombuffer(mapping, dtype=torch.uint8, count=1).data_ptr()
                block = _Block(mapping, address, size)
                self.reserved_bytes += size
            self.in_use_bytes += block.nbytes
        if block.used:
            self._wait()
        block.used = True
        lease = _lease_type(nbytes).from_address(block.address)
        lease.pool, lease.block = self, block
        return torch.frombuffer(lease, dtype=torch.uint8)

    def _take_free(self, size: int) -> _Block | None:
        """The smallest free block of at least ``size`` bytes and at most ``size / (1 - REUSE_SLACK)``."""
        fitting = [block for block in self._free if size <= block.nbytes <= size / (1 - REUSE_SLACK)]
        if not fitting:
            return None
        block = min(fitting, key=lambda candidate: candidate.nbytes)
        self._free.remove(block)
        return block

    def _evict_for(self, size: int) -> None:
        """Unregister free blocks, oldest first, until a new block of ``size`` fits under the pool's limit and in
        the system's room."""
        system = [limit.room for limit in system_limits()]
        room = min(system) if system else math.inf
        while self._free and ((self.limit_bytes is not None and self.reserved_bytes + size > self.limit_bytes)
                              or size > room):
            block = self._free.pop(0)
            room += block.nbytes
            self._unregister(block)

    def _unregister(self, block: _Block) -> None:
        self.reserved_bytes -= block.nbytes
        block.mapping = None  # its last reference: unregistered and unmapped now

    def give_back(self, block: _Block) -> None:
        """Called when the last view of ``block`` goes: keep it for the next borrower (within the limit)."""
        with self._lock:
            self.in_use_bytes -= block.nbytes
            if not self.keep_free or (self.limit_bytes is not None and self.reserved_bytes > self.limit_bytes):
                self._unregister(block)  # unpooled, or the limit was lowered while it was in use
            else:
                self._free.append(block)

    # ------------------------------------------------------------------------------------------- limit, release

    def limits(self) -> list[Limit]:
        """The bounds on new page-locked memory: the system's, with the pool's free blocks counted as room, and the
        pool's own limit."""
        limits = system_limits(reclaimable=self.reserved_bytes - self.in_use_bytes)
        if self.limit_bytes is not None:
            limits.append(Limit(f"the host pool's limit of {gib(self.limit_bytes)} ({gib(self.in_use_bytes)} in use)",
                                self.limit_bytes - self.in_use_bytes,
                                f"raise the limit ({ENV_LIMIT}, or flexicache.host_pool.set_limit(gib))"))
        return limits

    def set_limit(self, limit_bytes: int | None) -> None:
        """Bound the registered bytes (``None``: no bound of the pool's own); free blocks over it go at once."""
        with self._lock:
            self.limit_bytes = _checked_limit(limit_bytes)
            self._evict_for(0)

    def release(self) -> int:
        """Unregister every free block (back to the system); returns the bytes released."""
        with self._lock:
            released = sum(block.nbytes for block in self._free)
            for block in self._free:
                self._unregister(block)
            self._free.clear()
        return released

    def stats(self) -> dict[str, int]:
        """``host_pool_in_use_bytes`` (blocks lent to host tiers) and ``host_pool_reserved_bytes`` (registered, in
        use or kept for reuse)."""
        return {"host_pool_in_use_bytes": self.in_use_bytes, "host_pool_reserved_bytes": self.reserved_bytes}


@functools.lru_cache(maxsize=256)
def _lease_type(nbytes: int) -> type:
    """A ``ctypes`` array of ``nbytes`` over a block (its buffer is what a borrowed tensor views) that gives the block
    back when it is deleted, i.e. when the last tensor viewing it goes."""

    def __del__(self: Any) -> None:
        pool, block = getattr(self, "pool", None), getattr(self, "block", None)
        if pool is not None and block is not None:
            pool.give_back(block)

    return type(f"HostLease{nbytes}", (ctypes.c_uint8 * nbytes,), {"__del__": __del__})


def _checked_limit(limit_bytes: int | None) -> int | None:
    if limit_bytes is not None and (isinstance(limit_bytes, bool) or not isinstance(limit_bytes, int)
                                    or limit_bytes < 0):
        raise ValueError(f"the host pool's limit must be a number of bytes >= 0 or None, got {limit_bytes!r}.")
    return limit_bytes


def keep_from_environment() -> bool:
    """Whether the pool keeps blocks for reuse: ``FLEXICACHE_HOST_POOL_KEEP`` is ``1`` (the default) or ``0``."""
    value = os.environ.get(ENV_KEEP, "1").strip()
    if value not in ("0", "1"):
        raise ValueError(f"{ENV_KEEP} must be 1 (keep the blocks caches give back, for reuse) or 0, got {value!r}.")
    return value == "1"


def limit_from_environment() -> int | None:
    """The limit ``FLEXICACHE_HOST_POOL_GIB`` sets (GiB, e.g. ``64`` or ``0.5``), ``None`` when unset."""
    value = os.environ.get(ENV_LIMIT, "").strip()
    if not value:
        return None
    try:
        limit = float(value)
    except ValueError:
        limit = -1.0
    if not math.isfinite(limit) or limit < 0:
        raise ValueError(f"{ENV_LIMIT} must be a number of GiB >= 0 (e.g. 64 or 0.5), got {value!r}.")
    return int(limit * 2**30)


_process_pool: HostPool | None = None
_process_lock = threading.Lock()


def host_pool() -> HostPool:
    """The process's pool (made at the first call, and again in a forked child: the parent's registrations are
    not the child's)."""
    global _process_pool
    with _process_lock:
        if _process_pool is None or _process_pool.pid != os.getpid():
            _process_pool = HostPool(limit_from_environment(), keep_from_environment())
        return _process_pool


def set_limit(limit_gib: float | None) -> None:
    """Bound the process's pinned host memory for host tiers to ``limit_gib`` GiB (``None``: no bound but what the
    system can give); unused blocks over it are unregistered at once."""
    if limit_gib is not None and (isinstance(limit_gib, bool) or not isinstance(limit_gib, (int, float))
                                  or not math.isfinite(limit_gib) or limit_gib < 0):
        raise ValueError(f"set_limit takes a number of GiB >= 0 or None, got {limit_gib!r}.")
    host_pool().set_limit(None if limit_gib is None else int(limit_gib * 2**30))


def release() -> int:
    """Give the process pool's unused blocks back to the system; returns the bytes released."""
    return host_pool().release()
