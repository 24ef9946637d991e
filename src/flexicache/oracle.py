"""The oracle page selection: the ceiling of page-granular top-K attention on a model (not for production).

At every decode step each (request, KV head) attends to the ``token_budget // page_size`` pages that hold the most
true attention mass of its query heads (summed over the GQA group), the first (sink) and the last (tail) page
always in: the selection FlexiCache's page scores try to approximate, found by reading every key. Pages are cut
over each request's real tokens, as FlexiCache cuts them, so left padding does not shift them. An
``OracleCache`` keeps the full KV like a ``DynamicCache`` and runs through the ``"flexicache"`` attention
(prefill is dense), so the harness can put an oracle row beside dense and FlexiCache at every budget. In a model
that mixes layer types, the layers FlexiCache pages get the oracle selection and sliding-window layers keep their
window, as in a FlexiCache.

With ``candidates = n > 0`` the oracle only chooses among the top ``n * K`` pages by FlexiCache's box scores (its
default page scores, in the principal axes of the prompt's keys): the ceiling of a two-stage selection that scores
those candidates' keys exactly (reading ``n * K`` pages of keys per step) and keeps the K with the most mass.
"""

from __future__ import annotations

from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import Cache, DynamicLayer

from flexicache import handoff
from flexicache.config import FlexiCacheConfig, integer_argument
from flexicache.hybrid import layer_kinds
from flexicache.key_basis import KeyBasis
from flexicache.profiling.pages import page_bounds
from flexicache.selection import quest_page_scores, select_pages
from flexicache.sliding import SlidingWindowLayer


