"""Calibration data: LongBench-format JSONL, plain text files and synthetic prompts anyone can regenerate.

A data spec (``--data``) is one of
- ``synthetic:passkey``: a pass key hidden in filler text, asked for at the end (greedy answer);
- ``synthetic:kv``: a JSON object of random UUID pairs, one value asked for (greedy answer);
- ``synthetic:code``: Python standard-library source, continued teacher-forced;
- ``synthetic:docs``: standard-library docstrings (English prose), continued teacher-forced;
- a ``.jsonl`` file in LongBench format (fields ``context`` and ``input``; task = ``dataset`` field or file stem);
- any other file: plain text, continued teacher-forced (task = file stem); a folder: each file in it.
The standard library is found through ``sysconfig.get_paths()["stdlib"]``, so the synthetic data exists everywhere
(its exact text depends on the Python version, which the profile records).
"""

from __future__ import annotations

import ast
import json
import random
import sysconfig
import uuid
from collections.abc import Callable
from dataclasses import dataclass
from functools import lru_cache
from pathlib import Path
from typing import Literal

import torch

SampleKind = Literal["prompt", "text"]
SYNTHETIC_DESCRIPTIONS = {
    "passkey": "pass key hidden at a random depth in repeated filler sentences, asked for at the end; chat "
    "template; greedy answer (EOS banned unless --allow-eos)",
    "kv": "JSON object of random UUID key/value pairs, one value asked for; chat template; greedy answer",
    "code": "Python standard-library source files in a seeded random order; teacher-forced continuation",
    "docs": "docstrings of standard-library modules (English prose); teacher-forced continuation",
}
SYNTHETIC_TASKS = tuple(SYNTHETIC_DESCRIPTIONS)
_FILLER = (
    "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
)


@dataclass(frozen=True)
class CalibrationSample:
    """One calibration sample.

    ``make(chars)`` returns its text, about ``chars`` characters long when the source can be sized (synthetic data)
    and the fixed text otherwise. ``prompt`` samples are questions answered greedily (chat template applied when
    the tokenizer has one); ``text`` samples are cut into a prompt and a teacher-forced continuation.
    """

    task: str
    kind: SampleKind
    make: Callable[[int], str]


@dataclass
class EncodedSample:
    task: str
    prompt_ids: torch.Tensor  # [T] int64
    continuation_ids: torch.Tensor | None  # [S] int64 for teacher forcing, None for greedy decoding


@lru_cache(maxsize=1)
def _stdlib_files() -> tuple[Path, ...]:
    """Top-level ``.py`` files of the standard library, sorted by name."""
    return tuple(sorted(Path(sysconfig.get_paths()["stdlib"]).glob("*.py")))


def _stdlib_text(seed: int, chars: int, extract: Callable[[str], str]) -> str:
    """``chars`` characters of standard-library files taken in a seeded random order (less if they run out)."""
    files = list(_stdlib_files())
    random.Random(seed).shuffle(files)
    parts, total = [], 0
    for path in files:
        text = extract(path.read_text(encoding="utf-8", errors="replace"))
        if text:
            parts.append(text)
            total += len(text)
        if total >= chars:
            break
    return "\n\n".join(parts)[:chars]


def _docstrings(source: str) -> str:
    """Module, class and function docstrings of a Python source, blank-line separated ("" if it does not parse)."""
    try:
        tree = ast.parse(source)
    except SyntaxError:
        return ""
    nodes = [tree, *(n for n in ast.walk(tree) if isinstance(n, (ast.ClassDef, ast.FunctionDef, ast.AsyncFunctionDef)))]
    docs = (ast.get_docstring(node) for node in nodes)
    return "\n\n".join(doc for doc in docs if doc and len(doc) > 80)


