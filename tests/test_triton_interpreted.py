"""The Triton kernels (page scoring + selection + page list, zero-copy page copies) run by Triton's interpreter on
the CPU, against the torch paths they replace. The GPU tests run the same kernels compiled (test_gpu_flashinfer.py).

The interpreter must be switched on (``TRITON_INTERPRET=1``) before Triton is imported, so each check runs in a
subprocess: this file is both the test module and the script it runs.
"""

from __future__ import annotations

import os
import subprocess
import sys

import pytest
import torch

pytest.importorskip("triton")


def run_interpreted(check: str) -> None:
    env = dict(os.environ, TRITON_INTERPRET="1", OMP_NUM_THREADS="1")
    result = subprocess.run([sys.executable, __file__, check], env=env, capture_output=True, text=True, timeout=900)
    assert result.returncode == 0, result.stdout[-3000:] + result.stderr[-3000:]


def test_fused_decode_table_matches_torch_table() -> None:
    run_interpreted("table")


def test_zero_copy_transfers_match_torch_indexing() -> None:
    run_interpreted("transfers")


def tiny_model():
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    config = LlamaConfig(vocab_size=512, hidden_size=256, intermediate_size=256, num_hidden_layers=2,
                         num_attention_heads=8, num_key_value_heads=2, head_dim=32, max_position_embeddings=4096)
    return LlamaForCausalLM(config).eval()


def padded_batch() -> tuple[torch.Tensor, torch.Tensor]:
    ids = torch.randint(0, 512, (3, 300))
    mask = torch.ones_like(ids)
    mask[1, :50] = 0
    mask[2, :290] = 0  # 10 real tokens: fewer pages than the budget
    return ids, mask


def listed_pages(table: tuple[torch.Tensor, torch.Tensor]) -> list[list[tuple[int, int]]]:
    slots, lens = (tensor.tolist() for tensor in table)
    return [[(slot, length) for slot, length in zip(row_slots, row_lens) if length > 0]
            for row_slots, row_lens in zip(slots, lens)]


def check_table() -> None:
    """Every row lists the same pages (slot, length, order) as the torch table: unstable rows over and under the
    budget, stable rows, max and sum over the GQA group, random and all-zero queries (ties everywhere)."""
    from flexicache import FlexiCache, HeadProfile

    model = tiny_model()
    for unstable in ([(0, 0), (1, 1)], [(0, 0), (0, 1)], []):
        profile = HeadProfile(num_layers=2, num_kv_heads=2, head_dim=32, unstable_heads=unstable)
        ids, mask = padded_batch()
        cache = FlexiCache.from_model(model, profile=profile, token_budget=64)
        with torch.inference_mode():
            model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=21, do_sample=False)
            for reduce in ("max", "sum"):
                object.__setattr__(cache.settings, "group_reduce", reduce)
                for query in (torch.randn(3, 8, 1, 32), torch.zeros(3, 8, 1, 32)):
                    rows_query = query.reshape(3 * 2, -1, 32)
                    for layer in cache.layers:
                        expected = listed_pages(layer._decode_table(rows_query, layer.plan))
                        assert listed_pages(layer._fused_table(rows_query, layer.plan)) == expected, (unstable, reduce)


def check_transfers() -> None:
    """Promotions and tail retirements through the zero-copy kernel leave the state torch indexing leaves."""
    from flexicache import FlexiCache, HeadProfile, offload

    torch.cuda.synchronize = lambda *args, **kwargs: None  # the kernel runs on CPU tensors here
    model = tiny_model()
    profile = HeadProfile(num_layers=2, num_kv_heads=2, head_dim=32, unstable_heads=[(0, 1)])
    ids, mask = padded_batch()
    results = {}
    original_init = offload.OffloadedPages.__init__
    for zero_copy in (True, False):
        def init(self, *args, zero_copy=zero_copy, **kwargs):
            original_init(self, *args, **kwargs)
            self.zero_copy = zero_copy

        offload.OffloadedPages.__init__ = init
        cache = FlexiCache.from_model(model, profile=profile, token_budget=64)
        with torch.inference_mode():
            out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=40, do_sample=False,
                                 output_logits=True, return_dict_in_generate=True)
        layers = [layer for layer in cache.layers if layer.offloaded is not None]
        assert all(layer.offloaded.zero_copy is zero_copy for layer in layers)
        state = [tensor.clone() for layer in layers for tensor in
                 (layer.offloaded.selected, layer.pool.k, layer.pool.v, layer.offloaded.host.k, layer.offloaded.host.v)]
        results[zero_copy] = torch.stack(out.logits), state, cache.stats()
    assert torch.equal(results[True][0], results[False][0])
    assert all(torch.equal(a, b) for a, b in zip(results[True][1], results[False][1]))
    assert results[True][2]["promoted_pages"] == results[False][2]["promoted_pages"] > 0
    assert results[True][2]["bytes_d2h"] == results[False][2]["bytes_d2h"] > 0


if __name__ == "__main__":
    {"table": check_table, "transfers": check_transfers}[sys.argv[1]]()
