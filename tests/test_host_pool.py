"""The process-wide pinned host pool (flexicache.host_pool) and the host-memory limits checked before memory is taken
(flexicache.host_limits, flexicache.forward_guard), on the CPU: the pool over ordinary mappings whose release is
recorded, and whole caches over the real page-locking code with CUDA's registration calls faked. The real
registration runs in tests/test_gpu_reliability.py."""

from __future__ import annotations

import gc
import mmap
import re
import threading

import pytest
import torch
from conftest import greedy, left_pad, mixed_profile, random_prompt, tiny_config, tiny_model
from test_host_memory import FakeCudart, cudart  # noqa: F401  (the fixture)

from flexicache import FlexiCache, host_limits, host_pool, host_tier
from flexicache.host_limits import GIB, HEADROOM_BYTES, HostMemoryError, cgroup_room
from flexicache.host_pool import (
    BLOCK_BYTES,
    ENV_KEEP,
    ENV_LIMIT,
    HostPool,
    keep_from_environment,
    limit_from_environment,
)


class RecordedMapping(mmap.mmap):
    """An ordinary anonymous mapping standing for a registered block; its release is recorded."""

    released: list[int]

    def __del__(self) -> None:
        self.released.append(len(self))


class Recorder:
    def __init__(self) -> None:
        self.made: list[int] = []
        self.released: list[int] = []
        self.waits = 0

    def allocate(self, nbytes: int) -> RecordedMapping:
        self.made.append(nbytes)
        mapping = RecordedMapping(-1, nbytes, flags=mmap.MAP_PRIVATE | mmap.MAP_ANONYMOUS)
        mapping.released = self.released
        return mapping

    def wait(self) -> None:
        self.waits += 1

    def pool(self, limit_bytes: int | None = None, keep_free: bool = True) -> HostPool:
        return HostPool(limit_bytes, keep_free, allocate=self.allocate, wait=self.wait)


def test_a_borrowed_block_is_exact_and_comes_back_when_its_last_view_goes() -> None:
    recorder = Recorder()
    pool = recorder.pool()
    block = pool.borrow(3 * 2**20 + 5)
    assert block.dtype == torch.uint8 and block.numel() == 3 * 2**20 + 5
    assert recorder.made == [2 * BLOCK_BYTES]  # whole blocks
    assert pool.stats() == {"host_pool_in_use_bytes": 2 * BLOCK_BYTES, "host_pool_reserved_bytes": 2 * BLOCK_BYTES}
    block[-1] = 7
    view = block[2**20:].view(torch.int8)
    del block
    assert pool.in_use_bytes == 2 * BLOCK_BYTES  # a view still uses it
    assert int(view[-1]) == 7
    del view  # reference counting alone gives it back
    assert pool.stats() == {"host_pool_in_use_bytes": 0, "host_pool_reserved_bytes": 2 * BLOCK_BYTES}
    assert recorder.released == []  # kept registered for the next borrower
    assert pool.borrow(0).numel() == 0 and recorder.made == [2 * BLOCK_BYTES]


def test_a_block_given_back_serves_the_next_borrower_of_about_its_size() -> None:
    recorder = Recorder()
    pool = recorder.pool()
    address = pool.borrow(8 * BLOCK_BYTES).data_ptr()  # given back at once
    assert recorder.waits == 0
    again = pool.borrow(7 * BLOCK_BYTES)  # within the slack: the same block, after waiting for its last kernels
    assert again.data_ptr() == address and recorder.made == [8 * BLOCK_BYTES] and recorder.waits == 1
    small = pool.borrow(2 * BLOCK_BYTES)  # the free list is empty: a new block
    del again
    smaller = pool.borrow(BLOCK_BYTES)  # 8 blocks for 1 would idle 7: a new block, the large one stays free
    assert recorder.made == [8 * BLOCK_BYTES, 2 * BLOCK_BYTES, BLOCK_BYTES]
    assert pool.stats() == {"host_pool_in_use_bytes": 3 * BLOCK_BYTES, "host_pool_reserved_bytes": 11 * BLOCK_BYTES}
    del small, smaller
    assert pool.release() == 11 * BLOCK_BYTES
    assert sorted(recorder.released) == [BLOCK_BYTES, 2 * BLOCK_BYTES, 8 * BLOCK_BYTES]
    assert pool.stats() == {"host_pool_in_use_bytes": 0, "host_pool_reserved_bytes": 0}


