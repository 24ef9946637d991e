"""One dense prefill shared by every method: a cache filled from it decodes as after its own prefill, bit for bit,
and the runner's predictions are the same with sharing on and off."""

from __future__ import annotations

import json

import pytest
import torch
from conftest import mixed_profile, random_prompt, tiny_config, tiny_model
from test_eval_harness import LengthMetric, make_model, prompt_ids, save_tiny_model, train_tiny_tokenizer
from transformers import DynamicCache

from flexicache import FlexiCache
from flexicache.evaluation.generation import as_input, feed_tokens, forward, generate
from flexicache.evaluation.methods import DenseMethod, FlexiCacheMethod, Method, OracleMethod
from flexicache.evaluation.perplexity import decode_nll
from flexicache.evaluation.runner import PredictionStore, pending_groups, run_tasks
from flexicache.evaluation.shared_prefill import (
    can_fill,
    decode_nll_from,
    fill,
    generate_from,
    prefill_forward,
    prefill_generation,
    snapshot_cache,
)
from flexicache.evaluation.tasks import Sample, Task
from flexicache.oracle import OracleCache


@pytest.fixture(scope="module")
def tokenizer():
    return train_tiny_tokenizer()


@pytest.fixture(scope="module")
def model(tokenizer):
    return make_model(tokenizer, seed=6)  # its first tokens here decode to whole characters (stop strings match)


def cache_factories(config, model) -> dict:
    """Fresh caches of every kind the runner fills: sparse FlexiCaches (a mixed profile, a budget over the
    context), oracles and the dense cache."""
    profile = mixed_profile(config)
    return {
        "flexicache@16": lambda: FlexiCache.from_model(model, profile=profile, token_budget=16, page_size=4,
                                                       rerank_interval=3),
        "flexicache@32,sum": lambda: FlexiCache.from_model(model, profile=profile, token_budget=32, page_size=8,
                                                           rerank_interval=2, group_reduce="sum"),
        "flexicache@512": lambda: FlexiCache.from_model(model, profile=profile, token_budget=512, page_size=8),
        "flexicache@16,default": lambda: FlexiCache.from_model(model, token_budget=16, page_size=4),
        "flexicache@16,head_budgets": lambda: FlexiCache.from_model(model, profile=profile, token_budget=16,
                                                                    page_size=4, head_budgets="prompt"),
        "oracle@16": lambda: OracleCache(config, token_budget=16, page_size=4),
        "dense": lambda: DynamicCache(config=config),
    }


def decode_logits(model, cache, logits: torch.Tensor, steps: int) -> list[torch.Tensor]:
    """``steps`` greedy decode steps from ``logits`` [B, vocab]: the logits [B, vocab] before each token."""
    seen = [logits]
    for _ in range(steps):
        logits = forward(model, logits.argmax(-1, keepdim=True), cache)
        seen.append(logits)
    return seen


@pytest.mark.parametrize("batch", [1, 2])
def test_a_filled_cache_decodes_as_after_its_own_prefill(batch):
    config = tiny_config(num_layers=3)
    model = tiny_model(config)
    ids = torch.stack([random_prompt(45, seed) for seed in range(batch)])
    with torch.no_grad():
        prefill = prefill_forward(model, ids)
        snapshot = [(layer.keys.clone(), layer.values.clone()) for layer in prefill.snapshot.layers]
        for name, make in cache_factories(config, model).items():
            own = make()
            expected = decode_logits(model, own, forward(model, ids, own), 20)
            filled = make()
            assert can_fill(filled)
            fill(filled, prefill)
            got = decode_logits(model, filled, prefill.logits, 20)
            assert all(torch.equal(a, b) for a, b in zip(got, expected, strict=True)), name
            if isinstance(own, FlexiCache):
                assert filled.stats() == own.stats(), name
                assert all(torch.equal(a.storage.row_pages_host, b.storage.row_pages_host)
                           for a, b in zip(filled.layers, own.layers, strict=True)), name
                assert own.stats()["reranks_stable"] > 0 and own.stats()["decode_steps"] == 20
        assert all(torch.equal(layer.keys, keys) and torch.equal(layer.values, values)
                   for layer, (keys, values) in zip(prefill.snapshot.layers, snapshot, strict=True))


