"""kvcraft as a vLLM v1 KV connector (`KVConnectorBase_V1`), loaded by configuration.

    LLM(model, block_size=32, kv_transfer_config=kv_transfer_config("127.0.0.1:50051"))

What it moves: prefix KV in vLLM's own token blocks. Block i of a prompt is stored in
the service as a variant of the "chunk" made of that block's token ids, behind the
variant id of block i-1 (empty for block 0), so a block's variant id is a chained hash
of every token before it, exactly like vLLM's prefix cache:

    vid_0 = variant_id(chunk_key(M, tokens[0:B]), [])
    vid_i = variant_id(chunk_key(M, tokens[iB:(i+1)B]), [vid_{i-1}])

and one MatchPrefix RPC says how many leading blocks of a prompt the service holds.
M is a model id of its own (`block_model_spec`): vLLM's cached K is *after* RoPE, at
the block's absolute positions, unlike kvcraft's chunk caches (K without RoPE, rotated
by the adapter to any position). The distinct id keeps the two kinds apart.

Roles (vLLM creates one instance per role):
  scheduler  get_num_new_matched_tokens asks the service (one MatchPrefix, short
             timeout; a slow or dead service counts as 0 hits, logged once, and is
             not asked again for `retry_after_s`); build_connector_meta tells the
             worker which blocks to load and which newly computed full blocks to save.
  worker     start_load_kv opens one FetchLayers stream (layer-major) on a thread;
             wait_for_layer_load(layer i) copies layer i into the paged KV when it has
             arrived, so layer i+1 is in flight while layer i computes. A load that
             fails or is late reports its blocks through get_block_ids_with_load_errors
             and vLLM (kv_load_failure_policy="recompute") recomputes them.
             save_kv_layer copies the new blocks' rows out of the paged KV (a small
             clone, so vLLM may reuse the blocks at once); wait_for_save hands them to
             a background thread that Stores them. The forward pass never waits on the
             service for a save.

Not handled (the connector then neither loads nor saves the request): LoRA,
multimodal inputs, prompt embeddings, tensor/pipeline parallelism > 1.
"""

from __future__ import annotations

import logging
import queue
import re
import threading
import time
from collections import OrderedDict
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from kvcraft.keys import ModelSpec, chunk_key, variant_id

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.request import Request

log = logging.getLogger("kvcraft.vllm")

MODULE_PATH = "engine_adapter.vllm_connector"
CONNECTOR_NAME = "KVCraftConnector"


def kv_transfer_config(address: str, **extra: Any) -> dict[str, Any]:
    """The `kv_transfer_config` argument of `vllm.LLM` / `--kv-transfer-config`."""
    return {
        "kv_connector": CONNECTOR_NAME,
        "kv_connector_module_path": MODULE_PATH,
        "kv_role": "kv_both",
        # A failed load must be recomputed, never fail the request.
        "kv_load_failure_policy": "recompute",
        "kv_connector_extra_config": {"address": address, **extra},
    }


@dataclass(frozen=True)
class ConnectorSettings:
    """`kv_connector_extra_config`, validated once."""

    address: str = "127.0.0.1:50051"
    model_name: str = ""             # default: vLLM's model path/name
    lookup_timeout_s: float = 0.25   # MatchPrefix, on the scheduler's path
    retry_after_s: float = 5.0       # after a failed lookup, skip the service this long
    load_timeout_s: float = 5.0      # a whole load (all layers), on the forward path
    store_timeout_s: float = 10.0
    max_pending_saves: int = 4096    # blocks queued for Store; more are dropped
    token: str | None = None

    @classmethod
    def from_extra(cls, extra: dict[str, Any]) -> "ConnectorSettings":
        known = set(cls.__dataclass_fields__)
        unknown = set(extra) - known
        if unknown:
            raise ValueError(f"unknown kv_connector_extra_config keys: {sorted(unknown)}")
        s = cls(**extra)
        for name in ("lookup_timeout_s", "load_timeout_s", "store_timeout_s"):
            if getattr(s, name) <= 0:
                raise ValueError(f"{name} must be > 0")
        return s


def block_model_spec(name: str, block_size: int, num_layers: int, num_kv_heads: int, head_dim: int,
                     dtype: str, rope_theta: float) -> ModelSpec:
    """Identity of vLLM block KV: post-RoPE, fixed positions, one block per chunk."""
    return ModelSpec(f"vllm-blocks/post-rope/{name}/block{block_size}", num_layers, num_kv_heads, head_dim,
                     dtype, rope_theta)


