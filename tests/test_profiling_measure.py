"""Measurement: the probe attention function, page metadata, cache-identical selection, the decode loop."""

from __future__ import annotations

import functools
import math

import pytest
import torch
from transformers import LlamaConfig, LlamaForCausalLM
from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

from flexicache.profiling.measure import MeasureSettings, select_by_attention, select_by_quest, trace_batch
from flexicache.profiling.pages import PageBounds, page_attention_mass, page_bounds
from flexicache.profiling.probe import PROBE_NAME, QueryRecorder, probing


@pytest.fixture(scope="module")
def model() -> LlamaForCausalLM:
    torch.manual_seed(0)
    config = LlamaConfig(
        vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
        num_key_value_heads=2, head_dim=8, max_position_embeddings=1024, pad_token_id=0,
    )
    return LlamaForCausalLM(config).to(torch.float64).eval()


def _logits(model, ids, mask=None):
    with torch.no_grad():
        return model(input_ids=ids, attention_mask=mask).logits


def test_probe_is_transparent_and_restores_implementation(model):
    ids = torch.randint(1, 64, (2, 20), generator=torch.Generator().manual_seed(1))
    reference = _logits(model, ids)
    assert model.config._attn_implementation == "sdpa"
    with probing(model, QueryRecorder(prefill_tail=5)) as recorder:
        assert model.config._attn_implementation == PROBE_NAME
        probed = _logits(model, ids)
        queries = recorder.pop()
    assert model.config._attn_implementation == "sdpa"
    torch.testing.assert_close(probed, reference)
    assert sorted(queries) == [0, 1] and queries[0].shape == (2, 4, 5, 8)


def test_probe_mask_keeps_left_padded_rows_exact(model):
    """Left padding through the probe gives each row the logits it gets alone (the mask function is registered)."""
    generator = torch.Generator().manual_seed(2)
    short, long = torch.randint(1, 64, (1, 9), generator=generator), torch.randint(1, 64, (1, 14), generator=generator)
    batch = torch.cat([torch.cat([torch.zeros(1, 5, dtype=torch.long), short], 1), long])
    mask = torch.ones_like(batch)
    mask[0, :5] = 0
    with probing(model, QueryRecorder()):
        padded = _logits(model, batch, mask)[:, -1]
        alone = torch.cat([_logits(model, short)[:, -1], _logits(model, long)[:, -1]])
    torch.testing.assert_close(padded, alone)


def test_recorded_query_has_rope_applied(model):
    ids = torch.randint(1, 64, (1, 12), generator=torch.Generator().manual_seed(3))
    captured = {}
    attention = model.model.layers[1].self_attn
    handle = attention.q_proj.register_forward_hook(lambda m, i, o: captured.setdefault("q", o))
    try:
        with probing(model, QueryRecorder(prefill_tail=12)) as recorder:
            _logits(model, ids)
            query = recorder.pop()[1]
    finally:
        handle.remove()
    raw = captured["q"].view(1, 12, 4, 8).transpose(1, 2)
    cos, sin = model.model.rotary_emb(raw, torch.arange(12)[None])
    expected, _ = apply_rotary_pos_emb(raw, raw, cos, sin)
    torch.testing.assert_close(query, expected)
    assert not torch.allclose(query, raw)


def test_page_bounds_incremental_equals_one_shot():
    generator = torch.Generator().manual_seed(4)
    keys = torch.randn(2, 3, 50, 8, generator=generator)
    bounds = PageBounds(keys[..., :21, :], page_size=16, capacity_tokens=24)  # forces a regrow
    for t in range(21, 50):
        bounds.append(keys[..., t, :])
    kmin, kmax = page_bounds(keys, 16)
    assert bounds.num_pages == math.ceil(50 / 16)
    torch.testing.assert_close(bounds.bounds(), (kmin, kmax), rtol=0, atol=0)
    assert torch.equal(kmin[..., 3, :], keys[..., 48:, :].amin(-2))


