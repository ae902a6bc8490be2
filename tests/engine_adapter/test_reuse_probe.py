"""The per-model reuse probe: a misconfigured engine loses reuse, loudly, and still answers right."""

from __future__ import annotations

import importlib
import logging

import torch

from engine_adapter.blend import blend_prefill
from engine_adapter.llama import LlamaEngine
from engine_adapter.policy import Policy
from engine_adapter.probe import ReuseGate, probe
from kvkernels import RopeConfig

from .adapter_helpers import make_prompt

probe_mod = importlib.import_module("engine_adapter.probe")  # the module; `engine_adapter.probe` is the function


def test_probe_passes_for_a_consistent_engine(engine):
    r = probe(engine)
    assert r.ok and r.max_diff <= 1e-4


def test_probe_passes_in_bf16():
    eng = LlamaEngine.random("tiny", seed=0, std=0.1, dtype=torch.bfloat16)
    r = probe(eng)
    assert r.ok, r


def test_wrong_rope_base_fails_probe_disables_reuse_and_serves_full_prefill(engine, caplog):
    # The engine's forward rotates with base 1e5 while its spec (what caches are keyed and
    # rotated by) says 1e4: reused K would sit at the wrong angles.
    bad = LlamaEngine(engine.cfg, engine.w, rope=RopeConfig(head_dim=16, theta=1e5))
    p = make_prompt(engine, 31, behind="same")
    gate = ReuseGate()
    with caplog.at_level(logging.ERROR, logger="engine_adapter.probe"):
        r = blend_prefill(bad, p.segments(0.3), Policy("cachecraft"), p.source(), gate=gate)
    assert not r.reuse and r.fresh == {}
    assert (r.logits - bad.prefill(p.tokens)[0][-1]).abs().max() < 1e-5
    assert gate.verdict(bad.model_spec().fingerprint()) is False
    assert sum("reuse probe FAILED" in m and "KV reuse is OFF" in m for m in caplog.messages) == 1


def test_probe_runs_once_per_fingerprint(engine, monkeypatch):
    calls = []
    real = probe_mod.probe
    monkeypatch.setattr(probe_mod, "probe", lambda e: calls.append(1) or real(e))
    p = make_prompt(engine, 32, behind="same")
    gate = ReuseGate()
    for _ in range(2):
        r = blend_prefill(engine, p.segments(), Policy("naive"), p.source(), gate=gate)
        assert r.reuse
    blend_prefill(engine, p.segments(), Policy("full"), p.source(), gate=gate)  # no reuse: no probe needed
    assert calls == [1]
    assert gate.verdict(engine.model_spec().fingerprint()) is True
