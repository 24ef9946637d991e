"""Dense decoding with per-step top-K page selection for every (layer, KV head): the profiler's raw data.

Queries come from the probe attention function, keys from a ``DynamicCache``-like cache laid out as FlexiCache
lays out the model (:func:`tracing_cache`). Each step the per-page key min/max is updated for the tail page only,
pages are scored with :func:`quest_page_scores` (Quest's bound in the model's axes: the paper's page scores, not the
cache's defaults) and chosen with :func:`select_pages` (sink and tail forced). In a model with sliding-window layers
only its sparse paged (full-attention) layers are measured: the ones a profile covers (:mod:`flexicache.hybrid`).
"""

from __future__ import annotations

import math
from collections.abc import Callable, Iterator, Sequence
from contextlib import contextmanager
from dataclasses import dataclass

import torch
from transformers.cache_utils import Cache, DynamicLayer, DynamicSlidingWindowLayer

from flexicache.hybrid import check_supported_model, layer_kinds
from flexicache.models import cache_keyword
from flexicache.profile import model_shape
from flexicache.profiling.online import prompt_stability
from flexicache.profiling.pages import PageBounds
from flexicache.profiling.probe import QueryRecorder, probing
from flexicache.selection import GroupReduce, quest_page_scores, select_pages


@dataclass
class MeasureSettings:
    """How to decode and select. ``K = token_budget // page_size`` pages per head and step."""

    token_budget: int = 256
    page_size: int = 16
    steps: int = 256
    group_reduce: GroupReduce = "max"
    attention_mass: bool = False  # also record the top-K pages by true attention mass
    online_window: int = 64  # prompt-tail queries for the prefill estimate (0: skip it)
    max_distance: int = 16
    ban_token_ids: tuple[int, ...] = ()  # never generated greedily (e.g. EOS, to keep decoding long)

    @property
    def k(self) -> int:
        return self.token_budget // self.page_size

    def validate(self) -> None:
        if self.page_size <= 0 or self.page_size & (self.page_size - 1):
            raise ValueError(f"page_size must be a power of two, got {self.page_size}")
        if self.k < 2:
            raise ValueError(
                f"token_budget {self.token_budget} gives {self.k} page(s) of {self.page_size} tokens; the sink and "
                "tail pages alone need 2: raise the budget to at least 2 * page_size."
            )
        if self.steps < 2:
            raise ValueError(f"steps must be at least 2 to compare top-K sets over time, got {self.steps}")


@dataclass
class SampleTrace:
    """Top-K page sets of one calibration sample over its decode steps."""

    task: str
    prompt_tokens: int
    pages: torch.Tensor  # [S, L, H, K] int16 page indices, ascending, -1 padding (L: the measured layers)
    num_pages: torch.Tensor  # [S] int32 candidate pages at each step
    attention_pages: torch.Tensor | None = None  # [S, L, H, K] ranked by attention mass, if recorded
    prompt_estimate: torch.Tensor | None = None  # [L, H] stability estimated from the prompt tail, if recorded


def select_by_quest(
    query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, k: int, group_reduce: GroupReduce = "max"
) -> torch.Tensor:
    """Top-K by Quest's bound (the paper's selection): ``query [..., Hq, D]``, ``kmin/kmax [..., H, P, D]`` -> pages
    ``[..., H, min(k, P)]``.

    Leading dims (e.g. ``[L, B]``) are flattened into rows. Query head ``j`` belongs to KV head ``j // (Hq // H)``
    (transformers' ``repeat_kv`` layout).
    """
    *lead, heads, num_pages, dim = kmin.shape
    group = query.shape[-2] // heads
    rows = math.prod(lead) * heads
    scores = quest_page_scores(
        query.reshape(rows, group, dim), kmin.reshape(rows, num_pages, dim), kmax.reshape(rows, num_pages, dim),
        group_reduce,
    )
    pages, _ = select_pages(scores, torch.full((rows,), num_pages), k)
    return pages.view(*lead, heads, -1)


def select_by_attention(
    query: torch.Tensor, keys: torch.Tensor, scaling: float, page_size: int, k: int, group_reduce: GroupReduce = "max"
) -> torch.Tensor:
    """Top-K pages by softmax attention mass: ``query [B, Hq, D]``, ``keys [B, H, T, D]`` -> ``[B, H, min(k, P)]``.

    A page's mass is summed over its tokens and reduced over the GQA group like the Quest scores.
    """
    batch, heads, length, dim = keys.shape
    group = query.shape[1] // heads
    logits = torch.einsum("bhgd,bhtd->bhgt", query.view(batch, heads, group, dim).float(), keys.float()) * scaling
    probs = logits.softmax(dim=-1)
    num_pages = math.ceil(length / page_size)
    probs = torch.nn.functional.pad(probs, (0, num_pages * page_size - length))
    mass = probs.view(batch, heads, group, num_pages, page_size).sum(dim=-1)
    mass = mass.amax(dim=2) if group_reduce == "max" else mass.sum(dim=2)
    pages, _ = select_pages(mass.view(batch * heads, num_pages), torch.full((batch * heads,), num_pages), k)
    return pages.view(batch, heads, -1)


