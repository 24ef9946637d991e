"""CUDA path: FlashInfer backend against the torch reference, and FlexiCache generation on the GPU.

Skipped without CUDA + FlashInfer; run on the GPU host (see BENCHMARKS.md for the command).
"""

from __future__ import annotations

import contextlib
import warnings

import pytest
import torch

flashinfer = pytest.importorskip("flashinfer") if torch.cuda.is_available() else None
pytestmark = [
    pytest.mark.gpu,
    pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA"),
]

from conftest import skewed_head_budgets
from transfer_checks import (
    assert_same_transfer_outcome,
    assert_selected_slots_hold_their_pages,
    transfer_outcome,
)
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from flexicache import FlexiCache, HeadProfile, disable_step_graphs
from flexicache.backends import ReferenceBackend, build_decode_layout
from flexicache.decode_paths import FusedDecode, TorchDecode
from flexicache.step_graph import StepGraphs


def relative_error(result: torch.Tensor, reference: torch.Tensor) -> float:
    return float((result.double() - reference.double()).norm() / reference.double().norm())


@pytest.mark.parametrize("group", [1, 4, 7, 8])
@pytest.mark.parametrize("head_dim", [64, 128])
def test_flashinfer_matches_reference(group: int, head_dim: int) -> None:
    from flexicache.backends.flashinfer import FlashInferBackend

    torch.manual_seed(group * 1000 + head_dim)
    device, page_size, pages_per_head, num_kv_heads = torch.device("cuda"), 16, 8, 3
    num_tokens = torch.tensor([5, 16, 77, 400])  # 1 page, exactly full, partial, more pages than K
    rows = num_tokens.numel() * num_kv_heads
    pool_k = torch.randn(512, page_size, head_dim, device=device, dtype=torch.bfloat16)
    pool_v = torch.randn_like(pool_k)
    layout = build_decode_layout(num_tokens, num_kv_heads, pages_per_head, page_size)
    counts = (layout.row_indptr_host[1:] - layout.row_indptr_host[:-1]).tolist()
    slots = torch.full((rows, pages_per_head), -1, dtype=torch.long)
    page_lens = torch.zeros(rows, pages_per_head, dtype=torch.long)
    for row, count in enumerate(counts):
        chosen = torch.randperm(512)[:count]
        # listed entries may sit anywhere in the row (gaps allowed); the tail is the last listed one
        positions = torch.sort(torch.randperm(pages_per_head)[:count]).values
        slots[row, positions] = chosen
        page_lens[row, positions] = page_size
        page_lens[row, positions[-1]] = int(layout.row_last_page_len_host[row])
    query = torch.randn(rows, group, head_dim, device=device, dtype=torch.bfloat16)
    scale = head_dim**-0.5
    args = (query, pool_k, pool_v, slots.to(device), page_lens.to(device), scale, layout)
    expected = ReferenceBackend().paged_decode(*[a.double() if torch.is_tensor(a) and a.is_floating_point() else a
                                                 for a in args])
    for tensor_cores in (False, True):
        if not tensor_cores and group not in (1, 2, 4, 8):
            continue
        result = FlashInferBackend(device, use_tensor_cores=tensor_cores).paged_decode(*args)
        assert relative_error(result, expected) <= 1e-2


@pytest.mark.parametrize("tensor_cores", [False, True])
@pytest.mark.parametrize("batch", [4, 66])
def test_reused_plan_decodes_later_last_page_lengths(tensor_cores: bool, batch: int) -> None:
    """Steps whose rows list as many pages as the planned step (rows at the budget) skip ``plan()`` and only refresh
    the last pages' lengths: each such step decodes exactly as a freshly planned backend does, and as the fp64
    reference within bf16 error (66 requests x 4 heads: more rows than FlashInfer's split-KV batch)."""
    from flexicache.backends.flashinfer import FlashInferBackend

    torch.manual_seed(batch)
    device, page_size, pages_per_head, num_kv_heads, group, head_dim = torch.device("cuda"), 16, 64, 4, 4, 128
    rows = batch * num_kv_heads
    pool_k = torch.randn(rows * pages_per_head, page_size, head_dim, device=device, dtype=torch.bfloat16)
    pool_v = torch.randn_like(pool_k)
    slots = torch.randperm(pool_k.shape[0], device=device).view(rows, pages_per_head)
    query = torch.randn(rows, group, head_dim, device=device, dtype=torch.bfloat16)
    reused = FlashInferBackend(device, use_tensor_cores=tensor_cores)
    if not reused.reuses_plans:
        pytest.skip(f"FlashInfer {flashinfer.__version__}: plan reuse not verified for this release (plans every step)")
    first_tokens = torch.randint(pages_per_head * page_size + 1, 8 * pages_per_head * page_size, (batch,))
    plans = []
    for step in range(0, 17, 4):  # every last-page length moves; the page counts stay at the budget
        layout = build_decode_layout(first_tokens + step, num_kv_heads, pages_per_head, page_size)
        page_lens = torch.full((rows, pages_per_head), page_size, dtype=torch.long)
        page_lens[:, -1] = layout.row_last_page_len_host.long()
        args = (query, pool_k, pool_v, slots, page_lens.to(device), 128**-0.5, layout)
        result = reused.paged_decode(*args)
        plans.append(reused._current.planned_for)
        fresh = FlashInferBackend(device, use_tensor_cores=tensor_cores).paged_decode(*args)
        assert torch.equal(result, fresh), step
        expected = ReferenceBackend().paged_decode(*[a.double() if torch.is_tensor(a) and a.is_floating_point()
                                                     else a for a in args])
        assert relative_error(result, expected) <= 1e-2, step
    assert all(plan is plans[0] for plan in plans)  # planned once