def test_a_sparse_budget_changes_the_decode_so_equality_above_is_not_trivial():
    config = tiny_config(num_layers=3)
    model = tiny_model(config)
    ids = random_prompt(45, 0).view(1, -1)
    with torch.no_grad():
        prefill = prefill_forward(model, ids)
        outputs = {}
        for name, make in cache_factories(config, model).items():
            cache = make()
            fill(cache, prefill)
            outputs[name] = decode_logits(model, cache, prefill.logits, 20)[-1]
    assert torch.equal(outputs["flexicache@512"], outputs["dense"])  # a budget over the context is dense
    assert not torch.equal(outputs["flexicache@16"], outputs["dense"])
    assert not torch.equal(outputs["oracle@16"], outputs["dense"])


def test_only_full_attention_caches_are_filled():
    sliding = tiny_config("mistral", sliding_window=8, num_layers=2)
    assert snapshot_cache(tiny_model(sliding)) is None  # a hybrid model's prefill is not shared
    assert not can_fill(DynamicCache(config=sliding))
    config = tiny_config(num_layers=2)
    model = tiny_model(config)
    assert can_fill(DynamicCache(config=config)) and can_fill(OracleCache(config, token_budget=16, page_size=4))
    used = DynamicCache(config=config)
    with torch.no_grad():
        forward(model, random_prompt(10, 0).view(1, -1), used)
    assert not can_fill(used)  # not empty
    assert snapshot_cache(model) is not None
    model.set_attn_implementation("eager")  # another prefill than the probe's sdpa
    assert snapshot_cache(model) is None


# --------------------------------------------------------------------------------------------- generation
def generation_cases(tokenizer, model, prompts: list[list[int]]) -> list[dict]:
    """Stopping settings that end generation at the first token, later, or never, for the rows of ``prompts``."""
    free = generate(model, prompts, DynamicCache(config=model.config), 8, set())
    first, third, later = free[0][0], free[0][2], free[0][3]
    spanning = tokenizer.decode([prompts[0][-1], first])  # begins in the prompt, ends with the first token
    # row 0 ends at its first token, the others at their second: generate then stops after two steps
    early = {first} | {row[1] for row in free[1:] if row[0] != first}
    return [
        {"max_new_tokens": 8, "stop_ids": set()},
        {"max_new_tokens": 1, "stop_ids": set()},
        {"max_new_tokens": 8, "stop_ids": {first}},  # row 0 ends at its first token
        {"max_new_tokens": 8, "stop_ids": early},
        {"max_new_tokens": 8, "stop_ids": {first}, "min_new_tokens": 1},  # ... except that stops are masked
        {"max_new_tokens": 8, "stop_ids": {third}, "min_new_tokens": 2},  # masked at steps 1 and 2, not at 3
        {"max_new_tokens": 8, "stop_ids": {later}, "stop_strings": (tokenizer.decode([first]),)},
        {"max_new_tokens": 8, "stop_ids": set(), "stop_strings": (spanning,)},
        {"max_new_tokens": 8, "stop_ids": {later}, "stop_strings": (tokenizer.decode(free[0][2:4]), "zzzz")},
    ]


def counting_forwards(model, work) -> tuple[object, int]:
    """``work()``'s result and how many forwards of ``model`` it ran."""
    calls = []
    handle = model.register_forward_pre_hook(lambda *_: calls.append(1))
    try:
        return work(), len(calls)
    finally:
        handle.remove()


@pytest.mark.parametrize("decode_tail", [0, 3])
@pytest.mark.parametrize("rows", [1, 3])
def test_generation_from_a_shared_prefill_equals_its_own(tokenizer, model, decode_tail, rows):
    ids = prompt_ids(tokenizer, 200)
    prompts = [ids[start:start + 60] for start in range(0, 20 * rows, 20)]
    config = model.config
    makers = {"dense": lambda: DynamicCache(config=config),
              "flexicache@32": lambda: FlexiCache.from_model(model, token_budget=32, page_size=8, rerank_interval=2),
              "oracle@32": lambda: OracleCache(config, token_budget=32, page_size=8)}
    ended_early = 0
    for case in generation_cases(tokenizer, model, prompts):
        settings = {"decode_tail": decode_tail, "tokenizer": tokenizer, **case}
        prefill = prefill_generation(model, prompts, **settings)
        assert prefill.length == (len(prompts[0]) - decode_tail if decode_tail else len(prompts[0]))
        for name, make in makers.items():
            expected, own_forwards = counting_forwards(model, lambda: generate(model, prompts, make(), **settings))
            got, forwards = counting_forwards(model, lambda: generate_from(model, prompts, make(), prefill,
                                                                           **settings))
            assert got == expected, (name, case)
            assert forwards == own_forwards - 1, (name, case)  # the same steps, but for the prefill
        if not decode_tail:
            ended_early += int(prefill.finished.sum())
            assert prefill.first_tokens.tolist() == [row[0] for row in expected]
    if not decode_tail:
        assert ended_early >= 4  # the cases above do end some rows at their first token


