"""FlashInferBackend.prepare re-plans only when the plan can change, with a stand-in for FlashInfer's wrapper (runs
without FlashInfer and without a GPU; the GPU tests check the real kernel against the reference backend over many
steps that skip the plan)."""

from __future__ import annotations

import contextlib
import sys
from types import SimpleNamespace

import pytest
import torch

from flexicache.backends import build_decode_layout
from flexicache.backends.flashinfer import FlashInferBackend


class RecordingWrapper:
    """Records ``plan`` calls; like FlashInfer's CUDA-graph mode, a plan copies ``last_page_len`` into the buffer,
    and into a buffer of the wrapper's own (FlashInfer's stages its schedule in one)."""

    def __init__(self, workspace, kv_layout, use_cuda_graph, use_tensor_cores, paged_kv_indptr_buffer,
                 paged_kv_indices_buffer, paged_kv_last_page_len_buffer, backend) -> None:
        self.last_page_len = paged_kv_last_page_len_buffer
        self.staged = torch.zeros_like(paged_kv_last_page_len_buffer)
        self.plans: list[torch.Tensor] = []

    def plan(self, indptr, indices, last_page_len, *args, **kwargs) -> None:
        self.plans.append(indptr.clone())
        self.staged.copy_(last_page_len)
        self.last_page_len.copy_(last_page_len)


def stand_in_backend(monkeypatch: pytest.MonkeyPatch, version: str) -> FlashInferBackend:
    monkeypatch.setitem(sys.modules, "flashinfer", SimpleNamespace(BatchDecodeWithPagedKVCacheWrapper=RecordingWrapper,
                                                                   __version__=version))
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: self)  # no pinned memory without a GPU
    return FlashInferBackend(torch.device("cpu"))


@pytest.fixture
def backend(monkeypatch: pytest.MonkeyPatch) -> FlashInferBackend:
    return stand_in_backend(monkeypatch, "0.7.2.post1")


def prepare(backend: FlashInferBackend, num_tokens: list[int], group: int = 4, scale: float = 0.1):
    layout = build_decode_layout(torch.tensor(num_tokens), num_kv_heads=2, pages_per_head=4, page_size=16)
    return backend.prepare(layout, group, 64, 16, 4, torch.bfloat16, scale), layout


@pytest.mark.parametrize("group", [2, 4, 7], ids=["cuda-cores", "tensor-cores", "tensor-cores-only"])
def test_same_page_counts_refresh_the_last_pages_without_a_plan(backend: FlashInferBackend, group: int) -> None:
    planned, _ = prepare(backend, [100, 70], group=group)  # 4 pages each (the budget)
    assert len(planned.wrapper.plans) == 1
    for tokens in ([101, 71], [112, 80], [113, 81]):  # still 4 pages each, tails of 1..16 tokens
        again, layout = prepare(backend, tokens, group=group)
        assert again is planned and len(planned.wrapper.plans) == 1
        assert torch.equal(planned.last_page_len, layout.row_last_page_len_host)


def test_new_page_counts_settings_or_kernel_plan_again(backend: FlashInferBackend) -> None:
    planned, _ = prepare(backend, [20, 70])  # 2 and 4 pages
    prepare(backend, [33, 71])  # the first row grows to 3 pages
    assert len(planned.wrapper.plans) == 2
    prepare(backend, [34, 72], scale=0.2)  # other settings
    assert len(planned.wrapper.plans) == 3
    cuda_cores, _ = prepare(backend, [34, 72], group=2)  # the CUDA-core kernel: its own wrapper and plan
    assert cuda_cores is not planned and len(cuda_cores.wrapper.plans) == 1
    assert not backend._tensor_cores(2) and backend._tensor_cores(4) and backend._tensor_cores(7)


@pytest.mark.parametrize("version", ["0.8.0", "0.6.9", ""])
def test_unverified_flashinfer_releases_plan_every_step(monkeypatch: pytest.MonkeyPatch, version: str) -> None:
    backend = stand_in_backend(monkeypatch, version)
    planned, _ = prepare(backend, [100, 70])
    for tokens in ([101, 71], [112, 80]):  # the same page counts: a verified release would skip these plans
        again, layout = prepare(backend, tokens)
        assert torch.equal(again.last_page_len, layout.row_last_page_len_host)
    assert len(planned.wrapper.plans) == 3


def test_a_backend_made_in_inference_mode_plans_in_every_mode(monkeypatch: pytest.MonkeyPatch) -> None:
    """The backend is shared by every cache of the process: one made under ``torch.inference_mode`` (as warm_up
    makes it) must plan, re-plan and refresh its buffers under ``no_grad``, plain mode and inference mode again,
    in any order (an inference tensor refuses in-place writes outside inference mode)."""
    with torch.inference_mode():
        backend = stand_in_backend(monkeypatch, "0.7.2.post1")
        planned, _ = prepare(backend, [100, 70])
    for step, mode in enumerate((torch.no_grad, contextlib.nullcontext, torch.inference_mode, torch.no_grad)):
        with mode():
            again, layout = prepare(backend, [101 + step, 71])  # the same page counts: a refresh in place
            assert again is planned and torch.equal(planned.last_page_len, layout.row_last_page_len_host)
            prepare(backend, [20 + 16 * step, 70])  # other page counts: plan() writes the buffers
    assert len(planned.wrapper.plans) == 5


class Owner:
    """A layer storage's stand-in: what a split's plan belongs to (``head_budgets="prompt"``)."""


def test_each_split_keeps_its_own_plan_and_a_step_copies_its_last_pages_once(backend: FlashInferBackend,
                                                                           monkeypatch: pytest.MonkeyPatch) -> None:
    """Two layers with their own splits of the pages: a wrapper and a plan each (a captured decode replays its own),
    one buffer of last-page lengths (the same in every layer) copied once per step; a dropped owner's wrapper goes
    (by reference counting)."""
    import weakref

    copies: list[int] = []
    monkeypatch.setattr(torch.Tensor, "pin_memory", lambda self: copies.append(1) or self)
    owners = [Owner(), Owner(), Owner()]
    limits = [torch.tensor([4, 2, 3, 3]), torch.tensor([2, 4, 4, 2]), torch.tensor([4, 2, 3, 3])]  # [B * H] each
    for tokens in ([100, 70], [101, 71], [102, 72]):
        layouts = [build_decode_layout(torch.tensor(tokens), 2, 4, 16, limit) for limit in limits]
        planned = [backend.prepare(layout, 4, 64, 16, 4, torch.bfloat16, 0.1, owner=owner)
                   for layout, owner in zip(layouts, owners, strict=True)]
        assert all(torch.equal(p.last_page_len, layouts[0].row_last_page_len_host) for p in planned)
    assert len({id(p) for p in planned}) == 3  # an equal split (the third) keeps its own wrapper too
    assert planned[0].last_page_len is planned[1].last_page_len is planned[2].last_page_len
    assert [len(p.wrapper.plans) for p in planned] == [1, 1, 1]  # the later steps refresh the lengths only
    assert [plan.tolist() for plan in planned[1].wrapper.plans] == [[0, 2, 6, 10, 12]]
    assert copies == [1, 1]  # one copy per refreshing step, whatever the number of splits
    dropped = weakref.ref(planned[0])
    del planned, owners[0], layouts
    backend.prepare(build_decode_layout(torch.tensor([103, 73]), 2, 4, 16, limits[1]), 4, 64, 16, 4, torch.bfloat16,
                    0.1, owner=owners[0])  # the backend's last plan no longer the dropped owner's
    assert dropped() is None