def tiny_model(group: int = 4) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=128 * group, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=2 * group, num_key_value_heads=2, head_dim=64,
                         max_position_embeddings=4096)
    return LlamaForCausalLM(config).to("cuda", torch.bfloat16).eval()


def decode_logits(model, cache, ids: torch.Tensor, steps: int) -> torch.Tensor:
    """Teacher-forced: prefill ids[:, :-steps], then feed the remaining tokens one by one; ``[steps, V]``."""
    logits = []
    with torch.inference_mode():
        model(ids[:, :-steps], past_key_values=cache, use_cache=True)
        for index in range(ids.shape[1] - steps, ids.shape[1]):
            logits.append(model(ids[:, index : index + 1], past_key_values=cache, use_cache=True).logits[0, -1])
    return torch.stack(logits).float()


@pytest.mark.parametrize("group", [4, 7])
def test_full_budget_matches_dynamic_cache(group: int) -> None:
    model = tiny_model(group)
    profile = HeadProfile(num_layers=4, num_kv_heads=2, head_dim=model.config.head_dim, unstable_heads=[(0, 0), (2, 1)])
    ids = torch.randint(0, 512, (1, 700), device="cuda")
    dense = decode_logits(model, DynamicCache(config=model.config), ids, 40)
    cache = FlexiCache.from_model(model, profile=profile, token_budget=1024, backend="flashinfer")
    sparse = decode_logits(model, cache, ids, 40)
    assert cache.stats()["backend"] == "flashinfer"
    assert relative_error(sparse, dense) <= 2e-2


def test_flashinfer_generation_matches_reference_backend() -> None:
    """Both backends select with the same Triton kernels; this compares their attention numerics over 48 bf16 steps.
    Quest's bound (spread_weight=1) on 16-token pages whose stable heads keep their rerank's pages (no standby pages)
    keeps the selections of random tokens apart: with a down-weighted spread, or a selection made at every step among
    standby pages, more pages nearly tie, and a tie that the two backends' bf16 rounding breaks differently, not the
    decode, then dominates the comparison (the selection kernels are checked against torch in every setting
    elsewhere)."""
    model = tiny_model(4)
    profile = HeadProfile(num_layers=4, num_kv_heads=2, head_dim=model.config.head_dim, unstable_heads=[(1, 0)])
    ids = torch.randint(0, 512, (2, 900), device="cuda")
    results = {}
    for backend in ("reference", "flashinfer"):
        cache = FlexiCache.from_model(model, profile=profile, token_budget=128, backend=backend, spread_weight=1.0,
                                      page_size=16, standby_pages=0)
        results[backend] = decode_logits(model, cache, ids[:1], 48)
        stats = cache.stats()
        assert stats["promoted_pages"] > 0 and stats["reranks_stable"] > 0
    assert relative_error(results["flashinfer"], results["reference"]) <= 2e-2


def test_host_tier_round_trip_is_bit_exact() -> None:
    model = tiny_model(4)
    profile = HeadProfile(num_layers=4, num_kv_heads=2, head_dim=model.config.head_dim, unstable_heads=[(0, 1)])
    ids = torch.randint(0, 512, (2, 500), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :37] = 0  # left padding
    cache = FlexiCache.from_model(model, profile=profile, token_budget=64, backend="flashinfer")
    dense = DynamicCache(config=model.config)
    with torch.inference_mode():
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=40, do_sample=False)
        model.generate(ids, attention_mask=mask, past_key_values=dense, max_new_tokens=40, do_sample=False)
    assert cache.layers[0].storage.offloaded.host.k.is_pinned()
    real = cache.sequence.logical_valid()[:, : ids.shape[1]].to("cuda")
    for flexi_layer, dense_layer in zip(cache.layers, dense.layers):
        keys, values = flexi_layer.read_logical()
        length = ids.shape[1]  # generated tokens may differ (sparse budget); the prompt's KV must not
        keys, values = keys[:, :, :length], values[:, :, :length]
        expected_k = dense_layer.keys[:, :, :length]
        expected_v = dense_layer.values[:, :, :length]
        selector = real[:, None, :, None].expand_as(keys)
        assert torch.equal(keys[selector], expected_k[selector])
        assert torch.equal(values[selector], expected_v[selector])


def test_prompt_copies_into_the_host_tier_are_awaited_by_its_readers() -> None:
    """A prompt's stable KV reaches the host tier by copies on a side stream while the next layers compute; the commit
    reads its staged device copy, and every later reader waits for the copies: read back right after the prefill
    forward (the last layers' copies still queued), the tier holds exactly the prompt's keys and values."""
    model = tiny_model(4)
    profile = HeadProfile(num_layers=4, num_kv_heads=2, head_dim=model.config.head_dim, unstable_heads=[(0, 1)])
    ids = torch.randint(0, 512, (8, 4096), device="cuda")
    cache = FlexiCache(model.config, profile=profile, token_budget=64, backend="flashinfer")
    dense = DynamicCache(config=model.config)
    model.set_attn_implementation("flexicache")
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
        stable = [layer.storage.offloaded for layer in cache.layers]
        assert all(pages.staged is None and pages.tier_written is not None for pages in stable)
        read_back = [layer.read_logical() for layer in cache.layers]
        model.set_attn_implementation("sdpa")
        model(ids, past_key_values=dense, use_cache=True, logits_to_keep=1)
    assert all(pages.tier_written is None for pages in stable)
    for (keys, values), dense_layer in zip(read_back, dense.layers, strict=True):
        assert torch.equal(keys, dense_layer.keys)
        assert torch.equal(values, dense_layer.values)


