"""ChunkStore without gRPC: lease expiry on injected clocks, config precedence."""

from __future__ import annotations

import logging
import re
import shutil

import pytest

from kvcraft.keys import ModelSpec
from kvcraft.records import Ref
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.config import load_config
from kvservice.errors import ResourceExhausted
from kvservice.index import Spec, Variant
from kvservice.records import Selector, StoreHeader
from kvservice.store import ChunkStore

MODEL = ModelSpec("unit", 1, 1, 2, "float32").fingerprint()
LAYER_BYTES = 2 * 1 * 2 * 2 * 4  # K + V of [1, 2, 2] fp32


def put(store: ChunkStore, tokens: list[int], prefix: tuple[str, ...] = ()) -> str:
    spec = Spec(pb.FLOAT32, (1, len(tokens), 2))
    s = store.begin_store(StoreHeader(MODEL, tokens, prefix, 1, spec, spec))
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
    store = ChunkStore(cfg, clock=clock, elapsed=clock)
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


def test_a_wall_clock_step_neither_ends_a_lease_nor_holds_it_past_its_ttl(tmp_path):
    """The wall clock stepped an hour forward (NTP, a VM resumed) under a held lease: the
    variants stay held, and a step back holds them no longer than the ttl; clients are told
    the end on the wall clock as it was when the lease was taken."""
    wall, elapsed = Clock(), Clock()
    cfg = load_config(env={}, overrides={"data_dir": str(tmp_path), "disk_budget_bytes": 2 * LAYER_BYTES,
                                         "lease_timeout_s": 30.0})
    store = ChunkStore(cfg, clock=wall, elapsed=elapsed)
    a, b = put(store, [1, 2]), put(store, [3, 4])
    assert store.take_lease([Ref(a), Ref(b)])[2] == wall.now + 30.0
    wall.now += 3600.0
    with pytest.raises(ResourceExhausted, match="leased or pinned"):
        put(store, [5, 6])
    assert store.stats().leases == 1
    wall.now -= 7200.0
    elapsed.now += 30.1
    assert store.stats().leases == 0
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
    f.write_text("[[[\n")
    with pytest.raises(ValueError, match=r"kvcraft\.toml: not TOML: .*line 1"):  # the file named, where it broke
        load_config(f, env={})
    # values a service could start with and then serve nothing (every Plan over the message size),
    # or that would end `kvcraft serve` in a traceback (logging's own ValueError)
    for setting, message in (("max_message_bytes = 10", "max_message_bytes must be >= 1,048,576"),
                             ('log_level = "LOUD"', "log_level must be one of DEBUG, INFO")):
        f.write_text(setting + "\n")
        with pytest.raises(ValueError, match=message):
            load_config(f, env={})
    f.write_text('log_level = "debug"\n')
    assert logging.getLevelName(load_config(f, env={}).log_level) == logging.DEBUG  # any case, as logging takes it


def test_leases_match_a_brute_force_reference(tmp_path):
    """Random takes, releases and clock steps: which variants are leased, their holds and
    the lease count always equal a reference that checks every lease it ever made."""
    import random

    clock = Clock()
    cfg = load_config(env={}, overrides={"data_dir": str(tmp_path), "lease_timeout_s": 30.0})
    store = ChunkStore(cfg, clock=clock, elapsed=clock)
    keys = [put(store, [i, i + 1]) for i in range(0, 12, 2)]
    vids = {k: store.lookup(k)[0].variant_id for k in keys}
    rng = random.Random(5)
    made: list[tuple[str, list[str], float]] = []  # every lease: id, variant ids, expiry
    released: set[str] = set()

    def alive(now: float) -> list[tuple[str, list[str], float]]:
        return [m for m in made if m[0] not in released and m[2] > now]

    for step in range(5000):
        op = rng.random()
        if op < 0.45:
            chosen = rng.sample(keys, rng.randint(1, 3))
            ttl = rng.choice([0.0, 1.0, 4.0, 60.0])
            lease_id, _, expires = store.take_lease([Ref(k) for k in chosen], ttl)
            assert expires == clock.now + (ttl or 30.0)
            made.append((lease_id, [vids[k] for k in chosen], expires))
        elif op < 0.9 and made:
            lease_id = rng.choice(made)[0]
            expect = any(m[0] == lease_id for m in alive(clock.now))
            assert store.release(lease_id) is expect
            released.add(lease_id)
        else:
            clock.now += rng.choice([0.0, 0.5, 1.0, 3.0])
        if step % 7 == 0:
            live = alive(clock.now)
            assert store.stats().leases == len(live)  # (Stats ends the leases due first)
            for k in keys:
                want = sum(m[1].count(vids[k]) for m in live)
                assert store.index.get(vids[k]).holds == want, (step, k)
                assert store.leased(vids[k]) is (want > 0)
    store.close()


