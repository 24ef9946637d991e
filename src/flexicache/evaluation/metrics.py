"""Scoring functions: LongBench's official metrics, RULER string matching, ROUGE-L and output fidelity.

Every score is a float in [0, 1] for one prediction against one reference; the callers take the max over
references and report x100. The LongBench functions reproduce the benchmark's ``metrics.py`` semantics
(including its quirks, noted where they matter) without its code.
"""

from __future__ import annotations

import logging
import re
import string
from collections import Counter
from collections.abc import Sequence

_ZH_PUNCTUATION = (
    "！？｡。＂＃＄％＆＇（）＊＋，－／：；＜＝＞＠［＼］＾＿｀｛｜｝～｟｠｢｣､、〃》「」『』【】〔〕〖〗〘〙〚〛〜〝〞〟〰〾〿–—‘’‛“”„‟…‧﹏."
)
_EN_PUNCTUATION = frozenset(string.punctuation)
_ALL_PUNCTUATION = frozenset(string.punctuation + _ZH_PUNCTUATION)


def jieba_tokens(text: str) -> list[str]:
    """Chinese word segmentation with jieba in precise mode (as LongBench), quietly."""
    import jieba

    jieba.setLogLevel(logging.WARNING)
    return list(jieba.cut(text, cut_all=False))


