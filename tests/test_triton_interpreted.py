"""The Triton kernels (page scoring + selection + page list, zero-copy page copies) run by Triton's interpreter on
the CPU, against the torch paths they replace. The GPU tests run the same kernels compiled (test_gpu_flashinfer.py).

The interpreter must be switched on (``TRITON_INTERPRET=1``) before Triton is imported, so each check runs in a
subprocess: this file is both the test module and the script it runs (the longest check, ``step``, is run by
``test_triton_interpreted_steps.py``).
"""

from __future__ import annotations

import contextlib
import itertools
import os
import subprocess
import sys
import weakref

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

triton = pytest.importorskip("triton")
tl = pytest.importorskip("triton.language")

from conftest import skewed_head_budgets

from flexicache.backends.flashinfer import FlashInferBackend
from flexicache.backends.triton_select import _order_key, _top_keys


def run_interpreted(check: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, __file__, check], env=env, capture_output=True, text=True, timeout=900,
                            check=False)  # the assertion below reports the output
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_fused_decode_table_matches_torch_table() -> None:
    run_interpreted("table")


def test_top_k_search_matches_a_stable_sort() -> None:
    run_interpreted("topk")


def test_zero_copy_transfers_match_torch_indexing() -> None:
    run_interpreted("transfers")


def test_fused_rerank_matches_torch_rerank() -> None:
    run_interpreted("rerank")


def test_graph_path_replays_what_it_captured() -> None:
    run_interpreted("graph")


def test_caches_sharing_the_flashinfer_backend_interleave_graphed_steps() -> None:
    run_interpreted("interleave")


def test_caches_on_the_cuda_paths_are_freed_by_reference_counting() -> None:
    run_interpreted("freeing")


def test_the_cuda_paths_work_in_every_grad_mode_in_any_order() -> None:
    run_interpreted("modes")


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 512, (3, 300))
    mask = torch.ones_like(ids)
    mask[1, :50] = 0
    mask[2, :290] = 0  # 10 real tokens: fewer pages than the budget
    return ids, mask


def generate_crop_continue(model, flexi, ids: torch.Tensor, mask: torch.Tensor, first_tokens: int
                           ) -> tuple[torch.Tensor, torch.Tensor]:
    """Greedy ``generate`` of ``first_tokens``, a crop of 9 positions, then 7 new prompt tokens and 30 more."""
    first = model.generate(ids, attention_mask=mask, past_key_values=flexi, max_new_tokens=first_tokens,
                           do_sample=False)
    flexi.crop(-9)
    batch = ids.shape[0]
    more = torch.cat([first[:, :-9], torch.randint(0, 512, (batch, 7), generator=torch.Generator().manual_seed(1))],
                     dim=1)
    more_mask = torch.cat([mask, torch.ones(batch, more.shape[1] - mask.shape[1], dtype=mask.dtype)], dim=1)
    second = model.generate(more, attention_mask=more_mask, past_key_values=flexi, max_new_tokens=30,
                            do_sample=False)
    return first, second


def listed_pages(table: tuple[torch.Tensor, torch.Tensor]) -> list[list[tuple[int, int]]]:
    slots, lens = (tensor.tolist() for tensor in table)
    return [[(slot, length) for slot, length in zip(row_slots, row_lens) if length > 0]
            for row_slots, row_lens in zip(slots, lens)]


def check_table() -> None:
    """Every row lists the same pages (slot, length, order) as the torch table: unstable rows over and under the
    budget, stable rows (attending to all their working set, or with standby pages to its best), max and sum over the
    GQA group, Quest's bound and a down-weighted spread, random and all-zero queries (ties everywhere); pages chosen
    by their boxes or (``exact_rescore``) by their keys' attention mass, with box axes rotated or not (the exact
    scores read the stored keys, among 1, 2 or 3 K candidates); every row its own number of pages
    (``head_budgets="prompt"``)."""
    from flexicache import FlexiCache, HeadProfile
    from flexicache.decode_paths import FusedDecode, TorchDecode

    model = tiny_model()
    for unstable, principal, standby, exact, budgets, candidates in (
            ([(0, 0), (1, 1)], False, 0, False, "uniform", 2), ([(0, 0), (0, 1)], False, 0, False, "uniform", 2),
            ([], False, 0, False, "uniform", 2), ([(0, 0), (1, 1)], True, 0, False, "uniform", 2),
            ([(1, 1)], True, 3, False, "uniform", 2), ([(0, 0), (1, 1)], False, 0, True, "uniform", 2),
            ([(1, 1)], False, 3, True, "uniform", 2), ([], False, 2, True, "uniform", 2),
            ([(0, 0)], True, 3, True, "uniform", 2), ([(0, 0), (0, 1)], False, 0, True, "prompt", 2),
            ([(1, 1)], False, 8, True, "prompt", 2), ([(0, 0)], True, 8, False, "prompt", 2),
            ([(0, 0), (1, 0), (1, 1)], False, 0, False, "prompt", 2),
            ([(0, 0), (1, 1)], False, 0, True, "uniform", 3), ([(0, 0), (0, 1)], True, 8, True, "prompt", 3),
            ([(1, 0)], False, 0, True, "uniform", 1)):
        profile = HeadProfile(num_layers=2, num_kv_heads=2, head_dim=32, unstable_heads=unstable)
        ids, mask = padded_batch()
        cache = FlexiCache.from_model(model, profile=profile, token_budget=64, principal_bounds=principal,
                                      standby_pages=standby, exact_rescore=exact, exact_candidates=candidates,
                                      head_budgets=budgets)
        with torch.inference_mode(), skewed_head_budgets():
            model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=21, do_sample=False)
        assert budgets == "uniform" or any(layer.storage.row_pages_key for layer in cache.layers)
        with torch.inference_mode():
            for reduce, spread in itertools.product(("max", "sum"), (1.0, 0.5)):
                object.__setattr__(cache.settings, "group_reduce", reduce)
                object.__setattr__(cache.settings, "spread_weight", spread)
                for query in (torch.randn(3, 8, 1, 32), torch.zeros(3, 8, 1, 32)):
                    rows_query = query.reshape(3 * 2, -1, 32)
                    plan = cache.sequence.last_plan
                    for layer in cache.layers:
                        expected = listed_pages(TorchDecode(layer.storage, layer.backend).table(rows_query, plan,
                                                                                                 32 ** -0.5))
                        fused = FusedDecode(layer.storage, layer.backend).table(rows_query, plan, 32 ** -0.5)
                        assert listed_pages(fused) == expected, (unstable, standby, exact, candidates, reduce, spread)


