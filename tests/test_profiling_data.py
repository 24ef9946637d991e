"""Calibration data: synthetic tasks, LongBench JSONL, text files, tokenization to exact lengths."""

from __future__ import annotations

import json
import string

import pytest
from tokenizers import Tokenizer, models
from transformers import PreTrainedTokenizerFast

from flexicache.profiling.data import SYNTHETIC_TASKS, describe, encode_sample, load_samples, synthetic_samples


def char_tokenizer() -> PreTrainedTokenizerFast:
    """Offline tokenizer: one token per printable ASCII character (BPE without merges)."""
    symbols = ["<unk>", "<s>", "</s>", *sorted(set(string.printable))]
    backend = Tokenizer(models.BPE(vocab={c: i for i, c in enumerate(symbols)}, merges=[], unk_token="<unk>"))
    return PreTrainedTokenizerFast(tokenizer_object=backend, unk_token="<unk>", bos_token="<s>", eos_token="</s>")


@pytest.mark.parametrize("task", SYNTHETIC_TASKS)
def test_synthetic_tasks_are_deterministic_and_sized(task):
    first, second = synthetic_samples(task, 2, seed=3)
    again = synthetic_samples(task, 1, seed=3)[0]
    assert first.task == task and first.make(4000) == again.make(4000)
    assert first.make(4000) != second.make(4000)
    assert len(first.make(4000)) >= 3000 and len(first.make(20000)) > len(first.make(4000))


def test_synthetic_contents():
    passkey = synthetic_samples("passkey", 1)[0].make(3000)
    key = passkey.split("The pass key is ")[1].split(".")[0]
    assert key.isdigit() and passkey.rstrip().endswith("The pass key is")
    kv = synthetic_samples("kv", 1)[0].make(3000)
    asked = kv.split('Key: "')[1].split('"')[0]
    assert f'"{asked}": ' in kv
    code, docs = synthetic_samples("code", 1)[0].make(20000), synthetic_samples("docs", 1)[0].make(20000)
    assert code.count("def ") > 10 * max(1, docs.count("def "))  # source versus prose
    with pytest.raises(ValueError, match="passkey"):
        synthetic_samples("nope", 1)
    assert "teacher-forced" in describe("synthetic:code") and "greedy" in describe("synthetic:kv")
    assert "LongBench" in describe("x/y.jsonl") and "plain text" in describe("notes.txt")


def test_encode_to_exact_lengths():
    tokenizer = char_tokenizer()
    text = encode_sample(synthetic_samples("code", 1)[0], tokenizer, prompt_tokens=300, steps=50)
    assert text.prompt_ids.numel() == 300 and text.continuation_ids.numel() == 50
    prompt = encode_sample(synthetic_samples("passkey", 1)[0], tokenizer, prompt_tokens=300, steps=50)
    assert prompt.prompt_ids.numel() == 300 and prompt.continuation_ids is None
    tail = "".join(tokenizer.convert_ids_to_tokens(prompt.prompt_ids[-15:].tolist()))
    assert tail == "The pass key is"  # the question survives the cut


def test_longbench_jsonl_and_text_files(tmp_path):
    records = [{"context": "abc " * 200, "input": "what?", "dataset": "qa"}, {"context": "x", "input": "y"}]
    (tmp_path / "bench.jsonl").write_text("\n".join(json.dumps(r) for r in records) + "\n")
    (tmp_path / "novel.txt").write_text("Once upon a time. " * 100)
    samples = load_samples(str(tmp_path / "bench.jsonl"), count=5)
    assert [s.task for s in samples] == ["qa", "bench"] and all(s.kind == "prompt" for s in samples)
    assert "what?" in samples[0].make(0) and samples[0].make(10) == samples[0].make(10**6)
    pieces = load_samples(str(tmp_path / "novel.txt"), count=4)
    assert len(pieces) == 4 and {s.task for s in pieces} == {"novel"} and pieces[0].kind == "text"
    assert len(load_samples(str(tmp_path), count=2)) == 4  # folder: both files
    encoded = encode_sample(pieces[0], char_tokenizer(), prompt_tokens=1000, steps=100)
    assert encoded.continuation_ids.numel() == 100 and encoded.prompt_ids.numel() == 450 - 100
    (tmp_path / "bad.jsonl").write_text(json.dumps({"text": 1}) + "\n")
    with pytest.raises(ValueError, match="context"):
        load_samples(str(tmp_path / "bad.jsonl"), 1)
    with pytest.raises(FileNotFoundError):
        load_samples(str(tmp_path / "missing.txt"), 1)
