"""Models that mix layer types: full-attention layers are FlexiCache's sparse paged layers, sliding-window and chunked
layers keep exactly their window, and one FlexiCache serves the whole model through ``generate``.

Tiny random models of every family (fp64): with a budget covering the context the tokens and logits equal
DynamicCache's; with a small budget the device holds less KV than DynamicCache while the sliding layers hold the same
windows; features FlexiCache cannot compute are refused per feature.
"""

from __future__ import annotations

import warnings

import pytest
import torch
from conftest import FakeAttention, checked, dynamic_cache_bytes, greedy, left_pad, random_prompt
from hybrid_models import COMMON, EXPECTED_SPARSE, FAMILIES, HYBRID, WINDOW, family_model, stable_profile
from transformers import DeepseekV3Config, DynamicCache, Gemma2Config, GptOssConfig, Qwen3NextConfig, T5Config
from transformers.cache_utils import DynamicSlidingWindowLayer

from flexicache import FlexiCache, FlexiLayer, attention, warn_once
from flexicache.hybrid import layer_kinds, sparse_layers
from flexicache.parallel import BYTE_KEYS, kv_bytes_by_device
from flexicache.sliding import SlidingWindowLayer
from flexicache.step_graph import HYBRID_REFUSAL


def prompts() -> tuple[torch.Tensor, torch.Tensor]:
    """A left-padded batch of 41 and 27 tokens: both longer than the window."""
    return left_pad([random_prompt(41, seed=1), random_prompt(27, seed=2)])


def new_cache(model, **settings) -> FlexiCache:
    with warnings.catch_warnings():
        warnings.filterwarnings("ignore", "This model has no full-attention layer", UserWarning)
        return FlexiCache.from_model(model, **settings)


@pytest.mark.parametrize("family", list(FAMILIES))
def test_layers_follow_the_layer_types(family):
    model = family_model(family)
    cache = new_cache(model, token_budget=32, page_size=8)
    assert cache.sparse_layer_indices == EXPECTED_SPARSE[family] == sparse_layers(model.config)
    dense = DynamicCache(config=model.config)
    for index, (layer, kind) in enumerate(zip(cache.layers, layer_kinds(model.config), strict=True)):
        assert isinstance(layer, FlexiLayer) == kind.sparse
        if not kind.sparse:
            assert isinstance(layer, SlidingWindowLayer) and layer.sliding_window == kind.window == WINDOW
            assert isinstance(dense.layers[index], DynamicSlidingWindowLayer)
    assert cache.is_sliding == [not kind.sparse for kind in layer_kinds(model.config)]
    assert cache.step_graphs.layers == [layer for layer in cache.layers if isinstance(layer, FlexiLayer)]


@pytest.mark.parametrize("family", list(FAMILIES))
def test_budget_covering_context_matches_dynamic_cache(family):
    """Left-padded batch, contexts past the window: the tokens and every step's logits equal DynamicCache's."""
    model = family_model(family, seed=3)
    ids, mask = prompts()
    new_tokens = 23  # 41 + 23 = 64 tokens = 8 pages of 8
    reference = model.generate(ids, attention_mask=mask, past_key_values=DynamicCache(config=model.config),
                               max_new_tokens=new_tokens, do_sample=False, return_dict_in_generate=True,
                               output_logits=True)
    cache = checked(new_cache(model, token_budget=64, page_size=8, rerank_interval=4))
    ours = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=new_tokens,
                          do_sample=False, return_dict_in_generate=True, output_logits=True)
    assert torch.equal(ours.sequences, reference.sequences)
    for step, (mine, theirs) in enumerate(zip(ours.logits, reference.logits, strict=True)):
        torch.testing.assert_close(mine, theirs, rtol=0, atol=1e-10, msg=f"decode step {step}")
    sparse = len(EXPECTED_SPARSE[family])
    assert cache.backends[torch.device("cpu")].calls == (new_tokens - 1) * sparse
    assert cache.stats()["decode_steps"] == (new_tokens - 1 if sparse else 0)
    assert cache.get_seq_length() == ids.shape[1] + new_tokens - 1


