"""One tensor-parallel rank of tests/test_parallel.py: greedy generation with DynamicCache and FlexiCache under TP.

Run as ``torchrun --standalone --nproc-per-node N tests/tp_worker.py MODEL_DIR OUT_DIR`` (``MODEL_DIR``: a saved
model; CPU: gloo, with N GPUs: NCCL, one GPU per rank). Every rank loads the model with ``tp_plan="auto"``, builds
its caches through :func:`flexicache.parallel.local_view` with the full model's profile from ``OUT_DIR/profile.json``
and writes ``OUT_DIR/rank{r}.json``: for every run the generated tokens (``[B, L + new]`` lists), the KV heads
its caches hold (sparse paged and sliding-window layers) and the largest and relative logit differences from
DynamicCache up to the first differing token (at a budget covering the context with the default backend and with the
torch reference kernel, and at a small budget). A last run builds the small-budget cache with ``FlexiCache.from_model`` (on a GPU: whole-step CUDA graphs, which then
record the TP all-reduces too).
"""

from __future__ import annotations

import argparse
import json
import os
from pathlib import Path

import torch
from transformers import AutoModelForCausalLM, DynamicCache

import flexicache  # noqa: F401  (registers the "flexicache" attention)
from flexicache import FlexiCache, FlexiLayer, HeadProfile
from flexicache.parallel import kv_bytes_by_device, local_view, tensor_parallel_shard


def load_tensor_parallel(model_dir: str, dtype: torch.dtype) -> torch.nn.Module:
    """``model_dir`` sharded over every rank of this ``torchrun`` with the model's own TP plan."""
    try:
        from transformers.distributed import DistributedConfig

        parallel = {"distributed_config": DistributedConfig(tp_plan="auto")}
    except (ImportError, TypeError):  # transformers before DistributedConfig took tp_plan
        parallel = {"tp_plan": "auto"}
    return AutoModelForCausalLM.from_pretrained(model_dir, dtype=dtype, attn_implementation="flexicache", **parallel)


def generate(model: torch.nn.Module, inputs: dict, cache, new_tokens: int) -> tuple[torch.Tensor, list]:
    out = model.generate(**inputs, past_key_values=cache, max_new_tokens=new_tokens, do_sample=False, num_beams=1,
                         return_dict_in_generate=True, output_logits=True)
    return out.sequences, list(out.logits)


def logit_differences(sequences: torch.Tensor, logits: list, dense: torch.Tensor, dense_logits: list,
                      context: int) -> dict:
    """Logits against DynamicCache's over the steps that share its context: up to the first step where a generated
    token differs (its logits still came from the same context), all of them when every token agrees."""
    same = (sequences[:, context:] == dense[:, context:]).all(dim=0).tolist()
    matching = same.index(False) if False in same else len(same)
    ours = torch.stack(logits[: matching + 1]).double()
    reference = torch.stack(dense_logits[: matching + 1]).double()
    return {"matching_steps": matching, "max_logit_difference": float((ours - reference).abs().max()),
            "relative_logit_error": float((ours - reference).norm() / reference.norm())}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("model_dir")
    parser.add_argument("out_dir")
    parser.add_argument("--new-tokens", type=int, default=24)
    parser.add_argument("--page-size", type=int, default=8)
    parser.add_argument("--small-budget", type=int, default=32)
    parser.add_argument("--dtype", choices=["float64", "bfloat16"], default="float64")
    args = parser.parse_args()
    out_dir = Path(args.out_dir)
    inputs = {name: torch.tensor(value) for name, value in json.loads((out_dir / "inputs.json").read_text()).items()}
    profile = HeadProfile.load(out_dir / "profile.json")
    model = load_tensor_parallel(args.model_dir, getattr(torch, args.dtype))
    inputs = {name: value.to(model.device) for name, value in inputs.items()}
    context = inputs["input_ids"].shape[1]
    full_budget = -(-(context + args.new_tokens) // args.page_size) * args.page_size

    dense, dense_logits = generate(model, inputs, DynamicCache(config=model.config), args.new_tokens)
    result: dict = {"rank": int(os.environ["RANK"]), "shard": tensor_parallel_shard(model), "dense": dense.tolist()}
    settings = {"page_size": args.page_size, "rerank_interval": 4}
    for name, budget, backend in (("full_budget", full_budget, "auto"), ("full_budget_reference", full_budget,
                                                                             "reference"),
                                  ("small_budget", args.small_budget, "auto"),
                                  ("small_budget_from_model", args.small_budget, "auto")):
        if name == "small_budget_from_model":
            cache = FlexiCache.from_model(model, profile, token_budget=budget, **settings)
        else:
            config, local_profile = local_view(model, profile)
            cache = FlexiCache(config, profile=local_profile, token_budget=budget, backend=backend, **settings)
        tokens, logits = generate(model, inputs, cache, args.new_tokens)
        stats = cache.stats()
        sparse = [layer for layer in cache.layers if isinstance(layer, FlexiLayer)]  # sliding-window layers aside
        result[name] = {
            "tokens": tokens.tolist(),
            **logit_differences(tokens, logits, dense, dense_logits, context),
            "kv_heads": [layer.num_kv_heads for layer in sparse],
            "unstable_heads": [layer.unstable_heads for layer in sparse],
            "stored_kv_heads": [int(layer.storage.meta.kmin.shape[1]) for layer in sparse],
            "window_kv_heads": [int(layer.keys.shape[1]) for layer in cache.layers if layer not in sparse],
            "reranks_stable": stats["reranks_stable"],
            "bytes_by_device": kv_bytes_by_device(cache),
            "dense_kv_bytes": stats["dense_kv_bytes"],
            "backend": stats["backend"],
            "step_graph_replays": stats["step_graph_replays"],
        }
    (out_dir / f"rank{result['rank']}.json").write_text(json.dumps(result))


if __name__ == "__main__":
    main()
