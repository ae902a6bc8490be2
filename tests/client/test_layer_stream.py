"""kvclient.layer_stream.LayerStream against the real server on loopback: what arrives, the
deadline with a stalled service, close() at any moment, more refs than one stream carries."""

from __future__ import annotations

import signal
import time

import torch

from kvclient.client import KVClient, Ref
from kvcraft.keys import ModelSpec
from kvclient.layer_stream import LayerStream
from tests.conftest import random_layers

MODEL_SHAPE = dict(num_layers=3, num_kv_heads=2, head_dim=8, dtype="float32")  # `model`: the same under a name of its own
MODEL = ModelSpec("layer-stream-test", **MODEL_SHAPE).fingerprint()


def stored(c: KVClient, n: int, tokens: int = 4, model: str = MODEL
           ) -> tuple[list[Ref], list[list[tuple[torch.Tensor, torch.Tensor]]]]:
    refs, kv = [], []
    for i in range(n):
        layers = random_layers(i, (2, tokens, 8), 3)
        r = c.store(model, [i, i + 1, i + 2, i + 3][:tokens], layers)
        refs.append(Ref(r.chunk_key, r.variant_id))
        kv.append(layers)
    return refs, kv


def test_every_layer_of_every_variant_arrives_as_stored_even_past_one_stream(shared_server, model):
    with KVClient(shared_server.address) as c:
        refs, kv = stored(c, 300, model=model)  # > 256: two streams at once
        s = LayerStream(c, refs, deadline=time.monotonic() + 60, depth=1)
        for layer in range(3):
            got = s.wait_layer(layer)
            assert sorted(got) == list(range(300))
            for i in (0, 255, 256, 299):
                assert torch.equal(got[i][0], kv[i][layer][0]) and torch.equal(got[i][1], kv[i][layer][1])
        assert s.error is None and sorted(s.arrived) == [0, 1, 2]
        s.close()


def test_a_stalled_service_never_holds_the_consumer_past_the_deadline(kvserver):
    with KVClient(kvserver.address) as c:
        refs, _ = stored(c, 2)
        kvserver.proc.send_signal(signal.SIGSTOP)
        try:
            t0 = time.monotonic()
            s = LayerStream(c, refs, deadline=t0 + 0.5)
            got = s.wait_layer(0)
            waited = time.monotonic() - t0
            s.close(join_s=2.0)
            closed = time.monotonic() - t0
        finally:
            kvserver.proc.send_signal(signal.SIGCONT)
    assert got == {} and 0.4 < waited < 2.0 and closed < 3.0
    assert all(not t.is_alive() for t in s._threads)


def test_close_at_any_moment_leaves_no_reader_behind(shared_server, model):
    with KVClient(shared_server.address) as c:
        refs, _ = stored(c, 3, model=model)
        for _ in range(20):  # close races the opening of the stream and its first messages
            s = LayerStream(c, refs, deadline=time.monotonic() + 30)
            s.close()
            s.close()  # idempotent
            assert all(not t.is_alive() for t in s._threads)
            t0 = time.monotonic()
            s.wait_layer(0, deadline=t0 + 5)  # a closed stream answers at once with what it had
            assert time.monotonic() - t0 < 1.0
        after = LayerStream(c, refs, deadline=time.monotonic() + 30)  # the channel still serves
        assert sorted(after.wait_layer(2)) == [0, 1, 2]
        after.close()
