"""``flexicache`` command line: ``profile``, ``eval``, ``diagnose`` and ``bench`` subcommands, and the device and
dtype options they share with the example scripts."""

from __future__ import annotations

import argparse
import importlib
import sys

DISTRIBUTION = "flexicache-kv"  # the name on PyPI (``import flexicache``)
DTYPES = ("auto", "float32", "bfloat16", "float16")
DTYPE_HELP = "model dtype; auto: bfloat16 on CUDA (FlashInfer kernels), float32 on the CPU"

# subcommand -> module exposing ``add_arguments(parser)`` and ``run(args) -> int``
SUBCOMMANDS = {
    "profile": ("flexicache.profiling.cli", "Measure head stability and write a HeadProfile JSON."),
    "eval": ("flexicache.evaluation.cli", "Compare DynamicCache and FlexiCache accuracy on a suite."),
    "diagnose": ("flexicache.diagnostics.cli",
                 "Attention mass kept by FlexiCache's page selection vs the oracle, per layer and head."),
    "bench": ("flexicache.benchmarks.cli", "Measure memory and decode speed side by side."),
}


def resolve_device(device: str | None) -> str:
    """``device``, or ``"cuda"`` when a GPU is visible, else ``"cpu"``."""
    import torch

    return device or ("cuda" if torch.cuda.is_available() else "cpu")


def resolve_dtype(dtype: str, device: str) -> str:
    """The dtype name for ``--dtype``: ``"auto"`` is bfloat16 on CUDA (float32 would silently take the torch
    reference backend there, FlashInfer runs 16-bit only) and float32 elsewhere."""
    if dtype not in DTYPES:
        raise ValueError(f"dtype {dtype!r}: choose one of {DTYPES}")
    if dtype != "auto":
        return dtype
    return "bfloat16" if device.split(":")[0] == "cuda" else "float32"


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
                     f"Install them with: pip install '{DISTRIBUTION}[eval]'")
    return modules[args.command].run(args)


if __name__ == "__main__":
    sys.exit(main())
