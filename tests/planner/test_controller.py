import pytest

from kvservice.planner.controller import LinearEstimator, LoadingController, ModelProfile, TierProfile

MODEL = ModelProfile(num_layers=5, kv_bytes_per_token_layer=1000, compute_s_fixed=0.0,
                     compute_s_per_token=1e-6)
TIERS = {
    "host": TierProfile(bandwidth_Bps=1e9, latency_s=0.0),   # 1 us / token
    "disk": TierProfile(bandwidth_Bps=2.5e8, latency_s=0.0),  # 4 us / token
}


def test_ratio_equalises_recompute_and_load_with_floor():
    c = LoadingController(MODEL, TIERS, r_min=0.15)
    # disk: loading 1000 tokens = 4 ms; computing r * 1000 tokens = r ms -> r = 1 (capped)
    assert c.recompute_ratio(1000, 0, c.load_time({"disk": 1000})) == 1.0
    # host: 1 ms load; 500 tokens computed anyway (0.5 ms) -> r = 0.5
    assert c.recompute_ratio(1000, 500, c.load_time({"host": 1000})) == pytest.approx(0.5)
    # loading hidden entirely by the base computation -> floor r_min
    assert c.recompute_ratio(1000, 5000, c.load_time({"host": 1000})) == 0.15


def test_preload_depth_eq16():
    c = LoadingController(MODEL, TIERS)
    # Cache-Craft Fig. 19: L = 5, T_prefill : T_load = 1 : 2 -> Lp = 3
    assert c.preload_depth(1.0, 2.0) == 3
    assert c.preload_depth(2.0, 1.0) == 1  # prefill longer than load: one layer
    assert c.preload_depth(0.0, 1.0) == 5  # nothing to overlap with: all layers
    assert c.preload_depth(1.0, 0.0) == 1


def test_estimator_fits_reported_timings_and_keeps_defaults_until_then():
    e = LinearEstimator(c0=1.0, c1=1.0)
    e.observe(10, 0.003)
    assert e.predict(10) == 11.0  # one sample: defaults
    for x in (10, 20, 30, 40):
        e.observe(x, 0.002 + 0.0001 * x)
    assert e.c1 == pytest.approx(0.0001, rel=1e-3)
    assert e.c0 == pytest.approx(0.002, rel=0.05)


def test_reported_timings_change_the_decision():
    c = LoadingController(MODEL, TIERS, r_min=0.0)
    t_default = c.load_time({"host": 1000})
    for n in (100, 200, 400, 800):
        c.observe_load("host", n * 1000, n * 4e-6)  # host turns out 4x slower
    assert c.load_time({"host": 1000}) == pytest.approx(4 * t_default, rel=1e-3)
