"""eval/RESULTS.md shows what the committed results folders hold: its generated tables are what
eval/results_tables.py renders from them now, and the script that makes the folders parses."""

from __future__ import annotations

import importlib.util
import subprocess
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def load_results_tables():
    spec = importlib.util.spec_from_file_location("results_tables", ROOT / "eval" / "results_tables.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_results_md_tables_are_rendered_from_the_committed_folders() -> None:
    tables = load_results_tables()
    text = (ROOT / "eval" / "RESULTS.md").read_text()
    stored = text.split(tables.BEGIN, 1)[1].split(tables.END, 1)[0]
    assert stored.strip() == tables.all_tables(ROOT / "eval" / "results" / "cpu").strip(), (
        "eval/RESULTS.md is out of date: python eval/results_tables.py eval/results/cpu --update eval/RESULTS.md")


def test_every_results_folder_is_made_by_the_results_script() -> None:
    script = (ROOT / "eval" / "run_cpu_results.sh").read_text()
    subprocess.run(["bash", "-n", str(ROOT / "eval" / "run_cpu_results.sh")], check=True)
    folders = sorted(path.parent.relative_to(ROOT / "eval" / "results" / "cpu")
                     for path in (ROOT / "eval" / "results" / "cpu").glob("*/*/metrics.json"))
    assert folders, "no results folders"
    missing = [str(folder) for folder in folders if f"$root/{folder}" not in script]
    assert not missing, f"results folders no command of eval/run_cpu_results.sh writes: {missing}"


def test_every_prediction_file_belongs_to_a_method_its_folder_records() -> None:
    """A folder resumes and re-summarises from its prediction files, found by method name: each file must be named
    after a method of the folder's methods.json, and each method must have its predictions."""
    import json

    mismatched = []
    for methods_file in sorted((ROOT / "eval" / "results" / "cpu").glob("*/*/methods.json")):
        folder = methods_file.parent
        methods = set(json.loads(methods_file.read_text()))
        stems = {path.stem for path in folder.glob("predictions/*/*.jsonl")}
        mismatched += [f"{folder.name}: file {stem}.jsonl" for stem in sorted(stems - methods)]
        mismatched += [f"{folder.name}: method {name} has no predictions" for name in sorted(methods - stems)]
    assert not mismatched, mismatched
