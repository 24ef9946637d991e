"""One dense prefill per batch, shared by every method (row) of the accuracy table.

A prompt's first forward is dense under every built-in method: a ``DynamicCache`` attends densely, and the
flexicache attention commits a prefill chunk's keys and values into a FlexiCache or an OracleCache, then runs the
chunk as sdpa too (a FlexiCache seeds its stable heads' selection with the chunk's last query). That
forward's logits, and the keys and values it hands the cache, are therefore the same under every method. The runner
computes it once per batch into a ``DynamicCache`` (the snapshot), the probe attention recording each layer's last
query (:func:`prefill_forward`, :func:`prefill_generation`), and fills each method's fresh cache from it
(:func:`fill`) as that forward would have: per layer ``cache.update(keys, values, layer)``, then the staged chunk
committed with the layer's last query. Each method then goes on as it did after its own prefill
(:func:`generate_from`, :func:`decode_nll_from`), with the same tokens and NLL.

Only caches of full-attention layers are filled (:func:`can_fill`): a sliding-window layer
(``DynamicSlidingWindowLayer``, in a hybrid model's caches) keeps only a window of the prefill, and so does the
snapshot of such a model (:func:`snapshot_cache` gives none), so the runner runs those methods' own prefill. So
does a model whose attention is not sdpa-based (the probe's prefill is sdpa), or whose generation config stops or
scores by a rule that counts steps from the end of the prompt (:data:`STEP_COUNTING_SETTINGS`), since generation
here restarts after the first token.
"""

from __future__ import annotations

import time
from collections.abc import Callable, Collection, Sequence
from dataclasses import dataclass
from typing import Any

import torch
from transformers import DynamicCache
from transformers.cache_utils import DynamicLayer
from transformers.generation.stopping_criteria import StoppingCriteria, StoppingCriteriaList, StopStringCriteria

from flexicache import handoff
from flexicache.attention import ATTENTION_NAME, on_device
from flexicache.head_split import WINDOW
from flexicache.layer import FlexiLayer
from flexicache.oracle import OracleLayer
from flexicache.profiling.probe import QueryRecorder, probing

from .generation import (
    as_input,
    check_prompts,
    cut_at_stop,
    feed_tokens,
    forward,
    model_generate,
    pad_token,
    prefill_length,
)
from .perplexity import check_prefill, score_continuation

# attention implementations whose prefill is transformers' sdpa, as the probe's is
SDPA_PREFILL = (ATTENTION_NAME, "sdpa")
# generation-config settings that count steps from the end of the prompt, or stop by a rule of their own that the
# first-token check here does not evaluate: with any of them set, every method runs its own prefill
STEP_COUNTING_SETTINGS = ("begin_suppress_tokens", "exponential_decay_length_penalty", "max_time", "stop_strings")


class TailQueryRecorder(QueryRecorder):
    """A :class:`QueryRecorder` keeping a copy of each layer's last query positions, ``[B, Hq, W, D]`` (not a view,
    which would keep the whole chunk's queries alive): the last one seeds the stable heads' selection, all ``W``
    (:data:`flexicache.head_split.WINDOW`) the online head split of a cache without a profile."""

    def __init__(self) -> None:
        super().__init__(prefill_tail=WINDOW)

    def record(self, layer_idx: int, query: torch.Tensor, scaling: float | None) -> None:
        super().record(layer_idx, query, scaling)
        self.queries[layer_idx] = self.queries[layer_idx].clone()


@dataclass
class DensePrefill:
    """The dense forward of a batch's first ``length`` prompt tokens, ready to fill any number of caches.

    Attributes:
        snapshot: the ``DynamicCache`` it filled, keys/values ``[B, H, length, D]`` per layer (:func:`fill` only
            reads it).
        queries: by layer, the queries ``[B, Hq, W, D]`` of the last ``W`` positions.
        length: prompt tokens in the snapshot.
        seconds: wall time of the forward (and, for a generation without decode tail, of choosing the first token).
        logits: ``[B, vocab]`` float32 logits after the last position (:func:`prefill_forward`), else None.
        first_tokens: ``[B]`` the first generated token of every row (:func:`prefill_generation` without decode
            tail), else None.
        finished: ``[B]`` bool, rows whose output ends at their first token (with ``first_tokens``).
    """

    snapshot: DynamicCache
    queries: dict[int, torch.Tensor]
    length: int
    seconds: float
    logits: torch.Tensor | None = None
    first_tokens: torch.Tensor | None = None
    finished: torch.Tensor | None = None


