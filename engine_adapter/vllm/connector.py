"""kvcraft as a vLLM v1 KV connector (`KVConnectorBase_V1`), loaded by configuration.

Two services: prefix blocks (always), and blending (kv_connector_extra_config
`blend_policy`, docs/vllm.md "Blending": a RAG request's chunks reused from kvcraft at
any position, selected tokens recomputed; scheduler.py claims, context.py builds).

    LLM(model, block_size=32, kv_transfer_config=kv_transfer_config("127.0.0.1:50051"))

A thin class in the style of vLLM's own connectors: vLLM creates one instance per role,
and each delegates to its role's object,

  scheduler  SchedulerSide (scheduler.py): lookups, what to load, what to save
  worker     WorkerSide (worker.py): background loads into the paged KV, batched saves

with the block identity in blocks.py and the namespace/settings in config.py. Each
instance has its own counters (`metrics`).

Not handled (the connector then neither loads nor saves the request): LoRA,
multimodal inputs, prompt embeddings. Pipeline parallelism > 1 is refused; at tensor
parallelism > 1 the connector blends (every rank its heads, `engine_adapter.ranks`) and keeps
no vLLM blocks (a rank's block holds its heads alone; vLLM's own prefix cache serves them).
"""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING, Any

import torch
from vllm.distributed.kv_transfer.kv_connector.v1.base import (
    KVConnectorBase_V1,
    KVConnectorMetadata,
    KVConnectorRole,
)

from engine_adapter.vllm.blocks import KVCraftMetadata
from engine_adapter.vllm.config import ConnectorSettings, check_device, chunk_namespace, chunk_spec, spec_from_vllm
from engine_adapter.vllm.metrics import SCHEDULER_COUNTERS, WORKER_COUNTERS, ConnectorMetrics, KVCraftStats
from engine_adapter.vllm.scheduler import SchedulerSide
from engine_adapter.vllm.worker import WorkerSide

if TYPE_CHECKING:
    from vllm.config import VllmConfig
    from vllm.distributed.kv_transfer.kv_connector.v1.base import KVConnectorWorkerMetadata
    from vllm.distributed.kv_transfer.kv_connector.v1.metrics import KVConnectorStats
    from vllm.forward_context import ForwardContext
    from vllm.v1.core.kv_cache_manager import KVCacheBlocks
    from vllm.v1.core.sched.output import SchedulerOutput
    from vllm.v1.kv_cache_interface import KVCacheConfig
    from vllm.v1.outputs import KVConnectorOutput
    from vllm.v1.request import Request

log = logging.getLogger("kvcraft.vllm")