class _NoScan(dict):
    """A lease table that fails any walk over all of its leases."""

    def _walk(self, *a):
        raise AssertionError("walked every lease")

    items = values = keys = __iter__ = _walk


def test_lease_calls_do_not_walk_every_lease(tmp_path):
    """With many leases held (engines that died holding them), a Plan's lease, a release
    and a placement cost the same as with none: no call walks all leases."""
    clock = Clock()
    cfg = load_config(env={}, overrides={"data_dir": str(tmp_path), "lease_timeout_s": 30.0})
    store = ChunkStore(cfg, clock=clock, elapsed=clock)
    a, b = put(store, [1, 2]), put(store, [3, 4])
    held = [store.take_lease([Ref(a)])[0] for _ in range(2000)]
    store._leases._leases = _NoScan(store._leases._leases)
    lease_id = store.take_lease([Ref(a), Ref(b)])[0]
    assert store.release(lease_id) and store.release(held[0]) and not store.release(lease_id)
    assert store.leased(store.lookup(b)[0].variant_id) is False
    put(store, [5, 6])
    clock.now += 31.0  # every lease ends; each is visited once, by its own expiry
    assert store.leased(store.lookup(a)[0].variant_id) is False
    assert store.stats().leases == 0
    store.close()


@pytest.mark.parametrize("bound", ["disk", "max_variants"])
def test_eviction_follows_the_brute_force_order(tmp_path, bound):
    """A full disk (or max_variants) evicts the unprotected variant with the lowest
    (fr, last access, created, id), under reuses that raise fr and leases that protect:
    the same victim, every time, as a model that sorts every variant it holds."""
    import random

    clock = Clock()
    room = 5
    limits = ({"disk_budget_bytes": room * LAYER_BYTES} if bound == "disk"
              else {"max_variants": room, "disk_budget_bytes": 100 * LAYER_BYTES})
    cfg = load_config(env={}, overrides={"data_dir": str(tmp_path), "host_budget_bytes": 1, **limits})
    store = ChunkStore(cfg, clock=clock)
    rng = random.Random(11)
    model: dict[str, list] = {}  # chunk key -> [fr, last access ms, created ms, variant id]
    leases: dict[str, str] = {}  # lease id -> chunk key
    refused = evicted = 0
    for step in range(400):
        clock.now += rng.choice([0.0, 0.0005, 0.002, 0.01])  # some in the same ms: ties
        now_ms = int(clock.now * 1000)
        op = rng.random()
        if op < 0.35:
            tokens = [10 * step, 10 * step + 1]
            held = {leases[lid] for lid in leases}
            free = [k for k in model if k not in held]
            if len(model) >= room and not free:
                with pytest.raises(ResourceExhausted):
                    put(store, tokens)
                refused += 1
                continue
            if len(model) >= room:
                victim = min(free, key=lambda k: tuple(model[k]))
                del model[victim]
                evicted += 1
            key = put(store, tokens)
            model[key] = [0.0, now_ms, now_ms, store.lookup(key)[0].variant_id]
        elif op < 0.65 and model:
            key = rng.choice(sorted(model))
            cfo = rng.choice([None, 0.0, 0.05, 0.3, 1.0])
            store.close_fetch(store.open_fetch([Ref(key, cfo=cfo)]), promote=False)
            model[key][0] += 1.0 if cfo is None else 1.0 / max(cfo, 0.01)
            model[key][1] = now_ms
        elif op < 0.87 and model:
            key = rng.choice(sorted(model))
            leases[store.take_lease([Ref(key)], 3600.0)[0]] = key
        elif leases:
            lid = rng.choice(list(leases))  # in the order taken: lease ids are random
            assert store.release(lid)
            del leases[lid]
        assert {c.chunk_key for c in store.list_chunks("", 100, "")[0]} == set(model), step
        st = store.stats()
        assert (st.variants, st.leases) == (len(model), len(leases))
        assert {t.name: t.variants for t in st.tiers} == {"host": 0, "disk": len(model)}
    assert evicted > 30 and refused > 0  # the trace really exercised both
    store.close()