def _passkey(seed: int, chars: int) -> str:
    rng = random.Random(seed)
    key = rng.randint(10000, 99999)
    repeats = max(1, chars // len(_FILLER))
    depth = rng.randint(0, repeats)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    haystack = _FILLER * depth + needle + _FILLER * (repeats - depth)
    return (
        "There is important information hidden inside a lot of irrelevant text. Find it and memorize it.\n\n"
        f"{haystack}\n\nWhat is the pass key? The pass key is"
    )


def _kv_retrieval(seed: int, chars: int) -> str:
    rng = random.Random(seed)
    pairs = []
    while sum(len(k) + len(v) + 8 for k, v in pairs) < chars:
        pairs.append((str(uuid.UUID(int=rng.getrandbits(128))), str(uuid.UUID(int=rng.getrandbits(128)))))
    asked = rng.choice(pairs)[0]
    return (
        "Extract the value corresponding to the specified key in the JSON object below.\n\n"
        f"{json.dumps(dict(pairs), indent=1)}\n\nKey: \"{asked}\"\nThe value associated with the specified key is:"
    )


def synthetic_samples(task: str, count: int, seed: int = 0) -> list[CalibrationSample]:
    """``count`` samples of one synthetic task (see :data:`SYNTHETIC_TASKS`), deterministic given ``seed``."""
    seeds = [seed * 1000 + index for index in range(count)]
    if task == "passkey":
        return [CalibrationSample("passkey", "prompt", lambda c, s=s: _passkey(s, c)) for s in seeds]
    if task == "kv":
        return [CalibrationSample("kv", "prompt", lambda c, s=s: _kv_retrieval(s, c)) for s in seeds]
    if task == "code":
        return [CalibrationSample("code", "text", lambda c, s=s: _stdlib_text(s, c, str)) for s in seeds]
    if task == "docs":
        return [CalibrationSample("docs", "text", lambda c, s=s: _stdlib_text(s, c, _docstrings)) for s in seeds]
    raise ValueError(f"Unknown synthetic task {task!r}; choose one of {', '.join(SYNTHETIC_TASKS)}.")


def _fixed(text: str) -> Callable[[int], str]:
    return lambda _chars: text


def longbench_samples(path: Path, count: int) -> list[CalibrationSample]:
    """The first ``count`` records of a LongBench-format JSONL file as question prompts."""
    samples = []
    with path.open(encoding="utf-8") as handle:
        for line in handle:
            if len(samples) >= count:
                break
            if not line.strip():
                continue
            record = json.loads(line)
            if "context" not in record or "input" not in record:
                raise ValueError(f"{path}: LongBench records need 'context' and 'input' fields, got {sorted(record)}")
            prompt = (
                "Read the text below and answer the question.\n\n"
                f"{record['context']}\n\nQuestion: {record['input']}\nAnswer:"
            )
            samples.append(CalibrationSample(str(record.get("dataset") or path.stem), "prompt", _fixed(prompt)))
    return samples


def text_samples(path: Path, count: int) -> list[CalibrationSample]:
    """A plain text file split into ``count`` equal consecutive pieces, each continued teacher-forced."""
    text = path.read_text(encoding="utf-8", errors="replace")
    size = max(1, len(text) // count)
    pieces = [text[i * size : (i + 1) * size] for i in range(count)]
    return [CalibrationSample(path.stem, "text", _fixed(piece)) for piece in pieces if piece.strip()]


def load_samples(spec: str, count: int, seed: int = 0) -> list[CalibrationSample]:
    """Up to ``count`` samples per task from one data spec (see the module docstring)."""
    if spec.startswith("synthetic:"):
        return synthetic_samples(spec.split(":", 1)[1], count, seed)
    path = Path(spec)
    if path.is_dir():
        files = [child for child in sorted(path.iterdir()) if child.is_file()]
        return [sample for child in files for sample in load_samples(str(child), count)]
    if not path.is_file():
        raise FileNotFoundError(f"Calibration data {spec!r} is neither a file, a folder nor synthetic:<task>.")
    if path.suffix == ".jsonl":
        return longbench_samples(path, count)
    return text_samples(path, count)


def describe(spec: str) -> str:
    """One line saying what a data spec contains and how it is continued."""
    if spec.startswith("synthetic:"):
        return SYNTHETIC_DESCRIPTIONS.get(spec.split(":", 1)[1], "unknown synthetic task")
    if spec.endswith(".jsonl"):
        return "LongBench-format JSONL (context + input as a question prompt); greedy answer"
    return "plain text, cut into equal pieces; teacher-forced continuation"


def _truncate_middle(ids: list[int], length: int) -> list[int]:
    """Keep the first and last halves of ``ids`` when longer than ``length`` (LongBench-style truncation)."""
    if len(ids) <= length:
        return ids
    head = length // 2
    return ids[:head] + ids[len(ids) - (length - head) :]


def _render(tokenizer: object, sample: CalibrationSample, text: str) -> list[int]:
    if sample.kind == "prompt" and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template(
            [{"role": "user", "content": text}], add_generation_prompt=True, tokenize=False
        )
        return tokenizer(text, add_special_tokens=False)["input_ids"]
    return tokenizer(text)["input_ids"]


def encode_sample(
    sample: CalibrationSample, tokenizer: object, prompt_tokens: int, steps: int, max_tries: int = 6
) -> EncodedSample:
    """Tokenize a sample to a prompt of ``prompt_tokens`` tokens (fewer if the source is shorter).

    Sizable sources are regenerated larger until long enough. ``text`` samples also get ``steps`` continuation
    tokens; fixed texts too short for both keep ``steps`` tokens for the continuation and shorten the prompt.
    """
    needed = prompt_tokens + (steps if sample.kind == "text" else 0)
    chars = needed * 4
    ids: list[int] = []
    for _ in range(max_tries):
        text = sample.make(chars)
        ids = _render(tokenizer, sample, text)
        if len(ids) >= needed:
            break
        grown = int(chars * needed / max(len(ids), 1) * 1.1) + 1
        if sample.make(grown) == text:  # a fixed text: it will not grow
            break
        chars = grown
    if sample.kind == "prompt":
        return EncodedSample(sample.task, torch.tensor(_truncate_middle(ids, prompt_tokens)), None)
    ids = ids[:needed]
    split = max(1, len(ids) - steps)
    return EncodedSample(sample.task, torch.tensor(ids[:split]), torch.tensor(ids[split:]))
