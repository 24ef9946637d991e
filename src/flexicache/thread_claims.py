"""One thread at a time per shared decode backend: a clear refusal instead of two threads racing on one plan.

The FlashInfer backend is one object per device for the whole process (its workspace, its plan, the buffers its
CUDA graphs read: :func:`flexicache.backends._shared_flashinfer`), and its plan is per decode step: a step of one cache
interleaved with a step of another in another thread would decode from the other's plan. Caches sharing a backend
therefore take turns by thread: a cache that holds tokens *claims* its shared backends for the thread of its last
forward, and a forward of another cache from another thread is refused while such a claim stands. A cache gives its
claim up when it is reset, closed or dropped; the same cache may move from thread to thread. Backends a cache owns
alone (the torch reference) are never claimed: caches using them decode from any number of threads.
"""

from __future__ import annotations

import threading
import weakref
from collections.abc import Iterable
from typing import Protocol


class Claimant(Protocol):
    """A cache that claims backends while it holds tokens."""

    def holds_tokens(self) -> bool: ...


_lock = threading.Lock()
_claims: weakref.WeakKeyDictionary[object, dict[int, tuple[int, str, weakref.ref]]] = weakref.WeakKeyDictionary()


def claim(cache: Claimant, backends: Iterable[object], where: str) -> None:
    """Claim ``backends`` (the shared ones among a cache's) for the current thread, before a forward of ``cache``.

    Args:
        where: the device(s) of the backends, for the message.

    Raises:
        RuntimeError: another cache that holds tokens claimed one of them from another thread.
    """
    thread = threading.current_thread()
    with _lock:
        for backend in backends:
            holders = _claims.setdefault(backend, {})
            for key, (ident, name, ref) in list(holders.items()):
                other = ref()
                busy = other is not None and other.holds_tokens()
                refused = busy and other is not cache and ident != thread.ident
                del other  # a caught refusal's traceback must not keep the other cache alive
                if not busy:
                    del holders[key]
                elif refused:
                    raise RuntimeError(
                        f"This FlexiCache would decode on {where} from thread {thread.name!r} while another "
                        f"FlexiCache that holds tokens decodes there from thread {name!r}: the FlashInfer backend (its "
                        "plan and the buffers its CUDA graphs read) is shared by every cache on a device, so one "
                        "thread at a time may decode there. Finish with the other cache first (cache.close() or "
                        "cache.reset(), or drop it), run both caches from one thread, or use one process per thread."
                    )
            holders[id(cache)] = (thread.ident, thread.name, weakref.ref(cache))


def holders(backend: object) -> list[str]:
    """Names of the threads holding a live claim on ``backend`` (for tests and diagnostics)."""
    with _lock:
        return [name for _, name, ref in _claims.get(backend, {}).values()
                if ref() is not None and ref().holds_tokens()]
