"""Are two identical greedy generations bit-identical? Tells a race in FlexiCache's kernels (results that depend on
the timing of their warps or streams) from nondeterminism in the model's own kernels (BENCHMARKS.md,
"Repeatability").

For each configuration, ``--repeats`` times, a random tiny Llama (the GPU tests' shape: 4 layers, 2 KV heads, group
4, head dim 64, bf16) generates ``--new-tokens`` greedy tokens from one prompt twice, each time with a fresh cache,
and the two runs' logits are compared bit for bit. Configurations:

- ``dynamic``: DynamicCache + sdpa, no FlexiCache (the model's own repeatability);
- ``flexicache-eager``: FlexiCache with ``cuda_graphs=False`` (one stream, kernels launched one by one);
- ``flexicache-graphs-cuda-cores`` / ``flexicache-graphs-tensor-cores``: FlexiCache with whole-step CUDA graphs
  (recorded on a side stream), FlashInfer's CUDA-core or tensor-core decode forced.

Prints, per configuration, how many repeats were bit-identical and, for the others, the first step whose logits
differ, the largest logit difference up to it and the smallest top-two logit gap there. Run it once as is and once
with ``CUBLAS_WORKSPACE_CONFIG=:4096:8`` (cuBLAS then picks the same kernels whatever the streams). On a machine
without CUDA, ``--device cpu`` runs the first two configurations (torch reference backend) as a smoke test.

Usage: ``python eval/gpu_repeatability.py [--repeats 10] [--new-tokens 40] [--device cuda] [--out result.json]``
"""

from __future__ import annotations

import argparse
import json

import torch
from transformers import DynamicCache, LlamaConfig, LlamaForCausalLM

from flexicache import FlexiCache, HeadProfile, disable_step_graphs
from flexicache.backends import _shared_flashinfer

CONFIGURATIONS = ("dynamic", "flexicache-eager", "flexicache-graphs-cuda-cores", "flexicache-graphs-tensor-cores")


def tiny_model(device: torch.device) -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=512, intermediate_size=512, num_hidden_layers=4,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=64, max_position_embeddings=4096)
    return LlamaForCausalLM(config).to(device, torch.bfloat16).eval()


def make_cache(name: str, model: LlamaForCausalLM, device: torch.device) -> DynamicCache | FlexiCache:
    """A fresh cache of configuration ``name``, the model's forward and attention set for it."""
    disable_step_graphs(model)
    if name == "dynamic":
        model.set_attn_implementation("sdpa")
        return DynamicCache(config=model.config)
    graphs = name.startswith("flexicache-graphs")
    if graphs:  # the process-wide FlashInfer backend every cache on this device shares
        _shared_flashinfer(device).use_tensor_cores = name.endswith("tensor-cores")
    profile = HeadProfile(num_layers=4, num_kv_heads=2, head_dim=64, unstable_heads=[(0, 0), (2, 1)])
    return FlexiCache.from_model(model, profile=profile, token_budget=128, cuda_graphs=graphs,
                                 backend="flashinfer" if device.type == "cuda" else "reference")


def step_logits(model: LlamaForCausalLM, ids: torch.Tensor, cache, new_tokens: int) -> torch.Tensor:
    """``[new_tokens, B, V]`` fp32 logits of a greedy generation."""
    with torch.inference_mode():
        out = model.generate(ids, attention_mask=torch.ones_like(ids), past_key_values=cache,
                             max_new_tokens=new_tokens, do_sample=False, output_logits=True,
                             return_dict_in_generate=True)
    return torch.stack(out.logits).float()


def compare(first: torch.Tensor, second: torch.Tensor) -> dict[str, float | int | bool]:
    """Where two runs' logits ``[T, B, V]`` first differ (later steps may follow other tokens: not compared)."""
    if torch.equal(first, second):
        return {"identical": True}
    step = int((first != second).flatten(1).any(1).nonzero()[0])
    top_two = first[step].topk(2, dim=-1).values
    return {"identical": False, "first_step": step,
            "max_abs_difference": float((first[: step + 1] - second[: step + 1]).abs().max()),
            "top_two_gap": float((top_two[:, 0] - top_two[:, 1]).min()),
            "same_tokens_there": bool(torch.equal(first[step].argmax(-1), second[step].argmax(-1)))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--repeats", type=int, default=10)
    parser.add_argument("--new-tokens", type=int, default=40)
    parser.add_argument("--prompt-tokens", type=int, default=400)
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    device = torch.device(args.device)
    if device.type == "cuda" and device.index is None:  # the layers' own device: the shared backend's key
        device = torch.device("cuda", torch.cuda.current_device())
    model = tiny_model(device)
    ids = torch.randint(0, 512, (2, args.prompt_tokens), device=device,
                        generator=torch.Generator(device=device).manual_seed(1))
    names = CONFIGURATIONS if device.type == "cuda" else CONFIGURATIONS[:2]
    results = {}
    for name in names:
        runs = [compare(*(step_logits(model, ids, make_cache(name, model, device), args.new_tokens)
                          for _ in range(2))) for _ in range(args.repeats)]
        results[name] = runs
        identical = sum(run["identical"] for run in runs)
        print(f"{name}: {identical} of {len(runs)} repeats bit-identical", flush=True)
        for run in runs:
            if not run["identical"]:
                print(f"  first differing step {run['first_step']}, max |difference| {run['max_abs_difference']:.4f}"
                      f", top-two gap {run['top_two_gap']:.4f}, same tokens there {run['same_tokens_there']}")
    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