def snapshot_cache(model: Any) -> DynamicCache | None:
    """An empty ``DynamicCache`` for ``model``, or None when its prefill is not shared: not all its layers are full
    attention (a hybrid model's sliding-window layers keep a window), or its attention is not sdpa (what the
    flexicache attention and the probe run for a prefill)."""
    if model.config._attn_implementation not in SDPA_PREFILL:
        return None
    cache = DynamicCache(config=model.config)
    return cache if cache.layers and all(type(layer) is DynamicLayer for layer in cache.layers) else None


def can_fill(cache: Any) -> bool:
    """Whether :func:`fill` gives ``cache`` the state a dense prefill would: an empty cache whose layers are all
    full-attention ``DynamicLayer``, ``OracleLayer`` or ``FlexiLayer``."""
    layers = getattr(cache, "layers", None)
    return (bool(layers) and cache.get_seq_length() == 0
            and all(type(layer) in (DynamicLayer, OracleLayer) or isinstance(layer, FlexiLayer) for layer in layers))


def fill(cache: Any, prefill: DensePrefill) -> None:
    """Fill an empty ``cache`` (see :func:`can_fill`) with the snapshot, as the flexicache attention fills it during
    a prefill forward: layer by layer, ``cache.update`` with the keys/values ``[B, H, T, D]``, then the chunk that
    update staged committed with the layer's last queries ``[B, Hq, W, D]`` (no padding in a batch here). A
    ``DynamicLayer`` stages nothing: its update copies the snapshot's tensors, which stay as they are."""
    for index, layer in enumerate(prefill.snapshot.layers):
        with on_device(layer.keys.device):  # kernels launch on the current CUDA device: make it this layer's
            cache.update(layer.keys, layer.values, index)
            chunk = handoff.take(index)
            if chunk is not None:
                chunk.layer.commit(chunk, prefill.queries[index], None)


def _recorded(model: Any, run: Callable[[DynamicCache], Any]
              ) -> tuple[DynamicCache, dict[int, torch.Tensor], Any, float] | None:
    """``run(snapshot)`` under the probe attention: the snapshot, the last queries, its result and its seconds
    (None when the model's caches cannot share a prefill)."""
    snapshot = snapshot_cache(model)
    if snapshot is None:
        return None
    recorder = TailQueryRecorder()
    start = time.perf_counter()
    with probing(model, recorder):
        result = run(snapshot)
    for device in {layer.keys.device for layer in snapshot.layers if layer.keys.is_cuda}:
        torch.cuda.synchronize(device)  # the forward's time, not its launches'
    seconds = time.perf_counter() - start
    return snapshot, recorder.pop(), result, seconds


@torch.no_grad()
def prefill_forward(model: Any, input_ids: torch.Tensor) -> DensePrefill | None:
    """One dense forward of ``input_ids`` [batch, length] (the shared part of a prompt with a decode tail, or of a
    perplexity text); None when the model's caches cannot share it."""
    recorded = _recorded(model, lambda snapshot: forward(model, input_ids, snapshot))
    if recorded is None:
        return None
    snapshot, queries, logits, seconds = recorded
    return DensePrefill(snapshot, queries, input_ids.shape[1], seconds, logits=logits)