def tracing_cache(config: object) -> tuple[Cache, list[int]]:
    """``(cache, sparse layer indices)`` for the traced forward: the layers FlexiCache would serve sparsely hold every
    key (``DynamicLayer``, to score pages over), the sliding-window layers their window (transformers' sliding layer),
    so the model's outputs are the ones it has with FlexiCache at a covering budget. Raises like
    :class:`~flexicache.FlexiCache` for models it cannot serve."""
    check_supported_model(config)
    kinds = layer_kinds(config)
    if not any(kind.sparse for kind in kinds):
        raise ValueError("This model has no full-attention layer (all are sliding-window or chunked): there is no "
                         "head to profile, FlexiCache keeps every layer's window as DynamicCache does.")
    layers = [DynamicLayer() if kind.sparse else DynamicSlidingWindowLayer(sliding_window=kind.window)
              for kind in kinds]
    return Cache(layers=layers), [index for index, kind in enumerate(kinds) if kind.sparse]


@contextmanager
def _single_threaded(device: torch.device) -> Iterator[None]:
    """Run tiny CPU ops on one thread (several times faster than waking the intra-op pool); restore it after."""
    threads = torch.get_num_threads()
    if device.type == "cpu" and threads > 1:
        torch.set_num_threads(1)
    try:
        yield
    finally:
        if torch.get_num_threads() != threads:
            torch.set_num_threads(threads)


def _next_tokens(
    logits: torch.Tensor, continuation: torch.Tensor | None, index: int, banned: Sequence[int]
) -> torch.Tensor:
    """``[B]`` next input tokens: the teacher-forced continuation if given, else greedy without ``banned``."""
    if continuation is not None:
        return continuation[:, index]
    if banned:
        logits = logits.clone()
        logits[:, list(banned)] = float("-inf")
    return logits.argmax(dim=-1)


@torch.inference_mode()
def trace_batch(
    model: torch.nn.Module,
    prompt_ids: torch.Tensor,
    settings: MeasureSettings,
    continuation: torch.Tensor | None = None,
    tasks: Sequence[str] | None = None,
    on_step: Callable[[], None] | None = None,
) -> list[SampleTrace]:
    """Prefill ``prompt_ids [B, T]`` (no padding), decode ``settings.steps`` tokens and record top-K sets of every
    KV head of the sparse paged layers (all layers of a full-attention model; see :func:`tracing_cache`).

    Args:
        continuation: ``[B, >= steps]`` tokens to feed (teacher forcing); ``None`` decodes greedily.
        tasks: task name of each row (for the returned traces).
        on_step: called after every decode step (progress reporting).
    """
    settings.validate()
    cache, measured = tracing_cache(model.config)
    if continuation is not None and continuation.shape[1] < settings.steps:
        raise ValueError(f"continuation has {continuation.shape[1]} tokens, fewer than steps={settings.steps}")
    _, num_kv_heads, _ = model_shape(model.config)
    num_layers = len(measured)
    batch, prompt_len = prompt_ids.shape
    device = next(model.parameters()).device
    prompt_ids = prompt_ids.to(device)
    continuation = continuation.to(device) if continuation is not None else None
    k, steps = settings.k, settings.steps
    pages = torch.full((batch, steps, num_layers, num_kv_heads, k), -1, dtype=torch.int16)
    attention_pages = pages.clone() if settings.attention_mass else None
    num_pages = torch.zeros(steps, dtype=torch.int32)
    cache_kw = {cache_keyword(model): cache}
    recorder = QueryRecorder(prefill_tail=settings.online_window)
    estimate = None
    with probing(model, recorder):
        logits = model(input_ids=prompt_ids, use_cache=True, logits_to_keep=1, **cache_kw).logits[:, -1]
        prefill_queries = recorder.pop()
        keys = [cache.layers[layer].keys for layer in measured]
        if settings.online_window > 0:
            estimate = torch.stack([
                prompt_stability(prefill_queries[layer], layer_keys, settings.token_budget, settings.page_size,
                                 settings.max_distance, settings.group_reduce)
                for layer, layer_keys in zip(measured, keys)
            ], dim=1)  # [B, L, H]
        bounds = PageBounds(torch.stack(keys), settings.page_size, prompt_len + steps)  # [L, B, H, P, D]
        tokens = _next_tokens(logits, continuation, 0, settings.ban_token_ids)
        for step in range(steps):
            logits = model(input_ids=tokens[:, None], use_cache=True, **cache_kw).logits[:, -1]
            queries = recorder.pop()
            with _single_threaded(device):
                bounds.append(torch.stack([cache.layers[layer].keys[:, :, -1] for layer in measured]))
                query = torch.stack([queries[layer][:, :, 0] for layer in measured])  # [L, B, Hq, D]
                chosen = select_by_quest(query, *bounds.bounds(), k, settings.group_reduce)  # [L, B, H, K]
                pages[:, step, :, :, : chosen.shape[-1]] = chosen.transpose(0, 1).to(torch.int16).cpu()
                if attention_pages is not None:
                    for row, layer in enumerate(measured):
                        chosen = select_by_attention(
                            query[row], cache.layers[layer].keys, recorder.scaling[layer], settings.page_size, k,
                            settings.group_reduce,
                        )
                        attention_pages[:, step, row, :, : chosen.shape[-1]] = chosen.to(torch.int16).cpu()
            num_pages[step] = bounds.num_pages
            if step + 1 < steps:
                tokens = _next_tokens(logits, continuation, step + 1, settings.ban_token_ids)
            if on_step is not None:
                on_step()
    tasks = list(tasks) if tasks is not None else ["default"] * batch
    return [
        SampleTrace(
            task=tasks[row],
            prompt_tokens=prompt_len,
            pages=pages[row],
            num_pages=num_pages.clone(),
            attention_pages=attention_pages[row] if attention_pages is not None else None,
            prompt_estimate=estimate[row].cpu() if estimate is not None else None,
        )
        for row in range(batch)
    ]
