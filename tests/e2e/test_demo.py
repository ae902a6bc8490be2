"""`kvcraft demo` (kvbench.demo) runs end to end against a real service, at a small size:
both parts print their tables, the trained model's answers are counted (the default
policy's too, after the learning requests), the service
stops cleanly. Speed is not asserted here (bench/ttft.py measures it)."""

from __future__ import annotations

import pytest

from kvbench import demo
from kvbench.quality import modeling


@pytest.mark.skipif(not (modeling.MODEL_DIR / "model.safetensors").exists(), reason="no trained model committed")
def test_demo_runs_both_parts_and_counts_answers(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(demo, "SPEED_CHUNK_LEN", 32)
    code = demo.run_demo(str(tmp_path / "data"), quality_examples=4)
    out = capsys.readouterr().out
    assert "1. Speed" in out and "naive reuse" in out and "cacheblend, 15% budget" in out
    assert "4/4" in out  # naive and blended reuse served every chunk from the service
    assert "2. Answers" in out and "accuracy" in out and "/4 = " in out
    assert demo.DEFAULT_COLUMN in out  # the default policy (learned lists) answers beside the others
    assert "service stopped cleanly (exit 0)" in out
    assert code in (0, 1)  # 1 only if reuse lost on speed at this toy size, or lost answers