@triton.jit
def _top_k_kernel(scores_ptr, chosen_ptr, n, count, BLOCK: tl.constexpr):
    """``chosen[i] = 1`` for the ``count`` largest of ``scores[:n]`` as the selection kernels choose them."""
    page = tl.arange(0, BLOCK)
    valid = page < n
    key = _order_key(tl.load(scores_ptr + page, mask=valid, other=0.0)).to(tl.int64)
    tl.store(chosen_ptr + page, _top_keys(key, valid, count).to(tl.int8))


def check_topk() -> None:
    """The top-K search of the selection kernels picks what a stable descending sort picks (ties to the lower
    index; NaN counts as +inf), on rows with heavy ties, +-inf, +-0, NaN of either sign, huge and tiny magnitudes,
    all-equal rows and counts from 1 to the row length."""
    generator = torch.Generator().manual_seed(0)
    specials = torch.tensor([float("inf"), float("-inf"), 0.0, -0.0, 3.4e38, -3.4e38, 1e-45, -1e-45, 1.0, -1.0,
                             float("nan"), -float("nan")])
    block = 64
    for case in range(60):
        n = int(torch.randint(1, block + 1, (1,), generator=generator))
        kind = case % 4
        if kind == 0:  # few distinct values: ties at the boundary
            scores = torch.randint(-2, 3, (n,), generator=generator).float()
        elif kind == 1:
            scores = specials[torch.randint(0, len(specials), (n,), generator=generator)]
        elif kind == 2:
            scores = torch.randn(n, generator=generator) * 10.0 ** float(torch.randint(-30, 30, (1,), generator=generator))
        else:
            scores = torch.full((n,), float(torch.randn(1, generator=generator)))
        padded = torch.zeros(block)
        padded[:n] = scores
        for count in sorted({1, n, int(torch.randint(1, n + 1, (1,), generator=generator))}):
            expected = torch.zeros(block, dtype=torch.int8)
            ranked = scores.nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))  # NaN is +inf
            expected[torch.sort(ranked, descending=True, stable=True).indices[:count]] = 1
            chosen = torch.full((block,), -1, dtype=torch.int8)
            _top_k_kernel[(1,)](padded, chosen, n, count, BLOCK=block)
            assert torch.equal(chosen, expected), (case, count, scores.tolist())


def check_transfers() -> None:
    """Promotions and tail retirements through the zero-copy kernels leave the state torch indexing leaves; with a
    rerank interval of 48 several tails retire between two reranks (each takes over the lowest-scored slot). A host
    tier narrower than the KV (keys stored less their row's centre) is checked as a float16 tier under this float32
    model: the interpreter's float8 rounding is not the GPU's (the float8 tier itself: tests/test_gpu_flashinfer.py)."""
    from transfer_checks import assert_same_transfer_outcome, transfer_outcome

    from flexicache import FlexiCache, FlexiCacheConfig, HeadProfile, offload

    torch.cuda.synchronize = lambda *args, **kwargs: None  # the kernel runs on CPU tensors here
    model = tiny_model()
    profile = HeadProfile(num_layers=2, num_kv_heads=2, head_dim=32, unstable_heads=[(0, 1)])
    ids, mask = padded_batch()
    original_init = offload.OffloadedPages.__init__
    original_host_dtype = FlexiCacheConfig.host_tier_dtype
    for rerank_interval, narrow in ((16, False), (48, False), (16, True)):
        FlexiCacheConfig.host_tier_dtype = (lambda self, kv_dtype: torch.float16) if narrow else original_host_dtype
        results = {}
        for zero_copy in (True, False):
            def init(self, *args, zero_copy=zero_copy, **kwargs):
                original_init(self, *args, **kwargs)
                self.zero_copy = zero_copy

            offload.OffloadedPages.__init__ = init
            cache = FlexiCache.from_model(model, profile=profile, token_budget=64, rerank_interval=rerank_interval)
            with torch.inference_mode():
                out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=40,
                                     do_sample=False, output_logits=True, return_dict_in_generate=True)
            stable = [layer.storage.offloaded for layer in cache.layers if layer.storage.offloaded is not None]
            assert all(offloaded.zero_copy is zero_copy for offloaded in stable)
            assert all((offloaded.key_centre is not None) is narrow for offloaded in stable)
            results[zero_copy] = transfer_outcome(cache, out.logits)
        assert_same_transfer_outcome(results[True], results[False])


