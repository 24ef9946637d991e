"""Device page storage: per-page key min/max metadata and the page pool of heads that keep every page resident.

Shapes: ``B`` requests, ``H`` KV heads of a layer, ``h`` those of one class (stable or unstable), ``P`` page
capacity, ``S`` pool slots, ``ps`` page size, ``D`` head dim. Rows (request, head) flatten as ``r = b * h + head``.
"""

from __future__ import annotations

import torch

from flexicache.sequence import AppendPlan, expand_ranges, per_row


def grow_dim(tensor: torch.Tensor, dim: int, size: int, fill: float | bool = 0) -> torch.Tensor:
    """``tensor`` padded with ``fill`` along ``dim`` to at least ``size``.

    A growth reserves a quarter more than ``size`` (at least 16): copies stay amortised, reserved memory stays within
    ~25% of use, and a prefill leaves room for the decode steps after it (no reallocation at the first new page).
    """
    current = tensor.shape[dim]
    if size <= current:
        return tensor
    shape = list(tensor.shape)
    shape[dim] = grown_size(current, size)
    # made outside inference mode, like every buffer a cache keeps (flexicache.storage)
    with torch.inference_mode(False):
        grown = tensor.new_full(shape, fill)
        grown.narrow(dim, 0, current).copy_(tensor)
    return grown


