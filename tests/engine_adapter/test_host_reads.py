"""On a GPU every read of a device tensor by the host (bool(t), t.item(), t.tolist(), int(t),
t.nonzero(), t.cpu()) waits for the GPU to drain, and the blend loop is bound by the host
(docs/gpu.md: 450 such reads per naive prefill and 6,195 per default prefill made reuse
slower than full prefill on an H100). Here, on the CPU, the same calls are counted where the
project's engine code makes them: a prefill of twice the layers, or of chunks twice as long,
must make no more of them."""

from __future__ import annotations

import collections
import dataclasses
import traceback
from pathlib import Path

import pytest
import torch
from torch.overrides import TorchFunctionMode

from engine_adapter.blend import blend_prefill
from engine_adapter.llama import LlamaConfig, LlamaEngine
from engine_adapter.policy import Policy
from engine_adapter.probe import TRUSTED
from engine_adapter.source import InMemoryLayerSource
from tests.engine_adapter.adapter_helpers import make_prompt

HOST_READS = {"__bool__", "item", "tolist", "__int__", "__float__", "__index__", "nonzero", "cpu"}
ENGINE_CODE = Path(__file__).resolve().parents[2] / "engine_adapter"


class HostReads(TorchFunctionMode):
    """Counts host reads of tensors made directly by engine_adapter code, by call site.
    (kvkernels' CPU attention reads its mask on the CPU; on CUDA the Triton kernel runs.)"""

    def __init__(self) -> None:
        super().__init__()
        self.sites: collections.Counter[str] = collections.Counter()

    def __torch_function__(self, func, types, args=(), kwargs=None):  # noqa: ANN001, ANN204
        if getattr(func, "__name__", "") in HOST_READS:
            caller = traceback.extract_stack(limit=2)[0]
            if Path(caller.filename).resolve().parent == ENGINE_CODE:
                self.sites[f"{Path(caller.filename).name}:{caller.lineno} {func.__name__}"] += 1
        return func(*args, **(kwargs or {}))


def _reads(num_layers: int, policy: str, chunk_len: int = 24) -> collections.Counter[str]:
    cfg = dataclasses.replace(LlamaConfig.named("tiny"), num_layers=num_layers)
    engine = LlamaEngine.random(cfg, seed=0, std=0.1)
    p = make_prompt(engine, seed=1, behind="other", chunk_len=chunk_len)
    source = InMemoryLayerSource({i: v.kv for i, v in p.cache.items()})
    with torch.no_grad(), HostReads() as spy:
        r = blend_prefill(engine, p.segments(), Policy(policy), source, gate=TRUSTED, stats=False)
    assert r.reuse and r.computed_share < 1.0
    return spy.sites


@pytest.mark.parametrize("policy", ["naive", "query"])
def test_host_reads_grow_with_neither_layers_nor_rows(policy: str) -> None:
    base = _reads(4, policy)
    deeper, longer = _reads(8, policy), _reads(4, policy, chunk_len=48)
    assert deeper == base, f"reads per layer: {deeper - base}"
    assert longer == base, f"reads per row: {longer - base}"


def test_the_spy_sees_the_engines_reads() -> None:
    assert sum(_reads(4, "query").values()) > 0  # the query policy's picks are made on the host


def test_naive_reuse_reads_nothing_of_the_device() -> None:
    assert not _reads(4, "naive")  # its rows, indices and counts all come from the layout