def test_decode_tail_is_fed_after_the_shared_part(tokenizer, model):
    ids = prompt_ids(tokenizer, 50)
    prefill = prefill_generation(model, [ids], 1, set(), decode_tail=3)
    calls = []
    handle = model.register_forward_pre_hook(lambda _m, _a, kw: calls.append(kw["input_ids"].shape[1]),
                                             with_kwargs=True)
    try:
        generate_from(model, [ids], DynamicCache(config=model.config), prefill, 1, set(), decode_tail=3)
    finally:
        handle.remove()
    assert prefill.length == len(ids) - 3 and calls == [1, 1, 1]  # two prompt tokens, then generate's own


def test_perplexity_from_a_shared_prefill_equals_its_own(tokenizer, model):
    ids = prompt_ids(tokenizer, 80)
    prefill = prefill_forward(model, as_input(model, [ids[:30]]))
    for make in (lambda: DynamicCache(config=model.config),
                 lambda: FlexiCache.from_model(model, token_budget=16, page_size=4, rerank_interval=2)):
        assert decode_nll_from(model, ids, make(), prefill) == decode_nll(model, ids, make(), 30)
    with pytest.raises(ValueError, match=r"prefill must be in \[1, 29\], got 30"):
        decode_nll_from(model, ids[:30], DynamicCache(config=model.config), prefill)


def test_feed_tokens_feeds_one_token_per_forward(tokenizer, model):
    ids = as_input(model, [prompt_ids(tokenizer, 30)])
    cache = DynamicCache(config=model.config)
    with torch.no_grad():
        start = forward(model, ids[:, :10], cache)
        assert feed_tokens(model, ids, cache, 10, 10, start) is start
        logits = feed_tokens(model, ids, cache, 10, ids.shape[1])
        whole = model(ids).logits[:, -1].float()
    assert cache.get_seq_length() == ids.shape[1]
    torch.testing.assert_close(logits, whole)


# --------------------------------------------------------------------------------------------- runner
def runner_methods(model) -> tuple[list, list]:
    counting = []
    methods = [DenseMethod(model), OracleMethod(model, 32, 8),
               FlexiCacheMethod(model, {"token_budget": 32, "page_size": 8, "rerank_interval": 2}),
               Method("dense-copy", lambda: counting.append(1) or DynamicCache(config=model.config))]
    return methods, counting


def runner_task(tokenizer) -> list[Task]:
    ids = prompt_ids(tokenizer, 200)
    gen = Task("gen", [Sample(id=str(i), input_ids=ids[i:i + 70], max_new_tokens=6, stop_at_newline=i == 1)
                       for i in range(3)], metric=LengthMetric())
    ppl = Task("ppl", [Sample(id="a", input_ids=ids[:90], prefill=40)], kind="perplexity")
    return [gen, ppl]


def stored(folder, tasks, methods) -> dict:
    store = PredictionStore(folder)
    return {(t.name, m.name): store.load(t.name, m.name) for t in tasks for m in methods}


PREDICTION = ("tokens", "pred", "nll", "scored_tokens", "stats", "batch_size")


@pytest.mark.parametrize("decode_tail,batch_size", [(0, 1), (0, 2), (8, 2)])
def test_runner_predictions_are_the_same_with_and_without_sharing(tokenizer, model, tmp_path, decode_tail,
                                                                  batch_size):
    tasks = runner_task(tokenizer)
    batches = 2 if batch_size == 2 else 3  # sample 1 stops at a newline: a batch of its own
    calls = []
    handle = model.register_forward_pre_hook(lambda _m, _a, kw: calls.append(kw["input_ids"].shape[1]),
                                             with_kwargs=True)
    try:
        runs = {}
        for share in (False, True):
            methods, counting = runner_methods(model)
            calls.clear()
            run_tasks(model, tokenizer, tasks, methods, tmp_path / str(share), decode_tail=decode_tail,
                      progress=False, batch_size=batch_size, share_prefill=share)
            runs[share] = stored(tmp_path / str(share), tasks, methods), list(calls)
            assert len(counting) == batches + 1  # one cache per batch, sharing or not
    finally:
        handle.remove()
    (plain, plain_calls), (shared, shared_calls) = runs[False], runs[True]
    for key, records in plain.items():
        assert set(records) == set(shared[key])
        for sample_id, record in records.items():
            other = shared[key][sample_id]
            assert {k: record.get(k) for k in PREDICTION} == {k: other.get(k) for k in PREDICTION}, (key, sample_id)
            assert "prefill_seconds" not in record and other["prefill_seconds"] >= 0 and other["seconds"] >= 0
    prefill_length = 70 - decode_tail if decode_tail else 70
    assert plain_calls.count(prefill_length) == 4 * batches and shared_calls.count(prefill_length) == batches
    assert plain_calls.count(40) == 4 and shared_calls.count(40) == 1  # the perplexity prefill
    assert set(shared_calls) == {prefill_length, 40, 1}  # every method's own forwards are single tokens