@pytest.mark.parametrize("scan", [2, 5, 2048])
def test_listing_pages_through_every_chunk_in_key_order(tmp_path, monkeypatch, scan):
    """Pages of every size, with and without a model filter, put together are the sorted
    keys of the chunks stored (of that model), each once; the last page says so. Also
    when the store reads fewer keys per hold of its lock than a page holds, and after
    chunks left and came back."""
    import kvservice.store as store_module

    monkeypatch.setattr(store_module, "LIST_SCAN", scan)
    other = ModelSpec("unit-b", 1, 1, 2, "float32").fingerprint()
    cfg = load_config(env={}, overrides={"data_dir": str(tmp_path)})
    store = ChunkStore(cfg)
    keys = {MODEL: [], other: []}
    for i in range(23):
        model = other if i % 3 == 0 else MODEL
        spec = Spec(pb.FLOAT32, (1, 2, 2))
        s = store.begin_store(StoreHeader(model, [i, 99], (), 1, spec, spec))
        s.add_layer(0, bytes(16), bytes(16))
        keys[model].append(s.finish().chunk_key)
    store.evict(Selector(chunk_key=keys[MODEL].pop(3)))  # gone: no longer listed
    store.evict(Selector(chunk_key=keys[other][1]))  # gone, then stored again (i = 3): listed once
    s = store.begin_store(StoreHeader(other, [3, 99], (), 1, spec, spec))
    s.add_layer(0, bytes(16), bytes(16))
    assert s.finish().chunk_key == keys[other][1]
    for model_id, want in (("", sorted(keys[MODEL] + keys[other])), (MODEL, sorted(keys[MODEL])),
                           (other, sorted(keys[other]))):
        for size in (1, 2, 5, 7, 8, 23, 100):
            got, token, pages = [], "", 0
            while True:
                page, token = store.list_chunks(model_id, size, token)
                assert len(page) <= size
                got += [c.chunk_key for c in page]
                pages += 1
                if not token:
                    break
                assert pages <= len(want) + 1
            assert got == want, (model_id, size)
    store.close()


def test_a_lease_ends_on_the_record_it_held(tmp_path):
    """A leased variant dropped (its payload failed a read) and stored again is a new
    record: the old lease's end must not take a hold off the new one (it went to -1,
    and the next fetch's hold left the new record unprotected while read)."""
    cfg = load_config(env={}, overrides={"data_dir": str(tmp_path)})
    store = ChunkStore(cfg)
    key = put(store, [1, 2])
    (old,) = store.lookup(key)
    lease_id = store.take_lease([Ref(key)])[0]
    store._placement.drop(old.variant_id, "test: its payload failed a read")
    assert put(store, [1, 2]) == key
    (new,) = store.lookup(key)
    assert new is not old and new.variant_id == old.variant_id
    assert store.release(lease_id)
    assert (new.holds, store.leased(new.variant_id)) == (0, False)
    held = store.open_fetch([Ref(key)])
    assert new.protected
    store.close_fetch(held, promote=False)
    store.close()


def test_an_eviction_order_full_of_stale_entries_is_rebuilt_from_the_tier(tmp_path, monkeypatch):
    """Entries pile up when variants arrive again and again (promotions, copies): past
    twice what the tier holds (+1024) its order is rebuilt from the tier's own variants,
    not by walking the whole index (at 1M variants that took seconds with the store's
    lock held), and still names the lowest variant."""
    clock = Clock()
    store = ChunkStore(load_config(env={}, overrides={"data_dir": str(tmp_path)}), clock=clock)
    keys = [put(store, [i, i + 1]) for i in range(0, 6, 2)]
    s = store._s
    low = store.lookup(keys[0])[0]
    for k in keys[1:]:
        store.close_fetch(store.open_fetch([Ref(k)]), promote=False)  # fr 1 > low's 0
    monkeypatch.setattr(type(s.index), "__iter__", lambda self: (_ for _ in ()).throw(AssertionError("walked the index")))
    for _ in range(2000):
        s.placed(store.lookup(keys[1])[0], s.home)
    assert len(s.eviction_order[s.home]) <= 2 * len(s.tiers[s.home]) + 1024 + 1
    assert store._placement.lowest(s.home) is low
    monkeypatch.undo()
    store.close()


