"""Page importance (the Quest bound of each page's key box, optionally with its spread down-weighted) and per-head
top-K page selection.

Rows are (request, KV head) pairs flattened into a leading dimension ``R``; every function here works on any
device and dtype and does no host synchronisation.
"""

from __future__ import annotations

from typing import Literal

import torch

GroupReduce = Literal["max", "sum"]


def quest_page_scores(
    query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, group_reduce: GroupReduce = "max",
    spread_weight: float = 1.0,
) -> torch.Tensor:
    """Page scores from each page's key box, reduced over the query heads of a GQA group.

    With the box's centre ``c = (kmax + kmin) / 2`` and radius ``r = (kmax - kmin) / 2``,
    ``score[r, p] = reduce_g (q . c + spread_weight * |q| . r)``. ``spread_weight = 1`` is Quest's upper bound of
    ``q . k`` over the page, ``sum_d max(q_d kmax_d, q_d kmin_d) = relu(q) . kmax + min(q, 0) . kmin``; a smaller
    weight counts a page's spread less: in high dimension the bound is loose (no key sits in every corner of its
    box), and ``0.5`` ranks pages by their attention mass better on the models measured (eval/RESULTS.md). With
    ``w_hi = (1 + spread_weight) / 2`` and ``w_lo = (1 - spread_weight) / 2`` the score is
    ``(w_hi relu(q) + w_lo min(q, 0)) . kmax + (w_hi min(q, 0) + w_lo relu(q)) . kmin``: two batched matmuls.

    Args:
        query: ``[R, G, D]`` queries of the ``G`` query heads sharing each row's KV head.
        kmin, kmax: ``[R, P, D]`` element-wise key minimum / maximum of every page.
        group_reduce: ``"max"`` or ``"sum"`` over the ``G`` query heads.
        spread_weight: weight of the box's radius, in ``[0, 1]``.

    Returns:
        ``[R, P]`` scores in float32 (float64 if ``query`` is float64).
    """
    return reduce_group(box_scores(query, kmin, kmax, spread_weight), group_reduce)


def box_scores(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, spread_weight: float = 1.0
               ) -> torch.Tensor:
    """``[R, Q, P]`` box score of each of ``Q`` queries per row (:func:`quest_page_scores` before its reduction), from
    ``query [R, Q, D]`` and ``kmin, kmax [R, P, D]``."""
    compute_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
    q = query.to(compute_dtype)
    positive, negative = q.clamp(min=0), q.clamp(max=0)
    if spread_weight != 1.0:
        high, low = spread_weights(spread_weight)
        positive, negative = high * positive + low * negative, high * negative + low * positive
    scores = torch.bmm(positive, kmax.to(compute_dtype).transpose(1, 2))
    scores += torch.bmm(negative, kmin.to(compute_dtype).transpose(1, 2))
    return scores


def reduce_group(scores: torch.Tensor, group_reduce: GroupReduce) -> torch.Tensor:
    """``[R, P]`` from the scores ``[R, G, P]`` of a GQA group's query heads: their max or their sum."""
    if group_reduce == "max":
        return scores.amax(dim=1)
    if group_reduce == "sum":
        return scores.sum(dim=1)
    raise ValueError(f"group_reduce must be 'max' or 'sum', got {group_reduce!r}")


def spread_weights(spread_weight: float) -> tuple[float, float]:
    """``(w_hi, w_lo)`` of :func:`quest_page_scores`: the weights of a query's same-sign and opposite-sign box
    corner."""
    return (1.0 + spread_weight) / 2, (1.0 - spread_weight) / 2


