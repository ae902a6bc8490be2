"""The engine adapter with its engine on a GPU, against the real service on loopback (no gpu
tier): the stored layers come from the host tier (shared memory) or the stream, and reach
the engine's memory through the copy stream (`RAGAdapter.serve` puts a `GpuLayerSource`
behind the service's layers). The blended prefill's logits are the CPU engine's."""

from __future__ import annotations

import dataclasses
import uuid

import pytest
import torch

from engine_adapter import LlamaEngine, Policy, ReuseGate
from engine_adapter.rag import RAGAdapter
from kvclient.client import KVClient

pytestmark = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")

QUESTION = [7, 11, 13, 17, 19]


@pytest.mark.parametrize("local", [True, False], ids=["mapped", "streamed"])
def test_a_gpu_engine_blends_from_the_host_tier_as_the_cpu_engine_does(shared_server, local: bool):
    cpu = LlamaEngine.random("tiny", seed=0, std=0.1)
    cpu = LlamaEngine(dataclasses.replace(cpu.cfg, name=f"tiny-gpu-{uuid.uuid4().hex}"), cpu.w)
    gpu = LlamaEngine(cpu.cfg, {n: w.cuda() for n, w in cpu.w.items()})
    assert gpu.triton and gpu.device.type == "cuda"
    g = torch.Generator().manual_seed(3)
    cs = [torch.randint(0, 256, (20,), generator=g).tolist() for _ in range(4)]
    with KVClient(shared_server.address) as client:
        warm = RAGAdapter(cpu, client, Policy("full"), gate=ReuseGate())
        warm.prefill(cs, QUESTION)
        warm.flush()
        got = {}
        for name, engine in (("cpu", cpu), ("gpu", gpu)):
            adapter = RAGAdapter(engine, client, Policy("cacheblend", ratio=0.3), gate=ReuseGate(), store_back=False,
                                 local=local, shadows=False)
            result, report = adapter.prefill(cs[::-1], QUESTION, reorder=False)
            adapter.close()
            assert report.reused_chunks == len(cs) and not result.fallbacks, (name, report)
            got[name] = result.logits.float().cpu()
    torch.testing.assert_close(got["gpu"], got["cpu"], atol=2e-3, rtol=2e-3)
