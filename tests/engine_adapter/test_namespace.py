"""NamespaceWatch against the real service: chunks stored under another dtype are
reported at start-up and counted for each request that reused nothing because of it."""

from __future__ import annotations

import logging
import uuid
from dataclasses import replace

import pytest
import torch

from engine_adapter.namespace import NamespaceWatch, dtype_siblings
from kvclient.client import KVClient
from kvcraft.keys import ModelSpec

ENGINE = ModelSpec("smol", num_layers=2, num_kv_heads=1, head_dim=8, dtype="bfloat16")
STORED = replace(ENGINE, dtype="float32")
CHUNK = list(range(100, 116))


@pytest.fixture
def specs(request) -> tuple[ModelSpec, ModelSpec]:
    """ENGINE and STORED under a model name of this test's own: in the shared service the
    chunks of every dtype of it are its alone."""
    engine = replace(ENGINE, name=f"smol-{request.node.name}-{uuid.uuid4().hex}")
    return engine, replace(engine, dtype="float32")


def store_fp32(client: KVClient, stored: ModelSpec = STORED) -> None:
    layer = (torch.zeros(1, len(CHUNK), 8), torch.zeros(1, len(CHUNK), 8))
    client.store(stored.fingerprint(), CHUNK, [layer] * 2)


def test_siblings_are_the_same_model_under_the_other_dtypes():
    got = dtype_siblings(ENGINE)
    assert sorted(got.values()) == ["float16", "float32"]
    assert STORED.fingerprint() in got and ENGINE.fingerprint() not in got


def test_chunks_stored_as_float32_are_reported_once_and_counted_per_missed_request(shared_server, specs, caplog):
    engine, stored = specs
    misses = []
    with KVClient(shared_server.address) as c:
        store_fp32(c, stored)
        watch = NamespaceWatch(engine, c, on_miss=lambda: misses.append(1))
        with caplog.at_level(logging.WARNING, logger="kvcraft.namespace"):
            watch.check_stored()
            watch.close()
        said = [r.getMessage() for r in caplog.records]
        assert len(said) == 1 and "stored as float32 KV" in said[0] and "--dtype float32" in said[0], said
        for chunk in (CHUNK, CHUNK, list(range(16))):  # two misses of a float32 chunk, one never stored
            w = NamespaceWatch(engine, c, on_miss=lambda: misses.append(1))
            w.check_missed(chunk)
            w.close()
        assert len(misses) == 2


def test_nothing_is_said_when_the_dtypes_match(shared_server, specs, caplog):
    _, stored = specs
    with KVClient(shared_server.address) as c:
        store_fp32(c, stored)
        misses = []
        with caplog.at_level(logging.WARNING, logger="kvcraft.namespace"):
            for check in ("check_stored", "check_missed"):  # one watch each: a busy watch skips a check
                watch = NamespaceWatch(stored, c, on_miss=lambda: misses.append(1))
                getattr(watch, check)(*([CHUNK] if check == "check_missed" else []))
                watch.close()
    assert not caplog.records and not misses
