"""FlexiCache on a model split over several devices: token agreement, KV bytes per device, decode speed.

Builds a random-weight model of a real shape (nothing is downloaded), places it like transformers'
``device_map="auto"`` (layers balanced over the visible GPUs, what does not fit on the CPU), prefills ``--context``
random tokens and greedily generates ``--new-tokens`` tokens with DynamicCache, then with FlexiCache. Prints whether
the tokens agree, the KV bytes each device holds for both caches (FlexiCache's from
``flexicache.parallel.kv_bytes_by_device``) and the decode tokens/s of both.

    # the multi-GPU host: Llama-3.1-70B shape in bf16 over every visible GPU, 32k context, 1k budget; --warm-up keeps
    # first-use kernel compiles out of the timings (it costs one more prefill of --context)
    python examples/multi_gpu.py --shape 70b --warm-up --check-full-budget --out result.json
    # one GPU: cap its memory to force a GPU/CPU split (CPU layers stream their weights to the GPU, as accelerate
    # does; --cpu-layers run computes them on the CPU instead, so their KV lives in CPU memory)
    python examples/multi_gpu.py --shape 8b --max-gpu-memory 8GiB --context 8192
    # any machine, in seconds (what the tests run): exact agreement when the budget covers the context
    python examples/multi_gpu.py --shape tiny --context 256 --new-tokens 8 --budget 512 --dtype float64

With ``--budget`` >= context + new tokens (or with ``--check-full-budget``, which adds such a run) the FlexiCache
tokens must equal DynamicCache's (``--strict`` then exits non-zero otherwise); with a smaller budget they agree for
a while and may then drift (random weights attend almost uniformly, the hardest case for top-K selection).
"""

from __future__ import annotations

import argparse
import gc
import json
import sys
import time
from collections import Counter

import accelerate
import torch
import transformers
from accelerate.utils import get_balanced_memory, infer_auto_device_map, set_module_tensor_to_device

from flexicache import FlexiCache, FlexiCacheConfig, disable_step_graphs, warm_up
from flexicache.models import cache_keyword, input_device
from flexicache.parallel import kv_bytes_by_device

SHAPES: dict[str, dict] = {
    "70b": {"hidden_size": 8192, "intermediate_size": 28672, "num_hidden_layers": 80, "num_attention_heads": 64,
            "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rope_theta": 500000.0},
    "8b": {"hidden_size": 4096, "intermediate_size": 14336, "num_hidden_layers": 32, "num_attention_heads": 32,
           "num_key_value_heads": 8, "head_dim": 128, "vocab_size": 128256, "rope_theta": 500000.0},
    "tiny": {"hidden_size": 64, "intermediate_size": 128, "num_hidden_layers": 4, "num_attention_heads": 4,
             "num_key_value_heads": 2, "head_dim": 16, "vocab_size": 256, "rope_theta": 10000.0},
}
DTYPES = {"bfloat16": torch.bfloat16, "float16": torch.float16, "float32": torch.float32, "float64": torch.float64}
MIB = 2**20


def parse_args(argv: list[str] | None) -> argparse.Namespace:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shape", choices=sorted(SHAPES), default="70b", help="model shape (Llama-3.1 70B/8B)")
    parser.add_argument("--layers", type=int, help="decoder layers (default: the shape's)")
    parser.add_argument("--context", type=int, default=32768, help="prompt tokens (random)")
    parser.add_argument("--new-tokens", type=int, default=32, help="tokens to generate")
    parser.add_argument("--batch", type=int, default=1)
    parser.add_argument("--budget", type=int, default=1024, help="FlexiCache token_budget")
    parser.add_argument("--dtype", choices=sorted(DTYPES), default="bfloat16")
    parser.add_argument("--device", choices=["auto", "cuda", "cpu"], default="auto",
                        help="auto: the visible GPUs when there are any, else the CPU")
    parser.add_argument("--max-gpu-memory", help="weights per GPU, e.g. 40GiB (default: all but --reserve)")
    parser.add_argument("--reserve", default="24GiB",
                        help="GPU memory kept free for the KV cache and activations when --max-gpu-memory is unset")
    parser.add_argument("--cpu-layers", choices=["offload", "run"], default="offload",
                        help="layers placed on the CPU: offload = their weights stream to the GPU and they run there "
                             "(accelerate's default); run = they compute on the CPU (their KV in CPU memory)")
    parser.add_argument("--warm-up", action="store_true",
                        help="before timing: one short DynamicCache generate and flexicache.warm_up at this context "
                             "and batch, so kernel compiles (FlashInfer, Triton) stay out of the decode timings")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument("--out", help="write the results as JSON here")
    parser.add_argument("--check-full-budget", action="store_true",
                        help="also generate with a budget covering the context (every page attended): FlexiCache "
                             "must then give DynamicCache's tokens, up to near-ties that bf16 kernels may flip")
    parser.add_argument("--strict", action="store_true",
                        help="exit 1 if the budget covers the context and the tokens differ")
    return parser.parse_args(argv)


