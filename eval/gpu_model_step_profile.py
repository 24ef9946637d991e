"""Where a whole-model decode step goes on a CUDA GPU: kernels of ``generate`` steps grouped by kind.

Builds the ``--shape`` model with random weights (``--layers`` decoder layers, bf16), fills a cache of ``--system``
(``flexicache-1024``, ``dynamic``, ... as in ``flexicache bench``) with ``--context`` random tokens x ``--batch``
as the decode bench does, warms up, times ``--steps`` greedy ``generate`` steps (wall, device synchronised), then
runs ``--profile-steps`` more under the torch profiler and prints, per decode step: the GPU time of each group of
kernels (dense matmuls, FlashInfer or sdpa attention, FlexiCache's Triton kernels, elementwise/normalisation, copies,
the rest), their sum ("GPU busy": kernels that overlap on several streams count once each) and its share of the
step's wall time, and the kernels that take the most time.

Usage: ``python eval/gpu_model_step_profile.py [--layers 32] [--system flexicache-1024] [--context 32768]``
"""

from __future__ import annotations

import argparse
import collections
import json
import re
import statistics

import torch

from flexicache.benchmarks.measure import build_model, device_kernels, fill_cache, timed_generate
from flexicache.benchmarks.suite import Settings, System, model_config

# (group, pattern on the kernel name); the first match names a kernel's group
GROUPS = (
    ("copies", re.compile(r"^Memcpy|^Memset")),
    ("FlashInfer attention", re.compile(r"flashinfer")),
    ("sdpa attention (cuDNN / flash)", re.compile(r"sdpa|fmha|flash_fwd|lean_reduction")),
    ("dense matmuls (gemm/gemv)", re.compile(r"gemm|gemv|nvjet|cutlass|xmma|splitK", re.IGNORECASE)),
    ("FlexiCache Triton kernels", re.compile(r"^_[a-z0-9_]+_kernel$")),
    ("elementwise / reductions (norms, rotary, SiLU, softmax)",
     re.compile(r"elementwise|reduce|Reduce|softmax|index|cat|gather|scatter|fill|copy", re.IGNORECASE)),
)


def group_of(name: str) -> str:
    return next((group for group, pattern in GROUPS if pattern.search(name)), "other")


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b")
    parser.add_argument("--layers", type=int, default=32)
    parser.add_argument("--system", default="flexicache-1024")
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--steps", type=int, default=32)
    parser.add_argument("--profile-steps", type=int, default=16)
    parser.add_argument("--top", type=int, default=25, help="kernels listed")
    parser.add_argument("--json", help="write the groups and kernels here")
    args = parser.parse_args()

    device = torch.device("cuda")
    settings = Settings(device="cuda", dtype="bfloat16", layers=args.layers)
    config = model_config(args.shape, args.layers)
    model = build_model(config, device, torch.bfloat16, settings.seed)
    system = System(args.system)
    model.set_attn_implementation(system.attn_implementation)
    warmup = 20
    # capacity: the context, the warm-up, the timed and profiled steps, and each generate call's first step
    cache = system.make_cache(config, args.context + warmup + args.steps + args.profile_steps + 4, settings)
    ids = fill_cache(model, cache, args.batch, args.context, settings.seed)
    sequences, _ = timed_generate(model, cache, ids, warmup)
    sequences, step_ms = timed_generate(model, cache, sequences, args.steps + 1)
    p50 = statistics.median(step_ms[1:])

    profiled = device_kernels(lambda: timed_generate(model, cache, sequences, args.profile_steps), device)
    kernels = {name: ms / args.profile_steps for name, (ms, _) in profiled.items()}  # per step
    calls = {name: launches for name, (_, launches) in profiled.items()}
    groups: dict[str, float] = collections.defaultdict(float)
    for name, ms in kernels.items():
        groups[group_of(name)] += ms
    busy = sum(groups.values())

    print(f"{args.shape}, {args.layers} layers, {args.system}, {args.context} x {args.batch}: step wall p50 "
          f"{p50:.2f} ms, GPU busy {busy:.2f} ms per step ({busy / p50:.0%})")
    for group, ms in sorted(groups.items(), key=lambda item: -item[1]):
        print(f"  {ms:7.3f} ms  {group}")
    print("top kernels (ms per step, launches per step):")
    for name, ms in sorted(kernels.items(), key=lambda item: -item[1])[:args.top]:
        print(f"  {ms:7.3f}  {calls[name] / args.profile_steps:6.1f}  {group_of(name)[:12]:12s}  {name[:110]}")
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "step_ms_p50": p50, "busy_ms": busy, "groups": groups,
                       "kernels": {name: {"ms": ms, "calls": calls[name] / args.profile_steps}
                                   for name, ms in kernels.items()}}, handle, indent=1)


if __name__ == "__main__":
    main()
