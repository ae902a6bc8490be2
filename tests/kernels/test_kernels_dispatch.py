"""The package-level names route CPU tensors to the torch references, and the package
imports and works on a machine without a GPU even without the Triton interpreter."""

from __future__ import annotations

import os
import subprocess
import sys
import textwrap

import pytest
import torch

import kvkernels

CPU_CALLS = {
    "apply_rope": lambda: kvkernels.apply_rope(torch.randn(1, 3, 16), torch.arange(3), kvkernels.RopeConfig(16)),
    "selective_attention": lambda: kvkernels.selective_attention(
        torch.randn(2, 1, 16), torch.tensor([2]), torch.randn(1, 3, 16), torch.randn(1, 3, 16), torch.arange(3)
    ),
    "kv_deviation_topk": lambda: kvkernels.kv_deviation_topk(*[torch.randn(1, 3, 16) for _ in range(4)], 0.5),
}


@pytest.mark.parametrize("name", sorted(CPU_CALLS))
def test_cpu_tensors_go_to_the_reference(name: str, monkeypatch: pytest.MonkeyPatch) -> None:
    sentinel = object()

    def triton_must_not_run(*args, **kwargs):
        raise AssertionError("Triton variant called for CPU tensors")

    monkeypatch.setattr(kvkernels, f"{name}_triton", triton_must_not_run)
    monkeypatch.setattr(kvkernels, f"{name}_reference", lambda *a, **k: sentinel)
    assert CPU_CALLS[name]() is sentinel


@pytest.mark.skipif(not torch.cuda.is_available(), reason="routing to Triton needs CUDA tensors")
def test_cuda_tensors_go_to_triton(monkeypatch: pytest.MonkeyPatch) -> None:
    sentinel = object()
    monkeypatch.setattr(kvkernels, "kv_deviation_topk_triton", lambda *a, **k: sentinel)
    assert kvkernels.kv_deviation_topk(*[torch.zeros(1, 3, 16, device="cuda") for _ in range(4)], 0.5) is sentinel


def test_imports_and_runs_on_cpu_without_the_interpreter() -> None:
    script = textwrap.dedent(
        """
        import torch, kvkernels
        out = kvkernels.apply_rope(torch.randn(1, 3, 16), torch.arange(3), kvkernels.RopeConfig(16))
        assert out.shape == (1, 3, 16)
        try:
            kvkernels.apply_rope_triton(torch.randn(1, 3, 16), torch.arange(3), kvkernels.RopeConfig(16))
        except RuntimeError as e:
            assert "TRITON_INTERPRET" in str(e)
        else:
            raise SystemExit("Triton on CPU without the interpreter should refuse")
        print("ok")
        """
    )
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    env["CUDA_VISIBLE_DEVICES"] = ""
    proc = subprocess.run([sys.executable, "-c", script], env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    assert proc.stdout.strip() == "ok"
