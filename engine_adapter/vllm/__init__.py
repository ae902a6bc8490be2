"""kvcraft inside vLLM: a v1 KV connector (docs/vllm.md).

    from engine_adapter.vllm import kv_transfer_config
    LLM(model, block_size=32, enable_prefix_caching=True,
        kv_transfer_config=kv_transfer_config("127.0.0.1:50051"))

Modules: `connector` (the class vLLM loads, thin, one instance per role), `scheduler`
and `worker` (each role's object), `blocks` (block identity, scheduler->worker
metadata), `config` (settings, block namespace), `metrics` (per-instance counters).
Importing this package does not import vLLM; its modules do.
"""

from __future__ import annotations

from typing import Any

from engine_adapter.vllm.config import CONNECTOR_NAME, MODULE_PATH, ConnectorSettings, kv_transfer_config


def connectors_of(llm: Any) -> tuple[Any, Any]:
    """(scheduler-role, worker-role) KVCraftConnector instances of a `vllm.LLM` whose engine
    runs in this process (VLLM_ENABLE_V1_MULTIPROCESSING=0)."""
    core = getattr(getattr(llm, "llm_engine", None), "engine_core", None)
    inproc = getattr(core, "engine_core", None)
    if inproc is None:
        raise RuntimeError("vLLM runs its engine in another process (VLLM_ENABLE_V1_MULTIPROCESSING=1): "
                           "read kvcraft's counters from vLLM's metrics and logs (docs/vllm.md)")
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group

    if not has_kv_transfer_group():
        raise RuntimeError("this vLLM has no KV connector")
    return inproc.scheduler.connector, get_kv_transfer_group()


def connector_metrics(llm: Any) -> dict[str, Any]:
    """Both roles' counters of an in-process `vllm.LLM`, merged (see engine_adapter.vllm.metrics)."""
    sched, worker = connectors_of(llm)
    out = sched.metrics.snapshot()
    for k, v in worker.metrics.snapshot().items():
        if k not in ("scheduler_step_max_s", "scheduler_steps"):
            out[k] = out.get(k, 0) + v
    return out


__all__ = ["CONNECTOR_NAME", "MODULE_PATH", "ConnectorSettings", "connector_metrics", "connectors_of",
           "kv_transfer_config"]
