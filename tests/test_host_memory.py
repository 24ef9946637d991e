"""The host tier's page-locked memory (flexicache.host_memory) with CUDA's registration calls recorded: exact size,
zero fill, one registration of the whole mapping, unregistration once no view is left, a clear error when refused.
The real registration runs in tests/test_gpu_flashinfer.py."""

from __future__ import annotations

import pytest
import torch

from flexicache.host_memory import pinned_zeros


class FakeCudart:
    def __init__(self, register_result: int = 0) -> None:
        self.register_result = register_result
        self.registered: list[tuple[int, int, int]] = []
        self.unregistered: list[int] = []

    def cudaHostRegister(self, address: int, size: int, flags: int) -> int:
        self.registered.append((address, size, flags))
        return self.register_result

    def cudaHostUnregister(self, address: int) -> int:
        self.unregistered.append(address)
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
    monkeypatch.setattr(torch.cuda, "synchronize", lambda device=None: None)
    return fake


def test_pinned_zeros_registers_exactly_its_bytes_and_unregisters_after_the_last_view(cudart: FakeCudart) -> None:
    tensor = pinned_zeros((2, 3, 5, 4, 8), torch.bfloat16)
    assert tensor.shape == (2, 3, 5, 4, 8) and tensor.dtype == torch.bfloat16 and not tensor.any()
    nbytes = 2 * 3 * 5 * 4 * 8 * 2
    assert cudart.registered == [(tensor.data_ptr(), nbytes, 3)]  # portable | mapped
    tensor[1, 2] = 7  # ordinary writable host memory
    view, address = tensor[1], tensor.data_ptr()
    del tensor
    assert cudart.unregistered == []
    assert float(view[2].float().sum()) == 7 * 5 * 4 * 8
    del view
    assert cudart.unregistered == [address]


def test_empty_tier_is_not_registered(cudart: FakeCudart) -> None:
    assert pinned_zeros((4, 2, 0, 16, 64), torch.float16).shape == (4, 2, 0, 16, 64)
    assert cudart.registered == []


def test_refused_registration_says_what_to_change(cudart: FakeCudart) -> None:
    cudart.register_result = 2  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match=r"page-lock 0\.00 GiB .*ulimit -l.*batch size or context"):
        pinned_zeros((64, 64), torch.float32)
    assert cudart.unregistered == []  # never registered: nothing to undo