# ---------------------------------------------------------------- answer normalisation and token F1
def normalize_answer(text: str) -> str:
    """SQuAD-style English normalisation: lowercase, drop punctuation, drop articles, collapse whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _EN_PUNCTUATION)
    text = re.sub(r"\b(a|an|the)\b", " ", text)
    return " ".join(text.split())


def normalize_zh_answer(text: str) -> str:
    """Chinese normalisation: lowercase, drop English and Chinese punctuation, remove all whitespace."""
    text = "".join(ch for ch in text.lower() if ch not in _ALL_PUNCTUATION)
    return "".join(text.split())


def token_f1(prediction: Sequence[str], reference: Sequence[str]) -> float:
    """Bag-of-tokens F1 between two token lists (0 when nothing is shared)."""
    same = sum((Counter(prediction) & Counter(reference)).values())
    if same == 0:
        return 0.0
    precision = same / len(prediction)
    recall = same / len(reference)
    return 2 * precision * recall / (precision + recall)


def qa_f1(prediction: str, reference: str) -> float:
    """LongBench ``qa_f1_score``: token F1 after English normalisation, whitespace tokens."""
    return token_f1(normalize_answer(prediction).split(), normalize_answer(reference).split())


def qa_f1_zh(prediction: str, reference: str) -> float:
    """LongBench ``qa_f1_zh_score``: token F1 over jieba tokens, each normalised, empty ones dropped."""

    def tokens(text: str) -> list[str]:
        return [t for t in (normalize_zh_answer(tok) for tok in jieba_tokens(text)) if t]

    return token_f1(tokens(prediction), tokens(reference))


# ---------------------------------------------------------------- ROUGE-L
def lcs_length(a: Sequence, b: Sequence) -> int:
    """Length of the longest common subsequence (O(len(a) * len(b)) time, O(len(b)) memory)."""
    if not a or not b:
        return 0
    row = [0] * (len(b) + 1)
    for x in a:
        diagonal = 0
        for j, y in enumerate(b, start=1):
            above = row[j]
            row[j] = diagonal + 1 if x == y else max(above, row[j - 1])
            diagonal = above
    return row[-1]


def rouge_l_f1(prediction: Sequence, reference: Sequence) -> float:
    """Plain sentence-level ROUGE-L F1 between two token sequences; two empty sequences count as identical."""
    if not prediction and not reference:
        return 1.0
    lcs = lcs_length(prediction, reference)
    if lcs == 0:
        return 0.0
    precision, recall = lcs / len(prediction), lcs / len(reference)
    return 2 * precision * recall / (precision + recall)


def _lcs_word_set(reference: list[str], hypothesis: list[str]) -> set[str]:
    """Words of one LCS of the two word lists, reconstructed with the tie rule of the ``rouge`` package."""
    n, m = len(reference), len(hypothesis)
    table = [[0] * (m + 1) for _ in range(n + 1)]
    for i in range(1, n + 1):
        for j in range(1, m + 1):
            if reference[i - 1] == hypothesis[j - 1]:
                table[i][j] = table[i - 1][j - 1] + 1
            else:
                table[i][j] = max(table[i - 1][j], table[i][j - 1])
    words: set[str] = set()
    i, j = n, m
    while i > 0 and j > 0:
        if reference[i - 1] == hypothesis[j - 1]:
            words.add(reference[i - 1])
            i, j = i - 1, j - 1
        elif table[i - 1][j] > table[i][j - 1]:
            i -= 1
        else:
            j -= 1
    return words


def _rouge_sentences(text: str) -> list[list[str]]:
    """Sentences as the ``rouge`` package cuts them: on every '.', empty pieces dropped, words on single spaces."""
    return [" ".join(piece.split()).split(" ") for piece in text.split(".") if piece]


def longbench_rouge_l(prediction: str, reference: str) -> float:
    """LongBench ``rouge_score``: the ``rouge`` package's summary-level ROUGE-L F on whitespace words.

    Quirks kept: sentences are split on '.', the union LCS and both lengths count *distinct* words, and an
    input with no sentence (empty, or only dots) scores 0 (LongBench catches the package's error). Not kept:
    the package's recursive LCS overflows Python's stack on a sentence pair of ~1000 words (LongBench then
    scores 0); here such pairs are scored normally.
    """
    hypothesis, references = _rouge_sentences(prediction), _rouge_sentences(reference)
    if not hypothesis or not references:
        return 0.0
    reference_words = {w for sentence in references for w in sentence}
    hypothesis_words = {w for sentence in hypothesis for w in sentence}
    union: set[str] = set()
    for ref_sentence in references:
        for hyp_sentence in hypothesis:
            union |= _lcs_word_set(ref_sentence, hyp_sentence)
    recall, precision = len(union) / len(reference_words), len(union) / len(hypothesis_words)
    return 2.0 * precision * recall / (precision + recall + 1e-8)


def longbench_rouge_l_zh(prediction: str, reference: str) -> float:
    """LongBench ``rouge_zh_score``: the same ROUGE-L on jieba tokens joined by spaces."""
    return longbench_rouge_l(" ".join(jieba_tokens(prediction)), " ".join(jieba_tokens(reference)))


# ---------------------------------------------------------------- classification, retrieval, count, code
def classification(prediction: str, reference: str, all_classes: Sequence[str]) -> float:
    """LongBench ``classification_score``: 1/k when the reference is among the k class names found.

    Class names contained in the reference (but not equal to it) are dropped from the matches. The official
    loop removes items from the list it iterates, so the item right after a removed one is never checked;
    that behaviour is reproduced.
    """
    matches = [name for name in all_classes if name in prediction]
    i = 0
    while i < len(matches):
        if matches[i] in reference and matches[i] != reference:
            del matches[i]
        i += 1  # also after a deletion: the official loop skips the next item
    return 1.0 / len(matches) if reference in matches else 0.0


def _fraction_equal(numbers: list[str], target: str) -> float:
    return 0.0 if not numbers else sum(n == target for n in numbers) / len(numbers)


def retrieval(prediction: str, reference: str) -> float:
    """LongBench ``retrieval_score``: share of the numbers in the prediction equal to the paragraph id."""
    target = re.findall(r"Paragraph (\d+)", reference)[0]
    return _fraction_equal(re.findall(r"\d+", prediction), target)


def retrieval_zh(prediction: str, reference: str) -> float:
    """LongBench ``retrieval_zh_score``: as :func:`retrieval` with references like '段落3'."""
    target = re.findall(r"段落(\d+)", reference)[0]
    return _fraction_equal(re.findall(r"\d+", prediction), target)


def count(prediction: str, reference: str) -> float:
    """LongBench ``count_score``: share of the numbers in the prediction equal to the reference."""
    return _fraction_equal(re.findall(r"\d+", prediction), str(reference))


def first_code_line(prediction: str) -> str:
    """The first line without '`', '#' or '//' after leading newlines are dropped ('' if there is none)."""
    for line in prediction.lstrip("\n").split("\n"):
        if "`" not in line and "#" not in line and "//" not in line:
            return line
    return ""


def fuzz_ratio(a: str, b: str) -> int:
    """fuzzywuzzy's ``fuzz.ratio`` (with python-Levenshtein): equal -> 100, one empty -> 0, else the rounded
    normalised indel similarity x100."""
    from rapidfuzz import fuzz

    if a == b:
        return 100
    if not a or not b:
        return 0
    return round(fuzz.ratio(a, b))


def code_sim(prediction: str, reference: str) -> float:
    """LongBench ``code_sim_score``: fuzz ratio / 100 between the first code line and the reference."""
    return fuzz_ratio(first_code_line(prediction), reference) / 100


# ---------------------------------------------------------------- RULER and fidelity
def string_match_all(prediction: str, references: Sequence[str]) -> float:
    """RULER ``string_match_all``: share of the references found (case-insensitive) in the prediction."""
    text = prediction.lower()
    return sum(ref.lower() in text for ref in references) / len(references)


def string_match_part(prediction: str, references: Sequence[str]) -> float:
    """RULER ``string_match_part``: 1 when any reference is found (case-insensitive) in the prediction."""
    text = prediction.lower()
    return float(any(ref.lower() in text for ref in references))


def first_divergence(tokens: Sequence[int], reference: Sequence[int]) -> int | None:
    """Index of the first generated token that differs from the reference (None if the two are identical);
    when one is a prefix of the other, the length of the shorter one."""
    for step, (a, b) in enumerate(zip(tokens, reference, strict=False)):
        if a != b:
            return step
    return None if len(tokens) == len(reference) else min(len(tokens), len(reference))


def rouge_words(text: str) -> list[str]:
    """Tokens for plain ROUGE on English text: lowercase alphanumeric runs (rouge-score's default tokenizer)."""
    return re.findall(r"[a-z0-9]+", text.lower())
