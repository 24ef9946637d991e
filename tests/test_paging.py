"""Paging property tests: nothing is lost, page metadata is exact, device slots hold what they claim.

A FlexiCache is driven layer by layer with random q/k/v (prefill with left padding, decode steps, a multi-token
extend, more decode steps); a DynamicCache receiving the same keys/values is the reference.
"""

from __future__ import annotations

import pytest
import torch
from conftest import Driver, check_layer_state, checked, mixed_profile, page_minmax, tiny_config
from hypothesis import given
from hypothesis import strategies as st

from flexicache import FlexiCache, HeadProfile
from flexicache.paging import PageMetadata, PagePool, ResidentPages, chunk_tokens, grow_dim
from flexicache.sequence import SequenceState, expand_ranges


@st.composite
def paging_case(draw):
    page_size = draw(st.sampled_from([1, 2, 4, 8, 16]))
    pages_per_head = draw(st.integers(2, 6))
    batch = draw(st.integers(1, 3))
    lengths = [draw(st.integers(1, 40)) for _ in range(batch)]
    num_kv = draw(st.integers(1, 3))
    num_layers = 2
    heads = [(layer, head) for layer in range(num_layers) for head in range(num_kv)]
    unstable = draw(st.lists(st.sampled_from(heads), unique=True))
    return {
        "page_size": page_size, "budget": pages_per_head * page_size, "lengths": lengths, "num_kv": num_kv,
        "group": draw(st.sampled_from([1, 2, 3])), "unstable": unstable, "rerank_interval": draw(st.integers(1, 8)),
        "decode1": draw(st.integers(0, 24)), "extend": draw(st.integers(0, 20)), "decode2": draw(st.integers(0, 12)),
        "extend_holes": draw(st.booleans()), "seed": draw(st.integers(0, 2**31 - 1)),
        "dtype": draw(st.sampled_from([torch.float32, torch.float64])),
    }


@given(paging_case())
def test_every_token_reads_back_and_metadata_is_exact(case):
    config = tiny_config(group=case["group"], num_kv_heads=case["num_kv"], num_layers=2, head_dim=4)
    profile = HeadProfile(2, case["num_kv"], 4, unstable_heads=case["unstable"])
    cache = checked(FlexiCache(config, profile=profile, token_budget=case["budget"], page_size=case["page_size"],
                               rerank_interval=case["rerank_interval"]))
    driver = Driver(config, cache, dtype=case["dtype"], seed=case["seed"])
    driver.prefill(case["lengths"])
    check_layer_state(driver, cache)
    for _ in range(case["decode1"]):
        driver.decode()
    check_layer_state(driver, cache)
    if case["extend"]:
        mask = torch.ones(len(case["lengths"]), case["extend"], dtype=torch.long)
        if case["extend_holes"]:  # arbitrary padding inside the chunk; its last token is real
            generator = torch.Generator().manual_seed(case["seed"])
            mask[:, :-1] = (torch.rand(mask.shape[0], case["extend"] - 1, generator=generator) < 0.7).long()
        driver.chunk(mask)
        check_layer_state(driver, cache)
    for _ in range(case["decode2"]):
        driver.decode()
        check_layer_state(driver, cache)


@pytest.mark.parametrize("page_size,budget,prompt,steps", [(16, 32, 5, 40), (4, 8, 3, 30), (4, 12, 9, 60)])
def test_sink_page_stays_selected_through_decode(page_size, budget, prompt, steps):
    """The sink is always in a stable head's set, even with few selection slots and rare reranks."""
    config = tiny_config(group=1, num_kv_heads=1, num_layers=1, head_dim=4)
    cache = checked(FlexiCache(config, profile=HeadProfile(1, 1, 4, []), token_budget=budget,
                               page_size=page_size, rerank_interval=64))
    driver = Driver(config, cache, seed=1)
    driver.prefill([prompt])
    for _ in range(steps):
        driver.decode()
        check_layer_state(driver, cache)


