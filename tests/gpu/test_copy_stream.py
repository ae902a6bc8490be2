"""Layer-wise copies into GPU memory on a side stream: layer l's event is waited on the
compute stream before layer l is used (kvclient.copy_stream)."""

from __future__ import annotations

import threading
import time

import pytest
import torch

from engine_adapter.blend import blend_prefill
from engine_adapter.llama import LlamaEngine
from engine_adapter.policy import Policy
from engine_adapter.probe import TRUSTED
from kvclient.copy_stream import GpuLayerSource, LayerCopyStream, TorchCudaOps

from ..engine_adapter.adapter_helpers import make_prompt
from .fakes import FakeCudaOps


def layer_kv(layer: int, chunks: int = 2) -> dict[int, tuple[torch.Tensor, torch.Tensor]]:
    g = torch.Generator().manual_seed(layer)
    return {c: (torch.randn(2, 5, 4, generator=g), torch.randn(2, 5, 4, generator=g)) for c in range(chunks)}


def test_a_layer_is_on_the_device_only_after_its_event_is_waited() -> None:
    ops = FakeCudaOps()
    copies = LayerCopyStream("cpu", ops)
    sent = {layer: layer_kv(layer) for layer in range(3)}
    for layer, kv in sent.items():
        copies.submit(layer, kv)
    assert [e for e in ops.log if e[0] == "copy"] == [("copy", "side")] * 12  # all on the side stream
    assert not any(e[0] == "wait" for e in ops.log)  # submit never blocks the compute stream
    for layer, kv in sent.items():
        got = copies.take(layer)
        # the compute stream's last wait is for this layer's event, issued before the hand-out
        assert [e for e in ops.log if e[0] == "wait"][-1] == ("wait", "compute", layer)
        for c, (k, v) in kv.items():
            assert torch.equal(got[c][0], k) and torch.equal(got[c][1], v)
    copies.close()


def test_without_the_wait_the_bytes_have_not_landed() -> None:
    """The fake device is strict: it is what makes the test above able to fail."""
    ops = FakeCudaOps()
    copies = LayerCopyStream("cpu", ops)
    copies.submit(0, layer_kv(0))
    gpu, _event, _host = copies._pending[0]  # noqa: SLF001 - peek without take()
    assert torch.isnan(gpu[0][0]).all()


def test_taken_tensors_are_marked_used_by_the_compute_stream() -> None:
    ops = FakeCudaOps()
    copies = LayerCopyStream("cpu", ops)
    copies.submit(0, layer_kv(0, chunks=3))
    copies.take(0)
    assert ops.log.count(("record_stream", "compute")) == 6  # K and V of 3 chunks


def test_a_layer_is_submitted_once() -> None:
    copies = LayerCopyStream("cpu", FakeCudaOps())
    copies.submit(4, layer_kv(4))
    with pytest.raises(ValueError, match="layer 4 was already submitted"):
        copies.submit(4, layer_kv(4))


class _CountingSource:
    """Host layers in memory; records how far ahead of the consumer it was asked."""

    def __init__(self, kv: dict[int, dict], gpu_source: list) -> None:
        self.kv = kv
        self.gpu_source = gpu_source
        self.ahead: list[int] = []

    def wait_layer(self, layer: int, deadline: float) -> dict:
        self.ahead.append(layer - self.gpu_source[0]._consumed)  # noqa: SLF001
        return self.kv[layer]


@pytest.mark.parametrize("depth", [1, 3])
def test_gpu_layer_source_feeds_at_most_depth_layers_ahead(depth: int) -> None:
    ops = FakeCudaOps()
    holder: list = []
    inner = _CountingSource({layer: layer_kv(layer) for layer in range(6)}, holder)
    gate = threading.Event()
    orig = inner.wait_layer

    def gated(layer: int, deadline: float) -> dict:
        gate.wait()
        return orig(layer, deadline)

    inner.wait_layer = gated  # type: ignore[method-assign]
    src = GpuLayerSource(inner, 6, "cpu", depth=depth, ops=ops)
    holder.append(src)
    gate.set()
    for layer in range(6):
        got = src.wait_layer(layer, time.monotonic() + 30)
        assert torch.equal(got[1][1], inner.kv[layer][1][1])
        assert [e for e in ops.log if e[0] == "wait"][-1] == ("wait", "compute", layer)
    src.close()
    assert max(inner.ahead) <= depth and len(inner.ahead) == 6


def test_a_layer_not_fed_by_its_deadline_is_absent() -> None:
    release = threading.Event()

    class Stuck:
        def wait_layer(self, layer: int, deadline: float) -> dict:
            release.wait()
            return layer_kv(layer)

    src = GpuLayerSource(Stuck(), 2, "cpu", ops=FakeCudaOps())
    assert src.wait_layer(0, time.monotonic()) == {}  # deadline already passed: compute it
    release.set()
    src.close()


def test_blended_prefill_through_the_copy_stream_matches_the_host_source() -> None:
    """The adapter's real per-layer loop, fed through the fake device: identical logits
    (a layer used before its event was waited would be NaN)."""
    engine = LlamaEngine.random("tiny", seed=0, std=0.1)
    prompt = make_prompt(engine, seed=1)
    segs = prompt.segments(0.3)
    ref = blend_prefill(engine, segs, Policy("cachecraft"), prompt.source(), gate=TRUSTED)
    ops = FakeCudaOps()
    src = GpuLayerSource(prompt.source(), engine.cfg.num_layers, "cpu", ops=ops)
    got = blend_prefill(engine, segs, Policy("cachecraft"), src, gate=TRUSTED)
    src.close()
    assert torch.equal(got.logits, ref.logits)
    waits = [e[2] for e in ops.log if e[0] == "wait"]
    assert waits == list(range(engine.cfg.num_layers))


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU")
def test_real_cuda_copy_stream_is_bit_identical() -> None:
    copies = LayerCopyStream("cuda", TorchCudaOps())
    sent = {layer: {c: (k.pin_memory(), v.pin_memory()) for c, (k, v) in layer_kv(layer).items()}
            for layer in range(4)}
    for layer, kv in sent.items():
        copies.submit(layer, kv)
    for layer, kv in sent.items():
        got = copies.take(layer)
        for c, (k, v) in kv.items():
            assert got[c][0].is_cuda and torch.equal(got[c][0].cpu(), k) and torch.equal(got[c][1].cpu(), v)
    copies.close()
