"""Where should the principal axes' eigendecompositions run: beside a prefill's attention on the GPU, or on the host?

Times, on one GPU: ``--work`` causal sdpa calls (8 x 32 heads x 8k tokens, bf16: the size of a layer's attention),
three ``torch.linalg.eigh`` of the 64 covariances (128 x 128, float32) a 32k x 8 prefill solves per layer, and the
two together: after the work was queued, on a side stream of high priority (the host blocks in the solve while the
queue runs), on the same stream, and from a second host thread. Overlap would show as "together" below the sum.
Then one batch of the 64 solves (two spectra) by ``torch.linalg.eigh`` on the GPU and on the host (copied there and
back), and by ``torch.linalg.svd`` with cuSOLVER's batched drivers (the SVD of a symmetric positive semi-definite
matrix is its eigendecomposition), with their orthonormality and agreement with ``eigh``'s axes.

With ``--keys FILE`` it also compares, on real prompt keys, the page boxes in ``eigh``'s axes with those in
:func:`flexicache.key_basis.symmetric_eigenvectors`'s (the fast CUDA basis) and in the model's axes: the summed
width of a 16-token page's box, and the share of the top-16 pages of 64 probe queries that each basis shares with
``eigh``'s. The keys come from a real model on the CPU
(``--save-keys FILE``: SmolLM2's prompt keys over 2k tokens of the standard library's source, every other layer).

Usage: ``python eval/gpu_eigh_overlap.py [--work 32] [--keys keys.pt] [--out r.json]``;
``python eval/gpu_eigh_overlap.py --save-keys keys.pt`` (CPU).
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from collections.abc import Callable
from pathlib import Path

import torch
import torch.nn.functional as F

from flexicache.config import FlexiCacheConfig
from flexicache.key_basis import symmetric_eigenvectors
from flexicache.profiling.pages import page_bounds
from flexicache.selection import box_scores

PAGE_SIZE = 16


def seconds(run: Callable[[], None], repeats: int = 3) -> float:
    """Mean seconds of ``run`` (after one untimed call), the device synchronised."""
    run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def save_prompt_keys(path: str, tokens: int = 2048) -> None:
    """SmolLM2's keys ``[L / 2, H, T, D]`` (float16, every other layer) of a standard-library prompt, into ``path``."""
    import sysconfig

    from transformers import DynamicCache

    from flexicache.models import load_model

    model, tokenizer = load_model("smollm2", device="cpu", attn_implementation="sdpa")
    text = Path(sysconfig.get_paths()["stdlib"], "argparse.py").read_text()
    ids = tokenizer(text, return_tensors="pt").input_ids[:, :tokens]
    cache = DynamicCache(config=model.config)
    with torch.inference_mode():
        model(ids, past_key_values=cache, use_cache=True, logits_to_keep=1)
    keys = torch.stack([layer.keys[0] for layer in cache.layers[::2]]).half()
    torch.save(keys, path)
    print(f"saved keys {tuple(keys.shape)} into {path}")


def page_box_widths(keys: torch.Tensor, axes: torch.Tensor) -> torch.Tensor:
    """Mean summed width ``sum_d (max - min)`` (what a page score's ``|q| . radius`` weighs) of the 16-token page
    boxes of ``keys [N, T, D]`` in ``axes [N, D, D]``, per row ``[N]``."""
    kmin, kmax = page_bounds(torch.bmm(keys, axes), PAGE_SIZE)
    return (kmax - kmin).sum(-1).mean(1)


def top_pages(keys: torch.Tensor, axes: torch.Tensor, queries: torch.Tensor, k: int) -> torch.Tensor:
    """``[N, Q, P]`` bool: each query's top ``k`` pages by FlexiCache's box scores in ``axes``."""
    kmin, kmax = page_bounds(torch.bmm(keys, axes), PAGE_SIZE)
    scores = box_scores(torch.bmm(queries, axes), kmin, kmax, FlexiCacheConfig.spread_weight)
    top = scores.topk(k, dim=-1).indices
    return torch.zeros_like(scores, dtype=torch.bool).scatter_(-1, top, True)


