"""How much host memory this process can still take, and the error raised before taking more than that.

A host tier that does not fit is better refused with a number and a remedy than taken page by page until the
kernel's OOM killer ends the process (which is what happens to a dense offloaded cache of the same size). The limits
read here are the system's available memory (``MemAvailable`` in ``/proc/meminfo``, less :data:`HEADROOM_BYTES`
left for the rest of the process) and the container's memory limit (cgroup v2 ``memory.max`` or v1
``memory.limit_in_bytes``, less what the container uses beyond its reclaimable file cache); the pinned host pool adds
its own limit (:mod:`flexicache.host_pool`).

The locked-memory limit (``ulimit -l``, :func:`memlock_limit`) is read but not enforced: memory registered with
``cudaHostRegister`` is pinned by the NVIDIA driver, not by ``mlock``, and a container's default limit (a few MiB)
would refuse every host tier. ``eval/gpu_reliability.py`` prints it beside the bytes the process registered.
"""

from __future__ import annotations

import resource
from dataclasses import dataclass
from pathlib import Path

GIB = 2**30
HEADROOM_BYTES = GIB  # left to the rest of the process (Python objects, staging copies): a choice, not a measurement
UNLIMITED = 2**60  # cgroup v1 reports "no limit" as a number near 2**63


class HostMemoryError(MemoryError):
    """The host memory a cache needs is more than this process can take (the message says how much, and what to
    lower)."""


@dataclass(frozen=True)
class Limit:
    """One bound on the host memory this process can take: ``room`` bytes left under it, and how to raise it."""

    name: str
    room: int
    advice: str


def gib(nbytes: float) -> str:
    """``nbytes`` in GiB with two decimals (in MiB below 0.01 GiB)."""
    return f"{nbytes / GIB:.2f} GiB" if nbytes >= GIB / 100 or nbytes == 0 else f"{nbytes / 2**20:.2f} MiB"


def read_meminfo(path: Path = Path("/proc/meminfo")) -> dict[str, int]:
    """``/proc/meminfo`` in bytes (``{}`` where there is none, e.g. not Linux)."""
    try:
        lines = path.read_text().splitlines()
    except OSError:
        return {}
    values = {}
    for line in lines:
        name, _, rest = line.partition(":")
        fields = rest.split()
        if fields and fields[0].isdigit():
            values[name] = int(fields[0]) * (1024 if fields[1:2] == ["kB"] else 1)
    return values


def _read_int(path: Path) -> int | None:
    try:
        text = path.read_text().strip()
    except OSError:
        return None
    return int(text) if text.isdigit() else None


def _inactive_file(stat: Path, names: tuple[str, ...]) -> int:
    try:
        lines = stat.read_text().splitlines()
    except OSError:
        return 0
    fields = dict(line.split()[:2] for line in lines if len(line.split()) >= 2)
    return next((int(fields[name]) for name in names if name in fields and fields[name].isdigit()), 0)


def cgroup_room(root: Path = Path("/sys/fs/cgroup")) -> int | None:
    """Bytes the container (this process's memory cgroup) may still take, or ``None`` without a limit.

    What it uses counts without its inactive file cache, which the kernel reclaims before it kills anything."""
    v2_limit = root / "memory.max"
    if v2_limit.exists():
        limit, usage = _read_int(v2_limit), _read_int(root / "memory.current")
        reclaimable = _inactive_file(root / "memory.stat", ("inactive_file",))
    else:
        v1 = root / "memory"
        limit, usage = _read_int(v1 / "memory.limit_in_bytes"), _read_int(v1 / "memory.usage_in_bytes")
        reclaimable = _inactive_file(v1 / "memory.stat", ("total_inactive_file", "inactive_file"))
    if limit is None or limit >= UNLIMITED or usage is None:
        return None
    return max(0, limit - max(0, usage - reclaimable))


def memlock_limit() -> int | None:
    """The locked-memory limit (``ulimit -l``) in bytes, ``None`` when unlimited (informative, see the module
    docstring)."""
    soft, _ = resource.getrlimit(resource.RLIMIT_MEMLOCK)
    return None if soft == resource.RLIM_INFINITY else soft


def system_limits(reclaimable: int = 0) -> list[Limit]:
    """The system's bounds on new host memory; ``reclaimable``: bytes this process holds and would give back first
    (the pool's unused blocks), counted as room."""
    limits = []
    available = read_meminfo().get("MemAvailable")
    if available is not None:
        limits.append(Limit(f"the system's available memory ({gib(available)} in /proc/meminfo, less "
                            f"{gib(HEADROOM_BYTES)} left for the rest of the process)",
                            max(0, available - HEADROOM_BYTES) + reclaimable,
                            "free host memory (other processes, a CPU copy of the model)"))
    container = cgroup_room()
    if container is not None:
        limits.append(Limit(f"the container's memory limit ({gib(container)} left under it)", container + reclaimable,
                            "raise the container's memory limit"))
    return limits


def check_room(needed: int, limits: list[Limit], what: str, remedy: str) -> None:
    """Raise :class:`HostMemoryError` when ``needed`` bytes do not fit under every one of ``limits``.

    Args:
        what: what needs the memory, e.g. "the host tiers of this cache's stable heads (batch 8 x 32768 tokens ...)".
        remedy: what the caller can lower to need less.
    """
    if not limits:
        return
    binding = min(limits, key=lambda limit: limit.room)
    if needed <= binding.room:
        return
    raise HostMemoryError(
        f"FlexiCache needs {gib(needed)} more host memory for {what}, but this process can take {gib(binding.room)} "
        f"more: it is bound by {binding.name}. {remedy} Or {binding.advice}."
    )
