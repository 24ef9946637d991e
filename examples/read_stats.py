"""What every key of ``FlexiCache.stats()`` means, shown on a short generation and checked against the formulas.

    python examples/read_stats.py                       # SmolLM2-135M-Instruct (offline), 1k-token prompt
    python examples/read_stats.py --model tiny          # a tiny random Llama: no download, a few seconds

The script prefills a prompt, decodes ``--new-tokens`` tokens, then prints each statistic with its meaning and
recomputes the byte counts and rerank counts from the model's shape and the profile, so you can see where every
number comes from. ``--strict`` exits non-zero if a key has no explanation here or a check fails (the tests use it).
"""

from __future__ import annotations

import argparse
import math
import sys

import torch
import transformers

from flexicache import FlexiCache, FlexiLayer, HeadProfile
from flexicache.models import SMOLLM2, load_model
from flexicache.profile import model_shape
from flexicache.profiles import shipped_profile_path

TINY = "tiny"

# Every key of FlexiCache.stats(), in the order printed, with what it means.
EXPLANATIONS: dict[str, str] = {
    "token_budget": "tokens each KV head attends to at a decode step (K = token_budget / page_size pages, the "
                    "first 'sink' page and the current tail page included)",
    "backend": "decode kernel in use: 'reference' (torch, CPU or GPU) or 'flashinfer' (CUDA)",
    "unstable_heads": "(layer, KV head) pairs that are unstable (the profile's, or estimated from the prompt without "
                      "one): all their pages stay on the device and they rerank every decode step; every other head "
                      "is stable",
    "decode_steps": "single-token decode forwards served sparsely (the prefill and multi-token chunks are dense)",
    "dense_kv_bytes": "what a dense DynamicCache would hold for the same tokens: "
                      "2 (K,V) x layers x KV heads x tokens x head_dim x element size x batch (a sliding-window "
                      "layer: its window's tokens)",
    "device_kv_bytes": "KV on the device: unstable heads' pages in use + stable heads' K + C page slots each (their "
                       "working set of selected and standby pages, and the tail page); compare with dense_kv_bytes",
    "sliding_kv_bytes": "the windows of sliding-window layers (a model that mixes layer types, e.g. Gemma 3), "
                        "counted in device_kv_bytes and dense_kv_bytes alike; 0 without such layers",
    "device_metadata_bytes": "per-page key min/max of every head (two head_dim vectors per page, stable heads' host "
                             "pages included): what page scoring reads, never transferred",
    "device_reserved_bytes": "every device tensor of the cache, spare capacity included (the page pool grows in "
                             "chunks) + metadata: the device memory it actually takes",
    "host_kv_bytes": "stable heads' full KV in the host tier (pinned memory on CUDA): the host RAM the method needs",
    "host_reserved_bytes": "host-tier allocation, spare capacity included (grows by 1/4 at a time)",
    "reranks_unstable": "rows (one request x one KV head) of unstable heads scored and re-selected: every row "
                        "at every decode step",
    "reranks_stable": "rows of stable heads re-selected: once after the prefill, then every rerank_interval decode "
                      "steps (layers staggered so that no step pays for all of them)",
    "promoted_pages": "pages copied host -> device because a stable head's rerank newly selected them (pages "
                      "already on the device stay; nothing is ever dropped, a page can come back at any rerank)",
    "bytes_h2d": "host -> device bytes: promoted pages + the tail page restored after a multi-token chunk",
    "bytes_d2h": "device -> host bytes: the prefill's bulk copy of the stable heads' KV + each page that fills "
                 "up during decode",
    "step_graph_captures": "decode steps recorded as whole-step CUDA graphs (one per new key: batch shape, rerank "
                           "phase, storage after a growth); 0 off the CUDA + FlashInfer path",
    "step_graph_replays": "decode steps replayed from those graphs: the model's host work skipped (the rest ran "
                          "eagerly)",
    "host_pool_in_use_bytes": "the process's pinned host pool (shared by every cache on CUDA): page-locked blocks "
                              "lent to host tiers now; 0 on the CPU, whose host tier is ordinary memory",
    "host_pool_reserved_bytes": "the pool's page-locked blocks, in use or kept for the next cache (FLEXICACHE_HOST_"
                                "POOL_GIB bounds them, flexicache.host_pool.release() gives the unused ones back)",
}


def tiny_model(seed: int = 0):
    """A 4-layer random Llama (2 KV heads, head_dim 16): shapes and counters only, its text is noise."""
    config = transformers.LlamaConfig(vocab_size=256, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                                      num_attention_heads=4, num_key_value_heads=2, head_dim=16,
                                      max_position_embeddings=8192, bos_token_id=None, eos_token_id=None,
                                      pad_token_id=0)
    torch.manual_seed(seed)
    model = transformers.LlamaForCausalLM(config).eval()
    model.generation_config.pad_token_id = 0
    return model


def cache_keyword() -> str:
    major, minor = (int(part) for part in transformers.__version__.split(".")[:2])
    return "cache" if (major, minor) >= (5, 24) else "past_key_values"


def mib(value: int) -> str:
    return f"{value / 2**20:.3f} MiB"


