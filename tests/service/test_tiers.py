"""Tiers, fr-score eviction, leases and pins against a real server (Cache-Craft §3.3)."""

from __future__ import annotations

import random
import urllib.request
import socket

import pytest
import torch

from kvclient.client import KVClient, Ref
from kvclient.errors import NotFoundError, ResourceExhaustedError
from kvcraft.keys import ModelSpec
from tests.conftest import random_layers

MODEL = ModelSpec("tier-test", num_layers=2, num_kv_heads=2, head_dim=8, dtype="float32").fingerprint()
TOKENS = 8
SHAPE = (2, TOKENS, 8)  # per layer, 2 layers
SIZE = 2 * 2 * (2 * TOKENS * 8 * 4)  # layers * (K + V) * bytes = 2048


def tokens_for(seed: int) -> list[int]:
    return [seed * 100 + i for i in range(TOKENS)]


class BruteForceTiers:
    """The policy written as plainly as possible: host holds copies; when over budget,
    drop the unprotected copy with the lowest (fr, last access, created, id)."""

    def __init__(self, host_budget: int) -> None:
        self.budget = host_budget
        self.fr: dict[str, float] = {}
        self.in_host: set[str] = set()
        self.moves = 0

    def enforce(self, times: dict[str, tuple[int, int]]) -> None:
        while len(self.in_host) * SIZE > self.budget:
            victim = min(self.in_host, key=lambda v: (self.fr[v], *times[v], v))
            self.in_host.remove(victim)
            self.moves += 1

    def store(self, vid: str, times: dict[str, tuple[int, int]]) -> None:
        self.fr[vid] = 0.0
        self.in_host.add(vid)
        self.enforce(times)

    def fetch(self, vid: str, cfo: float, times: dict[str, tuple[int, int]]) -> None:
        self.fr[vid] += 1.0 if cfo is None else 1.0 / max(cfo, 0.01)
        self.in_host.add(vid)  # a fetch from disk promotes the variant
        self.enforce(times)


def server_view(c: KVClient, keys: dict[str, str]) -> tuple[set[str], dict[str, tuple[int, int]], dict[str, float]]:
    in_host, times, fr = set(), {}, {}
    for vid, key in keys.items():
        (info,) = c.get_chunk(key)
        times[vid] = (info.last_access_unix_ms, info.created_unix_ms)
        fr[vid] = info.fr
        if info.tier == "host":
            in_host.add(vid)
    return in_host, times, fr


def test_host_pressure_demotes_lowest_fr_first_like_brute_force(start_server):
    budget = 3 * SIZE + SIZE // 2
    server = start_server(host_budget_bytes=budget)
    rng = random.Random(7)
    model = BruteForceTiers(budget)
    keys: dict[str, str] = {}
    sent: dict[str, list] = {}
    with KVClient(server.address) as c:
        for step in range(40):
            if len(keys) < 3 or rng.random() < 0.35:
                seed = len(keys)
                r = c.store(MODEL, tokens_for(seed), random_layers(seed, SHAPE))
                keys[r.variant_id], sent[r.variant_id] = r.chunk_key, random_layers(seed, SHAPE)
                _, times, _ = server_view(c, keys)
                model.store(r.variant_id, times)
            else:
                vid = rng.choice(sorted(keys))
                cfo = rng.choice([None, 0.0, 0.1, 0.25, 0.5, 0.8, 1.0])
                got = [(f.key, f.value) for f in c.fetch_layers([Ref(keys[vid], vid, cfo)])]
                for (gk, gv), (wk, wv) in zip(got, sent[vid]):  # identical, from host or disk
                    assert torch.equal(gk, wk) and torch.equal(gv, wv)
                _, times, _ = server_view(c, keys)
                model.fetch(vid, cfo, times)
            in_host, _, fr = server_view(c, keys)
            assert in_host == model.in_host, f"step {step}"
            assert fr == pytest.approx(model.fr)
        assert model.moves > 5  # the trace really exercised demotion
        assert c.stats().moves == model.moves


def test_leased_and_pinned_variants_survive_any_pressure(start_server):
    server = start_server(host_budget_bytes=SIZE, disk_budget_bytes=4 * SIZE)
    with KVClient(server.address) as c:
        leased = c.store(MODEL, tokens_for(0), random_layers(0, SHAPE))
        pinned = c.store(MODEL, tokens_for(1), random_layers(1, SHAPE))
        lease = c.lease([Ref(leased.chunk_key)], ttl_s=3600)
        assert lease.variant_ids == [leased.variant_id]
        assert c.pin(chunk_key=pinned.chunk_key) == 1
        for seed in range(2, 30):  # 7x the disk budget
            c.store(MODEL, tokens_for(seed), random_layers(seed, SHAPE))
        assert c.stats().evictions >= 26
        for r, seed in ((leased, 0), (pinned, 1)):
            got = c.fetch(r.chunk_key)
            assert all(torch.equal(a, b) for (a, _), (b, _) in zip(got, random_layers(seed, SHAPE)))
        assert c.evict(chunk_key=leased.chunk_key).skipped_protected == 1
        assert c.flush().skipped_protected == 2

        # Fill the disk again, protect everything: a store that needs room is refused.
        for seed in (40, 41):
            c.store(MODEL, tokens_for(seed), random_layers(seed, SHAPE))
        assert len(c.list_chunks().chunks) == 4
        everything = c.lease([Ref(i.chunk_key) for i in c.list_chunks().chunks], ttl_s=3600)
        with pytest.raises(ResourceExhaustedError, match="disk tier is full"):
            c.store(MODEL, tokens_for(99), random_layers(99, SHAPE))
        assert c.fetch(pinned.chunk_key)

        # Release and unpin: now the policy may take them.
        assert c.release(lease.lease_id) and not c.release(lease.lease_id)
        assert c.release(everything.lease_id)
        assert c.unpin(chunk_key=pinned.chunk_key) == 1
        assert c.evict(chunk_key=pinned.chunk_key).evicted == 1
        with pytest.raises(NotFoundError):
            c.fetch(pinned.chunk_key)


