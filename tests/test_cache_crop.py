"""Crop, batch_select_indices and batch_repeat_interleave in place (flexicache.storage_ops): the state they leave
equals that of a cache that was fed only the kept tokens / requests, decoding on from it gives that cache's outputs,
nothing is read back densely, and assisted generation (transformers crops after rejected candidates) gives
DynamicCache's tokens at a covering budget."""

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
from flexicache.layer import FlexiLayer
from flexicache.storage import LayerStorage

NUM_LAYERS, NUM_KV, GROUP, HEAD_DIM = 2, 2, 2, 4


def chunk_inputs(generator: torch.Generator, batch: int, length: int) -> tuple[list, list, list]:
    """Random per-layer ``(q, k, v)`` of one chunk."""
    def randn(*shape):
        return torch.randn(*shape, generator=generator, dtype=torch.float64)

    return ([randn(batch, NUM_KV * GROUP, length, HEAD_DIM) for _ in range(NUM_LAYERS)],
            [randn(batch, NUM_KV, length, HEAD_DIM) for _ in range(NUM_LAYERS)],
            [randn(batch, NUM_KV, length, HEAD_DIM) for _ in range(NUM_LAYERS)])


def prefill(generator: torch.Generator, lengths: list[int]) -> tuple[torch.Tensor, tuple]:
    """A left-padded prefill chunk of prompts of ``lengths`` tokens: its 2-D mask and per-layer inputs."""
    mask = left_pad([torch.ones(length, dtype=torch.long) for length in lengths])[1]
    return mask, chunk_inputs(generator, len(lengths), mask.shape[1])


def make_driver(case: dict, seed: int = 0, principal_bounds: bool = False) -> Driver:
    """The page bookkeeping is compared with a cache fed fewer tokens, whose principal axes (taken from its own first
    chunk) would differ: boxes in the model's axes unless ``principal_bounds`` (see
    :func:`test_a_crop_keeps_the_boxes_in_the_caches_principal_axes`)."""
    config = tiny_config(group=GROUP, num_kv_heads=NUM_KV, num_layers=NUM_LAYERS, head_dim=HEAD_DIM)
    cache = checked(FlexiCache(config, profile=HeadProfile(NUM_LAYERS, NUM_KV, HEAD_DIM, case["unstable"]),
                               token_budget=case["budget"], page_size=case["page_size"],
                               rerank_interval=case["interval"], principal_bounds=principal_bounds,
                               max_cache_len=case.get("max_cache_len")))
    return Driver(config, cache, seed=seed)


def test_a_crop_keeps_the_boxes_in_the_caches_principal_axes() -> None:
    """With principal_bounds the axes stay those of the prompt; every page box (the new last page's refolded) is that
    of the kept tokens in those axes, and selecting and repeating requests carries each request's axes along."""
    case = {"unstable": [(0, 1)], "budget": 8, "page_size": 2, "interval": 3}
    driver = make_driver(case, principal_bounds=True)
    driver.prefill([13, 9])
    for _ in range(4):
        driver.decode()
    axes = [layer.storage.basis.matrix.clone() for layer in driver.cache.layers]
    driver.crop(5)
    check_layer_state(driver, driver.cache, settled=False)
    assert all(torch.equal(layer.storage.basis.matrix, kept) for layer, kept in zip(driver.cache.layers, axes))
    driver.decode()
    check_layer_state(driver, driver.cache)
    driver.cache.batch_select_indices(torch.tensor([1, 0]))
    assert all(torch.equal(layer.storage.basis.matrix, kept[[1, 0]]) for layer, kept in zip(driver.cache.layers, axes))


def feed(driver: Driver, chunks: list[tuple[torch.Tensor, tuple]], rows: torch.Tensor | None = None,
         length: int | None = None) -> None:
    """Run ``chunks`` (2-D mask, per-layer q/k/v), only requests ``rows`` and only the first ``length`` logical
    positions when given."""
    fed = 0
    for mask, (q, k, v) in chunks:
        take = mask.shape[1] if length is None else min(mask.shape[1], length - fed)
        if take <= 0:
            return
        pick = (lambda t: t[rows]) if rows is not None else (lambda t: t)
        driver.chunk(pick(mask[:, :take]), q=[pick(t[:, :, :take]) for t in q], k=[pick(t[:, :, :take]) for t in k],
                     v=[pick(t[:, :, :take]) for t in v])
        fed += take