def listed_pages(table: tuple[torch.Tensor, torch.Tensor]) -> list[list[tuple[int, int]]]:
    """Each row's listed ``(slot, length)`` entries in order (where an entry sits in the padded row is free)."""
    slots, lens = (tensor.tolist() for tensor in table)
    return [[(slot, length) for slot, length in zip(row_slots, row_lens) if length > 0]
            for row_slots, row_lens in zip(slots, lens)]


@pytest.mark.parametrize("head_budgets", ["uniform", "prompt"])
@pytest.mark.parametrize("standby_pages", [0, 5])
def test_fused_decode_table_matches_torch_table(standby_pages: int, head_budgets: str) -> None:
    pytest.importorskip("triton")
    model = tiny_model(4)
    profile = HeadProfile(num_layers=4, num_kv_heads=2, head_dim=model.config.head_dim,
                          unstable_heads=[(0, 0), (1, 1), (3, 0), (3, 1)])
    ids = torch.randint(0, 512, (3, 700), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :123] = 0
    mask[2, :680] = 0  # 20 real tokens: fewer pages than the budget
    cache = FlexiCache.from_model(model, profile=profile, token_budget=128, backend="reference",
                                  standby_pages=standby_pages, head_budgets=head_budgets)
    with torch.inference_mode(), skewed_head_budgets():
        model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=37, do_sample=False)
        assert head_budgets == "uniform" or any(layer.storage.row_pages_key for layer in cache.layers)
        for reduce in ("max", "sum"):
            object.__setattr__(cache.settings, "group_reduce", reduce)
            query = torch.randn(3, model.config.num_attention_heads, 1, model.config.head_dim, device="cuda",
                                dtype=torch.bfloat16)
            plan = cache.sequence.last_plan
            for layer in cache.layers:
                rows_query = query.reshape(3 * 2, -1, model.config.head_dim)
                assert isinstance(layer.path, FusedDecode)  # the reference backend on CUDA: fused kernels, eagerly
                scale = model.config.head_dim ** -0.5
                expected = TorchDecode(layer.storage, layer.backend).table(rows_query, plan, scale)
                assert listed_pages(layer.path.table(rows_query, plan, scale)) == listed_pages(expected)


def test_cuda_graph_decode_matches_eager_launches() -> None:
    """Captured decode graphs replay exactly what eager launches compute, through reranks, promotions, tail
    retirements and pool/metadata growth (each growth re-captures)."""
    model = tiny_model(4)
    profile = HeadProfile(num_layers=4, num_kv_heads=2, head_dim=model.config.head_dim,
                          unstable_heads=[(0, 0), (2, 1), (3, 0)])
    ids = torch.randint(0, 512, (3, 600), device="cuda")
    results, caches = {}, {}
    for graphs in (False, True):
        cache = FlexiCache.from_model(model, profile=profile, token_budget=128, backend="flashinfer",
                                      cuda_graphs=graphs)
        logits = []
        with torch.inference_mode():
            model(ids[:, :500], past_key_values=cache, use_cache=True)
            for index in range(500, 600):
                logits.append(model(ids[:, index : index + 1], past_key_values=cache, use_cache=True).logits[:, -1])
        results[graphs], caches[graphs] = torch.stack(logits), cache
    assert torch.equal(results[True], results[False])
    graphed = caches[True]
    assert all(layer.graphed.graph is not None for layer in graphed.layers)
    captures = [layer.graphed.graph.captures for layer in graphed.layers]
    assert all(1 <= count <= 10 for count in captures), captures  # replayed; re-captured on growth only
    assert graphed.stats()["promoted_pages"] == caches[False].stats()["promoted_pages"] > 0


@pytest.mark.parametrize("host_dtype", ["auto", "float8_e4m3fn"])
def test_zero_copy_transfers_match_torch_indexing(monkeypatch: pytest.MonkeyPatch, host_dtype: str) -> None:
    """Promotions and tail retirements through the zero-copy kernels leave exactly the state torch indexing does
    (with a float8 tier: the kernels' casts round as torch's do)."""
    model = tiny_model(4)
    profile = HeadProfile(num_layers=4, num_kv_heads=2, head_dim=model.config.head_dim, unstable_heads=[(0, 1), (3, 0)])
    ids = torch.randint(0, 512, (2, 600), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :91] = 0
    results = {}
    for zero_copy in (True, False):
        monkeypatch.setattr("flexicache.offload.triton_available", lambda zero_copy=zero_copy: zero_copy)
        cache = FlexiCache.from_model(model, profile=profile, token_budget=64, backend="flashinfer",
                                      host_dtype=host_dtype)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=40, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        stable = [layer.storage.offloaded for layer in cache.layers if layer.storage.offloaded is not None]
        assert all(offloaded.zero_copy is zero_copy for offloaded in stable)
        results[zero_copy] = transfer_outcome(cache, out.logits)
    assert_same_transfer_outcome(results[True], results[False])


