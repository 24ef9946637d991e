"""Greedy generation over an explicit cache through ``model.generate``, and the forward loop it is checked against.

The prompt goes in as one dense prefill forward, except its last ``decode_tail`` tokens, which are fed one per
forward (decode mode, so a sparse cache acts on them too). A batch holds prompts of one length (no padding, so
every row computes what it would alone). Generation is greedy and stops at a stop token or once the text holds
a stop string; either is kept in the output, as ``generate`` keeps it.
"""

from __future__ import annotations

import functools
import inspect
from collections.abc import Collection, Sequence
from typing import TYPE_CHECKING, Any

import torch

from flexicache.models import cache_keyword, input_device

if TYPE_CHECKING:
    from transformers.generation.stopping_criteria import StoppingCriteriaList


@functools.cache
def _takes_logits_to_keep(model_class: type) -> bool:
    return "logits_to_keep" in inspect.signature(model_class.forward).parameters


def forward(model: Any, input_ids: torch.Tensor, cache: Any) -> torch.Tensor:
    """One forward of ``input_ids`` [batch, tokens] appended to ``cache``; logits [batch, vocab] (float32) of the
    last position."""
    # transformers 5.24 renamed ``past_key_values`` to ``cache`` (the old name warns); 5.17 knows only the old one
    kwargs: dict[str, Any] = {cache_keyword(model): cache}
    if _takes_logits_to_keep(type(model)):
        kwargs["logits_to_keep"] = 1
    return model(input_ids=input_ids, use_cache=True, **kwargs).logits[:, -1].float()


def as_input(model: Any, prompts: Sequence[Sequence[int]]) -> torch.Tensor:
    """Token ids [batch, length] on the device of the model's input embeddings."""
    return torch.tensor([list(prompt) for prompt in prompts], device=input_device(model))


def prefill_length(prompt_length: int, decode_tail: int) -> int:
    """Tokens of the dense prefill forward: all but the last ``decode_tail``, at least one."""
    return max(1, prompt_length - max(0, decode_tail))


def feed_prompt(model: Any, input_ids: torch.Tensor, cache: Any, decode_tail: int = 0, end: int | None = None
                ) -> torch.Tensor | None:
    """Prefill the first tokens of ``input_ids`` [batch, length] in one forward, then feed the rest of the first
    ``end`` (default: all) one per forward; only the last ``decode_tail`` tokens are fed singly. Returns the logits
    [batch, vocab] after the last token fed (None when ``end`` leaves nothing to feed)."""
    end = input_ids.shape[1] if end is None else end
    split = min(prefill_length(input_ids.shape[1], decode_tail), end)
    if split <= 0:
        return None
    logits = forward(model, input_ids[:, :split], cache)
    return feed_tokens(model, input_ids, cache, split, end, logits)


def feed_tokens(model: Any, input_ids: torch.Tensor, cache: Any, start: int, end: int,
                logits: torch.Tensor | None = None) -> torch.Tensor | None:
    """Feed ``input_ids[:, start:end]`` ([batch, length]) one token per forward into ``cache``, which holds the
    first ``start`` tokens; returns the logits [batch, vocab] after the last one (``logits`` when none is fed)."""
    for position in range(start, end):
        logits = forward(model, input_ids[:, position:position + 1], cache)
    return logits


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


def cut_at_stop(tokens: Sequence[int], stop_ids: Collection[int], stop_strings: Sequence[str] = (),
                tokenizer: Any = None) -> list[int]:
    """``tokens`` up to and including the first stop token or the token that completes a stop string (what a row
    of a batch holds once it stopped; later positions are padding)."""
    for length, token in enumerate(tokens, start=1):
        if token in stop_ids or (stop_strings and any(s in tokenizer.decode(tokens[:length]) for s in stop_strings)):
            return list(tokens[:length])
    return list(tokens)


