"""A node's store and the cluster: adopt what other nodes listed, copy out what it stored.

- `discover(chunk_keys)`: before a Plan, read the variant lists of the request's chunks
  (ClusterView) and add the variants this node does not know to its index as
  remote-only records (tier "remote", not persisted: after a restart the node asks
  the cluster again). The store tells its listeners, so the planner's catalog and
  CP-Tree see them like local ones; a lease holds them like local ones; a fetch
  reads them from the remote tier and promotes them into the host slab. A variant this
  node holds whose copy in the cluster it counted on, gone now (it lay in the segment of
  a node the master dropped), is copied out again.
- write-through: after a Store is acknowledged, copy the variant from the fastest
  local tier holding it into the remote tier, in the background (one worker thread,
  never on the request's path), so other nodes can reuse it at once.
- republish: after a start, and whenever the node's client says the cluster may have
  lost what it held (`MooncakeClient.on_rejoin`), put back each local variant the
  cluster no longer holds or lists; a variant that fails is tried again on its own.

Both use the store's parts as the store's own promotion does: state under the store's
lock, payload copies outside it while the variant is held (so it cannot move).
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import Future, ThreadPoolExecutor
from concurrent.futures import TimeoutError as FutureTimeout
from typing import Sequence

from kvservice.cluster.records import payload_key, record_bytes
from kvservice.cluster.view import MISSING, UNLISTED, ClusterView, Lookup
from kvservice.errors import KVCraftError
from kvservice.index import Variant
from kvservice.records import ClusterStats
from kvservice.store.state import StoreState
from kvservice.tiers.base import Tier, TierFull
from kvservice.variant_codec import to_variant

log = logging.getLogger("kvcraft.cluster")

WRITE_ATTEMPTS = 3
REPUBLISH_BATCH = 512  # variants looked up in the cluster per call
REPUBLISH_BACKOFF_MAX_S = 30.0


def attach_cluster(state: StoreState) -> "ClusterSync | None":
    """The store's link to the cluster, if one of its tiers is `shared` across nodes."""
    for t in state.tiers:
        view = t.cluster_view() if t.shared else None
        if view is not None:
            return ClusterSync(state, t, view, state.cfg.remote_write_through)
    return None


