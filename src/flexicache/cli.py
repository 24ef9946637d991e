"""``flexicache`` command line: ``profile``, ``eval`` and ``bench`` subcommands."""

from __future__ import annotations

import argparse
import importlib
import sys

# subcommand -> module exposing ``add_arguments(parser)`` and ``run(args) -> int``
SUBCOMMANDS = {
    "profile": ("flexicache.profiling.cli", "Measure head stability and write a HeadProfile JSON."),
    "eval": ("flexicache.evaluation.cli", "Compare DynamicCache and FlexiCache accuracy on a suite."),
    "bench": ("flexicache.benchmarks.cli", "Measure memory and decode speed side by side."),
}


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(prog="flexicache", description=__doc__)
    subparsers = parser.add_subparsers(dest="command", required=True)
    modules = {}
    for name, (module_name, help_text) in SUBCOMMANDS.items():
        sub = subparsers.add_parser(name, help=help_text, description=help_text)
        try:
            modules[name] = importlib.import_module(module_name)
        except ImportError as error:  # an optional extra is missing: say which
            sub.set_defaults(_import_error=error)
            continue
        modules[name].add_arguments(sub)
    args = parser.parse_args(argv)
    if getattr(args, "_import_error", None) is not None:
        parser.error(f"`flexicache {args.command}` needs more packages: {args._import_error}. "
                     "Install them with: pip install 'flexicache[eval]'")
    return modules[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