def test_sequence_plan_left_padding():
    state = SequenceState(page_size=4)
    valid = torch.tensor([[False, False, True, True, True], [True, True, True, True, True]])
    plan = state.plan_chunk(0, valid, 2, 5, torch.device("cpu"))
    assert plan.after.tolist() == [3, 5] and plan.before.tolist() == [0, 0]
    assert plan.batch.tolist() == [0, 0, 0, 1, 1, 1, 1, 1]
    assert plan.chunk_pos.tolist() == [2, 3, 4, 0, 1, 2, 3, 4]
    assert plan.page.tolist() == [0, 0, 0, 0, 0, 0, 0, 1] and plan.offset.tolist() == [0, 1, 2, 0, 1, 2, 3, 0]
    assert list(zip(plan.new_page_batch.tolist(), plan.new_page_index.tolist())) == [(0, 0), (1, 0), (1, 1)]
    assert state.plan_chunk(0, valid, 2, 5, torch.device("cpu")) is plan  # the other layers reuse the plan
    plan = state.plan_chunk(1, None, 2, 1, torch.device("cpu"))
    assert plan.is_single_token and plan.after.tolist() == [4, 6] and plan.offset.tolist() == [3, 1]
    assert plan.num_new_pages == 0
    assert state.logical_valid().tolist() == [[False, False, True, True, True, True], [True] * 6]
    with pytest.raises(RuntimeError, match="out of step"):
        state.plan_chunk(5, None, 2, 1, torch.device("cpu"))


@given(counts=st.lists(st.integers(0, 70), min_size=1, max_size=6), page_size=st.sampled_from([1, 4, 16]))
def test_decode_plan_is_the_general_plan_of_one_token(counts: list[int], page_size: int) -> None:
    """A decode step's shortcut plan lists the same writes and page openings as the general one, for any mix of
    request lengths (left padding makes them differ), including requests at a page boundary and empty ones."""
    state, before, cpu = SequenceState(page_size), torch.tensor(counts), torch.device("cpu")
    fast = state._decode_plan(before, before.clone(), cpu)
    general = state._chunk_plan(None, before, before.clone(), 1, cpu)
    for name in ("batch", "chunk_pos", "page", "offset", "new_page_batch", "new_page_index", "before", "after",
                 "before_host", "after_host"):
        assert torch.equal(getattr(fast, name), getattr(general, name)), name
    assert fast.is_single_token and general.is_single_token


@given(counts=st.lists(st.integers(1, 40), min_size=1, max_size=4), chunks=st.lists(st.integers(1, 3), max_size=6),
       peek=st.lists(st.booleans(), min_size=6, max_size=6))
def test_a_peeked_decode_plan_is_taken_over_only_by_the_next_decode_step(counts, chunks, peek) -> None:
    """peek_decode_plan changes nothing a caller sees: the next decode step takes the peeked plan (same writes as
    computing it then), a chunk of several tokens in between discards it, and lengths stay as without peeking."""
    cpu = torch.device("cpu")
    peeking, plain = SequenceState(4), SequenceState(4)
    valid = torch.ones(len(counts), max(counts), dtype=torch.bool)
    valid[:, : max(counts)] = torch.arange(max(counts)) >= (max(counts) - torch.tensor(counts)).unsqueeze(1)
    for state in (peeking, plain):
        state.plan_chunk(0, valid, len(counts), valid.shape[1], cpu)
    for index, length in enumerate([1, *chunks, 1, 1]):
        peeked = peeking.peek_decode_plan(cpu) if peek[index % len(peek)] else None
        assert peeking.num_chunks == plain.num_chunks and torch.equal(peeking.num_tokens, plain.num_tokens)
        got = peeking.plan_chunk(peeking.num_chunks, None, len(counts), length, cpu)
        expected = plain.plan_chunk(plain.num_chunks, None, len(counts), length, cpu)
        assert (got is peeked) == (peeked is not None and length == 1)
        for name in ("page", "offset", "new_page_batch", "new_page_index", "before", "after", "after_host"):
            assert torch.equal(getattr(got, name), getattr(expected, name)), name
    assert torch.equal(peeking.logical_valid(), plain.logical_valid())


def test_resident_pages_and_metadata_unit():
    state = SequenceState(page_size=2)
    pool = PagePool(2, 3, torch.float64, torch.device("cpu"))
    other = pool.allocate(3)  # another head class's slots come first: the table must point past them
    pages = ResidentPages(pool, 1, 2, 2)
    meta = PageMetadata(1, 2, 3, torch.float64, torch.device("cpu"), capacity=0)
    keys = torch.arange(2 * 5 * 3, dtype=torch.float64).view(1, 2, 5, 3) * torch.tensor([1.0, -1.0, 1.0])
    for start, stop in ((0, 3), (3, 4), (4, 5)):
        plan = state.plan_chunk(state.num_chunks, None, 1, stop - start, torch.device("cpu"))
        chunk = keys[:, :, start:stop].permute(0, 2, 1, 3)[plan.batch, plan.chunk_pos]
        pages.append(chunk, chunk * 2, plan)
        meta.append(chunk, plan)
    assert other == 0 and pool.used == 3 + 3 * 2 and not pool.k[:3].any()
    read_k, read_v = pages.read_tokens(3)
    assert torch.equal(read_k[:, :, :5], keys) and torch.equal(read_v[:, :, :5], 2 * keys)
    for head in range(2):
        kmin, kmax = page_minmax(keys[0, head], 2)
        assert torch.equal(meta.kmin[0, head, :3], kmin) and torch.equal(meta.kmax[0, head, :3], kmax)
    assert pages.page_slots(torch.tensor([[0, 2, -1], [1, -1, -1]])).tolist()[1][1:] == [-1, -1]


