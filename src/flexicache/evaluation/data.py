"""Benchmark records as ``datasets.Dataset``: JSONL files, folders of them and zip archives holding them.

A source is a JSONL file, a folder (its ``data/*.jsonl`` when it has a ``data/`` folder, else its ``*.jsonl``)
or a zip archive (every ``*.jsonl`` member, read in place: the hub's LongBench ``data.zip`` needs no unpacking).
"""

from __future__ import annotations

import zipfile
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any


@dataclass(frozen=True)
class JsonlFile:
    """One JSONL file to load: ``stem`` names it (``qasper`` for ``data/qasper.jsonl``), ``data_file`` is what
    ``datasets`` reads (a path, or ``zip://MEMBER::ARCHIVE`` for a member of an archive)."""

    stem: str
    data_file: str


def jsonl_files(sources: Iterable[str | Path]) -> list[JsonlFile]:
    """The JSONL files of ``sources`` (files, folders, zip archives), each folder's and archive's sorted by name."""
    files: list[JsonlFile] = []
    for source in map(Path, sources):
        if source.is_dir():
            folder = source / "data" if (source / "data").is_dir() else source
            files.extend(JsonlFile(p.stem, str(p)) for p in sorted(folder.glob("*.jsonl")))
        elif source.is_file() and zipfile.is_zipfile(source):
            with zipfile.ZipFile(source) as archive:
                members = sorted(n for n in archive.namelist() if n.endswith(".jsonl"))
            files.extend(JsonlFile(Path(m).stem, f"zip://{m}::{source.resolve()}") for m in members)
        elif source.is_file():
            files.append(JsonlFile(source.stem, str(source)))
        else:
            raise FileNotFoundError(f"{source}: no such file or folder (give JSONL files, folders or zip archives)")
    return files


def load_jsonl(data_file: str) -> Any:
    """A JSONL file (a path or a ``zip://`` member) as one ``datasets.Dataset``, one row per line."""
    import datasets

    return datasets.load_dataset("json", data_files=data_file, split="train")


def rows(dataset: Any, limit: int | None = None) -> Iterator[dict[str, Any]]:
    """The first ``limit`` rows (all when None) of a ``datasets.Dataset``, as dicts."""
    count = len(dataset) if limit is None else min(limit, len(dataset))
    yield from dataset.select(range(count))
