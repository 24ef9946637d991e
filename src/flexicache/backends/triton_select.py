"""Fused per-layer decode kernels (Triton): the token append, Quest scoring, top-K and the page list of each row.

Three launches per layer and step, all CUDA-graph capturable (every per-step value is read from device memory):

- :func:`append_token`: write each row's new token into its tail page and fold its key into the page min/max;
- ``_score_pages_kernel`` (grid: unstable row x block of pages): Quest upper bounds of every page of the
  *unstable* rows, aggregated over the ``G`` query heads of the group, sink and tail forced to ``+inf`` (its
  ``STABLE_RERANK`` mode scores the stable rows' full pages for their periodic rerank, :func:`stable_page_scores`);
- ``_decode_table_kernel`` (grid: row): an unstable row finds the K-th largest score by bisection over
  order-preserving integer keys held in registers (ties go to the lower page, like
  :func:`~flexicache.selection.select_pages`) and lists the chosen pages in ascending order (tail last) through
  the page table; a *stable* row lists its working-set slots that hold a page (with standby pages: the ``K - 1`` of
  them whose boxes score best for this step's query, scored in the row's own program), then its tail slot. With
  ``exact_rescore`` both choose by the page masses of :mod:`flexicache.backends.triton_exact` instead (an
  unstable row among its top ``exact_candidates * K`` candidates).

Outputs are the compacted FlashInfer index buffer (``indices[indptr[r] + j]``) and/or the padded ``[B * H, K]``
slot/length table of the backend interface.

Every kernel of this package marks its integer arguments ``do_not_specialize``: Triton would otherwise compile a
variant per value class (1, multiples of 16), and these sizes differ between layers and change with buffer growth,
so a new variant compiled in the middle of a decode (~0.5-0.9 s for one step, seen on the H200).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
import triton
import triton.language as tl

from flexicache.selection import spread_weights

MAX_SCORED_PAGES = 16384  # pages per row the selection holds in registers (131k tokens at page size 8)
# Launch settings measured on the H200 (eval/gpu_kernel_sweep.py, BENCHMARKS.md): 32k context, batch 8.
SCORE_BLOCK = 32  # pages per scoring program
SCORE_WARPS = 4
TABLE_WARPS = 8  # most warps of a selection program over up to 4096 pages (fewer for short rows)


@triton.jit
def _order_key(scores):
    """fp32 -> int32 keys with the same order (negative floats have their magnitude bits flipped; -0.0 and +0.0
    tie, as in ``torch.sort``; NaN counts as +inf, whatever its sign bit)."""
    is_nan = scores != scores  # noqa: PLR0124 (the NaN test that compiles and interprets alike)
    bits = tl.where(scores == 0, 0.0, tl.where(is_nan, float("inf"), scores)).to(tl.int32, bitcast=True)
    return bits ^ ((bits >> 31) & 0x7FFFFFFF)


@triton.jit
def _top_keys(key, valid, count):
    """Mask of the ``count`` largest of the ``valid`` int64 ``key``s (ties go to the lower index; at least
    ``count`` keys valid), by bisecting the ``count``-th largest key: the largest ``t`` with
    ``#(key >= t) >= count``, between the smallest valid key and the largest below +inf's (the forced pages' +inf
    would widen the range by about 2^30 keys, six more steps) unless the +inf keys alone exceed the count. A ``t``
    with exactly ``count`` keys at or above it ends the search early: those keys are the answer whatever ``t`` is
    (no tie at the boundary)."""
    low = tl.min(tl.where(valid, key, 2147483647), axis=0)
    high = tl.max(tl.where(valid & (key < 0x7F800000), key, -2147483648), axis=0)  # 0x7F800000: +inf's key
    if tl.sum((valid & (key > high)).to(tl.int32), axis=0) > count:
        high = tl.max(tl.where(valid, key, -2147483648), axis=0)
    while low < high:
        middle = (low + high + 1) // 2
        above = tl.sum((valid & (key >= middle)).to(tl.int32), axis=0)
        if above > count:
            low = middle
        elif above == count:
            low = middle
            high = middle
        else:
            high = middle - 1
    ties_wanted = count - tl.sum((valid & (key > low)).to(tl.int32), axis=0)
    tie = valid & (key == low)
    return valid & ((key > low) | (tie & (tl.cumsum(tie.to(tl.int32), axis=0) <= ties_wanted)))


@triton.jit
def _row_of(pid, num_unstable_rows, num_unstable, num_stable, num_heads, unstable_heads_ptr, stable_heads_ptr):
    """(row index within its class, batch, row ``b * H + h``) of program ``pid`` (unstable rows first)."""
    if pid < num_unstable_rows:
        index = pid
        batch = index // num_unstable
        head = tl.load(unstable_heads_ptr + index % num_unstable)
    else:
        index = pid - num_unstable_rows
        batch = index // num_stable
        head = tl.load(stable_heads_ptr + index % num_stable)
    return index, batch, batch * num_heads + head


@triton.jit
def _box_scores(query_ptr, query_row, kmin_ptr, kmax_ptr, offsets, valid, weight_high, weight_low,
                GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, REDUCE_SUM: tl.constexpr,
                SPREAD_WEIGHTED: tl.constexpr):
    """``[BLOCK]`` box scores of the pages whose min/max sit at ``offsets [BLOCK, HEAD_DIM]`` (where ``valid``) for
    the ``GROUP`` queries of ``query_row`` (int64): Quest's bound, or with ``SPREAD_WEIGHTED`` the corners weighted
    ``weight_high``/``weight_low`` (:func:`~flexicache.selection.quest_page_scores`), max or sum over the group."""
    dims = tl.arange(0, HEAD_DIM)
    kmin = tl.load(kmin_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
    kmax = tl.load(kmax_ptr + offsets, mask=valid[:, None], other=0.0).to(tl.float32)
    if REDUCE_SUM:
        score = tl.zeros([BLOCK], dtype=tl.float32)
    else:
        score = tl.full([BLOCK], float("-inf"), dtype=tl.float32)
    for g in tl.static_range(GROUP):
        q = tl.load(query_ptr + (query_row * GROUP + g) * HEAD_DIM + dims).to(tl.float32)
        if SPREAD_WEIGHTED:
            positive, negative = tl.maximum(q, 0.0), tl.minimum(q, 0.0)
            high = weight_high * positive + weight_low * negative
            low = weight_high * negative + weight_low * positive
            bound = tl.sum(high[None, :] * kmax + low[None, :] * kmin, axis=1)
        else:
            bound = tl.sum(tl.maximum(q[None, :] * kmax, q[None, :] * kmin), axis=1)
        if REDUCE_SUM:
            score += bound
        else:
            score = tl.maximum(score, bound)
    return score


@triton.jit
def _listed_scores(query_ptr, kmin_ptr, kmax_ptr, pages_ptr, out_ptr, query_row, meta_row, count, weight_high,
                   weight_low, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr, BLOCK: tl.constexpr, CHUNK: tl.constexpr,
                   REDUCE_SUM: tl.constexpr, SPREAD_WEIGHTED: tl.constexpr):
    """Store at ``out_ptr`` the box scores of the ``count`` pages listed at ``pages_ptr`` (``-1``: none; metadata row
    from page ``meta_row``, int64) for the queries of ``query_row`` (int64), ``CHUNK`` pages at a time."""
    dims = tl.arange(0, HEAD_DIM)
    for start in tl.static_range(0, BLOCK, CHUNK):
        entry = start + tl.arange(0, CHUNK)
        page = tl.load(pages_ptr + entry, mask=entry < count, other=-1)
        offsets = (meta_row + tl.maximum(page, 0)[:, None].to(tl.int64)) * HEAD_DIM + dims[None, :]
        score = _box_scores(query_ptr, query_row, kmin_ptr, kmax_ptr, offsets, page >= 0, weight_high, weight_low,
                            GROUP, HEAD_DIM, CHUNK, REDUCE_SUM, SPREAD_WEIGHTED)
        tl.store(out_ptr + entry, score, mask=entry < count)


@triton.jit
def _mass_scores(mass_ptr, count, GROUP: tl.constexpr, BLOCK: tl.constexpr):
    """``[BLOCK]`` each listed page's share of the listed pages' attention summed over the ``GROUP`` query heads, in
    natural log (:func:`~flexicache.selection.exact_page_scores`; ``-inf`` for a page without tokens), from the
    log2 masses ``[GROUP, count]`` at ``mass_ptr`` (``exact_rescore``, :mod:`flexicache.backends.triton_exact`)."""
    w = tl.arange(0, BLOCK)
    # share_g = mass_g - log2 sum_w 2^mass_g; then log2 sum_g 2^share_g, both with their maxima out.
    top_share = tl.full([BLOCK], float("-inf"), tl.float32)
    for g in tl.static_range(GROUP):
        mass = tl.load(mass_ptr + g * count + w, mask=w < count, other=float("-inf"))
        top_share = tl.maximum(top_share, mass - _log2_sum_exp2(mass))
    safe_top = tl.where(top_share == float("-inf"), 0.0, top_share)
    total = tl.zeros([BLOCK], tl.float32)
    for g in tl.static_range(GROUP):
        mass = tl.load(mass_ptr + g * count + w, mask=w < count, other=float("-inf"))
        total += tl.exp2(mass - _log2_sum_exp2(mass) - safe_top)
    return tl.where(total > 0, (safe_top + tl.log2(total)) * 0.6931471805599453, float("-inf"))


@triton.jit
def _log2_sum_exp2(mass):
    """``log2 sum 2^mass`` over a row (``-inf`` for a row of ``-inf``)."""
    top = tl.max(mass, axis=0)
    safe = tl.where(top == float("-inf"), 0.0, top)
    return safe + tl.log2(tl.sum(tl.exp2(mass - safe), axis=0))


@triton.jit(do_not_specialize=["num_listed", "num_heads", "meta_capacity", "scores_stride", "weight_high",
                                "weight_low", "within_pages"])
def _score_pages_kernel(query_ptr, kmin_ptr, kmax_ptr, num_tokens_ptr, heads_ptr, scores_ptr,
                        num_listed, num_heads, meta_capacity, scores_stride, weight_high, weight_low, within_pages,
                        PAGE_SIZE: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
                        BLOCK_P: tl.constexpr, REDUCE_SUM: tl.constexpr, STABLE_RERANK: tl.constexpr,
                        SPREAD_WEIGHTED: tl.constexpr):
    """Box scores of a block of pages of row (request ``b``, head ``heads[i]``), program ``(b * n + i, block)``:
    Quest's bound, or with ``SPREAD_WEIGHTED`` the corners weighted ``weight_high``/``weight_low``
    (:func:`~flexicache.selection.quest_page_scores`).

    Decode selection (``STABLE_RERANK`` off): every page, only rows of more than ``within_pages`` pages (the fewest
    any row attends to: the others list every page, unscored), sink and tail +inf; the
    query of row ``b * H + h``. Stable rerank (on): full pages only (the tail is no candidate), every row, nothing
    forced; the query of row ``b * n + i`` (the listed heads' own queries).
    """
    index = tl.program_id(0)
    batch = index // num_listed
    row = batch * num_heads + tl.load(heads_ptr + index % num_listed)
    num_tokens = tl.load(num_tokens_ptr + batch).to(tl.int32)
    if STABLE_RERANK:
        num_pages = tl.maximum(num_tokens - 1, 0) // PAGE_SIZE
        query_row = index
        scored = tl.program_id(1) * BLOCK_P < num_pages
    else:
        num_pages = (num_tokens + PAGE_SIZE - 1) // PAGE_SIZE
        query_row = row
        scored = (num_pages > within_pages) & (tl.program_id(1) * BLOCK_P < num_pages)  # within budget: none
    page = tl.program_id(1) * BLOCK_P + tl.arange(0, BLOCK_P)
    valid = (page < num_pages) & (page < scores_stride)  # a row never writes past its own scores
    if scored:
        dims = tl.arange(0, HEAD_DIM)
        offsets = (row.to(tl.int64) * meta_capacity + page[:, None]) * HEAD_DIM + dims[None, :]
        score = _box_scores(query_ptr, query_row.to(tl.int64), kmin_ptr, kmax_ptr, offsets, valid, weight_high,
                            weight_low, GROUP, HEAD_DIM, BLOCK_P, REDUCE_SUM, SPREAD_WEIGHTED)
        if not STABLE_RERANK:
            score = tl.where((page == 0) | (page == num_pages - 1), float("inf"), score)
        tl.store(scores_ptr + index.to(tl.int64) * scores_stride + page, score, mask=valid)


@triton.jit
def _store_row(out_slots_ptr, out_lens_ptr, flat_ptr, indptr_ptr, row, positions, slots, lengths, mask, width,
               WRITE_TABLE: tl.constexpr, WRITE_FLAT: tl.constexpr):
    """Write the listed entries (``mask``) of ``row`` at ``positions`` (``width``: the padded table's row length)."""
    if WRITE_TABLE:
        out = row.to(tl.int64) * width + positions
        tl.store(out_slots_ptr + out, slots.to(tl.int64), mask=mask)
        tl.store(out_lens_ptr + out, lengths.to(tl.int64), mask=mask)
    if WRITE_FLAT:
        tl.store(flat_ptr + tl.load(indptr_ptr + row) + positions, slots.to(tl.int32), mask=mask)


@triton.jit(do_not_specialize=["num_unstable_rows", "num_unstable", "num_stable", "num_heads", "table_capacity",
                               "stable_base", "scores_stride", "meta_capacity", "weight_high", "weight_low", "width"])
def _decode_table_kernel(
    scores_ptr, table_ptr, selected_ptr, selected_scores_ptr, working_scores_ptr, query_ptr, kmin_ptr, kmax_ptr,
    num_tokens_ptr, unstable_heads_ptr, stable_heads_ptr, out_slots_ptr, out_lens_ptr, flat_ptr, indptr_ptr,
    candidate_slots_ptr, candidate_lens_ptr, unstable_mass_ptr, stable_mass_ptr, row_pages_ptr,
    num_unstable_rows, num_unstable, num_stable, num_heads, table_capacity, stable_base, scores_stride, meta_capacity,
    weight_high, weight_low, width,
    K: tl.constexpr, SLOTS: tl.constexpr, PAGE_SIZE: tl.constexpr, BLOCK_K: tl.constexpr, BLOCK_W: tl.constexpr,
    BLOCK_S: tl.constexpr, CHUNK_W: tl.constexpr, GROUP: tl.constexpr, HEAD_DIM: tl.constexpr,
    REDUCE_SUM: tl.constexpr, SPREAD_WEIGHTED: tl.constexpr, WRITE_TABLE: tl.constexpr, WRITE_FLAT: tl.constexpr,
    EXACT: tl.constexpr, CANDIDATES: tl.constexpr, BLOCK_C: tl.constexpr,
):
    pid = tl.program_id(0)
    index, batch, row = _row_of(pid, num_unstable_rows, num_unstable, num_stable, num_heads, unstable_heads_ptr,
                                stable_heads_ptr)
    k_offsets = tl.arange(0, BLOCK_K)
    in_row = k_offsets < width
    k = tl.load(row_pages_ptr + row).to(tl.int32)  # the row's own K (head_budgets)
    n = tl.load(num_tokens_ptr + batch).to(tl.int32)
    num_pages = (n + PAGE_SIZE - 1) // PAGE_SIZE
    last_len = n - (num_pages - 1) * PAGE_SIZE
    if WRITE_TABLE:  # clear the padded row first; listed entries overwrite it
        out = row.to(tl.int64) * width + k_offsets
        tl.store(out_slots_ptr + out, tl.full([BLOCK_K], -1, tl.int64), mask=in_row)
        tl.store(out_lens_ptr + out, tl.zeros([BLOCK_K], tl.int64), mask=in_row)
        tl.debug_barrier()
    if pid < num_unstable_rows:
        table_row = table_ptr + index.to(tl.int64) * table_capacity
        if num_pages <= k:  # every page fits: list them all
            listed = k_offsets < num_pages
            every_slot = tl.load(table_row + k_offsets, mask=listed, other=-1)
            every_length = tl.where(k_offsets == num_pages - 1, last_len, PAGE_SIZE)
            _store_row(out_slots_ptr, out_lens_ptr, flat_ptr, indptr_ptr, row, k_offsets, every_slot, every_length,
                       listed, width, WRITE_TABLE, WRITE_FLAT)
        elif EXACT:  # the k of most attention mass among the candidates (ascending pages: sink first, tail last)
            c = tl.arange(0, BLOCK_C)  # names below differ from the other branches': Triton types them per branch
            candidate = index.to(tl.int64) * CANDIDATES + c
            candidate_length = tl.load(candidate_lens_ptr + candidate, mask=c < CANDIDATES, other=0)
            is_candidate = candidate_length > 0
            last = tl.sum(is_candidate.to(tl.int32), axis=0) - 1
            mass_score = _mass_scores(unstable_mass_ptr + index.to(tl.int64) * GROUP * CANDIDATES, CANDIDATES, GROUP,
                                      BLOCK_C)
            mass_score = tl.where((c == 0) | (c == last), float("inf"), mass_score)
            picked = _top_keys(_order_key(mass_score).to(tl.int64), is_candidate, k)
            picked_slot = tl.load(candidate_slots_ptr + candidate, mask=picked, other=-1)
            picked_position = tl.cumsum(picked.to(tl.int32), axis=0) - 1
            _store_row(out_slots_ptr, out_lens_ptr, flat_ptr, indptr_ptr, row, picked_position, picked_slot,
                       candidate_length, picked, width, WRITE_TABLE, WRITE_FLAT)
        else:
            page = tl.arange(0, BLOCK_S)
            valid = page < num_pages
            key = _order_key(tl.load(scores_ptr + index.to(tl.int64) * scores_stride + page, mask=valid,
                                     other=0.0)).to(tl.int64)
            # Chosen pages in ascending order (the tail, the highest page, lands last); ties go to lower pages.
            chosen = _top_keys(key, valid, k)
            position = tl.cumsum(chosen.to(tl.int32), axis=0) - 1
            chosen_slot = tl.load(table_row + page, mask=chosen, other=-1)
            chosen_length = tl.where(page == num_pages - 1, last_len, PAGE_SIZE)
            _store_row(out_slots_ptr, out_lens_ptr, flat_ptr, indptr_ptr, row, position, chosen_slot, chosen_length,
                       chosen, width, WRITE_TABLE, WRITE_FLAT)
    else:
        # A stable row lists the working-set slots it attends to (all of them, or with standby pages the k - 1 best
        # for this step's query: OffloadedPages.decode_pages), then its tail slot.
        w = tl.arange(0, BLOCK_W)
        selected_row = selected_ptr + index.to(tl.int64) * SLOTS
        page = tl.load(selected_row + w, mask=w < SLOTS, other=-1)
        attended = page >= 0
        if SLOTS > K - 1:
            if EXACT:
                score = _mass_scores(stable_mass_ptr + index.to(tl.int64) * GROUP * SLOTS, SLOTS, GROUP, BLOCK_W)
            else:
                working_scores = working_scores_ptr + index.to(tl.int64) * SLOTS
                _listed_scores(query_ptr, kmin_ptr, kmax_ptr, selected_row, working_scores, row.to(tl.int64),
                               row.to(tl.int64) * meta_capacity, SLOTS, weight_high, weight_low, GROUP, HEAD_DIM,
                               BLOCK_W, CHUNK_W, REDUCE_SUM, SPREAD_WEIGHTED)
                tl.debug_barrier()
                score = tl.load(working_scores + w, mask=attended, other=0.0)
            score = tl.where(page == 0, float("inf"), tl.where(attended, score, float("-inf")))
            tl.store(selected_scores_ptr + index.to(tl.int64) * SLOTS + w, score, mask=w < SLOTS)
            if tl.sum(attended.to(tl.int32), axis=0) > k - 1:  # ties go to the lower slots
                attended = _top_keys(_order_key(score).to(tl.int64), attended, k - 1)
        count = tl.sum(attended.to(tl.int32))
        first_slot = stable_base + index.to(tl.int64) * (SLOTS + 1)
        positions = tl.cumsum(attended.to(tl.int32), axis=0) - 1
        _store_row(out_slots_ptr, out_lens_ptr, flat_ptr, indptr_ptr, row, positions, first_slot + w,
                   tl.full([BLOCK_W], PAGE_SIZE, tl.int32), attended, width, WRITE_TABLE, WRITE_FLAT)
        tail = w == 0
        _store_row(out_slots_ptr, out_lens_ptr, flat_ptr, indptr_ptr, row, count + w, first_slot + SLOTS + w,
                   last_len + w, tail, width, WRITE_TABLE, WRITE_FLAT)


@dataclass
class TableInputs:
    """Everything one layer's decode table reads. Tensors must keep their storage for a captured CUDA graph.

    ``query``: ``[B * H, G, D]`` rows of queries (row ``b * H + h``); ``kmin``/``kmax``: ``[B, H, P, D]`` page
    min/max; ``table``: ``[B, hu, P']`` pool slot of every page of the unstable heads (``None`` if none);
    ``selected``/``selected_scores``: ``[B * hs, K - 1 + C]`` the stable heads' working sets and their scores
    (``None`` if none; with standby pages, ``C > 0``, the scores are this step's after the table is made);
    ``num_tokens``: ``[B]`` real tokens per request (after this step's token); ``unstable_heads`` /
    ``stable_heads``: head indices of the two classes; ``stable_base``: first pool slot of the stable rows;
    ``row_pages``: ``[B * H]`` pages each row attends to (``K``, or its own with ``head_budgets="prompt"``),
    ``width`` the largest and ``fewest_pages`` the smallest of them (host ints: the table's row length, and the row
    length up to which every row lists every page); ``max_width``: the largest ``width`` any split of these settings
    gives (:attr:`~flexicache.config.FlexiCacheConfig.max_row_pages`: sizes the kernel's row block, so a request
    whose split differs compiles nothing new); ``candidate_pages``: an unstable row's candidates with exact rescoring
    (``exact_candidates * K``).
    """

    query: torch.Tensor
    kmin: torch.Tensor
    kmax: torch.Tensor
    table: torch.Tensor | None
    selected: torch.Tensor | None
    selected_scores: torch.Tensor | None
    num_tokens: torch.Tensor
    unstable_heads: torch.Tensor
    stable_heads: torch.Tensor
    stable_base: int
    pages_per_head: int
    page_size: int
    group_reduce: str
    spread_weight: float
    row_pages: torch.Tensor
    width: int
    fewest_pages: int
    max_width: int
    candidate_pages: int


@dataclass
class ExactScratch:
    """A layer's scratch for the exact rescoring (kept by a captured CUDA graph): ``candidate_slots`` /
    ``candidate_lens``: ``[B * hu, N]`` int64, the unstable rows' ``N`` (``exact_candidates * K``) candidate pages
    in ascending page order; ``unstable_mass``: ``[B * hu, G, N]`` and ``stable_mass``: ``[B * hs, G, K - 1 + C]``
    fp32 (one row where a class has no rows or, for the stable rows, no standby pages)."""

    candidate_slots: torch.Tensor
    candidate_lens: torch.Tensor
    unstable_mass: torch.Tensor
    stable_mass: torch.Tensor

    def tensors(self) -> tuple[torch.Tensor, ...]:
        return (self.candidate_slots, self.candidate_lens, self.unstable_mass, self.stable_mass)

    def fits(self, inputs: TableInputs, group: int) -> bool:
        """Whether this scratch serves a table of ``inputs`` with ``group`` query heads per row."""
        unstable, stable = _scratch_shapes(inputs, group)
        return self.unstable_mass.shape == unstable and self.stable_mass.shape == stable


def exact_scratch(inputs: TableInputs, group: int) -> ExactScratch:
    """Fresh :class:`ExactScratch` for a table of ``inputs`` with ``group`` query heads per row."""
    unstable, stable = _scratch_shapes(inputs, group)
    device = inputs.num_tokens.device
    slots = torch.full((unstable[0], unstable[2]), -1, dtype=torch.long, device=device)
    return ExactScratch(slots, torch.zeros_like(slots),
                        torch.empty(unstable, dtype=torch.float32, device=device),
                        torch.empty(stable, dtype=torch.float32, device=device))


def _scratch_shapes(inputs: TableInputs, group: int) -> tuple[tuple[int, int, int], tuple[int, int, int]]:
    """The shapes of the unstable and the stable rows' page masses (see :class:`ExactScratch`)."""
    unstable_rows = inputs.num_tokens.shape[0] * inputs.unstable_heads.numel()
    working = inputs.selected.shape[1] if inputs.selected is not None else 0
    stable_rows = inputs.selected.shape[0] if working > inputs.pages_per_head - 1 else 0
    return ((max(unstable_rows, 1), group, inputs.candidate_pages),
            (max(stable_rows, 1), group, max(working, 1)))


def selection_warps(block_scores: int) -> int:
    """Warps of a program that selects from a row of ``block_scores`` scores: one per 256 scores, 4 to 16, and at
    most ``TABLE_WARPS`` up to 4096 scores (measured there; longer rows keep 16)."""
    return max(4, min(TABLE_WARPS if block_scores <= 4096 else 16, block_scores // 256))


def fits_fused_table(meta_capacity: int) -> bool:
    """Whether the fused selection can hold a row of ``meta_capacity`` pages in registers."""
    return meta_capacity <= MAX_SCORED_PAGES


def scores_buffer(inputs: TableInputs) -> torch.Tensor:
    """``[B * hu, P]`` fp32 scratch for the unstable rows' page scores (allocate once per capacity)."""
    rows = max(inputs.num_tokens.shape[0] * inputs.unstable_heads.numel(), 1)
    return torch.empty(rows, max(inputs.kmin.shape[2], 1), dtype=torch.float32, device=inputs.query.device)


def stable_page_scores(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, num_tokens: torch.Tensor,
                       heads: torch.Tensor, width: int, page_size: int, group_reduce: str,
                       spread_weight: float = 1.0) -> torch.Tensor:
    """The stable heads' rerank scores (:func:`~flexicache.selection.quest_page_scores` of their full pages) in one
    launch that reads the page min/max once, in place.

    Args:
        query: ``[B * hs, G, D]`` queries of the KV heads ``heads [hs]``; kmin/kmax: ``[B, H, P, D]`` page min/max;
        num_tokens: ``[B]`` real tokens per request; width: columns to return (>= the longest row's full pages).

    Returns:
        ``[B * hs, width]`` fp32 scores; columns past a row's full pages are ``-inf``.
    """
    rows, group, head_dim = query.shape
    scores = torch.full((rows, width), float("-inf"), dtype=torch.float32, device=query.device)
    if rows and width:
        _score_pages_kernel[(rows, triton.cdiv(width, SCORE_BLOCK))](
            query.contiguous(), kmin, kmax, num_tokens, heads, scores, heads.numel(), kmin.shape[1], kmin.shape[2],
            width, *spread_weights(spread_weight), 0, PAGE_SIZE=page_size, GROUP=group, HEAD_DIM=head_dim,
            BLOCK_P=SCORE_BLOCK, REDUCE_SUM=group_reduce == "sum", STABLE_RERANK=True,
            SPREAD_WEIGHTED=spread_weight != 1.0, num_warps=SCORE_WARPS,
        )
    return scores


def working_scores_buffer(inputs: TableInputs) -> torch.Tensor:
    """``[B * hs, K - 1 + C]`` fp32 scratch for the stable rows' working-set scores (allocate once; one element
    without standby pages, where nothing is scored)."""
    rows, working = (inputs.selected.shape if inputs.selected is not None else (0, 0))
    standby = working > inputs.pages_per_head - 1
    return torch.empty(rows if standby else 1, working if standby else 1, dtype=torch.float32,
                       device=inputs.query.device)


def decode_table(inputs: TableInputs, scores: torch.Tensor, working_scores: torch.Tensor | None = None,
                 flat: torch.Tensor | None = None, indptr: torch.Tensor | None = None,
                 table_out: tuple[torch.Tensor, torch.Tensor] | None = None) -> None:
    """Score, select and list one layer's pages: fill ``flat`` at ``indptr`` (FlashInfer's index buffer and its
    ``[B * H + 1]`` row offsets) and/or ``table_out = (slots, page_lens)``, both ``[B * H, width]`` (padded);
    ``scores`` and ``working_scores`` are scratch (:func:`scores_buffer`, :func:`working_scores_buffer`; ``None``:
    allocated here)."""
    if not fits_fused_table(inputs.kmin.shape[2]):
        raise ValueError(f"fused decode table holds at most {MAX_SCORED_PAGES} pages per row, "
                         f"got {inputs.kmin.shape[2]}")
    score_unstable_pages(inputs, scores)
    list_pages(inputs, scores, working_scores_buffer(inputs) if working_scores is None else working_scores, flat,
               indptr, table_out)


def score_unstable_pages(inputs: TableInputs, scores: torch.Tensor) -> None:
    """Fill ``scores [B * hu, >= P]`` with the unstable rows' page scores (rows within the budget are skipped)."""
    rows, group, head_dim = inputs.query.shape
    batch, num_unstable, capacity = inputs.num_tokens.shape[0], inputs.unstable_heads.numel(), inputs.kmin.shape[2]
    if num_unstable:
        _score_pages_kernel[(batch * num_unstable, triton.cdiv(capacity, SCORE_BLOCK))](
            inputs.query, inputs.kmin, inputs.kmax, inputs.num_tokens, inputs.unstable_heads, scores, num_unstable,
            rows // batch, capacity, scores.shape[1], *spread_weights(inputs.spread_weight), inputs.fewest_pages,
            PAGE_SIZE=inputs.page_size, GROUP=group, HEAD_DIM=head_dim, BLOCK_P=SCORE_BLOCK,
            REDUCE_SUM=inputs.group_reduce == "sum", STABLE_RERANK=False,
            SPREAD_WEIGHTED=inputs.spread_weight != 1.0, num_warps=SCORE_WARPS,
        )


def list_pages(inputs: TableInputs, scores: torch.Tensor, working_scores: torch.Tensor,
               flat: torch.Tensor | None = None, indptr: torch.Tensor | None = None,
               table_out: tuple[torch.Tensor, torch.Tensor] | None = None, exact: ExactScratch | None = None
               ) -> None:
    """Select each row's pages from ``scores`` and write them (see :func:`decode_table`); with ``exact``
    (``exact_rescore``) by the page masses it holds: the unstable rows over the budget among its candidates, the
    stable rows' working sets (with standby pages)."""
    rows, group, head_dim = inputs.query.shape
    batch = inputs.num_tokens.shape[0]
    num_unstable, num_stable = inputs.unstable_heads.numel(), inputs.stable_heads.numel()
    unused = inputs.num_tokens  # an int64 stand-in for absent tensors (never read or written)
    block_scores = triton.next_power_of_2(max(inputs.kmin.shape[2], 16))
    slots, lens = table_out if table_out is not None else (unused, unused)
    working = inputs.selected.shape[1] if num_stable else inputs.pages_per_head - 1  # working-set slots per row
    block_working = triton.next_power_of_2(max(working, 1))
    exact_args = ((exact.candidate_slots, exact.candidate_lens, exact.unstable_mass, exact.stable_mass)
                  if exact is not None else (unused,) * 4)
    _decode_table_kernel[(batch * (num_unstable + num_stable),)](
        scores, inputs.table if num_unstable else unused, inputs.selected if num_stable else unused,
        inputs.selected_scores if num_stable else unused, working_scores, inputs.query, inputs.kmin, inputs.kmax,
        inputs.num_tokens, inputs.unstable_heads if num_unstable else unused,
        inputs.stable_heads if num_stable else unused, slots, lens, flat if flat is not None else unused,
        indptr if indptr is not None else unused, *exact_args, inputs.row_pages,
        batch * num_unstable, max(num_unstable, 1), max(num_stable, 1),
        rows // batch, inputs.table.shape[2] if num_unstable else 0, inputs.stable_base, scores.shape[1],
        inputs.kmin.shape[2], *spread_weights(inputs.spread_weight), inputs.width,
        K=inputs.pages_per_head, SLOTS=working, PAGE_SIZE=inputs.page_size,
        BLOCK_K=triton.next_power_of_2(inputs.max_width), BLOCK_W=block_working, BLOCK_S=block_scores,
        CHUNK_W=min(32, block_working), GROUP=group, HEAD_DIM=head_dim, REDUCE_SUM=inputs.group_reduce == "sum",
        SPREAD_WEIGHTED=inputs.spread_weight != 1.0, WRITE_TABLE=table_out is not None, WRITE_FLAT=flat is not None,
        EXACT=exact is not None, CANDIDATES=inputs.candidate_pages,
        BLOCK_C=triton.next_power_of_2(inputs.candidate_pages),
        num_warps=selection_warps(block_scores),
    )


@triton.jit(do_not_specialize=["num_heads", "meta_capacity"])
def _append_token_kernel(keys_ptr, values_ptr, bound_keys_ptr, pool_k_ptr, pool_v_ptr, kmin_ptr, kmax_ptr,
                         write_slots_ptr, page_ptr, offset_ptr, num_heads, meta_capacity,
                         PAGE_SIZE: tl.constexpr, HEAD_DIM: tl.constexpr, SEPARATE_BOUNDS: tl.constexpr):
    row = tl.program_id(0)  # b * H + h
    batch = row // num_heads
    dims = tl.arange(0, HEAD_DIM)
    key = tl.load(keys_ptr + row.to(tl.int64) * HEAD_DIM + dims)
    value = tl.load(values_ptr + row.to(tl.int64) * HEAD_DIM + dims)
    offset = tl.load(offset_ptr + batch)
    token = (tl.load(write_slots_ptr + row) * PAGE_SIZE + offset) * HEAD_DIM
    tl.store(pool_k_ptr + token + dims, key)
    tl.store(pool_v_ptr + token + dims, value)
    meta = (row.to(tl.int64) * meta_capacity + tl.load(page_ptr + batch)) * HEAD_DIM + dims
    opens = offset == 0
    if SEPARATE_BOUNDS:  # the key in the page boxes' axes, rounded to the metadata's dtype as torch rounds it
        key = tl.load(bound_keys_ptr + row.to(tl.int64) * HEAD_DIM + dims).to(kmin_ptr.dtype.element_ty)
    tl.store(kmin_ptr + meta, tl.where(opens, key, tl.minimum(tl.load(kmin_ptr + meta), key)))
    tl.store(kmax_ptr + meta, tl.where(opens, key, tl.maximum(tl.load(kmax_ptr + meta), key)))


def append_token(keys: torch.Tensor, values: torch.Tensor, pool_k: torch.Tensor, pool_v: torch.Tensor,
                 kmin: torch.Tensor, kmax: torch.Tensor, write_slots: torch.Tensor, page: torch.Tensor,
                 offset: torch.Tensor, bound_keys: torch.Tensor | None = None) -> None:
    """Decode step of one layer in one launch: write each row's token (``keys``/``values`` ``[B, H, D]``) at
    ``offset [B]`` of pool slot ``write_slots [B, H]`` and fold its key into the min/max of page ``page [B]``
    (``kmin``/``kmax`` ``[B, H, P, D]``; a page opening at offset 0 starts from the key). ``bound_keys``
    (``[B, H, D]``): the keys the boxes are kept in, when they differ from the stored ones (principal axes)."""
    batch, num_heads, head_dim = keys.shape
    keys = keys.contiguous()
    _append_token_kernel[(batch * num_heads,)](
        keys, values.contiguous(), keys if bound_keys is None else bound_keys.contiguous(), pool_k, pool_v, kmin,
        kmax, write_slots, page, offset, num_heads, kmin.shape[2], PAGE_SIZE=pool_k.shape[1], HEAD_DIM=head_dim,
        SEPARATE_BOUNDS=bound_keys is not None,
    )