@given(batch=st.integers(1, 3), heads=st.integers(1, 3), length=st.integers(2, 40),
       page_size=st.sampled_from([1, 2, 4, 8, 16]), padded=st.booleans(), seed=st.integers(0, 2**31 - 1))
def test_a_prompt_without_padding_folds_its_pages_as_the_general_path_does(batch, heads, length, page_size, padded,
                                                                           seed):
    """A first chunk that fills every request alike (``starts_empty_rows``) takes the page-block shortcut of
    ``chunk_tokens`` and ``PageMetadata.append``: the same tokens and boxes as the general per-token path."""
    keys = torch.randn(batch, heads, length, 4, generator=torch.Generator().manual_seed(seed), dtype=torch.float64)
    valid = torch.ones(batch, length, dtype=torch.bool)
    if padded:  # the same count per request, at other positions: the general path for the tokens, not the boxes
        valid[:, 0] = False
    plan = SequenceState(page_size).plan_chunk(0, valid, batch, length, torch.device("cpu"))
    assert plan.starts_empty_rows
    tokens = chunk_tokens(keys, plan)
    assert torch.equal(tokens, keys.permute(0, 2, 1, 3)[plan.batch, plan.chunk_pos])
    shortcut = PageMetadata(batch, heads, 4, torch.float64, torch.device("cpu"), capacity=0)
    shortcut.append(tokens, plan)
    plan.__dict__["starts_empty_rows"] = False  # the cached property overridden: the general path
    general = PageMetadata(batch, heads, 4, torch.float64, torch.device("cpu"), capacity=0)
    general.append(tokens, plan)
    assert torch.equal(shortcut.kmin, general.kmin) and torch.equal(shortcut.kmax, general.kmax)


def test_a_prompt_with_uneven_requests_or_after_earlier_tokens_takes_the_general_path():
    state = SequenceState(page_size=4)
    valid = torch.tensor([[True, True, True], [False, True, True]])
    assert not state.plan_chunk(0, valid, 2, 3, torch.device("cpu")).starts_empty_rows
    assert not state.plan_chunk(1, None, 2, 5, torch.device("cpu")).starts_empty_rows
    assert not state.plan_chunk(2, None, 2, 1, torch.device("cpu")).starts_empty_rows


def test_grow_dim_keeps_contents_and_fills():
    tensor = torch.arange(6.0).view(2, 3)
    grown = grow_dim(tensor, 1, 4, fill=-1.0)  # the capacity policy may reserve more than asked
    assert grown.shape[0] == 2 and grown.shape[1] >= 4
    assert torch.equal(grown[:, :3], tensor) and bool((grown[:, 3:] == -1).all())
    assert grow_dim(tensor, 1, 2) is tensor and grow_dim(tensor, 1, 3) is tensor


def test_growth_leaves_headroom_after_a_large_jump():
    """A prefill-sized jump reserves a quarter more, so the next decode pages fit without a reallocation."""
    grown = grow_dim(torch.zeros(1, 0), 1, 2048)
    assert grown.shape[1] == 2048 + 512
    assert grow_dim(grown, 1, 2049) is grown and grow_dim(grown, 1, 2560) is grown
    assert grow_dim(grown, 1, 2561).shape[1] == 2561 + 640


def test_host_tier_reserves_decode_headroom_and_keeps_pages():
    from flexicache.offload import HostTier

    tier = HostTier(batch_size=2, num_heads=3, page_size=4, head_dim=8, dtype=torch.float32, pin_memory=False)
    tier.reserve(100)  # a prefill of 100 pages
    assert tier.k.shape == (2, 3, 164, 4, 8)  # at least 64 pages of headroom
    tier.k[:, :, :100] = torch.randn(2, 3, 100, 4, 8)
    before, storage = tier.k[:, :, :100].clone(), tier.k.data_ptr()
    tier.reserve(164)
    assert tier.k.data_ptr() == storage  # the decode pages after the prefill fit in place
    tier.reserve(400)
    assert tier.k.shape[2] == 500 and torch.equal(tier.k[:, :, :100], before)
    assert tier.nbytes_reserved == 2 * tier.k.numel() * 4


