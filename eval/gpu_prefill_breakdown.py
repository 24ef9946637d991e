"""Where a FlexiCache prefill's time goes, beside DynamicCache's, on a random-weight model of a real shape.

Runs the prompt forward (``--batch`` random prompts of ``--context`` tokens, the logits of the last token only) with a
DynamicCache on sdpa and with ``FlexiCache.from_model`` (``--repeats`` times each: the first FlexiCache prefill
registers the host tiers' page-locked memory, the later ones borrow it from the pool), and then once more with a
synchronising timer around each part of FlexiCache's commit of a prompt chunk: the dense attention (sdpa), the page
metadata (min/max boxes), the principal axes of the boxes (and their eigendecompositions; ``--eigh``: by
``torch.linalg.eigh``, in place of the fast batched basis), the prompt tail's attention per page (what the page split
and the staleness score read), the online head split (``--online-split``: no profile, the library's default), the
unstable heads' pages, the stable heads' host tier and tails, the first rerank of the stable heads, and the cache's
own ``update`` (staging, read-back). The timed run synchronises before and after every part, so its total is above the
untimed prefill's; the parts say where the difference to DynamicCache sits.

Usage: ``python eval/gpu_prefill_breakdown.py [--shape llama-3.1-8b] [--layers 4] [--context 32768] [--batch 8]
[--out r.json]``; ``--device cpu --shape tiny-llama`` is a smoke test.
"""

from __future__ import annotations

import argparse
import contextlib
import json
import time
from collections import defaultdict
from collections.abc import Callable, Iterator
from pathlib import Path
from typing import Any

import torch
from transformers import DynamicCache

from flexicache import FlexiCache, attention, decode_paths, head_budgets, key_basis, layer, paging, storage
from flexicache.benchmarks.attention import Shape, random_profile
from flexicache.benchmarks.measure import build_model, random_ids, synchronize
from flexicache.benchmarks.suite import MODEL_SHAPES, model_config
from flexicache.config import FlexiCacheConfig
from flexicache.head_split import OnlineHeadSplit
from flexicache.key_basis import KeyBasis
from flexicache.models import cache_keyword
from flexicache.offload import OffloadedPages
from flexicache.sequence import SequenceState

# (label, owner, attribute): the parts timed, outermost first; a part's time includes the parts inside it.
PARTS: list[tuple[str, Any, str]] = [
    ("cache update (stage, read back)", FlexiCache, "update"),
    ("dense attention (sdpa)", attention, "sdpa_attention_forward"),
    ("commit of the chunk", layer.FlexiLayer, "commit"),
    ("  prompt tail attention per page", layer, "tail_page_mass"),
    ("  page gains for head budgets", head_budgets, "prompt_page_gains"),
    ("  online head split (no profile)", OnlineHeadSplit, "park"),
    ("  plan of the chunk", SequenceState, "plan_chunk"),
    ("  append to the pages", storage.LayerStorage, "append_chunk"),
    ("    principal axes", KeyBasis, "principal_axes"),
    ("      eigendecomposition", key_basis, "symmetric_eigenvectors"),
    ("    page metadata (min/max)", paging.PageMetadata, "append"),
    ("    unstable heads' pages", paging.ResidentPages, "append"),
    ("    stable heads' host tier + tails", OffloadedPages, "append_chunk"),
    ("  first rerank of the stable heads", decode_paths.TorchDecode, "rerank_stable"),
]


@contextlib.contextmanager
def timed_parts(device: torch.device, totals: dict[str, float], calls: dict[str, int]) -> Iterator[None]:
    """Wrap each of :data:`PARTS` in a synchronising timer adding its seconds to ``totals[label]`` and counting its
    calls in ``calls[label]``."""
    originals = []
    for label, owner, name in PARTS:
        raw = owner.__dict__[name] if isinstance(owner, type) else getattr(owner, name)
        function = raw.__func__ if isinstance(raw, classmethod) else raw

        def wrapper(*args: Any, __function: Callable = function, __label: str = label, **kwargs: Any) -> Any:
            synchronize(device)
            start = time.perf_counter()
            try:
                return __function(*args, **kwargs)
            finally:
                synchronize(device)
                totals[__label] += time.perf_counter() - start
                calls[__label] += 1

        setattr(owner, name, classmethod(wrapper) if isinstance(raw, classmethod) else wrapper)
        originals.append((owner, name, raw))
    try:
        yield
    finally:
        for owner, name, raw in originals:
            setattr(owner, name, raw)


