"""The remote tier and the cluster view against a real mooncake_master on loopback.

Two Mooncake clients in this process stand for two nodes: what one writes through
the tier protocol, the other reads bit-identical, verified by an independent
checksum; altered bytes never come back.
"""

from __future__ import annotations

import threading
import time

import pytest
import xxhash

from kvcraft.keys import chunk_key, variant_id
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.cluster import records
from kvservice.cluster.view import ClusterView
from kvservice.index import VariantIndex
from kvservice.variant_codec import to_variant
from kvservice.tiers.base import PayloadShape, TierFull
from kvservice.tiers.remote import RemoteTier

from tests.service.remote_helpers import MiB

MODEL = "0" * 32


def make_variant(tokens: list[int], prefix: tuple[str, ...] = (), layers: int = 3, seed: int = 0):
    """A record and a payload of `layers` layers, K then V of [2, T, 8] fp16 each."""
    ck = chunk_key(MODEL, tokens)
    layer_bytes = 2 * (2 * len(tokens) * 8 * 2)
    rnd = __import__("random").Random(seed)
    payload = bytes(rnd.getrandbits(8) for _ in range(layers * layer_bytes))
    spec = pb.TensorSpec(dtype=pb.FLOAT16, shape=[2, len(tokens), 8])
    sums = []
    for l in range(layers):
        lay = payload[l * layer_bytes : (l + 1) * layer_bytes]
        h = xxhash.xxh3_64()
        h.update(lay[: layer_bytes // 2])
        h.update(lay[layer_bytes // 2 :])
        sums.append(h.intdigest())
    info = pb.VariantInfo(variant_id=variant_id(ck, prefix), chunk_key=ck, model_id=MODEL, prefix_keys=prefix,
                          token_count=len(tokens), num_layers=layers, key_spec=spec, value_spec=spec,
                          size_bytes=len(payload), layer_checksums=sums, tier="disk", fr=2.5,
                          created_unix_ms=123)
    v = to_variant(VariantIndex(), info)  # the store's record, as recovery builds it
    v.tier = "disk"
    return v, payload, PayloadShape(layers, layer_bytes)


class Node:
    """A remote tier as one node's store sees it: records by variant id."""

    def __init__(self, c, ns: str, name: str) -> None:
        self.records: dict[str, pb.VariantInfo] = {}
        self.view = ClusterView(c, ns, holder=name, slots=4)
        self.tier = RemoteTier(c, self.view, budget_bytes=8 * MiB)
        self.tier.bind(self.records.get)

    def write(self, info, payload, shape) -> None:
        self.records[info.variant_id] = info
        w = self.tier.open_writer(info.variant_id, shape)
        for l in range(shape.num_layers):
            lay = memoryview(payload)[shape.offset(l) : shape.offset(l + 1)]
            w.write_layer(lay[: shape.layer_bytes // 2], lay[shape.layer_bytes // 2 :])
        w.commit()

    def adopt_all(self, chunks) -> list:
        found = self.view.discover(chunks)
        for e in found:
            self.records[e.info.variant_id] = to_variant(VariantIndex(), e.info)
            self.tier.adopt(e.info.variant_id, e.info.size_bytes)
        return found


@pytest.fixture(scope="module")
def clients(cluster):
    return cluster.client(), cluster.client()


@pytest.fixture
def nodes(clients, request):
    """Two nodes on the shared clients, in a namespace of this test's own."""
    ns = "t-" + request.node.name
    return Node(clients[0], ns, "node-a:1"), Node(clients[1], ns, "node-b:2")


def test_variant_written_by_one_node_reads_bit_identical_on_another(nodes):
    a, b = nodes
    info, payload, shape = make_variant(list(range(40)))
    a.write(info, payload, shape)
    assert info.variant_id in a.tier and a.tier.usage() == len(payload)
    assert info.variant_id not in b.tier
    found = b.adopt_all([info.chunk_key])
    assert [(e.info.variant_id, e.holder) for e in found] == [(info.variant_id, "node-a:1")]
    assert found[0].info.tier == "remote" and list(found[0].info.layer_checksums) == list(info.layer_checksums)
    got = b.tier.get_layers(info.variant_id, 0, shape.num_layers, shape)
    assert bytes(got) == payload
    assert bytes(b.tier.get_layer(info.variant_id, 2, shape)) == payload[shape.offset(2) :]


def test_altered_remote_payload_is_not_served_and_its_entry_is_dropped(nodes):
    a, b = nodes
    info, payload, shape = make_variant(list(range(30)), seed=1)
    a.write(info, payload, shape)
    b.adopt_all([info.chunk_key])
    # Rewrite the object under the same key with one payload byte flipped and a header
    # for another record: what a buggy or foreign writer could leave behind.
    key = records.payload_key(a.tier.ns, info.variant_id, records.record_bytes(info))
    other = records.canonical(info)
    other.layer_checksums[0] ^= 1
    bad = bytearray(payload)
    bad[5] ^= 0xFF
    a.tier.client.remove(key)
    header = records.encode_header(records.record_bytes(other), len(bad))
    a.tier.client.begin_put(key, len(header) + len(bad))
    a.tier.client.put_range(key, 0, [header, bad])
    a.tier.client.end_put(key)
    with pytest.raises(KeyError, match="altered"):
        b.tier.get_layers(info.variant_id, 0, shape.num_layers, shape)
    assert info.variant_id not in b.tier
    assert b.view.discover([info.chunk_key]) == []  # entry dropped from the cluster's list
    assert a.tier.client.get_many([key]) == [b""]  # and the object deleted


def test_altered_list_entry_is_ignored_and_removed(nodes):
    a, _ = nodes
    info, payload, shape = make_variant(list(range(8)), seed=2)
    a.write(info, payload, shape)
    key = records.slot_key(a.tier.ns, info.chunk_key, records.slot_of(info.variant_id, 4))
    raw = bytearray(a.tier.client.get_many([key])[0])
    raw[-3] ^= 1
    a.tier.client.upsert(key, bytes(raw))
    assert a.view.discover([info.chunk_key]) == []
    assert a.tier.client.get_many([key]) == [b""]


def test_one_variant_id_written_with_other_bytes_reads_back_as_its_listing_describes(nodes):
    """Two nodes computed one variant (same chunk, same prefix) into different bytes, as
    engines whose kernels round differently do, and both wrote it: whichever copy the list
    names, a third node reads exactly the bytes the entry describes."""
    a, b = nodes
    reader = Node(a.tier.client, a.view.ns, "node-r:3")
    tokens = list(range(50))
    first, by_a, shape = make_variant(tokens, seed=20)
    second, by_b, _ = make_variant(tokens, seed=21)
    assert first.variant_id == second.variant_id and by_a != by_b
    a.write(first, by_a, shape)
    b.write(second, by_b, shape)
    (entry,) = reader.adopt_all([first.chunk_key])
    got = bytes(reader.tier.get_layers(first.variant_id, 0, shape.num_layers, shape))
    assert got == {"node-a:1": by_a, "node-b:2": by_b}[entry.holder]
    assert list(entry.info.layer_checksums) == list((first if got == by_a else second).layer_checksums)


def test_global_view_finds_the_longest_prefix_and_its_holder(nodes):
    a, b = nodes
    c0, c1, c2 = (chunk_key(MODEL, [i] * 4) for i in (1, 2, 3))
    for j, (toks, prefix) in enumerate([([1] * 4, ()), ([2] * 4, (c0,))]):
        info, payload, shape = make_variant(toks, prefix, seed=10 + j)
        a.write(info, payload, shape)
    # b computed c2 behind (c0, c1): the prefix path ends on b's variant
    info, payload, shape = make_variant([3] * 4, (c0, c1), seed=12)
    b.write(info, payload, shape)
    hit = b.view.longest_prefix([c0, c1, c2])
    assert hit.length == 3 and hit.holder == "node-b:2"
    assert hit.variant_ids == (variant_id(c0, ()), variant_id(c1, (c0,)), variant_id(c2, (c0, c1)))
    assert b.view.longest_prefix([c1, c0]).length == 0  # c1 alone was never stored
    assert a.view.longest_prefix([c0, c2]).length == 1


def test_a_put_session_the_client_still_holds_is_settled_and_the_variant_written(nodes):
    """A put whose end got no answer (a master frozen mid-write) leaves this client a
    session for the key, which refuses every later start of it: the next write of the
    variant settles it first."""
    a, b = nodes
    info, payload, shape = make_variant(list(range(60)), seed=30)
    key = records.payload_key(a.tier.ns, info.variant_id, records.record_bytes(info))
    size = records.header_length(records.record_bytes(info)) + len(payload)
    assert a.tier.client._store.batch_put_session_start([key], [size]) == [0]  # left open, as a lost end leaves it
    a.write(info, payload, shape)
    (entry,) = b.adopt_all([info.chunk_key])
    assert entry.info.variant_id == info.variant_id
    assert bytes(b.tier.get_layers(info.variant_id, 0, shape.num_layers, shape)) == payload


def test_a_node_whose_segment_the_master_dropped_is_told_to_put_its_variants_back(clients):
    """The master drops a node's segment, and what it held, when the node's client expired
    (a node frozen or cut off past client_ttl, a master frozen and resumed) or when the
    master restarted; the node notices by its mark in that segment, however it came about,
    and marks it again. Here the mark goes the way the master's unmount takes it."""
    client = clients[0]
    told = threading.Event()
    client.on_rejoin.append(told.set)
    try:
        assert client.mark_key and client.exists([client.mark_key]) == [True]
        client.remove(client.mark_key)
        assert told.wait(10), "the node was not told within 10 s"
        assert client.exists([client.mark_key]) == [True] and client.placement(client.mark_key) == client.endpoint
    finally:
        client.on_rejoin.remove(told.set)


def test_budget_refuses_and_delete_frees(nodes):
    a, _ = nodes
    a.tier.budget_bytes = 5000
    info, payload, shape = make_variant(list(range(40)), seed=3)  # 3 x 2560 bytes
    a.records[info.variant_id] = info
    with pytest.raises(TierFull):
        a.tier.open_writer(info.variant_id, shape)
    a.tier.budget_bytes = 8 * MiB
    a.write(info, payload, shape)
    a.tier.delete(info.variant_id)
    assert a.tier.usage() == 0 and info.variant_id not in a.tier
    a.tier.flush()  # the cluster's copy goes in the background
    assert a.view.discover([info.chunk_key]) == []


def test_master_down_reads_are_not_here_and_restart_reconnects(cluster, nodes):
    """Last in the module: it takes the shared master down and back."""
    a, b = nodes
    info, payload, shape = make_variant(list(range(16)), seed=4)
    a.write(info, payload, shape)
    b.adopt_all([info.chunk_key])
    cluster.master.kill()
    with pytest.raises(KeyError):
        b.tier.get_layers(info.variant_id, 0, shape.num_layers, shape)
    assert b.view.discover([info.chunk_key]) == []
    cluster.master.start()
    # The clients rejoin the restarted master on their own (their ping thread); poll
    # for it with a deadline rather than sleeping a fixed time.
    info2, payload2, shape2 = make_variant(list(range(17)), seed=5)
    deadline = time.monotonic() + 30
    while True:
        try:
            a.write(info2, payload2, shape2)
            break
        except Exception:
            if time.monotonic() > deadline:
                raise
            time.sleep(0.2)
    # B's client rejoins on its own ping thread too, maybe later than A's: poll for its
    # view of the new variant under the same deadline.
    while not b.adopt_all([info2.chunk_key]):
        assert time.monotonic() < deadline, "node B did not rejoin the restarted master in 30 s"
        time.sleep(0.2)
    assert bytes(b.tier.get_layers(info2.variant_id, 0, 3, shape2)) == payload2


def test_remote_section_of_the_config_file(tmp_path):
    from kvservice.config import Config, load_config

    f = tmp_path / "kvcraft.toml"
    f.write_text('port = 7000\n[remote]\nmaster = "10.0.0.5:50052"\nprotocol = "rdma"\ndevice = "mlx5_0"\n')
    cfg = load_config(f, env={})
    assert (cfg.port, cfg.remote_master, cfg.remote_protocol, cfg.remote_device) == (7000, "10.0.0.5:50052", "rdma", "mlx5_0")
    assert Config().remote_master == ""  # off by default: no remote tier, no Mooncake import
    f.write_text('[remote]\nprotocol = "udp"\n')
    with pytest.raises(ValueError, match="remote_protocol must be tcp or rdma"):
        load_config(f, env={})
    f.write_text('[remote]\nmastr = "x:1"\n')
    with pytest.raises(ValueError, match="remote_mastr"):
        load_config(f, env={})


def test_a_node_of_a_cluster_across_hosts_refuses_loopback_addresses(tmp_path):
    """A loopback segment or advertised address sends the other nodes to themselves: refused
    at start when the master is on another host; fine when the cluster is on loopback."""
    from kvservice.config import load_config

    f = tmp_path / "kvcraft.toml"
    for line in ('local_hostname = "127.0.0.1"', 'advertise = "localhost:50051"', 'advertise = "[::1]:50051"'):
        f.write_text(f'[remote]\nmaster = "10.0.0.5:50052"\n{line}\n')
        with pytest.raises(ValueError, match="is a loopback address, but remote_master '10.0.0.5:50052' is not"):
            load_config(f, env={})
    f.write_text('[remote]\nmaster = "127.0.0.1:50052"\nlocal_hostname = "127.0.0.1"\n')
    assert load_config(f, env={}).remote_local_hostname == "127.0.0.1"


def test_the_segment_address_defaults_to_the_route_to_the_master():
    """remote_local_hostname "" = the source address of this host's route to the master
    (kernel's choice, as `ip route get` shows it)."""
    import subprocess

    from kvservice.cluster.mooncake import route_address

    assert route_address("127.0.0.1:50052") == "127.0.0.1"
    got = subprocess.run(["ip", "-4", "route", "get", "192.0.2.200"], capture_output=True, text=True)
    if got.returncode != 0:
        pytest.skip(f"no IPv4 route off this host: {got.stderr.strip()}")
    words = got.stdout.split()
    assert route_address("192.0.2.200:50052") == words[words.index("src") + 1]


def test_the_node_configuration_docs_scale_out_shows_loads(tmp_path):
    """docs/scale-out.md's TOML block is a valid node configuration, as written."""
    import re
    from pathlib import Path

    from kvservice.config import load_config

    doc = (Path(__file__).resolve().parents[2] / "docs" / "scale-out.md").read_text()
    (block,) = re.findall(r"```toml\n(.*?)```", doc, re.S)
    f = tmp_path / "node.toml"
    f.write_text(block)
    cfg = load_config(f, env={})
    assert (cfg.host, cfg.remote_master, cfg.remote_timeout_s) == ("10.0.0.11", "10.0.0.5:50052", 2.0)
    assert cfg.remote_local_hostname == cfg.remote_advertise == ""  # derived at start
