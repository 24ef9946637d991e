"""The generated sections of a markdown file such as BENCHMARKS.md, each rendered from the ``bench.json`` it names.

A generated section sits between two marker lines; the first names its ``bench.json`` (relative to the markdown
file's folder) and, optionally, the cases to render from it::

    <!-- flexicache-bench eval/results/gpu/decode/bench.json -->
    ... rendered: the command, hardware and versions, model and settings, headline numbers, tables, plots ...
    <!-- /flexicache-bench -->

    <!-- flexicache-bench eval/results/gpu/memory/bench.json cases=memory -->

``flexicache bench --update-benchmarks FILE`` rewrites every generated section of ``FILE`` from its ``bench.json``
(the text between the markers is replaced, everything else is kept), so that a new run's numbers replace the old
ones by command, and a change of the report's format reaches every section at once.
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass
from pathlib import Path

from flexicache.benchmarks.report import render_body

START = re.compile(r"^<!-- flexicache-bench (?P<source>\S+?)(?: cases=(?P<cases>[a-z,]+))? -->$", re.MULTILINE)
END = "<!-- /flexicache-bench -->"


@dataclass(frozen=True)
class Section:
    """One generated section: its ``bench.json`` (as written in the marker), the cases to render (``None``: all),
    and where its body lies in the text (``start`` to ``end``, between the two marker lines)."""

    source: str
    cases: list[str] | None
    start: int
    end: int


def find_sections(text: str) -> list[Section]:
    """The generated sections of ``text``, in order; raises ``ValueError`` for a start marker without its end."""
    sections = []
    for match in START.finditer(text):
        end = text.find("\n" + END, match.end())
        following = START.search(text, match.end())
        if end < 0 or (following is not None and following.start() < end):
            raise ValueError(f"the marker {match.group(0)!r} has no {END!r} line after it: add one where the "
                             "generated text ends")
        cases = match.group("cases")
        sections.append(Section(match.group("source"), cases.split(",") if cases else None, match.end(), end))
    return sections


def reproduce_command(command: str, folder: str, document: str) -> str:
    """``command`` (as a ``bench.json`` recorded it) writing into ``folder`` and updating ``document``."""
    args = shlex.split(command)
    if "--out" in args:
        args[args.index("--out") + 1] = folder
    else:
        args += ["--out", folder]
    return shlex.join(args + ["--update-benchmarks", document])


def render_section(results: dict, source: str, document: str, cases: list[str] | None) -> str:
    """The text of a generated section for the run ``results`` stored at ``source`` (relative to the document)."""
    folder = str(Path(source).parent)
    lines = [f"Measured by: `{results['command']}`", "",
             f"Re-measure and rewrite this section: `{reproduce_command(results['command'], folder, document)}`", "",
             f"Raw results: [`{source}`]({source}), with its standalone report "
             f"[`{folder}/report.md`]({folder}/report.md).", "", ""]
    return "\n".join(lines) + render_body(results, plot_prefix=folder, cases=cases, level=3)


def render_document(text: str, folder: Path, document: str) -> str:
    """``text`` with every generated section rendered anew from its ``bench.json`` (paths relative to ``folder``)."""
    pieces, position = [], 0
    for section in find_sections(text):
        path = folder / section.source
        if not path.is_file():
            raise FileNotFoundError(f"{document} names {section.source}, which does not exist: run the measurement "
                                    "into that folder, or remove the section")
        results = json.loads(path.read_text(encoding="utf-8"))
        pieces += [text[position:section.start], "\n",
                   render_section(results, section.source, document, section.cases).rstrip("\n") + "\n"]
        position = section.end
    return "".join(pieces) + text[position:]


def check_named(path: Path, run: Path) -> None:
    """Raise ``SystemExit`` (saying which lines to add) unless a generated section of the markdown file ``path``
    names the ``bench.json`` at ``run``: checked before a measurement, so that none is left out by mistake."""
    folder = path.resolve().parent
    sources = [section.source for section in find_sections(path.read_text(encoding="utf-8"))]
    if any((folder / source).resolve() == run.resolve() for source in sources):
        return
    shown = run.resolve().relative_to(folder) if run.resolve().is_relative_to(folder) else run
    raise SystemExit(f"{path} has no generated section for {run}: add the two lines\n"
                     f"<!-- flexicache-bench {shown} -->\n{END}\nwhere its numbers belong (sections now: "
                     f"{', '.join(sources) or 'none'})")


def update_document(path: Path, run: Path) -> None:
    """Rewrite every generated section of the markdown file ``path``, one of which must name the ``bench.json`` at
    ``run`` (the run just made or re-rendered)."""
    check_named(path, run)
    text = path.read_text(encoding="utf-8")
    path.write_text(render_document(text, path.resolve().parent, path.name), encoding="utf-8")