def block_chain(model_id: str, token_ids: list[int], block_size: int) -> tuple[list[str], list[str]]:
    """(chunk keys, chained variant ids) of the full blocks of `token_ids`."""
    keys: list[str] = []
    vids: list[str] = []
    prev: list[str] = []
    for start in range(0, len(token_ids) - block_size + 1, block_size):
        k = chunk_key(model_id, token_ids[start:start + block_size])
        v = variant_id(k, prev)
        keys.append(k)
        vids.append(v)
        prev = [v]
    return keys, vids


# -- the connector's own counters (per process) -------------------------------------------
@dataclass
class ConnectorMetrics:
    lookups: int = 0
    lookup_failures: int = 0
    matched_tokens: int = 0       # scheduler: tokens promised to vLLM from the service
    loaded_tokens: int = 0        # worker: tokens whose every layer was written
    failed_load_blocks: int = 0   # worker: blocks reported for recompute
    saved_blocks: int = 0
    dropped_saves: int = 0
    save_failures: int = 0
    per_request_matched: dict[str, int] = field(default_factory=dict)

    def snapshot(self) -> dict[str, Any]:
        d = dict(self.__dict__)
        d["per_request_matched"] = dict(self.per_request_matched)
        return d


METRICS = ConnectorMetrics()
_METRICS_LOCK = threading.Lock()


def _count(**inc: int) -> None:
    with _METRICS_LOCK:
        for k, v in inc.items():
            setattr(METRICS, k, getattr(METRICS, k) + v)


# -- metadata: scheduler -> worker, one per step -------------------------------------------
@dataclass(frozen=True)
class BlockLoad:
    req_id: str
    block_ids: tuple[int, ...]
    chunk_keys: tuple[str, ...]
    variant_ids: tuple[str, ...]


@dataclass(frozen=True)
class BlockSave:
    block_id: int
    token_ids: tuple[int, ...]
    prefix_vid: str  # "" for block 0
    variant_id: str


@dataclass
class KVCraftMetadata(KVConnectorMetadata):
    loads: list[BlockLoad] = field(default_factory=list)
    saves: list[BlockSave] = field(default_factory=list)


@dataclass
class _ReqState:
    tokens: list[int]
    keys: list[str]
    vids: list[str]
    service_blocks: int = 0      # leading blocks the service holds
    load_first: int = 0          # first block to load
    load_count: int = 0
    block_ids: list[int] = field(default_factory=list)
    saved_upto: int = 0          # blocks [0, saved_upto) are stored or scheduled


