"""Cache operations: a second generate on a non-empty cache, crop, batch_select_indices, batch_repeat_interleave
and reset give what a DynamicCache doing the same gives."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    Driver,
    check_layer_state,
    checked,
    dense_cache,
    expected_decode,
    greedy,
    left_pad,
    mixed_profile,
    random_prompt,
    tiny_config,
    tiny_model,
)
from hypothesis import given
from hypothesis import strategies as st

from flexicache import FlexiCache, HeadProfile


def assert_same_contents(cache: FlexiCache, reference, mask: torch.Tensor) -> None:
    """Every real token's K/V in ``cache`` equals the DynamicCache's; lengths agree."""
    assert cache.get_seq_length() == reference.get_seq_length() == mask.shape[1]
    for layer, dense in zip(cache.layers, reference.layers):
        keys, values = layer.read_logical()
        assert keys.shape == dense.keys.shape
        real = mask.bool()
        assert torch.equal(keys[real.unsqueeze(1).expand_as(keys[..., 0])],
                           dense.keys[real.unsqueeze(1).expand_as(keys[..., 0])])
        assert torch.equal(values[real.unsqueeze(1).expand_as(values[..., 0])],
                           dense.values[real.unsqueeze(1).expand_as(values[..., 0])])


def run_both(model, caches, ids, mask, new_tokens):
    outs = [greedy(model, ids, cache, mask, new_tokens, logits=True) for cache in caches]
    (ours, our_logits), (theirs, their_logits) = outs
    assert torch.equal(ours, theirs)
    for a, b in zip(our_logits, their_logits):
        torch.testing.assert_close(a, b, rtol=0, atol=1e-10)
    return ours


@pytest.mark.parametrize("family", ["llama", "qwen2"])
def test_operations_match_dynamic_cache(family):
    config = tiny_config(family, group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=4)
    ids, mask = left_pad([random_prompt(30, seed=1), random_prompt(18, seed=2)])
    cache = checked(FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=256, page_size=8,
                                          rerank_interval=3))
    reference = dense_cache(model)
    both = (cache, reference)

    def extend(sequences, mask, extra):
        new = torch.stack([random_prompt(extra, seed=int(s.sum())) for s in sequences])
        return torch.cat([sequences, new], 1), torch.cat([mask, torch.ones_like(new)], 1)

    # 1. first generate
    out = run_both(model, both, ids, mask, 10)
    mask = torch.cat([mask, torch.ones(2, 10, dtype=torch.long)], 1)
    assert_same_contents(cache, reference, mask[:, :-1])
    # 2. second generate on the non-empty cache: the uncached tokens arrive as one multi-token chunk
    ids, mask = extend(out, mask, 5)
    out = run_both(model, both, ids, mask, 8)
    mask = torch.cat([mask, torch.ones(2, 8, dtype=torch.long)], 1)
    assert_same_contents(cache, reference, mask[:, :-1])
    # 3. crop, then continue from the cropped length (a 4-token extend)
    for c in both:
        c.crop(-7)
    kept = cache.get_seq_length()
    assert kept == out.shape[1] - 1 - 7
    assert_same_contents(cache, reference, mask[:, :kept])
    out = run_both(model, both, out[:, :kept + 4], mask[:, :kept + 4], 6)
    mask = torch.cat([mask[:, :kept + 4], torch.ones(2, 6, dtype=torch.long)], 1)
    # 4. reorder the batch, then decode on
    order = torch.tensor([1, 0])
    for c in both:
        c.batch_select_indices(order)
    out, mask = out[order], mask[order]
    assert_same_contents(cache, reference, mask[:, :-1])
    out = run_both(model, both, out, mask, 6)
    mask = torch.cat([mask, torch.ones(2, 6, dtype=torch.long)], 1)
    # 5. keep one request, repeat it twice
    for c in both:
        c.batch_select_indices(torch.tensor([1]))
        c.batch_repeat_interleave(2)
    out, mask = out[[1, 1]], mask[[1, 1]]
    assert_same_contents(cache, reference, mask[:, :-1])
    out = run_both(model, both, out, mask, 5)
    assert torch.equal(out[0], out[1])
    # 6. reset: a fresh generation
    for c in both:
        c.reset()
    assert cache.get_seq_length() == 0
    ids, mask = left_pad([random_prompt(12, seed=5), random_prompt(25, seed=6), random_prompt(3, seed=7)])
    run_both(model, both, ids, mask, 9)


def test_operations_keep_every_token_with_sparse_budget():
    """With a budget far below the context the text differs from dense, but no op may lose or move a token: the
    reference is a DynamicCache holding the same K/V, doing the same ops."""
    config = tiny_config("llama", group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=5)
    ids, mask = left_pad([random_prompt(70, seed=1), random_prompt(45, seed=2)])
    cache = checked(FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=16, page_size=4,
                                          rerank_interval=5))
    out = greedy(model, ids, cache, mask, 12)
    mask = torch.cat([mask, torch.ones(2, 12, dtype=torch.long)], 1)[:, :-1]
    reference = dense_cache(model)
    for index, layer in enumerate(cache.layers):
        keys, values = layer.read_logical()
        reference.update(keys.clone(), values.clone(), index)
    for c in (cache, reference):
        c.crop(-9)
    mask = mask[:, :-9]
    assert_same_contents(cache, reference, mask)
    for c in (cache, reference):
        c.batch_select_indices(torch.tensor([1, 0]))
    out, mask = out[[1, 0], : mask.shape[1]], mask[[1, 0]]
    assert_same_contents(cache, reference, mask)
    for c in (cache, reference):
        c.batch_repeat_interleave(2)
    out, mask = out.repeat_interleave(2, 0), mask.repeat_interleave(2, 0)
    assert_same_contents(cache, reference, mask)
    reranks = cache.stats()["reranks_stable"]
    more = greedy(model, torch.cat([out, out[:, -3:]], 1), cache, torch.cat([mask, mask[:, -3:]], 1), 10)
    assert torch.equal(more[0], more[1]) and torch.equal(more[2], more[3])  # repeated requests stay identical
    assert cache.stats()["reranks_stable"] > reranks  # the stable heads reranked after the rebuild


def test_page_locked_read_back_equals_the_plain_one():
    """``read_tokens`` from a page-locked tier (row by row, or the whole tier at once) gives the plain path's tokens
    and leaves the tier as it was (forced on the CPU: the copies are the same calls as on CUDA)."""
    config = tiny_config("llama", group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=3)
    ids, mask = left_pad([random_prompt(70, seed=1), random_prompt(45, seed=2)])
    cache = checked(FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=16, page_size=4))
    greedy(model, ids, cache, mask, 6)
    num_tokens = cache.sequence.num_tokens_host
    for layer in cache.layers:
        offloaded = layer.storage.offloaded
        if offloaded is None:
            continue
        host_before = (offloaded.host.k.clone(), offloaded.host.v.clone())
        capacity = offloaded.host.k.shape[2]
        for num_pages in (int((num_tokens.max() + 3) // 4), capacity):
            plain = offloaded.read_tokens(num_pages, num_tokens)
            offloaded.host.pin_memory = True
            try:
                locked = offloaded.read_tokens(num_pages, num_tokens)
            finally:
                offloaded.host.pin_memory = False
            assert torch.equal(plain[0], locked[0]) and torch.equal(plain[1], locked[1])
        assert torch.equal(offloaded.host.k, host_before[0]) and torch.equal(offloaded.host.v, host_before[1])


def test_crop_arguments():
    config = tiny_config("llama", group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config)
    cache = FlexiCache.from_model(model, token_budget=32, page_size=8)
    cache.crop(-3)  # empty cache: nothing to do
    greedy(model, random_prompt(10, seed=0).view(1, -1), cache, None, 3)
    length = cache.get_seq_length()
    cache.crop(0)
    assert cache.get_seq_length() == length
    with pytest.raises(ValueError, match="negative"):
        cache.crop(5)


@st.composite
def op_sequence(draw):
    page_size = draw(st.sampled_from([2, 4, 8]))
    lengths = [draw(st.integers(1, 30)) for _ in range(draw(st.integers(1, 3)))]
    ops = draw(st.lists(st.one_of(
        st.tuples(st.just("decode"), st.integers(1, 12)),
        st.tuples(st.just("extend"), st.integers(2, 9)),
        st.tuples(st.just("crop"), st.integers(1, 12)),
        st.tuples(st.just("select"), st.integers(0, 2**31 - 1)),
        st.tuples(st.just("repeat"), st.integers(1, 2)),
    ), min_size=2, max_size=6))
    return {"page_size": page_size, "budget": draw(st.integers(2, 5)) * page_size, "lengths": lengths, "ops": ops,
                "interval": draw(st.integers(1, 5)), "unstable": draw(st.sampled_from([[], [(0, 0)], [(0, 1), (1, 0)]])),
                "seed": draw(st.integers(0, 1000))}


@given(op_sequence())
def test_random_operation_sequences_keep_state_and_sparse_outputs_exact(case):
    """Layer-level: any mix of decode, extend, crop (into the padding too), reorder and repeat keeps every token,
    the page metadata and slots exact, and every decode output equal to attention over the selected pages."""
    config = tiny_config(group=2, num_kv_heads=2, num_layers=2, head_dim=4)
    cache = checked(FlexiCache(config, profile=HeadProfile(2, 2, 4, case["unstable"]), token_budget=case["budget"],
                               page_size=case["page_size"], rerank_interval=case["interval"]))
    driver = Driver(config, cache, seed=case["seed"])
    driver.prefill(case["lengths"])
    check_layer_state(driver, cache)
    for op, arg in case["ops"]:
        settled = True
        if op == "decode":
            for _ in range(arg):
                driver.decode()
                for layer_idx in range(2):
                    torch.testing.assert_close(driver.outputs[layer_idx],
                                               expected_decode(driver, cache, layer_idx, reranked=False),
                                               rtol=0, atol=1e-12)
        elif op == "extend":
            driver.chunk(torch.ones(driver.attention_mask.shape[0], arg, dtype=torch.long))
        elif op == "crop":
            if arg >= driver.attention_mask.shape[1] or int(driver.attention_mask[:, :-arg].sum(1).min()) == 0:
                continue  # keep at least one real token per request
            driver.crop(arg)
            settled = False
        elif op == "select":
            batch = driver.attention_mask.shape[0]
            generator = torch.Generator().manual_seed(arg)
            driver.select(torch.randint(0, batch, (int(torch.randint(1, 4, (1,), generator=generator)),),
                                        generator=generator))
            settled = False
        elif op == "repeat":
            driver.repeat(arg)
            settled = False
        check_layer_state(driver, cache, settled=settled)


def cache_buffers(cache: FlexiCache) -> list[tuple[int, tuple[int, ...]]]:
    """(address, shape) of every buffer a growth would replace: pools, page tables, metadata, host tiers."""
    tensors = []
    for storage in (layer.storage for layer in cache.layers):
        tensors += [storage.pool.k, storage.pool.v, storage.meta.kmin, storage.meta.kmax]
        if storage.resident is not None:
            tensors.append(storage.resident.table)
        if storage.offloaded is not None:
            tensors += [storage.offloaded.host.k, storage.offloaded.host.v]
    return [(tensor.data_ptr(), tuple(tensor.shape)) for tensor in tensors]


def assert_reserved(cache: FlexiCache, batch: int, pages: int) -> None:
    """Every layer holds exactly ``pages`` pages per row in its min/max, page table and host tier, and pool slots
    for every page of its unstable heads plus the stable heads' K + C."""
    for layer in cache.layers:
        unstable, stable, storage = len(layer.unstable_heads), len(layer.stable_heads), layer.storage
        stable_slots = cache.settings.pages_per_head + cache.settings.num_standby_pages
        assert storage.pool.k.shape[0] == batch * (unstable * pages + stable * stable_slots)
        assert storage.meta.kmin.shape[2] == pages
        assert storage.resident is None or storage.resident.table.shape[2] == pages
        assert storage.offloaded is None or storage.offloaded.host.k.shape[2] == pages


