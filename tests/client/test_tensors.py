"""torch <-> wire bytes for every dtype the contract stores (kvcraft.layout.DTYPES)."""

from __future__ import annotations

import gc
import struct

import numpy as np
import pytest
import torch

from kvclient.tensors import TORCH_DTYPE, from_bytes, from_message, spec_of, to_bytes
from kvcraft.layout import DTYPES, spec_bytes


def reference_bytes(t: torch.Tensor) -> bytes:
    """Row-major little-endian bytes, packed value by value with struct (not through torch)."""
    values = t.float().flatten().tolist()  # exact: every fp16 / bf16 value is a float32
    if t.dtype == torch.float16:
        return struct.pack(f"<{len(values)}e", *values)
    f32 = struct.pack(f"<{len(values)}f", *values)
    if t.dtype == torch.float32:
        return f32
    return b"".join(f32[i + 2 : i + 4] for i in range(0, len(f32), 4))  # bf16 = high half of float32


def test_each_contract_dtype_has_the_torch_dtype_of_its_name_and_size():
    assert set(TORCH_DTYPE) == {d.wire for d in DTYPES}
    for d in DTYPES:
        t = TORCH_DTYPE[d.wire]
        assert str(t) == f"torch.{d.name}"
        assert torch.empty(0, dtype=t).element_size() == d.itemsize


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_round_trip_is_bit_exact_and_sized_as_the_layout_says(dtype):
    t = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(0)).to(dtype)
    t[0, 0, 0] = float("nan")
    t[1, 4, 2] = float("-inf")
    spec, data = spec_of(t), to_bytes(t)
    assert len(data) == spec_bytes(spec, "key_spec", tokens=5)
    assert data == reference_bytes(t)
    back = from_bytes(spec, data)
    assert back.dtype == dtype and back.shape == t.shape
    assert torch.equal(back.view(torch.uint8), t.view(torch.uint8))


def test_unstorable_tensors_are_refused_by_name():
    with pytest.raises(ValueError, match="not storable"):
        spec_of(torch.zeros(1, 2, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match=r"\[kv_heads, tokens, head_dim\]"):
        spec_of(torch.zeros(2, 3))


def _address(buf) -> int:
    return np.frombuffer(buf, dtype=np.uint8).ctypes.data


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_a_received_message_becomes_tensors_without_a_copy_when_aligned(dtype):
    """FetchLayers K and V alias the received message (the client's decode copies
    nothing); bytes misaligned for the dtype are copied once, never viewed misaligned."""
    t = torch.randn(2, 5, 3, generator=torch.Generator().manual_seed(1)).to(dtype)
    spec, data = spec_of(t), to_bytes(t)
    itemsize = t.element_size()
    for pad in range(8):
        message = bytes(pad) + data + b"tail"  # a message: fields before and after the tensor
        view = memoryview(message)[pad : pad + len(data)]
        got = from_message(spec, view)
        assert got.dtype == dtype and got.shape == t.shape
        assert torch.equal(got.view(torch.uint8), t.view(torch.uint8))
        assert got.data_ptr() % itemsize == 0
        aligned = (_address(message) + pad) % itemsize == 0
        assert (got.data_ptr() == _address(message) + pad) == aligned  # aliased exactly when aligned
        got.view(torch.uint8).reshape(-1)[0] = 7  # writable, and only this tensor's bytes change
        assert message[-4:] == b"tail" and message[:pad] == bytes(pad)
        del view, message
        gc.collect()  # the tensor holds the message
        assert torch.equal(got.view(torch.uint8).reshape(-1)[1:], t.view(torch.uint8).reshape(-1)[1:])


def test_a_message_of_the_wrong_size_is_refused():
    spec = spec_of(torch.zeros(2, 5, 3))
    with pytest.raises(RuntimeError):
        from_message(spec, memoryview(bytes(2 * 5 * 3 * 4 - 4)))
    with pytest.raises(RuntimeError):
        from_message(spec, memoryview(b""))