def test_the_limit_bounds_registered_bytes_and_free_blocks_make_room_oldest_first() -> None:
    recorder = Recorder()
    pool = recorder.pool(limit_bytes=6 * BLOCK_BYTES)
    first, second = pool.borrow(2 * BLOCK_BYTES), pool.borrow(3 * BLOCK_BYTES)
    with pytest.raises(HostMemoryError, match=r"needs 4\.00 MiB more .* can take 2\.00 MiB more.*host pool's limit "
                                              r"of 0\.01 GiB.*Lower the batch size or the context.*" + ENV_LIMIT):
        pool.borrow(2 * BLOCK_BYTES)
    assert recorder.made == [2 * BLOCK_BYTES, 3 * BLOCK_BYTES]  # refused before anything was made
    del first, second  # both free now, the 2-block one first
    third = pool.borrow(BLOCK_BYTES)  # either free block would idle most of its bytes: a new one, under the limit
    assert recorder.made == [2 * BLOCK_BYTES, 3 * BLOCK_BYTES, BLOCK_BYTES] and recorder.released == []
    del third
    fourth = pool.borrow(4 * BLOCK_BYTES)  # fits no free block: they go, oldest first, until it fits the limit
    assert recorder.released == [2 * BLOCK_BYTES, 3 * BLOCK_BYTES]
    assert pool.stats() == {"host_pool_in_use_bytes": 4 * BLOCK_BYTES, "host_pool_reserved_bytes": 5 * BLOCK_BYTES}
    pool.set_limit(2 * BLOCK_BYTES)  # free blocks over a lowered limit go at once, one in use when given back
    assert recorder.released == [2 * BLOCK_BYTES, 3 * BLOCK_BYTES, BLOCK_BYTES]
    del fourth
    assert recorder.released[-1] == 4 * BLOCK_BYTES and pool.reserved_bytes == 0
    kept = pool.borrow(BLOCK_BYTES)
    del kept
    pool.set_limit(0)  # free blocks over a lowered limit go at once
    assert recorder.released[-1] == BLOCK_BYTES and pool.reserved_bytes == 0
    with pytest.raises(ValueError, match="limit must be a number of bytes"):
        pool.set_limit(-1)


def test_the_system_limits_refuse_a_block_that_would_not_fit(monkeypatch: pytest.MonkeyPatch) -> None:
    recorder = Recorder()
    pool = recorder.pool()
    free = pool.borrow(2 * BLOCK_BYTES)
    del free  # 2 blocks free: they count as room, and go first
    monkeypatch.setattr(host_limits, "read_meminfo", lambda: {"MemAvailable": HEADROOM_BYTES + BLOCK_BYTES})
    monkeypatch.setattr(host_limits, "cgroup_room", lambda: None)
    block = pool.borrow(3 * BLOCK_BYTES)
    assert recorder.released == [2 * BLOCK_BYTES] and recorder.made[-1] == 3 * BLOCK_BYTES
    with pytest.raises(HostMemoryError, match=r"bound by the system's available memory.*Or free host memory"):
        pool.borrow(2 * BLOCK_BYTES)
    monkeypatch.setattr(host_limits, "cgroup_room", lambda: 0)
    with pytest.raises(HostMemoryError, match="container's memory limit"):
        pool.borrow(BLOCK_BYTES)
    del block


def test_cgroup_room_reads_v1_and_v2_without_reclaimable_cache(tmp_path) -> None:
    v2 = tmp_path / "v2"
    v2.mkdir()
    (v2 / "memory.max").write_text("1000000\n")
    (v2 / "memory.current").write_text("700000\n")
    (v2 / "memory.stat").write_text("anon 500000\ninactive_file 100000\n")
    assert cgroup_room(v2) == 1000000 - 600000
    (v2 / "memory.max").write_text("max\n")
    assert cgroup_room(v2) is None
    v1 = tmp_path / "v1" / "memory"
    v1.mkdir(parents=True)
    (v1 / "memory.limit_in_bytes").write_text(str(2**63 - 4096))
    (v1 / "memory.usage_in_bytes").write_text("5")
    assert cgroup_room(tmp_path / "v1") is None  # v1's "no limit"
    (v1 / "memory.limit_in_bytes").write_text("900")
    (v1 / "memory.stat").write_text("total_inactive_file 300\n")
    (v1 / "memory.usage_in_bytes").write_text("1000")
    assert cgroup_room(tmp_path / "v1") == 200
    assert cgroup_room(tmp_path / "none") is None


def test_an_unpooled_pool_unregisters_each_block_given_back() -> None:
    recorder = Recorder()
    pool = recorder.pool(keep_free=False)
    block = pool.borrow(BLOCK_BYTES)
    del block
    assert recorder.released == [BLOCK_BYTES] and pool.stats()["host_pool_reserved_bytes"] == 0


