"""Shared by the GPU tests and the Triton-interpreter checks (both must import without conftest: the GPU host runs
pytest with ``--noconftest`` and has no hypothesis): compare what two runs of the host-tier paths left behind."""

from __future__ import annotations

import torch

from flexicache import FlexiCache


def transfer_outcome(cache: FlexiCache, logits: tuple[torch.Tensor, ...]) -> tuple:
    """What a generation left behind in the host tier's paths: logits, the stable heads' selections, device pools and
    the host tiers' full pages (cloned; a tier borrowed from the host pool holds whatever its last user left past
    them), and the cache's counters. Compare two with :func:`assert_same_transfer_outcome`. Checks
    :func:`assert_selected_slots_hold_their_pages` first."""
    assert_selected_slots_hold_their_pages(cache)
    stored = [layer.storage for layer in cache.layers if layer.storage.offloaded is not None]
    page_size = cache.settings.page_size
    full_pages = [tokens // page_size for tokens in cache.sequence.num_tokens_host.tolist()]
    state = [tensor.clone() for storage in stored for tensor in
             (storage.offloaded.selected, storage.offloaded.selected_scores, storage.pool.k, storage.pool.v)]
    state += [tier[request, :, :pages].to(torch.float64) for storage in stored  # every tier dtype, by value
              for tier in (storage.offloaded.host.k, storage.offloaded.host.v)
              for request, pages in enumerate(full_pages)]
    return torch.stack(logits), state, cache.stats()


def assert_same_transfer_outcome(one: tuple, other: tuple) -> None:
    """Bit-exact logits and state, equal transfer counters, and transfers that really happened."""
    assert torch.equal(one[0], other[0])
    assert all(torch.equal(a, b) for a, b in zip(one[1], other[1]))
    assert one[2]["promoted_pages"] == other[2]["promoted_pages"] > 0
    assert one[2]["bytes_d2h"] == other[2]["bytes_d2h"] > 0


def assert_selected_slots_hold_their_pages(cache: FlexiCache) -> None:
    """The stable heads' invariant: every device selection slot holds the host page it lists (the page a rerank
    promoted or a tail retirement moved there; full pages never change on the host): exactly, or, for a tier
    narrower than the KV (``host_dtype``), either the host page with its row's key centre added back (promoted) or a
    page that rounds to the host page once the centre is taken off (a retired tail, exact on the device)."""
    for index, layer in enumerate(cache.layers):
        pages = layer.storage.offloaded
        if pages is None:
            continue
        host_k, host_v = pages.host.pages()
        row, column = (pages.selected >= 0).nonzero(as_tuple=True)
        device_slot = pages.base + row * pages.slots_per_row + column
        host_page = (row * pages.host.k.shape[2] + pages.selected[row, column]).to(host_k.device)
        centre = None if pages.key_centre is None else pages.key_centre[row].cpu().unsqueeze(1)  # [n, 1, D]
        for device_pages, host_pages, offset in ((pages.pool.k, host_k, centre), (pages.pool.v, host_v, None)):
            held, stored = device_pages[device_slot].cpu(), host_pages[host_page].cpu()  # [n, ps, D]
            dtype = torch.float64 if offset is None else offset.dtype  # the paths' arithmetic
            offset = 0.0 if offset is None else offset
            promoted = held == (stored.to(dtype) + offset).to(held.dtype)
            retired = (held.to(dtype) - offset).to(stored.dtype).to(torch.float64) == stored.to(torch.float64)
            differs = ~(promoted.flatten(1).all(1) | retired.flatten(1).all(1))
            assert not bool(differs.any()), (
                f"layer {index}: selection slots {device_slot[differs.to(device_slot.device)].tolist()} do not hold "
                f"the host pages they list")