@pytest.mark.parametrize("family", HYBRID + ["phi3-long"])
def test_small_budget_holds_less_device_kv_and_the_same_windows(family):
    model = family_model(family, seed=5)
    ids, mask = prompts()
    dense = DynamicCache(config=model.config)
    greedy(model, ids, dense, mask, 24)
    # no standby pages: the stable heads hold the budget's 2 pages alone (K standby pages would double that)
    cache = FlexiCache.from_model(model, profile=stable_profile(model.config), token_budget=16, page_size=8,
                                  rerank_interval=4, standby_pages=0)
    received = {}  # what each sliding layer's update was given, [B, H, T, D] per call
    for layer in cache.layers:
        if isinstance(layer, SlidingWindowLayer):
            received[layer.layer_idx] = []
            layer.update = recording_update(layer.update, received[layer.layer_idx])
    greedy(model, ids, cache, mask, 24)
    stats = cache.stats()
    assert stats["dense_kv_bytes"] == dynamic_cache_bytes(dense)  # the same shapes, whatever the tokens
    assert stats["device_kv_bytes"] < 0.7 * stats["dense_kv_bytes"]
    assert stats["host_kv_bytes"] > 0 and stats["reranks_stable"] > 0
    windows = [(cache.layers[index], dense.layers[index]) for index in received]
    assert stats.get("sliding_kv_bytes", 0) == sum(theirs.keys.nbytes + theirs.values.nbytes for _, theirs in windows)
    for ours, theirs in windows:  # each sliding layer holds exactly the last window - 1 tokens it was given
        keys = torch.cat([keys for keys, _ in received[ours.layer_idx]], dim=2)
        values = torch.cat([values for _, values in received[ours.layer_idx]], dim=2)
        assert ours.keys.shape == theirs.keys.shape and ours.keys.shape[2] == WINDOW - 1
        assert torch.equal(ours.keys, keys[:, :, -(WINDOW - 1):]) and torch.equal(ours.values, values[:, :, -(WINDOW - 1):])
        assert ours.get_mask_sizes(1) == theirs.get_mask_sizes(1)
    assert kv_bytes_by_device(cache) == {"cpu": {key: stats[key] for key in BYTE_KEYS}}


def recording_update(update, calls: list):
    """``update`` that also appends its ``(key_states, value_states)`` to ``calls``."""
    def recorded(key_states, value_states, *args, **kwargs):
        calls.append((key_states, value_states))
        return update(key_states, value_states, *args, **kwargs)
    return recorded


def test_model_without_full_attention_layers_warns_and_holds_dynamic_cache_windows():
    model = family_model("mistral", seed=2)
    with pytest.warns(UserWarning, match="no full-attention layer .* saves nothing"):
        cache = FlexiCache.from_model(model, token_budget=16, page_size=8)
    ids, mask = prompts()
    dense = DynamicCache(config=model.config)
    assert torch.equal(greedy(model, ids, cache, mask, 20), greedy(model, ids, dense, mask, 20))
    stats = cache.stats()
    assert stats["device_kv_bytes"] == stats["dense_kv_bytes"] == stats["sliding_kv_bytes"] == dynamic_cache_bytes(dense)
    assert stats["host_kv_bytes"] == 0 and stats["decode_steps"] == 0 and stats["backend"] is None


def test_dense_chunks_do_not_warn_of_a_decode_without_flexicache(monkeypatch):
    monkeypatch.setattr(warn_once, "GIVEN", set())
    model = family_model("gemma3")
    ids, mask = prompts()
    with warnings.catch_warnings():
        warnings.filterwarnings("error", "The model runs the \"flexicache\" attention, but no FlexiCache")
        greedy(model, ids, FlexiCache.from_model(model, token_budget=16, page_size=8), mask, 6)
    with pytest.warns(UserWarning, match="no FlexiCache was passed"):  # the warning itself still works
        greedy(model, ids, DynamicCache(config=model.config), mask, 3)


def test_hybrid_model_on_another_attention_is_caught():
    model = family_model("gemma3", attn_implementation="sdpa")
    cache = FlexiCache(model.config, token_budget=16, page_size=8)
    ids, mask = prompts()
    with pytest.raises(RuntimeError, match="did not run through the flexicache attention"):
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)


@pytest.mark.parametrize("kwargs,feature", [({"softcap": 50.0}, "softcapping"), ({"s_aux": torch.zeros(4)}, "sinks"),
                                            ({"sinks": torch.zeros(4)}, "sinks")])
@pytest.mark.parametrize("layer_idx", [0, 2])  # a sliding layer (sdpa would silently drop sinks), a sparse layer
def test_attention_refuses_features_per_layer(kwargs, feature, layer_idx):
    config = family_model("gemma3").config
    cache = FlexiCache(config, token_budget=16, page_size=8)
    keys = torch.randn(1, 2, 5, 16, dtype=torch.float64)
    full_keys, full_values = cache.update(keys, keys, layer_idx)
    query = torch.randn(1, 4, 5, 16, dtype=torch.float64)
    with pytest.raises(NotImplementedError, match=feature):
        attention.flexicache_attention_forward(FakeAttention(layer_idx, 2), query, full_keys, full_values, None,
                                               scaling=0.25, **kwargs)


