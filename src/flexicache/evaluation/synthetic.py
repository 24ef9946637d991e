"""Synthetic long-context tasks, generated to a target prompt length with the model's tokenizer.

Passkey retrieval (Landmark-attention style) and RULER-style tasks: needle-in-a-haystack variants (single,
multi-key, multi-value, multi-query), variable tracking, common- and frequent-word extraction. Templates
and answer prefixes follow RULER; its Paul Graham essays are replaced by the Python documentation that
ships with CPython (``pydoc_data``), so nothing is downloaded. Everything is seeded: the same arguments
give the same prompts. Scoring is RULER's string_match_all (the package's ``ruler`` evaluate module).
"""

from __future__ import annotations

import functools
import itertools
import random
import re
import string
import uuid
from collections.abc import Callable, Sequence
from dataclasses import dataclass
from typing import Any

from .prompting import render
from .scoring import EvaluateMetric
from .tasks import Sample, Task

NOISE_SENTENCES = ("The grass is green.", "The sky is blue.", "The sun is yellow.", "Here we go.",
                   "There and back again.")

_NIAH_TEMPLATE = (
    "Some special magic {kind} are hidden within the following text. Make sure to memorize it. I will quiz you "
    "about the {kind} afterwards.\n{context}\nWhat are all the special magic {kind} for {query} mentioned in the "
    "provided text?"
)
_NIAH_ANSWER = " The special magic {kind} for {query} mentioned in the provided text are"
_NEEDLE = "One of the special magic {kind} for {key} is: {value}."
_VT_TEMPLATE = (
    "Memorize and track the chain(s) of variable assignment hidden in the following text.\n\n{context}\n"
    "Question: Find all variables that are assigned the value {query} in the text above."
)
_VT_ANSWER = (" Answer: According to the chain(s) of variable assignment in the text above, {count} variables are "
              "assigned the value {query}, they are: ")
_CWE_TEMPLATE = (
    "Below is a numbered list of words. In these words, some appear more often than others. Memorize the ones "
    "that appear most often.\n{context}\nQuestion: What are the 10 most common words in the above list?"
)
_CWE_ANSWER = " Answer: The top 10 words that appear most often in the list are:"
_FWE_TEMPLATE = (
    "Read the following coded text and track the frequency of each coded word. Find the three most frequently "
    "appeared coded words. {context}\nQuestion: Do not provide any explanation. Please ignore the dots '....'. "
    "What are the three most frequently appeared words in the above coded text?"
)
_FWE_ANSWER = " Answer: According to the coded text above, the three most frequently appeared words are:"
_PASSKEY_INTRO = ("There is an important info hidden inside a lot of irrelevant text. Find it and memorize it. "
                  "I will quiz you about the important information there.")


@dataclass(frozen=True)
class Niah:
    """A RULER needle-in-a-haystack configuration."""

    haystack: str  # "noise", "essay" or "needle" (a haystack of distractor needles)
    key_type: str = "words"  # "words" or "uuids"
    value_type: str = "numbers"  # "numbers" or "uuids"
    num_keys: int = 1
    num_values: int = 1
    num_queries: int = 1


NIAH_TASKS: dict[str, Niah] = {
    "niah_single_1": Niah("noise"),
    "niah_single_2": Niah("essay"),
    "niah_single_3": Niah("essay", value_type="uuids"),
    "niah_multikey_1": Niah("essay", num_keys=4),
    "niah_multikey_2": Niah("needle"),
    "niah_multikey_3": Niah("needle", key_type="uuids", value_type="uuids"),
    "niah_multivalue": Niah("essay", num_values=4),
    "niah_multiquery": Niah("essay", num_queries=4),
}
MAX_NEW_TOKENS = {"passkey": 16, "niah": 128, "vt": 30, "cwe": 120, "fwe": 50}
SYNTHETIC_TASKS: tuple[str, ...] = ("passkey", *NIAH_TASKS, "vt", "cwe", "fwe")


@functools.cache
def essay_words() -> tuple[str, ...]:
    """The CPython reference documentation (``pydoc_data.topics``) as one stream of words."""
    from pydoc_data.topics import topics

    text = " ".join(topics[name] for name in sorted(topics))
    return tuple(re.sub(r"\*{3,}|={3,}|-{3,}", " ", text).split())


@functools.cache
def vocabulary() -> tuple[str, ...]:
    """Distinct lowercase English words (4-10 letters) of the documentation, sorted."""
    return tuple(sorted(set(re.findall(r"\b[a-z]{4,10}\b", " ".join(essay_words())))))


def fit_length(build: Callable[[int], list[int]], target: int, upper: int) -> tuple[int, list[int]]:
    """Largest ``n`` in [0, upper] with ``len(build(n)) <= target`` (``build`` grows with n) and its ids."""
    best = build(0)
    if len(best) > target:
        raise ValueError(f"target length {target} is below the task's minimum prompt ({len(best)} tokens)")
    low, high, best_n = 1, upper, 0
    while low <= high:
        middle = (low + high) // 2
        ids = build(middle)
        if len(ids) <= target:
            best_n, best, low = middle, ids, middle + 1
        else:
            high = middle - 1
    return best_n, best


