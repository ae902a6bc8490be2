"""ChunkStore without gRPC: lease expiry on an injected clock, config precedence."""

from __future__ import annotations

import pytest

from kvcraft.keys import ModelSpec
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.config import load_config
from kvservice.errors import ResourceExhausted
from kvservice.index import Spec
from kvservice.records import Ref, StoreHeader
from kvservice.store import ChunkStore

MODEL = ModelSpec("unit", 1, 1, 2, "float32").fingerprint()
LAYER_BYTES = 2 * 1 * 2 * 2 * 4  # K + V of [1, 2, 2] fp32


def put(store: ChunkStore, tokens: list[int]) -> str:
    spec = Spec(pb.FLOAT32, (1, len(tokens), 2))
    s = store.begin_store(StoreHeader(MODEL, tokens, (), 1, spec, spec))
    s.add_layer(0, bytes(len(tokens) * 8), bytes(len(tokens) * 8))
    return s.finish().chunk_key


class Clock:
    def __init__(self) -> None:
        self.now = 1000.0

    def __call__(self) -> float:
        return self.now


def test_lease_protects_until_it_times_out(tmp_path):
    clock = Clock()
    cfg = load_config(env={}, overrides={"data_dir": str(tmp_path), "disk_budget_bytes": 2 * LAYER_BYTES,
                                         "lease_timeout_s": 30.0})
    store = ChunkStore(cfg, clock=clock)
    a, b = put(store, [1, 2]), put(store, [3, 4])
    store.take_lease([Ref(a), Ref(b)])
    with pytest.raises(ResourceExhausted, match="leased or pinned"):
        put(store, [5, 6])
    clock.now += 29.9
    with pytest.raises(ResourceExhausted):
        put(store, [5, 6])
    clock.now += 0.2  # past the 30 s timeout: the lease ends by itself
    c = put(store, [5, 6])
    assert store.lookup(c) and store.variant_count() == 2
    store.close()


def test_settings_precedence_defaults_file_env_flags(tmp_path):
    f = tmp_path / "kvcraft.toml"
    f.write_text('port = 7000\ndata_dir = "/from/file"\nhost_budget_bytes = 5\n')
    env = {"KVCRAFT_PORT": "7100", "KVCRAFT_HOST_BUDGET_BYTES": "6"}
    cfg = load_config(f, env=env, overrides={"port": 7200})
    assert (cfg.port, cfg.data_dir, cfg.host_budget_bytes, cfg.max_layers) == (7200, "/from/file", 6, 512)
    with pytest.raises(ValueError, match="unknown setting 'prot'"):
        f.write_text("prot = 1\n")
        load_config(f, env={})
    with pytest.raises(ValueError, match="KVCRAFT|port"):
        load_config(env={"KVCRAFT_PORT": "many"})
