"""The GPU check kit (scripts/gpu-check.sh, scripts/gpu-wheels.sh, scripts/gpu_blend.py;
docs/gpu.md): on a machine without CUDA it parses, runs to the end, and says what it
skipped and why; the blended-prefill check runs its own logic on CPU."""

from __future__ import annotations

import importlib.util
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.slow  # over ~10 s: after the inner loop (README, "Developing")

ROOT = Path(__file__).resolve().parents[1]
SCRIPTS = ROOT / "scripts"
CUDA_STEPS = ("blend-llama3-8b", "blend-smollm2-135m", "serve-llama3-8b", "blend-smollm2-135m-fp32", "tests", "kernels")


@pytest.mark.parametrize("script", ["gpu-check.sh", "gpu-wheels.sh"])
def test_the_scripts_parse(script: str) -> None:
    subprocess.run(["bash", "-n", str(SCRIPTS / script)], check=True)


@pytest.mark.skipif(torch.cuda.is_available(), reason="checks what a machine without CUDA runs")
def test_without_cuda_the_check_runs_to_the_end_and_says_what_it_skipped(tmp_path: Path) -> None:
    out = tmp_path / "out"
    env = {**os.environ, "PYTHON": sys.executable, "OUT": str(out), "GPU_CHECK_DIR": str(tmp_path),
           "GPU_CHECK_WHEELS": str(tmp_path / "no-wheels"), "GPU_CHECK_BUDGET_S": "100"}
    run = subprocess.run(["bash", str(SCRIPTS / "gpu-check.sh")], cwd=ROOT, env=env, capture_output=True,
                         text=True, timeout=150)
    assert run.returncode == 0, run.stdout[-3000:] + run.stderr[-2000:]
    summary = (out / "summary.txt").read_text()
    lines = {line.split()[1]: line for line in summary.splitlines()[1:-1]}
    # the numbers first: the blend and service steps come before the self-test and the tests
    order = [line.split()[1] for line in summary.splitlines()
             if line.startswith("  ") and not line.startswith("  ran ")]
    assert order == ["env", "wheels", "project", "imports", *CUDA_STEPS[:4], "selftest", *CUDA_STEPS[4:]]
    for step in CUDA_STEPS:
        assert lines[step].split()[0] == "SKIP" and "torch sees no CUDA device" in lines[step], summary
    assert "no-wheels/*.whl" in lines["wheels"]  # no wheel folder: nothing to install, said so
    for step in ("env", "project", "imports", "selftest"):
        assert lines[step].split()[0] == "PASS", summary
    assert "CPU half only" in lines["selftest"]
    assert "failed or stopped 0, skipped 7" in summary
    report = json.loads((out / "selftest.json").read_text())
    assert {r["status"] for r in report["results"]} <= {"PASS", "SKIP"}
    assert summary in (out / "gpu-check.log").read_text()  # the log holds everything printed


def _gpu_blend():
    spec = importlib.util.spec_from_file_location("gpu_blend", SCRIPTS / "gpu_blend.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_blend_check_dry_runs_on_cpu(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    out = tmp_path / "blend.json"
    rc = _gpu_blend().main(["--shape", "tiny", "--device", "cpu", "--dtype", "fp32", "--chunks", "3", "4",
                            "--chunk-len", "16", "--question-len", "4", "--repeats", "1", "--json", str(out)])
    runs = json.loads(out.read_text())
    assert rc == 0, [r["checks"] for r in runs]
    assert [r["prompt_tokens"] for r in runs] == [52, 68]  # one run per prompt length, one set of weights
    for run in runs:
        assert [r["case"] for r in run["rows"]] == [
            "full prefill", "exact reuse", "naive", "cachecraft top 15%", "default (query) 15%",
            "naive, pinned host", "default (query) 15%, pinned host"]
        exact = run["rows"][1]
        assert exact["top1"] and exact["logit_dev"] < 1e-4  # the exact variants reproduce full prefill
        for r in run["rows"]:  # GPU-only measures: not measured on CPU, said so
            assert r["ttft_ms"] > 0 and r["speedup"] > 0
            assert r["gpu_busy_share"] is None and r["launches"] is None and r["kernels"] is None
        assert {r["kv"] for r in run["rows"][-2:]} == {"host, streamed by layer"}
        assert all(r["layers_computed_for_lack_of_kv"] == 0 for r in run["rows"][-2:])
        statuses = {c["check"]: c["status"] for c in run["checks"]}
        assert set(statuses.values()) == {"PASS"}
        assert {"full prefill logits finite", "exact reuse", "naive, pinned host",
                "default (query) 15%, pinned host"} <= set(statuses)
    assert "reuse probe (engine_adapter.probe)" in {c["check"] for c in runs[0]["checks"]}
    assert "not measured" in capsys.readouterr().out


def test_the_served_prefill_dry_runs_on_cpu(tmp_path: Path) -> None:
    """--serve on CPU: kvcraft serve as a process (gpu_budget_bytes set; without a CUDA driver
    it runs without the gpu tier), this process the engine: store, plan, Locate, blend."""
    out = tmp_path / "serve.json"
    rc = _gpu_blend().main(["--serve", "--shape", "tiny", "--device", "cpu", "--dtype", "fp32", "--chunks", "3",
                            "--chunk-len", "16", "--question-len", "4", "--repeats", "1",
                            "--data-dir", str(tmp_path), "--json", str(out)])
    (run,) = json.loads(out.read_text())
    assert rc == 0, run["checks"]
    assert run["mode"] == "serve" and run["service"]["gpu_budget_bytes"] > 0
    assert [r["case"] for r in run["rows"]] == ["full prefill (engine alone)", "served full prefill",
                                              "served exact reuse", "served default (query) 15%"]
    exact = run["rows"][2]
    assert exact["reused_chunks"] == 3 and exact["fallbacks"] == 0 and exact["logit_dev"] < 1e-4
    assert run["located_tiers"] == ["host"] * 3 and run["gpu_tier"].startswith("not measured")
    assert {c["check"]: c["status"] for c in run["checks"]} == {
        "first request stores every chunk": "PASS", "served exact reuse": "PASS", "served default (query) 15%": "PASS"}


def test_the_blend_check_says_so_without_the_device(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks what a machine without CUDA prints")
    assert _gpu_blend().main(["--device", "cuda"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().out