@pytest.mark.parametrize("lowered", [{"disk_budget_bytes": 3 * LAYER_BYTES}, {"max_variants": 3}],
                         ids=["disk_budget_bytes", "max_variants"])
def test_a_start_under_a_lowered_budget_keeps_the_highest_variants_that_fit(tmp_path, caplog, lowered):
    """The data dir holds 8 variants; the service starts with room for 3 (on disk, or in all):
    it evicts at once, by the eviction order (brute force: every variant sorted by its key),
    keeping the pinned one whatever its score, and says what it did."""
    import random

    from kvservice.index import eviction_key

    clock = Clock()
    data = tmp_path / "data"
    cfg = {"data_dir": str(data)}
    store = ChunkStore(load_config(env={}, overrides=cfg), clock=clock)
    keys = [put(store, [i, i + 1]) for i in range(0, 16, 2)]
    rng = random.Random(3)
    for _ in range(20):  # reuse at random: fr and last access differ
        clock.now += 1
        store.close_fetch(store.open_fetch([Ref(rng.choice(keys[1:]))]), promote=False)
    store.set_pinned(Selector(chunk_key=keys[0]), True)  # never reused: the lowest score, kept
    pinned = store.lookup(keys[0])[0].variant_id
    ranked = [v.variant_id for v in sorted(store.index, key=eviction_key, reverse=True) if v.variant_id != pinned]
    store.close()
    with caplog.at_level(logging.WARNING, logger="kvcraft.store"):
        store = ChunkStore(load_config(env={}, overrides={**cfg, **lowered}), clock=clock)
    assert {v.variant_id for v in store.index} == {pinned, *ranked[:2]}
    assert store.stats().tiers[-1].bytes_used == 3 * LAYER_BYTES
    assert re.search(r"held 8 variants, over max_variants=3: 5 evicted" if "max_variants" in lowered else
                     r"disk tier held 256 bytes, over its budget of 96: 5 variants evicted", caplog.text), caplog.text
    store.close()
    store = ChunkStore(load_config(env={}, overrides=cfg), clock=clock)  # durable: the records went too
    assert {v.variant_id for v in store.index} == {pinned, *ranked[:2]}
    store.close()


def test_a_start_under_a_lowered_max_variants_per_chunk_keeps_each_chunks_highest(tmp_path, caplog):
    """A chunk stored behind 4 prefixes; the service starts with max_variants_per_chunk 2: the
    chunk keeps its 2 highest variants by the eviction order (brute force), the others theirs."""
    from kvservice.index import eviction_key

    clock = Clock()
    cfg = {"data_dir": str(tmp_path / "data")}
    store = ChunkStore(load_config(env={}, overrides=cfg), clock=clock)
    a, b = put(store, [1, 2]), put(store, [3, 4])
    x = [put(store, [5, 6], prefix) for prefix in ((), (a,), (b,), (a, b))][0]
    for step, prefix in enumerate([(a,), (a, b), (a,)]):  # reuses of three of its variants
        clock.now += 1 + step
        vid = next(v.variant_id for v in store.lookup(x) if tuple(v.prefix_keys) == prefix)
        store.close_fetch(store.open_fetch([Ref(x, vid)]), promote=False)
    ranked = [v.variant_id for v in sorted(store.lookup(x), key=eviction_key, reverse=True)]
    others = {v.variant_id for k in (a, b) for v in store.lookup(k)}
    store.close()
    with caplog.at_level(logging.WARNING, logger="kvcraft.store"):
        store = ChunkStore(load_config(env={}, overrides={**cfg, "max_variants_per_chunk": 2}), clock=clock)
    assert {v.variant_id for v in store.lookup(x)} == set(ranked[:2])
    assert {v.variant_id for k in (a, b) for v in store.lookup(k)} == others
    assert "1 chunks held more than max_variants_per_chunk=2 variants: 2 evicted" in caplog.text, caplog.text
    store.close()


def _scores(store: ChunkStore) -> dict[str, tuple[float, int]]:
    return {v.variant_id: (v.fr, v.last_access_ms) for v in store.index}


def _scores_after_restart(path, clock=None) -> dict[str, tuple[float, int]]:
    """The scores a store opened on `path` recovers (and closed again)."""
    store = ChunkStore(load_config(env={}, overrides={"data_dir": str(path)}), clock=clock or Clock())
    try:
        return _scores(store)
    finally:
        store.close()