def check_stable_scores() -> None:
    """The stable rerank's one-launch scores equal the torch box scores on every row's full pages (requests with no,
    one and many full pages; max and sum over the group; Quest's bound, a down-weighted and a zero spread) and are
    -inf past them."""
    from flexicache.backends.triton_select import stable_page_scores
    from flexicache.selection import quest_page_scores

    generator = torch.Generator().manual_seed(1)
    batch, heads, group, capacity, head_dim, page_size, width = 5, 4, 3, 80, 16, 4, 70
    kmin = torch.randn(batch, heads, capacity, head_dim, generator=generator)
    kmax = kmin + torch.rand(batch, heads, capacity, head_dim, generator=generator)
    stable = torch.tensor([0, 2, 3])
    query = torch.randn(batch * len(stable), group, head_dim, generator=generator)
    num_tokens = torch.tensor([0, 3, 5, 8, 4 * width + 1])  # 0, 0, 1, 1 (a full tail is no candidate), width
    full_pages = ((num_tokens - 1) // page_size).repeat_interleave(len(stable))
    for reduce, spread in itertools.product(("max", "sum"), (1.0, 0.5, 0.0)):
        got = stable_page_scores(query, kmin, kmax, num_tokens, stable, width, page_size, reduce, spread)
        want = quest_page_scores(query, kmin[:, stable, :width].flatten(0, 1), kmax[:, stable, :width].flatten(0, 1),
                                 reduce, spread)
        inside = torch.arange(width) < full_pages[:, None]
        assert torch.allclose(got[inside], want[inside], rtol=1e-5, atol=1e-5), reduce
        assert bool((got[~inside] == float("-inf")).all()) and bool(inside.any()) and bool((~inside).any())
        narrow = stable_page_scores(query, kmin, kmax, num_tokens, stable, 10, page_size, reduce, spread)  # rows longer
        assert torch.equal(narrow, got[:, :10])  # than the width stay inside their own columns


def check_rerank() -> None:
    """The fused rerank leaves the selection, scores, device slots and promotion count the torch rerank leaves:
    rows with no, few (< K - 1) and many full pages, scores with ties everywhere (small integers, all zero) and
    mostly -inf (no candidates: a refresh's scores on the torch path), each
    rerank starting from the selection the previous one left (tail retirements: check_transfers), with and without
    ``max_promotions``. Then
    :func:`check_stable_scores`."""
    import copy

    check_stable_scores()

    from flexicache.offload import OffloadedPages
    from flexicache.paging import PagePool

    torch.cuda.synchronize = lambda *args, **kwargs: None
    generator = torch.Generator().manual_seed(0)
    batch, heads, pages_per_head, page_size, head_dim, width = 3, 2, 5, 4, 8, 12
    pool = PagePool(page_size, head_dim, torch.float32, torch.device("cpu"))
    pages = OffloadedPages(pool, batch, heads, pages_per_head, page_size, standby_pages=2)  # 6 working-set slots
    pages.host.reserve(width)
    pages.host.k.copy_(torch.randn(pages.host.k.shape, generator=generator))
    pages.host.v.copy_(torch.randn(pages.host.v.shape, generator=generator))
    num_full = torch.tensor([0, 2, 12, 12, 7, 4])  # rows r = b * heads + head
    draws = [torch.randint(0, 4, (6, width), generator=generator).float() for _ in range(3)]
    draws += [torch.randn(6, width, generator=generator), torch.zeros(6, width)]
    sparse = torch.randn(6, width, generator=generator)  # most pages -inf, as a refresh on the torch path scores
    draws.append(sparse.masked_fill(torch.rand(6, width, generator=generator) < 0.7, float("-inf")))
    for max_promotions in (None, 1, 2):
        for fused in (True, False):
            state = copy.deepcopy(pages)
            state.zero_copy = fused
            outcomes = []
            for scores in draws:
                state.rerank(scores, num_full, max_promotions)
                outcomes.append((state.selected.clone(), state.selected_scores.clone(), state.pool.k.clone(),
                                 state.pool.v.clone(),
                                 int(state.counters.promoted_pages)))
            if fused:
                fused_outcomes = outcomes
            else:
                for got, want in zip(fused_outcomes, outcomes):
                    assert all(torch.equal(a, b) for a, b in zip(got[:4], want[:4])), (max_promotions, got[0], want[0])
                    assert got[4] == want[4]
        assert outcomes[-1][4] > 0


class PlannedBuffers:
    """What FlashInfer's CUDA-graph-mode wrapper holds: the index buffer and the planned row layout."""

    def __init__(self, rows: int, pages_per_head: int) -> None:
        self.indices = torch.zeros(rows * pages_per_head + 1, dtype=torch.int32)
        self.indptr = torch.zeros(rows + 1, dtype=torch.int32)
        self.last_page_len = torch.zeros(rows, dtype=torch.int32)


class FlashInferStandIn:
    """The FlashInfer backend's graph-path interface in plain torch: attention over the pages listed in the planned
    index buffer (``indices[indptr[r]:indptr[r + 1]]``, tail last with ``last_page_len`` tokens)."""

    name = "flashinfer-stand-in"
    paged_decode = FlashInferBackend.paged_decode  # the table path: compacts the table into the planned buffer

    def __init__(self, launches: list) -> None:
        self.launches = launches
        self.buffers: dict[tuple[int, int], PlannedBuffers] = {}
        self.owned: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # a split's own, per storage
        self.scale = 1.0

    def prepare(self, layout, group, head_dim, page_size, pages_per_head, dtype, scale, owner=None
                ) -> PlannedBuffers:
        rows = layout.row_last_page_len_host.numel()
        buffers = self.buffers if owner is None else self.owned.setdefault(owner, {})
        planned = buffers.setdefault((rows, pages_per_head), PlannedBuffers(rows, pages_per_head))
        planned.indptr.copy_(layout.row_indptr_host)
        planned.last_page_len.copy_(layout.row_last_page_len_host)
        self.scale = scale
        return planned

    def run_prepared(self, planned, query, pool_k, pool_v, out=None):
        out = torch.empty_like(query) if out is None else out
        self.launches.append(("flashinfer", query.data_ptr(), pool_k.data_ptr(), pool_k.shape, out.data_ptr(),
                              planned.indices.data_ptr(), self.scale))
        return listed_pages_attention(query, pool_k, pool_v, planned, self.scale, out)


def listed_pages_attention(query, pool_k, pool_v, planned, scale: float, out):
    """What FlashInfer's paged decode computes: each row of ``query [R, G, D]`` over the pool pages listed for it in
    ``planned`` (``indices[indptr[r]:indptr[r + 1]]``, the last with ``last_page_len[r]`` tokens)."""
    page_size, head_dim = pool_k.shape[1:]
    for row in range(query.shape[0]):
        start, end = int(planned.indptr[row]), int(planned.indptr[row + 1])
        slots = planned.indices[start:end].long()
        length = (end - start - 1) * page_size + int(planned.last_page_len[row])
        keys = pool_k[slots].reshape(-1, head_dim)[:length].float()
        values = pool_v[slots].reshape(-1, head_dim)[:length].float()
        weights = torch.softmax(query[row].float() @ keys.T * scale, dim=-1)
        out[row] = (weights @ values).to(out.dtype)
    return out


class DecodeWrapperStandIn:
    """FlashInfer's CUDA-graph-mode ``BatchDecodeWithPagedKVCacheWrapper`` in torch, for the real
    :class:`~flexicache.backends.flashinfer.FlashInferBackend`: ``plan`` writes the layout into the fixed buffers,
    ``run`` reads them (as a replayed graph does) and counts plans."""

    plans = 0

    def __init__(self, workspace, kv_layout, use_cuda_graph, use_tensor_cores, paged_kv_indptr_buffer,
                 paged_kv_indices_buffer, paged_kv_last_page_len_buffer, backend) -> None:
        self.indptr, self.indices = paged_kv_indptr_buffer, paged_kv_indices_buffer
        self.last_page_len = paged_kv_last_page_len_buffer
        self.scale = None

    def plan(self, indptr, indices, last_page_len, num_qo_heads, num_kv_heads, head_dim, page_size, q_data_type,
             kv_data_type, sm_scale) -> None:
        self.indptr.copy_(indptr)
        self.last_page_len.copy_(last_page_len)
        self.scale = sm_scale
        DecodeWrapperStandIn.plans += 1

    def run(self, query, cache, out=None):
        out = torch.empty_like(query) if out is None else out
        return listed_pages_attention(query, cache[0].squeeze(2), cache[1].squeeze(2), self, self.scale, out)


def check_graph() -> None:
    """The CUDA path on CPU tensors: Triton kernels interpreted, FlashInfer replaced by a torch stand-in that reads
    the planned index buffer, and each layer's "graph" replaced by a recorder. At every step where a captured graph
    would replay, the launches must match the captured ones exactly (tensor storage, shapes and scalars), i.e.
    nothing the graph reads moved without a re-capture; through left padding, reranks, promotions, tail retirements,
    growth, a crop and a continued generate; with ``exact_rescore`` too. Tokens must equal the torch reference
    path's."""
    from flexicache import FlexiCache, HeadProfile, decode_graph
    from flexicache.backends import triton_exact, triton_select

    torch.cuda.synchronize = lambda *args, **kwargs: None
    launches: list = []
    for module, name in ((triton_select, "_score_pages_kernel"), (triton_select, "_decode_table_kernel"),
                         (triton_select, "_append_token_kernel"), (triton_exact, "_candidates_kernel"),
                         (triton_exact, "_page_mass_kernel")):
        kernel = getattr(module, name)

        def recorded(grid, kernel=kernel, name=name):
            def launch(*args, **kwargs):
                launches.append((name, grid, *[(a.data_ptr(), a.shape) if torch.is_tensor(a) else a for a in args],
                                 *sorted(kwargs.items())))
                return kernel[grid](*args, **kwargs)
            return launch

        setattr(module, name, type(name, (), {"__getitem__": staticmethod(recorded)})())
    mismatches = []

    def run(self, launch, storage_key):
        start = len(launches)
        launch()
        record = launches[start:]
        if getattr(self, "record", None) is not None and storage_key == self._storage_key:
            if record != self.record:
                mismatches.append(next(pair for pair in zip(record, self.record) if pair[0] != pair[1]))
        else:
            self.record, self._storage_key = record, storage_key
            self.captures += 1
        return self.output

    model = tiny_model()
    profile = HeadProfile(num_layers=2, num_kv_heads=2, head_dim=32, unstable_heads=[(0, 1), (1, 0)])
    ids, mask = padded_batch()
    # Page boxes in the model's axes and in each head's principal axes; pages chosen by their boxes or their keys.
    for principal, exact in ((False, False), (True, False), (False, True)):
        tokens = {}
        for mode in ("graph", "reference"):
            with (cuda_path_on_cpu(lambda: FlashInferStandIn(launches)) if mode == "graph"
                  else contextlib.nullcontext()):
                original_run = decode_graph.DecodeGraph.run
                decode_graph.DecodeGraph.run = run if mode == "graph" else original_run
                try:
                    flexi = FlexiCache.from_model(model, profile=profile, token_budget=64, rerank_interval=4,
                                                  principal_bounds=principal, exact_rescore=exact,
                                                  standby_pages=2 if exact else "auto")
                    with torch.inference_mode():
                        tokens[mode] = generate_crop_continue(model, flexi, ids, mask, first_tokens=40)
                finally:
                    decode_graph.DecodeGraph.run = original_run
            if mode == "graph":
                captures = [layer.graphed.graph.captures for layer in flexi.layers]
                assert all(1 <= count <= 12 for count in captures), captures  # most steps replay
                assert flexi.stats()["promoted_pages"] > 0
        assert not mismatches, mismatches[:1]
        assert all(torch.equal(a, b) for a, b in zip(tokens["graph"], tokens["reference"])), (principal, exact)


@contextlib.contextmanager
def cuda_path_on_cpu(make_backend):
    """Give new caches the CUDA path on CPU tensors: the Triton decode kernels (interpreted), zero-copy transfers
    and ``make_backend()`` as every layer's backend (a FlashInfer stand-in: the CUDA-graph decode path)."""
    from flexicache import backends, decode_paths, offload

    original = (backends.resolve_backend, decode_paths.fused_kernels_available, offload.zero_copy_available)
    backends.resolve_backend = lambda name, device, dtype, head_dim: make_backend()
    decode_paths.fused_kernels_available = lambda device, head_dim: True
    offload.zero_copy_available = lambda device: True
    try:
        yield
    finally:
        backends.resolve_backend, decode_paths.fused_kernels_available, offload.zero_copy_available = original


class ExternalReads(TorchDispatchMode):
    """Records every torch op and Triton launch of a forward with the storage of each tensor argument it did not
    produce itself (weights, cache buffers, static inputs, per-step tensors made before the forward) and every
    scalar argument of the launches: a CUDA graph would bake exactly these in."""

    active: list[ExternalReads] = []

    def __init__(self) -> None:
        super().__init__()
        self.produced: set[int] = set()
        self.reads: list = []

    def __enter__(self):
        ExternalReads.active.append(self)
        return super().__enter__()

    def __exit__(self, *exc):
        ExternalReads.active.pop()
        return super().__exit__(*exc)

    def describe(self, values) -> list:
        return [("tensor", tuple(a.shape), a.stride(), None if a.untyped_storage().data_ptr() in self.produced
                 else a.untyped_storage().data_ptr()) if torch.is_tensor(a) else a
                for a in torch.utils._pytree.tree_leaves(values)]

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        kwargs = kwargs or {}
        external = [a for a in self.describe((args, kwargs)) if isinstance(a, tuple) and a[-1] is not None]
        out = func(*args, **kwargs)
        self.produced.update(t.untyped_storage().data_ptr() for t in torch.utils._pytree.tree_leaves(out)
                             if torch.is_tensor(t))
        self.reads.append((str(func), external))
        return out

    @staticmethod
    def record_launches(module) -> None:
        """Make every ``_*_kernel`` of ``module`` log its launches (grid, tensors, scalars) to the active mode."""
        for name in [name for name in vars(module) if name.startswith("_") and name.endswith("_kernel")]:
            kernel = getattr(module, name)

            def launcher(grid, kernel=kernel, name=name):
                def launch(*args, **kwargs):
                    if ExternalReads.active:
                        mode = ExternalReads.active[-1]
                        mode.reads.append((name, grid, mode.describe((args, sorted(kwargs.items())))))
                    return kernel[grid](*args, **kwargs)
                return launch

            setattr(module, name, type(name, (), {"__getitem__": staticmethod(launcher)})())


def host_state(flexi) -> list:
    """The cache's host-side bookkeeping (what a graph replay cannot change)."""
    sequence = flexi.sequence
    state = [sequence.num_chunks, sequence.logical_length, sequence.last_chunk_start, sequence.decode_steps,
             sequence.num_tokens_host.tolist(), id(sequence.last_plan)]
    for layer in flexi.layers:
        state += [layer.num_chunks, layer.get_seq_length(), layer.unstable_reranks]
        offloaded = layer.storage.offloaded
        if offloaded is not None:
            state += [offloaded.steps_since_rerank, offloaded.counters.reranks, offloaded.counters.bytes_d2h]
    return state


class EmulatedGraph:
    """A recorded whole step on the CPU: a replay runs the recorded forward again in recording mode and notes in
    ``problems`` any read that differs from the recording's (something a real graph would read stale) or any
    host-state change (a real replay runs no Python)."""

    def __init__(self, run_forward, flexi, reads, problems: list) -> None:
        self.run_forward, self.flexi, self.reads, self.problems, self.recorded = run_forward, flexi, reads, problems, None
        # What a real graph bakes in: each layer's recorded work (a replay may follow a step whose host work was done
        # by prepare_replay, which leaves these as the last recording set them).
        self.layer_work = [(layer.graphed.recorded_rerank, layer.graphed.recorded_launch) for layer in flexi.layers]
        # A real replay runs the recorded kernels whatever grad mode its caller is in: run the forward again in the
        # recording's mode (torch dispatches some ops differently in another one).
        self.grad_mode = (torch.is_inference_mode_enabled(), torch.is_grad_enabled())

    def replay(self) -> None:
        before = host_state(self.flexi)
        for layer, (rerank, launch) in zip(self.flexi.layers, self.layer_work):
            layer.graphed.recorded_rerank, layer.graphed.recorded_launch = rerank, launch
        inference, grad = self.grad_mode
        with (ExternalReads() as mode, self.flexi.step_graphs.recording(), torch.inference_mode(inference),
              torch.set_grad_enabled(grad)):
            self.recorded.output = self.run_forward()
        if mode.reads != self.reads:
            self.problems.append(next((i, a, b) for i, (a, b) in enumerate(zip(mode.reads, self.reads)) if a != b))
        if host_state(self.flexi) != before:
            self.problems.append(("host state changed", before, host_state(self.flexi)))


def emulated_recording(problems: list):
    """A stand-in for ``step_graph._record`` that records an :class:`EmulatedGraph`."""
    from flexicache import step_graph

    def record(store, key, flexi, tensors, forward):
        with torch.inference_mode(False):  # as step_graph._record makes them: replays copy into them in any mode
            inputs = {name: tensor.clone() for name, tensor in tensors.items()}
        before = host_state(flexi)
        with ExternalReads() as mode, flexi.step_graphs.recording():
            output = forward(inputs)
        assert host_state(flexi) == before
        graph = EmulatedGraph(lambda: forward(inputs), flexi, mode.reads, problems)
        store.steps[key] = graph.recorded = step_graph.RecordedStep(graph, inputs, output)
        store.captures += 1
        return output

    return record


@contextlib.contextmanager
def graph_path_on_cpu(make_backend, record):
    """Route new caches through the whole-step graph path on CPU tensors: :func:`cuda_path_on_cpu`, each layer's
    graph runs its launch, ``record`` stands in for ``step_graph._record`` and the CPU counts as one CUDA device."""
    from flexicache import decode_graph, step_graph

    original = (decode_graph.DecodeGraph.run, step_graph.single_cuda_device, step_graph._record)
    decode_graph.DecodeGraph.run = lambda self, launch, storage_key: (launch(), self.output)[1]
    step_graph.single_cuda_device = lambda layers: True
    step_graph._record = record
    try:
        with cuda_path_on_cpu(make_backend):
            yield
    finally:
        decode_graph.DecodeGraph.run, step_graph.single_cuda_device, step_graph._record = original


def check_step() -> None:
    """Whole-step CUDA graphs emulated on CPU tensors (Triton kernels interpreted, FlashInfer replaced by the torch
    stand-in). A "capture" runs the prepared step once and records every op's external reads; a "replay" runs the
    recorded forward again and must read exactly the same storage (nothing per-step baked in) without changing any
    host state (a real replay runs no Python). Through left padding, two requests opening pages at the same steps,
    reranks at every phase, promotions, tail retirements, growth while steps replay (4-token pages: checked to
    happen), a crop, a continued generate, a hand-written decode loop (with standby pages), per-layer page splits and
    every head unstable, the tokens must equal the torch reference path's."""
    from flexicache import FlexiCache, HeadProfile
    from flexicache.evaluation.generation import greedy_generate

    torch.cuda.synchronize = lambda *args, **kwargs: None
    record_kernel_launches()
    problems: list = []

    record = emulated_recording(problems)

    model = tiny_model()
    profile = HeadProfile(num_layers=2, num_kv_heads=2, head_dim=32, unstable_heads=[(0, 1), (1, 0)])
    ids, mask = padded_batch()
    ids, mask = torch.cat([ids, ids[:1]]), torch.cat([mask, mask[:1]])  # two requests open pages at the same steps
    tokens, stats = {}, {}
    for mode in ("step graphs", "reference"):
        graph_path = graph_path_on_cpu(lambda: FlashInferStandIn([]), record)
        with graph_path if mode == "step graphs" else contextlib.nullcontext():
            flexi = FlexiCache.from_model(model, profile=profile, token_budget=32, page_size=4, rerank_interval=4)
            finished = []  # steps whose host work was split around the replay (prepare_replay / finish_replay)
            finish_replay = flexi.step_graphs.finish_replay
            flexi.step_graphs.finish_replay = lambda plan: (finished.append(plan.num_new_pages),
                                                            finish_replay(plan))[1]
            grew = []
            clear = flexi.step_graphs.clear
            flexi.step_graphs.clear = lambda: (  # note the clears of a storage change (not those of a reset)
                grew.append(flexi.step_graphs.replays)
                if sys._getframe(1).f_code.co_name == "run_graphed_step" else None, clear())[1]
            with torch.inference_mode():
                first, second = generate_crop_continue(model, flexi, ids, mask, first_tokens=60)
                # A hand-written decode loop passes no positions: the step graphs must make them step inputs. Its
                # cache sizes its buffers up front (max_cache_len): the graphs read reserved, not grown, storage;
                # and it keeps its page boxes in principal axes (the turned key and query inside the recording),
                # and refreshes its stable heads from standby pages at every step.
                alone = FlexiCache.from_model(model, profile=profile, token_budget=64, rerank_interval=4,
                                              max_cache_len=ids.shape[1] + 24, principal_bounds=True,
                                              standby_pages=3)
                loop = greedy_generate(model, ids[0].tolist(), alone, max_new_tokens=24, stop_ids=set())
                # Each layer with its own split of the pages (head_budgets): its own plan inside the step graphs;
                # and a first layer with its own split before a layer that keeps K for every head (the shared plan
                # that layer reads must still be refreshed at every step).
                split = FlexiCache.from_model(model, profile=profile, token_budget=64, rerank_interval=4,
                                              head_budgets="prompt")
                first_split = FlexiCache.from_model(model, profile=HeadProfile(2, 2, 32, [(0, 0), (0, 1)]),
                                                    token_budget=64, rerank_interval=4, standby_pages=0,
                                                    head_budgets="prompt")
                with skewed_head_budgets():
                    split_tokens = model.generate(ids, attention_mask=mask, past_key_values=split,
                                                  max_new_tokens=24, do_sample=False)
                    first_split_tokens = model.generate(ids, attention_mask=mask, past_key_values=first_split,
                                                        max_new_tokens=24, do_sample=False)
                assert all(layer.storage.row_pages_key for layer in split.layers)
                assert [bool(layer.storage.row_pages_key) for layer in first_split.layers] == [True, False]
                # Every head unstable (the online split's unstable_fraction=1.0): no host tier, no stable rerank.
                unstable = FlexiCache.from_model(model, token_budget=32, page_size=4, unstable_fraction=1.0)
                unstable_tokens = model.generate(ids, attention_mask=mask, past_key_values=unstable,
                                                 max_new_tokens=24, do_sample=False)
                assert all(layer.storage.unstable_heads == [0, 1] for layer in unstable.layers)
            tokens[mode] = (first, second, torch.tensor(loop), split_tokens, first_split_tokens, unstable_tokens)
            stats[mode] = flexi.stats()
            stats[mode]["grew"], stats[mode]["finished"] = grew, finished
            stats[mode]["loop_replays"] = alone.stats()["step_graph_replays"]
            stats[mode]["split_replays"] = min(split.stats()["step_graph_replays"],
                                               first_split.stats()["step_graph_replays"],
                                               unstable.stats()["step_graph_replays"])
    graphed = stats["step graphs"]
    assert not problems, problems[:1]
    assert graphed["grew"], "no buffer grew while steps replayed: growth and re-recording went untested"
    assert graphed["step_graph_replays"] >= 30 and 4 <= graphed["step_graph_captures"] <= 30, graphed
    assert graphed["promoted_pages"] > 0 and graphed["reranks_stable"] == stats["reference"]["reranks_stable"]
    assert graphed["decode_steps"] == stats["reference"]["decode_steps"] and graphed["loop_replays"] >= 15
    assert graphed["split_replays"] >= 15
    # Most replays split their host work around the replay, also at steps that open pages (reservations first).
    assert len(graphed["finished"]) >= 20 and any(graphed["finished"]), graphed["finished"]
    assert all(torch.equal(a, b) for a, b in zip(tokens["step graphs"], tokens["reference"])), [
        torch.equal(a, b) for a, b in zip(tokens["step graphs"], tokens["reference"])]


def flashinfer_on_cpu() -> None:
    """Let the real :class:`FlashInferBackend` run on CPU tensors in this process: FlashInfer's wrapper is
    :class:`DecodeWrapperStandIn`, and the CUDA calls around it (synchronisation, page-locking) do nothing."""
    import types

    sys.modules["flashinfer"] = types.SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=DecodeWrapperStandIn,
                                                      __version__="0.7.2.post1")
    torch.cuda.synchronize = lambda *args, **kwargs: None
    torch.Tensor.pin_memory = lambda self, *args, **kwargs: self


