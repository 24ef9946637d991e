"""An LCC-style next-line code-completion set in the LongBench schema, built offline from Python sources.

Each record's ``context`` is a window of a source file that ends right before a one-line statement; the
answer is that line as written (indentation kept, trailing
whitespace dropped). The dataset is "lcc", so it gets LongBench's prompt and its code edit
similarity. Seeded: the same files, count and seed give the same records.
"""

from __future__ import annotations

import io
import random
import sysconfig
import tokenize
from collections.abc import Sequence
from pathlib import Path
from typing import Any

MIN_ANSWER_CHARS = 12
MIN_WORDS, MAX_WORDS = 800, 3000  # default context range: about 2k-7.5k SmolLM2 tokens of Python


def stdlib_sources(min_words: int) -> list[Path]:
    """Top-level ``.py`` files of this interpreter's standard library with at least ``min_words`` words."""
    folder = Path(sysconfig.get_paths()["stdlib"])
    return [p for p in sorted(folder.glob("*.py"))
            if len(p.read_text(encoding="utf-8", errors="replace").split()) >= min_words]


def statement_lines(source: str) -> list[int]:
    """0-based indices of lines that hold a whole one-line statement starting with a name or keyword, with at
    least ``MIN_ANSWER_CHARS`` characters and none of '#', '`', '//' (which the scorer treats as comments)."""
    lines = source.split("\n")
    found = []
    first: tokenize.TokenInfo | None = None
    try:
        for token in tokenize.generate_tokens(io.StringIO(source).readline):
            if token.type in (tokenize.INDENT, tokenize.DEDENT, tokenize.NL, tokenize.COMMENT):
                continue
            if token.type == tokenize.NEWLINE:
                if first is not None and first.type == tokenize.NAME and first.start[0] == token.start[0]:
                    text = lines[first.start[0] - 1].strip()
                    if len(text) >= MIN_ANSWER_CHARS and not any(c in text for c in ("#", "`", "//")):
                        found.append(first.start[0] - 1)
                first = None
            elif first is None:
                first = token
    except (tokenize.TokenError, SyntaxError):  # a file this Python cannot tokenize: use what was read
        pass
    return found


def _window(lines: list[str], end: int, words: int) -> int:
    """First line of the shortest trailing window of ``lines[:end]`` with at least ``words`` words."""
    total, start = 0, end
    while start > 0 and total < words:
        start -= 1
        total += len(lines[start].split())
    return start


def build_records(files: Sequence[str | Path], count: int, seed: int = 0, min_words: int = MIN_WORDS,
                  max_words: int = MAX_WORDS) -> list[dict[str, Any]]:
    """``count`` records; each context has a word count drawn uniformly from [min_words, max_words]
    (LongBench's ``length`` for code is the word count), taken as the window that precedes the answer."""
    rng = random.Random(seed)
    sources = []
    for path in map(Path, files):
        text = path.read_text(encoding="utf-8", errors="replace")
        lines = text.split("\n")
        prefix_words, total = [], 0
        for line in lines:
            prefix_words.append(total)
            total += len(line.split())
        sources.append((path, lines, prefix_words, statement_lines(text)))
    records: list[dict[str, Any]] = []
    seen: set[str] = set()
    for _ in range(50 * count):
        if len(records) == count:
            break
        words = rng.randint(min_words, max_words)
        path, lines, prefix_words, candidates = rng.choice(sources)
        usable = [i for i in candidates if prefix_words[i] >= words]
        if not usable:
            continue
        index = rng.choice(usable)
        record_id = f"{path.name}:{index + 1}"
        if record_id in seen:
            continue
        seen.add(record_id)
        context = "\n".join(lines[_window(lines, index, words):index]) + "\n"
        records.append({"input": "", "context": context, "answers": [lines[index].rstrip()],
                        "length": len(context.split()), "dataset": "lcc", "language": "python",
                        "all_classes": None, "_id": record_id})
    if len(records) < count:
        raise ValueError(f"only {len(records)} of {count} records: give longer files or a smaller min_words")
    return records


def as_dataset(records: Sequence[dict[str, Any]]) -> Any:
    """Records as a ``datasets.Dataset`` (what the LongBench task builder takes)."""
    import datasets

    return datasets.Dataset.from_list(list(records))
