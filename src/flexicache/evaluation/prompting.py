"""Turning prompt text into model input: LongBench's middle truncation and the optional chat template."""

from __future__ import annotations

from typing import Any


def middle_truncate(tokenizer: Any, text: str, max_tokens: int) -> str:
    """Keep the first and last ``max_tokens // 2`` tokens of ``text`` (LongBench's rule: instructions sit at
    both ends); text that already fits is returned unchanged. Special tokens are dropped when decoding."""
    ids = tokenizer(text, add_special_tokens=True).input_ids
    if len(ids) <= max_tokens:
        return text
    half = max_tokens // 2
    head = tokenizer.decode(ids[:half], skip_special_tokens=True)
    tail = tokenizer.decode(ids[-half:], skip_special_tokens=True) if half else ""
    return head + tail


def has_chat_template(tokenizer: Any) -> bool:
    """Whether the tokenizer can format a conversation."""
    return bool(getattr(tokenizer, "chat_template", None))


def render(tokenizer: Any, prompt: str, chat: bool, response_prefix: str = "") -> list[int]:
    """Token ids of ``prompt`` as one user turn (``chat`` and a template exists) or as plain text, followed by
    ``response_prefix`` (the start of the answer, as RULER and passkey prompts use)."""
    if chat and has_chat_template(tokenizer):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": prompt}], tokenize=False, add_generation_prompt=True
        )
        return tokenizer(text + response_prefix, add_special_tokens=False).input_ids
    return tokenizer(prompt + response_prefix, add_special_tokens=True).input_ids
