"""Launch settings of FlexiCache's per-layer decode kernels, timed on a CUDA GPU, each variant checked against the
default's output.

Builds one Llama-3.1-8B-shaped attention layer (8 KV heads, group 4, head dim 128, 25% unstable heads, budget
1024) with ``--context`` random tokens x batch ``--batch``, runs decode steps until its selection is warm, then times
on that state, each from a CUDA graph of 20 launches (launch overhead excluded, as in a whole-step graph):

- the unstable rows' page scoring (``_score_pages_kernel``) per pages-per-program block and warp count;
- the selection + page list (``_decode_table_kernel``) per ``TABLE_WARPS`` (the warps launched are
  :func:`~flexicache.backends.triton_select.selection_warps`'s, which caps them by the row length);
- the per-layer copy of the step's token and query into the layer's static buffers (``DecodeGraph.load``);
- FlashInfer's sparse decode with the CUDA-core and the tensor-core kernel on the same page list, then on random
  pools per GQA group and row count (:func:`flashinfer_shapes`).

Usage: ``python eval/gpu_kernel_sweep.py [--context 32768] [--batch 8] [--out sweep.json]``
"""

from __future__ import annotations

import argparse
import functools
import json
from collections.abc import Callable

import torch
import triton

from flexicache import FlexiCache, attention
from flexicache.backends import triton_select
from flexicache.backends.flashinfer import FlashInferBackend
from flexicache.benchmarks.attention import Module, Shape, prefilled_cache
from flexicache.decode_graph import capture

REPEATS = 20


def graph_us(work: Callable[[], None]) -> float:
    """Microseconds per ``work()`` replayed from a CUDA graph of ``REPEATS`` calls (median of 5 replays)."""
    work()
    torch.cuda.synchronize()
    graph = capture(lambda: [work() for _ in range(REPEATS)], torch.device("cuda", torch.cuda.current_device()))
    graph.replay()
    times = []
    for _ in range(5):
        start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        start.record()
        graph.replay()
        end.record()
        torch.cuda.synchronize()
        times.append(1000 * start.elapsed_time(end) / REPEATS)
    return sorted(times)[2]


def warm_layer(context: int, batch: int, steps: int) -> FlexiCache:
    """A one-layer cache of ``context`` random tokens after ``steps`` decode steps (layer by layer)."""
    shape = Shape(num_layers=1)
    torch.manual_seed(0)
    cache, query = prefilled_cache(shape, batch, context)
    layer, module = cache.layers[0], Module(0, shape)
    for _ in range(steps):
        token = torch.randn(batch, shape.num_kv_heads, 1, shape.head_dim, dtype=torch.bfloat16, device="cuda")
        out_keys, out_values = layer.update(token, torch.randn_like(token))
        attention.flexicache_attention_forward(module, torch.randn_like(query), out_keys, out_values, None,
                                               scaling=module.scaling)
    torch.cuda.synchronize()
    return cache


