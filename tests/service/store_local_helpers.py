"""The StoreLocal protocol driven by hand, for the co-located Store tests (and the client
process one of them kills mid-store)."""

from __future__ import annotations

import queue

import grpc

from kvclient import local_store
from kvclient.client import store_header
from kvclient.local_store import StagingBuffer
from kvcraft.keys import ModelSpec
from kvcraft.v1 import kvcraft_pb2 as pb

MODEL_SHAPE = dict(num_layers=4, num_kv_heads=2, head_dim=64, dtype="float32")  # `model`: the same under a name of its own
MODEL = ModelSpec("staged", **MODEL_SHAPE).fingerprint()
STAGED = (2, 64, 64)  # a layer's K (and V): [kv_heads, tokens, head_dim], 4 layers
LAYER_BYTES = 2 * 2 * 64 * 64 * 4  # K + V of [2, 64, 64] fp32


def staged_tokens(i: int) -> list[int]:
    return [i * 1000 + t for t in range(64)]


class RawStoreLocal:
    """The StoreLocal protocol by hand (what kvclient.local_store does, step by step)."""

    def __init__(self, address: str, serializer=pb.StoreLocalRequest.SerializeToString) -> None:
        self.channel = grpc.insecure_channel(address)
        self.q: queue.SimpleQueue = queue.SimpleQueue()
        method = self.channel.stream_stream(local_store.STORE_LOCAL, request_serializer=serializer,
                                            response_deserializer=pb.StoreLocalResponse.FromString)
        self.call = method(iter(self.q.get, None), timeout=60)
        self.staging: StagingBuffer | None = None

    def send(self, msg) -> None:
        self.q.put(msg)

    def start(self, tokens: list[int], layers, area: pb.StagingArea | None = None) -> None:
        """Header + a staging area of the payload's size (or `area` as given); waits
        for the service to accept."""
        self.staging = StagingBuffer(len(layers) * LAYER_BYTES // (4 // layers[0][0].element_size()))
        self.send(pb.StoreLocalRequest(start=pb.StoreLocalStart(header=store_header(MODEL, tokens, layers),
                                                                staging=area or self.staging.message())))
        assert next(self.call).WhichOneof("part") == "accepted"

    def put_all(self, layers) -> None:
        for i, (k, v) in enumerate(layers):
            self.staging.put(i * LAYER_BYTES, k, v)

    def staged(self, count: int) -> None:
        self.send(pb.StoreLocalRequest(staged=pb.StagedLayers(layers=count)))

    def end(self):
        self.q.put(None)
        return next(self.call)

    def close(self) -> None:
        self.q.put(None)
        self.call.cancel()
        if self.staging is not None:
            self.staging.close()
        self.channel.close()