def test_reuse_scores_survive_a_crash_and_a_restart_and_die_with_their_variant(tmp_path):
    """fr and last access are written as small access records on every reuse: a copy of
    the data directory taken while the store runs (a crash: nothing closed) and a clean
    restart both come back with the scores the store had. A variant deleted and stored
    again under the same id starts from 0, not from its predecessor's access record."""
    clock = Clock()
    data = tmp_path / "data"
    store = ChunkStore(load_config(env={}, overrides={"data_dir": str(data)}), clock=clock)
    a, b, c = (put(store, [i, i + 1]) for i in range(0, 6, 2))
    for step, (key, cfo) in enumerate([(a, 0.5), (b, None), (a, 0.25), (c, 1.0), (a, None)]):
        clock.now += 1 + step
        store.close_fetch(store.open_fetch([Ref(key, cfo=cfo)]), promote=False)
    store.set_pinned(Selector(chunk_key=b), True)  # a whole record, written between reuses
    clock.now += 10
    store.locate([Ref(b)])  # counts a reuse too
    want = _scores(store)
    assert len({s[0] for s in want.values()}) == 3 and all(s[1] > 1_000_000 for s in want.values())
    shutil.copytree(data, tmp_path / "crashed")
    store.close()
    assert _scores_after_restart(tmp_path / "crashed") == want
    assert _scores_after_restart(data) == want
    store = ChunkStore(load_config(env={}, overrides={"data_dir": str(data)}), clock=clock)
    assert store.evict(Selector(chunk_key=a))[0] == 1
    assert put(store, [0, 1]) == a
    (fresh,) = store.lookup(a)
    store.close()
    assert _scores_after_restart(data)[fresh.variant_id] == (0.0, fresh.last_access_ms)


def test_reuse_scores_whose_writes_failed_are_written_at_close(tmp_path, monkeypatch):
    """Access records that could not be written (a full disk) are not lost for good:
    the store writes every variant's scores when it closes."""
    clock = Clock()
    store = ChunkStore(load_config(env={}, overrides={"data_dir": str(tmp_path)}), clock=clock)
    keys = [put(store, [i, i + 1]) for i in range(0, 6, 2)]
    put_access = store._s.meta.put_access

    def full(variants):
        raise Exception("IO error: No space left on device")
    monkeypatch.setattr(store._s.meta, "put_access", full)
    for k in keys:
        clock.now += 1
        store.close_fetch(store.open_fetch([Ref(k)]), promote=False)  # the read goes on
    monkeypatch.setattr(store._s.meta, "put_access", put_access)  # space again
    clock.now += 1
    store.close_fetch(store.open_fetch([Ref(keys[0])]), promote=False)
    want = _scores(store)
    assert sorted(s[0] for s in want.values()) == [1.0, 1.0, 2.0]
    store.close()
    assert _scores_after_restart(tmp_path) == want


def test_access_records_no_variant_record_describes_are_dropped_at_recovery(tmp_path):
    store = ChunkStore(load_config(env={}, overrides={"data_dir": str(tmp_path)}))
    key = put(store, [1, 2])
    (v,) = store.lookup(key)
    ghost = Variant.build("f" * 32, v.chunk_key, (), 2, "", v.stats, fr=7.0, last_access_ms=5)
    store._s.meta.put_access([v, ghost])
    store.close()
    store = ChunkStore(load_config(env={}, overrides={"data_dir": str(tmp_path)}))
    assert set(store._s.meta.load_access()) == {v.variant_id}
    store.close()


def test_a_variant_evicted_between_planning_and_leasing_is_planned_again(tmp_path, monkeypatch):
    """Plan chooses a variant, then leases it; an eviction can land in between (another
    thread's Store). The Plan is made again without it, not answered with a lease on
    nothing; if variants keep vanishing, UNAVAILABLE says to retry."""
    from kvservice.errors import Unavailable
    from kvservice.planning import PlanningService
    from kvclient.client import plan_request

    store = ChunkStore(load_config(env={}, overrides={"data_dir": str(tmp_path)}))
    planning = PlanningService(store)
    key = put(store, [1, 2])
    (v,) = store.lookup(key)
    first = planning.plan(plan_request(MODEL, [[1, 2]], 3))
    assert first.chunks[0].variant_id == v.variant_id and store.release(first.lease_id)
    lease = store.lease_variants
    calls = []

    def evicted_first(ids, ttl_s=0.0):
        calls.append(list(ids))
        if len(calls) == 1:
            assert store.evict(Selector(chunk_key=key))[0] == 1
        return lease(ids, ttl_s)
    monkeypatch.setattr(store, "lease_variants", evicted_first)
    resp = planning.plan(plan_request(MODEL, [[1, 2]], 3))
    assert calls == [[v.variant_id]] and not resp.lease_id
    assert resp.chunks[0].source == pb.ChunkPlan.FRESH and not resp.chunks[0].variant_id

    put(store, [1, 2])
    monkeypatch.setattr(store, "lease_variants", lambda ids, ttl_s=0.0: lease(["0" * 32], ttl_s))
    with pytest.raises(Unavailable, match="retry"):
        planning.plan(plan_request(MODEL, [[1, 2]], 3))
    store.close()