@pytest.mark.parametrize("max_promotions", [None, 3])
@pytest.mark.parametrize("batch, pages_per_head, standby_pages, width", [(512, 16, 6, 64), (64, 128, 24, 256)],
                         ids=["21-slots", "151-slots"])
def test_rerank_and_tail_retirement_kernels_match_torch_at_scale(max_promotions: int | None, batch: int,
                                                                 pages_per_head: int, standby_pages: int,
                                                                 width: int) -> None:
    """The fused rerank and tail retirement leave exactly the state of their torch versions over thousands of rows
    (one program each, thousands of warps in flight) with working sets of 21 and 151 pages (standby pages), rerank
    after rerank and retirement after retirement, with and without a limit on the promotions. A program
    whose warps each read the row's selection while another warp of it already rewrote it moves part of a page into
    the wrong slot, which shows up as rare run-to-run differences of generate() (what eval/gpu_repeatability.py
    looks for)."""
    from types import SimpleNamespace

    from flexicache.offload import OffloadedPages
    from flexicache.paging import PagePool

    heads, page_size, head_dim = 8, 16, 64
    rows = batch * heads
    generator = torch.Generator(device="cuda").manual_seed(0)
    states = {}
    for zero_copy in (True, False):
        pages = OffloadedPages(PagePool(page_size, head_dim, torch.bfloat16, torch.device("cuda")), batch, heads,
                               pages_per_head, page_size, standby_pages=standby_pages)
        pages.zero_copy = zero_copy
        pages.host.reserve(width + 8)
        states[zero_copy] = pages
    for name in ("k", "v"):
        filled = torch.randn(getattr(states[True].host, name).shape, generator=generator, device="cuda")
        for pages in states.values():
            getattr(pages.host, name).copy_(filled)
    tail_slots = states[True].tail_slots().view(-1)
    requests = torch.arange(batch, device="cuda")

    def assert_same_state(what: str) -> None:
        fused, torch_path = states[True], states[False]
        for name in ("selected", "selected_scores"):
            differs = (getattr(fused, name) != getattr(torch_path, name)).any(1)
            assert not bool(differs.any()), f"{what}: {name} differs in rows {differs.nonzero().view(-1)[:8].tolist()}"
        for name in ("k", "v"):
            differs = (getattr(fused.pool, name) != getattr(torch_path.pool, name)).flatten(1).any(1)
            assert not bool(differs.any()), f"{what}: pool.{name} differs in slots {differs.nonzero().view(-1)[:8]}"
            assert torch.equal(getattr(fused.host, name), getattr(torch_path.host, name)), f"{what}: host.{name}"

    full_pages = torch.randint(1, width - 24, (batch,), generator=generator, device="cuda")  # per request, grows
    for round_index in range(6):
        scores = (torch.randint(0, 4, (rows, width), generator=generator, device="cuda").float() if round_index % 2
                  else torch.randn(rows, width, generator=generator, device="cuda"))
        for pages in states.values():
            pages.rerank(scores, full_pages.repeat_interleave(heads), max_promotions)
        assert_same_state(f"rerank {round_index}")
        for retirement in range(3):  # later tails evict earlier ones' neighbours (+inf until the next rerank)
            before = (full_pages + 1) * page_size  # each tail page is full: it retires as page ``full_pages``
            plan = SimpleNamespace(before=before, before_host=before.cpu())
            tails = torch.randn(2, rows, page_size, head_dim, generator=generator, device="cuda")
            for pages in states.values():
                pages.pool.k[tail_slots], pages.pool.v[tail_slots] = tails[0].bfloat16(), tails[1].bfloat16()
                pages.retire_full_tails(requests, plan)
            assert_same_state(f"round {round_index}, retirement {retirement}")
            full_pages += 1
    assert int(states[True].counters.promoted_pages) == int(states[False].counters.promoted_pages) > 0


@pytest.mark.parametrize("settings", [{}, {"page_size": 8, "rerank_interval": 1, "max_promotions": 2},
                                      {"page_size": 8, "standby_pages": 5}, {"head_budgets": "prompt"},
                                      {"unstable_fraction": 1.0}],
                         ids=["defaults", "limited-promotions", "standby-pages", "head-budgets", "every-head-unstable"])
