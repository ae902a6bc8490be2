"""On a GPU every read of a device tensor by the host (bool(t), t.item(), t.tolist(), int(t),
t.nonzero(), t.cpu()) waits for the GPU to drain, and the blend loop is bound by the host
(docs/gpu.md: 450 such reads per naive prefill and 6,195 per default prefill made reuse
slower than full prefill on an H100). Here, on the CPU, the same calls are counted where the
project's engine code makes them: a prefill of twice the layers, or of chunks twice as long,
must make no more of them. On the Triton path (`LlamaEngine(triton=True)`, the kernels in
Triton's interpreter) the kernels' launchers are counted too: that path is the GPU's."""

from __future__ import annotations

import collections
import dataclasses
import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine_adapter.blend import blend_prefill
from engine_adapter.graphs import StepGraphs
from engine_adapter.llama import LlamaConfig, LlamaEngine
from engine_adapter.policy import Policy
from engine_adapter.probe import TRUSTED
from engine_adapter.prompt import Segment
from engine_adapter.source import InMemoryLayerSource
from tests.engine_adapter.adapter_helpers import make_prompt

HOST_READS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "nonzero", "cpu"}
ENGINE_CODE = Path(__file__).resolve().parents[2] / "engine_adapter"
KERNEL_CODE = Path(__file__).resolve().parents[2] / "kernels"


class HostReads(TorchFunctionMode):
    """Counts host reads of tensors made directly by engine_adapter code, by call site.
    (kvkernels' CPU attention reads its mask on the CPU; on CUDA the Triton kernel runs.)"""

    def __init__(self, code: tuple[Path, ...] = (ENGINE_CODE,)) -> None:
        super().__init__()
        self.code = code
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if getattr(func, "__name__", "") in HOST_READS:
            caller = traceback.extract_stack(limit=2)[0]
            if Path(caller.filename).resolve().parent in self.code:
                self.sites[f"{Path(caller.filename).name}:{caller.lineno} {func.__name__}"] += 1
        return func(*args, **(kwargs or {}))


def _reads(num_layers: int, policy: str, chunk_len: int = 24, triton: bool = False,
           graphs: bool = False) -> collections.Counter[str]:
    """triton: the engine's Triton path, with a fresh chunk (its statistics read the attention
    mass, which that path takes from the attention kernel's launch), kernels' reads counted.
    graphs: that path's static steps (`engine_adapter.graphs`, small buckets), no fresh chunk
    (whose statistics keep the eager step)."""
    cfg = dataclasses.replace(LlamaConfig.named("tiny"), num_layers=num_layers)
    engine = LlamaEngine.random(cfg, seed=0, std=0.1)
    p = make_prompt(engine, seed=1, behind="other", chunk_len=chunk_len, n_chunks=3 if triton else 4)
    engine = LlamaEngine(cfg, engine.w, triton=triton)  # the stored variants made by the torch path
    steps = StepGraphs(engine, tokens_step=16, rows_step=8) if graphs else None
    segments = p.segments()
    fresh = triton and not graphs
    if fresh:
        segments[-2] = Segment(p.chunks[-1])
    source = InMemoryLayerSource({i: v.kv for i, v in p.cache.items()})
    with torch.no_grad(), HostReads((ENGINE_CODE, KERNEL_CODE) if triton else (ENGINE_CODE,)) as spy:
        r = blend_prefill(engine, segments, Policy(policy), source, gate=TRUSTED, stats=fresh, steps=steps)
    assert r.reuse and r.computed_share < 1.0
    assert bool(r.fresh) == fresh
    assert all(t.static for t in r.timings) == graphs
    return spy.sites


@pytest.mark.parametrize("policy", ["naive", "query"])
def test_host_reads_grow_with_neither_layers_nor_rows(policy: str) -> None:
    base = _reads(4, policy)
    deeper, longer = _reads(8, policy), _reads(4, policy, chunk_len=48)
    assert deeper == base, f"reads per layer: {deeper - base}"
    assert longer == base, f"reads per row: {longer - base}"


def test_on_the_triton_path_host_reads_grow_with_neither_layers_nor_rows() -> None:
    # the default policy: both passes, the picks, HKVD-free rows (naive's loop is a subset of it)
    base = _reads(2, "query", chunk_len=12, triton=True)
    deeper, longer = _reads(4, "query", chunk_len=12, triton=True), _reads(2, "query", chunk_len=24, triton=True)
    assert deeper == base, f"reads per layer: {deeper - base}"
    assert longer == base, f"reads per row: {longer - base}"


def test_on_static_steps_host_reads_grow_with_neither_layers_nor_rows() -> None:
    # the default's two phases on them (24-token chunks or more: its budget buys picks)
    base = _reads(2, "query", chunk_len=24, triton=True, graphs=True)
    deeper = _reads(4, "query", chunk_len=24, triton=True, graphs=True)
    longer = _reads(2, "query", chunk_len=48, triton=True, graphs=True)
    assert deeper == base, f"reads per layer: {deeper - base}"
    assert longer == base, f"reads per row: {longer - base}"


def test_the_spy_sees_the_engines_reads() -> None:
    assert sum(_reads(4, "query").values()) > 0  # the query policy's picks are made on the host


def test_naive_reuse_reads_nothing_of_the_device() -> None:
    assert not _reads(4, "naive")  # its rows, indices and counts all come from the layout