@torch.no_grad()
def prefill_generation(model: Any, prompts: Sequence[Sequence[int]], max_new_tokens: int, stop_ids: Collection[int],
                       min_new_tokens: int = 0, decode_tail: int = 0, stop_strings: Sequence[str] = (),
                       tokenizer: Any = None) -> DensePrefill | None:
    """The dense prefill :func:`~flexicache.evaluation.generation.generate` runs for ``prompts`` with these settings
    (None when the model's caches or its generation config cannot share it).

    With a ``decode_tail`` (and prompts of at least two tokens): the forward of the first
    ``max(1, length - decode_tail)`` tokens. Without: ``model.generate`` of one token over a ``DynamicCache`` with the
    same settings (stop tokens masked for ``min_new_tokens``, ...), which chooses the first token as the full
    generation would; ``finished`` says which rows stop there (a stop token, a stop string ending right after it,
    or ``max_new_tokens == 1``).
    """
    check_prompts(prompts, stop_strings, tokenizer)
    config = getattr(model, "generation_config", None)
    if any(getattr(config, name, None) is not None for name in STEP_COUNTING_SETTINGS):
        return None
    input_ids = as_input(model, prompts)
    if decode_tail > 0 and input_ids.shape[1] > 1:
        return prefill_forward(model, input_ids[:, :prefill_length(input_ids.shape[1], decode_tail)])
    # one step: masking the stop tokens for min_new_tokens >= 1 steps masks them at this step
    recorded = _recorded(model, lambda snapshot: model_generate(
        model, input_ids, snapshot, 1, stop_ids, min(min_new_tokens, 1), stop_strings, tokenizer)[:, 0])
    if recorded is None:
        return None
    snapshot, queries, first, seconds = recorded
    finished = torch.isin(first, torch.tensor(sorted(stop_ids), dtype=first.dtype, device=first.device))
    if max_new_tokens <= 1:
        finished[:] = True
    elif stop_strings:  # as generate checks them: on the whole sequence, so a string may begin in the prompt
        finished |= StopStringCriteria(tokenizer, list(stop_strings))(torch.cat([input_ids, first[:, None]], 1), None)
    return DensePrefill(snapshot, queries, input_ids.shape[1], seconds, first_tokens=first, finished=finished)


class RowsFinished(StoppingCriteria):
    """Marks given rows ``[B]`` bool finished from the first step on (rows whose output already ended)."""

    def __init__(self, rows: torch.Tensor) -> None:
        self.rows = rows

    def __call__(self, input_ids: torch.Tensor, scores: Any, **kwargs: Any) -> torch.Tensor:
        return self.rows.to(input_ids.device)


@torch.no_grad()
def generate_from(model: Any, prompts: Sequence[Sequence[int]], cache: Any, prefill: DensePrefill,
                  max_new_tokens: int, stop_ids: Collection[int], min_new_tokens: int = 0, decode_tail: int = 0,
                  stop_strings: Sequence[str] = (), tokenizer: Any = None) -> list[list[int]]:
    """What :func:`~flexicache.evaluation.generation.generate` returns for these arguments, with ``prefill`` (from
    :func:`prefill_generation` with the same ones) in place of its own prefill; fills the empty ``cache``.

    ``decode_tail`` is accepted with ``generate``'s other keywords; the prefill (made with the same value) decides.
    With a decode tail, the rest of the prompt but its last token is fed one per forward and ``generate`` reads the
    last one, as there. Without, the output starts with the prefill's first token; the rows that go on continue in
    one ``generate`` of the prompt and that token (the cache holds the prompt: generate runs the token alone), one
    step and one new token fewer to go, while the rows that ended hold the padding ``generate`` would have given
    them.
    """
    fill(cache, prefill)
    input_ids = as_input(model, prompts)
    if prefill.first_tokens is None:
        feed_tokens(model, input_ids, cache, prefill.length, input_ids.shape[1] - 1)
        output = model_generate(model, input_ids, cache, max_new_tokens, stop_ids, min_new_tokens, stop_strings,
                                tokenizer)
    else:
        first, finished = prefill.first_tokens[:, None], prefill.finished
        output = first
        if not bool(finished.all()):
            criteria = StoppingCriteriaList([RowsFinished(finished)]) if bool(finished.any()) else None
            rest = model_generate(model, torch.cat([input_ids, first], 1), cache, max_new_tokens - 1, stop_ids,
                                  max(0, min_new_tokens - 1), stop_strings, tokenizer, criteria)
            rest[finished.to(rest.device)] = pad_token(stop_ids)
            output = torch.cat([first, rest], 1)
    return [cut_at_stop(row, stop_ids, stop_strings, tokenizer) for row in output.tolist()]


@torch.no_grad()
def decode_nll_from(model: Any, ids: Sequence[int], cache: Any, prefill: DensePrefill) -> tuple[float, int]:
    """:func:`~flexicache.evaluation.perplexity.decode_nll` of ``ids`` with ``prefill`` (from :func:`prefill_forward`
    of ``ids[:prefill]``, batch of one) in place of its first forward; fills the empty ``cache``."""
    check_prefill(ids, prefill.length)
    fill(cache, prefill)
    return score_continuation(model, ids, cache, prefill.length, prefill.logits[0])