class KVCraftConnector(KVConnectorBase_V1):
    """Prefix KV of vLLM blocks kept in a kvcraft service (see the module docstring)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra(dict(tc.kv_connector_extra_config or {}))
        if getattr(tc, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kvcraft: kv_load_failure_policy=%r: a failed load fails the request; "
                        "use 'recompute' (kv_transfer_config() sets it)", tc.kv_load_failure_policy)
        par = vllm_config.parallel_config
        if par.tensor_parallel_size * par.pipeline_parallel_size != 1:
            raise ValueError("KVCraftConnector supports tensor/pipeline parallel size 1 only")
        mc = vllm_config.model_config
        self.block_size = vllm_config.cache_config.block_size
        cache_dtype = vllm_config.cache_config.cache_dtype
        dtype = str(mc.dtype).removeprefix("torch.") if cache_dtype in ("auto", None) else str(cache_dtype)
        rope = getattr(mc.hf_config, "rope_theta", None)
        if rope is None:
            rope = (getattr(mc.hf_config, "rope_parameters", None) or {}).get("rope_theta", 0.0)
        self.spec = block_model_spec(self.settings.model_name or str(mc.model), self.block_size,
                                     mc.get_num_layers(par), mc.get_num_kv_heads(par), mc.get_head_size(),
                                     dtype, float(rope))
        self.model_id = self.spec.fingerprint()
        from kvclient.client import KVClient, MAX_MESSAGE_BYTES  # grpc loads here, not at vLLM import

        self._client = KVClient(self.settings.address, token=self.settings.token,
                                timeout=self.settings.store_timeout_s, max_message_bytes=MAX_MESSAGE_BYTES)
        # scheduler side
        self._reqs: dict[str, _ReqState] = {}
        self._saved_vids: OrderedDict[str, None] = OrderedDict()
        self._down_until = 0.0
        self._down_logged = False
        # worker side
        self._layers: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._layer_index: dict[str, int] = {}
        self._load: _LayerLoad | None = None
        self._failed_blocks: set[int] = set()
        self._save_rows: list[tuple[torch.Tensor, torch.Tensor]] = []
        self._saver: _Saver | None = None
        log.info("kvcraft connector (%s) for %s at %s, model id %s", role.name, self.spec.name,
                 self.settings.address, self.model_id)

    # ================= scheduler side =================
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int, bool]:
        """Tokens past `num_computed_tokens` whose KV the service holds (block-aligned).

        Blocks the scheduler: at most one MatchPrefix with `lookup_timeout_s`.
        """
        st = self._reqs.get(request.request_id)
        if st is None:
            st = self._new_state(request)
            self._reqs[request.request_id] = st
        bs = self.block_size
        if not st.vids or num_computed_tokens % bs:
            return 0, False
        st.service_blocks = self._match(st.vids)
        # vLLM computes at least the last prompt token itself.
        usable = min(st.service_blocks, (len(st.tokens) - 1) // bs)
        first = num_computed_tokens // bs
        if usable <= first:
            st.load_count = 0
            return 0, False
        st.load_first, st.load_count = first, usable - first
        return st.load_count * bs, False

    def _new_state(self, request: "Request") -> _ReqState:
        tokens = list(request.prompt_token_ids or [])
        unsupported = (getattr(request, "lora_request", None) is not None or getattr(request, "mm_features", None)
                       or getattr(request, "prompt_embeds", None) is not None)
        if unsupported:
            return _ReqState(tokens, [], [], saved_upto=len(tokens) // self.block_size)
        keys, vids = block_chain(self.model_id, tokens, self.block_size)
        return _ReqState(tokens, keys, vids)

    def _match(self, vids: list[str]) -> int:
        now = time.monotonic()
        if now < self._down_until:
            return 0
        _count(lookups=1)
        try:
            n = 0
            for i in range(0, len(vids), 256):  # max_fetch_variants per RPC
                part = vids[i:i + 256]
                got = self._client.match_prefix(part, timeout=self.settings.lookup_timeout_s)
                n += got
                if got < len(part):
                    break
        except Exception as e:  # noqa: BLE001 - any failure means "no hit", never a crash
            _count(lookup_failures=1)
            self._down_until = now + self.settings.retry_after_s
            if not self._down_logged:
                log.warning("kvcraft: service at %s did not answer a prefix lookup within %.2fs (%s); "
                            "vLLM computes these prompts itself, retrying the service every %.0fs",
                            self.settings.address, self.settings.lookup_timeout_s, type(e).__name__,
                            self.settings.retry_after_s)
                self._down_logged = True
            return 0
        if self._down_logged:
            log.warning("kvcraft: service at %s answers again", self.settings.address)
            self._down_logged = False
        return n

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks",
                                 num_external_tokens: int) -> None:
        st = self._reqs.get(request.request_id)
        if st is None:
            return
        if num_external_tokens != st.load_count * self.block_size:
            st.load_count = 0  # vLLM took fewer tokens than offered: load nothing
        if st.load_count:
            _count(matched_tokens=num_external_tokens)
            with _METRICS_LOCK:
                METRICS.per_request_matched[request.request_id] = num_external_tokens

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        meta = KVCraftMetadata()
        for new in scheduler_output.scheduled_new_reqs:
            st = self._reqs.get(new.req_id)
            if st is None:
                continue
            st.block_ids = list(new.block_ids[0])
            if st.load_count:
                a, b = st.load_first, st.load_first + st.load_count
                meta.loads.append(BlockLoad(new.req_id, tuple(st.block_ids[a:b]), tuple(st.keys[a:b]),
                                            tuple(st.vids[a:b])))
                st.load_count = 0
            self._plan_saves(st, new.num_computed_tokens + scheduler_output.num_scheduled_tokens[new.req_id], meta)
        cached = scheduler_output.scheduled_cached_reqs
        for i, req_id in enumerate(cached.req_ids):
            st = self._reqs.get(req_id)
            if st is None:
                continue
            new_ids = cached.new_block_ids[i]
            if new_ids is not None:
                if req_id in cached.resumed_req_ids:
                    st.block_ids = list(new_ids[0])
                else:
                    st.block_ids.extend(new_ids[0])
            self._plan_saves(st, cached.num_computed_tokens[i] + scheduler_output.num_scheduled_tokens[req_id], meta)
        return meta

    def _plan_saves(self, st: _ReqState, computed_end: int, meta: KVCraftMetadata) -> None:
        """Full prompt blocks whose KV exists after this step and the service lacks."""
        upto = min(computed_end, len(st.tokens)) // self.block_size
        upto = min(upto, len(st.block_ids), len(st.vids))
        bs = self.block_size
        for b in range(max(st.saved_upto, st.service_blocks), upto):
            vid = st.vids[b]
            if vid in self._saved_vids:
                self._saved_vids.move_to_end(vid)
                continue
            self._saved_vids[vid] = None
            if len(self._saved_vids) > 200_000:
                self._saved_vids.popitem(last=False)
            meta.saves.append(BlockSave(st.block_ids[b], tuple(st.tokens[b * bs:(b + 1) * bs]),
                                        st.vids[b - 1] if b else "", vid))
        st.saved_upto = max(st.saved_upto, upto)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        self._reqs.pop(request.request_id, None)
        return False, None

    # ================= worker side =================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        def index(name: str) -> int:
            m = re.search(r"layers\.(\d+)\.", name)
            return int(m.group(1)) if m else 0

        names = sorted(kv_caches, key=index)
        self._layers = [self._kv_views(kv_caches[n]) for n in names]
        self._layer_index = {n: i for i, n in enumerate(names)}
        self._saver = _Saver(self._client, self.model_id, self.settings.max_pending_saves)

    def _kv_views(self, t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
        """(K, V) views of one layer's paged KV, each [num_blocks, kv_heads, block_size, head_dim]."""
        bs, h, d = self.block_size, self.spec.num_kv_heads, self.spec.head_dim
        nb = t.shape[0]
        if t.dim() == 4 and tuple(t.shape[1:]) == (h, bs, 2 * d):
            # CPU backend: [blocks, heads, block, 2*hd], K rows then V rows per (block, head)
            v = t.view(nb, h, 2, bs, d)
            return v[:, :, 0], v[:, :, 1]
        if t.dim() == 5 and tuple(t.shape[1:]) == (2, bs, h, d):
            # flash-attention NHD: [blocks, 2, block, heads, hd]
            return t[:, 0].permute(0, 2, 1, 3), t[:, 1].permute(0, 2, 1, 3)
        raise ValueError(f"KVCraftConnector does not know the paged KV layout {tuple(t.shape)} "
                         f"(block {bs}, kv heads {h}, head dim {d})")

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVCraftMetadata)
        self._load = _LayerLoad(self._client, meta.loads, len(self._layers),
                                self.settings.load_timeout_s) if meta.loads else None

    def wait_for_layer_load(self, layer_name: str) -> None:
        load = self._load
        if load is None or load.failed:
            return
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        rows = load.wait_layer(i)
        if rows is None:
            self._fail_load(load)
            return
        kc, vc = self._layers[i]  # [blocks, heads, block, hd] views
        want = tuple(kc.shape[1:])
        for block_id, (k, v) in zip(load.block_ids, rows):  # k, v: [heads, block, hd]
            if tuple(k.shape) != want or tuple(v.shape) != want or k.dtype != kc.dtype:
                self._fail_load(load, f"a block of shape {tuple(k.shape)} {k.dtype}, not {want} {kc.dtype}")
                return
            kc[block_id].copy_(k)
            vc[block_id].copy_(v)
        if i == len(self._layers) - 1 and not load.counted:
            load.counted = True
            _count(loaded_tokens=len(load.block_ids) * self.block_size)

    def _fail_load(self, load: "_LayerLoad", why: str = "") -> None:
        load.failed = True
        load.cancel()
        self._failed_blocks.update(load.block_ids)
        _count(failed_load_blocks=len(load.block_ids))
        log.warning("kvcraft: loading %d blocks from %s failed (%s); vLLM recomputes them",
                    len(load.block_ids), self.settings.address, why or load.error or "timeout")

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVCraftMetadata) or not meta.saves:
            return
        i = self._layer_index.get(layer_name)
        if i is None:
            return
        if i == 0:
            self._save_rows = []
        kc, vc = self._layers[i]
        ids = torch.tensor([s.block_id for s in meta.saves], dtype=torch.long, device=kc.device)
        # a copy now, so vLLM may reuse the blocks before the Store is sent
        self._save_rows.append((kc.index_select(0, ids).cpu(), vc.index_select(0, ids).cpu()))

    def wait_for_save(self) -> None:
        """Hands this step's new blocks to the background saver; never waits on the service."""
        meta = self._get_connector_metadata()
        if not isinstance(meta, KVCraftMetadata) or not meta.saves or self._saver is None:
            return
        rows, self._save_rows = self._save_rows, []
        if len(rows) != len(self._layers):
            return  # a layer was skipped (e.g. a profiling run): save nothing
        for j, s in enumerate(meta.saves):
            layers = [(k[j].contiguous(), v[j].contiguous()) for k, v in rows]  # [heads, block, hd]
            self._saver.put(s, layers)

    def get_block_ids_with_load_errors(self) -> set[int]:
        out, self._failed_blocks = self._failed_blocks, set()
        return out

    def shutdown(self) -> None:
        if self._saver is not None:
            self._saver.stop()
        if self._load is not None:
            self._load.cancel()
        self._client.close()


