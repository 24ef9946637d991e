"""Head profiles and the profiler on models that mix layer types: they cover the full-attention (sparse paged) layers
only, named by their model layer index."""

from __future__ import annotations

import json

import pytest
import torch
from hybrid_models import family_model
from test_profiling_data import char_tokenizer
from transformers import AutoConfig, DynamicCache, Gemma3ForCausalLM

from flexicache import FlexiCache, FlexiLayer, HeadProfile
from flexicache.cli import main
from flexicache.profiling import ClassifySettings, build_profile
from flexicache.profiling.measure import MeasureSettings, select_by_quest, trace_batch
from flexicache.profiling.pages import page_bounds
from flexicache.profiling.probe import QueryRecorder, probing

PNG_MAGIC = b"\x89PNG\r\n\x1a\n"


def test_trace_records_the_full_attention_layers_by_their_index():
    """Gemma 3 (layers 2 and 5 full attention): the trace's rows are those layers, and the first step's pages are
    the top-K of each one's own keys and query (read here from a DynamicCache and the probe)."""
    model = family_model("gemma3", seed=1)
    prompt = torch.randint(2, 97, (1, 50), generator=torch.Generator().manual_seed(3))
    settings = MeasureSettings(token_budget=24, page_size=8, steps=6, online_window=8)
    trace = trace_batch(model, prompt, settings)[0]
    assert trace.pages.shape == (6, 2, 2, settings.k) and trace.prompt_estimate.shape == (2, 2)

    cache, recorder = DynamicCache(config=model.config), QueryRecorder()
    with probing(model, recorder), torch.inference_mode():
        logits = model(input_ids=prompt, past_key_values=cache, use_cache=True).logits[:, -1]
        model(input_ids=logits.argmax(-1, keepdim=True), past_key_values=cache, use_cache=True)
        queries = recorder.pop()
    for row, layer in enumerate((2, 5)):
        keys = cache.layers[layer].keys  # a full-attention layer: every key
        assert keys.shape[2] == 51
        expected = select_by_quest(queries[layer][:, :, 0], *page_bounds(keys, 8), settings.k)
        assert torch.equal(trace.pages[0, row, :, : expected.shape[-1]].long(), expected[0].long()), layer
    assert not torch.equal(trace.pages[:, 0], trace.pages[:, 1])  # two layers, two sets


def test_built_profile_names_model_layers_and_serves_a_cache(tmp_path):
    model = family_model("gemma3", seed=2)
    settings = MeasureSettings(token_budget=16, page_size=8, steps=20, online_window=8)
    generator = torch.Generator().manual_seed(4)
    traces = [trace for seed in range(2)
              for trace in trace_batch(model, torch.randint(2, 97, (1, 48 + seed), generator=generator), settings,
                                       tasks=[f"t{seed}"])]
    profile = build_profile(model.config, traces, settings, ClassifySettings(fraction=0.5))
    assert profile.sparse_layers == [2, 5] and len(profile.unstable_heads) == 2  # half of 2 layers x 2 heads
    assert {layer for layer, _ in profile.unstable_heads} <= {2, 5}
    assert [row is None for row in profile.scores] == [True, True, False, True, True, False]
    counts = profile.calibration["bottom_quantile_counts"]
    assert counts[0] is None and len(counts[2]) == 2
    assert all(layer in (2, 5) for layer, _ in profile.calibration["unstable_order"])
    assert set(profile.calibration["reports"]["online_estimate"]) >= {"per_request_overlap", "random_baseline"}
    profile.save(tmp_path / "p.json")
    loaded = HeadProfile.load(tmp_path / "p.json")
    cache = FlexiCache.from_model(model, profile=loaded, token_budget=16, page_size=8)
    assert [cache.layers[layer].unstable_heads for layer in (2, 5)] == [
        loaded.unstable_heads_of(2), loaded.unstable_heads_of(5)]

    from flexicache.profiling.plots import plot_profile

    for path in plot_profile(loaded, tmp_path / "plots", "gemma3"):
        assert path.read_bytes()[:8] == PNG_MAGIC


