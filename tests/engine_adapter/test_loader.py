"""engine_adapter.loader against a real service on loopback: shared memory where the
service holds a variant in host memory, the stream for the rest, the lease released."""

from __future__ import annotations

import logging
import time
import uuid

import grpc
import pytest
import torch

from engine_adapter.loader import ServiceLayerSource
from kvclient.client import KVClient, Ref
from kvclient.errors import from_status
from kvcraft.keys import ModelSpec
from kvcraft.v1 import kvcraft_pb2 as pb

LAYERS, HEADS, DIM = 3, 2, 8
MODEL = ModelSpec("loader-test", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="bfloat16").fingerprint()
SMALL, BIG = 9, 400  # tokens: 1.7 KiB a variant, and 77 KiB, more than the host tier below holds
HOST_BUDGET = 64 << 10


@pytest.fixture
def model(request) -> str:
    """MODEL's shape under a name of this test's own: in the shared service its chunks are its alone."""
    name = f"loader-test-{request.node.name}-{uuid.uuid4().hex}"
    return ModelSpec(name, num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="bfloat16").fingerprint()


def layers_for(seed: int, tokens: int = SMALL) -> list[tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(seed)
    return [(torch.randn(HEADS, tokens, DIM, generator=g).bfloat16(),
             torch.randn(HEADS, tokens, DIM, generator=g).bfloat16()) for _ in range(LAYERS)]


def store(c: KVClient, seed: int, tokens: int = SMALL, model: str = MODEL
          ) -> tuple[Ref, list[tuple[torch.Tensor, torch.Tensor]]]:
    layers = layers_for(seed, tokens)
    r = c.store(model, [seed * 1000 + t for t in range(tokens)], layers)
    return Ref(r.chunk_key, r.variant_id), layers


def read_all(source: ServiceLayerSource) -> list[dict[int, tuple[torch.Tensor, torch.Tensor]]]:
    """Every layer, copied (mapped tensors are not to be read after close)."""
    return [{i: (k.clone(), v.clone()) for i, (k, v) in source.wait_layer(layer).items()} for layer in range(LAYERS)]


def same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    return a.dtype == b.dtype and a.shape == b.shape and torch.equal(a.view(torch.uint8), b.view(torch.uint8))


def deadline() -> float:
    return time.monotonic() + 30.0


def test_shared_memory_layers_equal_the_streamed_ones_byte_for_byte(shared_server, model):
    with KVClient(shared_server.address) as c:
        # keys: a prompt's segment indices
        refs = {2: store(c, 1, model=model)[0], 5: store(c, 2, model=model)[0], 7: store(c, 3, model=model)[0]}
        mapped = ServiceLayerSource(c, refs, local=True, deadline=deadline())
        streamed = ServiceLayerSource(c, refs, local=False, deadline=deadline())
        try:
            assert (mapped.mapped, mapped.streamed, mapped.mapped_tier) == ([2, 5, 7], [], "host")
            assert (streamed.mapped, streamed.streamed) == ([], [2, 5, 7])
            got, want = read_all(mapped), read_all(streamed)
        finally:
            mapped.close()
            streamed.close()
    assert all(set(layer) == {2, 5, 7} for layer in got)
    for g, w in zip(got, want, strict=True):
        for i in refs:
            assert same_bytes(g[i][0], w[i][0]) and same_bytes(g[i][1], w[i][1]), i
    assert sorted(mapped.mapped_bytes) == list(range(LAYERS))


def test_a_variant_the_host_tier_cannot_hold_comes_through_the_stream(start_server):
    server = start_server(host_budget_bytes=HOST_BUDGET)
    with KVClient(server.address) as c:
        (a, la), (big, lbig), (b, lb) = store(c, 1), store(c, 2, BIG), store(c, 3)
        source = ServiceLayerSource(c, {0: a, 1: big, 2: b}, local=True, deadline=deadline())
        try:
            assert (source.mapped, source.streamed) == ([0, 2], [1])
            got = read_all(source)
        finally:
            source.close()
    assert not source.error and sorted(source.arrived) == list(range(LAYERS))
    for layer, kv in enumerate(got):
        for i, want in ((0, la), (1, lbig), (2, lb)):
            assert same_bytes(kv[i][0], want[layer][0]) and same_bytes(kv[i][1], want[layer][1]), (layer, i)


def test_close_releases_the_lease_once_and_hands_out_nothing_after(kvserver):
    with KVClient(kvserver.address) as c:
        refs = {0: store(c, 1)[0], 1: store(c, 2)[0]}
        source = ServiceLayerSource(c, refs, local=True, deadline=deadline())
        assert c.stats().leases == 1  # Locate's: the mapped bytes stay put while the source is open
        assert set(source.wait_layer(0)) == {0, 1}
        source.close()
        assert c.stats().leases == 0
        source.close()
        assert source.wait_layer(1) == {}
        assert c.stats().leases == 0


def test_a_service_whose_memory_is_not_on_this_host_is_streamed_and_said_to_be_elsewhere(kvserver, caplog):
    """Locate answers with a segment this host lacks (a service elsewhere): the source says
    so (its consumer turns `local` off and logs it, so the loader does not warn too),
    streams every variant, and the lease Locate took is not left to its ttl."""
    with KVClient(kvserver.address) as c:
        (a, la), (b, lb) = store(c, 1), store(c, 2)
        mappings = c.core.mappings()
        of = mappings.of

        def elsewhere(answer: pb.LocateResponse) -> object:
            moved = pb.LocateResponse()
            moved.CopyFrom(answer)
            moved.segment = f"kvcraft-absent-{answer.instance_id}"
            return of(moved)

        mappings.of = elsewhere
        with caplog.at_level(logging.WARNING, logger="engine_adapter.loader"):
            source = ServiceLayerSource(c, {0: a, 1: b}, local=True, deadline=deadline())
        try:
            assert source.elsewhere and "FileNotFoundError" in source.local_error
            assert (source.mapped, source.streamed) == ([], [0, 1])
            got = read_all(source)
        finally:
            source.close()
        assert c.stats().leases == 0
    assert "kvcraft Locate failed" not in caplog.text
    for layer, kv in enumerate(got):
        assert same_bytes(kv[0][0], la[layer][0]) and same_bytes(kv[1][1], lb[layer][1])


def test_a_service_that_refuses_locate_for_another_host_is_streamed_and_said_to_be_elsewhere(
        shared_server, model, caplog):
    """Locate answered FAILED_PRECONDITION (the service sees this client's address is not
    its host's; on loopback it never does, so the refusal is the service's message, raised
    as the client raises it): every variant streams, `elsewhere` is set for the consumer,
    and the loader logs no warning of its own."""
    with KVClient(shared_server.address) as c:
        (a, la), (b, lb) = store(c, 1, model=model), store(c, 2, model=model)

        def refused(*args, **kwargs):  # noqa: ANN002, ANN003
            raise from_status(grpc.StatusCode.FAILED_PRECONDITION.value[0],
                              "the client at 10.1.0.12 is not on this service's host: shared memory is not "
                              "reachable from there; stream the layers (FetchLayers)")

        c.fetch_local = refused
        with caplog.at_level(logging.WARNING, logger="engine_adapter.loader"):
            source = ServiceLayerSource(c, {0: a, 1: b}, local=True, deadline=deadline())
        try:
            assert source.elsewhere and "FailedPreconditionError" in source.local_error
            assert "10.1.0.12 is not on this service's host" in source.local_error
            assert (source.mapped, source.streamed) == ([], [0, 1])
            got = read_all(source)
        finally:
            source.close()
    assert not caplog.records
    for layer, kv in enumerate(got):
        assert same_bytes(kv[0][0], la[layer][0]) and same_bytes(kv[1][1], lb[layer][1])


def test_another_locate_failure_is_this_loads_own_and_logged(shared_server, model, caplog):
    """A Locate that fails for another reason (here: the deadline passed) is not a service
    elsewhere: `local` stays on for later loads, and the loader warns."""
    with KVClient(shared_server.address) as c:
        a, _ = store(c, 3, model=model)
        with caplog.at_level(logging.WARNING, logger="engine_adapter.loader"):
            source = ServiceLayerSource(c, {0: a}, local=True, deadline=time.monotonic() - 1.0)
        source.close()
    assert not source.elsewhere and "deadline passed before Locate" in source.local_error
    assert "kvcraft Locate failed" in caplog.text


def test_mapped_layers_are_withheld_once_the_locate_lease_ends_and_computed_instead(start_server, caplog):
    """Past its lease the service may evict a variant and hand its bytes to another: a layer read
    then would be another variant's KV. So from the lease's end (less its margin) the mapped
    variants are absent, handed out to no later layer and replayed to no later pass (the
    consumer computes them); streamed ones are the consumer's own and stay."""
    from engine_adapter.source import ReplayLayerSource
    from tests.conftest import wait_for

    server = start_server(lease_timeout_s=1.0, host_budget_bytes=HOST_BUDGET)
    with KVClient(server.address) as c:
        (a, la), (big, _), (b, _) = store(c, 1), store(c, 2, BIG), store(c, 3)
        source = ServiceLayerSource(c, {0: a, 1: big, 2: b}, local=True, deadline=deadline())
        replay = ReplayLayerSource(source)
        try:
            assert (source.mapped, source.streamed) == ([0, 2], [1]) and source.holds()
            first = replay.wait_layer(0, deadline())
            assert set(first) == {0, 1, 2} and same_bytes(first[0][0], la[0][0])
            assert set(replay.wait_layer(0, deadline())) == {0, 1, 2}  # a second pass, within the lease
            wait_for(lambda: not source.holds(), "the lease's end less its margin", timeout=10)
            with caplog.at_level(logging.WARNING, logger="engine_adapter.loader"):
                assert set(replay.wait_layer(1, deadline())) == {1}  # the mapped ones withheld
            assert source.lease_lapsed == 1 and "ended before layer 1 was read" in caplog.text
            assert replay.wait_layer(0, deadline()) == {}  # nor replayed to a later pass
            assert set(replay.wait_layer(2, deadline())) == {1}
            wait_for(lambda: c.stats().leases == 0, "the service to end the lease", timeout=10)
            assert c.evict(chunk_key=a.chunk_key).evicted == 1  # what it guards against: the bytes are free
        finally:
            source.close()
