"""Greedy decoding and prompt feeding over an explicit cache, batch size 1.

The prompt goes in as one dense prefill forward, except its last ``decode_tail`` tokens, which are fed one
per forward (decode mode, so a sparse cache acts on them too). Generation is greedy and stops at a stop
token, which is kept in the output like ``generate`` keeps it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Collection, Sequence
from typing import Any

import torch

from flexicache.models import cache_keyword


@functools.cache
def _forward_parameters(model_class: type) -> frozenset[str]:
    return frozenset(inspect.signature(model_class.forward).parameters)


def forward(model: Any, ids: Sequence[int], cache: Any, last_only: bool = True) -> torch.Tensor:
    """One forward of ``ids`` appended to ``cache``; returns logits [len(ids) or 1, vocab] in float32."""
    parameters = _forward_parameters(type(model))
    # transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns); 5.17 knows only the old one
    kwargs: dict[str, Any] = {cache_keyword(model): cache}
    if last_only and "logits_to_keep" in parameters:
        kwargs["logits_to_keep"] = 1
    out = model(input_ids=torch.tensor([list(ids)], device=model.device), use_cache=True, **kwargs)
    logits = out.logits[0]
    return (logits[-1:] if last_only else logits).float()


def feed_prompt(model: Any, prompt_ids: Sequence[int], cache: Any, decode_tail: int = 0) -> torch.Tensor:
    """Prefill all but the last ``decode_tail`` prompt tokens (at least one token is prefilled), then feed
    those one at a time. Returns the logits [vocab] that predict the first new token."""
    if not prompt_ids:
        raise ValueError("empty prompt")
    split = max(1, len(prompt_ids) - max(0, decode_tail))
    logits = forward(model, prompt_ids[:split], cache)
    for token in prompt_ids[split:]:
        logits = forward(model, [token], cache)
    return logits[-1]


def stop_tokens(model: Any, tokenizer: Any) -> set[int]:
    """The tokenizer's EOS and the model's generation-config EOS id(s)."""
    ids = set()
    configured = getattr(getattr(model, "generation_config", None), "eos_token_id", None)
    for value in (tokenizer.eos_token_id, configured):
        if isinstance(value, int):
            ids.add(value)
        elif value is not None:
            ids.update(int(v) for v in value)
    return ids


def newline_token(tokenizer: Any) -> int:
    """Id of the newline token (LongBench's samsum stop: the last id of encoding '\\n')."""
    return tokenizer.encode("\n", add_special_tokens=False)[-1]


@torch.no_grad()
def greedy_generate(
    model: Any,
    prompt_ids: Sequence[int],
    cache: Any,
    max_new_tokens: int,
    stop_ids: Collection[int],
    min_new_tokens: int = 0,
    decode_tail: int = 0,
) -> list[int]:
    """Greedy continuation of ``prompt_ids`` (at most ``max_new_tokens`` tokens, the stop token included).

    Stop tokens are masked out for the first ``min_new_tokens`` steps.
    """
    logits = feed_prompt(model, prompt_ids, cache, decode_tail)
    blocked = torch.tensor(sorted(stop_ids), dtype=torch.long, device=logits.device)
    generated: list[int] = []
    for step in range(max_new_tokens):
        if step < min_new_tokens and len(blocked):
            logits = logits.index_fill(0, blocked, float("-inf"))
        token = int(logits.argmax())
        generated.append(token)
        if token in stop_ids or step == max_new_tokens - 1:
            break
        logits = forward(model, [token], cache)[-1]
    return generated