def test_whole_step_graphs_match_eager_generation(settings: dict) -> None:
    """generate() with whole-step CUDA graphs (from_model's default) gives the tokens and logits of the same cache
    run layer by layer, through a padded batch, reranks at every phase, promotions, retirements and growth; most
    steps replay (the recordings after the first of each storage replay their fresh graph). With a split of the
    pages per layer (head_budgets) each layer replays its own plan; with every head unstable (the online split's
    ``unstable_fraction=1.0``) no layer has a host tier."""
    model = tiny_model(4)
    profile = None if "unstable_fraction" in settings else HeadProfile(
        num_layers=4, num_kv_heads=2, head_dim=model.config.head_dim, unstable_heads=[(0, 0), (2, 1), (3, 0)])
    ids = torch.randint(0, 512, (3, 500), device="cuda")
    mask = torch.ones_like(ids)
    mask[1, :37] = 0
    runs = {}
    for step_graphs in (False, True):
        cache = FlexiCache.from_model(model, profile=profile, token_budget=128, backend="flashinfer", **settings)
        if not step_graphs:
            disable_step_graphs(model)
        with torch.inference_mode(), skewed_head_budgets():
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=120,
                                 do_sample=False, output_logits=True, return_dict_in_generate=True)
        assert_selected_slots_hold_their_pages(cache)
        assert "head_budgets" not in settings or all(layer.storage.row_pages_key for layer in cache.layers)
        assert cache.step_graphs.captures_at_once  # no capture of a later rerank phase needed an eager run first
        runs[step_graphs] = out, cache.stats()
    (eager, eager_stats), (graphed, graphed_stats) = runs[False], runs[True]
    assert torch.equal(graphed.sequences, eager.sequences)
    assert torch.equal(torch.stack(graphed.logits), torch.stack(eager.logits))
    assert eager_stats["step_graph_replays"] == 0
    assert graphed_stats["step_graph_replays"] >= 90 and graphed_stats["step_graph_captures"] <= 25, graphed_stats
    for name in ("promoted_pages", "reranks_stable", "reranks_unstable", "bytes_h2d", "bytes_d2h", "decode_steps"):
        assert graphed_stats[name] == eager_stats[name], name


def test_a_plain_cache_switches_the_model_calling_it_to_whole_step_graphs() -> None:
    """``FlexiCache(config)`` on a model loaded with the flexicache attention (the plain path) replays whole-step
    graphs from its second decode step on, without a warning, with the tokens and logits of a ``from_model`` cache;
    a model that ``disable_step_graphs`` set to layer by layer stays so, with the same tokens and logits."""
    profile = HeadProfile(num_layers=4, num_kv_heads=2, head_dim=64, unstable_heads=[(0, 0), (2, 1), (3, 0)])
    ids = torch.randint(0, 512, (2, 400), device="cuda")
    runs = {}
    for path in ("from_model", "plain", "layer by layer"):
        model = tiny_model(4)  # the same weights each time (seeded)
        if path == "from_model":
            cache = FlexiCache.from_model(model, profile=profile, token_budget=128, backend="flashinfer")
        else:
            model.set_attn_implementation("flexicache")
            if path == "layer by layer":
                disable_step_graphs(model)
            cache = FlexiCache(model.config, profile=profile, token_budget=128, backend="flashinfer")
        with warnings.catch_warnings(record=True) as caught, torch.inference_mode():
            warnings.simplefilter("always")
            out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=60,
                                 min_new_tokens=60, do_sample=False, output_logits=True, return_dict_in_generate=True)
        assert not [w for w in caught if "decodes layer by layer" in str(w.message)], path
        runs[path] = out, cache.stats(), isinstance(model.forward, StepGraphs)
    for path, (out, stats, wrapped) in runs.items():
        assert torch.equal(out.sequences, runs["from_model"][0].sequences), path
        assert torch.equal(torch.stack(out.logits), torch.stack(runs["from_model"][0].logits)), path
        assert wrapped == (path != "layer by layer"), path
        assert (stats["step_graph_replays"] >= 40) == (path != "layer by layer"), (path, stats)


def test_max_cache_len_matches_a_growing_cache_and_records_fewer_graphs() -> None:
    """A cache sized up front for the whole generation (``max_cache_len``) generates the tokens and logits of one
    that grows its buffers as it goes, and never drops its whole-step graphs for a growth (the growing one does)."""
    model = tiny_model(4)
    profile = HeadProfile(num_layers=4, num_kv_heads=2, head_dim=model.config.head_dim,
                          unstable_heads=[(0, 0), (2, 1), (3, 0)])
    ids = torch.randint(0, 512, (2, 300), device="cuda")
    new_tokens = 400  # past the growing cache's reserve after the prompt (19 pages + 16)
    runs = {}
    for max_cache_len in (None, ids.shape[1] + new_tokens):
        cache = FlexiCache.from_model(model, profile=profile, token_budget=128, backend="flashinfer",
                                      max_cache_len=max_cache_len)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                 max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                                 return_dict_in_generate=True)
        assert_selected_slots_hold_their_pages(cache)
        runs[max_cache_len is not None] = out, cache.stats()
    (growing, growing_stats), (sized, sized_stats) = runs[False], runs[True]
    assert torch.equal(sized.sequences, growing.sequences)
    assert torch.equal(torch.stack(sized.logits), torch.stack(growing.logits))
    assert sized_stats["step_graph_captures"] < growing_stats["step_graph_captures"], (sized_stats, growing_stats)


def triton_kernels() -> list:
    from flexicache.backends import triton_exact, triton_rerank, triton_select, triton_transfer

    return [triton_rerank._rerank_kernel, triton_select._score_pages_kernel, triton_select._decode_table_kernel,
            triton_select._append_token_kernel, triton_transfer._copy_pages_kernel,
            triton_transfer._retire_tails_kernel, triton_transfer._open_pages_kernel,
            triton_transfer._write_tokens_kernel, triton_exact._candidates_kernel, triton_exact._page_mass_kernel]


def compiled_triton_variants() -> dict[str, set[str]]:
    """The compiled variants (their specialization keys) of every FlexiCache Triton kernel in this process, over all
    devices, by kernel name: a test that compares two of these names the kernel and variant that is new."""
    return {kernel.fn.__name__: {str(key) for caches in list(kernel.device_caches.values()) for key in caches[0]}
            for kernel in triton_kernels()}