def test_each_chunk_keeps_at_most_m_variants_lowest_fr_goes(start_server):
    server = start_server(max_variants_per_chunk=2)
    with KVClient(server.address) as c:
        base = c.store(MODEL, tokens_for(0), random_layers(0, SHAPE))
        prefixes = [[c.store(MODEL, tokens_for(s), random_layers(s, SHAPE)).chunk_key] for s in (1, 2)]
        v1 = c.store(MODEL, tokens_for(0), random_layers(3, SHAPE), prefix_keys=prefixes[0])
        list(c.fetch_layers([Ref(base.chunk_key, base.variant_id, 0.5)]))  # base fr = 2 > v1 fr = 0
        v2 = c.store(MODEL, tokens_for(0), random_layers(4, SHAPE), prefix_keys=prefixes[1])
        held = {i.variant_id for i in c.get_chunk(base.chunk_key)}
    assert held == {base.variant_id, v2.variant_id}
    assert v1.variant_id not in held


def test_metrics_endpoint_reports_tiers(start_server):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_server(metrics_port=port, host_budget_bytes=SIZE)
    with KVClient(server.address) as c:
        for seed in range(3):
            c.store(MODEL, tokens_for(seed), random_layers(seed, SHAPE))
        c.fetch(c.list_chunks().chunks[0].chunk_key)
        stats = c.stats()
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    disk = next(t for t in stats.tiers if t.name == "disk")
    assert f'kvcraft_tier_bytes{{tier="disk"}} {float(disk.bytes_used)}' in text
    assert f"kvcraft_moves_total {float(stats.moves)}" in text
    assert "kvcraft_fetch_seconds_count 1.0" in text
    assert not stats.HasField("cluster") and "kvcraft_cluster" not in text  # not a cluster node


def test_same_host_fast_path_reads_the_slab_without_copies(start_server):
    server = start_server(host_budget_bytes=2 * SIZE)
    with KVClient(server.address) as c:
        rs = [c.store(MODEL, tokens_for(s), random_layers(s, SHAPE)) for s in range(3)]  # one is only on disk
        with c.fetch_local([Ref(r.chunk_key) for r in rs[:2]]) as got:
            assert got.lease_id
            for layers, seed in zip(got.layers, (0, 1)):
                assert layers is not None
                for (k, v), (wk, wv) in zip(layers, random_layers(seed, SHAPE)):
                    assert torch.equal(k, wk) and torch.equal(v, wv)
            assert c.stats().leases == 1
        assert c.stats().leases == 0  # released on exit
        # A variant that is not in host memory is brought in (Locate promotes it).
        with c.fetch_local([Ref(rs[2].chunk_key)]) as got:
            (layers,) = got.layers
            assert all(torch.equal(k, wk) for (k, _), (wk, _) in zip(layers, random_layers(2, SHAPE)))
        # Too big for the host tier: no location; the caller falls back to FetchLayers.
        big = c.store(MODEL, list(range(1000, 1100)), [(torch.zeros(2, 100, 8), torch.zeros(2, 100, 8))] * 2)
        with c.fetch_local([Ref(big.chunk_key)]) as got:
            assert got.layers == [None]


def test_disk_delete_frees_at_once_and_a_variant_stored_again_meanwhile_is_kept(tmp_path):
    """A deleted payload leaves the tier and its usage at once; its file is unlinked
    later, off the caller's thread. A variant stored again under the same id before
    that must keep its new file, and closing the tier leaves no file behind."""
    from kvservice.tiers.base import PayloadShape
    from kvservice.tiers.disk import DiskTier

    tier = DiskTier(tmp_path / "payloads", 1 << 20)
    shape = PayloadShape(2, 4096)
    vids = [f"{i:02x}" + "a" * 30 for i in range(8)]

    def write(vid: str, fill: int) -> None:
        w = tier.open_writer(vid, shape)
        for _ in range(2):
            w.write_layer(bytes([fill]) * 4096)
        w.commit()

    for vid in vids:
        write(vid, 1)
    assert tier.usage() == 8 * 2 * 4096
    for vid in vids:
        tier.delete(vid)
        assert vid not in tier and not tier.path_of(vid).exists()
        write(vid, 2)  # stored again at once, while the old file may wait for the reaper
    assert tier.usage() == 8 * 2 * 4096
    tier.close()  # the reaper has unlinked every old file by now
    files = sorted(p.name for p in (tmp_path / "payloads").rglob("*") if p.is_file())
    assert files == sorted(v + ".kv" for v in vids)
    for vid in vids:
        assert tier.path_of(vid).read_bytes()[:8192] == bytes([2]) * 8192
