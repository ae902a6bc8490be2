"""`kvcraft serve` keeps its index out of the cyclic garbage collector's scans
(kvservice.server.heap.Freezer): a full collection walks every tracked object while
holding the GIL, 0.81 s at a million variants. The server freezes what is alive once
its index is recovered, and again while idle once the index has grown by a quarter
(and by REFREEZE_MIN_VARIANTS); its log says how many objects are frozen, which must
include the variants' records."""

from __future__ import annotations

import gc
import re
import time


from kvclient.client import KVClient
from kvcraft.keys import ModelSpec
from kvservice.launcher import ServiceProcess
from kvservice.server.heap import REFREEZE_MIN_VARIANTS, Freezer
from tests.conftest import random_layers

MODEL = ModelSpec("heap", num_layers=2, num_kv_heads=1, head_dim=8, dtype="float32").fingerprint()


def _store(c: KVClient, first: int, n: int) -> None:
    layers = random_layers(first)
    for i in range(first, first + n):
        c.store(MODEL, [i * 10 + t for t in range(4)], layers)


def _frozen_at_start(log: str) -> int:
    counts = re.findall(r"(\d+) start-up objects frozen", log)
    assert counts, log[-2000:]
    return int(counts[-1])


def test_recovered_index_is_frozen_at_start(tmp_path):
    data = tmp_path / "data"
    n = 60
    with ServiceProcess(data) as s:
        empty = _frozen_at_start(s.log())
        with KVClient(s.address) as c:
            _store(c, 0, n)
        assert s.stop() == 0
    with ServiceProcess(data) as s, KVClient(s.address) as c:
        assert c.stats().variants == n
        assert _frozen_at_start(s.log()) >= empty + n  # at least one frozen object per recovered variant


def test_grown_index_is_frozen_again_once_idle(tmp_path):
    with ServiceProcess(tmp_path / "data") as s:
        at_start = _frozen_at_start(s.log())
        with KVClient(s.address) as c:
            _store(c, 0, REFREEZE_MIN_VARIANTS)
        deadline = time.monotonic() + 30
        while (found := re.findall(r"grew to (\d+) variants: (\d+) objects now frozen", s.log())) == []:
            assert time.monotonic() < deadline, s.log()[-2000:]
            time.sleep(0.1)
        variants, frozen = map(int, found[0])
        assert variants == REFREEZE_MIN_VARIANTS
        assert frozen >= at_start + variants


def test_refreeze_is_due_after_a_quarter_more_variants_and_never_before_the_first_freeze(monkeypatch):
    monkeypatch.setattr(gc, "freeze", lambda: None)  # this test process's own heap stays as it is
    size = [0]
    f = Freezer(lambda: size[0])
    size[0] = 10 * REFREEZE_MIN_VARIANTS
    assert not f.due()  # never frozen (tests, embedded use): left alone
    f.freeze()
    for grown, due in ((0, False), (REFREEZE_MIN_VARIANTS * 10 // 4 - 1, False), (REFREEZE_MIN_VARIANTS * 10 // 4, True)):
        size[0] = 10 * REFREEZE_MIN_VARIANTS + grown
        assert f.due() is due, grown
    f.freeze()
    size[0] += REFREEZE_MIN_VARIANTS - 1
    assert not f.due()
    size[0] = 100  # evicted below the last freeze: nothing to do
    assert not f.due()
