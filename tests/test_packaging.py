"""The packaging metadata: a free PyPI name used by every install hint, build requirements that can build the
metadata, one version source, and dependencies that match what the package imports."""

from __future__ import annotations

import ast
import re
import sys
from pathlib import Path

import pytest
from packaging.requirements import Requirement
from packaging.version import Version

from flexicache.cli import DISTRIBUTION

tomllib = pytest.importorskip("tomllib")  # Python >= 3.11
REPO = Path(__file__).resolve().parents[1]
PYPROJECT = tomllib.loads((REPO / "pyproject.toml").read_text(encoding="utf-8"))
PROJECT = PYPROJECT["project"]
EXTRAS = PROJECT["optional-dependencies"]
IMPORT_NAME = {"flashinfer-python": "flashinfer", "huggingface-hub": "huggingface_hub"}  # where they differ
IMPORTED_BY_TRANSFORMERS = {"gguf"}  # transformers' GGUF loader imports it, the package does not
# imported by the package, installed without being declared: triton comes with torch's CUDA wheels, and the
# Triton kernels are used only on CUDA
UNDECLARED_OK = {"triton"}
# the extras of the package itself (dev holds tools for the tests, examples and notebooks)
PACKAGE_EXTRAS = ("cuda", "gguf", "eval", "plot")


def requirements(names) -> list[Requirement]:
    return [Requirement(line) for name in names for line in (PROJECT["dependencies"] if name == "core" else
                                                            EXTRAS[name])]


def third_party_imports(folder: Path) -> set[str]:
    """Top-level modules imported anywhere under ``folder`` (module level or inside functions)."""
    found = set()
    for path in folder.rglob("*.py"):
        for node in ast.walk(ast.parse(path.read_text(encoding="utf-8"))):
            if isinstance(node, ast.Import):
                found.update(alias.name.split(".")[0] for alias in node.names)
            elif isinstance(node, ast.ImportFrom) and node.level == 0 and node.module:
                found.add(node.module.split(".")[0])
    return {name for name in found if name not in sys.stdlib_module_names and name != "flexicache"}


def test_the_distribution_name_is_the_one_every_hint_names():
    assert PROJECT["name"] == DISTRIBUTION != "flexicache"  # "flexicache" on PyPI is an unrelated project
    hint = re.compile(r"""pip install[^'"\n]*['"]?([A-Za-z0-9_.-]+)\[([a-z,]+)\]""")
    files = [*(REPO / "src").rglob("*.py"), *(REPO / "examples").rglob("*.py"), *(REPO / "examples").rglob("*.ipynb")]
    hints = [(path, m) for path in files for m in hint.finditer(path.read_text(encoding="utf-8"))]
    assert any(m.group(1) == DISTRIBUTION for _, m in hints)  # the check below looks at something
    for path, match in hints:
        assert match.group(1) in (DISTRIBUTION, "."), f"{path.relative_to(REPO)}: {match.group(0)!r}"  # . = a checkout
        assert set(match.group(2).split(",")) <= set(EXTRAS), f"{path.relative_to(REPO)}: {match.group(0)!r}"
    dev = {Requirement(r).name: Requirement(r) for r in EXTRAS["dev"]}
    assert DISTRIBUTION in dev and dev[DISTRIBUTION].extras <= set(EXTRAS)


def test_build_requirements_can_build_this_metadata():
    (setuptools,) = [Requirement(r) for r in PYPROJECT["build-system"]["requires"] if r.startswith("setuptools")]
    lowest = min(Version(spec.version) for spec in setuptools.specifier if spec.operator in (">=", "=="))
    if isinstance(PROJECT["license"], str) or "license-files" in PROJECT:
        assert lowest >= Version("77"), "SPDX license strings and license-files need setuptools >= 77"


def test_one_version_source():
    assert "version" not in PROJECT and "version" in PROJECT["dynamic"]
    assert PYPROJECT["tool"]["setuptools"]["dynamic"]["version"] == {"attr": "flexicache.__version__"}
    init = ast.parse((REPO / "src" / "flexicache" / "__init__.py").read_text(encoding="utf-8"))
    versions = [node.value.value for node in init.body if isinstance(node, ast.Assign)
                and any(getattr(t, "id", None) == "__version__" for t in node.targets)]
    assert len(versions) == 1 and Version(versions[0])  # a literal setuptools reads without importing torch
    written = [p for p in (REPO / "src").rglob("*.py") if re.search(r"^__version__\s*=", p.read_text(), re.MULTILINE)]
    assert written == [REPO / "src" / "flexicache" / "__init__.py"]


def test_dependencies_are_the_ones_the_package_imports():
    imported = third_party_imports(REPO / "src" / "flexicache")
    declared = {IMPORT_NAME.get(r.name, r.name.replace("-", "_")): r for r in requirements(("core", *PACKAGE_EXTRAS))}
    unused = set(declared) - imported - IMPORTED_BY_TRANSFORMERS
    assert not unused, f"declared but never imported by the package: {sorted(unused)}"
    undeclared = imported - set(declared) - UNDECLARED_OK
    assert not undeclared, f"imported by the package but not declared: {sorted(undeclared)}"


def test_fragile_dependencies_have_tested_bounds():
    by_name = {r.name: r for r in requirements(("core", *PACKAGE_EXTRAS))}
    transformers = by_name["transformers"].specifier
    assert "5.17.0" in transformers and "6.0" not in transformers  # the oldest tested; 6 drops past_key_values=
    flashinfer = by_name["flashinfer-python"].specifier
    assert "0.7.2" in flashinfer and "0.8.0" not in flashinfer  # plan reuse is verified on 0.7.x
    assert all(r.name != "rouge-score" for r in requirements(("core", *EXTRAS)))  # ROUGE is computed here
