"""Long generation in the style of L-Eval's open-ended tasks (summaries and long answers, up to 512 new
tokens, scored with ROUGE-L and token F1), from L-Eval JSONL files or from a reference-free offline set.

L-Eval records (loaded as ``datasets.Dataset``) hold one long ``input`` document with parallel ``instructions``
and ``outputs`` lists; each instruction becomes one sample. The offline set asks for long explanations of
standard-library modules: it has no references, so only the fidelity to the dense output (measured by the runner)
is reported.
"""

from __future__ import annotations

from collections.abc import Sequence
from pathlib import Path
from typing import Any

from .data import jsonl_files, load_jsonl
from .perplexity import DEFAULT_STDLIB_FILES, stdlib_file
from .prompting import middle_truncate, render
from .scoring import EvaluateMetric
from .tasks import Sample, Task

SYSTEM = ("Now you are given a very long document. Please follow the instruction after this document. These "
          "instructions may include summarizing a document, answering questions based on the document, or "
          "writing a required paragraph.")
MAX_NEW_TOKENS = 512
OFFLINE_INSTRUCTIONS = (
    "Explain in detail what the code above does, one class or function at a time.",
    "Write a long, detailed summary of the module above for a new contributor.",
    "Describe the public interface of the module above and how its parts work together.",
)


def build_prompt(document: str, instruction: str, words: int | None = None) -> str:
    """L-Eval's open-ended prompt; ``words`` adds its length hint (the reference's word count)."""
    hint = f" The suggested output length is around {words} words." if words else ""
    return f"{SYSTEM}\n\nDocument is as follows. {document}\n\nInstruction: {instruction}{hint}\nOutput: "


def _document_budget(tokenizer: Any, context_length: int, instruction: str, chat: bool) -> int:
    """Tokens left for the document once the prompt around it (chat template included) is counted."""
    overhead = len(render(tokenizer, build_prompt("", instruction, 9999), chat))
    return max(1, context_length - overhead)


def _sample(tokenizer: Any, sample_id: str, document: str, instruction: str, answers: list[str],
            context_length: int, chat: bool, max_new_tokens: int, length_hint: bool) -> Sample:
    document = middle_truncate(tokenizer, document, _document_budget(tokenizer, context_length, instruction, chat))
    words = len(answers[0].split()) if answers and length_hint else None
    return Sample(id=sample_id, input_ids=render(tokenizer, build_prompt(document, instruction, words), chat),
                  answers=answers, max_new_tokens=max_new_tokens)


def build_tasks(tokenizer: Any, files: Sequence[str | Path], context_length: int, chat: bool = True,
                limit: int | None = None, max_new_tokens: int = MAX_NEW_TOKENS) -> list[Task]:
    """One task per L-Eval JSONL file (named after it; zip archives of them work too), at most ``limit``
    instructions each; documents are middle-truncated so that the prompt fits ``context_length`` tokens."""
    tasks = []
    for file in jsonl_files(files):
        samples: list[Sample] = []
        for r, record in enumerate(load_jsonl(file.data_file)):
            for i, (instruction, output) in enumerate(zip(record["instructions"], record["outputs"], strict=True)):
                if limit is not None and len(samples) >= limit:
                    break
                answers = output if isinstance(output, list) else [output]
                samples.append(_sample(tokenizer, f"{r}-{i}", record["input"], instruction, answers,
                                       context_length, chat, max_new_tokens, length_hint=True))
        tasks.append(Task(name=file.stem, samples=samples, metric=EvaluateMetric("leval")))
    return tasks


def build_offline_task(tokenizer: Any, context_length: int, files: Sequence[str | Path] | None = None,
                       chat: bool = True, limit: int | None = None, max_new_tokens: int = MAX_NEW_TOKENS) -> Task:
    """The reference-free long-generation set: one standard-library module (or given text file) per sample,
    with a rotating instruction; task name ``longgen``."""
    paths = [Path(p) for p in files] if files else [stdlib_file(name) for name in DEFAULT_STDLIB_FILES]
    samples = [
        _sample(tokenizer, path.name, path.read_text(encoding="utf-8", errors="replace"),
                OFFLINE_INSTRUCTIONS[i % len(OFFLINE_INSTRUCTIONS)], [], context_length, chat, max_new_tokens,
                length_hint=False)
        for i, path in enumerate(paths[:limit])
    ]
    return Task(name="longgen", samples=samples)
