"""Page boxes in the principal axes of each head's prompt keys (``principal_bounds``): the axes, the boxes they
give, the generation at a covering budget, padding, and a real effect on page scores."""

from __future__ import annotations

import pytest
import torch
from conftest import (
    Driver,
    assert_batch_matches_alone,
    assert_same_generation,
    check_layer_state,
    checked,
    mixed_profile,
    random_prompt,
    tiny_config,
    tiny_model,
)

from flexicache import FlexiCache, HeadProfile
from flexicache.key_basis import ORTHONORMAL_TOLERANCE, KeyBasis, symmetric_eigenvectors
from flexicache.selection import quest_page_scores


def test_axes_are_orthonormal_and_diagonalise_each_rows_real_keys() -> None:
    generator = torch.Generator().manual_seed(0)
    keys = torch.randn(2, 3, 40, 6, generator=generator, dtype=torch.float64) @ torch.randn(6, 6, generator=generator,
                                                                                          dtype=torch.float64)
    valid = torch.ones(2, 40, dtype=torch.bool)
    valid[1, :15] = False  # left padding: its keys must not count
    keys[1, :, :15] = 1e6
    basis = KeyBasis.principal_axes(keys, valid)
    assert basis.matrix.shape == (2, 3, 6, 6) and basis.matrix.dtype == torch.float64
    for b, start in ((0, 0), (1, 15)):
        for h in range(3):
            axes = basis.matrix[b, h]
            torch.testing.assert_close(axes.T @ axes, torch.eye(6, dtype=torch.float64))
            real = keys[b, h, start:] - keys[b, h, start:].mean(0)
            spread = axes.T @ (real.T @ real) @ axes
            torch.testing.assert_close(spread, torch.diag(spread.diagonal()), atol=1e-8, rtol=0)


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
@pytest.mark.parametrize("dtype", [torch.float32, torch.float64])
def test_the_fast_cuda_basis_is_orthonormal_and_as_tight_as_eighs(dtype: torch.dtype) -> None:
    generator = torch.Generator(device="cuda").manual_seed(3)
    spread = torch.logspace(1, -3, 128, device="cuda", dtype=dtype)
    keys = torch.randn(64, 1024, 128, generator=generator, device="cuda", dtype=dtype) * spread
    keys = keys @ torch.linalg.qr(torch.randn(128, 128, generator=generator, device="cuda", dtype=dtype)).Q
    short = torch.randn(3, 20, 128, generator=generator, device="cuda", dtype=dtype)  # rank 19: eigh's fallback
    covariances = torch.cat([keys.mT @ keys, short.mT @ short, torch.zeros(1, 128, 128, device="cuda", dtype=dtype)])
    fast = symmetric_eigenvectors(covariances)
    identity = torch.eye(128, device="cuda", dtype=dtype)
    assert float((fast.mT @ fast - identity).abs().max()) <= (1e-5 if dtype == torch.float32 else ORTHONORMAL_TOLERANCE)
    exact = torch.linalg.eigh(covariances[:64]).eigenvectors

    def widths(axes: torch.Tensor) -> torch.Tensor:  # the summed box widths: what |q| . radius weighs
        pages = torch.bmm(keys, axes).unflatten(1, (64, 16))
        return (pages.amax(2) - pages.amin(2)).sum(-1).mean()

    torch.testing.assert_close(widths(fast[:64]), widths(exact), rtol=1e-3, atol=0)
    assert float(widths(exact)) < 0.6 * float(widths(identity.expand(64, 128, 128)))  # the axes matter here


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_half_precision_keys_get_axes_as_tight_as_float32_keys() -> None:
    """bf16 keys on CUDA: covariances from tensor-core products of the rounded centred keys, keys turned in bf16;
    the axes are orthonormal and the page boxes as tight as those of the same keys in float32."""
    generator = torch.Generator(device="cuda").manual_seed(4)
    spread = torch.logspace(1, -2, 128, device="cuda")
    keys = torch.randn(2, 4, 2048, 128, generator=generator, device="cuda") * spread + 3.0  # far from centred
    keys = (keys @ torch.linalg.qr(torch.randn(128, 128, generator=generator, device="cuda")).Q).bfloat16()
    half, full = KeyBasis.principal_axes(keys, None), KeyBasis.principal_axes(keys.float(), None)
    assert half.matrix.dtype == torch.float32
    identity = torch.eye(128, device="cuda")
    assert float((half.matrix.mT @ half.matrix - identity).abs().max()) <= 1e-5
    turned = half.chunk(keys)
    assert turned.dtype == torch.bfloat16
    exact = keys.float() @ half.matrix
    assert float((turned.float() - exact).abs().max()) <= 1e-2 * float(exact.abs().max())  # bf16 rounding

    def widths(turned_keys: torch.Tensor) -> torch.Tensor:
        pages = turned_keys.float().unflatten(2, (128, 16))
        return (pages.amax(3) - pages.amin(3)).sum(-1).mean()

    torch.testing.assert_close(widths(turned), widths(full.chunk(keys.float())), rtol=1e-2, atol=0)