class _LayerLoad:
    """One step's loads: a FetchLayers stream read on a thread, consumed layer by layer."""

    def __init__(self, client: Any, loads: list[BlockLoad], num_layers: int, timeout_s: float) -> None:
        from kvclient.client import Ref

        self.block_ids = [b for ld in loads for b in ld.block_ids]
        self.refs = [Ref(k, v) for ld in loads for k, v in zip(ld.chunk_keys, ld.variant_ids)]
        self.num_layers = num_layers
        self.deadline = time.monotonic() + timeout_s
        self.failed = False
        self.counted = False
        self.error = ""
        self._rows: list[list[Any]] = [[None] * len(self.refs) for _ in range(num_layers)]
        self._have = [0] * num_layers
        self._cv = threading.Condition()
        self._streams: list[Any] = []
        self._done = False
        self._client = client
        self._thread = threading.Thread(target=self._run, name="kvcraft-load", daemon=True)
        self._thread.start()

    def _run(self) -> None:
        try:
            for off in range(0, len(self.refs), 256):
                stream = self._client.fetch_layers(self.refs[off:off + 256],
                                                   timeout=max(0.05, self.deadline - time.monotonic()))
                self._streams.append(stream)
                for f in stream:
                    with self._cv:
                        if f.layer < self.num_layers and self._rows[f.layer][off + f.index] is None:
                            self._rows[f.layer][off + f.index] = (f.key, f.value)
                            self._have[f.layer] += 1
                        self._cv.notify_all()
                    if self._done:
                        return
        except Exception as e:  # noqa: BLE001 - reported as a failed load
            self.error = f"{type(e).__name__}: {e}"[:200]
        finally:
            with self._cv:
                self._done = True
                self._cv.notify_all()

    def wait_layer(self, i: int) -> list[Any] | None:
        n = len(self.refs)
        with self._cv:
            while self._have[i] < n:
                left = self.deadline - time.monotonic()
                if self._done or left <= 0:
                    return None
                self._cv.wait(left)
            return self._rows[i]

    def cancel(self) -> None:
        self._done = True
        for s in self._streams:
            s.cancel()