def select_pages(
    scores: torch.Tensor, num_pages: torch.Tensor, k: int | torch.Tensor, force_last: bool = True,
    most: int | None = None,
) -> tuple[torch.Tensor, torch.Tensor]:
    """Top-``k`` pages of every row, with the first page (sink) and optionally the last page (tail) forced in.

    Equal scores are broken toward the lower page index, whatever the row's width (batch invariance).

    Args:
        scores: ``[R, P]`` page scores; columns at or beyond a row's ``num_pages`` are ignored.
        num_pages: ``[R]`` number of candidate pages of each row (pages ``0 .. num_pages - 1``).
        k: pages to select per row (``k >= 2`` when ``force_last``, ``k >= 1`` otherwise): one number for every
            row, or ``[R]`` one per row (``head_budgets="prompt"``; the output is as wide as the largest).
        force_last: also force page ``num_pages - 1`` (the current, partially filled page).
        most: with ``k`` per row, its largest value where the host knows it (no device sync to read it).

    Returns:
        ``(pages, page_scores)``, both ``[R, min(k, P)]``: selected page indices in ascending order (so the tail,
        when forced, is the last valid entry) with ``-1`` padding at the end for rows with fewer than ``k``
        candidates, and the score of each selected page (``+inf`` for forced pages, ``-inf`` for padding).
    """
    num_rows, width = scores.shape
    row_k = None
    if isinstance(k, torch.Tensor):
        row_k, k = k.to(scores.device).view(-1, 1), most if most is not None else int(k.max()) if k.numel() else 0
    k = min(k, width)
    if k == 0:
        empty = torch.empty(num_rows, 0, dtype=torch.long, device=scores.device)
        return empty, scores.new_empty(num_rows, 0)
    columns = torch.arange(width, device=scores.device)
    num_pages = num_pages.to(scores.device).view(-1, 1)
    ranked = scores.masked_fill(columns >= num_pages, float("-inf"))
    forced = (columns == 0) & (num_pages > 0)
    if force_last:
        forced |= columns == num_pages - 1
    ranked = ranked.masked_fill(forced, float("inf"))
    # Ties go to the lower page index. A stable sort, not topk: topk breaks ties differently for different row
    # widths, so a request would select other pages in a batch (wider rows) than alone, e.g. for a zero query.
    top_scores, top_pages = ranked.sort(dim=1, descending=True, stable=True)
    top_scores, top_pages = top_scores[:, :k], top_pages[:, :k]
    if row_k is not None:  # a row's entries beyond its own k are padding
        top_scores = top_scores.masked_fill(torch.arange(k, device=scores.device) >= row_k, float("-inf"))
    missing = top_scores == float("-inf")
    # Ascending page order, padding last: sort keys put missing entries after every real page.
    sort_keys = top_pages.masked_fill(missing, width)
    sort_keys, order = sort_keys.sort(dim=1)
    pages = sort_keys.masked_fill(sort_keys == width, -1)
    return pages, top_scores.gather(1, order)


def exact_page_scores(query: torch.Tensor, keys: torch.Tensor, page_lens: torch.Tensor, scale: float
                      ) -> torch.Tensor:
    """``[R, W]`` each listed page's attention mass from its keys: ``log sum_g softmax_g(page)``, the share of the
    listed tokens' attention that the page holds for query head ``g``, summed over the ``G`` query heads (the
    oracle's criterion, over the listed pages only). ``-inf`` for a page without tokens.

    Args:
        query: ``[R, G, D]`` queries of the query heads sharing each row's KV head.
        keys: ``[R, W, ps, D]`` the keys of every row's ``W`` listed pages.
        page_lens: ``[R, W]`` tokens in each listed page (its first ``page_lens`` keys count; 0: none).
        scale: the attention's softmax scale.
    """
    logits = torch.einsum("rgd,rwtd->rgwt", query.float(), keys.float()) * scale
    real = torch.arange(keys.shape[2], device=keys.device) < page_lens.unsqueeze(-1)  # [R, W, ps]
    page = logits.masked_fill(~real.unsqueeze(1), float("-inf")).logsumexp(dim=-1)  # [R, G, W]
    share = page - page.logsumexp(dim=-1, keepdim=True)
    return share.logsumexp(dim=1).nan_to_num(nan=float("-inf"), neginf=float("-inf"))  # no tokens: NaN -> -inf


def select_candidates(candidates: torch.Tensor, scores: torch.Tensor, k: int | torch.Tensor, most: int | None = None
                      ) -> torch.Tensor:
    """``[R, min(k, W)]`` the columns of the ``k`` (``[R]``: per row, at most ``most``) best of every row's
    ``candidates [R, W]`` by ``scores [R, W]``,
    in ascending order with ``-1`` padding at the end. The candidates are pages as :func:`select_pages` lists them
    (ascending, ``-1`` padding last, sink and tail included): the first and the last listed are forced in and ties
    go to the lower page, so the pages chosen are those :func:`select_pages` chooses from a page-indexed row holding
    ``scores`` at the candidates and ``-inf`` elsewhere."""
    columns, _ = select_pages(scores, (candidates >= 0).sum(dim=1), k, force_last=True, most=most)
    return columns


