"""Crop and request selection of a layer's storage, without reading its KV back densely.

transformers crops a cache after rejected candidates of assisted generation (at every step), and selects or repeats
its requests for some decoding strategies. A dense rebuild would read every layer's full KV onto the device at once:
the memory FlexiCache exists to save. Here:

- :func:`crop_storage` truncates in place: per request, the pages past the new end are forgotten (min/max back to
  empty, the unstable heads' slots kept for the tokens that come next), the new last page's min/max is recomputed
  from its remaining tokens, the stable heads' selections of pages that are no longer full go (their heads then
  rerank at the next decode step), and a stable tail that moves back to an earlier page is copied from the host tier
  into its tail slot. The result holds what a cache that never saw the cropped tokens holds (pages, counts, min/max,
  host tier up to the new end); its selections are those it had, less the pages cropped, until that rerank.
- :func:`select_requests` makes the storage of the chosen requests (in order, repeats allowed) and copies their
  device pages, metadata, selections and host-tier rows into it, one layer at a time: at most one layer's storage
  exists twice.

Every tensor made here is kept across calls, so it is made outside inference mode (see :mod:`flexicache.storage`).
"""

from __future__ import annotations

import torch

from flexicache import decode_paths
from flexicache.sequence import expand_ranges, host_to_device
from flexicache.storage import LayerStorage


@torch.inference_mode(False)
def crop_storage(storage: LayerStorage, before: torch.Tensor, after: torch.Tensor) -> None:
    """Keep the first ``after [B]`` of each request's ``before [B]`` real tokens (CPU ``long``, ``after <= before``)."""
    page_size, device = storage.settings.page_size, storage.device
    changed = (after < before).nonzero().view(-1)
    if not changed.numel():
        return
    old_pages, new_pages = (before + page_size - 1) // page_size, (after + page_size - 1) // page_size
    if storage.offloaded is not None:  # first: the stable tails' new pages come into their slots
        storage.offloaded.truncate(before, after)
        full_before, full_after = ((tokens - 1).clamp(min=0) // page_size for tokens in (before, after))
        if bool((full_after < full_before).any()):
            # Selections may have lost pages: every row must list min(K - 1, full pages) of them at a decode step
            # (the backends' layout), so the stable heads rerank at the next one (an extend chunk reranks anyway).
            storage.offloaded.steps_since_rerank = storage.settings.rerank_interval
    if storage.resident is not None:
        storage.resident.keep_spare(old_pages)
    counts = (old_pages - new_pages)[changed]
    if int(counts.sum()):
        owner, page = expand_ranges(new_pages[changed], counts)
        batch = changed[owner]
        storage.meta.clear_pages(host_to_device(batch, device), host_to_device(page, device))
    kept = changed[after[changed] > 0]
    if kept.numel():
        tail_page = new_pages[kept] - 1
        batch, page = host_to_device(kept, device), host_to_device(tail_page, device)
        keys = torch.empty(kept.numel(), storage.num_kv_heads, page_size, storage.head_dim, dtype=storage.dtype,
                           device=device)
        if storage.resident is not None:
            keys[:, storage.unstable_index] = storage.resident.page_keys(batch, page)
        if storage.offloaded is not None:
            keys[:, storage.stable_index] = storage.offloaded.tail_keys(batch)
        if storage.basis is not None:  # the boxes are kept in the rows' principal axes
            keys = storage.basis.select(batch).chunk(keys)
        storage.meta.refold(batch, page, keys, host_to_device(after[kept] - tail_page * page_size, device))
    if storage.resident is not None:
        storage.write_slots[:, storage.unstable_index] = storage.resident.tail_slots(host_to_device(after, device))


@torch.inference_mode(False)
def select_requests(storage: LayerStorage, index: torch.Tensor, num_tokens: torch.Tensor) -> LayerStorage:
    """The storage of requests ``index [B']`` of ``storage`` (CPU ``long`` in ``[0, B)``, any order, repeats
    allowed), whose requests hold ``num_tokens [B]`` (CPU) real tokens."""
    device, page_size = storage.device, storage.settings.page_size
    fused = decode_paths.fused_kernels_available(device, storage.head_dim)
    chosen = LayerStorage(storage.settings, storage.unstable_heads, storage.num_kv_heads, index.numel(),
                          storage.head_dim, storage.dtype, device,
                          decode_paths.reserved_device_pages(storage.settings, fused))
    device_index = index.to(device)
    chosen.meta.kmin = storage.meta.kmin.index_select(0, device_index)
    chosen.meta.kmax = storage.meta.kmax.index_select(0, device_index)
    chosen.basis = None if storage.basis is None else storage.basis.select(device_index)
    kept_tokens = num_tokens[index]
    chosen.use_row_pages(storage.row_pages_host.view(storage.batch_size, -1)[index])
    if storage.resident is not None:
        chosen.resident.take_rows(storage.resident, index, (kept_tokens + page_size - 1) // page_size)
        chosen.write_slots[:, chosen.unstable_index] = chosen.resident.tail_slots(host_to_device(kept_tokens, device))
    if storage.offloaded is not None:
        chosen.offloaded.take_rows(storage.offloaded, index)
    return chosen