class OracleLayer(DynamicLayer):
    """A ``DynamicLayer`` whose decode attends to its oracle pages (see the module docstring)."""

    def __init__(self, layer_idx: int, settings: FlexiCacheConfig, candidates: int = 0) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.settings = settings
        self.candidates = candidates
        self.valid: torch.Tensor | None = None  # [B, T] bool: which cached positions hold real tokens
        self.basis: KeyBasis | None = None  # with candidates: the principal axes of the prompt's keys

    def update(self, key_states: torch.Tensor, value_states: torch.Tensor, *args: Any, **kwargs: Any
               ) -> tuple[torch.Tensor, torch.Tensor]:
        """Store the new tokens ``[B, H, T, D]`` and stage them for the flexicache attention; returns the full KV."""
        start = self.get_seq_length()
        keys, values = super().update(key_states, value_states, *args, **kwargs)
        handoff.stage(self, self.layer_idx, key_states, value_states, start)
        return keys, values

    def commit(self, chunk: handoff.StagedChunk, query: torch.Tensor, real_tokens: torch.Tensor | None) -> None:
        """A chunk of several tokens (dense attention): record which of them are real (``real_tokens [B, T]``)."""
        batch_size, _, length, _ = chunk.keys.shape
        real = torch.ones(batch_size, length, dtype=torch.bool) if real_tokens is None else real_tokens.cpu()
        if self.candidates and self.valid is None and length > 1:  # a first single token keeps the model's axes
            self.basis = KeyBasis.principal_axes(chunk.keys.detach(), real)
        self.valid = real if self.valid is None else torch.cat([self.valid, real], dim=1)

    def reset(self) -> None:
        super().reset()
        self.valid = self.basis = None

    def crop(self, max_length: int) -> None:
        super().crop(max_length)
        self.valid = self.valid[:, : self.get_seq_length()]

    def batch_repeat_interleave(self, repeats: int) -> None:
        super().batch_repeat_interleave(repeats)
        self.valid = self.valid.repeat_interleave(repeats, dim=0)
        if self.basis is not None:
            self.basis = KeyBasis(self.basis.matrix.repeat_interleave(repeats, dim=0))

    def batch_select_indices(self, indices: torch.Tensor) -> None:
        super().batch_select_indices(indices)
        self.valid = self.valid[indices.cpu()]
        if self.basis is not None:
            self.basis = self.basis.select(indices)

    def decode(self, chunk: handoff.StagedChunk, query: torch.Tensor, scale: float) -> torch.Tensor:
        """Attention of ``query [B, Hq, 1, D]`` over each row's oracle pages; ``[B, 1, Hq, D]``."""
        batch_size = query.shape[0]
        self.valid = torch.cat([self.valid, torch.ones(batch_size, 1, dtype=torch.bool)], dim=1)
        outputs = [self._decode_request(query[b, :, 0], b, scale) for b in range(batch_size)]
        return torch.stack(outputs).unsqueeze(1).to(query.dtype)

    def _decode_request(self, query: torch.Tensor, request: int, scale: float) -> torch.Tensor:
        """``query [Hq, D]`` of one request over its real tokens' oracle pages: ``[Hq, D]``."""
        real = self.valid[request].nonzero().view(-1).to(self.keys.device)
        compute_dtype = torch.float64 if query.dtype == torch.float64 else torch.float32
        keys = self.keys[request][:, real].to(compute_dtype)  # [H, N, D]
        values = self.values[request][:, real].to(compute_dtype)
        num_heads, _, head_dim = keys.shape
        grouped = query.to(compute_dtype).view(num_heads, -1, head_dim)  # [H, G, D]
        logits = torch.bmm(grouped, keys.transpose(1, 2)) * scale  # [H, G, N]
        candidates = None if not self.candidates else self._candidate_pages(grouped, keys, request)
        mask = self.token_mask(logits, candidates)
        weights = logits.masked_fill(~mask.unsqueeze(1), float("-inf")).softmax(-1)
        return torch.bmm(weights, values).view(-1, head_dim)

    def token_mask(self, logits: torch.Tensor, candidates: torch.Tensor | None) -> torch.Tensor:
        """``[H, N]`` bool: the tokens each KV head attends to, for its query heads' ``logits [H, G, N]`` among the
        pages ``candidates [H, P]`` (``None``: all): its oracle pages (a subclass may choose otherwise)."""
        return oracle_token_mask(logits.softmax(-1), self.settings.page_size, self.settings.pages_per_head,
                                 candidates)

    def _candidate_pages(self, grouped: torch.Tensor, keys: torch.Tensor, request: int) -> torch.Tensor:
        """``[H, P]`` bool: the top ``candidates * K`` pages of each head of ``request`` by FlexiCache's box scores
        (sink and tail forced), for its queries ``grouped [H, G, D]`` and real keys ``keys [H, N, D]``."""
        settings = self.settings
        if self.basis is not None:  # None: a cache started token by token keeps the model's axes, as FlexiCache
            basis = self.basis.select(torch.tensor([request]))
            grouped = basis.rows(grouped)
            keys = basis.chunk(keys.unsqueeze(0))[0].to(grouped.dtype)
        pages = box_top_pages(grouped, keys, settings, self.candidates * settings.pages_per_head)
        return page_mask(pages, -(-keys.shape[1] // settings.page_size))


def box_top_pages(query: torch.Tensor, keys: torch.Tensor, settings: FlexiCacheConfig, k: int) -> torch.Tensor:
    """``[R, min(k, P)]`` each row's top-``k`` pages by FlexiCache's box scores (``settings``' page size, group
    reduction and spread weight), sink and tail forced, ascending (:func:`~flexicache.selection.select_pages`), for
    queries ``query [R, G, D]`` over all of ``keys [R, N, D]``, both in the boxes' axes."""
    kmin, kmax = page_bounds(keys, settings.page_size)
    scores = quest_page_scores(query, kmin, kmax, settings.group_reduce, settings.spread_weight)
    counts = torch.full((scores.shape[0],), scores.shape[1], dtype=torch.long, device=scores.device)
    return select_pages(scores, counts, k, force_last=True)[0]


def page_mask(pages: torch.Tensor, num_pages: int) -> torch.Tensor:
    """``[R, num_pages]`` bool: the pages listed in ``pages [R, k]`` (``-1``: none)."""
    chosen = torch.zeros(pages.shape[0], num_pages + 1, dtype=torch.bool, device=pages.device)
    return chosen.scatter_(1, pages.masked_fill(pages < 0, num_pages), True)[:, :-1]


def page_mass(weights: torch.Tensor, page_size: int) -> torch.Tensor:
    """``[R, P]`` each page's attention mass summed over the group, from ``weights [R, G, T]`` (the last page may be
    partly filled)."""
    num_tokens = weights.shape[-1]
    num_pages = -(-num_tokens // page_size)
    padded = torch.nn.functional.pad(weights.sum(1), (0, num_pages * page_size - num_tokens))
    return padded.view(weights.shape[0], num_pages, page_size).sum(-1)


def oracle_token_mask(weights: torch.Tensor, page_size: int, pages: int, candidates: torch.Tensor | None = None
                      ) -> torch.Tensor:
    """``[R, T]`` bool: the tokens of the top ``pages`` pages of every row by attention mass summed over the group
    (``weights [R, G, T]``), sink and tail pages forced, among the pages ``candidates [R, P]`` (bool; ``None``:
    all); every token when the row has at most ``pages`` pages."""
    rows, _, num_tokens = weights.shape
    num_pages = -(-num_tokens // page_size)
    if num_pages <= pages:
        return torch.ones(rows, num_tokens, dtype=torch.bool, device=weights.device)
    mass = page_mass(weights, page_size)
    if candidates is not None:
        mass = mass.masked_fill(~candidates, -1.0)
    mass[:, 0] = mass[:, -1] = float("inf")
    top = mass.topk(pages, dim=1).indices
    chosen = torch.zeros(rows, num_pages, dtype=torch.bool, device=weights.device).scatter_(1, top, True)
    return chosen.repeat_interleave(page_size, dim=1)[:, :num_tokens]


class OracleCache(DynamicCache):
    """Full KV with oracle page selection at decode (see the module docstring). For measurement, not production:
    every decode step reads every key.

    Args:
        config: the model's config; token_budget, page_size: as :class:`~flexicache.FlexiCacheConfig`'s;
        candidates: ``n > 0`` restricts the choice to the top ``n * K`` pages by FlexiCache's box scores (see the
            module docstring); 0: every page.
    """

    def __init__(self, config: Any, token_budget: int = FlexiCacheConfig.token_budget,
                 page_size: int = FlexiCacheConfig.page_size, candidates: int = 0) -> None:
        candidates = integer_argument(candidates, "candidates", "0: every page a candidate")
        if candidates < 0:
            raise ValueError(f"candidates must be an int >= 0 (0: every page a candidate), got {candidates!r}")
        settings = FlexiCacheConfig(token_budget=token_budget, page_size=page_size)
        layers = [OracleLayer(index, settings, candidates) if kind.sparse else SlidingWindowLayer(index, kind.window)
                  for index, kind in enumerate(layer_kinds(config))]
        Cache.__init__(self, layers=layers)
        self.settings = settings