class ClusterSync:
    """Attached to a store one of whose tiers is shared across nodes (`attach_cluster`)."""

    def __init__(self, state: StoreState, remote: Tier, view: ClusterView, write_through: bool) -> None:
        self.s = state
        self.remote = remote
        self.view = view
        self.remote_index = state.tiers.index(remote)
        self.write_through = write_through
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvcraft-remote")
        # The view's reads run here, waited for at most remote_timeout_s: a node that
        # stops answering mid-read (a partition) must not hold a Plan longer than that.
        self._lookups = ThreadPoolExecutor(1, thread_name_prefix="kvcraft-view")
        self._lookup: Future | None = None
        self._putting_back: set[str] = set()  # variant ids a `_put_back` queued will look at
        self.timeout_s = state.cfg.remote_timeout_s
        self._closed = False
        remote.bind(state.index.get)
        state.listeners.append(self)
        view.client.on_rejoin.append(self.republish)
        self.republish()  # a restart: what this node holds may be gone from the cluster

    def stats(self) -> ClusterStats:
        """Whether the master answers (`kvservice.cluster.watch`) and which segments are
        skipped (`kvservice.cluster.silence`): Admin Stats and the metrics."""
        client = self.view.client
        return ClusterStats(client.up, client.silent.endpoints())

    # -- putting this node's variants back -------------------------------------------------
    def republish(self, retry: int = 0, only: frozenset[str] | None = None) -> None:
        """Put this node's local variants the cluster lost back into it, in the background:
        after a start, and whenever the node's client says the cluster may have lost them
        (a master that answers again, or that dropped this node's segment: a restarted
        master starts empty, one that lost this node dropped its segment's objects). Those
        the cluster refuses are tried again after 1, 2, 4 ... 30 s (`retry` counts the
        tries; `only`: their ids), each on its own: one refused copy holds up no other."""
        if not self._closed:
            self._pool.submit(self._republish, retry, only)

    def _retry_republish(self, retry: int, vids: list[str]) -> None:
        delay = min(REPUBLISH_BACKOFF_MAX_S, 2.0 ** retry)
        log.info("the cluster refused %d copies; trying them again in %.0fs", len(vids), delay)
        timer = threading.Timer(delay, self.republish, (retry + 1, frozenset(vids)))
        timer.daemon = True
        timer.start()

    def _republish(self, retry: int, only: frozenset[str] | None) -> None:
        s = self.s
        with s.lock:
            local = [v for v in s.index if (only is None or v.variant_id in only)
                     and any(i != self.remote_index for i in s.holders(v))]
        copied = listed_again = 0
        refused: list[str] = []
        for at in range(0, len(local), REPUBLISH_BATCH):
            batch = local[at : at + REPUBLISH_BATCH]
            try:
                held = self.view.copies(batch)
            except KVCraftError as e:
                log.info("republishing stopped (%s): the next rejoin tries again", e)
                return
            for v, there in zip(batch, held):
                if there == MISSING:
                    with s.lock:  # whatever this node knew of its copy is stale (not deleted: it is gone)
                        if v.variant_id in self.remote:
                            self.remote.forget(v.variant_id)
                            s.retier(v)
                    done = self._copy_out(v.variant_id)
                    copied += done
                elif there == UNLISTED:
                    listed = self._publish(v)
                    done = listed is not None
                    listed_again += bool(listed)
                else:  # LISTED, or ELSEWHERE: another node's copy serves the fleet
                    done = True
                if not done:
                    refused.append(v.variant_id)
        if copied or listed_again:
            log.info("republished: of the %d variants this node holds, %d copied into the cluster (or found "
                     "there), %d listed again", len(local), copied, listed_again)
        if refused and not self._closed:
            self._retry_republish(retry, refused)

    def _publish(self, v: Variant) -> bool | None:
        """Whether the list names this node's copy now (False: another node's copy of the
        variant); None when the cluster did not answer."""
        try:
            return self.view.publish(v)
        except KVCraftError:
            return None

    # -- adopting what other nodes stored ------------------------------------------------
    def discover(self, chunk_keys: Sequence[str]) -> int:
        """Adopt the listed variants of these chunks this node lacks; how many. Within
        remote_timeout_s, or nothing: the Plan goes on with what this node holds (and
        while an earlier lookup still hangs, no new one starts)."""
        chunks = list(dict.fromkeys(chunk_keys))
        with self.s.lock:
            if self._lookup is not None and not self._lookup.done():
                return 0
            self._lookup = lookup = self._lookups.submit(self.view.lookup, chunks)
        try:
            found: Lookup = lookup.result(timeout=self.timeout_s)
        except FutureTimeout:
            log.warning("cluster view did not answer within %.1fs (the master?): planning from this node's tiers",
                        self.timeout_s)
            return 0
        s, n = self.s, 0
        cfg = s.cfg
        bad: list[tuple[str, str]] = []  # (chunk, variant id): entries not describing theirs, removed after
        with s.lock:
            for e in found.entries:
                vid = e.info.variant_id
                if vid in s.index:
                    v = s.index.get(vid)
                    if vid not in self.remote and record_bytes(v) == e.record:  # the listed copy is its bytes
                        self.remote.adopt(vid, e.info.size_bytes)
                        s.placed(v, self.remote_index)
                    continue
                if len(s.index.variants_of(e.info.chunk_key)) >= cfg.max_variants_per_chunk \
                        or len(s.index) >= cfg.max_variants:
                    continue  # no room without evicting local variants for remote ones
                v = to_variant(s.index, e.info)
                if v is None or v.size_bytes != e.info.size_bytes:
                    bad.append((e.info.chunk_key, vid))
                    continue
                now = s.now_ms()
                v.created_ms, v.last_access_ms = now, now
                self.remote.adopt(vid, e.info.size_bytes)
                s.retier(v)
                s.index.add(v)
                s.placed(v)
                for lst in s.listeners:
                    lst.on_put(v)
                n += 1
            unlisted = [vid for vid in self._unlisted(chunks, found) if vid not in self._putting_back]
            self._putting_back.update(unlisted)
        for chunk, vid in bad:
            self.view.drop_entry(chunk, vid)
        if unlisted:
            self._pool.submit(self._put_back, unlisted)
        return n

    def _unlisted(self, chunks: Sequence[str], found: Lookup) -> list[str]:
        """Local variants of `chunks` whose copy in the cluster this node counts on, and
        which the lists do not name (store lock held)."""
        s = self.s
        listed = {e.info.variant_id for e in found.entries}
        return [v.variant_id for chunk in chunks if chunk not in found.unknown  # unknown: a silent segment
                for v in s.index.variants_of(chunk)
                if v.variant_id in self.remote and v.variant_id not in listed
                and any(i != self.remote_index for i in s.holders(v))]

    def _put_back(self, vids: list[str]) -> None:
        """Copy out again those of `vids` whose copy is gone from the cluster (it lay in the
        segment of a node the master dropped); one that is there, its list slot taken by
        another variant of the chunk, stays as it is."""
        s = self.s
        with s.lock:
            self._putting_back.difference_update(vids)
            held = [v for vid in vids if (v := s.index.get(vid)) is not None and vid in self.remote]
        try:
            there = self.view.client.exists([payload_key(self.view.ns, v.variant_id, record_bytes(v)) for v in held])
        except KVCraftError:
            return  # the master does not answer: the rejoin's republish puts them back
        for v, stored in zip(held, there):
            if stored:
                continue
            with s.lock:  # what this node knew of that copy is stale (not deleted: it is gone)
                if v.variant_id in self.remote:
                    self.remote.forget(v.variant_id)
                    s.retier(v)
            self._copy_out(v.variant_id)

    # -- StoreListener: write-through ----------------------------------------------------
    def on_put(self, variant: Variant) -> None:
        if self.write_through and variant.variant_id not in self.remote:
            self._pool.submit(self._copy_out, variant.variant_id)

    def on_evict(self, variant_id: str) -> None:
        pass

    def _copy_out(self, vid: str) -> bool:
        """Copy the variant into the cluster; False when every attempt failed on the
        cluster's side (True: copied, or nothing to copy)."""
        s = self.s
        with s.lock:
            v = s.index.get(vid)
            if v is None or vid in self.remote:
                return True
            held = [i for i in s.holders(v) if i != self.remote_index]
            if not held:
                return True
            src = s.tiers[held[0]]
            shape = s.shape(v)
            v.holds += 1
        try:
            # The master places each object on some node's segment; a node that died a
            # moment ago may still be listed (until its client_ttl passes), so a failed
            # copy is tried again: the next placement is another one.
            for attempt in range(WRITE_ATTEMPTS):
                if not self.view.client.up:  # put back when it answers again (`republish`)
                    log.info("write-through of %s waits: the Mooncake master does not answer", vid)
                    return False
                try:
                    writer = self.remote.open_writer(vid, shape)
                except (TierFull, KeyError) as e:
                    log.info("write-through of %s skipped: %s", vid, e)
                    return True
                except KVCraftError as e:
                    log.warning("write-through of %s failed (attempt %d): %s", vid, attempt + 1, e)
                    continue
                try:
                    for layer in range(v.num_layers):
                        data = src.get_layer(vid, layer, shape)
                        if src.verify_reads and not v.layer_intact(layer, data):  # (a start reads no payload)
                            writer.abort()
                            log.warning("write-through of %s skipped: layer %d of its %s copy fails its checksum "
                                        "(its next read drops it)", vid, layer, src.name)
                            return True
                        writer.write_layer(data)
                    writer.commit()  # header and list entry: network calls, outside the store's lock
                    with s.lock:
                        if vid in s.index:
                            s.placed(v, self.remote_index)
                            return True
                    writer.withdraw()  # deleted meanwhile: its copy goes too
                    return True
                except (KeyError, OSError) as e:  # the local copy went away: nothing to copy
                    writer.abort()
                    log.info("write-through of %s skipped: %s", vid, e)
                    return True
                except KVCraftError as e:
                    writer.abort()
                    log.warning("write-through of %s failed (attempt %d): %s", vid, attempt + 1, e)
            return False
        finally:
            with s.lock:
                v.holds -= 1

    def flush(self) -> None:
        """Wait for the write-throughs queued so far (tests, benchmarks, shutdown)."""
        self._pool.submit(lambda: None).result()

    def close(self) -> None:
        self._closed = True
        self._pool.shutdown(wait=True)
        self._lookups.shutdown(wait=False, cancel_futures=True)  # a lookup stuck on a lost node is not waited for