def test_max_cache_len_sizes_every_buffer_up_front():
    """With ``max_cache_len`` = prompt + new tokens, a chunked prefill and the decode after it never reallocate a
    buffer and generate exactly what a cache growing as it goes generates; a longer request still grows them."""
    config = tiny_config(group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=4)
    ids, mask = left_pad([random_prompt(45, seed=1), random_prompt(37, seed=2)])
    new_tokens, page_size = 12, 8

    def make(max_cache_len):
        return checked(FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=32,
                                             page_size=page_size, rerank_interval=3, max_cache_len=max_cache_len))

    sized, growing = make(ids.shape[1] + new_tokens), make(None)
    outputs = []
    for cache in (sized, growing):
        with torch.no_grad():
            first = model(input_ids=ids[:, :20], attention_mask=mask[:, :20], past_key_values=cache)  # a chunk
        buffers = cache_buffers(cache)
        sequences = greedy(model, ids, cache, mask, new_tokens)
        outputs.append(sequences)
        assert first.logits.isfinite().all()
        if cache is sized:
            assert cache_buffers(cache) == buffers  # nothing reallocated after the first chunk
            assert_reserved(cache, ids.shape[0], -(-(ids.shape[1] + new_tokens) // page_size))
    assert torch.equal(outputs[0], outputs[1])
    before = cache_buffers(sized)
    longer_mask = torch.cat([mask, torch.ones(mask.shape[0], new_tokens, dtype=mask.dtype)], dim=1)
    longer = greedy(model, outputs[0], sized, longer_mask, 10)  # past max_cache_len: the buffers grow
    assert longer.shape[1] == outputs[0].shape[1] + 10 and cache_buffers(sized) != before