def test_sliding_window_served_as_full_attention_refuses_past_its_window():
    """phi3-long's window covers max_position_embeddings; a sequence past the window (beyond the model's range) is
    refused rather than attended past the window."""
    make_config, model_class = FAMILIES["phi3-long"]
    config = make_config()
    config.sliding_window = 40
    config.max_position_embeddings = 40
    torch.manual_seed(0)
    model = model_class(config).eval().to(torch.float64)
    model.generation_config.pad_token_id, model.generation_config.eos_token_id = 0, None
    cache = FlexiCache.from_model(model, token_budget=64, page_size=8)
    assert cache.sparse_layer_indices == [0, 1, 2] and cache.step_graphs.max_length == 40
    ids = random_prompt(30, seed=1).view(1, -1)
    dense = greedy(model, ids, DynamicCache(config=model.config), None, 11)  # 30 + 10 = 40 positions: the window
    assert torch.equal(greedy(model, ids, cache, None, 11), dense)
    with pytest.raises(ValueError, match="window 40.*reached 41 positions"):
        greedy(model, ids, FlexiCache.from_model(model, token_budget=64, page_size=8), None, 12)


def test_step_graphs_refuse_hybrid_caches():
    model = family_model("gemma3")
    cache = FlexiCache.from_model(model, token_budget=16, page_size=8)
    assert cache.step_graphs.refusal == cache.step_graphs.eager_reason == HYBRID_REFUSAL
    ids, mask = prompts()
    greedy(model, ids, cache, mask, 4)
    assert not cache.step_graphs.ready() and cache.stats()["step_graph_captures"] == 0
    full = FlexiCache.from_model(family_model("phi3-long"), token_budget=16, page_size=8)
    assert full.step_graphs.refusal is None and full.step_graphs.eager_reason is None


def test_step_graph_store_stops_at_the_covering_window():
    """ready() turns False once the next step would pass ``max_length`` (the eager step then checks the window)."""
    from flexicache.sequence import SequenceState
    from flexicache.step_graph import StepGraphStore

    class Layer:
        device = torch.device("cuda")  # never touched: only compared
        recording = False

        def graphed_step_ready(self, next_pages: int) -> bool:
            return True

    sequence = SequenceState(page_size=8)
    store = StepGraphStore([Layer()], sequence, enabled=True, max_length=12)
    sequence.plan_chunk(0, None, 1, 11, torch.device("cpu"))
    assert store.ready()  # 11 positions, the next step makes 12
    sequence.plan_chunk(1, None, 1, 1, torch.device("cpu"), decode=True)
    assert not store.ready()


def test_a_crop_the_sliding_layers_refuse_changes_nothing():
    """Past its window a sliding layer without past recording cannot roll back (transformers refuses): the crop is
    refused before any layer or length changes, and the cache decodes on."""
    model = family_model("qwen2")
    ids, mask = prompts()
    cache = FlexiCache.from_model(model, token_budget=16, page_size=8)
    sequences = greedy(model, ids, cache, mask, 4)
    length = cache.get_seq_length()
    assert length > WINDOW
    with pytest.raises(RuntimeError, match="activate_past_recording"):
        cache.crop(-3)
    assert cache.get_seq_length() == length and all(layer.get_seq_length() == length for layer in cache.layers)
    with torch.inference_mode():
        model(input_ids=sequences[:, -1:], past_key_values=cache)
    assert cache.get_seq_length() == length + 1


def test_close_frees_sliding_layers_and_refuses_later_use():
    model = family_model("qwen2")
    ids, mask = prompts()
    cache = FlexiCache.from_model(model, token_budget=16, page_size=8)
    greedy(model, ids, cache, mask, 4)
    sliding = cache.layers[2]
    assert isinstance(sliding, SlidingWindowLayer) and sliding.stats()["device_kv_bytes"] > 0
    cache.close()
    assert sliding.keys is None and sliding.stats() == {}
    with pytest.raises(RuntimeError, match="closed"):
        sliding.update(torch.zeros(2, 2, 1, 8), torch.zeros(2, 2, 1, 8))
    with pytest.raises(RuntimeError, match="closed"):
        cache.stats()


def test_another_batch_without_reset_is_refused_by_a_sliding_layer_too():
    model = family_model("gemma3")  # layer 0 is a sliding-window layer
    ids, mask = prompts()
    cache = FlexiCache.from_model(model, token_budget=16, page_size=8)
    model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    with pytest.raises(ValueError, match="holds a batch of 2 requests, got 1: call cache.reset"):
        model(input_ids=ids[:1, -5:], past_key_values=cache)