def record_kernel_launches() -> None:
    """Make every FlexiCache Triton kernel log its launches to the active :class:`ExternalReads`."""
    from flexicache.backends import triton_rerank, triton_select, triton_transfer

    for module in (triton_select, triton_transfer, triton_rerank):
        ExternalReads.record_launches(module)


def check_interleave() -> None:
    """Two caches of different lengths share the process's FlashInfer backend (the real ``FlashInferBackend`` over a
    torch stand-in of FlashInfer's wrapper) and alternate whole-step graphed decode steps, with the CUDA-core and
    the tensor-core kernel (both reuse a plan while the page counts stay): each step must plan for its own cache
    before its replay (the other cache re-planned the shared buffers in between), replays must read what they
    recorded, and each cache's tokens must equal its own reference-path run."""
    from flexicache import FlexiCache, HeadProfile

    flashinfer_on_cpu()
    record_kernel_launches()
    problems: list = []
    profile = HeadProfile(num_layers=2, num_kv_heads=2, head_dim=32, unstable_heads=[(0, 1), (1, 0)])
    torch.manual_seed(1)
    # B starts under the budget (4 of 8 pages): while it grows, its page counts differ from A's at every step.
    prompts = {"A": torch.randint(0, 512, (3, 150)), "B": torch.randint(0, 512, (3, 14))}

    def decode(order: list[str]) -> tuple[dict, dict]:
        model = tiny_model()
        caches = {name: FlexiCache.from_model(model, profile=profile, token_budget=32, page_size=4,
                                              rerank_interval=4) for name in prompts}
        tokens: dict[str, list] = {name: [] for name in prompts}
        with torch.inference_mode():
            last = {name: model(input_ids=ids, past_key_values=caches[name]).logits[:, -1].argmax(-1)
                    for name, ids in prompts.items()}
            for name in order:
                tokens[name].append(last[name])
                logits = model(input_ids=last[name][:, None], past_key_values=caches[name]).logits
                last[name] = logits[:, -1].argmax(-1)
        return {name: torch.stack(t, 1) for name, t in tokens.items()}, {n: c.stats() for n, c in caches.items()}

    steps = 24
    reference, _ = decode(["A"] * steps + ["B"] * steps)
    for tensor_cores in (False, True):
        shared = FlashInferBackend(torch.device("cpu"), use_tensor_cores=tensor_cores)
        plans_before = DecodeWrapperStandIn.plans
        with graph_path_on_cpu(lambda shared=shared: shared, emulated_recording(problems)):
            tokens, stats = decode(["A", "B"] * steps)
        assert not problems, problems[:1]
        assert all(stats[name]["step_graph_replays"] >= steps // 2 for name in prompts), stats
        # While B grows (its first ~15 steps) each cache plans before each of its steps (the other re-planned the
        # shared wrapper in between); once both sit at the budget no step plans (planning every step: 2 * steps).
        plans = DecodeWrapperStandIn.plans - plans_before
        assert steps < plans <= 2 * steps - 12, (tensor_cores, plans)
        assert all(torch.equal(tokens[name], reference[name]) for name in prompts), tensor_cores


class StreamStandIn:
    def wait_stream(self, other) -> None:
        pass


class CapturedGraph:
    """What a CUDA graph keeps of Python: nothing (a replay runs the recorded kernels, not the code that launched
    them), so a stand-in replay does nothing."""

    def replay(self) -> None:
        pass


def capture_stand_in(launch, device, pool=None) -> CapturedGraph:
    launch()  # a capture runs the Python once, recording what it launches
    return CapturedGraph()


def check_freeing() -> None:
    """With the cycle collector off, a cache nobody refers to any more is freed, its layers, storage and decode
    paths with it, on the CUDA paths run on CPU tensors: the fused kernels launched eagerly, per-layer CUDA graphs
    and whole-step graphs, the caches sharing one FlashInfer backend (the real one over a torch stand-in of
    FlashInfer's wrapper, as the process-wide one is shared), through prefill, reranks, promotions, tail
    retirements, growth, a crop and a continued generate. Captures run their launch once and keep nothing of it;
    replays do nothing (the outputs are check_graph's and check_step's concern): with whole-step graphs that leaves
    the pages opened at replayed steps without a slot, which a crop in place would take as they are, so that case
    crops before its first replay (its continued generate replays). ``close()`` frees a cache's storage and
    recorded steps at once, while it is still referred to."""
    import gc
    import weakref

    from flexicache import FlexiCache, HeadProfile, decode_graph, disable_step_graphs, enable_step_graphs, step_graph
    from flexicache.backends import ReferenceBackend

    flashinfer_on_cpu()
    torch.cuda.graph_pool_handle = lambda: None
    torch.cuda.current_stream = lambda device=None: StreamStandIn()
    torch.cuda.stream = lambda stream: contextlib.nullcontext()
    decode_graph.capture = step_graph.capture = capture_stand_in
    step_graph.capture_stream = lambda device: StreamStandIn()
    step_graph.single_cuda_device = lambda layers: True
    shared = FlashInferBackend(torch.device("cpu"))
    model = tiny_model()
    profile = HeadProfile(num_layers=2, num_kv_heads=2, head_dim=32, unstable_heads=[(0, 1), (1, 0)])
    ids, mask = padded_batch()
    settings = {"profile": profile, "token_budget": 32, "page_size": 4, "rerank_interval": 4}
    cases = {"FusedDecode": (ReferenceBackend, disable_step_graphs), "GraphedDecode": (lambda: shared,
             disable_step_graphs), "whole-step graphs": (lambda: shared, enable_step_graphs)}
    for name, (make_backend, step_graphs) in cases.items():
        gc.collect()
        gc.disable()
        try:
            with cuda_path_on_cpu(make_backend):
                cache = FlexiCache.from_model(model, **settings)
                step_graphs(model)
                with torch.inference_mode():
                    generate_crop_continue(model, cache, ids, mask,
                                           first_tokens=3 if name == "whole-step graphs" else 20)
                stats, paths = cache.stats(), {type(layer.path).__name__ for layer in cache.layers}
                parts = [cache, *cache.layers, *(layer.storage for layer in cache.layers),
                         *(layer.path for layer in cache.layers)]
                refs = [weakref.ref(part) for part in parts]
                del cache, parts
            alive = [ref() for ref in refs if ref() is not None]
            assert not alive, (name, type(alive[0]).__name__, [type(r).__name__ for r in gc.get_referrers(alive[0])])
        finally:
            gc.enable()
        assert paths == {name if name != "whole-step graphs" else "GraphedDecode"}, (name, paths)
        assert stats["promoted_pages"] > 0 and (stats["step_graph_replays"] > 0) == (name == "whole-step graphs")
    gc.disable()
    try:
        with cuda_path_on_cpu(lambda: shared), FlexiCache.from_model(model, **settings) as cache:
            with torch.inference_mode():
                model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=12, do_sample=False)
            held = [weakref.ref(layer.storage) for layer in cache.layers]
            held += [weakref.ref(recorded) for recorded in cache.step_graphs.steps.values()]
            assert len(held) > 2
        assert all(ref() is None for ref in held) and cache.closed
    finally:
        gc.enable()


