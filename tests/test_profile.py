"""HeadProfile: JSON round trip, shape validation, default, from_pretrained resolution."""

from __future__ import annotations

import json

import pytest
import torch
from transformers import LlamaConfig

from flexicache.profile import HeadProfile, shipped_profiles


def _config(layers: int = 4, kv_heads: int = 2, heads: int = 4, head_dim: int = 16) -> LlamaConfig:
    return LlamaConfig(
        num_hidden_layers=layers, num_attention_heads=heads, num_key_value_heads=kv_heads, head_dim=head_dim,
        hidden_size=heads * head_dim, intermediate_size=32, vocab_size=32,
    )


def _profile() -> HeadProfile:
    return HeadProfile(
        num_layers=4, num_kv_heads=2, head_dim=16, unstable_heads=[(3, 1), (0, 0)], model="tiny",
        page_size=16, token_budget=128, unstable_fraction=0.25,
        scores=[[0.1, 0.9], [0.8, 0.7], [0.6, 0.5], [0.4, 0.2]],
        calibration={"command": "flexicache profile ...", "reports": {"x": [1, 2]}},
        model_info={"model_type": "llama"},
    )


def test_round_trip(tmp_path):
    profile = _profile()
    path = tmp_path / "p.json"
    profile.save(path)
    loaded = HeadProfile.load(path)
    assert loaded == profile
    assert loaded.unstable_heads == [(0, 0), (3, 1)]
    assert json.loads(path.read_text())["unstable_heads"] == [[0, 0], [3, 1]]


def test_masks():
    profile = _profile()
    mask = profile.unstable_mask()
    assert mask.dtype == torch.bool and mask.shape == (4, 2) and mask.sum() == 2 and mask[0, 0] and mask[3, 1]
    assert profile.unstable_heads_of(3) == [1] and profile.unstable_heads_of(1) == []


def test_validate_for_matching_and_mismatching_shapes():
    profile = _profile()
    profile.validate_for(_config())
    for other in (_config(layers=5), _config(kv_heads=4), _config(head_dim=32)):
        with pytest.raises(ValueError, match="flexicache profile"):
            profile.validate_for(other)


def test_out_of_range_head_and_unknown_fields_fail():
    with pytest.raises(ValueError, match="outside the profiled shape"):
        HeadProfile(num_layers=2, num_kv_heads=2, head_dim=8, unstable_heads=[(2, 0)])
    data = _profile().to_dict()
    data["bogus"] = 1
    with pytest.raises(ValueError, match="bogus"):
        HeadProfile.from_dict(data)


def test_default_profile_marks_first_layers():
    profile = HeadProfile.default(_config(layers=6, kv_heads=3), unstable_layers=2)
    assert profile.unstable_mask()[:2].all() and not profile.unstable_mask()[2:].any()


def test_from_pretrained_file_and_folder(tmp_path):
    profile = _profile()
    profile.save(tmp_path / "flexicache_profile.json")
    profile.save(tmp_path / "other.json")
    assert HeadProfile.from_pretrained(tmp_path / "other.json") == profile
    assert HeadProfile.from_pretrained(tmp_path) == profile
    assert HeadProfile.from_pretrained(str(tmp_path), filename="other.json") == profile
    with pytest.raises(FileNotFoundError, match="missing.json"):
        HeadProfile.from_pretrained(tmp_path, filename="missing.json")


def test_a_missing_profile_file_is_not_looked_up_on_the_hub(tmp_path, monkeypatch):
    import huggingface_hub

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", lambda **kwargs: pytest.fail("looked up on the hub"))
    for missing in (str(tmp_path / "typo.json"), "./typo", "profiles.json"):
        with pytest.raises(FileNotFoundError, match="No profile file"):
            HeadProfile.from_pretrained(missing)


@pytest.mark.parametrize("field, value", [("unstable_heads", [(1.9, True)]), ("unstable_heads", [("1", "0")]),
                                          ("sparse_layers", [0.5, 1])])
def test_indices_that_are_not_integers_are_refused_not_rounded(field, value):
    fields = {"num_layers": 4, "num_kv_heads": 2, "head_dim": 8, "unstable_heads": [(1, 0)], field: value}
    with pytest.raises(ValueError, match=f"HeadProfile's {field} must be an integer"):
        HeadProfile(**fields)


def test_from_pretrained_shipped_name():
    names = shipped_profiles()
    assert "smollm2-135m-instruct" in names
    profile = HeadProfile.from_pretrained("smollm2-135m-instruct")
    assert (profile.num_layers, profile.num_kv_heads, profile.head_dim) == (30, 3, 64)


def test_from_pretrained_hub_id_downloads(tmp_path, monkeypatch):
    import huggingface_hub

    _profile().save(tmp_path / "downloaded.json")
    calls = []

    def fake_download(repo_id, filename, revision=None):
        calls.append((repo_id, filename, revision))
        return str(tmp_path / "downloaded.json")

    monkeypatch.setattr(huggingface_hub, "hf_hub_download", fake_download)
    loaded = HeadProfile.from_pretrained("someone/some-profiles", filename="llama.json", revision="v1")
    assert loaded == _profile()
    assert calls == [("someone/some-profiles", "llama.json", "v1")]


def test_a_profile_missing_from_a_real_hub_repository_raises_entry_not_found():
    """A real hub request for a file the repository lacks raises the hub's own error (not a FlexiCache one); skipped
    without hub access (this project's CI and sandboxes are offline)."""
    huggingface_hub = pytest.importorskip("huggingface_hub")
    from huggingface_hub.errors import LocalEntryNotFoundError

    try:
        huggingface_hub.model_info("HuggingFaceTB/SmolLM2-135M-Instruct", timeout=5)
    except Exception:  # noqa: BLE001 - any failure here means no hub access
        pytest.skip("Hugging Face hub not reachable")
    with pytest.raises((LocalEntryNotFoundError, huggingface_hub.errors.EntryNotFoundError)):
        HeadProfile.from_pretrained("HuggingFaceTB/SmolLM2-135M-Instruct", filename="no_such_flexicache_profile.json")
