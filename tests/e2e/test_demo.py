"""`kvcraft demo` (kvcli.demo) runs end to end against a real service, at a small size:
its part 2 prints the trained model's answers, counted (the default policy's too, and
the default as deployed, adaptive, with the service's fidelity tallies), and the service
stops cleanly. Part 1, the real model, is
tests/realmodel/test_demo.py; speed is not asserted here (bench/engine/ttft.py measures it)."""

from __future__ import annotations

import pytest

from kvcli import demo
from kvbench.quality import modeling


@pytest.mark.skipif(not (modeling.MODEL_DIR / "model.safetensors").exists(), reason="no trained model committed")
def test_demo_counts_the_trained_models_answers(capsys, tmp_path):
    code = demo.run_demo(str(tmp_path / "data"), quality_examples=4, real=False)
    out = capsys.readouterr().out
    assert "1. The real model" not in out
    assert "2. Answers" in out and "accuracy" in out and "/4 = " in out
    assert demo.DEFAULT_COLUMN in out  # the default policy answers beside the others
    assert demo.ADAPTIVE_COLUMN in out and "fidelity target: first-token agreement >= 0.950" in out
    assert "query   0.25    measuring" in out  # a new model: the controller's cold start, measured
    assert "service stopped cleanly (exit 0)" in out
    assert code in (0, 1)  # 1 only if reuse lost answers at this toy size