def insert_at_depths(units: Sequence[str], items: Sequence[str], depths: Sequence[float]) -> list[str]:
    """``units`` with each item inserted at fraction ``depth`` of its length (0 = start, 1 = end); items at
    equal positions keep their order."""
    out = list(units)
    order = sorted(range(len(items)), key=lambda i: (depths[i], i), reverse=True)  # back to front
    for i in order:
        out.insert(round(depths[i] * len(units)), items[i])
    return out


def zeta_function(alpha: float, terms: int = 100_000) -> float:
    """Riemann zeta(alpha) for alpha > 1: a partial sum plus the integral of the tail."""
    return sum(k ** -alpha for k in range(1, terms)) + terms ** (1 - alpha) / (alpha - 1)


def _noise(n: int) -> list[str]:
    return [NOISE_SENTENCES[i % len(NOISE_SENTENCES)] for i in range(n)]


def _essay(n: int, start: int) -> list[str]:
    words = essay_words()
    return [words[(start + i) % len(words)] for i in range(n)]


def _word_key(rng: random.Random) -> str:
    first, second = rng.sample(vocabulary(), 2)
    return f"{first}-{second}"


def _uuid(rng: random.Random) -> str:
    return str(uuid.UUID(int=rng.getrandbits(128), version=4))


def _draw(kind: str, rng: random.Random) -> str:
    if kind == "words":
        return _word_key(rng)
    if kind == "numbers":
        return str(rng.randint(10**6, 10**7 - 1))
    return _uuid(rng)


Builder = Callable[[str, str], list[int]]
"""(prompt, answer prefix) -> model input ids."""


def passkey(build: Builder, target: int, rng: random.Random, depth: float) -> Sample:
    """Find a 5-digit pass key in repeated filler sentences; the needle sits at ``depth``."""
    key = str(rng.randint(10000, 99999))
    needle = f"The pass key is {key}. Remember it. {key} is the pass key."

    def ids(n: int) -> list[int]:
        body = " ".join(insert_at_depths(_noise(n), [needle], [depth]))
        return build(f"{_PASSKEY_INTRO} {body}\nWhat is the pass key?", " The pass key is")

    _, input_ids = fit_length(ids, target, target)
    return Sample(id="", input_ids=input_ids, answers=[key], max_new_tokens=MAX_NEW_TOKENS["passkey"],
                  meta={"depth": depth})


def niah(build: Builder, target: int, rng: random.Random, config: Niah) -> Sample:
    """RULER needle in a haystack: needles 'One of the special magic numbers for KEY is: VALUE.' hidden in
    noise, documentation text or other needles; the answer lists the values of the queried keys."""
    kind = "numbers" if config.value_type == "numbers" else "uuids"
    keys = [_draw(config.key_type, rng) for _ in range(max(config.num_keys, config.num_queries))]
    values = [[_draw(config.value_type, rng) for _ in range(config.num_values)] for _ in keys]
    needles = [_NEEDLE.format(kind=kind, key=k, value=v) for k, vs in zip(keys, values, strict=True) for v in vs]
    rng.shuffle(needles)
    depths = [rng.random() for _ in needles]
    queried = keys[: config.num_queries]
    query = queried[0] if len(queried) == 1 else ", ".join(queried[:-1]) + ", and " + queried[-1]
    answers = [v for vs in values[: config.num_queries] for v in vs]
    start = rng.randrange(len(essay_words()))
    distractors: list[str] = []
    distractor_rng = random.Random(rng.random())
    while config.haystack == "needle" and len(distractors) < target:
        key = _draw(config.key_type, distractor_rng)
        if key not in keys:
            distractors.append(_NEEDLE.format(kind=kind, key=key, value=_draw(config.value_type, distractor_rng)))

    def haystack(n: int) -> tuple[list[str], str]:
        if config.haystack == "noise":
            return _noise(n), " "
        if config.haystack == "essay":
            return _essay(n, start), " "
        return distractors[:n], "\n"

    def ids(n: int) -> list[int]:
        units, sep = haystack(n)
        context = sep.join(insert_at_depths(units, needles, depths))
        return build(_NIAH_TEMPLATE.format(kind=kind, context=context, query=query),
                     _NIAH_ANSWER.format(kind=kind, query=query))

    _, input_ids = fit_length(ids, target, target)
    return Sample(id="", input_ids=input_ids, answers=answers, max_new_tokens=MAX_NEW_TOKENS["niah"],
                  meta={"depths": depths})


