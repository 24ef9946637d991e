"""FlexiCache under the usual transformers entry points: ``pipeline("text-generation")`` with the cache in the generate
kwargs, sampling with ``num_return_sequences``, ``TextStreamer``, stop strings and left-padded batches, each checked
against ``DynamicCache`` at a budget that covers the context (same tokens) and run at a sparse budget.

The slow test at the end runs this file and the harness's generation tests again under the oldest supported
transformers (5.17, from PyPI), which takes the cache as ``past_key_values=`` only.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
from pathlib import Path

import pytest
import torch
import transformers
from test_eval_harness import train_tiny_tokenizer
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM, TextStreamer, pipeline

from flexicache import FlexiCache, HeadProfile
from flexicache.models import cache_keyword

REPO = Path(__file__).resolve().parents[1]
OLDEST_TRANSFORMERS = "5.17"
COVERING = 1024  # tokens: more than any prompt + generation here, so FlexiCache attends to everything
# the harness's generation through model.generate, against a plain forward loop and DynamicCache
HARNESS_TESTS = [f"tests/test_eval_harness.py::{name}" for name in (
    "test_generate_matches_the_forward_loop_and_plain_generate", "test_stop_tokens_and_min_new_tokens",
    "test_stop_strings_end_generation_where_the_text_holds_them",
    "test_batch_of_equal_length_prompts_matches_each_prompt_alone", "test_decode_tail_feeds_tokens_one_by_one",
    "test_flexicache_with_full_budget_equals_dense", "test_cli_flexicache_sparse_budget")]
PROMPTS = ["The rain in Spain stays mainly in the plain. " * 6, "A quick brown fox jumps over the lazy dog; " * 4]


@pytest.fixture(scope="module")
def tokenizer():
    tokenizer = train_tiny_tokenizer()
    tokenizer.pad_token, tokenizer.padding_side = tokenizer.eos_token, "left"
    return tokenizer


@pytest.fixture(scope="module")
def model(tokenizer):
    """A tiny random Llama in float64 (exact comparisons), with the flexicache attention."""
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=len(tokenizer), hidden_size=64, intermediate_size=96, num_hidden_layers=2,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=16, max_position_embeddings=2048,
                         bos_token_id=tokenizer.bos_token_id, eos_token_id=tokenizer.eos_token_id,
                         pad_token_id=tokenizer.pad_token_id)
    model = LlamaForCausalLM(config).eval().to(torch.float64)
    model.set_attn_implementation("flexicache")
    return model


def sparse_cache(model) -> FlexiCache:
    """A 32-token budget (2 pages of 16) with one unstable head per layer, so the others use the host tier."""
    profile = HeadProfile(num_layers=2, num_kv_heads=2, head_dim=16, unstable_heads=[(0, 0), (1, 1)])
    return FlexiCache.from_model(model, profile=profile, token_budget=32, page_size=16)


def cache_kwargs(model, cache) -> dict:
    """The cache as generate takes it: ``cache=`` from transformers 5.24, ``past_key_values=`` before."""
    return {cache_keyword(model): cache}


def test_runs_the_transformers_it_is_meant_to():
    """Under the oldest-version run, this process really imports that version (not the newest)."""
    expected = os.environ.get("FLEXICACHE_EXPECT_TRANSFORMERS")
    if expected:
        assert transformers.__version__.startswith(expected + "."), transformers.__version__
    major, minor = map(int, transformers.__version__.split(".")[:2])
    assert (major, minor) >= (5, 17) and major < 6  # the range pyproject.toml declares


def test_cache_keyword_follows_the_version(model):
    major, minor = map(int, transformers.__version__.split(".")[:2])
    assert cache_keyword(model) == ("cache" if (major, minor) >= (5, 24) else "past_key_values")


def test_left_padded_batch_equals_dynamic_cache(model, tokenizer):
    inputs = tokenizer(PROMPTS, return_tensors="pt", padding=True)
    assert (inputs.attention_mask == 0).any()  # the shorter prompt is left-padded
    settings = {"max_new_tokens": 24, "do_sample": False}
    dense = model.generate(**inputs, **settings, past_key_values=DynamicCache(config=model.config))
    flexi = FlexiCache.from_model(model, token_budget=COVERING)
    assert torch.equal(model.generate(**inputs, **settings, past_key_values=flexi), dense)
    assert flexi.stats()["decode_steps"] == 23
    sparse = sparse_cache(model)
    out = model.generate(**inputs, **settings, **cache_kwargs(model, sparse))
    assert out.shape == dense.shape and sparse.stats()["device_kv_bytes"] < sparse.stats()["dense_kv_bytes"]


def test_pipeline_takes_the_cache_through_generate_kwargs(model, tokenizer):
    generator = pipeline("text-generation", model=model, tokenizer=tokenizer)
    settings = {"max_new_tokens": 16, "do_sample": False, "return_full_text": False}
    dense = generator(PROMPTS[0], **settings, **cache_kwargs(model, DynamicCache(config=model.config)))
    flexi = FlexiCache.from_model(model, token_budget=COVERING)
    assert generator(PROMPTS[0], **settings, **cache_kwargs(model, flexi)) == dense
    assert flexi.stats()["decode_steps"] == 15  # the pipeline's generate really used this cache
    # a list of prompts in one batch: one generate call, so one fresh cache serves it (left padding inside)
    batch = FlexiCache.from_model(model, token_budget=COVERING)
    both = generator(PROMPTS, batch_size=2, **settings, **cache_kwargs(model, batch))
    alone = [generator(p, **settings, **cache_kwargs(model, DynamicCache(config=model.config))) for p in PROMPTS]
    assert both == alone
    sparse = sparse_cache(model)
    (answer,) = generator(PROMPTS[0], **settings, **cache_kwargs(model, sparse))
    assert isinstance(answer["generated_text"], str) and sparse.stats()["host_kv_bytes"] > 0


def test_sampling_with_several_return_sequences(model, tokenizer):
    inputs = tokenizer(PROMPTS[:1], return_tensors="pt")
    settings = {"max_new_tokens": 20, "do_sample": True, "temperature": 1.5, "top_k": 0, "num_return_sequences": 3}

    def sample(cache) -> torch.Tensor:
        torch.manual_seed(7)
        return model.generate(**inputs, **settings, **cache_kwargs(model, cache))

    dense = sample(DynamicCache(config=model.config))
    assert dense.shape[0] == 3 and len({tuple(row.tolist()) for row in dense}) == 3  # three different samples
    flexi = FlexiCache.from_model(model, token_budget=COVERING)
    assert torch.equal(sample(flexi), dense)
    sparse = sparse_cache(model)
    assert sample(sparse).shape == dense.shape
    one = sparse_cache(model)
    torch.manual_seed(7)
    model.generate(**inputs, **{**settings, "num_return_sequences": 1}, **cache_kwargs(model, one))
    assert sparse.stats()["dense_kv_bytes"] == 3 * one.stats()["dense_kv_bytes"]  # the cache holds three rows


def test_text_streamer_prints_what_generate_returns(model, tokenizer, capsys):
    inputs = tokenizer(PROMPTS[:1], return_tensors="pt")
    streamer = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    out = model.generate(**inputs, max_new_tokens=20, do_sample=False, streamer=streamer,
                         **cache_kwargs(model, sparse_cache(model)))
    printed = capsys.readouterr().out
    assert printed.rstrip("\n") == tokenizer.decode(out[0, inputs.input_ids.shape[1]:], skip_special_tokens=True)


def test_stop_strings_end_generation_like_dynamic_cache(model, tokenizer):
    inputs = tokenizer(PROMPTS[:1], return_tensors="pt")
    length = inputs.input_ids.shape[1]
    free = model.generate(**inputs, max_new_tokens=24, do_sample=False,
                          past_key_values=DynamicCache(config=model.config))
    text = tokenizer.decode(free[0, length:])
    stop = re.search(r"[A-Za-z]{2}", text[4:]).group()  # two letters, completed after the first token at least
    settings = {"max_new_tokens": 24, "do_sample": False, "stop_strings": [stop], "tokenizer": tokenizer}
    dense = model.generate(**inputs, **settings, past_key_values=DynamicCache(config=model.config))
    flexi = model.generate(**inputs, **settings,
                           **cache_kwargs(model, FlexiCache.from_model(model, token_budget=COVERING)))
    assert torch.equal(flexi, dense) and dense.shape[1] < free.shape[1]
    assert stop in tokenizer.decode(dense[0, length:]) and stop not in tokenizer.decode(dense[0, length:-1])


@pytest.mark.slow
def test_oldest_supported_transformers(tmp_path):
    """This file and the harness's generation tests under transformers 5.17 (installed from PyPI into a folder that
    goes first on the path; torch and the rest come from this environment). Needs PyPI access."""
    site = tmp_path / "site"
    install = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--disable-pip-version-check", "--target",
                              str(site), f"transformers=={OLDEST_TRANSFORMERS}.*"],
                             capture_output=True, text=True, timeout=600, check=False)
    assert install.returncode == 0, f"pip could not fetch transformers {OLDEST_TRANSFORMERS} from PyPI:\n" + \
        install.stderr[-2000:]
    env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(site), str(REPO / "src")]),
               FLEXICACHE_EXPECT_TRANSFORMERS=OLDEST_TRANSFORMERS, OMP_NUM_THREADS="1")
    run = subprocess.run([sys.executable, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-m", "not slow and not gpu",
                          "tests/test_transformers_conventions.py", *HARNESS_TESTS],
                         cwd=REPO, env=env, capture_output=True, text=True, timeout=900, check=False)
    assert run.returncode == 0, run.stdout[-4000:] + run.stderr[-2000:]
    assert " passed" in run.stdout and "skipped" not in run.stdout.splitlines()[-1], run.stdout[-1000:]
