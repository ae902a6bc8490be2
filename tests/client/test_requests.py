"""Requests name chunks by token ids however the caller holds them (a list, numpy, torch,
floats a tokenizer returned): the ids on the wire are the same ints, and an id outside
uint32 is refused with a ValueError that names it."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from kvclient.messages import lookup_request, plan_request, store_header
from kvcraft.keys import ModelSpec

MODEL = ModelSpec("req", 1, 1, 2, "float32").fingerprint()
LAYERS = [(torch.zeros(1, 3, 2), torch.zeros(1, 3, 2))]


@pytest.mark.parametrize("ids", [[7, 8, 2**32 - 1], (7, 8, 2**32 - 1), np.array([7, 8, 2**32 - 1]),
                                 torch.tensor([7, 8, 2**32 - 1]), [7.0, 8, 4294967295.0], ["7", "8", 2**32 - 1]])
def test_token_ids_reach_the_wire_as_the_same_ints(ids):
    want = [7, 8, 2**32 - 1]
    assert list(plan_request(MODEL, [ids, ("a" * 32, 4)], 5).chunks[0].token_ids) == want
    assert list(store_header(MODEL, ids, LAYERS).token_ids) == want
    assert list(lookup_request(MODEL, ids, None).tokens.token_ids) == want


@pytest.mark.parametrize("bad", [[1, -1], [2**32], np.array([3, -5])])
def test_an_id_outside_uint32_is_refused(bad):
    for build in (lambda: plan_request(MODEL, [bad], 5), lambda: store_header(MODEL, bad, LAYERS),
                  lambda: lookup_request(MODEL, bad, None)):
        with pytest.raises(ValueError, match="out of range"):
            build()


BAD_STORES = {  # what a Store is given -> what the ValueError says
    "no layers": ([5, 6, 7], [], "layers is empty"),
    "an id outside uint32": ([5, -6, 7], LAYERS, r"token_ids: .*out of range"),
    "a 2-D layer": ([5, 6, 7], [LAYERS[0], (torch.zeros(3, 2), torch.zeros(3, 2))],
                    r"layers\[1\]: expected a \[kv_heads"),
    "an integer layer": ([5, 6, 7], [(torch.zeros(1, 3, 2, dtype=torch.int64),) * 2],
                         r"layers\[0\]: dtype torch.int64"),
}


@pytest.mark.parametrize("case", BAD_STORES)
@pytest.mark.parametrize("local_store", [True, False])
async def test_a_store_of_what_is_no_variant_raises_the_value_error_through_either_path_and_stores_nothing(
        shared_server, case, local_store):
    """Through shared memory or the gRPC stream, blocking or asyncio: the same ValueError before
    anything is sent (raised inside grpc's iteration of the stream, it would reach the caller as
    UNKNOWN "Exception iterating requests!")."""
    from kvclient import AsyncKVClient, KVClient

    ids, layers, message = BAD_STORES[case]
    with KVClient(shared_server.address, timeout=10, local_store=local_store) as c:
        with pytest.raises(ValueError, match=message):
            c.store(MODEL, ids, layers)
        async with AsyncKVClient(shared_server.address, timeout=10, local_store=local_store) as a:
            with pytest.raises(ValueError, match=message):
                await a.store(MODEL, ids, layers)
        if case != "an id outside uint32":
            assert not c.lookup(MODEL, ids).found


@pytest.mark.parametrize("bad", [-1, 2**32])
def test_a_count_outside_uint32_is_refused_by_its_name(bad):
    from kvclient.messages import fetch_request

    with pytest.raises(ValueError, match=f"question_tokens is {bad}"):
        plan_request(MODEL, [[1, 2]], bad)
    for name in ("first_layer", "num_layers"):
        with pytest.raises(ValueError, match=f"{name} is {bad}"):
            fetch_request([("a" * 32, "")], **{name: bad})


@pytest.mark.parametrize("address,message", [("", "address is empty"), ("http://127.0.0.1:50051", "is a URL"),
                                             ("127.0.0.1:99999", "port 99999 is outside"),
                                             ("127.0.0.1:0", "port 0 is outside")])
async def test_an_address_grpc_would_misread_is_refused_by_both_faces(address, message):
    """(grpc dials port 99999 as 34463: another service's, maybe.)"""
    from kvclient import AsyncKVClient, KVClient

    with pytest.raises(ValueError, match=message):
        KVClient(address)
    with pytest.raises(ValueError, match=message):
        AsyncKVClient(address)


def test_addresses_grpc_reads_as_meant_are_taken():
    from kvclient import KVClient

    for address in ("localhost:50051", "[::1]:50051", "unix:/run/kvcraft.sock", "dns:///kv.internal:50051"):
        KVClient(address).close()