def variable_tracking(build: Builder, target: int, rng: random.Random, hops: int = 4) -> Sample:
    """RULER variable tracking: a chain 'VAR A = 12345', 'VAR B = VAR A', ... hidden in noise; the answer is
    every variable holding the value."""
    names: list[str] = []
    while len(names) < hops + 1:
        name = "".join(rng.choices(string.ascii_uppercase, k=5))
        if name not in names:
            names.append(name)
    value = str(rng.randint(10000, 99999))
    chain = [f"VAR {names[0]} = {value}."] + [f"VAR {b} = VAR {a}." for a, b in itertools.pairwise(names)]
    depths = sorted(rng.random() for _ in chain)

    def ids(n: int) -> list[int]:
        context = " ".join(insert_at_depths(_noise(n), chain, depths))
        return build(_VT_TEMPLATE.format(context=context, query=value),
                     _VT_ANSWER.format(count=len(names), query=value))

    _, input_ids = fit_length(ids, target, target)
    return Sample(id="", input_ids=input_ids, answers=names, max_new_tokens=MAX_NEW_TOKENS["vt"])


def common_words(build: Builder, target: int, rng: random.Random, num_common: int = 10,
                 freq_common: int = 30, freq_rare: int = 3) -> Sample:
    """RULER common-word extraction: a numbered list where ``num_common`` words appear ``freq_common`` times
    and the others ``freq_rare`` times; the answer is the common words."""
    pool = list(vocabulary())
    rng.shuffle(pool)
    common, rare_pool = pool[:num_common], pool[num_common:]
    shuffle_seed = rng.random()

    def ids(n: int) -> list[int]:
        words = common * freq_common + rare_pool[:n] * freq_rare
        random.Random(shuffle_seed).shuffle(words)
        context = " ".join(f"{i + 1}. {word}" for i, word in enumerate(words))
        return build(_CWE_TEMPLATE.format(context=context), _CWE_ANSWER)

    _, input_ids = fit_length(ids, target, len(rare_pool))
    return Sample(id="", input_ids=input_ids, answers=common, max_new_tokens=MAX_NEW_TOKENS["cwe"])


def frequent_words(build: Builder, target: int, rng: random.Random, alpha: float = 2.0,
                   vocab_size: int = 2000, word_length: int = 6) -> Sample:
    """RULER frequent-word extraction: coded words drawn with Zipf(alpha) frequencies; the most frequent one
    is '....' (noise); the answer is the next three."""
    vocab: list[str] = []
    seen: set[str] = set()
    while len(vocab) < vocab_size:
        word = "".join(rng.choices(string.ascii_lowercase, k=word_length))
        if word not in seen:
            seen.add(word)
            vocab.append(word)
    vocab[0] = "...."
    zeta = zeta_function(alpha)
    shuffle_seed = rng.random()

    def ids(n: int) -> list[int]:
        words = [w for k, w in enumerate(vocab, start=1) for _ in range(int(n * k ** -alpha / zeta))]
        random.Random(shuffle_seed).shuffle(words)
        return build(_FWE_TEMPLATE.format(context=" ".join(words)), _FWE_ANSWER)

    _, input_ids = fit_length(ids, target, 4 * target)
    return Sample(id="", input_ids=input_ids, answers=vocab[1:4], max_new_tokens=MAX_NEW_TOKENS["fwe"])


def build_sample(task: str, tokenizer: Any, target: int, seed: int, index: int, count: int,
                 chat: bool = False) -> Sample:
    """Sample ``index`` (of ``count``) of ``task`` with a prompt of at most ``target`` tokens."""
    rng = random.Random(f"{seed}/{task}/{target}/{index}")

    def build(prompt: str, answer_prefix: str) -> list[int]:
        return render(tokenizer, prompt, chat, answer_prefix)

    if task == "passkey":
        sample = passkey(build, target, rng, depth=index / (count - 1) if count > 1 else 0.5)
    elif task in NIAH_TASKS:
        sample = niah(build, target, rng, NIAH_TASKS[task])
    elif task == "vt":
        sample = variable_tracking(build, target, rng)
    elif task == "cwe":
        sample = common_words(build, target, rng)
    elif task == "fwe":
        sample = frequent_words(build, target, rng)
    else:
        raise KeyError(f"unknown synthetic task {task!r}; choose from {SYNTHETIC_TASKS}")
    sample.id = f"{task}-{target}-{index}"
    sample.meta["target_length"] = target
    return sample


def build_tasks(tokenizer: Any, names: Sequence[str], lengths: Sequence[int], samples: int, seed: int = 0,
                chat: bool = False, max_new_tokens: int | None = None) -> list[Task]:
    """One task per (name, length), named ``{name}_{length}``, with ``samples`` seeded samples each."""
    metric = EvaluateMetric("ruler", "string_match_all")
    tasks = []
    for name in names:
        for length in lengths:
            items = [build_sample(name, tokenizer, length, seed, i, samples, chat) for i in range(samples)]
            for item in items:
                item.max_new_tokens = min(item.max_new_tokens, max_new_tokens or item.max_new_tokens)
            tasks.append(Task(name=f"{name}_{length}", samples=items, metric=metric))
    return tasks