class KVCraftConnector(KVConnectorBase_V1):
    """Prefix KV of vLLM blocks kept in a kvcraft service (see the package docs)."""

    def __init__(self, vllm_config: "VllmConfig", role: KVConnectorRole,
                 kv_cache_config: "KVCacheConfig | None" = None) -> None:
        super().__init__(vllm_config=vllm_config, role=role, kv_cache_config=kv_cache_config)
        tc = vllm_config.kv_transfer_config
        self.settings = ConnectorSettings.from_extra(dict(tc.kv_connector_extra_config or {}))
        check_device(self.settings, str(vllm_config.device_config.device_type))
        if getattr(tc, "kv_load_failure_policy", "recompute") != "recompute":
            log.warning("kvcraft: kv_load_failure_policy=%r: a failed load fails the request; "
                        "use 'recompute' (kv_transfer_config() sets it)", tc.kv_load_failure_policy)
        par = vllm_config.parallel_config
        if par.pipeline_parallel_size != 1:
            raise ValueError(f"KVCraftConnector: pipeline parallel size {par.pipeline_parallel_size} is not supported "
                             "(1 only; tensor parallel is)")
        # At tensor parallel > 1 the ranks blend in step on vLLM's step thread (worker.py), and
        # vLLM's own blocks are not kept in the service: each rank's block holds its heads alone.
        self.tensor_parallel = par.tensor_parallel_size
        if self.tensor_parallel > 1 and self.settings.blend_graphs:
            raise ValueError("kv_connector_extra_config blend_graphs needs tensor parallel size 1")
        self.block_size = vllm_config.cache_config.block_size
        self.spec = spec_from_vllm(vllm_config, self.settings)
        self.model_id = self.spec.fingerprint()
        self.metrics = ConnectorMetrics()
        from kvclient.client import MAX_MESSAGE_BYTES, KVClient  # grpc loads here, not at vLLM import

        self._client = KVClient(self.settings.address, token=self.settings.token,
                                timeout=self.settings.store_timeout_s, max_message_bytes=MAX_MESSAGE_BYTES)
        self._reported: dict[str, float] = {}
        self.scheduler: SchedulerSide | None = None
        self.worker: WorkerSide | None = None
        self.chunk_model_id = ""
        if self.settings.blend_policy != "off":
            from engine_adapter.vllm.model import ARCHITECTURES

            archs = list(getattr(vllm_config.model_config, "architectures", None) or [])
            if not set(ARCHITECTURES) & set(archs):
                raise ValueError(f"kv_connector_extra_config blend_policy={self.settings.blend_policy!r} needs one of "
                                 f"the model classes {', '.join(ARCHITECTURES)}: start vLLM with hf_overrides="
                                 f"{{'architectures': ['KVCraftLlamaForCausalLM']}} (or the Mistral, Qwen2, Qwen3 "
                                 f"one; model architectures now: {archs})")
            self.chunk_model_id = chunk_namespace(vllm_config, self.settings)
        if role == KVConnectorRole.SCHEDULER:
            watch = None
            if self.chunk_model_id and not self.settings.chunk_model_id:
                from engine_adapter.namespace import NamespaceWatch

                watch = NamespaceWatch(chunk_spec(vllm_config), self._client,
                                       on_miss=lambda: self.metrics.add(blend_namespace_misses=1))
                watch.check_stored()
            # The blend answers last tokens at tensor parallel 1, where the model class's forward runs
            # in every step: a step of one-token requests replays a full CUDA graph, never calling it.
            graphs = vllm_config.compilation_config.cudagraph_mode
            answers = self.tensor_parallel == 1 and (graphs is None or graphs.max_cudagraph_mode().name != "FULL")
            self.scheduler = SchedulerSide(self.settings, self.model_id, self.block_size, self._client,
                                           self._block_ids_of, self.metrics, chunk_model_id=self.chunk_model_id,
                                           num_layers=self.spec.num_layers, namespaces=watch,
                                           prefix_blocks=self.tensor_parallel == 1, last_tokens=answers)
        else:
            context = None
            if self.chunk_model_id:
                from engine_adapter.vllm.context import ContextBuilder

                context = ContextBuilder(self.settings, self._client, vllm_config, self.chunk_model_id,
                                         self.block_size, self.metrics)
            # On a CPU a blend runs on vLLM's step thread, whose OpenMP team has the cores
            # (engine_adapter.threads); at tensor parallel > 1 every rank's blend in step order
            on_cpu = str(vllm_config.device_config.device_type) == "cpu"
            self.worker = WorkerSide(self.settings, self.spec, self.model_id, self.block_size, self._client,
                                     self.metrics, context=context, in_step=self.tensor_parallel > 1 or on_cpu)
            if context is not None:  # loads and a GPU's blends run on the loader threads: the trim releases their heaps
                context.serving.watch(self.worker.loader)
        log.info("kvcraft connector (%s) for %s at %s, model id %s", role.name, self.spec.name,
                 self.settings.address, self.model_id)

    @property
    def requires_kv_delivery(self) -> bool:
        return False  # a cache: a dropped save is a later miss, never lost output

    # ================= scheduler side =================
    def get_num_new_matched_tokens(self, request: "Request", num_computed_tokens: int) -> tuple[int | None, bool]:
        assert self.scheduler is not None
        return self.scheduler.get_num_new_matched_tokens(request, num_computed_tokens)

    def update_state_after_alloc(self, request: "Request", blocks: "KVCacheBlocks", num_external_tokens: int) -> None:
        assert self.scheduler is not None
        self.scheduler.update_state_after_alloc(request, blocks, num_external_tokens)

    def build_connector_meta(self, scheduler_output: "SchedulerOutput") -> KVConnectorMetadata:
        assert self.scheduler is not None
        return self.scheduler.build_connector_meta(scheduler_output)

    def update_connector_output(self, connector_output: "KVConnectorOutput") -> None:
        if self.scheduler is not None:
            self.scheduler.update_connector_output(connector_output)

    def request_finished(self, request: "Request", block_ids: list[int]) -> tuple[bool, dict[str, Any] | None]:
        if self.scheduler is not None:
            return False, self.scheduler.request_finished(request)
        return False, None

    def _block_ids_of(self, req_id: str) -> list[int]:
        assert self._kv_cache_manager is not None, "vLLM did not bind its KV cache manager"
        return list(self._kv_cache_manager.get_block_ids(req_id)[0])

    # ================= worker side =================
    def register_kv_caches(self, kv_caches: dict[str, torch.Tensor]) -> None:
        assert self.worker is not None
        self.worker.register_kv_caches(kv_caches)

    def start_load_kv(self, forward_context: "ForwardContext", **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.start_loads(self._meta())

    def wait_for_layer_load(self, layer_name: str) -> None:
        return  # loads are asynchronous: a request runs only once its blocks are in

    def save_kv_layer(self, layer_name: str, kv_layer: torch.Tensor, attn_metadata: Any, **kwargs: Any) -> None:
        assert self.worker is not None
        self.worker.save_layer(self._meta(), layer_name)

    def wait_for_save(self) -> None:
        """Hands this step's new blocks to the saver threads; never waits on the service."""
        assert self.worker is not None
        self.worker.submit_saves()

    def get_finished(self, finished_req_ids: set[str]) -> tuple[set[str] | None, set[str] | None]:
        """Loads that ended. In a step where vLLM computes nothing this first waits (at most
        `idle_wait_s`) for one of the running loads to end: vLLM's engine loop would
        otherwise spin through empty steps, holding the GIL the loader threads need."""
        assert self.worker is not None
        if self.worker.context is not None:
            self.worker.context.last_tokens.drop(finished_req_ids)
        meta = self._connector_metadata
        idle = isinstance(meta, KVCraftMetadata) and meta.idle
        return None, self.worker.finished_loads(wait=idle) or None

    def build_connector_worker_meta(self) -> "KVConnectorWorkerMetadata | None":
        """What each blend that finished this step computed (the request's output reports it)."""
        assert self.worker is not None
        return self.worker.worker_meta()

    def get_block_ids_with_load_errors(self) -> set[int]:
        assert self.worker is not None
        return self.worker.failed_blocks()

    def get_kv_connector_stats(self) -> "KVConnectorStats | None":
        """This role's counter increments since the last call, for vLLM's stat loggers (vLLM
        adds the scheduler's to the worker's and prints them as "KV Transfer metrics")."""
        names = WORKER_COUNTERS if self.worker is not None else SCHEDULER_COUNTERS
        now = self.metrics.snapshot()
        delta = {k: now[k] - self._reported.get(k, 0) for k in names if now[k] != self._reported.get(k, 0)}
        self._reported = {k: now[k] for k in names}
        return KVCraftStats(data=delta) if delta else None

    @classmethod
    def build_kv_connector_stats(cls, data: dict[str, Any] | None = None) -> "KVConnectorStats | None":
        return KVCraftStats(data=dict(data or {}))

    def _meta(self) -> KVCraftMetadata:
        meta = self._get_connector_metadata()
        assert isinstance(meta, KVCraftMetadata)
        return meta

    # ================= both =================
    def shutdown(self) -> None:
        if self.worker is not None:
            self.worker.shutdown(close_channel=self._client.close)
        else:
            if self.scheduler is not None:
                self.scheduler.close()
            self._client.close()