def new_variants(before: dict[str, set[str]], after: dict[str, set[str]]) -> dict[str, set[str]]:
    """The variants in ``after`` that ``before`` lacks, by kernel."""
    return {name: keys - before.get(name, set()) for name, keys in after.items() if keys - before.get(name, set())}


def test_other_sizes_compile_no_new_kernel_variants() -> None:
    """A generation with another batch (1: Triton's own value class), context and profile (other row counts, bases
    and capacities) compiles no Triton kernel the first generation did not: integer arguments are not specialized,
    so a decode step never stops for a compile (~0.5-0.9 s each, seen mid-generation on the H200)."""
    for kernel in triton_kernels():  # forget what earlier tests compiled (Triton's disk cache makes this cheap)
        kernel.device_caches.clear()
    model = tiny_model(4)
    runs = [((3, 500), [(0, 0), (2, 1), (3, 0)]), ((1, 630), [(1, 0), (2, 0), (3, 1)])]
    counts = []
    for (batch, context), unstable in runs:
        profile = HeadProfile(num_layers=4, num_kv_heads=2, head_dim=model.config.head_dim, unstable_heads=unstable)
        cache = FlexiCache.from_model(model, profile=profile, token_budget=128, backend="flashinfer")
        disable_step_graphs(model)  # the layer-by-layer path launches every kernel with the step's sizes
        ids = torch.randint(0, 512, (batch, context), device="cuda")
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=40,
                           do_sample=False)
        assert cache.stats()["promoted_pages"] > 0  # the decode reranked stable heads and copied pages in
        counts.append(compiled_triton_variants())
    added = new_variants(counts[0], counts[1])
    assert any(counts[0].values()) and not added, added


def test_collecting_an_old_cache_does_not_break_the_next_capture(monkeypatch: pytest.MonkeyPatch) -> None:
    """A cache that became garbage (here kept in a reference cycle, as a caller's objects may keep it) must not be
    collected while the next cache records its CUDA graphs: destroying its graphs there invalidates the capture (seen
    on the H200). A collection is forced inside every recording where the collector is on; both generations give the
    same tokens and logits, bit for bit (a race in a kernel, e.g. one in the tail retirement, would make them differ:
    see test_rerank_and_tail_retirement_kernels_match_torch_at_scale)."""
    import gc

    from flexicache.backends import triton_select

    append_token = triton_select.append_token

    def collecting_append_token(*args, **kwargs):  # the first launch of every decode step's device work
        if torch.cuda.is_current_stream_capturing() and gc.isenabled():  # the collector could run here
            gc.collect()
        return append_token(*args, **kwargs)

    monkeypatch.setattr(triton_select, "append_token", collecting_append_token)
    model = tiny_model(4)
    profile = HeadProfile(num_layers=4, num_kv_heads=2, head_dim=model.config.head_dim, unstable_heads=[(0, 0), (2, 1)])
    ids = torch.randint(0, 512, (2, 400), device="cuda")
    sequences = []
    thresholds = gc.get_threshold()
    gc.set_threshold(0)  # no automatic collection: it could free the old cache harmlessly between recordings
    try:
        for _ in range(2):
            cache = FlexiCache.from_model(model, profile=profile, token_budget=128, backend="flashinfer")
            with torch.inference_mode():
                sequences.append(model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                                max_new_tokens=40, do_sample=False, output_logits=True,
                                                return_dict_in_generate=True))
            assert cache.stats()["step_graph_replays"] > 0
            cache.cycle = cache  # only the collector frees it now
            cache = None
    finally:
        gc.set_threshold(*thresholds)
    assert torch.equal(sequences[0].sequences, sequences[1].sequences)
    assert torch.equal(torch.stack(sequences[0].logits), torch.stack(sequences[1].logits))


@pytest.mark.parametrize("step_graphs", [True, False], ids=["step-graphs", "layer-by-layer"])
def test_warm_up_compiles_every_kernel_the_generation_needs(step_graphs: bool) -> None:
    """After ``warm_up(model, context, batch)`` a generation of that context and batch (more new tokens than the
    warm-up's, through reranks, promotions, page boundaries and retirements) compiles no Triton kernel variant."""
    from flexicache import warm_up

    for kernel in triton_kernels():
        kernel.device_caches.clear()
    model = tiny_model(4)
    profile = HeadProfile(num_layers=4, num_kv_heads=2, head_dim=model.config.head_dim, unstable_heads=[(1, 0), (3, 1)])
    batch, context = 3, 700
    warmed = warm_up(model, context, batch, profile=profile, token_budget=128, backend="flashinfer",
                     cuda_graphs=step_graphs)
    compiled = compiled_triton_variants()
    assert any(compiled.values()) and warmed["promoted_pages"] > 0, warmed
    cache = FlexiCache.from_model(model, profile=profile, token_budget=128, backend="flashinfer",
                                  cuda_graphs=step_graphs)
    ids = torch.randint(0, 512, (batch, context), device="cuda")
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=60,
                       min_new_tokens=60, do_sample=False)
    stats = cache.stats()
    assert stats["promoted_pages"] > 0 and (stats["step_graph_replays"] > 0) == step_graphs, stats
    added = new_variants(compiled, compiled_triton_variants())
    assert not added, added


