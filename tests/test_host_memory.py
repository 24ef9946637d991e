"""The host tier's page-locked memory (flexicache.host_memory) with CUDA's registration calls recorded: exact size,
zero fill, one registration of the whole mapping, unregistration once no view is left, a clear error when refused.
The real registration runs in tests/test_gpu_flashinfer.py."""

from __future__ import annotations

import gc
import os

import pytest
import torch

from flexicache.host_memory import pinned_zeros


class FakeCudart:
    """CUDA's registration calls and device synchronisations, recorded in order (``calls``)."""

    def __init__(self, register_result: int = 0) -> None:
        self.register_result = register_result
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []
        self.calls: list[str] = []

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        self.registered.append((address, size, flags))
        self.calls.append("register")
        return self.register_result

    def cudaHostUnregister(self, address: int) -> int:
        self.unregistered.append(address)
        self.calls.append("unregister")
        return 0

    def cudaGetLastError(self) -> int:
        self.calls.append("clear error")
        return 0


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()

    def check_error(result: int) -> None:
        if result:
            raise RuntimeError(f"CUDA error {result}")

    monkeypatch.setattr(torch.cuda, "cudart", lambda: fake)
    monkeypatch.setattr(torch.cuda, "check_error", check_error)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: False)
    monkeypatch.setattr(torch.cuda, "device_count", lambda: 3)
    monkeypatch.setattr(torch._C, "_cuda_hasPrimaryContext", lambda device: device != 1, raising=False)
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: fake.calls.append(f"synchronize {device}"))
    return fake


def test_pinned_zeros_registers_exactly_its_bytes_and_unregisters_after_the_last_view(cudart: FakeCudart) -> None:
    tensor = pinned_zeros((2, 3, 5, 4, 8), torch.bfloat16)
    assert tensor.shape == (2, 3, 5, 4, 8) and tensor.dtype == torch.bfloat16 and not tensor.any()
    nbytes = 2 * 3 * 5 * 4 * 8 * 2
    assert cudart.registered == [(tensor.data_ptr(), nbytes, 3)]  # portable | mapped
    tensor[1, 2] = 7  # ordinary writable host memory
    view, address = tensor[1], tensor.data_ptr()
    del tensor
    gc.collect()
    assert cudart.calls == ["register"]  # a view still uses it
    assert float(view[2].float().sum()) == 7 * 5 * 4 * 8
    del view
    # every started device's kernels that may still use it are waited for before the memory is unregistered and
    # unmapped; device 1 (no context in this process) is not started by waiting on it
    assert cudart.calls == ["register", "synchronize 0", "synchronize 2", "unregister"]
    assert cudart.unregistered == [address]


def test_no_wait_while_a_cuda_graph_is_being_captured(cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch) -> None:
    tensor = pinned_zeros((16,), torch.float32)
    monkeypatch.setattr(torch.cuda, "is_current_stream_capturing", lambda: True)
    del tensor
    assert cudart.calls == ["register", "unregister"]


def test_unregistered_even_when_waiting_fails(cudart: FakeCudart, monkeypatch: pytest.MonkeyPatch) -> None:
    def failing_synchronize(device=None) -> None:
        raise RuntimeError("CUDA error: device-side assert triggered")

    tensor = pinned_zeros((16,), torch.float32)
    monkeypatch.setattr(torch.cuda, "synchronize", failing_synchronize)
    del tensor  # the memory is unregistered anyway
    assert cudart.calls == ["register", "unregister"]


def test_a_forked_child_leaves_the_parents_registration_alone(cudart: FakeCudart,
                                                               monkeypatch: pytest.MonkeyPatch) -> None:
    tensor = pinned_zeros((16,), torch.float32)
    monkeypatch.setattr(os, "getpid", lambda: -1)  # as seen from another process
    del tensor
    assert cudart.calls == ["register"]


def test_empty_tier_is_not_registered(cudart: FakeCudart) -> None:
    assert pinned_zeros((4, 2, 0, 16, 64), torch.float16).shape == (4, 2, 0, 16, 64)
    assert cudart.registered == []


def test_refused_registration_says_what_to_change(cudart: FakeCudart) -> None:
    cudart.register_result = 2  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError,
                       match=r"page-lock 0\.00 GiB .*ulimit -l.*batch size, the context or the cache.s max_cache_len"):
        pinned_zeros((64, 64), torch.float32)
    gc.collect()
    assert cudart.calls == ["register", "clear error"]  # never registered: nothing to undo