def assert_same_state(ours: FlexiCache, theirs: FlexiCache, compare_selection: str | None) -> None:
    """Counts, validity, every token, page min/max (empty beyond the pages in use), the host tiers' full pages and
    the stable tail slots agree; our selections hold only full pages, once each, and equal theirs if asked:
    ``"pages"`` (the same pages, in any slots) or ``"slots"`` (slot by slot, with their scores)."""
    page_size = ours.settings.page_size
    assert ours.get_seq_length() == theirs.get_seq_length()
    assert torch.equal(ours.sequence.num_tokens_host, theirs.sequence.num_tokens_host)
    assert torch.equal(ours.sequence.logical_valid(), theirs.sequence.logical_valid())
    counts = ours.sequence.num_tokens_host
    for mine, other in zip(ours.layers, theirs.layers):
        for a, b in zip(mine.read_logical(), other.read_logical()):
            assert torch.equal(a, b)
        width = min(mine.storage.meta.kmin.shape[2], other.storage.meta.kmin.shape[2])
        for request, tokens in enumerate(counts.tolist()):
            pages, full = -(-tokens // page_size), max(tokens - 1, 0) // page_size
            for name in ("kmin", "kmax"):
                a, b = getattr(mine.storage.meta, name)[request], getattr(other.storage.meta, name)[request]
                assert torch.equal(a[:, :width], b[:, :width]), (mine.layer_idx, request, name)
                assert bool(a[:, pages:].isinf().all()), "pages past the end are empty"
            off_a, off_b = mine.storage.offloaded, other.storage.offloaded
            if off_a is None:
                continue
            heads = len(mine.stable_heads)
            assert torch.equal(off_a.host.k[request, :, :full], off_b.host.k[request, :, :full])
            assert torch.equal(off_a.host.v[request, :, :full], off_b.host.v[request, :, :full])
            for local in range(heads):
                row = request * heads + local
                tail_a, tail_b = (off.base + (row + 1) * off.slots_per_row - 1 for off in (off_a, off_b))
                length = tokens - (pages - 1) * page_size if tokens else 0
                assert torch.equal(off_a.pool.k[tail_a, :length], off_b.pool.k[tail_b, :length])
                assert torch.equal(off_a.pool.v[tail_a, :length], off_b.pool.v[tail_b, :length])
                chosen = [page for page in off_a.selected[row].tolist() if page >= 0]
                assert len(set(chosen)) == len(chosen) and all(0 <= page < full for page in chosen), chosen
                if compare_selection == "pages":
                    assert sorted(chosen) == sorted(page for page in off_b.selected[row].tolist() if page >= 0)
                elif compare_selection == "slots":
                    assert torch.equal(off_a.selected[row], off_b.selected[row])
                    assert torch.equal(off_a.selected_scores[row], off_b.selected_scores[row])


def decode_both(drivers: tuple[Driver, Driver], generator: torch.Generator, steps: int) -> None:
    """Decode both with the same inputs; their outputs must agree (selections are the same once reranked)."""
    batch = drivers[0].attention_mask.shape[0]
    for _ in range(steps):
        q, k, v = chunk_inputs(generator, batch, 1)
        for driver in drivers:
            driver.chunk(torch.ones(batch, 1, dtype=torch.long), q=q, k=k, v=v)
        for a, b in zip(drivers[0].outputs, drivers[1].outputs):
            torch.testing.assert_close(a, b, rtol=0, atol=1e-12)
        check_layer_state(drivers[0], drivers[0].cache)


@st.composite
def crop_case(draw):
    page_size = draw(st.sampled_from([2, 4, 8]))
    return {"page_size": page_size, "budget": draw(st.integers(2, 5)) * page_size,
            "lengths": [draw(st.integers(1, 40)) for _ in range(draw(st.integers(1, 3)))],
            "extend": draw(st.integers(0, 9)), "decode": draw(st.integers(0, 20)), "crop": draw(st.integers(1, 30)),
            "unstable": draw(st.sampled_from([[], [(0, 0)], [(0, 1), (1, 0)], [(0, 0), (0, 1)]])),
            "interval": draw(st.sampled_from([1, 1, 2, 5])), "seed": draw(st.integers(0, 1000))}


@given(crop_case())
def test_a_crop_leaves_the_state_of_a_cache_that_never_saw_the_cropped_tokens(case: dict) -> None:
    """Prefill (left padded), an extend chunk, decode steps, then a crop of any length (within the tail page, to a
    page boundary, whole pages back, into the prompt and its padding): the state equals a cache fed only the kept
    positions; with reranks at every step, decoding on gives its outputs too; at other intervals every decode step
    lists min(K, pages) pages per row (the stable heads rerank first where the crop took selected pages) and equals
    attention over the pages it lists."""
    generator = torch.Generator().manual_seed(case["seed"])
    batch, chunks = len(case["lengths"]), [prefill(generator, case["lengths"])]
    if case["extend"] > 1:
        chunks.append((torch.ones(batch, case["extend"], dtype=torch.long),
                       chunk_inputs(generator, batch, case["extend"])))
    chunks += [(torch.ones(batch, 1, dtype=torch.long), chunk_inputs(generator, batch, 1))
               for _ in range(case["decode"])]
    total = sum(mask.shape[1] for mask, _ in chunks)
    keep = total - case["crop"]
    kept_mask = torch.cat([mask for mask, _ in chunks], dim=1)[:, :max(keep, 0)]
    if keep < 1 or int(kept_mask.sum(1).min()) == 0:
        return  # every request keeps a real token (a crop of everything resets: tested below)
    ours, theirs = make_driver(case), make_driver(case)
    feed(ours, chunks)
    ours.crop(case["crop"])
    feed(theirs, chunks, length=keep)
    assert_same_state(ours.cache, theirs.cache, compare_selection=None)
    check_layer_state(ours, ours.cache, settled=False)
    if case["interval"] == 1:  # both rerank at every step: the same selections, the same outputs
        decode_both((ours, theirs), generator, steps=2 * case["page_size"] + 1)
        assert_same_state(ours.cache, theirs.cache, compare_selection="pages")
        return
    for _ in range(2 * case["page_size"] + 1):  # every step keeps the backends' contract (checked) and is exact
        ours.decode()
        for layer_idx in range(NUM_LAYERS):
            torch.testing.assert_close(ours.outputs[layer_idx], expected_decode(ours, ours.cache, layer_idx, False),
                                       rtol=0, atol=1e-12)
        check_layer_state(ours, ours.cache)


@st.composite
def select_case(draw):
    page_size = draw(st.sampled_from([2, 4]))
    batch = draw(st.integers(1, 3))
    return {"page_size": page_size, "budget": draw(st.integers(2, 4)) * page_size, "interval": draw(st.integers(1, 4)),
            "lengths": [draw(st.integers(1, 30)) for _ in range(batch)], "decode": draw(st.integers(0, 12)),
            "rows": draw(st.lists(st.integers(0, batch - 1), min_size=1, max_size=4)),
            "unstable": draw(st.sampled_from([[], [(0, 0)], [(0, 1), (1, 0)]])), "seed": draw(st.integers(0, 1000)),
            "max_cache_len": draw(st.sampled_from([None, 96]))}


@given(select_case())
def test_selected_requests_hold_the_state_of_a_cache_of_those_requests_alone(case: dict) -> None:
    """batch_select_indices (any order, repeats) leaves exactly the state a cache fed only those requests has,
    selections and rerank phase included (buffers sized by ``max_cache_len`` or grown), and decoding on gives its
    outputs."""
    generator = torch.Generator().manual_seed(case["seed"])
    batch, chunks = len(case["lengths"]), [prefill(generator, case["lengths"])]
    chunks += [(torch.ones(batch, 1, dtype=torch.long), chunk_inputs(generator, batch, 1))
               for _ in range(case["decode"])]
    rows = torch.tensor(case["rows"])
    ours, theirs = make_driver(case), make_driver(case)
    feed(ours, chunks)
    ours.select(rows)
    feed(theirs, chunks, rows=rows)
    assert_same_state(ours.cache, theirs.cache, compare_selection="slots")
    decode_both((ours, theirs), generator, steps=case["page_size"] + 2)
    assert_same_state(ours.cache, theirs.cache, compare_selection="slots")


def test_repeat_interleave_is_selecting_each_request_repeatedly() -> None:
    case = {"page_size": 4, "budget": 8, "interval": 2, "unstable": [(0, 1)]}
    generator = torch.Generator().manual_seed(3)
    chunks = [(torch.ones(2, 19, dtype=torch.long), chunk_inputs(generator, 2, 19))]
    ours, theirs = make_driver(case), make_driver(case)
    for driver in (ours, theirs):
        feed(driver, chunks)
    ours.repeat(3)
    theirs.select(torch.tensor([0, 0, 0, 1, 1, 1]))
    assert_same_state(ours.cache, theirs.cache, compare_selection="slots")
    decode_both((ours, theirs), generator, steps=6)


@pytest.mark.parametrize("operation", ["crop", "select", "repeat"])
def test_cache_operations_read_nothing_back_densely(operation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """No operation reads the KV back (a dense copy of every layer); select/repeat copy one layer at a time."""
    config = tiny_config(num_layers=3)
    model = tiny_model(config)
    cache = FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=16, page_size=4)
    ids, mask = left_pad([random_prompt(40, seed=1), random_prompt(25, seed=2)])
    greedy(model, ids, cache, mask, 6)

    def refused(*args, **kwargs):
        raise AssertionError("a cache operation read the KV back densely")

    monkeypatch.setattr(FlexiLayer, "read_logical", refused)
    monkeypatch.setattr(LayerStorage, "read_logical", refused)
    alive: list[int] = []
    original = LayerStorage.__init__

    def counted(self, *args, **kwargs):
        original(self, *args, **kwargs)
        alive.append(sum(layer.storage is not None for layer in cache.layers))

    monkeypatch.setattr(LayerStorage, "__init__", counted)
    {"crop": lambda: cache.crop(-9), "select": lambda: cache.batch_select_indices(torch.tensor([1, 0, 1])),
     "repeat": lambda: cache.batch_repeat_interleave(2)}[operation]()
    assert alive == ([] if operation == "crop" else [3, 3, 3])  # each new storage replaces its layer's before the next


@pytest.mark.parametrize("operation", ["crop", "select"])
def test_an_operation_that_fails_part_way_resets_the_cache(operation: str, monkeypatch: pytest.MonkeyPatch) -> None:
    """A crop or selection whose second layer fails (e.g. out of memory) would leave layers that disagree: the cache
    is reset before the error goes on, and the next prompt generates as on a fresh cache."""
    from flexicache import cache as cache_module

    config = tiny_config(num_layers=3)
    model = tiny_model(config)
    cache = FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=16, page_size=4)
    ids, mask = left_pad([random_prompt(40, seed=1), random_prompt(25, seed=2)])
    greedy(model, ids, cache, mask, 6)
    name = {"crop": "crop_storage", "select": "select_requests"}[operation]
    original, calls = getattr(cache_module, name), []

    def failing_on_the_second_layer(*args, **kwargs):
        calls.append(1)
        if len(calls) == 2:
            raise torch.OutOfMemoryError("no room")
        return original(*args, **kwargs)

    monkeypatch.setattr(cache_module, name, failing_on_the_second_layer)
    with pytest.raises(torch.OutOfMemoryError):
        {"crop": lambda: cache.crop(-9), "select": lambda: cache.batch_select_indices(torch.tensor([1, 0]))}[operation]()
    assert cache.get_seq_length() == 0 and not cache.holds_tokens()
    monkeypatch.setattr(cache_module, name, original)
    fresh = FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=16, page_size=4)
    assert torch.equal(greedy(model, ids, cache, mask, 6), greedy(model, ids, fresh, mask, 6))


