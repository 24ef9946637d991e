"""Shared helpers of the core test suite: tiny random models, a layer-by-layer driver and independent references.

Everything here runs on the CPU in seconds. The references (page min/max, Quest scores, top-K, masked softmax) are
written from the DESIGN document, not from the library code, so a test compares two independent computations.
"""

from __future__ import annotations

import contextlib
import importlib.util
import itertools

import math
import os
from dataclasses import dataclass, field

import pytest
import torch
from hypothesis import HealthCheck, settings
from transformers import (
    DynamicCache,
    LlamaConfig,
    LlamaForCausalLM,
    MistralConfig,
    MistralForCausalLM,
    Qwen2Config,
    Qwen2ForCausalLM,
)

import flexicache  # noqa: F401  (registers the "flexicache" attention)
from flexicache import FlexiCache, HeadProfile, head_budgets
from flexicache.attention import flexicache_attention_forward
from flexicache.head_budgets import row_bounds, split_budget

# Tiny tensors: intra-op threads only add hand-off latency (milliseconds per op on a busy 2-core runner).
torch.set_num_threads(int(os.environ.get("FLEXICACHE_TEST_THREADS", "1")))

settings.register_profile(
    "core", max_examples=int(os.environ.get("FLEXICACHE_HYPOTHESIS_EXAMPLES", "40")), deadline=None,
    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large], print_blob=True,
)
settings.load_profile("core")

# The fast CUDA path (FlashInfer decode, Triton kernels, whole-step graphs) needs both packages: without them a CUDA
# cache runs the torch reference backend and records no graphs, so tests of that path skip rather than fail.
needs_fast_cuda_path = pytest.mark.skipif(
    not torch.cuda.is_available() or importlib.util.find_spec("flashinfer") is None
    or importlib.util.find_spec("triton") is None, reason="needs CUDA with FlashInfer and Triton (the fast CUDA path)")


# The slowest files, slowest first (seconds on one core of a 2-core runner: 507, 257, 244, 163, 159, 113). The test
# workers take whole files in collection order (pyproject: --dist loadfile --no-loadscope-reorder): handed out
# first, these run beside the many short files instead of alone at the end.
SLOWEST_FILES = ("test_triton_interpreted.py", "test_triton_interpreted_steps.py", "test_notebooks.py",
                 "test_gemma3_270m.py", "test_eval_scripts.py", "test_examples.py")


def pytest_collection_modifyitems(items: list[pytest.Item]) -> None:
    rank = {name: position for position, name in enumerate(SLOWEST_FILES)}
    items.sort(key=lambda item: rank.get(item.path.name, len(rank)))  # stable: each file keeps its own order


def pytest_configure(config: pytest.Config) -> None:
    # transformers 5.24 renamed generate(past_key_values=) to cache=; the old spelling (used here, works on 5.17+)
    # only warns.
    config.addinivalue_line("filterwarnings", "ignore:`past_key_values` is deprecated:FutureWarning")


# ------------------------------------------------------------------------------------------------- tiny models

FAMILIES = {
    "llama": (LlamaConfig, LlamaForCausalLM, {}),
    "mistral": (MistralConfig, MistralForCausalLM, {"sliding_window": None}),
    "qwen2": (Qwen2Config, Qwen2ForCausalLM, {"use_sliding_window": False}),
}


def tiny_config(family: str = "llama", group: int = 2, num_kv_heads: int = 2, num_layers: int = 3,
                head_dim: int = 8, vocab_size: int = 97, **overrides):
    """A small random decoder config with ``num_attention_heads = group * num_kv_heads``."""
    config_class, _, extra = FAMILIES[family]
    num_heads = group * num_kv_heads
    kwargs = {
        "vocab_size": vocab_size, "hidden_size": num_heads * head_dim, "intermediate_size": 48, "num_hidden_layers": num_layers,
        "num_attention_heads": num_heads, "num_key_value_heads": num_kv_heads, "head_dim": head_dim,
        "max_position_embeddings": 2048, "initializer_range": 0.2, "tie_word_embeddings": False, "pad_token_id": 0,
        "bos_token_id": 1, "eos_token_id": None,
    }
    kwargs.update(extra)
    kwargs.update(overrides)
    return config_class(**kwargs)


