"""Chunk namespaces an engine cannot reuse but should hear about.

A chunk's KV is keyed by the engine's model fingerprint (`kvcraft.keys.ModelSpec`), dtype
included: KV computed in float32 is not the KV a bfloat16 engine computes, so it is never
served to it. That is right, but an engine whose dtype differs from the one that filled
the cache (a vLLM left to pick bfloat16 beside a float32 reference engine) then misses
every stored chunk and recomputes it, with nothing to say so. `NamespaceWatch` says so:
once at start-up when chunks are stored under a namespace that differs from the engine's
only in its dtype, and for each request that reused nothing while its first chunk is
stored under such a namespace (counted, logged once per namespace). Its look-ups run on
one background thread, never on a request's path, at most one at a time.
"""

from __future__ import annotations

import logging
import threading
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace
from typing import Any, Callable, Sequence

from kvcraft.keys import ModelSpec

log = logging.getLogger("kvcraft.namespace")

DTYPES = ("float32", "bfloat16", "float16")


def dtype_siblings(spec: ModelSpec) -> dict[str, str]:
    """The model ids of `spec` under each other dtype -> that dtype."""
    return {replace(spec, dtype=d).fingerprint(): d for d in DTYPES if d != spec.dtype}


class NamespaceWatch:
    """See the module docstring. `on_miss`: called (on the watch's thread) for each request
    whose chunks are stored under another dtype's namespace."""

    def __init__(self, spec: ModelSpec, client: Any, on_miss: Callable[[], None] | None = None) -> None:
        self.spec = spec
        self._client = client
        self._siblings = dtype_siblings(spec)
        self._on_miss = on_miss
        self._said: set[str] = set()
        self._idle = threading.Lock()  # held while a look-up runs: later ones are skipped
        self._pool = ThreadPoolExecutor(max_workers=1, thread_name_prefix="kvcraft-namespace")

    def check_stored(self) -> None:
        """In the background: is anything stored under a sibling namespace? (Admin
        ListChunks; skipped quietly where the service refuses it or is not up.)"""
        self._submit(self._stored)

    def check_missed(self, chunk: Sequence[int]) -> None:
        """A request reused nothing: in the background, is its first chunk stored under a
        sibling namespace? Skipped while another look-up runs."""
        self._submit(self._missed, list(chunk))

    def close(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _submit(self, fn: Callable[..., None], *args: Any) -> None:
        if not self._idle.acquire(blocking=False):
            return

        def run() -> None:
            try:
                fn(*args)
            except Exception as e:  # noqa: BLE001 - advice only: never fails the engine
                log.debug("kvcraft namespace check failed: %s", e)
            finally:
                self._idle.release()

        try:
            self._pool.submit(run)
        except RuntimeError:  # shut down
            self._idle.release()

    def _stored(self) -> None:
        for model_id, dtype in self._siblings.items():
            if self._client.list_chunks(model_id=model_id, page_size=1).chunks:
                self._say(model_id, dtype, "chunks of this model are stored")

    def _missed(self, chunk: list[int]) -> None:
        for model_id, dtype in self._siblings.items():
            if self._client.lookup(model_id, chunk).found:
                if self._on_miss is not None:
                    self._on_miss()
                self._say(model_id, dtype, "a request reused nothing while its chunks are stored")
                return

    def _say(self, model_id: str, dtype: str, what: str) -> None:
        if model_id in self._said:
            return
        self._said.add(model_id)
        log.warning("kvcraft: %s as %s KV (model id %s); this engine computes %s (model id %s) and never reuses "
                    "them: run the engine with dtype %s (vLLM: --dtype %s) to reuse them",
                    what, dtype, model_id, self.spec.dtype, self.spec.fingerprint(), dtype, dtype)