def test_an_eviction_holds_the_lock_through_no_disk_flush_and_admin_evictions_are_durable(tmp_path, monkeypatch):
    """A Store on a full disk evicts with the store's lock held: its metadata delete is
    unsynced (no fsync; recovery copes, docs/storage.md). Admin Evict / Flush answer an
    operator, so theirs reach the disk before they return."""
    import os

    cfg = load_config(env={}, overrides={"data_dir": str(tmp_path), "disk_budget_bytes": 2 * LAYER_BYTES})
    store = ChunkStore(cfg)
    a, b = put(store, [1, 2]), put(store, [3, 4])
    fsyncs: list[int] = []
    real = os.fsync
    monkeypatch.setattr(os, "fsync", lambda fd: (fsyncs.append(fd), real(fd))[1])
    with store._s.lock:
        store._placement.delete(store.lookup(a)[0].variant_id)
    assert fsyncs == [] and not store.lookup(a)
    assert store.evict(Selector(chunk_key=b)) == (1, 0)
    assert fsyncs, "Admin Evict returned before its delete was on disk"
    store.close()


def test_flush_deletes_in_batches_and_spares_what_it_must(tmp_path, monkeypatch):
    """Flush frees the store's lock between batches: a variant stored meanwhile stays, a
    pinned or leased one is skipped, every other one is gone (and counted once)."""
    import kvservice.store as store_module

    monkeypatch.setattr(store_module, "FLUSH_BATCH", 3)
    store = ChunkStore(load_config(env={}, overrides={"data_dir": str(tmp_path)}))
    keys = [put(store, [i, i + 1]) for i in range(0, 20, 2)]
    store.set_pinned(Selector(chunk_key=keys[4]), True)
    store.take_lease([Ref(keys[8])])
    batches = []
    evict_many = store._placement.evict_many

    def watched(vs):
        batches.append(len(vs))
        if len(batches) == 1:  # between batches, another thread stores and evicts
            store._s.lock.release()
            try:
                keys.append(put(store, [100, 101]))
                store.evict(Selector(chunk_key=keys[9]))
            finally:
                store._s.lock.acquire()
        return evict_many(vs)
    monkeypatch.setattr(store._placement, "evict_many", watched)
    assert store.flush() == (7, 2)
    assert batches == [3, 1, 3, 3, 0]  # the 1: the other thread's Evict; the 0: its variant gone
    assert sorted(k for k in keys if store.lookup(k)) == sorted([keys[4], keys[8], keys[10]])
    store.close()


def test_the_pinned_count_matches_the_variants_through_pins_drops_and_restarts(tmp_path):
    """Stats' pinned count is kept as variants change, not counted by a walk: against a
    count of the variants themselves after every step of a random run, and after a
    restart."""
    import random

    rng = random.Random(5)
    store = ChunkStore(load_config(env={}, overrides={"data_dir": str(tmp_path)}))
    keys = [put(store, [i, i + 1]) for i in range(0, 24, 2)]
    for step in range(300):
        key = rng.choice(keys)
        action = rng.random()
        if not store.lookup(key):
            i = keys.index(key) * 2
            put(store, [i, i + 1])  # stored again: a new record, unpinned
        elif action < 0.4:
            store.set_pinned(Selector(chunk_key=key), True)
        elif action < 0.7:
            store.set_pinned(Selector(chunk_key=key), False)
        elif action < 0.8:
            store._placement.drop(store.lookup(key)[0].variant_id, "test: unreadable")  # pinned or not
        else:
            store.evict(Selector(chunk_key=key))  # spares a pinned one
        assert store.stats().pinned == sum(v.pinned for v in store.index), step
    want = sum(v.pinned for v in store.index)
    assert 0 < want < len(store.index)
    store.close()
    store = ChunkStore(load_config(env={}, overrides={"data_dir": str(tmp_path)}))
    assert store.stats().pinned == want == sum(v.pinned for v in store.index)
    store.close()


