"""The engine side's one loader: stored variants, layer by layer, from the service.

    source = ServiceLayerSource(client, {index: ref}, local=True, deadline=time.monotonic() + 5.0)
    for layer in range(num_layers):
        got = source.wait_layer(layer)   # {index: (K, V)}; a late or missing variant is absent
    source.close()                       # ends the stream, releases the Locate lease

`RAGAdapter` (the reference engine, and blending inside vLLM) and the vLLM connector's
prefix loads (`engine_adapter.vllm.worker`) read the service through it. Two paths, one
source; the copies each costs can be read off it:

- mapped (`local`: the service runs on this host): one Locate leases the variants and
  places them in the service's host tier (or finds them in its gpu tier); their layers
  are tensors aliasing its shared memory (`kvclient.local`): no byte crosses gRPC, 0
  copies. They are valid until `close()` releases the lease.
- streamed: the variants Locate could not place in host memory, or all of them when
  `local` is off or Locate failed (never raised), come over one FetchLayers stream
  (`kvclient.layer_stream.LayerStream`, `depth` layers ahead of the consumer): grpcio's
  copy, none after. A Locate that failed because the service is on another host (it
  answered FAILED_PRECONDITION: this client's address is not its host's; or its shared
  memory is not here) sets `elsewhere`, and the consumer turns `local` off and logs it
  once; any other failure is logged here.

The consumer copies what it keeps: the reference engine re-rotates each layer's K into
its merged cache; the vLLM worker gathers each layer's blocks into one tensor and
scatters it into its paged cache (one `index_copy_` per K and per V). `mapped` and
`streamed` name the indices each path served.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any, Mapping

import grpc
from torch import Tensor

from engine_adapter.source import LayerKV
from kvclient.errors import DeadlineExceededError, FailedPreconditionError, KVCraftError
from kvclient.layer_stream import LayerStream
from kvcraft.records import Ref

log = logging.getLogger(__name__)
# A mapped layer is handed out (and replayed to a later pass) only while its Locate lease has this
# long to run: the consumer copies it at once, so the service cannot move the bytes under that copy.
LEASE_MARGIN_S = 1.0


class ServiceLayerSource:
    """A `LayerSource` over the service: shared memory where co-located, one stream for the rest.

    refs: index (a prompt's segment, a request's block) -> the variant to read.
    local: the service runs on this host: try Locate first.
    deadline: `time.monotonic()` after which nothing is waited for (Locate included).
    depth: layers the stream may run ahead of the last one handed out (None: no limit).
    """

    def __init__(self, client: Any, refs: Mapping[int, Ref], *, local: bool, deadline: float,
                 depth: int | None = 1, name: str = "kvcraft-fetch") -> None:
        self.mapped: list[int] = []  # indices read from shared memory
        self.mapped_tier = ""  # the tier the mapped variants lie in ("" when several)
        self.mapped_seconds: dict[int, float] = {}  # layer -> seconds to hand out the mapped part
        self.mapped_bytes: dict[int, int] = {}  # layer -> K+V bytes of the mapped part
        self.local_error = ""  # why Locate did not serve (then everything streams)
        self.elsewhere = False  # the service's shared memory cannot be mapped here: it runs on another host
        self.lease_lapsed: int | None = None  # the layer from which the mapped variants were withheld (lease ended)
        self._layers: dict[int, list[tuple[Tensor, Tensor]]] = {}
        self._lease: Any = None  # kvclient.local.LocalFetch while mapped tensors are handed out
        self._margin_s = LEASE_MARGIN_S  # (made a tenth of a shorter lease once Locate answers)
        self._lock = threading.Lock()
        self._closed = False
        if local and refs:
            self._locate(client, refs, deadline)
        rest = {i: r for i, r in refs.items() if i not in self._layers}
        self.streamed = list(rest)  # indices read from the stream
        self._stream = (LayerStream(client, list(rest.values()), deadline=deadline, depth=depth, name=name)
                        if rest else None)

    def _locate(self, client: Any, refs: Mapping[int, Ref], deadline: float) -> None:
        left = deadline - time.monotonic()
        try:
            if left <= 0:
                raise DeadlineExceededError(grpc.StatusCode.DEADLINE_EXCEEDED, "deadline passed before Locate")
            located = client.fetch_local(list(refs.values()), timeout=min(left, client.timeout))
        except (KVCraftError, OSError, ValueError) as e:
            self.local_error = f"{type(e).__name__}: {e}"[:300]
            # Another host: the service refused (FAILED_PRECONDITION: the client's address is
            # not its host's), or its segment is not here. The consumer says so once and
            # turns `local` off; any other failure is this load's own.
            self.elsewhere = isinstance(e, (OSError, FailedPreconditionError))
            if self.elsewhere:
                log.debug("kvcraft Locate: the service is on another host (%s); streaming", self.local_error)
            else:
                log.warning("kvcraft Locate failed (%s); streaming over gRPC instead", self.local_error)
            return
        self._lease = located
        # the margin: LEASE_MARGIN_S, or a tenth of a shorter lease (`lease_timeout_s`)
        self._margin_s = min(LEASE_MARGIN_S, 0.1 * max(0.0, located.expires_unix_ms / 1000 - time.time()))
        tiers = set()
        for i, layers, tier in zip(refs, located.layers, located.tier):
            if layers is not None:
                self._layers[i] = layers
                tiers.add(tier)
        self.mapped = list(self._layers)
        self.mapped_tier = tiers.pop() if len(tiers) == 1 else ""
        if not self._layers:
            self._release()

    @property
    def error(self) -> str | None:
        """Why the stream stopped before every layer arrived (None: it did not)."""
        return self._stream.error if self._stream is not None else None

    @property
    def arrived(self) -> dict[int, float]:
        """Streamed part: layer -> seconds from the start until every streamed variant had it."""
        return self._stream.arrived if self._stream is not None else {}

    @property
    def layer_bytes(self) -> dict[int, int]:
        """Streamed part: layer -> K+V bytes received."""
        return self._stream.layer_bytes if self._stream is not None else {}

    def wait_layer(self, layer: int, deadline: float | None = None) -> LayerKV:
        """Layer `layer` of every variant that is here by min(deadline, the source's
        deadline): the mapped ones at once, the streamed ones as they arrive. Nothing
        after `close()`."""
        t0 = time.perf_counter()
        with self._lock:
            if self._closed:
                return {}
            if self._layers and not self._holds():
                # Past (or about to pass) the lease's end the service may move those bytes:
                # the mapped variants are absent from here on, and the consumer computes them.
                log.warning("kvcraft: the Locate lease of variants %s ended before layer %d was read; computing "
                            "them instead", sorted(self._layers), layer)
                self.lease_lapsed = layer
                self._layers.clear()
            got = {i: layers[layer] for i, layers in self._layers.items() if layer < len(layers)}
        if got:
            self.mapped_seconds[layer] = time.perf_counter() - t0
            self.mapped_bytes[layer] = sum(k.nbytes + v.nbytes for k, v in got.values())
        if self._stream is not None:
            streamed = self._stream.wait_layer(layer, deadline)
            got.update((self.streamed[j], kv) for j, kv in streamed.items())
        return got

    def holds(self) -> bool:
        """The layers handed out still hold the variants' bytes (`source.holds`): nothing was
        mapped, or the Locate lease has more than its margin to run."""
        with self._lock:
            return self.lease_lapsed is None and (not self._layers or self._holds())

    def _holds(self) -> bool:
        return self._lease.held(self._margin_s)

    def cancel(self) -> None:
        """End the stream now without waiting for its reader (any thread); the consumer's
        `close()` still releases the lease."""
        if self._stream is not None:
            self._stream.close(join_s=0.0)

    def close(self) -> None:
        """End the stream and release the lease; idempotent. The mapped tensors handed out
        are not to be read after it."""
        with self._lock:
            if self._closed:
                return
            self._closed = True
            self._layers.clear()
        if self._stream is not None:
            self._stream.close()
        self._release()

    def _release(self) -> None:
        lease, self._lease = self._lease, None
        if lease is None:
            return
        try:
            lease.release()
        except Exception as e:  # noqa: BLE001 - the lease times out by itself; a load never fails for it
            log.warning("kvcraft Release of a Locate lease failed (%s: %s); it times out by itself",
                        type(e).__name__, str(e)[:200])