def _page_mass_reference(query: torch.Tensor, key: torch.Tensor, first: int, page_size: int) -> torch.Tensor:
    """:func:`page_attention_mass` written plainly in float64: ``[H, w, P]``."""
    num_heads, length, head_dim = key.shape
    group = query.shape[0] // num_heads
    mass = torch.zeros(num_heads, query.shape[1], math.ceil(length / page_size), dtype=torch.float64)
    for head in range(num_heads):
        for w in range(query.shape[1]):
            for q_head in range(head * group, (head + 1) * group):
                seen = first + w + 1
                logits = key[head, :seen].double() @ query[q_head, w].double() / math.sqrt(head_dim)
                for t, share in enumerate(logits.softmax(dim=0).tolist()):
                    mass[head, w, t // page_size] += share / group
    return mass


@pytest.mark.parametrize("length, first, page_size", [(37, 30, 8), (40, 20, 8), (33, 0, 4), (16, 15, 16)])
def test_page_attention_mass_matches_causal_attention_written_plainly(length, first, page_size):
    generator = torch.Generator().manual_seed(length)
    query, key = torch.randn(6, 5, 16, generator=generator) * 2, torch.randn(2, length, 16, generator=generator) * 2
    width = min(5, length - first)
    expected = _page_mass_reference(query[:, :width], key, first, page_size)
    mass = page_attention_mass(query[:, :width], key, first, page_size)
    assert mass.dtype == torch.float32
    torch.testing.assert_close(mass.double(), expected, atol=1e-6, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_page_attention_mass_of_16_bit_keys_on_cuda_is_float32s(dtype):
    """16-bit queries and keys multiply on tensor cores into float32 logits: the float32 path's result on the same
    (exactly converted) values, up to the order of the sums."""
    generator = torch.Generator().manual_seed(0)
    query = (torch.randn(32, 16, 128, generator=generator) * 2).to(dtype).cuda()
    key = (torch.randn(8, 3001, 128, generator=generator) * 2).to(dtype).cuda()
    mass = page_attention_mass(query, key, 2990, 8)
    expected = page_attention_mass(query.float(), key.float(), 2990, 8)
    assert mass.dtype == torch.float32 and mass.shape == (8, 16, 376)
    torch.testing.assert_close(mass, expected, atol=1e-6, rtol=1e-4)
    reference = _page_mass_reference(query[:, :2].cpu(), key.cpu(), 2990, 8)
    torch.testing.assert_close(mass[:, :2].double().cpu(), reference, atol=1e-5, rtol=0)


def test_select_by_quest_matches_brute_force():
    generator = torch.Generator().manual_seed(5)
    batch, heads, group, length, dim, page, k = 2, 2, 3, 100, 8, 16, 4
    query = torch.randn(batch, heads * group, dim, generator=generator, dtype=torch.float64)
    keys = torch.randn(batch, heads, length, dim, generator=generator, dtype=torch.float64)
    kmin, kmax = page_bounds(keys, page)
    pages = select_by_quest(query, kmin, kmax, k)
    num_pages = kmin.shape[2]
    for b in range(batch):
        for h in range(heads):
            q = query[b, h * group : (h + 1) * group]  # [G, D]
            bound = torch.maximum(q[:, None] * kmax[b, h][None], q[:, None] * kmin[b, h][None]).sum(-1).amax(0)
            middle = bound[1:-1].topk(k - 2).indices + 1
            expected = sorted([0, num_pages - 1, *middle.tolist()])
            assert pages[b, h].tolist() == expected


def test_select_by_attention_picks_the_heavy_pages():
    keys = torch.zeros(1, 1, 80, 4, dtype=torch.float64)
    keys[0, 0, 35, 0] = 10.0  # page 2
    keys[0, 0, 50, 0] = 9.0  # page 3
    query = torch.tensor([[[1.0, 0, 0, 0]]], dtype=torch.float64)
    pages = select_by_attention(query, keys, scaling=1.0, page_size=16, k=3)
    assert pages.tolist() == [[[0, 2, 4]]]  # sink, heaviest page, tail
    assert select_by_attention(query, keys, 1.0, 16, k=4).tolist() == [[[0, 2, 3, 4]]]


def test_trace_batch_layout_and_batch_invariance(model):
    generator = torch.Generator().manual_seed(6)
    prompts = torch.randint(1, 64, (2, 70), generator=generator)
    settings = MeasureSettings(token_budget=48, page_size=16, steps=40, online_window=8, attention_mass=True)
    traces = trace_batch(model, prompts, settings, tasks=["x", "y"])
    alone = trace_batch(model, prompts[1:], settings)[0]
    assert [t.task for t in traces] == ["x", "y"]
    trace = traces[1]
    k = settings.k
    assert trace.pages.shape == (40, 2, 2, k) and trace.pages.dtype == torch.int16
    expected_pages = [math.ceil((70 + step + 1) / 16) for step in range(40)]
    assert trace.num_pages.tolist() == expected_pages
    assert (trace.pages[..., 0] == 0).all()  # sink
    assert (trace.pages[..., -1] == trace.num_pages.view(-1, 1, 1) - 1).all()  # tail
    assert (trace.pages.diff(dim=-1) > 0).all()  # ascending, distinct
    assert torch.equal(trace.pages, alone.pages) and torch.equal(trace.attention_pages, alone.attention_pages)
    assert trace.prompt_estimate.shape == (2, 2)
    torch.testing.assert_close(trace.prompt_estimate, alone.prompt_estimate)


def test_trace_batch_teacher_forcing_feeds_the_continuation(model):
    generator = torch.Generator().manual_seed(7)
    prompt = torch.randint(1, 64, (1, 60), generator=generator)
    continuation = torch.randint(1, 64, (1, 20), generator=generator)
    settings = MeasureSettings(token_budget=32, page_size=16, steps=20, online_window=0)
    forced = trace_batch(model, prompt, settings, continuation)[0]
    # The same sets come from prefilling prompt + continuation[:s] and selecting with the query of token s.
    full = torch.cat([prompt, continuation], 1)
    with probing(model, QueryRecorder(prefill_tail=20)) as recorder:
        out = model(input_ids=full, use_cache=True)
        queries = recorder.pop()
    for step in (0, 7, 19):
        length = 61 + step
        layer_keys = out.past_key_values.layers[1].keys[:, :, :length]
        kmin, kmax = page_bounds(layer_keys, 16)
        expected = select_by_quest(queries[1][:, :, step], kmin, kmax, settings.k)
        assert forced.pages[step, 1].tolist() == expected[0].tolist()
    assert forced.prompt_estimate is None


def test_ban_token_ids_are_never_generated(model):
    prompt = torch.randint(1, 64, (1, 40), generator=torch.Generator().manual_seed(8))
    settings = MeasureSettings(token_budget=32, steps=10, online_window=0)
    generated = []
    original_forward = model.forward

    @functools.wraps(original_forward)
    def spy(*args, **kwargs):
        generated.append(kwargs["input_ids"][:, -1].tolist())
        return original_forward(*args, **kwargs)

    model.forward = spy
    try:
        trace_batch(model, prompt, settings)
        first_run = generated[1:]
        generated.clear()
        banned = sorted({token for row in first_run for token in row})
        banning = MeasureSettings(token_budget=32, steps=10, online_window=0, ban_token_ids=tuple(banned))
        trace_batch(model, prompt, banning)
    finally:
        del model.forward
    assert not {token for row in generated[1:] for token in row} & set(banned)


@pytest.mark.parametrize(
    ("kwargs", "message"),
    [({"page_size": 12}, "power of two"), ({"token_budget": 16}, "sink and tail"), ({"steps": 1}, "steps")],
)
def test_settings_validation(kwargs, message):
    with pytest.raises(ValueError, match=message):
        MeasureSettings(**kwargs).validate()