def prefill_seconds(model: Any, ids: torch.Tensor, cache: Any) -> float:
    """Seconds of one prompt forward into ``cache`` (the last token's logits only)."""
    synchronize(ids.device)
    start = time.perf_counter()
    with torch.inference_mode():
        model(ids, attention_mask=torch.ones_like(ids), use_cache=True, logits_to_keep=1,
              **{cache_keyword(model): cache})
    synchronize(ids.device)
    return time.perf_counter() - start


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--shape", default="llama-3.1-8b", choices=sorted(MODEL_SHAPES))
    parser.add_argument("--layers", type=int, default=4)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--budget", type=int, default=1024)
    parser.add_argument("--unstable-fraction", type=float, default=0.25)
    parser.add_argument("--online-split", action="store_true",
                        help="no profile: the unstable heads estimated from the prompt over every layer "
                             "(the library's default)")
    parser.add_argument("--split-score", default=FlexiCacheConfig.split_score, choices=["staleness", "overlap"],
                        help="with --online-split: how the heads are ranked (the split's park is a timed part)")
    parser.add_argument("--head-budgets", default=FlexiCacheConfig.head_budgets, choices=["uniform", "prompt"],
                        help="pages per head: K each, or split at the prompt (its page gains are a timed part)")
    parser.add_argument("--repeats", type=int, default=3)
    parser.add_argument("--no-principal-bounds", action="store_true", help="boxes in the model's axes")
    parser.add_argument("--eigh", action="store_true",
                        help="the principal axes by torch.linalg.eigh on the GPU (in place of the fast basis)")
    parser.add_argument("--device", default="cuda")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args()
    device = torch.device(args.device)
    if args.eigh:
        key_basis.symmetric_eigenvectors = lambda matrices: torch.linalg.eigh(matrices).eigenvectors
    config = model_config(args.shape, args.layers)
    model = build_model(config, device, torch.bfloat16, seed=0)
    profile = None if args.online_split else random_profile(Shape.of(config), args.unstable_fraction)
    settings = {"profile": profile, "token_budget": args.budget,
                "max_cache_len": args.context + 1, "backend": "auto" if device.type == "cuda" else "reference",
                "principal_bounds": not args.no_principal_bounds, "head_budgets": args.head_budgets,
                **({"split_score": args.split_score} if args.online_split else {})}
    ids = random_ids(args.batch, args.context, config.vocab_size, device, seed=1)
    print(f"{args.shape}, {args.layers} layers, batch {args.batch} x {args.context} tokens, budget {args.budget}, "
          f"principal_bounds={settings['principal_bounds']}, head_budgets={args.head_budgets}, "
          f"{f'online head split by {args.split_score}' if args.online_split else 'random profile'}", flush=True)
    model.set_attn_implementation("sdpa")
    dense = [prefill_seconds(model, ids, DynamicCache(config=config)) for _ in range(args.repeats)]
    print("DynamicCache + sdpa: " + ", ".join(f"{s:.3f} s" for s in dense), flush=True)
    flexi = []
    for _ in range(args.repeats):
        cache = FlexiCache.from_model(model, **settings)
        flexi.append(prefill_seconds(model, ids, cache))
        del cache
    print("FlexiCache.from_model: " + ", ".join(f"{s:.3f} s" for s in flexi), flush=True)
    totals: dict[str, float] = defaultdict(float)
    calls: dict[str, int] = defaultdict(int)
    cache = FlexiCache.from_model(model, **settings)
    with timed_parts(device, totals, calls):
        timed_total = prefill_seconds(model, ids, cache)
    del cache
    print(f"FlexiCache, every part synchronised: {timed_total:.3f} s", flush=True)
    for label, _, _ in PARTS:
        print(f"  {label:<40} {totals[label]:8.3f} s  {calls[label]:4d} calls", flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps({
            "shape": args.shape, "layers": args.layers, "context": args.context, "batch": args.batch,
            "budget": args.budget, "principal_bounds": settings["principal_bounds"], "head_budgets": args.head_budgets,
            "eigendecompositions": "torch.linalg.eigh" if args.eigh else "key_basis.symmetric_eigenvectors",
            "head_split": (f"online, {args.split_score}" if args.online_split
                           else f"random, {args.unstable_fraction} unstable"),
            "dynamic_cache_s": dense, "flexicache_s": flexi,
            "timed_total_s": timed_total, "parts_s": {label.strip(): totals[label] for label, _, _ in PARTS},
            "calls": {label.strip(): calls[label] for label, _, _ in PARTS},
        }, indent=2))


if __name__ == "__main__":
    main()
