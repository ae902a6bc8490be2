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
CUDA_STEPS = ("tests", "kernels", "blend-smollm2-135m", "blend-llama3-8b")


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
    for step in CUDA_STEPS:
        assert lines[step].split()[0] == "SKIP" and "torch sees no CUDA device" in lines[step], summary
    assert "no-wheels/*.whl" in lines["wheels"]  # no wheel folder: nothing to install, said so
    for step in ("env", "project", "imports", "selftest"):
        assert lines[step].split()[0] == "PASS", summary
    assert "CPU half only" in lines["selftest"]
    assert "failed or stopped 0, skipped 5" in summary
    report = json.loads((out / "selftest.json").read_text())
    assert {r["status"] for r in report["results"]} <= {"PASS", "SKIP"}
    assert summary in (out / "gpu-check.log").read_text()  # the log holds everything printed


def _gpu_blend():
    spec = importlib.util.spec_from_file_location("gpu_blend", SCRIPTS / "gpu_blend.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_the_blend_check_dry_runs_on_cpu(tmp_path: Path) -> None:
    out = tmp_path / "blend.json"
    rc = _gpu_blend().main(["--shape", "tiny", "--device", "cpu", "--dtype", "fp32", "--chunks", "3",
                            "--chunk-len", "16", "--question-len", "4", "--repeats", "1", "--json", str(out)])
    (run,) = json.loads(out.read_text())
    assert rc == 0, run["checks"]
    assert [r["case"] for r in run["rows"]] == ["full prefill", "exact reuse", "naive", "cachecraft top 15%",
                                              "default (query) 15%"]
    exact = run["rows"][1]
    assert exact["top1"] and exact["logit_dev"] < 1e-4  # the exact variants reproduce full prefill
    assert {c["check"]: c["status"] for c in run["checks"]} == {
        "full prefill logits finite": "PASS", "exact reuse": "PASS", "reuse probe (engine_adapter.probe)": "PASS"}


def test_the_blend_check_says_so_without_the_device(capsys: pytest.CaptureFixture[str]) -> None:
    if torch.cuda.is_available():
        pytest.skip("checks what a machine without CUDA prints")
    assert _gpu_blend().main(["--device", "cuda"]) == 2
    assert "torch sees no CUDA device" in capsys.readouterr().out