def build_config(shape: str, layers: int | None) -> transformers.LlamaConfig:
    fields = dict(SHAPES[shape])
    if layers is not None:
        fields["num_hidden_layers"] = layers
    return transformers.LlamaConfig(**fields, max_position_embeddings=131072, tie_word_embeddings=False,
                                    bos_token_id=None, eos_token_id=None, pad_token_id=0,
                                    attn_implementation="flexicache")


def plan_device_map(model: torch.nn.Module, dtype: torch.dtype, use_cuda: bool, max_gpu_memory: str | None,
                    reserve: str) -> dict[str, int | str]:
    """transformers' ``device_map="auto"`` for a model on the meta device: balanced over GPUs, the rest on the CPU."""
    if not use_cuda:
        return {"": "cpu"}
    reserve_bytes = accelerate.utils.convert_file_size_to_int(reserve)
    max_memory: dict[int | str, int | str] = {
        index: max_gpu_memory or max(torch.cuda.mem_get_info(index)[0] - reserve_bytes, 0)
        for index in range(torch.cuda.device_count())
    }
    max_memory["cpu"] = 2**50  # whatever does not fit on the GPUs (the host's RAM is the real limit)
    no_split = model._no_split_modules
    if torch.cuda.device_count() > 1 and max_gpu_memory is None:
        max_memory = get_balanced_memory(model, max_memory, no_split_module_classes=no_split, dtype=dtype)
    return infer_auto_device_map(model, max_memory=max_memory, no_split_module_classes=no_split, dtype=dtype)


def random_model(config: transformers.LlamaConfig, dtype: torch.dtype, args: argparse.Namespace
                 ) -> tuple[torch.nn.Module, dict[str, int | str]]:
    """A random model dispatched with accelerate's hooks; weights are drawn on their own device, never gathered."""
    with accelerate.init_empty_weights(include_buffers=False):
        model = transformers.LlamaForCausalLM(config)
    use_cuda = args.device == "cuda" or (args.device == "auto" and torch.cuda.is_available())
    device_map = plan_device_map(model, dtype, use_cuda, args.max_gpu_memory, args.reserve)
    if "disk" in device_map.values():
        raise SystemExit("The model does not fit in GPU + CPU memory: use --layers to make it smaller.")
    placement = sorted(device_map.items(), key=lambda item: -len(item[0]))  # most specific module name first
    torch.manual_seed(args.seed)
    for name, parameter in model.named_parameters():
        device = next(target for prefix, target in placement if prefix in ("", name) or name.startswith(prefix + "."))
        device = f"cuda:{device}" if isinstance(device, int) else device
        value = torch.empty(parameter.shape, dtype=dtype, device=device)
        if parameter.dim() > 1:  # projections and embeddings; the 1-D parameters are RMSNorm weights
            value.normal_(0.0, config.initializer_range)
        else:
            value.fill_(1.0)
        set_module_tensor_to_device(model, name, device, value=value, dtype=dtype)
    main_device = "cpu" if args.cpu_layers == "run" or not use_cuda else None
    model = accelerate.dispatch_model(model, device_map, main_device=main_device,
                                      skip_keys=model._skip_keys_device_placement)
    model.eval()
    model.generation_config.pad_token_id = 0
    return model, device_map