def grown_size(current: int, size: int) -> int:
    """The length :func:`grow_dim` leaves along a dimension of length ``current`` asked for ``size``."""
    return current if size <= current else size + max(16, size // 4)


def chunk_tokens(keys: torch.Tensor, plan: AppendPlan) -> torch.Tensor:
    """``[N, h, D]``: the real tokens of a chunk ``keys [B, h, T, D]`` in plan order."""
    batch_size, num_heads, length, head_dim = keys.shape
    if plan.batch.numel() == batch_size * length:  # every position real: plan order is [B, T] row-major
        return keys.transpose(1, 2).reshape(batch_size * length, num_heads, head_dim)
    return keys.permute(0, 2, 1, 3)[plan.batch, plan.chunk_pos]


class PageMetadata:
    """Element-wise key min/max of every page of every head of a layer: ``kmin``/``kmax``, ``[B, H, P, D]``."""

    def __init__(self, batch_size: int, num_heads: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int) -> None:
        self.kmin = torch.full((batch_size, num_heads, capacity, head_dim), float("inf"), dtype=dtype, device=device)
        self.kmax = torch.full_like(self.kmin, float("-inf"))

    @property
    def nbytes(self) -> int:
        return 2 * self.kmin.numel() * self.kmin.element_size()

    def reserve(self, num_pages: int) -> None:
        """Make room for ``num_pages`` pages per row."""
        self.kmin = grow_dim(self.kmin, 2, num_pages, float("inf"))
        self.kmax = grow_dim(self.kmax, 2, num_pages, float("-inf"))

    def append(self, new_keys: torch.Tensor, plan: AppendPlan) -> None:
        """Fold the chunk's real keys (``[N, H, D]`` in plan order) into their pages' min/max."""
        batch_size, num_heads, _, head_dim = self.kmin.shape
        self.reserve(plan.max_pages_after)
        new_keys = new_keys.to(self.kmin.dtype)
        if plan.is_single_token:  # decode: one token per request, a page opens where its offset is 0
            opens = (plan.offset == 0).view(-1, 1, 1)
            current_min = self.kmin[plan.batch, :, plan.page]
            current_max = self.kmax[plan.batch, :, plan.page]
            self.kmin[plan.batch, :, plan.page] = torch.where(opens, new_keys, torch.minimum(current_min, new_keys))
            self.kmax[plan.batch, :, plan.page] = torch.where(opens, new_keys, torch.maximum(current_max, new_keys))
            return
        if plan.starts_empty_rows:
            self._fold_from_empty(new_keys.reshape(batch_size, -1, num_heads, head_dim), plan.page_size)
            return
        # Several tokens per page: the touched pages' tokens laid out as ``[U, ps, H, D]`` blocks (the rest of a page
        # padded with the reduction's identity) and reduced over the page; a page the chunk continues keeps its old
        # tokens' min/max (a page it opens starts empty). No atomics: one pass per bound.
        self.kmin[plan.new_page_batch, :, plan.new_page_index] = float("inf")
        self.kmax[plan.new_page_batch, :, plan.new_page_index] = float("-inf")
        capacity = self.kmin.shape[2]
        touched, inverse = torch.unique(plan.batch * capacity + plan.page, return_inverse=True)
        touched_batch, touched_page = touched // capacity, touched % capacity
        blocks = new_keys.new_empty(touched.numel(), plan.page_size, num_heads, head_dim)
        for meta, empty, reduce, combine in ((self.kmin, float("inf"), torch.amin, torch.minimum),
                                             (self.kmax, float("-inf"), torch.amax, torch.maximum)):
            blocks.fill_(empty)
            blocks[inverse, plan.offset] = new_keys
            meta[touched_batch, :, touched_page] = combine(meta[touched_batch, :, touched_page],
                                                           reduce(blocks, dim=1))

    def _fold_from_empty(self, keys: torch.Tensor, page_size: int) -> None:
        """The boxes of the first pages of every row from ``keys [B, n, H, D]``, each request's first ``n`` tokens
        (a view, no token copied): full pages reduced as ``[B, P, ps, H, D]`` blocks, then the partial last page."""
        batch_size, length, num_heads, head_dim = keys.shape
        full = length // page_size
        for meta, reduce in ((self.kmin, torch.amin), (self.kmax, torch.amax)):
            if full:
                blocks = keys[:, :full * page_size].view(batch_size, full, page_size, num_heads, head_dim)
                meta[:, :, :full] = reduce(blocks, dim=2).transpose(1, 2)
            if length % page_size:
                meta[:, :, full] = reduce(keys[:, full * page_size:], dim=1)

    def clear_pages(self, batch: torch.Tensor, page: torch.Tensor) -> None:
        """Forget pages ``page [n]`` of requests ``batch [n]`` (every head): min ``+inf``, max ``-inf``, as never
        written."""
        self.kmin[batch, :, page] = float("inf")
        self.kmax[batch, :, page] = float("-inf")

    def refold(self, batch: torch.Tensor, page: torch.Tensor, keys: torch.Tensor, lengths: torch.Tensor) -> None:
        """Recompute the min/max of pages ``page [n]`` of requests ``batch [n]`` from their first ``lengths [n]``
        tokens, ``keys [n, H, ps, D]`` (the rest of each page is ignored)."""
        kept = (torch.arange(keys.shape[2], device=keys.device) < lengths.view(-1, 1)).view(-1, 1, keys.shape[2], 1)
        keys = keys.to(self.kmin.dtype)
        self.kmin[batch, :, page] = keys.masked_fill(~kept, float("inf")).amin(dim=2)
        self.kmax[batch, :, page] = keys.masked_fill(~kept, float("-inf")).amax(dim=2)

    def rows(self, heads: torch.Tensor, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kmin, kmax)`` of the first ``num_pages`` pages of ``heads`` as ``[B * len(heads), num_pages, D]``."""
        head_dim = self.kmin.shape[-1]
        return (
            self.kmin[:, heads, :num_pages].reshape(-1, num_pages, head_dim),
            self.kmax[:, heads, :num_pages].reshape(-1, num_pages, head_dim),
        )

    def listed_rows(self, heads: torch.Tensor, pages: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """``(kmin, kmax)`` ``[B * len(heads), L, D]`` of the pages ``pages [B * len(heads), L]`` of each row of
        ``heads`` (``-1`` entries read page 0)."""
        batch = torch.arange(self.kmin.shape[0], device=pages.device).repeat_interleave(heads.numel()).unsqueeze(1)
        head = heads.repeat(self.kmin.shape[0]).unsqueeze(1)
        pages = pages.clamp(min=0)
        return self.kmin[batch, head, pages], self.kmax[batch, head, pages]


class PagePool:
    """One layer's device pages: ``k``/``v`` of shape ``[S, ps, D]``, handed out in slot ranges that never move.

    ``capacity`` slots are allocated up front; growing beyond reallocates but keeps every slot index valid.
    """

    def __init__(self, page_size: int, head_dim: int, dtype: torch.dtype, device: torch.device,
                 capacity: int = 0) -> None:
        self.k = torch.zeros(capacity, page_size, head_dim, dtype=dtype, device=device)
        self.v = torch.zeros_like(self.k)
        self.used = 0

    def allocate(self, count: int) -> int:
        """First slot of ``count`` new consecutive slots."""
        start = self.used
        self.make_room(count)
        self.used += count
        return start

    def make_room(self, count: int) -> None:
        """Capacity for ``count`` slots beyond those in use (no slot handed out)."""
        self.k = grow_dim(self.k, 0, self.used + count)
        self.v = grow_dim(self.v, 0, self.used + count)

    @property
    def nbytes_reserved(self) -> int:
        return 2 * self.k.numel() * self.k.element_size()


class ResidentPages:
    """Every page of ``h`` heads on the device, in the layer's :class:`PagePool`, with a page table per row.

    ``table``: ``[B, h, P]`` pool slot of every page (``-1`` = none), ``capacity`` pages per row up front. Slots are
    never freed: the pages a crop removes keep theirs in the table (``spare``) for the tokens that come next.
    """

    def __init__(self, pool: PagePool, batch_size: int, num_heads: int, page_size: int, capacity: int = 0) -> None:
        self.pool = pool
        self.num_heads = num_heads
        self.page_size = page_size
        self.table = torch.full((batch_size, num_heads, capacity), -1, dtype=torch.long, device=pool.k.device)
        # [B] (CPU) pages of each request whose table entries hold pool slots, where a crop left some beyond its
        # tokens; None: the table holds slots for exactly the requests' pages.
        self.spare: torch.Tensor | None = None

    def reserve_pages(self, plan: AppendPlan) -> int:
        """Room in the page table and ``num_new_pages x h`` new pool slots for the pages the chunk starts; returns
        the first slot (the ``r``-th new page gets slots ``first + r * h + j``, head ``j``)."""
        self.make_room(plan)
        return self.pool.allocate(plan.num_new_pages * self.num_heads)

    def make_room(self, plan: AppendPlan) -> None:
        """The page table's and the pool's capacity for the pages the chunk starts (no slot handed out)."""
        self.table = grow_dim(self.table, 2, plan.max_pages_after, -1)
        self.pool.make_room(plan.num_new_pages * self.num_heads)

    def open_pages(self, plan: AppendPlan) -> None:
        """Give every page the chunk starts a pool slot per head (the slot it had before a crop, if any)."""
        num_new = plan.num_new_pages * self.num_heads
        if num_new and self.spare is not None:
            self._open_pages_reusing(plan)
        elif num_new:
            start = self.reserve_pages(plan)
            slots = torch.arange(start, start + num_new, device=self.table.device)
            self.table[plan.new_page_batch, :, plan.new_page_index] = slots.view(-1, self.num_heads)

    def _open_pages_reusing(self, plan: AppendPlan) -> None:
        """:meth:`open_pages` after a crop: pages below ``spare`` keep their table entries, the others get new
        slots."""
        page_size = self.page_size
        first_new = (plan.before_host + page_size - 1) // page_size
        end_new = (plan.after_host + page_size - 1) // page_size
        fresh_start = torch.maximum(first_new, self.spare)
        counts = (end_new - fresh_start).clamp(min=0)
        self.table = grow_dim(self.table, 2, plan.max_pages_after, -1)
        total = int(counts.sum())
        if total:
            start = self.pool.allocate(total * self.num_heads)
            batch, page = expand_ranges(fresh_start, counts)
            slots = torch.arange(start, start + total * self.num_heads, device=self.table.device)
            device = self.table.device
            self.table[batch.to(device), :, page.to(device)] = slots.view(-1, self.num_heads)
        self.spare = torch.maximum(self.spare, end_new)
        if bool((self.spare == end_new).all()):
            self.spare = None

    def keep_spare(self, pages: torch.Tensor) -> None:
        """A crop left each request ``pages [B]`` (CPU) pages with slots, some now beyond its tokens."""
        self.spare = pages.clone() if self.spare is None else torch.maximum(self.spare, pages)

    def page_keys(self, batch: torch.Tensor, page: torch.Tensor) -> torch.Tensor:
        """``[n, h, ps, D]`` keys of page ``page [n]`` of requests ``batch [n]``."""
        return self.pool.k[self.table[batch, :, page]]

    def take_rows(self, source: ResidentPages, index: torch.Tensor, num_pages: torch.Tensor) -> None:
        """Hold the pages of requests ``index [B']`` of ``source`` (another pool's): new slots in this pool, the
        pages copied; ``num_pages [B']`` (CPU): pages of each (its spare ones are left behind)."""
        device = self.table.device
        self.table = torch.full((index.numel(), self.num_heads, source.table.shape[2]), -1, dtype=torch.long,
                                device=device)
        total = int(num_pages.sum())
        if not total:
            return
        batch, page = expand_ranges(torch.zeros_like(num_pages), num_pages)
        batch, page = batch.to(device), page.to(device)
        count = total * self.num_heads
        start = self.pool.allocate(count)
        self.table[batch, :, page] = torch.arange(start, start + count, device=device).view(-1, self.num_heads)
        source_slots = source.table[index.to(device)[batch], :, page].view(-1)
        for target, pages in ((self.pool.k, source.pool.k), (self.pool.v, source.pool.v)):
            # straight into the new slots (consecutive): no temporary copy of the pages
            torch.index_select(pages, 0, source_slots, out=target[start:start + count])

    def append(self, new_keys: torch.Tensor, new_values: torch.Tensor, plan: AppendPlan) -> None:
        """Write the chunk's real tokens (``[N, h, D]`` in plan order), opening the pages they start."""
        self.open_pages(plan)
        slots = self.table[plan.batch, :, plan.page].reshape(-1)  # [N * h]
        offsets = per_row(plan.offset, self.num_heads)
        self.pool.k[slots, offsets] = new_keys.reshape(-1, new_keys.shape[-1]).to(self.pool.k.dtype)
        self.pool.v[slots, offsets] = new_values.reshape(-1, new_values.shape[-1]).to(self.pool.v.dtype)

    def tail_slots(self, after: torch.Tensor) -> torch.Tensor:
        """``[B, h]`` slots of each request's last page, given its real-token count ``after [B]``."""
        tail_page = ((after - 1).clamp(min=0) // self.page_size).view(-1, 1, 1).expand(-1, self.num_heads, 1)
        return self.table.gather(2, tail_page).squeeze(2)

    def page_slots(self, pages: torch.Tensor) -> torch.Tensor:
        """Pool slots of ``pages [B * h, k]`` (``-1`` stays ``-1``)."""
        table = self.table.reshape(-1, self.table.shape[2])
        return torch.where(pages >= 0, table.gather(1, pages.clamp(min=0)), -1)

    def read_tokens(self, num_pages: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[B, h, num_pages * ps, D]`` keys and values in token order (beyond a request's length: unspecified)."""
        slots = self.table[:, :, :num_pages].clamp(min=0)
        batch_size, num_heads = slots.shape[:2]
        shape = (batch_size, num_heads, num_pages * self.page_size, self.pool.k.shape[-1])
        return self.pool.k[slots].reshape(shape), self.pool.v[slots].reshape(shape)