def test_runner_shares_a_prefill_among_the_methods_that_lack_the_same_samples(tokenizer, model, tmp_path):
    ids = prompt_ids(tokenizer, 120)
    samples = [Sample(id=str(i), input_ids=ids[i:i + 50], max_new_tokens=4) for i in range(2)]
    methods = [DenseMethod(model), FlexiCacheMethod(model, {"token_budget": 32, "page_size": 8}),
               OracleMethod(model, 32, 8)]
    done = {"dense": {"0"}, methods[1].name: set(), "oracle@32": set()}
    groups = pending_groups(samples, methods, done)
    assert [([s.id for s in todo], [m.name for m in group]) for todo, group in groups] == [
        (["1"], ["dense"]), (["0", "1"], ["flexicache@32", "oracle@32"])]
    assert pending_groups(samples, methods, {m.name: {"0", "1"} for m in methods}) == []

    task = Task("gen", samples, metric=LengthMetric())
    run_tasks(model, tokenizer, [task], methods[:1], tmp_path, progress=False, batch_size=2)
    path = PredictionStore(tmp_path).path("gen", "dense")
    path.write_text(path.read_text().splitlines()[0] + "\n")  # the first sample only, as after an interruption
    _, forwards = counting_forwards(model, lambda: run_tasks(model, tokenizer, [task], methods, tmp_path,
                                                             progress=False, batch_size=2))
    store = PredictionStore(tmp_path)
    dense, sparse, oracle = (store.load("gen", m.name) for m in methods)
    assert dense["1"]["batch_size"] == 1 and sparse["0"]["batch_size"] == oracle["1"]["batch_size"] == 2
    assert sparse["0"]["prefill_seconds"] == oracle["0"]["prefill_seconds"]  # one prefill for the two
    assert forwards == 2 + 3 * 3  # two prefills, then three new tokens per method


def test_runner_runs_each_methods_own_prefill_where_it_cannot_be_shared(tokenizer, tmp_path):
    config = tiny_config("mistral", sliding_window=16, num_layers=2, vocab_size=len(tokenizer))
    model = tiny_model(config)
    task = Task("gen", [Sample(id="0", input_ids=prompt_ids(tokenizer, 60)[:40], max_new_tokens=4)],
                metric=LengthMetric())
    run_tasks(model, tokenizer, [task], [DenseMethod(model), Method("copy", lambda: DynamicCache(config=config))],
              tmp_path, progress=False)
    records = PredictionStore(tmp_path)
    dense, copy = records.load("gen", "dense")["0"], records.load("gen", "copy")["0"]
    assert "prefill_seconds" not in dense and "prefill_seconds" not in copy and dense["tokens"] == copy["tokens"]


def test_cli_no_shared_prefill_gives_the_same_predictions(tmp_path):
    from flexicache.evaluation.cli import main as eval_main

    folder = save_tiny_model(tmp_path / "model")
    outs = {}
    for flag in ([], ["--no-shared-prefill"]):
        out = tmp_path / ("plain" if flag else "shared")
        assert eval_main(["--model", str(folder), "--out", str(out), "--no-progress", "--device", "cpu", "--suite",
                          "synthetic", "--tasks", "passkey", "--lengths", "256", "--limit", "2", "--max-new-tokens",
                          "4", "--budget", "64", "--oracle", *flag]) == 0
        outs[bool(flag)] = out
    for method in ("dense", "oracle@64", "flexicache@64"):
        plain, shared = (PredictionStore(outs[flag]).load("passkey_256", method) for flag in (True, False))
        assert {i: r["tokens"] for i, r in plain.items()} == {i: r["tokens"] for i, r in shared.items()}
        assert all("prefill_seconds" in r for r in shared.values())
        assert not any("prefill_seconds" in r for r in plain.values())
    assert json.loads((outs[True] / "config.json").read_text())["no_shared_prefill"] is True