def test_cli_profiles_a_hybrid_model(tmp_path, capsys):
    folder = tmp_path / "tiny-gemma3"
    tokenizer = char_tokenizer()
    tokenizer.save_pretrained(folder)
    model = family_model("gemma3", seed=0)
    model.config.vocab_size = len(tokenizer)
    Gemma3ForCausalLM(model.config).save_pretrained(folder)
    out = tmp_path / "gemma3.json"
    argv = ["profile", "--model", str(folder), "--data", "synthetic:passkey", "synthetic:docs",
            "--samples-per-task", "1", "--prompt-tokens", "96", "--steps", "24", "--budget", "32", "--fraction", "0.5",
            "--online-window", "8", "--out", str(out), "--no-progress"]
    assert main(argv) == 0
    assert "2 of 4 heads unstable" in capsys.readouterr().out  # of the full-attention layers' heads
    profile = HeadProfile.load(out)
    profile.validate_for(AutoConfig.from_pretrained(folder))
    assert profile.sparse_layers == [2, 5] and json.loads(out.read_text())["sparse_layers"] == [2, 5]
    assert profile.model_info["model_type"] == "gemma3_text"
def test_default_profile_covers_the_full_attention_layers():
    model = family_model("gemma3")
    profile = HeadProfile.default(model.config, unstable_layers=1)
    assert profile.sparse_layers == [2, 5] and profile.covered_layers() == [2, 5]
    assert profile.unstable_heads == [(2, 0), (2, 1)]
    assert "full-attention layers" in profile.calibration["source"]
    cache = FlexiCache.from_model(model, profile="default", token_budget=16, page_size=8)
    assert cache.profile.sparse_layers == [2, 5]
    assert [layer.unstable_heads for layer in cache.layers if isinstance(layer, FlexiLayer)] == [[0, 1], [0, 1]]
    full_attention = HeadProfile.default(family_model("phi3-long").config)
    assert full_attention.sparse_layers is None and "sparse_layers" not in full_attention.to_dict()


def test_profile_validation_against_layer_types(tmp_path):
    config = family_model("gemma3").config
    profile = HeadProfile(6, 2, 16, [(5, 1)], sparse_layers=[2, 5], scores=[None, None, [0.5, 0.4], None, None,
                                                                            [0.3, 0.2]])
    profile.validate_for(config)
    profile.save(tmp_path / "p.json")
    assert HeadProfile.load(tmp_path / "p.json") == profile
    assert torch.isnan(profile.score_matrix()[0]).all() and profile.score_matrix()[5].tolist() == [0.3, 0.2]
    with pytest.raises(ValueError, match="layers \\[3\\] are sliding-window layers"):
        HeadProfile(6, 2, 16, [(3, 0)]).validate_for(config)  # a full-attention model's profile of the same shape
    with pytest.raises(ValueError, match="covers the full-attention layers \\[0, 5\\]"):
        HeadProfile(6, 2, 16, [], sparse_layers=[0, 5]).validate_for(config)
    with pytest.raises(ValueError, match="does not cover"):
        HeadProfile(6, 2, 16, [(1, 0)], sparse_layers=[2, 5])
    with pytest.raises(ValueError, match="flexicache profile"):
        FlexiCache(config, profile=HeadProfile(6, 2, 16, [(3, 0)]))


def test_shard_profile_keeps_the_covered_layers():
    from flexicache.parallel import shard_config, shard_profile

    profile = HeadProfile(6, 2, 16, [(2, 1), (5, 0)], sparse_layers=[2, 5],
                          scores=[None, None, [0.5, 0.4], None, None, [0.3, 0.2]])
    shard = shard_profile(profile, 1, 2)
    assert shard.sparse_layers == [2, 5] and shard.unstable_heads == [(2, 0)]
    assert shard.scores == [None, None, [0.4], None, None, [0.2]]
    config = shard_config(family_model("gemma3").config, 2)
    FlexiCache(config, profile=shard, token_budget=16, page_size=8)  # validates against the local config