def test_pinned_zeros_is_page_locked_exact_and_unregistered_when_freed(monkeypatch: pytest.MonkeyPatch) -> None:
    """The host tier's memory: zero-filled, exactly its bytes, page-locked (asynchronous copies and zero-copy kernels
    work), and unregistered once the last view of it is gone."""
    from flexicache.host_memory import pinned_zeros

    cudart = torch.cuda.cudart()
    unregistered = []

    class Recorder:
        def __getattr__(self, name):
            return getattr(cudart, name)

        def cudaHostUnregister(self, address):
            unregistered.append(address)
            return cudart.cudaHostUnregister(address)

    monkeypatch.setattr(torch.cuda, "cudart", lambda: Recorder())
    tensor = pinned_zeros((3, 5, 4096), torch.bfloat16)
    assert tensor.is_pinned() and tensor.untyped_storage().nbytes() == 3 * 5 * 4096 * 2
    assert not tensor.any()
    source = torch.randn(3, 5, 4096, device="cuda").bfloat16()
    tensor.copy_(source, non_blocking=True)
    back = tensor.to("cuda", non_blocking=True)
    torch.cuda.synchronize()
    assert torch.equal(back, source)
    view, address = tensor[1], tensor.data_ptr()
    del tensor
    assert unregistered == []  # a view still uses it
    del view
    assert unregistered == [address]


# ------------------------------------------------------------------------------------ freeing and grad modes


@pytest.fixture
def registered_host_bytes(monkeypatch: pytest.MonkeyPatch) -> dict[int, int]:
    """``{address: bytes}`` of the page-locked host memory (the host tiers) registered with CUDA and not yet
    unregistered, from now on; host tiers come from a pool that keeps nothing a cache gives back (the pool's reuse:
    tests/test_gpu_reliability.py)."""
    from flexicache import host_memory, host_pool

    monkeypatch.setattr(host_pool, "_process_pool", host_pool.HostPool(keep_free=False))

    live: dict[int, int] = {}
    register, release = host_memory._RegisteredMapping.register, host_memory._RegisteredMapping.__del__

    def recorded_register(self) -> None:
        register(self)
        live[self.address] = len(self)

    def recorded_release(self) -> None:
        live.pop(self.address, None)
        release(self)

    monkeypatch.setattr(host_memory._RegisteredMapping, "register", recorded_register)
    monkeypatch.setattr(host_memory._RegisteredMapping, "__del__", recorded_release)
    return live


def generate_and_drop(model, make_cache, ids: torch.Tensor, new_tokens: int = 40) -> dict:
    """Generate with ``make_cache()`` (the cycle collector must be off), drop everything, and check the cache is gone
    by reference counting: returns its stats."""
    import weakref

    cache = make_cache()
    with torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=new_tokens,
                       min_new_tokens=new_tokens, do_sample=False)
    stats, ref = cache.stats(), weakref.ref(cache)
    del cache
    assert ref() is None, "the cache outlived its last reference (a reference cycle)"
    torch.cuda.synchronize()
    return stats


FREEING_PATHS = {"whole-step graphs": (True, True), "layer graphs": (True, False), "eager": (False, False)}


def path_cache(model, path: str, **settings) -> FlexiCache:
    """A ``from_model`` cache on the CUDA path ``path`` of :data:`FREEING_PATHS` (cuda_graphs, whole-step graphs)."""
    cuda_graphs, step_graphs = FREEING_PATHS[path]
    cache = FlexiCache.from_model(model, backend="flashinfer", cuda_graphs=cuda_graphs, **settings)
    if not step_graphs:
        disable_step_graphs(model)
    return cache


@pytest.mark.parametrize("head_budgets", ["uniform", "prompt"])
@pytest.mark.parametrize("path", list(FREEING_PATHS))
def test_a_dropped_cache_gives_its_host_tier_and_device_memory_back(path: str, head_budgets: str,
                                                                     registered_host_bytes) -> None:
    """With the cycle collector off, a cache nobody refers to is freed at once, on every CUDA path: its pinned host
    tier unregistered, the device memory of its pages, metadata and graphs back with the allocator (with a split of
    the pages per layer, head_budgets, its layers' own FlashInfer plans too)."""
    import gc

    model = tiny_model(4)
    profile = HeadProfile(num_layers=4, num_kv_heads=2, head_dim=model.config.head_dim, unstable_heads=[(0, 0), (2, 1)])
    ids = torch.randint(0, 512, (8, 3000), device="cuda")
    gc.collect()
    gc.disable()

    def make() -> FlexiCache:
        return path_cache(model, path, profile=profile, token_budget=128, head_budgets=head_budgets)

    try:
        with skewed_head_budgets():
            generate_and_drop(model, make, ids)  # warm-up
            baseline = torch.cuda.memory_allocated()
            assert registered_host_bytes == {}
            stats = generate_and_drop(model, make, ids)
        assert registered_host_bytes == {}, "a dropped cache's host tier is still page-locked"
        assert abs(torch.cuda.memory_allocated() - baseline) <= 2**20, (torch.cuda.memory_allocated(), baseline)
    finally:
        gc.enable()
    assert stats["host_reserved_bytes"] > 2**24 and stats["device_reserved_bytes"] > 2**24  # a footprint to miss
    assert stats["promoted_pages"] > 0 and (stats["step_graph_replays"] > 0) == (path == "whole-step graphs")


