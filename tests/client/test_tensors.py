"""torch <-> wire bytes for every dtype the contract stores (kvcraft.layout.DTYPES)."""

from __future__ import annotations

import gc
import struct

import numpy as np
import pytest
import torch

from kvclient.tensors import TORCH_DTYPE, from_bytes, from_message, message_tensors, spec_of, to_bytes
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
    kept = []
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
        kept.append(got)
        del view, message
    gc.collect()  # the tensors hold their messages (one collection: each took ~0.5 s in the suite)
    for got in kept:
        assert torch.equal(got.view(torch.uint8).reshape(-1)[1:], t.view(torch.uint8).reshape(-1)[1:])


def test_a_message_of_the_wrong_size_is_refused():
    spec = spec_of(torch.zeros(2, 5, 3))
    with pytest.raises(RuntimeError):
        from_message(spec, memoryview(bytes(2 * 5 * 3 * 4 - 4)))
    with pytest.raises(RuntimeError):
        from_message(spec, memoryview(b""))


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16, torch.float32])
def test_ranges_of_one_message_become_tensors_aliased_exactly_when_aligned(dtype):
    """message_tensors (the FetchLayers client's K and V): each range as from_message
    makes it: equal to the reference bytes, aliasing the message when aligned, one copy
    otherwise, writable without touching anything outside its range, holding the message."""
    g = torch.Generator().manual_seed(2)
    k, v = torch.randn(2, 5, 3, generator=g).to(dtype), torch.randn(2, 5, 3, generator=g).to(dtype)
    kb, vb = reference_bytes(k), reference_bytes(v)
    itemsize = k.element_size()
    kept = []
    for pad in range(8):
        for gap in range(4):
            message = bytes(pad) + kb + bytes(gap) + vb + b"tail"
            parts = ((spec_of(k), pad, len(kb)), (spec_of(v), pad + len(kb) + gap, len(vb)))
            got = message_tensors(message, parts)
            for t, want, (_, offset, _) in zip(got, (k, v), parts):
                assert t.dtype == dtype and t.shape == want.shape
                assert torch.equal(t.view(torch.uint8), want.view(torch.uint8))
                assert t.data_ptr() % itemsize == 0
                aligned = (_address(message) + offset) % itemsize == 0
                assert (t.data_ptr() == _address(message) + offset) == aligned
            got[0].view(torch.uint8).reshape(-1)[0] ^= 0xFF  # only K's first byte changes
            assert message[:pad] == bytes(pad) and message[-4:] == b"tail"
            assert torch.equal(got[1].view(torch.uint8), v.view(torch.uint8))
            kept.append(got)
            del message
    gc.collect()  # the tensors hold their messages (one collection: each took ~0.5 s in the suite)
    for got in kept:
        assert torch.equal(got[0].view(torch.uint8).reshape(-1)[1:], k.view(torch.uint8).reshape(-1)[1:])
        assert torch.equal(got[1].view(torch.uint8), v.view(torch.uint8))


def test_ranges_of_the_wrong_size_or_dtype_are_refused():
    spec = spec_of(torch.zeros(2, 5, 3))  # float32, 120 bytes
    message = bytes(256)
    for n in (116, 118, 124, 0):  # fewer or more whole values, not whole values, nothing
        with pytest.raises(RuntimeError):
            message_tensors(message, [(spec, 8, n)])
    bad = spec_of(torch.zeros(2, 5, 3))
    bad.dtype = 99
    with pytest.raises(ValueError, match="unknown dtype 99"):
        message_tensors(message, [(bad, 8, 120)])
