"""Page-locking (cudaHostRegister) of memory kvcraft did not allocate with torch: the
engine's mapping of the host slab. The CUDA runtime is a fake here; the real one runs
on a GPU host (test at the end)."""

from __future__ import annotations

from multiprocessing import resource_tracker, shared_memory

import pytest
import torch

from kvclient import copy_stream
from kvclient.local import SharedSlab


class FakeCudart:
    def __init__(self) -> None:
        self.registered: dict[int, int] = {}
        self.flags: list[int] = []

    def cudaHostRegister(self, ptr: int, nbytes: int, flags: int) -> int:  # noqa: N802 - CUDA's name
        assert ptr not in self.registered, "registered twice"
        self.registered[ptr] = nbytes
        self.flags.append(flags)
        return 0

    def cudaHostUnregister(self, ptr: int) -> int:  # noqa: N802
        del self.registered[ptr]
        return 0


@pytest.fixture
def cudart(monkeypatch: pytest.MonkeyPatch) -> FakeCudart:
    fake = FakeCudart()
    monkeypatch.setattr(copy_stream.torch.cuda, "is_available", lambda: True)
    monkeypatch.setattr(copy_stream.torch.cuda, "cudart", lambda: fake)
    return fake


def test_the_engine_pins_its_mapping_of_the_slab_and_unpins_on_close(cudart: FakeCudart) -> None:
    shm = shared_memory.SharedMemory(create=True, size=3 * 4096)
    try:
        slab = SharedSlab(shm.name)
        mapped = torch.frombuffer(slab._shm.buf, dtype=torch.uint8)  # noqa: SLF001
        assert cudart.registered == {mapped.data_ptr(): 3 * 4096}
        assert cudart.flags == [1]  # cudaHostRegisterPortable: pinned for every context
        del mapped
        slab.close()
        assert cudart.registered == {}
    finally:
        # SharedSlab told this process's resource tracker to forget the segment (it is
        # normally the service's); tell it again, so the unlink below is tracked cleanly.
        resource_tracker.register(shm._name, "shared_memory")  # noqa: SLF001
        shm.close()
        shm.unlink()


def test_a_failed_registration_is_an_error_naming_the_size(cudart: FakeCudart, monkeypatch) -> None:  # noqa: ANN001
    monkeypatch.setattr(cudart, "cudaHostRegister", lambda ptr, n, flags: 2)  # cudaErrorMemoryAllocation
    with pytest.raises(RuntimeError, match="cudaHostRegister of 64 bytes failed"):
        copy_stream.pin_host_memory(torch.zeros(16))


def test_without_cuda_nothing_is_pinned() -> None:
    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    assert copy_stream.pin_host_memory(torch.zeros(16)) is None


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_pinned_mapping_copies_bit_identical() -> None:
    t = torch.randint(0, 255, (1 << 20,), dtype=torch.uint8)
    undo = copy_stream.pin_host_memory(t)
    try:
        assert torch.equal(t.to("cuda", non_blocking=True).cpu(), t)
    finally:
        undo()