def test_host_tier_growth_is_all_or_nothing(monkeypatch: pytest.MonkeyPatch) -> None:
    """If the larger tier cannot be had (e.g. CUDA refuses to page-lock it, or it would not fit), keys and values keep
    their old size and contents: the kernels size both from the keys."""
    from flexicache.offload import HostTier

    tier = HostTier(batch_size=1, num_heads=2, page_size=4, head_dim=8, dtype=torch.float32, pin_memory=False)
    tier.reserve(10)
    tier.k.fill_(1.0)
    tier.v.fill_(2.0)

    def refused(shape, dtype):
        raise RuntimeError("Could not page-lock 0.01 GiB of host memory")

    monkeypatch.setattr(tier, "_buffers", refused)
    with pytest.raises(RuntimeError, match="page-lock"):
        tier.reserve(200)
    assert tier.k.shape == tier.v.shape == (1, 2, 74, 4, 8)
    assert bool((tier.k == 1.0).all()) and bool((tier.v == 2.0).all())


@given(st.lists(st.tuples(st.integers(0, 50), st.integers(0, 6)), max_size=8))
def test_expand_ranges_lists_every_range_in_order(ranges: list[tuple[int, int]]) -> None:
    starts = torch.tensor([start for start, _ in ranges], dtype=torch.long)
    counts = torch.tensor([count for _, count in ranges], dtype=torch.long)
    owner, value = expand_ranges(starts, counts)
    expected = [(i, start + k) for i, (start, count) in enumerate(ranges) for k in range(count)]
    assert list(zip(owner.tolist(), value.tolist())) == expected


def _graphed_step_state(cache: FlexiCache) -> list[tuple]:
    """Per layer: pool slots in use, bytes counted to the host, the first new slot written for the recorded work."""
    state = []
    for layer in cache.layers:
        storage = layer.storage
        state.append((storage.pool.used, storage.offloaded.counters.bytes_d2h if storage.offloaded else 0,
                      int(storage.open_start) if storage.resident is not None else None))
    return state


def _prefilled(lengths: list[int]) -> Driver:
    config = tiny_config(num_kv_heads=2, num_layers=3)
    cache = FlexiCache(config, profile=mixed_profile(config), token_budget=8, page_size=4, cuda_graphs=False)
    driver = Driver(config, cache)
    driver.prefill(lengths)
    return driver


def test_a_graphed_steps_room_made_ahead_takes_no_slot_and_counts_nothing():
    """The room a whole-step graph's step needs (made a step ahead, StepGraphStore.prepare_next_step) leaves slots
    and counts to the step's own reservation: room then reservation equals the reservation alone, and room for a
    decode step that never comes (a chunk of several tokens first) leaves the next steps as without it."""
    lengths = [8, 5]  # the next token opens a page for request 0 and retires its full tail
    cpu = torch.device("cpu")
    ahead, alone, unused, plain = (_prefilled(lengths) for _ in range(4))
    for driver in (ahead, unused):
        plan = driver.cache.sequence.peek_decode_plan(cpu)
        assert plan.num_new_pages and plan.num_full_tails
        before = _graphed_step_state(driver.cache)
        for layer in driver.cache.layers:
            layer.make_graphed_step_room(plan)
        room = _graphed_step_state(driver.cache)
        assert [state[:2] for state in room] == [state[:2] for state in before]
        assert all(state[2] in (None, state[0]) for state in room)  # the first slot the step will take
    for driver in (ahead, alone):
        plan = driver.cache.sequence.peek_decode_plan(cpu)
        for layer in driver.cache.layers:
            layer.reserve_graphed_step(plan)
    assert _graphed_step_state(ahead.cache) == _graphed_step_state(alone.cache)
    for driver in (unused, plain):
        driver.chunk(torch.ones(2, 3, dtype=torch.long))  # the peeked decode plan never runs
        driver.decode()
        driver.decode()
    assert [state[:2] for state in _graphed_step_state(unused.cache)] == \
        [state[:2] for state in _graphed_step_state(plain.cache)]
    for layer in range(3):
        torch.testing.assert_close(unused.outputs[layer], plain.outputs[layer], rtol=0, atol=0)
    check_layer_state(unused, unused.cache)