def test_reset_clears_sliding_layers_for_the_next_batch():
    model = family_model("gemma2")
    ids, mask = prompts()
    cache = FlexiCache.from_model(model, token_budget=64, page_size=8)
    first = greedy(model, ids, cache, mask, 10)
    cache.reset()
    assert cache.get_seq_length() == 0 and all(layer.stats() == {} for layer in cache.layers)
    assert torch.equal(greedy(model, ids, cache, mask, 10), first)


@pytest.mark.parametrize("config,match", [
    (Gemma2Config(num_hidden_layers=2, **COMMON), "attn_logit_softcapping=50.0.*DynamicCache"),
    (GptOssConfig(num_hidden_layers=2, num_local_experts=2, **COMMON), "gpt_oss.*attention-sink"),
    (Qwen3NextConfig(num_hidden_layers=4, **COMMON), "linear_attention"),
    (DeepseekV3Config(num_hidden_layers=2), "multi-head latent attention"),
    (T5Config(), "encoder-decoder"),
], ids=["gemma2-softcap", "gpt-oss-sinks", "qwen3-next-linear", "deepseek-v3-mla", "t5-encoder-decoder"])
def test_refused_features(config, match):
    from flexicache.profiling.measure import tracing_cache

    with pytest.raises(ValueError, match=match):
        FlexiCache(config, token_budget=32, page_size=8)
    with pytest.raises(ValueError, match=match):  # the profiler refuses them alike
        tracing_cache(config)


def test_model_families_table_names_tests_that_exist():
    """Every row of README.md's "Model families" table names the tests that cover it, and they exist."""
    import ast
    import re
    from pathlib import Path

    root = Path(__file__).resolve().parents[1]
    section = (root / "README.md").read_text(encoding="utf-8").split("\n## Model families\n")[1].split("\n## ")[0]
    rows = [line for line in section.splitlines() if line.startswith("| ") and not line.startswith("| family")]
    assert len(rows) >= 10
    for row in rows:
        references = re.findall(r"`(tests/[\w/]+\.py)::(\w+)`", row.rsplit(" | ", 1)[-1])
        assert references, f"a row names no test: {row[:60]}"
        for path, name in references:
            tree = ast.parse((root / path).read_text(encoding="utf-8"))
            assert name in {node.name for node in tree.body if isinstance(node, ast.FunctionDef)}, (path, name)


@pytest.mark.parametrize("family", ["gemma3", "qwen2", "llama4", "mistral"])
def test_masks_for_the_flexicache_attention_match_sdpa_per_layer_type(family):
    """After the same prefill, every layer reports DynamicCache's mask sizes, and the masks transformers builds per
    layer type under the "flexicache" name (its sdpa mask function) are sdpa's with DynamicCache: the sliding ones
    over the window's keys, left padding included."""
    import transformers
    from transformers.masking_utils import create_masks_for_generate

    model = family_model(family)
    ids, mask = prompts()
    dense, cache = DynamicCache(config=model.config), new_cache(model, token_budget=16, page_size=8)
    with torch.inference_mode():
        model(input_ids=ids, attention_mask=mask, past_key_values=dense)
        model(input_ids=ids, attention_mask=mask, past_key_values=cache)
    layers = range(model.config.num_hidden_layers)
    assert [cache.get_mask_sizes(1, i) for i in layers] == [dense.get_mask_sizes(1, i) for i in layers]
    step = torch.cat([mask, torch.ones(2, 1, dtype=mask.dtype)], dim=1)
    embeds = torch.zeros(2, 1, model.config.hidden_size, dtype=torch.float64)
    position = torch.full((2, 1), ids.shape[1])
    sdpa_config = type(model.config).from_dict(model.config.to_dict())
    sdpa_config._attn_implementation = "sdpa"
    try:
        theirs = create_masks_for_generate(sdpa_config, embeds, step, dense, position)
    except TypeError as error:  # transformers 5.17 passes chunked masks an argument they do not take
        pytest.skip(f"transformers {transformers.__version__} builds no {family} masks with DynamicCache: {error}")
    ours = create_masks_for_generate(model.config, embeds, step, cache, position)
    assert type(ours) is type(theirs)
    for kind, expected in (theirs.items() if isinstance(theirs, dict) else [(None, theirs)]):
        got = ours[kind] if kind is not None else ours
        assert (got is None) == (expected is None), kind
        if expected is not None:
            assert torch.equal(got, expected), kind
            windowed = kind in ("sliding_attention", "chunked_attention") or family == "mistral"
            assert got.shape[-1] == (WINDOW if windowed else ids.shape[1] + 1), kind  # the window: W - 1 + 1 keys