@torch.no_grad()
def generate(model: Any, prompts: Sequence[Sequence[int]], cache: Any, max_new_tokens: int, stop_ids: Collection[int],
             min_new_tokens: int = 0, decode_tail: int = 0, stop_strings: Sequence[str] = (),
             tokenizer: Any = None) -> list[list[int]]:
    """Greedy continuations of ``prompts`` (all of one length: one batch, one cache) through ``model.generate``.

    Each continuation has at most ``max_new_tokens`` tokens, its stop token or stop string included; stop tokens
    are masked out for the first ``min_new_tokens`` steps. ``stop_strings`` need the ``tokenizer``. With a
    ``decode_tail``, the prompt but its last token is fed here and ``generate`` reads that last token alone.
    """
    check_prompts(prompts, stop_strings, tokenizer)
    input_ids = as_input(model, prompts)
    if decode_tail > 0:
        feed_prompt(model, input_ids, cache, decode_tail, end=input_ids.shape[1] - 1)
    output = model_generate(model, input_ids, cache, max_new_tokens, stop_ids, min_new_tokens, stop_strings, tokenizer)
    return [cut_at_stop(row, stop_ids, stop_strings, tokenizer) for row in output.tolist()]  # padding dropped


def check_prompts(prompts: Sequence[Sequence[int]], stop_strings: Sequence[str], tokenizer: Any) -> None:
    """Raise ``ValueError`` unless ``prompts`` make one batch (one non-zero length) and stop strings come with a
    tokenizer."""
    lengths = {len(prompt) for prompt in prompts}
    if len(lengths) != 1 or 0 in lengths:
        raise ValueError(f"prompts of one non-zero length make a batch, got lengths {sorted(lengths)}")
    if stop_strings and tokenizer is None:
        raise ValueError("stop_strings need the tokenizer: pass tokenizer=")


def pad_token(stop_ids: Collection[int]) -> int:
    """What ``generate`` writes after a row's stop: its first stop token (0 without any: no row stops early then,
    except by a stop string)."""
    return min(stop_ids) if stop_ids else 0


def model_generate(model: Any, input_ids: torch.Tensor, cache: Any, max_new_tokens: int, stop_ids: Collection[int],
                   min_new_tokens: int = 0, stop_strings: Sequence[str] = (), tokenizer: Any = None,
                   stopping_criteria: StoppingCriteriaList | None = None) -> torch.Tensor:
    """Greedy ``model.generate`` of ``input_ids`` [batch, length] over ``cache`` (which may already hold a prefix
    of them: generate then runs only the rest); returns the new tokens [batch, steps], rows that stopped padded
    with :func:`pad_token`. ``stopping_criteria``: criteria for generate besides the stop tokens and strings."""
    stops = sorted(stop_ids)  # eos_token_id=[]: no stop token (None would mean the model's own)
    extra: dict[str, Any] = {"stop_strings": list(stop_strings), "tokenizer": tokenizer} if stop_strings else {}
    if stops:
        extra["min_new_tokens"] = min_new_tokens
    if stopping_criteria is not None:
        extra["stopping_criteria"] = stopping_criteria
    output = model.generate(
        input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=max_new_tokens, do_sample=False,
        num_beams=1, eos_token_id=stops, pad_token_id=pad_token(stop_ids), **extra, **{cache_keyword(model): cache})
    return output[:, input_ids.shape[1]:]


@torch.no_grad()
def greedy_generate(model: Any, prompt_ids: Sequence[int], cache: Any, max_new_tokens: int, stop_ids: Collection[int],
                    min_new_tokens: int = 0, decode_tail: int = 0) -> list[int]:
    """The same greedy continuation of one prompt as :func:`generate`, by a plain forward loop (no ``generate``, no
    attention mask, no positions): the reference :func:`generate` is tested against, and a caller's own loop."""
    if not prompt_ids:
        raise ValueError("empty prompt")
    logits = feed_prompt(model, as_input(model, [prompt_ids]), cache, decode_tail)[0]
    blocked = torch.tensor(sorted(stop_ids), dtype=torch.long, device=logits.device)
    generated: list[int] = []
    for step in range(max_new_tokens):
        if step < min_new_tokens and len(blocked):
            logits = logits.index_fill(0, blocked, float("-inf"))
        token = int(logits.argmax())
        generated.append(token)
        if token in stop_ids or step == max_new_tokens - 1:
            break
        logits = forward(model, as_input(model, [[token]]), cache)[0]
    return generated