class StepTimer(transformers.LogitsProcessor):
    """Records when each generated token's logits are ready (after a device sync): the decode steps' wall times."""

    def __init__(self) -> None:
        self.times: list[float] = []

    def __call__(self, input_ids: torch.LongTensor, scores: torch.FloatTensor) -> torch.FloatTensor:
        if scores.is_cuda:
            torch.cuda.synchronize(scores.device)
        self.times.append(time.perf_counter())
        return scores

    def tokens_per_second(self, batch: int) -> float:
        """Decode tokens/s over the steps after the first token (the prefill is excluded)."""
        steps = len(self.times) - 1
        return batch * steps / (self.times[-1] - self.times[0]) if steps > 0 else float("nan")

    def step_milliseconds(self) -> dict[str, float]:
        """Median and slowest decode step (ms): a slow outlier (a compile, a reallocation) shows against the median."""
        steps = sorted(1000 * (end - start) for start, end in zip(self.times, self.times[1:]))
        if not steps:
            return {"p50": float("nan"), "max": float("nan")}
        return {"p50": steps[len(steps) // 2], "max": steps[-1]}


def run(model: torch.nn.Module, ids: torch.Tensor, cache, new_tokens: int) -> tuple[torch.Tensor, StepTimer]:
    """Greedy generation: ``(new tokens [B, new_tokens], the decode steps' timer)``."""
    timer = StepTimer()
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), max_new_tokens=new_tokens, do_sample=False,
                             num_beams=1, logits_processor=transformers.LogitsProcessorList([timer]),
                             **{cache_keyword(model): cache})
    return out[:, ids.shape[1]:].cpu(), timer


def dynamic_kv_bytes_by_device(cache: transformers.DynamicCache) -> dict[str, int]:
    totals: Counter[str] = Counter()
    for layer in cache.layers:
        totals[str(layer.keys.device)] += layer.keys.nbytes + layer.values.nbytes
    return dict(totals)


def peak_memory() -> dict[str, int]:
    """Peak allocated bytes of every GPU since the last reset."""
    if not torch.cuda.is_available():
        return {}
    return {f"cuda:{index}": torch.cuda.max_memory_allocated(index) for index in range(torch.cuda.device_count())}


def reset_peaks() -> None:
    if torch.cuda.is_available():
        for index in range(torch.cuda.device_count()):
            torch.cuda.empty_cache()
            torch.cuda.reset_peak_memory_stats(index)


def agreement(dense: torch.Tensor, sparse: torch.Tensor) -> dict:
    """Matching positions, and the first step where any request differs (``None`` if none)."""
    same = (dense == sparse).all(dim=0)
    first = None if bool(same.all()) else int((~same).nonzero()[0])
    return {"agree": first is None, "matching_tokens": int((dense == sparse).sum()), "total_tokens": dense.numel(),
            "first_difference_step": first}