def test_scores_are_the_box_scores_of_the_turned_keys_and_turning_keeps_dot_products() -> None:
    generator = torch.Generator().manual_seed(1)
    keys = torch.randn(1, 2, 32, 8, generator=generator, dtype=torch.float64)
    basis = KeyBasis.principal_axes(keys, None)
    query = torch.randn(2, 3, 8, generator=generator, dtype=torch.float64)  # rows (0, h), group 3
    turned_keys, turned_query = basis.chunk(keys)[0], basis.rows(query)
    torch.testing.assert_close(turned_query @ turned_keys.transpose(1, 2), query @ keys[0].transpose(1, 2))
    torch.testing.assert_close(basis.token(keys[:, :, 5]), turned_keys[:, 5].unsqueeze(0))
    pages = turned_keys.view(2, 4, 8, 8)
    scores = quest_page_scores(turned_query, pages.amin(2), pages.amax(2))
    exact = torch.einsum("rgd,rpsd->rgps", query, keys[0].view(2, 4, 8, 8)).amax(dim=(1, 3))
    assert bool((scores >= exact - 1e-12).all())  # still an upper bound in the turned axes


def test_principal_boxes_are_tighter_on_correlated_keys() -> None:
    generator = torch.Generator().manual_seed(2)
    mixing = torch.randn(16, 16, generator=generator, dtype=torch.float64)
    keys = (torch.randn(1, 1, 256, 16, generator=generator, dtype=torch.float64)
            * torch.logspace(0, -2, 16, dtype=torch.float64)) @ mixing
    basis = KeyBasis.principal_axes(keys, None)
    query = torch.randn(1, 1, 16, generator=generator, dtype=torch.float64)
    plain = keys[0].view(1, 16, 16, 16)
    turned = basis.chunk(keys)[0].view(1, 16, 16, 16)
    exact = torch.einsum("rgd,rpsd->rps", query, plain).amax(-1)
    loose = quest_page_scores(query, plain.amin(2), plain.amax(2)) - exact
    tight = quest_page_scores(basis.rows(query), turned.amin(2), turned.amax(2)) - exact
    assert float(tight.mean()) < 0.5 * float(loose.mean())


def test_covering_budget_generates_what_dynamic_cache_generates() -> None:
    config = tiny_config(group=2, num_kv_heads=2, num_layers=3)
    model = tiny_model(config, seed=3)
    ids = random_prompt(33, seed=4).view(1, -1)
    cache = assert_same_generation(model, ids, None, 20, profile=mixed_profile(config), token_budget=64,
                                                page_size=8, principal_bounds=True)
    assert cache.layers[0].storage.basis is not None


def test_left_padded_batch_equals_each_request_alone() -> None:
    config = tiny_config(group=2, num_kv_heads=2, num_layers=2)
    model = tiny_model(config, seed=5)
    assert_batch_matches_alone(model, [random_prompt(50, seed=6), random_prompt(23, seed=7)],
                               profile=mixed_profile(config), token_budget=16, page_size=4, principal_bounds=True)


def test_stored_boxes_follow_the_turned_keys_through_decode() -> None:
    config = tiny_config(group=2, num_kv_heads=2, num_layers=2, head_dim=8)
    cache = checked(FlexiCache(config, profile=HeadProfile(2, 2, 8, [(0, 1)]), token_budget=12, page_size=4,
                               principal_bounds=True))
    driver = Driver(config, cache, seed=8)
    driver.prefill([30, 19])
    for _ in range(9):
        driver.decode()
    check_layer_state(driver, cache)
    stats = cache.stats()
    basis_bytes = sum(layer.storage.basis.nbytes for layer in cache.layers)
    assert stats["device_metadata_bytes"] >= basis_bytes > 0