def test_sequential_requests_with_fresh_caches_do_not_grow_memory(registered_host_bytes) -> None:
    """The loop that ran out of memory on the H200 (a fresh ``from_model`` cache per request, the cache dropped after
    its generate, no garbage collection): device memory and page-locked host memory stay flat, round after round."""
    import gc

    model = tiny_model(4)
    ids = torch.randint(0, 512, (8, 3000), device="cuda")
    allocated = []
    gc.collect()
    gc.disable()
    try:
        for _ in range(5):
            generate_and_drop(model, lambda: FlexiCache.from_model(model, token_budget=128), ids)
            assert registered_host_bytes == {}, "a dropped cache's host tier is still page-locked"
            allocated.append(torch.cuda.memory_allocated())
    finally:
        gc.enable()
    assert max(allocated[1:]) - min(allocated[1:]) <= 2**20, allocated  # the first round warms the backend up


def test_close_frees_a_graphed_cache_at_once(registered_host_bytes) -> None:
    """``close()`` (the end of a ``with`` block) unregisters the host tier and frees the device buffers and graphs
    while the cache object is still referred to; using it again raises."""
    model = tiny_model(4)
    ids = torch.randint(0, 512, (4, 2000), device="cuda")
    with FlexiCache.from_model(model, token_budget=128) as cache:
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=30,
                           do_sample=False)
        stats = cache.stats()
        assert stats["step_graph_replays"] > 0 and registered_host_bytes
        torch.cuda.synchronize()
        during = torch.cuda.memory_allocated()
    torch.cuda.synchronize()
    assert registered_host_bytes == {}
    assert torch.cuda.memory_allocated() <= during - stats["device_reserved_bytes"]  # pools and metadata at least
    with pytest.raises(RuntimeError, match="closed"), torch.inference_mode():
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=2)


@pytest.mark.skipif(torch.cuda.device_count() < 2, reason="needs two GPUs")
def test_a_cache_over_several_gpus_is_freed_by_reference_counting(registered_host_bytes) -> None:
    """Layers split over two GPUs (accelerate's dispatch): a dropped cache's memory comes back on each of them."""
    import gc

    import accelerate

    model = tiny_model(4)
    device_map = {"model.embed_tokens": 0, "model.rotary_emb": 0, "model.norm": 1, "lm_head": 1}
    device_map.update({f"model.layers.{index}": index // 2 for index in range(4)})
    model = accelerate.dispatch_model(model, device_map, skip_keys=model._skip_keys_device_placement)
    ids = torch.randint(0, 512, (8, 3000), device="cuda:0")
    gc.collect()
    gc.disable()
    try:
        generate_and_drop(model, lambda: FlexiCache.from_model(model, token_budget=128), ids)
        baseline = [torch.cuda.memory_allocated(device) for device in (0, 1)]
        stats = generate_and_drop(model, lambda: FlexiCache.from_model(model, token_budget=128), ids)
        for device in (0, 1):
            torch.cuda.synchronize(device)
        after = [torch.cuda.memory_allocated(device) for device in (0, 1)]
        assert registered_host_bytes == {}
        assert all(abs(now - before) <= 2**20 for now, before in zip(after, baseline)), (after, baseline)
    finally:
        gc.enable()
    assert stats["promoted_pages"] > 0 and stats["step_graph_replays"] == 0  # two devices: layer by layer


GRAD_MODES = {"no_grad": torch.no_grad, "plain": contextlib.nullcontext, "inference_mode": torch.inference_mode}


def test_warm_up_then_generate_in_every_grad_mode() -> None:
    """``warm_up`` runs under ``inference_mode``; the FlashInfer backend, capture streams and kernels it leaves
    behind serve later generations under ``no_grad``, plain mode and ``inference_mode`` again, with a
    ``from_model`` cache (whole-step graphs) and a plain one (layer by layer), in that order and back, all with the
    same tokens. A cache prefilled under ``inference_mode`` then goes on generating under ``no_grad``."""
    from flexicache import warm_up

    model = tiny_model(4)
    profile = HeadProfile(num_layers=4, num_kv_heads=2, head_dim=model.config.head_dim, unstable_heads=[(1, 0), (3, 1)])
    batch, context = 3, 700
    warm_up(model, context, batch, profile=profile, token_budget=128)
    ids = torch.randint(0, 512, (batch, context), device="cuda")
    sequences = []
    for mode in ("no_grad", "plain", "inference_mode", "plain"):
        for make in (lambda: FlexiCache.from_model(model, profile=profile, token_budget=128),
                     lambda: FlexiCache(model.config, profile=profile, token_budget=128)):
            cache = make()
            with GRAD_MODES[mode]():
                sequences.append(model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                                                max_new_tokens=40, min_new_tokens=40, do_sample=False))
            assert cache.stats()["promoted_pages"] > 0, mode
    assert all(torch.equal(sequence, sequences[0]) for sequence in sequences[1:])
    cache = FlexiCache.from_model(model, profile=profile, token_budget=128)
    with torch.inference_mode():
        model(ids[:, :-1], past_key_values=cache)
    with torch.no_grad():  # the last prompt token and the new ones: decode steps on the prefilled cache
        model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache, max_new_tokens=20,
                       min_new_tokens=20, do_sample=False)
    stats = cache.stats()
    assert stats["decode_steps"] >= 19 and stats["step_graph_replays"] > 0 and stats["promoted_pages"] > 0
