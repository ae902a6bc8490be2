"""Remote tier: variants in a Mooncake Store cluster shared by every kvcraft node.

Last in the tier list (host, disk, remote). Variants arrive here two ways: demotion
out of the disk tier (the store's usual one-tier-down move), and write-through after
a Store (`remote_write_through`), so other nodes can reuse a chunk as soon as it is
stored. Each payload object is self-describing and checksummed
(kvservice.cluster.records) and keyed by variant id, a content hash, and its record, so
any node finds any variant and a list entry names the very bytes it describes; after the
write the variant is listed in its chunk's variant list (kvservice.cluster.view), which is
how other nodes' planners see it. The store reads a copy under its own record of the
variant: its own copy, or the one another node listed, which it adopted.

Zero-copy: a writer reserves the object (a Mooncake put session) and copies each
layer into it straight from the caller's memory (the host slab or the disk read
buffer); a read brings header and payload in one call straight into a buffer of this
tier, whose layers the store copies into the host slab when it promotes.

The tier is `shared`: another node may delete or replace a variant, and the master
may lose everything; a read that finds nothing, or a header that does not carry the
expected record, is KeyError ("not here"): the store drops its record of the remote
copy and the engine recomputes. Layer checksums are checked by the store
(`verify_reads`), so altered bytes are never served.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from collections import OrderedDict

from kvcraft import tiers
from kvservice.cluster.mooncake import MooncakeClient, ObjectMissing, RemoteSettings
from kvservice.cluster.records import BadRecord, check_header, encode_header, header_length, payload_key, record_bytes
from kvservice.cluster.view import ClusterView
from kvservice.config import Config
from kvservice.errors import KVCraftError, Unavailable
from kvservice.index import Variant
from kvservice.tiers.base import Buffer, PayloadShape, RecordOf, Tier, TierFull, TierWriter

log = logging.getLogger("kvcraft.remote")
READERS = 4  # remote reads in flight (each waited for at most remote_timeout_s)


def _check_layers(v: Variant, payload: bytearray, shape: PayloadShape) -> None:
    for layer in range(shape.num_layers):
        if not v.layer_intact(layer, memoryview(payload)[shape.offset(layer) : shape.offset(layer + 1)]):
            raise BadRecord(f"layer {layer} fails its checksum")


class RemoteWriter(TierWriter):
    """Fills a reserved object layer by layer; `commit` adds the header and lists it."""

    def __init__(self, tier: "RemoteTier", info: Variant, shape: PayloadShape) -> None:
        self._tier = tier
        self._info = info
        self._shape = shape
        self._record = record_bytes(info)
        self._head = header_length(self._record)
        self._key = payload_key(tier.ns, info.variant_id, self._record)
        self._pos = 0
        self._open = True
        self._exists = False
        try:
            tier.client.begin_put(self._key, self._head + shape.total_bytes)
        except FileExistsError:  # a copy with this very record (the same bytes) is there, or being written
            self._exists = True

    def write_layer(self, *parts: Buffer) -> None:
        n = sum(p.nbytes if isinstance(p, memoryview) else len(p) for p in parts)
        if self._pos + n > self._shape.total_bytes:
            raise ValueError(f"{self._info.variant_id}: write past the payload's {self._shape.total_bytes} bytes")
        if not self._exists:
            self._tier.client.put_range(self._key, self._head + self._pos, parts)
        self._pos += n

    def commit(self) -> None:
        """Complete the object and list it. FileExistsError, with nothing of this writer's
        kept, when the list already names another copy of this variant id (other bytes)."""
        if self._pos != self._shape.total_bytes:
            raise ValueError(f"{self._info.variant_id}: {self._pos} bytes written, {self._shape.total_bytes} expected")
        client, vid, n, mine = self._tier.client, self._info.variant_id, self._shape.total_bytes, not self._exists
        if mine:
            client.put_range(self._key, 0, [encode_header(self._record, n)])
            client.end_put(self._key)
        elif not client.exists([self._key])[0]:
            # Another node's write of the same bytes is still open (or failed): listing it
            # now could name an object that never completes. That node lists it once done.
            raise Unavailable(f"{self._key}: another node's copy is not complete")
        self._open = False  # complete: counted from here on, listed or not
        try:
            listed = self._tier.view.publish(self._info)
        except BaseException:
            self._tier._committed(vid, n, mine)  # readable here; listed by the next republish
            raise
        if not listed:
            self._tier._discard(self._info, n, mine)
            raise FileExistsError(f"{vid}: another node's copy of this variant (other bytes) is listed")
        self._tier._committed(vid, n, mine)

    def withdraw(self) -> None:
        """Remove what `commit` wrote (the variant was deleted while it was copied out)."""
        if self._tier._is_mine(self._info.variant_id):
            self._tier._remove(self._info)

    def abort(self) -> None:
        if self._open:
            self._open = False
            if not self._exists:
                try:
                    self._tier.client.abort_put(self._key)
                except KVCraftError:
                    pass  # the master discards an unfinished put on its own
            self._tier._release(self._shape.total_bytes)


def remote_tier(cfg: Config) -> "RemoteTier":
    """Join the cluster `cfg.remote_master` names; Unavailable if it cannot be reached."""
    client = MooncakeClient(RemoteSettings(cfg.remote_master, cfg.remote_local_hostname, cfg.remote_protocol,
                                           cfg.remote_device, cfg.remote_segment_bytes, cfg.remote_buffer_bytes,
                                           cfg.remote_timeout_s))
    holder = cfg.remote_advertise or advertise(cfg, client.settings.local_hostname, cfg.port)
    view = ClusterView(client, cfg.remote_namespace, holder, cfg.remote_list_slots)
    return RemoteTier(client, view, cfg.remote_budget_bytes)


def advertise(cfg: Config, local_hostname: str, port: int) -> str:
    """This node's gRPC address for the cluster view when remote_advertise is empty: the
    address it listens on, or the segment's address where it listens on every interface."""
    host = local_hostname if cfg.host in ("", "0.0.0.0", "::", "[::]") else cfg.host
    return f"[{host}]:{port}" if ":" in host else f"{host}:{port}"