def main(argv: list[str] | None = None) -> int:
    args = parse_args(argv)
    dtype = DTYPES[args.dtype]
    config = build_config(args.shape, args.layers)
    model, device_map = random_model(config, dtype, args)
    ids = torch.randint(1, config.vocab_size, (args.batch, args.context),
                        generator=torch.Generator().manual_seed(args.seed)).to(input_device(model))
    print(f"model: {args.shape} shape, {config.num_hidden_layers} layers, {args.dtype}, device map {device_map}")
    results: dict = {"shape": args.shape, "layers": config.num_hidden_layers, "dtype": args.dtype,
                     "context": args.context, "batch": args.batch, "new_tokens": args.new_tokens,
                     "budget": args.budget, "cpu_layers": args.cpu_layers,
                     "device_map": {name: str(device) for name, device in device_map.items()}}

    if args.warm_up:
        run(model, ids[:, :128], transformers.DynamicCache(config=model.config), 4)
        warm_up(model, context=args.context, batch_size=args.batch, token_budget=args.budget)
        disable_step_graphs(model)  # DynamicCache runs on the model as it was; from_model below prepares it again
    reset_peaks()
    dense_cache = transformers.DynamicCache(config=model.config)
    dense_tokens, dense_timer = run(model, ids, dense_cache, args.new_tokens)
    dense_speed = dense_timer.tokens_per_second(args.batch)
    results["dynamic"] = {"decode_tokens_per_s": dense_speed, "step_ms": dense_timer.step_milliseconds(),
                          "kv_bytes_by_device": dynamic_kv_bytes_by_device(
        dense_cache), "peak_gpu_bytes": peak_memory()}
    del dense_cache

    reset_peaks()
    cache = FlexiCache.from_model(model, token_budget=args.budget)
    tokens, timer = run(model, ids, cache, args.new_tokens)
    speed, stats = timer.tokens_per_second(args.batch), cache.stats()
    results["flexicache"] = {"decode_tokens_per_s": speed, "step_ms": timer.step_milliseconds(),
                             "kv_bytes_by_device": kv_bytes_by_device(cache),
                             "peak_gpu_bytes": peak_memory(), "stats": stats}
    results["layers_per_device"] = dict(Counter(str(layer.device) for layer in cache.layers))
    results["agreement"] = agreement(dense_tokens, tokens)
    del cache
    gc.collect()  # the layers' CUDA-graph launches refer back to them: free the pages before the next run
    if args.check_full_budget:
        page_size = FlexiCacheConfig().page_size
        covering = -(-(args.context + args.new_tokens) // page_size) * page_size  # whole pages
        full_tokens, _ = run(model, ids, FlexiCache.from_model(model, token_budget=covering), args.new_tokens)
        results["full_budget"] = {"budget": covering, "agreement": agreement(dense_tokens, full_tokens)}

    match = results["agreement"]
    print(f"context {args.context} x batch {args.batch}, {args.new_tokens} new tokens, budget {args.budget}")
    print(f"tokens agree: {match['agree']} ({match['matching_tokens']}/{match['total_tokens']} match, "
          f"first difference at step {match['first_difference_step']})")
    if "full_budget" in results:
        full = results["full_budget"]["agreement"]
        print(f"with a budget covering the context ({results['full_budget']['budget']}): tokens agree: "
              f"{full['agree']} ({full['matching_tokens']}/{full['total_tokens']} match)")
    print(f"decoder layers per device: {results['layers_per_device']}")
    print(f"{'MiB per device':<14} {'DynamicCache KV':>16} {'FlexiCache KV':>14} {'+ metadata':>11} "
          f"{'host KV':>10}")
    flexi_bytes = results["flexicache"]["kv_bytes_by_device"]
    for device in sorted(set(results["dynamic"]["kv_bytes_by_device"]) | set(flexi_bytes)):
        ours = flexi_bytes.get(device, {})
        print(f"{device:<14} {results['dynamic']['kv_bytes_by_device'].get(device, 0) / MIB:>16,.2f} "
              f"{ours.get('device_kv_bytes', 0) / MIB:>14,.2f} {ours.get('device_metadata_bytes', 0) / MIB:>11,.2f} "
              f"{ours.get('host_kv_bytes', 0) / MIB:>10,.2f}")
    print(f"decode tokens/s: DynamicCache {dense_speed:.2f}, FlexiCache {speed:.2f}")
    for name in ("dynamic", "flexicache"):
        step = results[name]["step_ms"]
        print(f"{name} decode step: median {step['p50']:.1f} ms, slowest {step['max']:.1f} ms")
    if args.out:
        with open(args.out, "w", encoding="utf-8") as handle:
            json.dump(results, handle, indent=2)
            handle.write("\n")
    covered = args.budget >= args.context + args.new_tokens
    full_agrees = results.get("full_budget", {"agreement": {"agree": True}})["agreement"]["agree"]
    return 1 if args.strict and ((covered and not match["agree"]) or not full_agrees) else 0


if __name__ == "__main__":
    sys.exit(main())