def check_modes() -> None:
    """The CUDA graph paths on CPU tensors under ``inference_mode``, ``no_grad`` and plain mode, in any order: the
    FlashInfer backend the process shares (the real one over a torch stand-in of FlashInfer's wrapper) first used
    under ``inference_mode`` by another cache (as ``warm_up`` uses it), then caches prefilled under one mode and
    decoded step by step under the others, whole-step graphs (emulated, as in :func:`check_step`) recorded in one
    mode and replayed in another. Tokens must equal the torch reference path's in inference mode alone."""
    from flexicache import FlexiCache, HeadProfile

    flashinfer_on_cpu()
    record_kernel_launches()
    problems: list = []
    profile = HeadProfile(num_layers=2, num_kv_heads=2, head_dim=32, unstable_heads=[(0, 1), (1, 0)])
    settings = {"profile": profile, "token_budget": 32, "page_size": 4, "rerank_interval": 4}
    model = tiny_model()
    prompt = torch.randint(0, 512, (2, 60), generator=torch.Generator().manual_seed(2))
    modes = {"inference_mode": torch.inference_mode, "no_grad": torch.no_grad, "plain": contextlib.nullcontext}

    def decode(order: list[str], steps: int = 18) -> torch.Tensor:
        cache = FlexiCache.from_model(model, **settings)
        with modes[order[0]]():
            last = model(input_ids=prompt, past_key_values=cache).logits[:, -1].argmax(-1)
        tokens = []
        for step in range(steps):
            tokens.append(last)
            with modes[order[(step + 1) % len(order)]]():  # a clone: an inference tensor is no plain-mode input
                last = model(input_ids=last[:, None].clone(), past_key_values=cache).logits[:, -1].argmax(-1)
        assert cache.stats()["promoted_pages"] > 0
        return torch.stack(tokens, 1)

    reference = decode(["inference_mode"])
    shared = FlashInferBackend(torch.device("cpu"))
    with graph_path_on_cpu(lambda: shared, emulated_recording(problems)):
        with torch.inference_mode():
            model.generate(prompt, attention_mask=torch.ones_like(prompt), max_new_tokens=6, do_sample=False,
                           past_key_values=FlexiCache.from_model(model, **settings))
        for order in (["no_grad", "plain", "inference_mode"], ["inference_mode", "plain", "no_grad"]):
            assert torch.equal(decode(order), reference), order
    assert not problems, problems[:1]