def test_crop_and_select_arguments() -> None:
    config = tiny_config(num_layers=2)
    model = tiny_model(config)
    cache = FlexiCache.from_model(model, token_budget=32, page_size=8)
    ids, mask = left_pad([random_prompt(12, seed=1), random_prompt(9, seed=2)])
    greedy(model, ids, cache, mask, 3)
    length = cache.get_seq_length()
    for bad, error, text in ((2.0, ValueError, "tokens_to_remove must be an integer"),
                             (True, ValueError, "tokens_to_remove must be an integer"),
                             (4, ValueError, "negative number")):
        with pytest.raises(error, match=text):
            cache.crop(bad)
    for bad, error, text in ((torch.tensor([0.0]), ValueError, "1-D tensor of request positions"),
                             (torch.tensor([[0]]), ValueError, "1-D tensor"),
                             (torch.tensor([2]), IndexError, "out of range for a batch of 2"),
                             (torch.tensor([-3]), IndexError, "out of range"),
                             (torch.tensor([], dtype=torch.long), ValueError, "selects no request"),
                             (torch.tensor([True]), ValueError, "one entry per request")):
        with pytest.raises(error, match=text):
            cache.batch_select_indices(bad)
    for bad, error in ((0, ValueError), (1.5, ValueError)):
        with pytest.raises(error, match="repeats"):
            cache.batch_repeat_interleave(bad)
    assert cache.get_seq_length() == length and cache.sequence.batch_size == 2  # refusals change nothing
    cache.batch_select_indices(torch.tensor([True, False]))
    cache.batch_select_indices([-1])
    assert cache.sequence.batch_size == 1
    cache.crop(-length - 5)  # more than it holds: empty, like DynamicCache
    assert cache.get_seq_length() == 0
    assert torch.equal(greedy(model, ids[:1], cache, mask[:1], 4),
                       greedy(model, ids[:1], dense_cache(model), mask[:1], 4))