def test_the_limit_comes_from_the_environment(monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv(ENV_KEEP, raising=False)
    assert keep_from_environment()
    monkeypatch.setenv(ENV_KEEP, "0")
    assert not keep_from_environment()
    monkeypatch.setenv(ENV_KEEP, "no")
    with pytest.raises(ValueError, match=ENV_KEEP):
        keep_from_environment()
    monkeypatch.delenv(ENV_LIMIT, raising=False)
    assert limit_from_environment() is None
    monkeypatch.setenv(ENV_LIMIT, "1.5")
    assert limit_from_environment() == int(1.5 * GIB)
    for bad in ("-1", "lots", "nan"):
        monkeypatch.setenv(ENV_LIMIT, bad)
        with pytest.raises(ValueError, match=f"{ENV_LIMIT} must be a number of GiB"):
            limit_from_environment()
    with pytest.raises(ValueError, match="set_limit takes a number of GiB"):
        host_pool.set_limit("8")


def test_threads_borrow_and_give_back_concurrently() -> None:
    recorder = Recorder()
    pool = recorder.pool(limit_bytes=64 * BLOCK_BYTES)
    errors: list[BaseException] = []

    def work(seed: int) -> None:
        try:
            for step in range(200):
                held = [pool.borrow((seed + step + size) % 3 * BLOCK_BYTES + 1) for size in range(3)]
                for block in held:
                    block[0] = seed
                assert all(int(block[0]) == seed for block in held)
                del held
        except BaseException as error:  # reported below
            errors.append(error)

    threads = [threading.Thread(target=work, args=(seed,)) for seed in range(4)]
    for thread in threads:
        thread.start()
    for thread in threads:
        thread.join()
    assert not errors, errors[0]
    assert pool.in_use_bytes == 0 and pool.reserved_bytes == sum(recorder.made) - sum(recorder.released)
    assert pool.reserved_bytes <= 64 * BLOCK_BYTES


# ------------------------------------------------------------------------------------------ caches on the pool


@pytest.fixture
def pinned_pool(monkeypatch: pytest.MonkeyPatch, cudart: FakeCudart) -> HostPool:  # noqa: F811
    """A fresh process pool, and host tiers page-locked on the CPU (the real mapping code, CUDA's calls faked);
    its blocks are unregistered at the end, while the fakes still stand."""
    pool = HostPool()
    monkeypatch.setattr(host_pool, "_process_pool", pool)
    monkeypatch.setattr(host_tier, "pins_host_tier", lambda device: True)
    yield pool
    gc.collect()
    pool.release()


def generate(model, cache, new_tokens: int = 10) -> torch.Tensor:
    ids, mask = left_pad([random_prompt(37, seed=1), random_prompt(22, seed=2)])
    return greedy(model, ids, cache, mask, new_tokens)


def test_a_cache_borrows_its_host_tiers_and_gives_them_back_by_reference_counting(
        pinned_pool: HostPool, cudart: FakeCudart) -> None:  # noqa: F811
    config = tiny_config(num_layers=3)
    model = tiny_model(config)
    settings = {"profile": mixed_profile(config), "token_budget": 16, "page_size": 4, "rerank_interval": 3}
    with pytest.MonkeyPatch.context() as unpinned:
        unpinned.setattr(host_tier, "pins_host_tier", lambda device: False)
        expected = generate(model, FlexiCache.from_model(model, **settings))
    assert cudart.registered == []
    gc.collect()
    gc.disable()
    try:
        cache = FlexiCache.from_model(model, **settings)
        assert torch.equal(generate(model, cache), expected)
        stats = cache.stats()
        tiers = [layer.storage.offloaded.host for layer in cache.layers if layer.storage.offloaded is not None]
        assert all(tier.pin_memory for tier in tiers) and len(tiers) == 2
        assert stats["host_pool_in_use_bytes"] == pinned_pool.in_use_bytes >= stats["host_reserved_bytes"] > 0
        registered = len(cudart.registered)
        assert registered > 0 and sum(size for _, size, _ in cudart.registered) == pinned_pool.reserved_bytes
        del cache, tiers
        assert pinned_pool.in_use_bytes == 0 and pinned_pool.reserved_bytes == stats["host_pool_reserved_bytes"]
        assert "unregister" not in cudart.calls  # kept for the next cache
        again = FlexiCache.from_model(model, **settings)
        assert torch.equal(generate(model, again), expected)  # whatever the blocks held before
        assert len(cudart.registered) == registered  # the same shapes: every tier came from the pool
        del again
    finally:
        gc.enable()
    reserved = pinned_pool.reserved_bytes
    assert pinned_pool.release() == reserved and pinned_pool.reserved_bytes == 0
    assert cudart.calls.count("unregister") == registered


def test_a_cache_that_cannot_fit_fails_before_taking_any_memory(pinned_pool: HostPool, cudart: FakeCudart  # noqa: F811
                                                                ) -> None:
    """At a small pool limit the first forward fails at once, saying how many GiB the cache needs (exactly what its
    tiers take once the limit allows them) and what to lower; nothing was registered and nothing the caller passed
    changed, and the same cache works after the limit is raised."""
    config = tiny_config(num_layers=3)
    model = tiny_model(config)
    settings = {"profile": mixed_profile(config), "token_budget": 16, "page_size": 4}
    cache = FlexiCache.from_model(model, **settings)
    ids, mask = left_pad([random_prompt(37, seed=1), random_prompt(22, seed=2)])
    originals = (ids.clone(), mask.clone())
    pinned_pool.set_limit(BLOCK_BYTES // 2)
    with pytest.raises(HostMemoryError) as refused:
        greedy(model, ids, cache, mask, 4)
    message = str(refused.value)
    assert re.search(r"needs 4\.00 MiB more host memory for the page-locked host tiers of this cache's stable heads "
                     r"\(3 KV heads x batch 2 x 40 tokens at 128 bytes per token and head; 4\.00 MiB for the tiers",
                     message), message
    assert "host pool's limit of 1.00 MiB" in message and "Lower the batch size or the context" in message
    assert "unstable heads" in message and "token budget does not change" in message
    assert cudart.registered == [] and pinned_pool.reserved_bytes == 0
    assert torch.equal(ids, originals[0]) and torch.equal(mask, originals[1])
    assert cache.get_seq_length() == 0
    pinned_pool.set_limit(None)
    assert greedy(model, ids, cache, mask, 4).shape == (2, 41)
    # what it named is what the tiers take: 2 layers' tiers of 3 * 2 * (10 pages + 64 headroom) * 512 bytes, in
    # whole 2 MiB blocks
    assert cache.stats()["host_reserved_bytes"] == 3 * 2 * (10 + 64) * 2 * 4 * 8 * 8
    assert cache.stats()["host_pool_in_use_bytes"] == 4 * 2**20


def test_an_unpinned_cache_is_checked_against_the_systems_memory(monkeypatch: pytest.MonkeyPatch) -> None:
    config = tiny_config(num_layers=2)
    model = tiny_model(config)
    monkeypatch.setattr(host_limits, "read_meminfo", lambda: {"MemAvailable": HEADROOM_BYTES + 1000})
    cache = FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=16, page_size=4)
    with pytest.raises(HostMemoryError, match=r"for the host tiers .* bound by the system's available memory"):
        generate(model, cache)
    monkeypatch.setattr(host_limits, "read_meminfo", dict)  # nothing to read: no bound
    assert generate(model, cache).shape == (2, 47)


def test_a_cache_without_a_profile_is_checked_for_the_heads_its_split_will_keep_stable(
        monkeypatch: pytest.MonkeyPatch) -> None:
    """Before the first prompt the online head split has made no head unstable; the check counts the heads the split
    will keep stable (three quarters here), so room for exactly what the tiers take is enough and a byte less is not."""
    config = tiny_config(num_kv_heads=2, num_layers=12)  # 24 KV heads: the split makes 6 unstable
    model = tiny_model(config)
    monkeypatch.setattr(host_limits, "cgroup_room", lambda: None)
    reference = FlexiCache.from_model(model, token_budget=8, page_size=4)
    expected = generate(model, reference)
    needed = reference.stats()["host_reserved_bytes"]
    assert reference.stats()["unstable_heads"] == 6 and needed == 18 * 2 * (10 + 64) * 2 * 4 * 8 * 8
    cache = FlexiCache.from_model(model, token_budget=8, page_size=4)
    monkeypatch.setattr(host_limits, "read_meminfo", lambda: {"MemAvailable": HEADROOM_BYTES + needed - 1})
    with pytest.raises(HostMemoryError, match=r"stable heads \(18 KV heads x batch 2 x 40 tokens"):
        generate(model, cache)
    monkeypatch.setattr(host_limits, "read_meminfo", lambda: {"MemAvailable": HEADROOM_BYTES + needed})
    assert torch.equal(generate(model, cache), expected)


def test_what_a_reused_block_held_before_changes_nothing(monkeypatch):
    """A pooled block comes back with its previous owner's bytes (NaN here, the worst of them): a generation over
    such a host tier equals one over a zeroed tier. (The prefill copies a request's partial tail page from the tier
    to the device, its unwritten tokens included; attention must not read past a page's length.)"""
    config = tiny_config("llama", group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=1)
    ids, mask = left_pad([random_prompt(150, seed=3), random_prompt(97, seed=4)])
    zeroed = host_tier.HostTier._buffers

    def stale(self, shape, dtype):
        keys, values = zeroed(self, shape, dtype)
        return keys.fill_(float("nan")), values.fill_(float("nan"))

    runs = []
    for buffers in (zeroed, stale):
        monkeypatch.setattr(host_tier.HostTier, "_buffers", buffers)
        cache = FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=32, page_size=8)
        runs.append(greedy(model, ids, cache, mask, 12, logits=True))
    assert torch.equal(runs[0][0], runs[1][0])
    assert all(torch.equal(a, b) for a, b in zip(runs[0][1], runs[1][1]))