def test_admin_pin_evict_and_flush_sync_their_writes_with_the_store_lock_free(tmp_path, monkeypatch):
    """Pin, Evict and Flush are durable before they answer, yet the log's fsync (a disk
    flush, milliseconds) runs with the store's lock free: Plans, Lookups and fetch
    starts, which take it, do not wait for the disk. What they did survives a restart."""
    import os
    import threading

    from kvservice import metadata

    store = ChunkStore(load_config(env={}, overrides={"data_dir": str(tmp_path)}))
    keys = [put(store, [i, i + 1]) for i in range(0, 12, 2)]
    lock_free_at_fsync: list[bool] = []
    real_fsync = metadata.os.fsync

    def fsync(fd: int) -> None:
        if os.readlink(f"/proc/self/fd/{fd}").endswith(".log"):
            got: list[bool] = []

            def try_lock() -> None:  # another thread, as the event loop's Plan would be
                got.append(store._s.lock.acquire(timeout=2))
                if got[0]:
                    store._s.lock.release()
            t = threading.Thread(target=try_lock)
            t.start()
            t.join()
            lock_free_at_fsync.append(got[0])
        real_fsync(fd)

    monkeypatch.setattr(metadata.os, "fsync", fsync)
    store.take_lease([Ref(keys[5])])
    for call in (lambda: store.set_pinned(Selector(chunk_key=keys[0]), True),
                 lambda: store.evict(Selector(chunk_key=keys[1])),
                 store.flush):
        lock_free_at_fsync.clear()
        call()
        assert lock_free_at_fsync and all(lock_free_at_fsync), lock_free_at_fsync
    store.close()
    monkeypatch.undo()
    store = ChunkStore(load_config(env={}, overrides={"data_dir": str(tmp_path)}))
    assert sorted(k for k in keys if store.lookup(k)) == sorted([keys[0], keys[5]])  # pinned, leased: kept
    assert store.lookup(keys[0])[0].pinned
    store.close()


class _FullDisk:
    """Stands for the database handle on a full disk: every write fails as RocksDB's does."""

    def __init__(self, db) -> None:  # noqa: ANN001 - a rocksdict Rdict
        self.db = db

    def write(self, *args: object) -> None:
        raise Exception("IO error: No space left on device: While appending to file: 000009.log")

    def close(self) -> None:
        self.db.close()


def test_a_store_whose_metadata_write_fails_leaves_nothing_and_writes_resume_without_a_restart(tmp_path,
                                                                                                 monkeypatch):
    """The metadata cannot be written, nor the database reopened (a full disk): the
    Store fails naming the cause, its payload file is deleted (not adopted later as a
    variant nobody acknowledged), and the database stays closed without breaking the
    next write (which used to find no handle: AttributeError), until space frees."""
    store = ChunkStore(load_config(env={}, overrides={"data_dir": str(tmp_path)}))
    kept = put(store, [1, 2])
    meta = store._s.meta
    real_open = meta._open

    def full_open() -> None:
        raise Exception("IO error: No space left on device: While open a file for appending: MANIFEST-000012")

    meta._db = _FullDisk(meta._db)
    monkeypatch.setattr(meta, "_open", full_open)
    for tokens in ([3, 4], [5, 6]):  # the second finds the database closed
        with pytest.raises(Exception, match="No space left on device"):
            put(store, tokens)
    with pytest.raises(Exception, match="No space left on device"):
        store.evict(Selector(chunk_key=kept))
    assert meta._db is None and store.variant_count() == 1
    assert len(list((tmp_path / "payloads").rglob("*.kv"))) == 1
    monkeypatch.setattr(meta, "_open", real_open)  # space again
    added = put(store, [3, 4])
    assert store.evict(Selector(chunk_key=kept)) == (1, 0)
    store.close()
    store = ChunkStore(load_config(env={}, overrides={"data_dir": str(tmp_path)}))
    assert [v.chunk_key for v in store.index] == [added] and store.recovery.dropped_metadata == 0
    assert store.recovery.adopted_payloads == 0
    store.close()