def real_key_axes(path: str) -> dict[str, float]:
    """The fast CUDA basis against ``eigh``'s on the real keys saved in ``path``: orthonormality, page box widths
    and how many of the top-16 pages of 64 probe queries (keys of the same row, a stand-in for the model's queries)
    the two bases share; the model's axes beside them."""
    keys = torch.load(path).cuda().float().flatten(0, 1)
    centred = keys - keys.mean(1, keepdim=True)
    covariance = torch.bmm(centred.mT, centred)
    exact = torch.linalg.eigh(covariance).eigenvectors
    fast = symmetric_eigenvectors(covariance)
    identity = torch.eye(keys.shape[-1], device="cuda")
    model_axes = identity.expand_as(exact)
    generator = torch.Generator(device="cuda").manual_seed(0)
    probes = keys[:, torch.randint(0, keys.shape[1], (64,), generator=generator, device="cuda")]
    exact_top = top_pages(keys, exact, probes, 16)
    exact_widths = page_box_widths(keys, exact)

    def shared(axes: torch.Tensor) -> float:
        return float((top_pages(keys, axes, probes, 16) & exact_top).sum() / exact_top.sum())

    return {"rows": keys.shape[0], "tokens": keys.shape[1], "head_dim": keys.shape[2],
            "fast_orthonormality_error": (torch.bmm(fast.mT, fast) - identity).abs().max().item(),
            "box_width_fast_over_eigh": (page_box_widths(keys, fast) / exact_widths).mean().item(),
            "box_width_model_axes_over_eigh": (page_box_widths(keys, model_axes) / exact_widths).mean().item(),
            "top16_pages_shared_with_eigh_fast": shared(fast),
            "top16_pages_shared_with_eigh_model_axes": shared(model_axes),
            "fast_s": seconds(lambda: symmetric_eigenvectors(covariance)),
            "eigh_s": seconds(lambda: torch.linalg.eigh(covariance))}


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=int, default=32, help="sdpa calls queued before the solves")
    parser.add_argument("--keys", default=None, help="real prompt keys saved by --save-keys: compare the axes on them")
    parser.add_argument("--save-keys", default=None, help="save SmolLM2's prompt keys here (CPU) and stop")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args()
    if args.save_keys:
        save_prompt_keys(args.save_keys)
        return
    torch.manual_seed(0)
    keys = torch.randn(8, 8, 4096, 128, device="cuda") * torch.linspace(0.1, 3, 128, device="cuda")
    covariance = torch.einsum("bhtd,bhte->bhde", keys, keys)
    query = torch.randn(8, 32, 8192, 128, device="cuda", dtype=torch.bfloat16)
    key = torch.randn_like(query)
    side = torch.cuda.Stream(priority=-1)

    def work() -> None:
        for _ in range(args.work):
            F.scaled_dot_product_attention(query, key, key, is_causal=True)

    def solves_on_side_stream(ready: torch.cuda.Event) -> None:
        side.wait_event(ready)
        with torch.cuda.stream(side):
            for _ in range(3):
                torch.linalg.eigh(covariance)
        torch.cuda.current_stream().wait_stream(side)

    def work_then_side_stream() -> None:
        ready = torch.cuda.Event()
        ready.record()
        work()
        solves_on_side_stream(ready)

    def work_then_same_stream() -> None:
        work()
        for _ in range(3):
            torch.linalg.eigh(covariance)

    def solves_in_thread(with_work: bool) -> None:
        ready = torch.cuda.Event()
        ready.record()

        def solve() -> None:
            torch.cuda.set_device(0)
            solves_on_side_stream(ready)
            side.synchronize()

        thread = threading.Thread(target=solve)
        thread.start()
        if with_work:
            work()
        thread.join()

    result = {
        "work_alone_s": seconds(work),
        "eigh_3_alone_inline_s": seconds(lambda: solves_on_side_stream(torch.cuda.Event())),
        "work_then_3_eigh_inline_side_stream_s": seconds(work_then_side_stream),
        "work_then_3_eigh_same_stream_s": seconds(work_then_same_stream),
        "work_plus_3_eigh_gpu_thread_s": seconds(lambda: solves_in_thread(True)),
        "3_eigh_gpu_thread_alone_s": seconds(lambda: solves_in_thread(False)),
    }
    for spectrum, low, high in (("variances 0.01-9", -1.0, 0.48), ("variances 1e-6-10", -3.0, 0.5)):
        spread = torch.randn(64, 4096, 128, device="cuda") * torch.logspace(low, high, 128, device="cuda")
        matrices = spread.mT @ spread
        axes = torch.linalg.eigh(matrices).eigenvectors
        row = {"eigh_s": seconds(lambda m=matrices: torch.linalg.eigh(m)),
               "host_eigh_s": seconds(lambda m=matrices: torch.linalg.eigh(m.cpu()).eigenvectors.to("cuda"))}
        for driver in ("gesvda", "gesvdj"):
            row[f"svd_{driver}_s"] = seconds(lambda m=matrices, d=driver: torch.linalg.svd(m, driver=d))
            vectors = torch.linalg.svd(matrices, driver=driver).U
            eye = torch.eye(128, device="cuda")
            row[f"svd_{driver}_orthonormality_error"] = (vectors.mT @ vectors - eye).abs().max().item()
            # the same axes up to sign and order: each eigh axis has one svd axis it equals
            row[f"svd_{driver}_min_best_match"] = (axes.mT @ vectors).abs().amax(1).min().item()
        row["fast_basis_s"] = seconds(lambda m=matrices: symmetric_eigenvectors(m))
        result[f"one_batch_of_64, spectrum {spectrum}"] = row
    if args.keys:
        result["real_keys"] = real_key_axes(args.keys)
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
