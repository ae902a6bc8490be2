"""The engine benchmarks at a tiny size: `kvcraft bench static-steps` (the static steps against
the eager step on the trained quality model, small buckets) and `kvcraft bench timeline` (the
per-layer timeline of each policy, with a stored layer that never arrives)."""

from __future__ import annotations

from kvbench.engine import static_steps, timeline
from kvbench.quality.modeling import MODEL_DIR


def test_static_steps_run_every_layer_static_and_give_the_eager_steps_logits():
    rows = static_steps.run(str(MODEL_DIR), chunk_len=6, device="cpu", tokens_step=16, rows_step=8)
    assert [r["policy"] for r in rows] == [name for name, *_ in static_steps.POLICIES]
    for r in rows:
        assert r["static_layers"] == r["layers"], r
        assert r["vs_eager"] <= r["tolerance"] and r["vs_torch"] <= r["tolerance"] and r["same_top1"], r


def test_the_timeline_times_every_policy_and_the_late_layer_falls_back():
    runs = timeline.run(chunk_len=8, interval_s=0.0)
    names = [name for name, _, _ in runs]
    assert names[0] == "full prefill" and len(names) == 5
    late = dict((name, result) for name, result, _ in runs)["cacheblend, chunk 1\nlayer 4 missing"]
    assert late.fallbacks == [(1, 4)]
    for name, result, deviation in runs:
        assert len(result.timings) == 8 and sum(t.compute_s for t in result.timings) > 0, name
        assert (deviation < 1e-5) == (name == "full prefill"), (name, deviation)  # reuse moves the logits