class _Saver:
    """Stores blocks in order on one thread; a full queue drops blocks (a later miss)."""

    def __init__(self, client: Any, model_id: str, max_pending: int) -> None:
        self._client = client
        self._model_id = model_id
        self._q: queue.Queue = queue.Queue(maxsize=max_pending)
        self._logged = False
        self._thread = threading.Thread(target=self._run, name="kvcraft-save", daemon=True)
        self._thread.start()

    def put(self, save: BlockSave, layers: list[tuple[torch.Tensor, torch.Tensor]]) -> None:
        try:
            self._q.put_nowait((save, layers))
        except queue.Full:
            _count(dropped_saves=1)

    def _run(self) -> None:
        while True:
            item = self._q.get()
            if item is None:
                return
            save, layers = item
            try:
                r = self._client.store(self._model_id, list(save.token_ids), layers,
                                       prefix_keys=[save.prefix_vid] if save.prefix_vid else [])
                if r.variant_id != save.variant_id:
                    raise RuntimeError(f"service named the block {r.variant_id}, expected {save.variant_id}")
                _count(saved_blocks=1)
                self._logged = False
            except Exception as e:  # noqa: BLE001 - a lost save is only a later miss
                _count(save_failures=1)
                if not self._logged:
                    log.warning("kvcraft: storing a block failed (%s: %s); later requests recompute it",
                                type(e).__name__, str(e)[:200])
                    self._logged = True

    def stop(self) -> None:
        try:
            self._q.put_nowait(None)
        except queue.Full:
            pass
