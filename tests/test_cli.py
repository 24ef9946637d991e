"""The ``flexicache`` command line's shared options: device and dtype defaults, and the install hint."""

from __future__ import annotations

import pytest

from flexicache import cli


def test_auto_dtype_is_bfloat16_on_cuda_and_float32_elsewhere():
    # float32 on a GPU would silently take the torch reference backend: FlashInfer runs 16-bit only
    assert cli.resolve_dtype("auto", "cuda") == "bfloat16"
    assert cli.resolve_dtype("auto", "cuda:1") == "bfloat16"
    assert cli.resolve_dtype("auto", "cpu") == "float32"
    assert cli.resolve_dtype("float16", "cuda") == "float16" and cli.resolve_dtype("bfloat16", "cpu") == "bfloat16"
    with pytest.raises(ValueError, match="choose one of"):
        cli.resolve_dtype("fp8", "cuda")


def test_default_device_follows_cuda(monkeypatch):
    import torch

    assert cli.resolve_device("cpu") == "cpu" and cli.resolve_device("cuda:1") == "cuda:1"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: True)
    assert cli.resolve_device(None) == "cuda"
    monkeypatch.setattr(torch.cuda, "is_available", lambda: False)
    assert cli.resolve_device(None) == "cpu"


@pytest.mark.parametrize("command", ["eval", "profile"])
def test_subcommands_default_to_auto_dtype(command, capsys):
    with pytest.raises(SystemExit):
        cli.main([command, "--help"])
    out = capsys.readouterr().out
    assert "--dtype {auto,float32,bfloat16,float16}" in out and "bfloat16 on CUDA" in " ".join(out.split())


def test_a_missing_extra_names_the_distribution(monkeypatch, capsys):
    import importlib

    real = importlib.import_module

    def without_evaluation(name, *args):
        if name == "flexicache.evaluation.cli":
            raise ImportError("No module named 'datasets'")
        return real(name, *args)

    monkeypatch.setattr(importlib, "import_module", without_evaluation)
    with pytest.raises(SystemExit):
        cli.main(["eval"])
    assert f"pip install '{cli.DISTRIBUTION}[eval]'" in capsys.readouterr().err
