"""Compile what a model's FlexiCache decode needs before it is timed or serves requests.

On CUDA the first use of each kernel compiles it just in time: FlashInfer's decode module (15-30 s the first time on
a machine, then loaded from its disk cache) and FlexiCache's Triton kernels (~0.5-1 s each per new variant). Without a
warm-up they land inside the first generation: its first decode step, its first rerank of each layer and its first
page boundary (measured on two H200s: a 1.5 s step at 80 layers). :func:`warm_up` runs one short generation that
reaches all of them, with the shapes of the real work.
"""

from __future__ import annotations

import os
import time
from typing import Any

import torch

from flexicache.cache import FlexiCache
from flexicache.host_memory import started_cuda_devices
from flexicache.models import cache_keyword, input_device
from flexicache.profile import HeadProfile


def warm_up(model: torch.nn.Module, context: int, batch_size: int = 1,
            profile: HeadProfile | str | os.PathLike | None = None, **settings: Any) -> dict[str, Any]:
    """Run one greedy generation of ``batch_size`` random prompts of ``context`` tokens through a
    ``FlexiCache.from_model(model, profile, **settings)`` cache, long enough for every layer to rerank its stable
    heads and for the tokens to cross a page boundary, then drop the cache.

    Use the context length and batch size of the real work: some kernel variants depend on the cache's capacity
    (its pages rounded up to a power of two) and on the batch, so a generation that grows past the next power of
    two of pages (more new tokens than about a quarter of the context) still compiles once more; a cache with
    ``max_cache_len`` has that capacity from the start, so pass the same ``max_cache_len`` here. Like
    ``from_model``, this switches ``model`` to the flexicache attention (and, with ``cuda_graphs``, to whole-step
    graphs).

    Returns:
        ``{"seconds": wall time, "new_tokens": decode tokens generated, **cache.stats()}``.
    """
    if context < 1 or batch_size < 1:
        raise ValueError(f"warm_up needs context >= 1 and batch_size >= 1, got context={context}, "
                         f"batch_size={batch_size}: pass the prompt length and batch of the real work.")
    with FlexiCache.from_model(model, profile, **settings) as cache:  # its buffers go back at the end of the block
        cache_settings = cache.settings
        # the rerank warm-up, every rerank phase after it, a page boundary, and a step after them
        new_tokens = cache_settings.rerank_warmup + cache_settings.rerank_interval + cache_settings.page_size + 1
        vocab_size = model.config.get_text_config().vocab_size
        generator = torch.Generator().manual_seed(0)
        ids = torch.randint(1, vocab_size, (batch_size, context), generator=generator).to(input_device(model))
        start = time.perf_counter()
        with torch.inference_mode():
            model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens,
                           min_new_tokens=new_tokens, do_sample=False, num_beams=1, **{cache_keyword(model): cache})
        for device in started_cuda_devices():
            torch.cuda.synchronize(device)
        result = {"seconds": time.perf_counter() - start, "new_tokens": new_tokens, **cache.stats()}
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return result