def flashinfer_shapes(page_size: int, pages_per_head: int, head_dim: int) -> list[dict[str, float]]:
    """FlashInfer's CUDA-core vs tensor-core sparse decode (plans reused, as at a decode step at the budget) per
    GQA group and row count (rows = requests x 8 KV heads), each row ``pages_per_head`` random pages of a random
    pool: which kernel to pick per shape."""
    from flexicache.backends import build_decode_layout

    results = []
    for group in (1, 2, 4, 8):
        for rows in (16, 64, 256):
            pool_k = torch.randn(rows * pages_per_head, page_size, head_dim, dtype=torch.bfloat16, device="cuda")
            pool_v = torch.randn_like(pool_k)
            query = torch.randn(rows, group, head_dim, dtype=torch.bfloat16, device="cuda")
            layout = build_decode_layout(torch.full((rows // 8,), 32768), 8, pages_per_head, page_size)
            indices = torch.randperm(pool_k.shape[0], device="cuda").to(torch.int32)
            row: dict[str, float] = {"group": group, "rows": rows}
            outputs = {}
            for name, tensor_cores in (("cuda_core", False), ("tensor_core", True)):
                backend = FlashInferBackend(torch.device("cuda"), use_tensor_cores=tensor_cores)
                planned = backend.prepare(layout, group, head_dim, page_size, pages_per_head, torch.bfloat16,
                                          head_dim**-0.5)
                planned.indices[:-1].copy_(indices)
                outputs[name] = torch.empty_like(query)
                row[f"{name}_us"] = graph_us(functools.partial(FlashInferBackend.run_prepared, planned, query, pool_k,
                                                               pool_v, out=outputs[name]))
            row["max_abs_difference"] = float((outputs["cuda_core"].float() - outputs["tensor_core"].float()).abs()
                                              .max())
            results.append(row)
            print(f"flashinfer group {group} rows {rows:3d}: cuda cores {row['cuda_core_us']:6.2f} us, tensor cores "
                  f"{row['tensor_core_us']:6.2f} us, max |difference| {row['max_abs_difference']:.4f}", flush=True)
    return results


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--context", type=int, default=32768)
    parser.add_argument("--batch", type=int, default=8)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    cache = warm_layer(args.context, args.batch, steps=40)
    layer = cache.layers[0]
    graphed, storage, settings = layer.graphed, layer.storage, layer.settings
    graph = graphed.graph
    query = graph.query
    # The last step's layout and plan: the same objects its launch used, so prepare() returns that plan as it is.
    layout = cache.sequence.last_plan.decode_layout(storage.num_kv_heads, settings.pages_per_head)
    planned = layer.backend.prepare(layout, query.shape[1], storage.head_dim, settings.page_size,
                                    settings.pages_per_head, storage.dtype, graphed.scale)
    inputs = graphed.table_inputs(graph.query, layer.step_inputs[layer.device].num_tokens)
    scores, working = graph.scores, graph.working_scores
    block_scores = triton.next_power_of_2(max(inputs.kmin.shape[2], 16))  # as triton_select.list_pages sizes it
    results: dict[str, object] = {"context": args.context, "batch": args.batch, "gpu": torch.cuda.get_device_name(),
                                  "meta_capacity": inputs.kmin.shape[2], "score": {}, "table": {}}
    defaults = (triton_select.SCORE_BLOCK, triton_select.SCORE_WARPS, triton_select.TABLE_WARPS)

    triton_select.score_unstable_pages(inputs, scores)
    reference_scores = scores.clone()
    tokens_per_row = inputs.num_tokens.repeat_interleave(inputs.unstable_heads.numel())  # [B * hu]
    pages = (tokens_per_row + inputs.page_size - 1) // inputs.page_size
    written = torch.arange(scores.shape[1], device=scores.device) < pages.unsqueeze(1)  # columns a row's scores fill
    for block in (32, 64, 128):
        for warps in (2, 4, 8):
            triton_select.SCORE_BLOCK, triton_select.SCORE_WARPS = block, warps
            scores.zero_()
            triton_select.score_unstable_pages(inputs, scores)
            same = bool(torch.equal(scores[written], reference_scores[written]))
            us = graph_us(lambda: triton_select.score_unstable_pages(inputs, scores))
            results["score"][f"block{block}_warps{warps}"] = {"us": us, "same_scores": same}
            print(f"score block {block:3d} warps {warps:2d}: {us:7.2f} us  same {same}", flush=True)
    triton_select.SCORE_BLOCK, triton_select.SCORE_WARPS = defaults[:2]
    triton_select.score_unstable_pages(inputs, scores)

    triton_select.list_pages(inputs, scores, working, flat=planned.indices, indptr=planned.indptr)
    reference_indices = planned.indices.clone()
    for warps in (4, 8, 16):
        triton_select.TABLE_WARPS = warps
        launched = triton_select.selection_warps(block_scores)  # TABLE_WARPS, within the bounds it applies to
        planned.indices.fill_(-7)
        triton_select.list_pages(inputs, scores, working, flat=planned.indices, indptr=planned.indptr)
        same = bool(torch.equal(planned.indices[:-1], reference_indices[:-1]))
        us = graph_us(lambda: triton_select.list_pages(inputs, scores, working, flat=planned.indices,
                                                       indptr=planned.indptr))
        results["table"][f"warps{warps}"] = {"us": us, "same_pages": same, "launched_warps": launched}
        print(f"table warps {warps:2d} (launched {launched:2d}): {us:7.2f} us  same {same}", flush=True)
    triton_select.TABLE_WARPS = defaults[2]
    triton_select.list_pages(inputs, scores, working, flat=planned.indices, indptr=planned.indptr)

    token = torch.randn(args.batch, storage.num_kv_heads, 1, storage.head_dim, dtype=storage.dtype, device="cuda")
    full_query = torch.randn(args.batch, query.shape[0] // args.batch * query.shape[1], 1, storage.head_dim,
                             dtype=storage.dtype, device="cuda")
    rows_query = full_query.reshape(query.shape)
    results["load_us"] = graph_us(lambda: graph.load(token[:, :, 0], token[:, :, 0], rows_query))
    print(f"DecodeGraph.load: {results['load_us']:.2f} us", flush=True)
    pool_k, pool_v = storage.pool.k, storage.pool.v
    outputs = {}
    results["flashinfer"] = {}
    for name, tensor_cores in (("cuda_core", False), ("tensor_core", True)):  # on the layer's own page list
        kernel = FlashInferBackend(layer.device, use_tensor_cores=tensor_cores).prepare(
            layout, query.shape[1], storage.head_dim, settings.page_size, settings.pages_per_head, storage.dtype,
            graphed.scale)
        kernel.indices.copy_(planned.indices)
        outputs[name] = FlashInferBackend.run_prepared(kernel, query, pool_k, pool_v).float()
        results["flashinfer"][f"{name}_us"] = graph_us(functools.partial(
            FlashInferBackend.run_prepared, kernel, query, pool_k, pool_v, out=graph.output))
    results["flashinfer"]["max_abs_difference"] = float((outputs["cuda_core"] - outputs["tensor_core"]).abs().max())
    print(f"flashinfer: {results['flashinfer']}", flush=True)
    results["flashinfer_shapes"] = flashinfer_shapes(settings.page_size, settings.pages_per_head, storage.head_dim)

    if args.out:
        with open(args.out, "w") as handle:
            json.dump(results, handle, indent=2)


if __name__ == "__main__":
    main()
