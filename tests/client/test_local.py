"""KVClient.fetch_local (same-host fast path) against the real server."""

from __future__ import annotations

import pytest
import torch

from kvclient.client import KVClient
from kvcraft.keys import ModelSpec
from kvcraft.v1 import kvcraft_pb2 as pb
from tests.conftest import random_layers

MODEL_SHAPE = dict(num_layers=3, num_kv_heads=1, head_dim=8, dtype="bfloat16")  # `model`: the same under a name of its own
MODEL = ModelSpec("local-test", **MODEL_SHAPE).fingerprint()


def test_fetch_local_tensors_alias_the_stored_bytes_until_released(shared_server, model):
    layers = random_layers(5, (1, 9, 8), 3, torch.bfloat16)
    with KVClient(shared_server.address) as c:
        r = c.store(model, list(range(9)), layers)
        with c.fetch_local([r.chunk_key]) as got:
            lease_id = got.lease_id
            assert got.variant_ids == [r.variant_id]
            for (gk, gv), (wk, wv) in zip(got.layers[0], layers, strict=True):
                assert gk.dtype == torch.bfloat16 and gk.shape == wk.shape
                assert torch.equal(gk.view(torch.uint8), wk.view(torch.uint8))
                assert torch.equal(gv.view(torch.uint8), wv.view(torch.uint8))
            slab = next(iter(c.core.mappings()._slabs.values()))  # noqa: SLF001 - the mapping fetch_local opened
            bad = pb.VariantLocation()
            bad.CopyFrom(got.locations[0])
            bad.length -= 2
            with pytest.raises(ValueError, match="do not match its specs"):
                slab.layers(bad)
        assert not c.release(lease_id)  # leaving the block released it


def test_a_lease_is_held_for_its_ttl_whatever_the_wall_clock_does(shared_server, model, monkeypatch):
    """The service ends a lease by elapsed time; the client counts it the same way: the wall
    clock stepped an hour forward under it leaves it held, one hour back does not keep it past
    its ttl (the bytes its tensors alias may be moved then)."""
    import time

    from tests.conftest import wait_for

    real = time.time
    with KVClient(shared_server.address) as c:
        r = c.store(model, list(range(100, 109)), random_layers(6, (1, 9, 8), 3, torch.bfloat16))
        with c.fetch_local([r.chunk_key], ttl_s=2.0) as got:
            assert got.held()
            monkeypatch.setattr(time, "time", lambda: real() + 3600.0)
            assert got.held()
            monkeypatch.setattr(time, "time", lambda: real() - 3600.0)
            wait_for(lambda: not got.held(), "the lease's end, 2 s after it was taken", timeout=10.0)
            monkeypatch.setattr(time, "time", real)
            assert not c.release(got.lease_id)  # the service ended it too


def test_a_locate_from_another_service_instance_retires_the_old_mapping():
    from multiprocessing import shared_memory

    from kvclient.local import LocalMappings

    old, new = (shared_memory.SharedMemory(create=True, size=64) for _ in range(2))
    m = LocalMappings()
    try:
        first, _ = m.of(pb.LocateResponse(instance_id="one", segment=old.name))
        assert m.of(pb.LocateResponse(instance_id="one", segment=old.name))[0] is first  # mapped once
        second, _ = m.of(pb.LocateResponse(instance_id="two", segment=new.name))
        assert second.segment == new.name
        assert first._shm.buf is None  # noqa: SLF001 - unmapped: never read again
        # the same name from a new instance is mapped anew, not served by the old mapping
        third, _ = m.of(pb.LocateResponse(instance_id="three", segment=new.name))
        assert third is not second
    finally:
        m.close()
        for s in (old, new):
            s.close()
            s.unlink()


def test_a_retired_mapping_stays_mapped_while_a_tensor_aliases_it():
    """Unmapping memory a tensor still points at lets the next allocation land there: the
    tensor then reads (and a write through it corrupts) whatever lives there now."""
    import gc
    from multiprocessing import shared_memory

    from kvclient.local import LocalMappings

    old, new = (shared_memory.SharedMemory(create=True, size=1 << 20) for _ in range(2))
    m = LocalMappings()
    try:
        k, v = torch.arange(64, dtype=torch.float32).view(2, 4, 8), torch.full((2, 4, 8), 7.0)
        old.buf[:256], old.buf[256:512] = k.numpy().tobytes(), v.numpy().tobytes()
        loc = pb.VariantLocation(variant_id="v", offset=0, length=512, num_layers=1,
                                 key_spec=pb.TensorSpec(dtype=pb.FLOAT32, shape=[2, 4, 8]),
                                 value_spec=pb.TensorSpec(dtype=pb.FLOAT32, shape=[2, 4, 8]))
        slab, _ = m.of(pb.LocateResponse(instance_id="one", segment=old.name))
        (key, value), = slab.layers(loc)
        m.of(pb.LocateResponse(instance_id="two", segment=new.name))  # the service restarted: retired
        del slab
        gc.collect()
        filler = [torch.ones(1 << 18) for _ in range(64)]  # new allocations, to land where an unmapped slab was
        assert torch.equal(key, k) and torch.equal(value, v)
        del filler, key, value
    finally:
        m.close()
        gc.collect()
        for s in (old, new):
            s.close()
            s.unlink()


def test_offsets_outside_the_segment_are_refused(shared_server, model):
    layers = [(torch.zeros(1, 9, 8).bfloat16(), torch.zeros(1, 9, 8).bfloat16())] * 3
    with KVClient(shared_server.address) as c:
        r = c.store(model, list(range(9)), layers)
        with c.fetch_local([r.chunk_key]) as got:
            slab = next(iter(c.core.mappings()._slabs.values()))  # noqa: SLF001
            bad = pb.VariantLocation()
            bad.CopyFrom(got.locations[0])
            bad.offset = slab._shm.size  # noqa: SLF001
            with pytest.raises(ValueError, match="outside segment"):
                slab.layers(bad)


def test_a_locate_answer_this_process_cannot_map_raises_and_frees_its_lease(kvserver):
    """A service on another host answers Locate with a segment this host does not have:
    fetch_local raises what mapping it raised and releases the lease at once, instead of
    holding the variants until the lease's ttl."""
    layers = [(torch.zeros(1, 9, 8).bfloat16(), torch.zeros(1, 9, 8).bfloat16())] * 3
    with KVClient(kvserver.address) as c:
        r = c.store(MODEL, list(range(9)), layers)
        mappings = c.core.mappings()
        of = mappings.of

        def elsewhere(answer: pb.LocateResponse) -> object:
            moved = pb.LocateResponse()
            moved.CopyFrom(answer)
            moved.segment = f"kvcraft-absent-{answer.instance_id}"  # no such segment on this host
            return of(moved)

        mappings.of = elsewhere
        with pytest.raises(FileNotFoundError):
            c.fetch_local([r.chunk_key])
        assert c.stats().leases == 0
