"""Decode-mode perplexity (as Quest measures PG19): prefill a first chunk, then feed the text one token per
forward so that every later prediction goes through the cache's decode path."""

from __future__ import annotations

import math
import sysconfig
from collections.abc import Sequence
from pathlib import Path
from typing import Any

import torch

from .generation import as_input, forward
from .tasks import Sample, Task

# Long, plain-text-like standard-library sources: present on every CPython install.
DEFAULT_STDLIB_FILES = ("argparse.py", "tarfile.py", "typing.py", "inspect.py", "difflib.py", "subprocess.py")


def stdlib_file(name: str) -> Path:
    """Path of a file in this interpreter's standard library."""
    return Path(sysconfig.get_paths()["stdlib"]) / name


@torch.no_grad()
def decode_nll(model: Any, ids: Sequence[int], cache: Any, prefill: int) -> tuple[float, int]:
    """Summed negative log-likelihood (nats) of ``ids[prefill:]`` and how many tokens it covers.

    ``ids[:prefill]`` go in as one dense forward; every later token is fed alone and scored by the
    prediction made before it.
    """
    check_prefill(ids, prefill)
    logits = forward(model, as_input(model, [ids[:prefill]]), cache)[0]
    return score_continuation(model, ids, cache, prefill, logits)


def check_prefill(ids: Sequence[int], prefill: int) -> None:
    """Raise ``ValueError`` unless ``prefill`` leaves at least one of ``ids`` to score."""
    if not 1 <= prefill < len(ids):
        raise ValueError(f"prefill must be in [1, {len(ids) - 1}], got {prefill}")


@torch.no_grad()
def score_continuation(model: Any, ids: Sequence[int], cache: Any, start: int, logits: torch.Tensor
                       ) -> tuple[float, int]:
    """Summed NLL (nats) of ``ids[start:]`` and its token count, ``cache`` holding ``ids[:start]`` and ``logits``
    [vocab] the prediction after them: every later token is fed alone and scored by the prediction before it."""
    total = 0.0
    for position in range(start, len(ids)):
        total -= float(torch.log_softmax(logits, dim=-1)[ids[position]])
        if position + 1 < len(ids):
            logits = forward(model, as_input(model, [[ids[position]]]), cache)[0]
    return total, len(ids) - start


def perplexity(nll: float, tokens: int) -> float:
    """exp(mean NLL)."""
    return math.exp(nll / tokens)


def build_task(tokenizer: Any, files: Sequence[str | Path], context_length: int, prefill: int,
               limit: int | None = None) -> Task:
    """One sample per text file: its first ``context_length`` tokens, the first ``prefill`` of them
    prefilled."""
    samples = []
    for path in list(files)[:limit]:
        path = Path(path)
        ids = tokenizer(path.read_text(encoding="utf-8", errors="replace"), add_special_tokens=True).input_ids
        ids = ids[:context_length]
        if len(ids) <= prefill:
            raise ValueError(f"{path} has {len(ids)} tokens, not more than the prefill ({prefill})")
        samples.append(Sample(id=path.name, input_ids=ids, prefill=prefill, meta={"path": str(path)}))
    return Task(name="ppl", samples=samples, kind="perplexity")
