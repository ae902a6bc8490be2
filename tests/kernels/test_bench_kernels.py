"""bench/kernels.py is GPU-only; here its measuring code runs once on a tiny prompt, on CPU
under the Triton interpreter (so the script is known to run before it meets a GPU) and on
the GPU where there is one (tests/conftest.py sets the interpreter only without CUDA)."""

from __future__ import annotations

import math

import pytest
import torch

from kvbench.engine import kernels as bench

pytestmark = pytest.mark.slow  # over ~10 s: after the inner loop (README, "Developing")


def test_bench_runs_every_kernel_and_all_match_their_reference() -> None:
    calls: list[int] = []

    def once(fn) -> float:
        fn()
        calls.append(1)
        return 1.0  # ms

    device = "cuda" if torch.cuda.is_available() else "cpu"
    rows = bench.run(48, 0.25, torch.float32, 4.8e12, 990e12, device=device, timer=once)
    assert len(calls) == len(rows) == 9
    assert {r.kernel for r in rows} == {"rope", "selective_attention", "kv_deviation_topk"}
    for r in rows:
        # deviation sums ~2k |differences| per token: a few fp32 ulps there are ~1e-3
        tol = 2e-3 if r.kernel == "kv_deviation_topk" else 1e-4
        assert r.max_abs_err is None or r.max_abs_err < tol, r
        assert math.isfinite(r.roofline_fraction) and r.roofline_fraction > 0
    attn = next(r for r in rows if r.impl == "triton, no mass")
    visible = sum(p + 1 for p in range(48)) // 4  # about a quarter of the causal pairs
    assert 0.5 * visible < attn.flops / (4 * 32 * 128) < 2 * visible


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA prints")
def test_bench_exits_cleanly_without_gpu(capsys, tmp_path) -> None:
    assert bench.main(["--json", str(tmp_path / "out.json")]) == 0
    assert "needs a CUDA GPU" in capsys.readouterr().out
    assert not (tmp_path / "out.json").exists()