def update_selection(scores: torch.Tensor, num_full_pages: torch.Tensor, selected: torch.Tensor,
                     max_promotions: int | None = None
                     ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor]:
    """A stable rerank's new selection: the top ``S`` full pages of every row (the sink forced, ties to the lower
    page), pages still selected keeping their slots, the ``r``-th newly promoted page taking the ``r``-th free slot.

    Args:
        scores: ``[R, P]`` page scores (``P`` >= every row's full pages).
        num_full_pages: ``[R]`` candidate pages of each row (all its pages but the tail).
        selected: ``[R, S]`` page held by each selection slot (``-1`` = empty).
        max_promotions: promote at most this many pages per row beyond its empty slots (:func:`limit_promotions`);
            ``None``: no limit.

    Returns:
        ``(new_pages, promoted, target_slots, updated)``: ``[R, S]`` each: the new pages in ascending order
        (``-1`` padded), which of them were not selected before, the slot each promoted one goes to (``S`` for the
        others) and the updated selection.
    """
    slots_per_row = selected.shape[1]
    width = scores.shape[1]
    if max_promotions is not None:
        scores = limit_promotions(scores, num_full_pages, selected, max_promotions)
    new_pages, _ = select_pages(scores, num_full_pages, slots_per_row, force_last=False)
    if new_pages.shape[1] < slots_per_row:
        new_pages = torch.nn.functional.pad(new_pages, (0, slots_per_row - new_pages.shape[1]), value=-1)
    in_new = _membership(new_pages, width)
    in_old = _membership(selected, width)
    keep = (selected >= 0) & in_new.gather(1, selected.clamp(min=0))
    promoted = (new_pages >= 0) & ~in_old.gather(1, new_pages.clamp(min=0))  # over the new pages' entries
    # Pair the r-th promoted page of a row with its r-th free slot (column ``slots_per_row`` takes the rest).
    dump = slots_per_row
    free = ~keep
    columns = torch.arange(slots_per_row, device=keep.device).expand_as(keep)
    slot_of_rank = torch.full((keep.shape[0], slots_per_row + 1), dump, dtype=torch.long, device=keep.device)
    slot_of_rank.scatter_(1, torch.where(free, free.long().cumsum(1) - 1, dump), columns)
    target_slots = slot_of_rank.gather(1, torch.where(promoted, promoted.long().cumsum(1) - 1, dump))
    target_slots = torch.where(promoted, target_slots, dump)
    updated = torch.cat([torch.where(keep, selected, -1), selected.new_full((keep.shape[0], 1), -1)], 1)
    updated.scatter_(1, target_slots, new_pages)
    return new_pages, promoted, target_slots, updated[:, :slots_per_row]


def limit_promotions(scores: torch.Tensor, num_full_pages: torch.Tensor, selected: torch.Tensor,
                     max_promotions: int) -> torch.Tensor:
    """``scores [R, P]`` with every page a rerank may not select set to ``-inf``: a row keeps its held pages
    (``selected [R, S]``) as candidates and admits only its best ``max_promotions`` + (empty slots) others (ties to
    the lower page), so its top ``S`` among those swaps at most ``max_promotions`` held pages for better ones: the
    ``m``-th best newcomer replaces the ``m``-th worst held page where it scores higher."""
    width = scores.shape[1]
    columns = torch.arange(width, device=scores.device)
    candidate = columns < num_full_pages.to(scores.device).view(-1, 1)
    held = _membership(selected, width)[:, :width] & candidate
    newcomer_scores = scores.masked_fill(columns == 0, float("inf")).masked_fill(held | ~candidate, float("-inf"))
    order = newcomer_scores.sort(dim=1, descending=True, stable=True).indices
    rank = torch.empty_like(order).scatter_(1, order, columns.expand_as(order))
    room = max_promotions + (selected < 0).sum(dim=1, keepdim=True)
    admitted = candidate & ~held & (rank < room)
    return scores.masked_fill(~(held | admitted), float("-inf"))


def attended_slots(scores: torch.Tensor, selected: torch.Tensor, count: int | torch.Tensor) -> torch.Tensor:
    """``[R, W]`` bool: the ``count`` (``[R]``: per row) best held slots of every row's working set ``selected
    [R, W]`` (``-1`` = empty) by ``scores [R, W]``, the sink (page 0) forced, NaN as ``+inf`` (as the kernels rank),
    ties to the lower slot; an empty slot never takes a held slot's place, whatever the held slot scores."""
    held = selected >= 0
    ranked = scores.nan_to_num(nan=float("inf"), posinf=float("inf"), neginf=float("-inf"))
    order = ranked.masked_fill(selected == 0, float("inf")).sort(dim=1, descending=True, stable=True).indices
    order = order.gather(1, (~held.gather(1, order)).to(torch.int8).sort(dim=1, stable=True).indices)  # held first
    columns = torch.arange(order.shape[1], device=order.device)
    rank = torch.empty_like(order).scatter_(1, order, columns.expand_as(order))
    if isinstance(count, torch.Tensor):
        count = count.to(rank.device).view(-1, 1)
    return held & (rank < count)


def _membership(pages: torch.Tensor, width: int) -> torch.Tensor:
    """``[R, width + 1]`` bool: page ``p`` is listed in the row (column ``width`` collects the -1 padding)."""
    member = torch.zeros(pages.shape[0], width + 1, dtype=torch.bool, device=pages.device)
    return member.scatter_(1, pages.masked_fill(pages < 0, width), True)