def tiny_model(config, seed: int = 0, dtype: torch.dtype = torch.float64):
    """A random model of ``config`` in eval mode, ``dtype`` (fp64 by default: exactness tests)."""
    _, model_class, _ = FAMILIES[config.model_type]
    torch.manual_seed(seed)
    model = model_class(config).eval().to(dtype)
    model.generation_config.pad_token_id = 0
    model.generation_config.eos_token_id = None
    return model


def mixed_profile(config, unstable=None) -> HeadProfile:
    """Layer 0 all unstable, the last layer all stable, the layers between mixed (even heads unstable)."""
    num_layers, num_kv = config.num_hidden_layers, config.num_key_value_heads
    if unstable is None:
        unstable = [(0, head) for head in range(num_kv)]
        unstable += [(layer, head) for layer in range(1, num_layers - 1) for head in range(0, num_kv, 2)]
    return HeadProfile(num_layers=num_layers, num_kv_heads=num_kv, head_dim=config.head_dim, unstable_heads=unstable)


def left_pad(prompts: list[torch.Tensor], pad_id: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """``(input_ids, attention_mask)`` of 1-D prompts, left-padded to the longest."""
    length = max(p.numel() for p in prompts)
    ids = torch.full((len(prompts), length), pad_id, dtype=torch.long)
    mask = torch.zeros(len(prompts), length, dtype=torch.long)
    for row, prompt in enumerate(prompts):
        ids[row, length - prompt.numel():] = prompt
        mask[row, length - prompt.numel():] = 1
    return ids, mask


def random_prompt(length: int, seed: int, vocab_size: int = 97) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    return torch.randint(2, vocab_size, (length,), generator=generator)


def greedy(model, ids, cache, mask=None, max_new_tokens: int = 8, logits: bool = False):
    """Greedy ``generate``; returns the sequences, or ``(sequences, [step logits])`` when ``logits``."""
    if mask is None:
        mask = torch.ones_like(ids)
    out = model.generate(ids, attention_mask=mask, past_key_values=cache, max_new_tokens=max_new_tokens,
                         do_sample=False, num_beams=1, return_dict_in_generate=True, output_logits=logits)
    if logits:
        return out.sequences, list(out.logits)
    return out.sequences


def dense_cache(model) -> DynamicCache:
    return DynamicCache(config=model.config)


def dynamic_cache_bytes(cache: DynamicCache) -> int:
    return sum(layer.keys.nbytes + layer.values.nbytes for layer in cache.layers)


# ------------------------------------------------------------------------------------ driving layers directly


class FakeAttention(torch.nn.Module):
    """What the flexicache attention function reads from a transformers attention module."""

    def __init__(self, layer_idx: int, groups: int) -> None:
        super().__init__()
        self.layer_idx = layer_idx
        self.num_key_value_groups = groups
        self.is_causal = True
        self.eval()


def chunk_mask(attention_mask: torch.Tensor, length: int) -> torch.Tensor:
    """4-D bool mask ``[B, 1, T, L]`` of the last ``length`` positions of a 2-D mask ``[B, L]`` (causal + padding)."""
    total = attention_mask.shape[1]
    past = total - length
    rows = torch.arange(length).view(-1, 1) + past
    causal = torch.arange(total).view(1, -1) <= rows
    mask = causal.unsqueeze(0) & attention_mask.bool().view(-1, 1, total)
    # A padded query row may attend to nothing; let it see itself (its output is never used) to avoid NaNs.
    mask |= (torch.arange(total).view(1, -1) == rows).unsqueeze(0) & ~mask.any(-1, keepdim=True)
    return mask.unsqueeze(1)


@dataclass
class Driver:
    """Feeds random q/k/v chunks to a FlexiCache (and a DynamicCache) like a decoder forward does.

    For every chunk and every layer: ``cache.update(k, v, layer)``, then the flexicache attention function. The
    DynamicCache receives the same keys/values: it is the dense reference of every token's K/V.
    """

    config: object
    cache: FlexiCache
    dtype: torch.dtype = torch.float64
    seed: int = 0
    attention_mask: torch.Tensor | None = None  # [B, L] 1 = real
    outputs: list = field(default_factory=list)  # per layer: attention output of the last chunk
    queries: list = field(default_factory=list)  # per layer: queries of the last chunk

    def __post_init__(self) -> None:
        self.dense = DynamicCache(config=self.config)
        self.generator = torch.Generator().manual_seed(self.seed)
        self.num_layers = self.config.num_hidden_layers
        self.num_kv = self.config.num_key_value_heads
        self.group = self.config.num_attention_heads // self.num_kv
        self.head_dim = self.config.head_dim
        self.modules = [FakeAttention(i, self.group) for i in range(self.num_layers)]

    def randn(self, *shape) -> torch.Tensor:
        return torch.randn(*shape, generator=self.generator, dtype=torch.float64).to(self.dtype)

    def chunk(self, new_mask: torch.Tensor, q=None, k=None, v=None) -> None:
        """Run one chunk whose 2-D mask is ``new_mask [B, T]``; q/k/v: per-layer lists, random when ``None``."""
        batch, length = new_mask.shape
        self.attention_mask = new_mask if self.attention_mask is None else torch.cat(
            [self.attention_mask, new_mask], dim=1)
        mask = chunk_mask(self.attention_mask, length)
        self.outputs, self.queries = [], []
        for layer in range(self.num_layers):
            query = q[layer] if q is not None else self.randn(batch, self.num_kv * self.group, length, self.head_dim)
            key = k[layer] if k is not None else self.randn(batch, self.num_kv, length, self.head_dim)
            value = v[layer] if v is not None else self.randn(batch, self.num_kv, length, self.head_dim)
            self.dense.update(key, value, layer)
            full_key, full_value = self.cache.update(key, value, layer)
            out, _ = flexicache_attention_forward(self.modules[layer], query, full_key, full_value, mask,
                                                  scaling=self.head_dim ** -0.5)
            self.outputs.append(out)
            self.queries.append(query)

    def prefill(self, lengths: list[int], **kw) -> None:
        total = max(lengths)
        mask = torch.zeros(len(lengths), total, dtype=torch.long)
        for row, length in enumerate(lengths):
            mask[row, total - length:] = 1
        self.chunk(mask, **kw)

    def decode(self, **kw) -> None:
        self.chunk(torch.ones(self.attention_mask.shape[0], 1, dtype=torch.long), **kw)

    # cache operations, applied to both caches and to the attention mask
    def crop(self, tokens: int) -> None:
        self.cache.crop(-tokens)
        self.dense.crop(-tokens)
        self.attention_mask = self.attention_mask[:, : self.attention_mask.shape[1] - tokens]

    def select(self, indices: torch.Tensor) -> None:
        self.cache.batch_select_indices(indices)
        self.dense.batch_select_indices(indices)
        self.attention_mask = self.attention_mask[indices]

    def repeat(self, repeats: int) -> None:
        self.cache.batch_repeat_interleave(repeats)
        self.dense.batch_repeat_interleave(repeats)
        self.attention_mask = self.attention_mask.repeat_interleave(repeats, dim=0)

    # -------------------------------------------------------------------------------- reference views

    def real_positions(self, batch: int) -> torch.Tensor:
        return self.attention_mask[batch].nonzero().view(-1)

    def real_kv(self, layer: int, batch: int) -> tuple[torch.Tensor, torch.Tensor]:
        """``[H, n, D]`` keys and values of request ``batch``'s real tokens, from the DynamicCache."""
        positions = self.real_positions(batch)
        dense = self.dense.layers[layer]
        return dense.keys[batch][:, positions], dense.values[batch][:, positions]


# ----------------------------------------------------------------------------------- independent references


def page_minmax(keys: torch.Tensor, page_size: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Element-wise ``(min, max)`` of each page of ``keys [n, D]``: ``[ceil(n / ps), D]`` each."""
    pages = [keys[start:start + page_size] for start in range(0, keys.shape[0], page_size)]
    return (torch.stack([p.min(dim=0).values for p in pages]), torch.stack([p.max(dim=0).values for p in pages]))


def brute_quest(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, reduce: str = "max",
                spread: float = 1.0) -> torch.Tensor:
    """``[P]`` box scores of one row: ``query [G, D]``, page bounds ``[P, D]``, loops over elements; ``spread``
    weighs each element's half-width (1: Quest's bound, the larger corner product)."""
    scores = torch.empty(kmin.shape[0], dtype=torch.float64)
    for page in range(kmin.shape[0]):
        per_head = []
        for g in range(query.shape[0]):
            total = 0.0
            for d in range(query.shape[1]):
                qd, low, high = float(query[g, d]), float(kmin[page, d]), float(kmax[page, d])
                if spread == 1.0:
                    total += max(qd * high, qd * low)
                else:
                    total += qd * (high + low) / 2 + spread * abs(qd) * (high - low) / 2
            per_head.append(total)
        scores[page] = max(per_head) if reduce == "max" else sum(per_head)
    return scores


def reference_topk(scores: torch.Tensor, num_pages: int, k: int, force_last: bool) -> list[int]:
    """Pages chosen by the DESIGN rule: sink (and tail) forced, then the highest scores, ascending."""
    if num_pages <= k:
        return list(range(num_pages))
    forced = {0} | ({num_pages - 1} if force_last else set())
    rest = sorted((p for p in range(num_pages) if p not in forced), key=lambda p: -float(scores[p]))
    return sorted(forced | set(rest[: k - len(forced)]))


def masked_attention(query: torch.Tensor, keys: torch.Tensor, values: torch.Tensor, scale: float) -> torch.Tensor:
    """Plain softmax attention ``query [G, D]`` over ``keys/values [n, D]`` in fp64: ``[G, D]``."""
    logits = query.double() @ keys.double().T * scale
    return torch.softmax(logits, dim=-1) @ values.double()


def cdiv(a: int, b: int) -> int:
    return -(-a // b)





class ContractBackend:
    """The torch reference backend, checking on every call the contract the FlashInfer backend relies on.

    Every row lists exactly ``layout`` pages (``min(K, pages)`` of its request), full pages first, the tail page
    (``last_page_len`` tokens) last, and every listed slot is a valid pool slot.
    """

    name = "reference"

    def __init__(self) -> None:
        from flexicache.backends import ReferenceBackend

        self.inner = ReferenceBackend()
        self.calls = 0

    def paged_decode(self, query, pool_k, pool_v, slots, page_lens, scale, layout):
        page_size = pool_k.shape[1]
        counts = (layout.row_indptr_host[1:] - layout.row_indptr_host[:-1]).tolist()
        assert slots.shape == page_lens.shape and slots.shape[0] == query.shape[0] == len(counts)
        for row in range(slots.shape[0]):
            lens = page_lens[row][page_lens[row] > 0].tolist()
            assert len(lens) == counts[row], f"row {row} lists {len(lens)} pages, the layout says {counts[row]}"
            assert lens[-1] == int(layout.row_last_page_len_host[row]), f"row {row}: tail not last"
            assert all(length == page_size for length in lens[:-1]), f"row {row}: partial page before the tail"
            listed = slots[row][page_lens[row] > 0]
            assert bool((listed >= 0).all()) and bool((listed < pool_k.shape[0]).all())
            assert listed.unique().numel() == listed.numel(), f"row {row} lists a slot twice"
        self.calls += 1
        return self.inner.paged_decode(query, pool_k, pool_v, slots, page_lens, scale, layout)


def checked(cache: FlexiCache) -> FlexiCache:
    """``cache`` decoding on the CPU through :class:`ContractBackend`."""
    cache.backends[torch.device("cpu")] = ContractBackend()
    return cache


def assert_same_generation(model, ids, mask, max_new_tokens, atol=1e-10, **settings) -> FlexiCache:
    """Greedy ``generate`` with ``FlexiCache.from_model(model, **settings)`` (torch reference backend) gives
    DynamicCache's tokens and, to ``atol``, its logits at every step; returns the cache."""
    reference, reference_logits = greedy(model, ids, dense_cache(model), mask, max_new_tokens, logits=True)
    cache = checked(FlexiCache.from_model(model, **settings))
    tokens, logits = greedy(model, ids, cache, mask, max_new_tokens, logits=True)
    assert torch.equal(tokens, reference)
    assert len(logits) == len(reference_logits) == max_new_tokens
    for step, (ours, theirs) in enumerate(zip(logits, reference_logits)):
        torch.testing.assert_close(ours, theirs, rtol=0, atol=atol, msg=f"decode step {step}")
    stats = cache.stats()
    assert stats["decode_steps"] == max_new_tokens - 1 and stats["backend"] == "reference"
    assert cache.backends[torch.device("cpu")].calls == (max_new_tokens - 1) * model.config.num_hidden_layers
    return cache


def assert_batch_matches_alone(model, prompts: list[torch.Tensor], max_new_tokens: int = 12, **settings) -> None:
    """A left-padded batch of ``prompts`` generates, greedily with ``FlexiCache.from_model(model, **settings)``
    (checked), the tokens each prompt generates alone."""
    ids, mask = left_pad(prompts)
    batch = greedy(model, ids, checked(FlexiCache.from_model(model, **settings)), mask=mask,
                   max_new_tokens=max_new_tokens)
    for row, prompt in enumerate(prompts):
        alone = greedy(model, prompt.view(1, -1), checked(FlexiCache.from_model(model, **settings)),
                       max_new_tokens=max_new_tokens)
        assert torch.equal(batch[row, -max_new_tokens:], alone[0, -max_new_tokens:]), row


# ------------------------------------------------------------------------------- state and output checks


def page_bounds(layer, head: int) -> tuple[torch.Tensor, torch.Tensor]:
    """``(kmin, kmax)`` ``[B, P, D]`` the layer stores for KV head ``head``."""
    return layer.storage.meta.kmin[:, head], layer.storage.meta.kmax[:, head]


def check_layer_state(driver: Driver, cache: FlexiCache, settled: bool = True) -> None:
    """Every invariant of the stored pages, layer by layer, against the DynamicCache reference.

    ``settled=False`` right after a crop/reorder: the stable heads have no selection until the next decode step.
    """
    page_size = cache.settings.page_size
    batch = driver.attention_mask.shape[0]
    for layer_idx, layer in enumerate(cache.layers):
        dense = driver.dense.layers[layer_idx]
        keys, values = layer.read_logical()
        assert keys.shape == dense.keys.shape and keys.dtype == dense.keys.dtype
        real = driver.attention_mask.bool()
        for b in range(batch):
            positions = real[b].nonzero().view(-1)
            assert torch.equal(keys[b][:, positions], dense.keys[b][:, positions]), (layer_idx, b)
            assert torch.equal(values[b][:, positions], dense.values[b][:, positions]), (layer_idx, b)
            assert not keys[b][:, ~real[b]].any(), "padding reads back as zero"
            real_keys, real_values = driver.real_kv(layer_idx, b)
            n = real_keys.shape[1]
            num_pages, full_pages = cdiv(n, page_size), (n - 1) // page_size
            for head in range(driver.num_kv):
                stored_min, stored_max = page_bounds(layer, head)
                basis = layer.storage.basis
                if basis is None:
                    kmin, kmax = page_minmax(real_keys[head], page_size)
                    assert torch.equal(stored_min[b, :num_pages], kmin), (layer_idx, b, head)
                    assert torch.equal(stored_max[b, :num_pages], kmax), (layer_idx, b, head)
                else:  # boxes in the principal axes: rotated chunk by chunk, so equal up to rounding
                    kmin, kmax = page_minmax(real_keys[head] @ basis.matrix[b, head].to(real_keys.dtype), page_size)
                    # a few roundings of the key dtype (float32: 1e-7 seen; float64 rounds far below 1e-12)
                    tol = 1e-12 if kmin.dtype == torch.float64 else 8 * torch.finfo(kmin.dtype).resolution
                    torch.testing.assert_close(stored_min[b, :num_pages], kmin, rtol=tol, atol=tol)
                    torch.testing.assert_close(stored_max[b, :num_pages], kmax, rtol=tol, atol=tol)
            if layer.storage.offloaded is None:
                continue
            off = layer.storage.offloaded
            for local, head in enumerate(layer.stable_heads):
                row = b * len(layer.stable_heads) + local
                chosen = [p for p in off.selected[row].tolist() if p >= 0]
                assert len(chosen) == len(set(chosen)) and all(0 <= p < full_pages for p in chosen), chosen
                if full_pages >= 1 and settled:
                    assert 0 in chosen, f"sink missing from stable head {head} of layer {layer_idx}: {chosen}"
                for slot, page in enumerate(off.selected[row].tolist()):
                    if page < 0:
                        continue
                    span = slice(page * page_size, (page + 1) * page_size)
                    slot_index = off.base + row * off.slots_per_row + slot
                    assert torch.equal(off.pool.k[slot_index], real_keys[head, span]), (layer_idx, b, page)
                    assert torch.equal(off.pool.v[slot_index], real_values[head, span]), (layer_idx, b, page)
                tail = off.pool.k[off.base + (row + 1) * off.slots_per_row - 1]
                last_len = n - (num_pages - 1) * page_size
                assert torch.equal(tail[:last_len], real_keys[head, (num_pages - 1) * page_size:]), "tail slot"
                # the host tier holds every full page exactly
                host_k = off.host.k[b, local, :full_pages].reshape(-1, real_keys.shape[-1])
                assert torch.equal(host_k, real_keys[head, : full_pages * page_size])
    assert cache.get_seq_length() == driver.dense.get_seq_length()


def quest(query: torch.Tensor, kmin: torch.Tensor, kmax: torch.Tensor, reduce: str, spread: float = 1.0
          ) -> torch.Tensor:
    """``[P]``: per element ``q * centre + spread * |q| * half-width`` of the page's box (``spread = 1``:
    ``max(q * kmax, q * kmin)``), summed over d, then reduced over the group ``query [G, D]``."""
    if spread == 1.0:
        per_head = torch.maximum(query[:, None] * kmax[None], query[:, None] * kmin[None]).sum(-1)  # [G, P]
    else:
        centre, half_width = (kmax + kmin) / 2, (kmax - kmin) / 2
        per_head = (query[:, None] * centre[None] + spread * query[:, None].abs() * half_width[None]).sum(-1)
    return per_head.amax(0) if reduce == "max" else per_head.sum(0)


def expected_decode(driver: Driver, cache: FlexiCache, layer_idx: int, reranked: bool) -> torch.Tensor:
    """``[B, 1, Hq, D]`` expected decode output of one layer after the last decode step."""
    layer = cache.layers[layer_idx]
    settings = cache.settings
    page_size, reduce = settings.page_size, settings.group_reduce
    query = driver.queries[layer_idx][:, :, 0].double()  # [B, Hq, D]
    batch, num_query_heads, head_dim = query.shape
    group = num_query_heads // driver.num_kv
    expected = torch.empty(batch, num_query_heads, head_dim, dtype=torch.float64)
    for b in range(batch):
        keys, values = driver.real_kv(layer_idx, b)
        n = keys.shape[1]
        num_pages, full_pages = cdiv(n, page_size), (n - 1) // page_size
        for head in range(driver.num_kv):
            k = int(layer.storage.row_pages_host[b * driver.num_kv + head])  # the row's own K (head_budgets)
            q = query[b, head * group:(head + 1) * group]
            axes = torch.eye(head_dim, dtype=torch.float64)
            if layer.storage.basis is not None:  # boxes in the cache's axes (checked in test_key_basis)
                axes = layer.storage.basis.matrix[b, head].double()
            kmin, kmax = page_minmax(keys[head].double() @ axes, page_size)
            scores = quest(q @ axes, kmin, kmax, reduce, settings.spread_weight)

            def exact_mass(pages: list[int]) -> torch.Tensor:
                """``[len(pages)]`` each page's share of the attention over ``pages``, summed over the group."""
                logits = [q @ keys[head, p * page_size:(p + 1) * page_size].double().T * head_dim ** -0.5
                          for p in pages]
                page_mass = torch.stack([lg.logsumexp(-1) for lg in logits], dim=1)  # [G, W]
                return (page_mass - page_mass.logsumexp(-1, keepdim=True)).exp().sum(0)

            if head in layer.unstable_heads:
                pages = reference_topk(scores, num_pages, k, force_last=True)
                if settings.exact_rescore and num_pages > k:  # the K of most mass among the candidates
                    candidates = reference_topk(scores, num_pages, settings.exact_candidates * settings.pages_per_head,
                                                force_last=True)
                    chosen = reference_topk(exact_mass(candidates), len(candidates), k, force_last=True)
                    pages = [candidates[column] for column in chosen]
            else:
                offloaded = layer.storage.offloaded
                row = b * len(layer.stable_heads) + layer.stable_heads.index(head)
                held = offloaded.selected[row].tolist()
                working = sorted(p for p in held if p >= 0)
                assert len(set(working)) == len(working), f"layer {layer_idx} request {b}: a page held twice"
                if reranked:
                    assert working == reference_topk(scores[:full_pages], full_pages, len(held), force_last=False), (
                        f"layer {layer_idx} request {b} stable head {head}: rerank is not the Quest top-K")
                assert len(working) == min(len(held), full_pages), "stable head holds fewer pages than it may"
                # With standby pages: the K - 1 best held slots for this step's query (sink first, ties to the lower
                # slot); without, every held page.
                step_scores = dict(enumerate(scores.tolist()))  # by page; exact_rescore: the held pages' masses
                if settings.exact_rescore and working:
                    step_scores = dict(zip(working, exact_mass(working).tolist()))
                ranked = sorted((slot for slot, p in enumerate(held) if p >= 0),
                                key=lambda slot: (-(math.inf if held[slot] == 0 else step_scores[held[slot]]), slot))
                pages = sorted(held[slot] for slot in ranked[:k - 1]) + [num_pages - 1]
            if num_pages <= k:
                assert pages == list(range(num_pages)), "budget covers the context: every page attended"
            tokens = torch.cat([torch.arange(p * page_size, min((p + 1) * page_size, n)) for p in pages])
            expected[b, head * group:(head + 1) * group] = masked_attention(
                q, keys[head, tokens], values[head, tokens], head_dim ** -0.5)
    return expected.unsqueeze(1)


def skewed_row_pages(gains: torch.Tensor, settings, unstable_heads: list[int], shift: int = 0) -> torch.Tensor:
    """``head_budgets="prompt"``'s split (:func:`flexicache.head_budgets.prompt_row_pages`) made uneven: head ``h``
    gains as much as ``(h + shift) % H + 1``, so it takes pages from the heads of lower numbers (a random model splits
    evenly)."""
    batch, heads, _ = gains.shape
    unstable = torch.zeros(heads, dtype=torch.bool)
    unstable[unstable_heads] = True
    weight = (torch.arange(heads, dtype=torch.float32) + shift) % heads + 1
    favour = weight.view(-1, 1) / torch.arange(1, 65).view(1, -1)
    return split_budget(favour, heads * settings.pages_per_head, *row_bounds(settings, unstable)).repeat(batch, 1)


@contextlib.contextmanager
def skewed_head_budgets():
    """Caches with ``head_budgets="prompt"`` split their pages by :func:`skewed_row_pages`, shifted by one head at each
    layer's split (neighbouring layers split differently: each keeps its own plan)."""
    original = head_budgets.prompt_row_pages
    calls = itertools.count()
    head_budgets.prompt_row_pages = lambda gains, settings, unstable_heads: skewed_row_pages(
        gains, settings, unstable_heads, next(calls))
    try:
        yield
    finally:
        head_budgets.prompt_row_pages = original