def patch_language_once_per_launch() -> None:
    """Speed Triton's interpreter up: it patches the ``triton.language`` modules a kernel's module sees for the
    kernel's launch, then again at every call of a jitted helper inside the kernel (a scan of the modules' members
    each time: about 40% of these checks' time), though those patches hold until the launch ends. Patch once per
    launch for each module the kernel and its helpers come from; on a Triton release without the names this relies
    on, change nothing."""
    from triton.runtime import interpreter

    patch_lang, executor = getattr(interpreter, "_patch_lang", None), getattr(interpreter, "GridExecutor", None)
    scope = getattr(interpreter, "_LangPatchScope", None)
    if patch_lang is None or executor is None or scope is None:
        return
    launch = executor.__call__
    patched: set[int] = set()  # the globals of the modules this launch patched the language for

    def patch_once(fn):
        if id(fn.__globals__) in patched:
            return scope()  # nothing to restore
        patched.add(id(fn.__globals__))
        return patch_lang(fn)

    def launch_patching_once(self, *args, **kwargs):
        patched.clear()
        try:
            return launch(self, *args, **kwargs)
        finally:
            patched.clear()

    interpreter._patch_lang = patch_once
    executor.__call__ = launch_patching_once


if __name__ == "__main__":
    patch_language_once_per_launch()
    checks = {"table": check_table, "topk": check_topk, "transfers": check_transfers, "rerank": check_rerank, "graph": check_graph,
              "step": check_step, "interleave": check_interleave, "freeing": check_freeing, "modes": check_modes}
    checks[sys.argv[1]]()