class RemoteTier(Tier):
    name = tiers.REMOTE
    persistent = False  # the cluster outlives this process, but not the master's loss
    shared = True
    cache_on_store = False
    verify_reads = True

    def __init__(self, client: MooncakeClient, view: ClusterView, budget_bytes: int,
                 read_cache_bytes: int = 256 << 20) -> None:
        super().__init__(budget_bytes)
        self.client = client
        self.timeout_s = client.settings.timeout_s
        self._reads = ThreadPoolExecutor(READERS, thread_name_prefix="kvcraft-remote-read")
        self._deletes = ThreadPoolExecutor(1, thread_name_prefix="kvcraft-remote-delete")
        self.view = view
        self.ns = view.ns
        self._record_of: RecordOf = lambda vid: None
        self._known: dict[str, int] = {}  # variant id -> payload bytes, listed in the cluster
        self._mine: set[str] = set()  # written by this node (counted in usage)
        self._used = 0  # payload bytes this node wrote, plus open writers
        self._lock = threading.Lock()
        # Payloads read last: a layer-major fetch of several remote-only variants reads
        # each one whole once, then serves its layers from here (LRU, bounded in bytes).
        self._cache: OrderedDict[str, bytearray] = OrderedDict()
        self._cache_bytes = 0
        self._cache_limit = read_cache_bytes

    def bind(self, record_of: RecordOf) -> None:
        """The store's record of a variant id (a writer puts it in the header)."""
        self._record_of = record_of

    # -- write ------------------------------------------------------------------------
    def open_writer(self, variant_id: str, shape: PayloadShape) -> RemoteWriter:
        info = self._record_of(variant_id)
        if info is None:
            raise KeyError(f"{variant_id}: no record to describe the remote payload with")
        with self._lock:
            if self._used + shape.total_bytes > self.budget_bytes:
                raise TierFull(f"remote tier budget {self.budget_bytes} bytes: {self._used} used by this node")
            self._used += shape.total_bytes
        try:
            return RemoteWriter(self, info, shape)
        except BaseException:
            self._release(shape.total_bytes)
            raise

    def _committed(self, vid: str, n: int, mine: bool) -> None:
        with self._lock:
            self._known[vid] = n
            if mine and vid not in self._mine:
                self._mine.add(vid)
                return
        self._release(n)

    def _release(self, n: int) -> None:
        with self._lock:
            self._used -= n

    def _discard(self, info: Variant, n: int, mine: bool) -> None:
        """A complete copy that is not to be listed: removed if this node wrote it."""
        self._release(n)
        if mine:
            try:
                self.client.remove(payload_key(self.ns, info.variant_id, record_bytes(info)))
            except KVCraftError as e:
                log.info("removing the unlisted copy of %s failed (%s); the cluster evicts it in time",
                         info.variant_id, e)

    def cluster_view(self) -> ClusterView:
        return self.view

    def adopt(self, variant_id: str, size_bytes: int) -> None:
        """A variant another node listed: readable here from now on."""
        with self._lock:
            self._known.setdefault(variant_id, size_bytes)

    # -- read -------------------------------------------------------------------------
    def get_layer(self, variant_id: str, layer: int, shape: PayloadShape) -> memoryview:
        return self.get_layers(variant_id, layer, 1, shape)

    def get_layers(self, variant_id: str, first: int, count: int, shape: PayloadShape) -> memoryview:
        payload = self._payload(variant_id, shape)
        start = shape.offset(first)
        return memoryview(payload)[start : start + count * shape.layer_bytes]

    def _payload(self, vid: str, shape: PayloadShape) -> bytearray:
        with self._lock:
            got = self._cache.get(vid)
            if got is not None:
                self._cache.move_to_end(vid)
                return got
        info = self._record_of(vid)
        if info is None or vid not in self._known:
            raise KeyError(f"{vid}: not in the remote tier")
        record = record_bytes(info)
        header = bytearray(header_length(record))
        payload = bytearray(shape.total_bytes)
        try:
            self._read(payload_key(self.ns, vid, record), [header, payload])
            check_header(header, record, shape.total_bytes)
            _check_layers(info, payload, shape)
        except ObjectMissing:
            self._forget(vid)
            raise KeyError(f"{vid}: gone from the remote tier") from None
        except BadRecord as e:
            log.warning("remote payload of %s is not the listed variant (%s): deleting it", vid, e)
            self._remove(info)
            raise KeyError(f"{vid}: remote payload altered ({e})") from None
        except KVCraftError as e:  # master or peer unreachable: not here, for now
            raise KeyError(f"{vid}: remote tier unavailable ({e})") from None
        with self._lock:
            if vid not in self._cache:
                self._cache[vid] = payload
                self._cache_bytes += len(payload)
            while self._cache_bytes > self._cache_limit and self._cache:
                self._cache_bytes -= len(self._cache.popitem(last=False)[1])
        return payload

    def _read(self, key: str, parts: list[bytearray]) -> None:
        """get_into, waited for at most timeout_s: a node frozen or cut off mid-read can
        hold the call much longer. The segment that did not answer is silent from then on
        (`MooncakeClient.silent`): reads of objects in it fail at once until it answers a
        probe. The buffers are this read's own, so a call that finishes after it was given
        up writes into memory nobody reads."""
        where: list[str] = []
        try:
            self._reads.submit(self._read_from, key, parts, where).result(timeout=self.timeout_s)
        except FutureTimeout:
            self.client.silent.add(where[0] if where else "", f"no answer within {self.timeout_s:.1f}s reading {key}")
            raise Unavailable(f"no answer within {self.timeout_s:.1f}s reading {key} "
                              f"from {where[0] if where else 'its node'}") from None

    def _read_from(self, key: str, parts: list[bytearray], where: list[str]) -> None:
        at = self.client.placement(key)
        if not at:
            raise ObjectMissing(key)
        where.append(at)
        if at in self.client.silent:
            raise Unavailable(f"{key} lies in the segment at {at}, which stopped answering")
        self.client.get_into(key, parts)

    # -- bookkeeping ------------------------------------------------------------------
    def forget(self, variant_id: str) -> None:
        """Drop what this node knew of the variant's copy in the cluster, which is gone (a
        restarted master): unlike `delete`, nothing is removed there, where another node
        may be putting it back."""
        self._forget(variant_id)

    def _forget(self, vid: str) -> None:
        with self._lock:
            n = self._known.pop(vid, None)
            dropped = self._cache.pop(vid, None)
            if dropped is not None:
                self._cache_bytes -= len(dropped)
            if vid in self._mine:
                self._mine.discard(vid)
                self._used -= n or 0

    def delete(self, variant_id: str) -> None:
        """Forget the variant; remove it from the cluster only if this node wrote it
        (a node's eviction of a variant another node listed is not that node's loss),
        in the background: the store calls this under its lock, and a cluster call may
        wait up to remote_timeout_s. Altered payloads are removed by the read that finds
        them, whoever wrote them."""
        info = self._record_of(variant_id)
        mine = variant_id in self._mine
        self._forget(variant_id)
        if mine and info is not None:
            self._deletes.submit(self._remove, info)

    def flush(self) -> None:
        """Wait for the removals `delete` queued so far."""
        self._deletes.submit(lambda: None).result()

    def _is_mine(self, vid: str) -> bool:
        with self._lock:
            return vid in self._mine

    def _remove(self, info: Variant) -> None:
        """This copy of the variant leaves the cluster: its list entry, then its payload."""
        vid, record = info.variant_id, record_bytes(info)
        self._forget(vid)
        try:
            self.view.unpublish(info.chunk_key, vid, record)
            self.client.remove(payload_key(self.ns, vid, record))
        except KVCraftError as e:
            log.warning("remote delete of %s failed (%s); the cluster evicts it in time", vid, e)

    def usage(self) -> int:
        return self._used

    def __contains__(self, variant_id: object) -> bool:
        return variant_id in self._known

    def __len__(self) -> int:
        return len(self._known)

    def variant_ids(self) -> list[str]:
        with self._lock:
            return list(self._known)

    def close(self) -> None:
        self._reads.shutdown(wait=False, cancel_futures=True)  # a read stuck on a lost node is not waited for
        self._deletes.shutdown(wait=True)
        self.client.close()