def test_assisted_generation_gives_dynamic_cache_tokens_at_a_covering_budget(monkeypatch: pytest.MonkeyPatch) -> None:
    """transformers verifies an assistant's candidates in one forward and crops the rejected ones: the tokens equal
    DynamicCache's (and plain greedy's), through crops of every length."""
    config = tiny_config(num_layers=3)
    model = tiny_model(config, seed=4)
    assistant = tiny_model(tiny_config(num_layers=1), seed=9)
    assistant.generation_config.num_assistant_tokens = 5
    crops: list[int] = []
    original = FlexiCache.crop
    monkeypatch.setattr(FlexiCache, "crop", lambda self, n: (crops.append(n), original(self, n))[1])
    ids = random_prompt(30, seed=5).view(1, -1)

    def assisted(cache) -> torch.Tensor:
        return model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=24,
                              do_sample=False, assistant_model=assistant)

    cache = FlexiCache.from_model(model, profile=mixed_profile(config), token_budget=256, page_size=4,
                                  rerank_interval=2)
    ours = assisted(cache)
    assert torch.equal(ours, assisted(dense_cache(model)))
    assert torch.equal(ours, greedy(model, ids, dense_cache(model), None, 24))
    assert sum(1 for n in crops if n < 0) >= 3, crops  # candidates were rejected and cropped
    assert cache.get_seq_length() == ours.shape[1] - 1
    # the cropped pages' slots served the tokens after them: the unstable heads' slots never exceed the pages
    # reached (the final length plus one verification's candidates)
    reached = -(-(cache.get_seq_length() + 6) // 4)
    for layer in cache.layers:
        storage = layer.storage
        stable_slots = len(layer.stable_heads) * storage.offloaded.slots_per_row if storage.offloaded else 0
        assert storage.pool.used <= stable_slots + len(layer.unstable_heads) * reached, layer.layer_idx
