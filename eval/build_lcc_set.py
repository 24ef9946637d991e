"""Build the LCC-style next-line code-completion set (LongBench schema, dataset "lcc") from Python sources.

    python eval/build_lcc_set.py --out eval/data/lcc_stdlib.jsonl            # this interpreter's stdlib
    python eval/build_lcc_set.py --files a.py b.py --count 10 --seed 1 --out my.jsonl

Run it with ``flexicache eval --suite lcc --data <out>``. The records depend only on the files, the count,
the seed and the word range.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from flexicache.evaluation import lcc


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--files", nargs="*", help="Python sources (default: the standard library's top-level "
                                                   "modules long enough for --min-words)")
    parser.add_argument("--count", type=int, default=40)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--min-words", type=int, default=lcc.MIN_WORDS, help="shortest context, in whitespace words")
    parser.add_argument("--max-words", type=int, default=lcc.MAX_WORDS, help="longest context, in whitespace words")
    parser.add_argument("--out", required=True)
    args = parser.parse_args(argv)
    files = args.files or lcc.stdlib_sources(args.min_words)
    records = lcc.build_records(files, args.count, args.seed, args.min_words, args.max_words)
    out = Path(args.out)
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text("".join(json.dumps(r) + "\n" for r in records), encoding="utf-8")
    print(f"{len(records)} records from {len(files)} files -> {out}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