def checks(cache: FlexiCache, stats: dict, config, dtype: torch.dtype, batch: int, tokens: int
           ) -> list[tuple[str, int, int]]:
    """``(what, expected, reported)`` for the counts that follow from the shape, the profile and the run."""
    settings = cache.settings
    num_layers, num_kv_heads, head_dim = model_shape(config)
    element = torch.empty(0, dtype=dtype).element_size()
    page_bytes = 2 * settings.page_size * head_dim * element  # K and V of one page of one head
    pages = math.ceil(tokens / settings.page_size)
    unstable = sum(len(layer.unstable_heads) for layer in cache.layers if isinstance(layer, FlexiLayer))
    stable = num_layers * num_kv_heads - unstable
    steps = stats["decode_steps"]
    return [
        ("dense_kv_bytes = 2 x L x H x tokens x D x elem", 2 * num_layers * num_kv_heads * tokens * head_dim * element
         * batch, stats["dense_kv_bytes"]),
        ("device_kv_bytes = (unstable x pages + stable x (K + C)) x page bytes",
         batch * (unstable * pages + stable * (settings.pages_per_head + settings.num_standby_pages)) * page_bytes,
         stats["device_kv_bytes"]),
        ("host_kv_bytes = stable x pages x page bytes", batch * stable * pages * page_bytes, stats["host_kv_bytes"]),
        ("reranks_unstable = decode steps x unstable heads", batch * steps * unstable, stats["reranks_unstable"]),
    ]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2, help="'smollm2' (default, offline), 'tiny', a hub id or folder")
    parser.add_argument("--gguf-file", default=None)
    parser.add_argument("--profile", default=None, help="HeadProfile JSON (default: shipped for smollm2, else none: "
                                                        "the unstable heads estimated from the prompt)")
    parser.add_argument("--context-tokens", type=int, default=1024, help="prompt length")
    parser.add_argument("--new-tokens", type=int, default=40, help="decode steps (> 16 so that stable heads rerank)")
    parser.add_argument("--budget", type=int, default=256, help="token budget per KV head")
    parser.add_argument("--rerank-interval", type=int, default=16)
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    parser.add_argument("--strict", action="store_true", help="exit 1 on an unexplained key or a failed check")
    args = parser.parse_args(argv)

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if args.model == TINY:
        model = tiny_model().to(device)
        input_ids = torch.randint(1, model.config.vocab_size, (1, args.context_tokens),
                                  generator=torch.Generator().manual_seed(0)).to(device)
        shipped = None
    else:
        from flexicache.evaluation.synthetic import build_sample

        model, tokenizer = load_model(args.model, gguf_file=args.gguf_file, device=device)
        sample = build_sample("passkey", tokenizer, args.context_tokens, seed=0, index=0, count=1)
        input_ids = torch.tensor([sample.input_ids], device=device)
        shipped = shipped_profile_path("smollm2-135m-instruct") if args.model == SMOLLM2 else None
    profile_path = args.profile or shipped
    profile = HeadProfile.load(profile_path) if profile_path else None
    cache = FlexiCache.from_model(model, profile=profile, token_budget=args.budget,
                                  rerank_interval=args.rerank_interval)
    with torch.inference_mode():
        model.generate(input_ids, attention_mask=torch.ones_like(input_ids), max_new_tokens=args.new_tokens,
                       min_new_tokens=args.new_tokens, do_sample=False, **{cache_keyword(): cache})
    stats = cache.stats()
    tokens = cache.get_seq_length()  # prompt + new tokens fed back (the last generated token is not stored)
    num_layers, num_kv_heads, head_dim = model_shape(model.config)
    print(f"model {args.model}: {num_layers} layers x {num_kv_heads} KV heads, head_dim {head_dim}, {model.dtype}, "
          f"{device}; profile: {profile_path or 'none (unstable heads estimated from the prompt)'}")
    print(f"prompt {input_ids.shape[1]} tokens + {args.new_tokens} decode steps -> {tokens} tokens cached; "
          f"budget {args.budget} = K {cache.settings.pages_per_head} pages of {cache.settings.page_size}\n")

    problems = []
    for key in list(EXPLANATIONS) + [key for key in stats if key not in EXPLANATIONS]:
        if key not in stats:
            problems.append(f"stats() has no key {key!r} (explained here)")
            continue
        value = stats[key]
        shown = mib(value) if "bytes" in key else str(value)
        explanation = EXPLANATIONS.get(key)
        if explanation is None:
            problems.append(f"no explanation for the stats() key {key!r}")
            explanation = "(not explained by this script: a new key?)"
        print(f"{key:<22} {shown:>14}  {explanation}")

    dense = stats["dense_kv_bytes"]
    total_rows = num_layers * num_kv_heads * input_ids.shape[0]
    every_step = total_rows * stats["decode_steps"]
    print("\nreading them together:")
    print(f"  device KV is {stats['device_kv_bytes'] / dense:.1%} of dense "
          f"({(stats['device_kv_bytes'] + stats['device_metadata_bytes']) / dense:.1%} with the page min/max); "
          f"the host tier holds {stats['host_kv_bytes'] / dense:.1%} of dense")
    if every_step:
        done = stats["reranks_unstable"] + stats["reranks_stable"]
        print(f"  reranks: {done} rows, {done / every_step:.1%} of reranking every head at every step "
              f"({every_step} rows)")
    print(f"  {stats['promoted_pages']} pages promoted host -> device ({mib(stats['bytes_h2d'])} in all)")
    if device.type == "cpu":
        print("  on the CPU the 'device' and the 'host' tier are the same RAM: the split shows what a GPU would hold")

    print("\nchecks (expected = reported):")
    for what, expected, reported in checks(cache, stats, model.config, model.dtype, input_ids.shape[0], tokens):
        ok = expected == reported
        if not ok:
            problems.append(f"{what}: expected {expected}, reported {reported}")
        print(f"  {'ok ' if ok else 'FAIL'} {what}: {expected} {'=' if ok else '!='} {reported}")
    for problem in problems:
        print(f"warning: {problem}", file=sys.stderr)
    return 1 if problems and args.strict else 0


if __name__ == "__main__":
    raise SystemExit(main())
