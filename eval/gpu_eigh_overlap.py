"""Can the principal axes' eigendecompositions run beside a prefill's attention on the GPU?

Times, on one GPU: ``--work`` causal sdpa calls (8 x 32 heads x 8k tokens, bf16: the size of a layer's attention),
three ``torch.linalg.eigh`` of the 64 covariances (128 x 128, float32) a 32k x 8 prefill solves per layer, and the
two together: after the work was queued, on a side stream of high priority (the host blocks in the solve while the
queue runs), on the same stream, and from a second host thread. Overlap would show as "together" below the sum.

Usage: ``python eval/gpu_eigh_overlap.py [--work 32] [--out r.json]``.
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


def seconds(run: Callable[[], None], repeats: int = 3) -> float:
    """Mean seconds of ``run`` (after one untimed call), the device synchronised."""
    run()
    torch.cuda.synchronize()
    start = time.perf_counter()
    for _ in range(repeats):
        run()
    torch.cuda.synchronize()
    return (time.perf_counter() - start) / repeats


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--work", type=int, default=32, help="sdpa calls queued before the solves")
    parser.add_argument("--out", default=None, help="write the result as JSON here")
    args = parser.parse_args()
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
    print(json.dumps(result, indent=1))
    if args.out:
        Path(args.out).write_text(json.dumps(result, indent=1))


if __name__ == "__main__":
    main()
