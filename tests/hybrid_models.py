"""Tiny random models of the families whose layers mix types (and two whose layers are all sliding), for the hybrid
tests: windows of 16 tokens, contexts of 40-64 tokens, fp64."""

from __future__ import annotations

import torch
from transformers import (
    Cohere2Config,
    Cohere2ForCausalLM,
    Gemma2Config,
    Gemma2ForCausalLM,
    Gemma3ForCausalLM,
    Gemma3TextConfig,
    Llama4ForCausalLM,
    Llama4TextConfig,
    MistralConfig,
    MistralForCausalLM,
    Phi3Config,
    Phi3ForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
    Qwen3Config,
    Qwen3ForCausalLM,
)

from flexicache import HeadProfile
from flexicache.hybrid import sparse_layers

WINDOW = 16
COMMON = {"vocab_size": 97, "hidden_size": 32, "intermediate_size": 48, "num_attention_heads": 4,
          "num_key_value_heads": 2, "max_position_embeddings": 2048, "initializer_range": 0.2, "pad_token_id": 0,
          "bos_token_id": 1, "eos_token_id": None, "tie_word_embeddings": False}
SLIDING, FULL = "sliding_attention", "full_attention"
# family: (config, model class); windows of 16 tokens, contexts of 40-64 tokens
FAMILIES = {
    # Gemma 2 without its logit softcap (refused with it, see test_refused_features); query_pre_attn_scalar != head_dim
    "gemma2": (lambda: Gemma2Config(num_hidden_layers=4, head_dim=16, sliding_window=WINDOW,
                                    attn_logit_softcapping=None, query_pre_attn_scalar=40, **COMMON),
               Gemma2ForCausalLM),
    "gemma3": (lambda: Gemma3TextConfig(num_hidden_layers=6, head_dim=16, sliding_window=WINDOW,
                                        layer_types=[SLIDING, SLIDING, FULL, SLIDING, SLIDING, FULL],
                                        query_pre_attn_scalar=40, **COMMON), Gemma3ForCausalLM),
    "qwen2": (lambda: Qwen2Config(num_hidden_layers=4, use_sliding_window=True, sliding_window=WINDOW,
                                  max_window_layers=2, **COMMON), Qwen2ForCausalLM),
    "qwen3": (lambda: Qwen3Config(num_hidden_layers=4, head_dim=8, use_sliding_window=True, sliding_window=WINDOW,
                                  max_window_layers=2, **COMMON), Qwen3ForCausalLM),
    "cohere2": (lambda: Cohere2Config(num_hidden_layers=4, sliding_window=WINDOW, **COMMON), Cohere2ForCausalLM),
    "llama4": (lambda: Llama4TextConfig(num_hidden_layers=4, head_dim=8, attention_chunk_size=WINDOW,
                                        intermediate_size_mlp=48, num_local_experts=2, num_experts_per_tok=1,
                                        interleave_moe_layer_step=2, no_rope_layer_interval=4, **COMMON),
               Llama4ForCausalLM),
    # every layer sliding: nothing to page
    "mistral": (lambda: MistralConfig(num_hidden_layers=3, head_dim=8, sliding_window=WINDOW, **COMMON),
                MistralForCausalLM),
    "phi3": (lambda: Phi3Config(num_hidden_layers=3, sliding_window=WINDOW, **COMMON), Phi3ForCausalLM),
    # Phi-3 128k: a window above max_position_embeddings is full attention for every sequence the model takes
    "phi3-long": (lambda: Phi3Config(num_hidden_layers=3, sliding_window=4096, **COMMON), Phi3ForCausalLM),
}
HYBRID = ["gemma2", "gemma3", "qwen2", "qwen3", "cohere2", "llama4"]
EXPECTED_SPARSE = {"gemma2": [1, 3], "gemma3": [2, 5], "qwen2": [0, 1], "qwen3": [0, 1], "cohere2": [3],
                   "llama4": [3], "mistral": [], "phi3": [], "phi3-long": [0, 1, 2]}


def family_model(family: str, seed: int = 0, attn_implementation: str = "flexicache"):
    """A random model of ``family`` on ``attn_implementation`` (the flexicache attention: sdpa without a FlexiCache,
    so a DynamicCache run is the sdpa reference; Gemma 2 would otherwise run eager, whose left-padded rows whose
    window holds only padding come out NaN)."""
    make_config, model_class = FAMILIES[family]
    torch.manual_seed(seed)
    config = make_config()
    config._attn_implementation = attn_implementation
    model = model_class(config).eval().to(torch.float64)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def stable_profile(config) -> HeadProfile:
    """Every head of the sparse layers stable (their KV in the host tier, K pages on the device)."""
    num_layers, num_kv = config.num_hidden_layers, config.num_key_value_heads
    head_dim = getattr(config, "head_dim", None) or config.hidden_size // config.num_attention_heads
    return HeadProfile(num_layers, num_kv, head_dim, [], sparse_layers=sparse_layers(config))
