"""The RAG trace through vLLM four ways (`python -m kvbench.vllm.rag`), and the one-vLLM-instance
runner the benchmarks and tests/vllm use (`kvbench.common.engines.engine_run` starts it in a process
forked from one that imported vLLM once; by hand it is):

    python -m kvbench.vllm.rag engine SPEC.json OUT.json

SPEC: {"model": dir, "block_size": 32, "kv": {"address": ..., <extra config>} | null,
       "num_blocks": int | null, "max_tokens": 8, "requests": [{"prompt": [ids]} | {"conv": str,
       "chunks": [[ids]], "question": [ids], "preamble": [ids]}], "front": {"address": ...,
       "model_id": ...} | null, "connector": {"module": ..., "name": ...} (a KVCraftConnector subclass),
       "plugins": ["module:function", ...] (called before the engine starts, e.g. the blend model
       class's registration), "hf_overrides": {...}, "blend": {"policy": ..., "options": {...}}
       (chunk/question requests carry their chunk boundaries + this policy to kvcraft),
       "enforce_eager": bool (vLLM runs the model eagerly: no torch.compile, which costs
       ~15-20 s of every start on a 2-core CPU; the tests use it where the compiled forward
       is not what they check)}
      or, for several phases on one instance, "phases": [{"requests": [...], "max_tokens": n,
       "batch": bool, "reset_prefix_cache": bool, "signal": "SIGSTOP" | "SIGCONT" (sent to
       "service_pid" first), "drain_saves_s": s, "per_request_metrics": bool}], and "shutdown": true
       to time the engine's shutdown at the end. A request may also carry "kv_transfer_params"
       (sent as SamplingParams.extra_args["kv_transfer_params"]), "reset_prefix_cache" (vLLM's
       own prefix cache emptied before it; whether vLLM did is in the output's
       "prefix_cache_reset") and "cache_salt" (vLLM's prefix-cache salt: blocks of other salts
       never match).
OUT:  {"outputs": [{"prompt": [ids], "output": [ids], "cached": int, "ttft_s": float,
       "kv_transfer_params": the connector's per-request report, "metrics": this request's
       counter increments (per_request_metrics)}, ...],
       "metrics": connector counters (both roles), "phases": [{"outputs", "metrics"}, ...],
       "startup_s": float, "shutdown_s": float (the engine's), "connector_shutdown_s": float}

Requests run one at a time (greedy), so each wall time is that request's TTFT when
max_tokens is 1; a "batch" phase sends them in one generate call (vLLM batches and, with
few KV blocks, preempts; every output's "ttft_s" is then the batch's wall time). A `front` spec builds each prompt through kvclient.rag_front first (its
Plan RPC counts in the TTFT).
"""

from __future__ import annotations

import json
import os
import sys
import time
from pathlib import Path
from typing import Any

import torch

from kvbench import results, stats
from kvbench.common.args import count


def build_tiny_llama(path: str | Path, *, layers: int = 2, hidden: int = 128, heads: int = 4, kv_heads: int = 2,
                     vocab: int = 512, seed: int = 0, intermediate: int | None = None,
                     architecture: str = "llama") -> Path:
    """A random-weight model in HF format with a byte-level tokenizer, made offline: a Llama, or
    of `architecture` "mistral", "qwen2" (its q/k/v biases drawn, not zero) or "qwen3" (its q/k
    norms drawn, not one)."""
    import transformers
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast

    path = Path(path)
    torch.manual_seed(seed)
    kind = {"llama": "Llama", "mistral": "Mistral", "qwen2": "Qwen2", "qwen3": "Qwen3"}[architecture]
    extra = {"sliding_window": None} if architecture == "mistral" else {}
    cfg = getattr(transformers, f"{kind}Config")(
        vocab_size=vocab, hidden_size=hidden, intermediate_size=intermediate or 2 * hidden, num_hidden_layers=layers,
        num_attention_heads=heads, num_key_value_heads=kv_heads, max_position_embeddings=8192,
        bos_token_id=256, eos_token_id=257, tie_word_embeddings=False, **extra)
    model = getattr(transformers, f"{kind}ForCausalLM")(cfg).to(torch.float32)
    with torch.no_grad():  # larger logits: greedy ties (and so flaky comparisons) become unlikely
        model.lm_head.weight.mul_(8.0)
        for name, p in model.named_parameters():
            if name.endswith("_proj.bias") or name.endswith("q_norm.weight") or name.endswith("k_norm.weight"):
                p.normal_(1.0 if "norm" in name else 0.0, 0.3)
    model.save_pretrained(path, safe_serialization=True)
    byte_vocab = {tok: i for i, tok in enumerate(pre_tokenizers.ByteLevel.alphabet())}
    byte_vocab.update({"<s>": 256, "</s>": 257})
    tk = Tokenizer(models.BPE(vocab=byte_vocab, merges=[]))
    tk.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)
    tk.decoder = decoders.ByteLevel()
    PreTrainedTokenizerFast(tokenizer_object=tk, bos_token="<s>", eos_token="</s>",
                            unk_token="</s>").save_pretrained(path)
    return path


def _quantized_copy(src: str | Path, dst: str | Path, quantize: Any, quantization_config: dict) -> Path:
    """`src` copied to `dst` with each decoder layer's linear weight `name` replaced by
    `quantize(name, w)`'s tensors and `quantization_config` in config.json; embeddings, norms
    and the vocabulary projection as they were."""
    import shutil

    from safetensors.torch import load_file, save_file

    src, dst = Path(src), Path(dst)
    shutil.copytree(src, dst)
    out = {}
    for name, w in load_file(dst / "model.safetensors").items():
        linear = name.startswith("model.layers.") and name.endswith("_proj.weight")
        out |= quantize(name, w) if linear else {name: w}
    save_file(out, dst / "model.safetensors", metadata={"format": "pt"})
    config = json.loads((dst / "config.json").read_text())
    config["quantization_config"] = quantization_config
    (dst / "config.json").write_text(json.dumps(config, indent=1))
    return dst


def quantize_w8a8(src: str | Path, dst: str | Path) -> Path:
    """`src`'s model as an int8 W8A8 checkpoint in the compressed-tensors format (which vLLM
    serves on a CPU through oneDNN): each decoder layer's linear weights symmetric int8 per
    output channel with their scales, activations quantized per token at run time; embeddings,
    norms and the vocabulary projection as they were. Made here, with no quantization library."""
    def int8(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        scale = w.float().abs().amax(dim=1, keepdim=True).clamp(min=1e-12) / 127.0  # [out, 1]
        return {name: torch.round(w.float() / scale).clamp(-128, 127).to(torch.int8),
                name.removesuffix("weight") + "weight_scale": scale.to(w.dtype)}

    bits = {"num_bits": 8, "type": "int", "symmetric": True}
    return _quantized_copy(src, dst, int8, {
        "quant_method": "compressed-tensors", "format": "int-quantized", "quantization_status": "compressed",
        "config_groups": {"group_0": {"targets": ["Linear"],
                                      "weights": {**bits, "strategy": "channel", "dynamic": False},
                                      "input_activations": {**bits, "strategy": "token", "dynamic": True}}},
        "ignore": ["lm_head"]})


def quantize_gptq(src: str | Path, dst: str | Path, group_size: int = 64) -> Path:
    """`src`'s model as a 4-bit checkpoint in GPTQ's format (which vLLM serves on a CPU through
    its WNA16 kernel): each decoder layer's linear weights symmetric 4-bit per group of
    `group_size` inputs (zero point 8), packed eight to an int32 along the inputs, with fp16
    scales; embeddings, norms and the vocabulary projection as they were. The values are
    rounded to nearest, not GPTQ's calibrated updates: the format and the kernels are GPTQ's,
    the error a little larger. Made here, with no quantization library."""
    def int4(name: str, w: torch.Tensor) -> dict[str, torch.Tensor]:
        rows, cols = w.shape  # [out, in]
        groups = w.float().t().reshape(cols // group_size, group_size, rows)  # [groups, size, out]
        scale = groups.abs().amax(dim=1).clamp(min=1e-12) * 2 / 15  # [groups, out]
        q = (torch.round(groups / scale[:, None]) + 8).clamp(0, 15).to(torch.int32).reshape(cols, rows)
        packed = torch.zeros(cols // 8, rows, dtype=torch.int32)
        for i in range(8):  # input i of each eight at bits 4i..4i+3
            packed |= q[i::8] << (4 * i)
        base = name.removesuffix(".weight")
        # GPTQ stores the zero point less one (7), eight to an int32 along the outputs
        return {f"{base}.qweight": packed, f"{base}.scales": scale.to(torch.float16),
                f"{base}.qzeros": torch.full((cols // group_size, rows // 8), 0x77777777, dtype=torch.int32),
                f"{base}.g_idx": torch.arange(cols, dtype=torch.int32) // group_size}

    return _quantized_copy(src, dst, int4, {"quant_method": "gptq", "bits": 4, "group_size": group_size,
                                            "desc_act": False, "sym": True, "checkpoint_format": "gptq"})


def front_model_id(model: str) -> str:
    """Namespace of the chunk keys the CRAFT front's Plan counts, per model."""
    from kvcraft.keys import ModelSpec

    return ModelSpec(f"rag-front/{model}", 0, 0, 0, "none").fingerprint()


def engine_env() -> dict[str, str]:
    """Environment for a vLLM CPU process: engine in this process, 1 GiB of KV cache (unless
    VLLM_CPU_KVCACHE_SPACE is set), no
    OpenMP thread pinning, offline (no model hub), Triton not interpreted (docs/vllm.md)."""
    env = dict(os.environ)
    env.pop("TRITON_INTERPRET", None)  # the test suite's; vLLM must not run Triton interpreted
    env.update({"VLLM_CPU_KVCACHE_SPACE": env.get("VLLM_CPU_KVCACHE_SPACE", "1"), "HF_HUB_OFFLINE": "1", "VLLM_ENABLE_V1_MULTIPROCESSING": "0",
                "VLLM_CPU_OMP_THREADS_BIND": "nobind", "TOKENIZERS_PARALLELISM": "false",
                "VLLM_LOGGING_LEVEL": env.get("VLLM_LOGGING_LEVEL", "WARNING")})
    return env


def run(spec: dict[str, Any]) -> tuple[dict[str, Any], Any]:
    """One vLLM instance through the spec's phases (a spec without "phases" is one phase): its
    output, and the `LLM`, still up."""
    import logging

    from vllm import LLM

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    logging.getLogger("kvcraft").setLevel(logging.INFO)
    t0 = time.perf_counter()
    kw: dict[str, Any] = {}
    if spec.get("kv"):
        from engine_adapter.vllm import kv_transfer_config

        kv = dict(spec["kv"])
        kw["kv_transfer_config"] = kv_transfer_config(kv.pop("address"), **kv)
        if spec.get("connector"):  # a subclass of KVCraftConnector (tests)
            kw["kv_transfer_config"].update(kv_connector=spec["connector"]["name"],
                                            kv_connector_module_path=spec["connector"]["module"])
    if spec.get("num_blocks"):
        kw["num_gpu_blocks_override"] = int(spec["num_blocks"])
    for entry in spec.get("plugins", []):  # "module:function" registrations, before the engine starts
        import importlib

        mod, _, fn = entry.partition(":")
        getattr(importlib.import_module(mod), fn)()
    if spec.get("hf_overrides"):
        kw["hf_overrides"] = spec["hf_overrides"]
    if spec.get("enforce_eager"):
        kw["enforce_eager"] = True
    llm = LLM(model=spec["model"], block_size=spec.get("block_size", 32), dtype="float32", seed=0,
              enable_prefix_caching=True, max_model_len=spec.get("max_model_len", 4096),
              max_num_batched_tokens=spec.get("max_num_batched_tokens", spec.get("max_model_len", 4096)),
              max_num_seqs=spec.get("max_num_seqs", 256), **kw)
    startup = time.perf_counter() - t0
    front = None
    if spec.get("front"):
        from kvclient.rag_front import RAGFront

        front = RAGFront(spec["front"]["address"], spec["front"]["model_id"],
                         preamble=spec["front"].get("preamble", []), timeout_s=spec["front"].get("timeout_s", 1.0))
    phases = spec.get("phases") or [{"requests": spec["requests"], "max_tokens": spec.get("max_tokens", 8),
                                     "return_prompts": spec.get("return_prompts", False),
                                     "drain_saves_s": spec.get("drain_saves_s", 0)}]
    from kvbench.common.engines import Turn

    turn = Turn(spec.get("turns"))  # engines side by side: each request in its turn
    results = [_phase(llm, front, spec, ph, turn) for ph in phases]
    if front is not None:
        front.close()
    out = {"outputs": results[0]["outputs"], "metrics": results[-1]["metrics"], "phases": results,
           "startup_s": startup}
    if spec.get("rest"):  # the engine's memory right after its last request, and at rest
        with turn:
            out["memory_before_rest"] = memory_mib()
            _rest(llm, spec, results[-1]["metrics"].get("heap_trims", 0))
            out["memory_at_rest"] = memory_mib()
    if spec.get("shutdown"):  # the engine's own shutdown path: scheduler then worker connector
        worker = None
        if spec.get("kv"):
            from engine_adapter.vllm import connectors_of

            worker = connectors_of(llm)[1].worker
        t = time.perf_counter()
        llm.llm_engine.engine_core.shutdown()
        out["shutdown_s"] = time.perf_counter() - t
        if worker is not None:
            out["metrics"] = {**out["metrics"], "dropped_saves": worker.metrics.get("dropped_saves")}
            out["connector_shutdown_s"] = worker.shutdown_s
    return out, llm


def _rest(llm: Any, spec: dict[str, Any], trims: float, timeout_s: float = 30.0) -> None:
    """At rest: with kvcraft, until its idle trim has handed the freed heap back (`kvcraft.heap`:
    a second after the last blend or shadow); vLLM alone, the same malloc_trim called here, so
    that the two compare like for like."""
    if not spec.get("kv"):
        from kvcraft.heap import malloc_trim

        malloc_trim()()
        return
    from engine_adapter.vllm import connector_metrics

    end = time.monotonic() + timeout_s
    while connector_metrics(llm)["heap_trims"] <= trims and time.monotonic() < end:
        time.sleep(0.05)


def _settle(llm: Any) -> None:
    """Wait for the connector's background work of the requests so far: the blends' store-backs
    and the shadow prefills the fidelity controller asked for (the next request then starts on
    an idle engine; that work's cost is the sampling cost, docs/fidelity.md)."""
    from engine_adapter.vllm import connectors_of

    context = connectors_of(llm)[1].worker.context
    if context is not None:
        context.flush()


def _phase(llm: Any, front: Any, spec: dict[str, Any], ph: dict[str, Any], turn: Any) -> dict[str, Any]:
    """One phase: optional service signal / prefix-cache reset, then its requests (one at a
    time, each after the one before's background work with "settle"; or all in one generate
    call with "batch"), then optionally wait for the saves. Each request, or the batch, in its
    `turn` (`kvbench.common.engines.engines_in_turns`)."""
    import signal

    from vllm import SamplingParams
    from vllm.inputs import TokensPrompt

    if ph.get("signal"):
        os.kill(int(spec["service_pid"]), getattr(signal, ph["signal"]))
    if ph.get("reset_prefix_cache"):
        llm.reset_prefix_cache()
    params = SamplingParams(temperature=0.0, max_tokens=ph.get("max_tokens", 8), ignore_eos=True)
    outs = []
    if ph.get("batch"):
        reqs = ph["requests"]
        prompts = [TokensPrompt(prompt_token_ids=list(r["prompt"]),
                                **({"cache_salt": r["cache_salt"]} if r.get("cache_salt") else {})) for r in reqs]
        with turn:
            t = time.perf_counter()
            res = llm.generate(prompts, [_request_params(params, r) for r in reqs], use_tqdm=False)
            wall = time.perf_counter() - t
        for r, o in zip(reqs, res):
            outs.append({"prompt_len": len(r["prompt"]), "prompt": list(r["prompt"]) if ph.get("return_prompts")
                         else None, "output": list(o.outputs[0].token_ids), "cached": int(o.num_cached_tokens or 0),
                         "ttft_s": wall, **({"kv_transfer_params": o.kv_transfer_params}
                                            if getattr(o, "kv_transfer_params", None) else {})})
    for r in ([] if ph.get("batch") else ph["requests"]):
        with turn:
            outs.append(_request(llm, front, spec, ph, params, r))
            if ph.get("settle") and spec.get("kv"):
                _settle(llm)
    metrics: dict[str, Any] = {}
    if spec.get("kv"):
        from engine_adapter.vllm import connector_metrics, connectors_of

        if ph.get("drain_saves_s"):
            metrics["saves_drained"] = connectors_of(llm)[1].worker.drain_saves(ph["drain_saves_s"])
        metrics.update(connector_metrics(llm))
    return {"outputs": outs, "metrics": metrics}


def _request(llm: Any, front: Any, spec: dict[str, Any], ph: dict[str, Any], params: Any,
             r: dict[str, Any]) -> dict[str, Any]:
    """One request of a phase, on its own: its output, TTFT and what the connector reported."""
    from vllm.inputs import TokensPrompt

    reset = llm.reset_prefix_cache() if r.get("reset_prefix_cache") else None
    before = _counters(llm) if spec.get("kv") and ph.get("per_request_metrics") else None
    t = time.perf_counter()
    if "prompt" in r:
        prompt, extra = list(r["prompt"]), {}
    elif front is not None:
        fp = front.build(r.get("conv", ""), r["chunks"], r["question"])
        prompt = fp.token_ids
        extra = {"chunk_tokens": fp.chunk_tokens, "dropped_tokens": fp.dropped_tokens, "planned": fp.planned}
    else:
        prompt = list(r.get("preamble", [])) + [t for c in r["chunks"] for t in c] + list(r["question"])
        extra = {"chunk_tokens": len(prompt) - len(r["question"]), "dropped_tokens": 0}
        if spec.get("blend") and "kv_transfer_params" not in r:  # chunk boundaries for kvcraft blending
            lens = [len(c) for c in ([r["preamble"]] if r.get("preamble") else []) + list(r["chunks"])]
            r = {**r, "kv_transfer_params": {"kvcraft": {"chunks": lens, **spec["blend"]}}}
    p = _request_params(params, r)
    salt = {"cache_salt": r["cache_salt"]} if r.get("cache_salt") else {}
    (o,) = llm.generate([TokensPrompt(prompt_token_ids=prompt, **salt)], p, use_tqdm=False)
    ttft = time.perf_counter() - t
    if reset is not None:
        extra["prefix_cache_reset"] = bool(reset)
    if before is not None:
        after = _counters(llm)
        extra["metrics"] = {k: v - before.get(k, 0) for k, v in after.items() if v != before.get(k, 0)}
    if getattr(o, "kv_transfer_params", None):  # the connector's per-request report
        extra["kv_transfer_params"] = o.kv_transfer_params
    return {"prompt_len": len(prompt), "prompt": prompt if ph.get("return_prompts") else None,
            "output": list(o.outputs[0].token_ids), "cached": int(o.num_cached_tokens or 0), "ttft_s": ttft, **extra}


def _request_params(params: Any, r: dict[str, Any]) -> Any:
    """`params`, with the request's connector parameters (blending) when it has some."""
    if r.get("kv_transfer_params") is None:
        return params
    p = params.clone()
    p.extra_args = {**(p.extra_args or {}), "kv_transfer_params": r["kv_transfer_params"]}
    return p


def _counters(llm: Any) -> dict[str, float]:
    """The connector's numeric counters (both roles), to take one request's increments."""
    from engine_adapter.vllm import connector_metrics

    return {k: v for k, v in connector_metrics(llm).items()
            if isinstance(v, (int, float)) and not isinstance(v, bool) and not k.endswith("_max_s")}


def memory_mib() -> dict[str, float]:
    """This process's resident memory, MiB: its peak (VmHWM), and now its private memory
    (RssAnon) and the shared memory it has touched (RssShmem: the kvcraft service's segments,
    whose pages belong to the service)."""
    fields = {"VmHWM": "peak_rss_mib", "RssAnon": "anon_mib", "RssShmem": "shmem_mib"}
    out = {}
    for line in Path("/proc/self/status").read_text().splitlines():
        name = line.split(":", 1)[0]
        if name in fields:
            out[fields[name]] = int(line.split()[1]) / 1024
    return out


def engine_main(argv: list[str]) -> int:
    spec = json.loads(Path(argv[0]).read_text())
    out, llm = run(spec)
    out["memory"] = memory_mib()
    Path(argv[1]).write_text(json.dumps(out))
    from kvbench.common.engines import exit_now

    # The LLM still up: the process ends without vLLM's shutdown (a full garbage collection and
    # the KV cache's release, ~0.9 s of an engine of the tests; spec "shutdown" runs it), nor
    # waiting for vLLM's and gRPC's threads.
    exit_now(0)


MODES = ("vllm", "vllm+kvcraft", "vllm+kvcraft+craft", "vllm+kvcraft+blend")
# The blend mode's requests: Cache-Craft, each reused chunk's recompute list as the plan sizes
# it (the service's cfo_alpha, default 0.15); a CacheBlend budget of 15% is below layer 0 alone
# on the trace's 2-layer model.
BLEND_POLICY = {"policy": "cachecraft", "options": {}}


def trace_requests(conversations: int, token_scale: float, seed: int = 0) -> list[dict[str, Any]]:
    """The default RAG trace, scaled down for CPU: fewer conversations (corpus scaled alike,
    so chunk popularity keeps its shape) and shorter chunks; token ids fixed per chunk."""
    import random
    from dataclasses import replace

    from kvbench.common.workload import DEFAULT, generate

    d = DEFAULT
    cfg = replace(d, seed=seed, conversations=conversations,
                  corpus=max(1000, int(d.corpus * conversations / d.conversations)),
                  min_tokens=max(8, int(d.min_tokens * token_scale)), max_tokens=max(16, int(d.max_tokens * token_scale)),
                  question_tokens=(max(4, int(d.question_tokens[0] * token_scale)),
                                   max(8, int(d.question_tokens[1] * token_scale))))
    out = []
    for i, r in enumerate(generate(cfg)):
        chunks = [[random.Random(int(k, 16)).randrange(256) for _ in range(n)] for k, n in r.chunks]
        q = [random.Random(f"q{i}").randrange(256) for _ in range(r.question_tokens)]
        out.append({"conv": r.conv_id, "chunks": chunks, "question": q})
    return out


def report(o: dict[str, Any]) -> dict[str, Any]:
    """The connector's per-request report of a blended request (RequestOutput.kv_transfer_params
    ["kvcraft"]; empty for requests without one)."""
    return (o.get("kv_transfer_params") or {}).get("kvcraft") or {}


def computed_tokens(o: dict[str, Any]) -> tuple[int, float]:
    """(tokens vLLM computed, kvcraft's recomputed row-layers / layers) of one request. A
    blended request's report says how many tokens vLLM computed (a failed blend: all, and
    vLLM's num_cached_tokens still counts the tokens it had accepted); else prompt - cached."""
    rep = report(o)
    if "vllm_computed_tokens" in rep:
        return int(rep["vllm_computed_tokens"]), rep.get("kvcraft_row_layers", 0) / max(1, rep.get("num_layers", 1))
    return o["prompt_len"] - min(o["cached"], o["prompt_len"]), 0.0


def summarize(mode: str, reqs: list[dict[str, Any]], res: dict[str, Any]) -> dict[str, Any]:
    outs = res["outputs"]
    retrieved = sum(len(c) for r in reqs for c in r["chunks"])
    prompt = sum(o["prompt_len"] for o in outs)
    # blending: kvcraft recomputes some claimed tokens (row-layers / layers, question rows included)
    reps = [report(o) for o in outs]
    done = [computed_tokens(o) for o in outs]
    cached = sum(o["prompt_len"] - v for o, (v, _) in zip(outs, done))
    recomputed = [x for _, x in done]
    chunk_computed = round(sum(max(0, o["chunk_tokens"] - (o["prompt_len"] - v)) + x for o, (v, x) in zip(outs, done)))
    ttft = [o["ttft_s"] * 1e3 for o in outs]
    return {"mode": mode, "requests": len(outs), "retrieved_chunk_tokens": retrieved, "prompt_tokens": prompt,
            "computed_share_of_prompt": (prompt - cached + sum(recomputed)) / prompt, "hit_tokens": cached,
            "kvcraft_recomputed_tokens": round(sum(recomputed)), "blended_requests": sum(bool(r.get("blended")) for r in reps),
            "kvcraft_loaded_tokens": res["metrics"].get("loaded_tokens", 0),
            "chunk_tokens_computed": chunk_computed, "chunk_computed_share": chunk_computed / retrieved,
            "dropped_chunk_tokens": sum(o["dropped_tokens"] for o in outs),
            **stats.summary(ttft, prefix="ttft_ms_"), "startup_s": res["startup_s"],
            "connector": res["metrics"]}


def bench_main(argv: list[str]) -> int:
    import argparse
    import tempfile

    from kvbench.common.engines import engine_run
    from kvservice.launcher import ServiceProcess

    ap = argparse.ArgumentParser(prog="kvcraft bench vllm-rag", description="Replay the default RAG trace through "
                                                                          "vLLM four ways.")
    ap.add_argument("--conversations", type=count(), default=200, help="of the default trace's 2000")
    ap.add_argument("--token-scale", type=float, default=0.5, help="chunk and question lengths x this")
    ap.add_argument("--local-blocks", type=count(), default=512,
                    help="vLLM's own KV blocks (its local prefix cache), 32 tokens each")
    results.add_argument(ap, "vllm-rag")
    ap.add_argument("--modes", nargs="*", choices=MODES, default=list(MODES))
    a = ap.parse_args(argv)
    reqs = trace_requests(a.conversations, a.token_scale)
    rows = []
    with tempfile.TemporaryDirectory() as td:
        tmp = Path(td)
        model = str(build_tiny_llama(tmp / "model"))
        for mode in a.modes:
            server = ServiceProcess(tmp / f"data-{len(rows)}").start() if mode != "vllm" else None
            spec: dict[str, Any] = {"model": model, "max_tokens": 1, "num_blocks": a.local_blocks,
                                    "kv": {"address": server.address} if server else None, "requests": reqs}
            if mode == "vllm+kvcraft+craft":
                spec["front"] = {"address": server.address, "model_id": front_model_id(model)}
            if mode == "vllm+kvcraft+blend":  # chunks in retriever order, blended; fresh chunks stored back
                spec.update(hf_overrides={"architectures": ["KVCraftLlamaForCausalLM"]},
                            plugins=["engine_adapter.vllm.model:register"], blend=BLEND_POLICY)
                spec["kv"].update(blend_policy=BLEND_POLICY["policy"], blend_options=BLEND_POLICY["options"],
                                  blend_store_back=True)
            try:
                res = engine_run(tmp, mode, spec)
            finally:
                if server:
                    server.close()
            rows.append(summarize(mode, reqs, res))
            r = rows[-1]
            print(f"{mode:20s} computed {r['computed_share_of_prompt']:6.1%} of prompt tokens, "
                  f"chunk tokens computed {r['chunk_computed_share']:6.1%} of retrieved, hits {r['hit_tokens']} "
                  f"(kvcraft {r['kvcraft_loaded_tokens']}), TTFT p50 {r['ttft_ms_p50']:.1f} ms "
                  f"p99 {r['ttft_ms_p99']:.1f} ms", flush=True)
    by_mode = {r["mode"]: r for r in rows}
    result = {"config": {k: v for k, v in vars(a).items() if k != "json"}, "trace_requests": len(reqs), "rows": rows}
    base = by_mode.get("vllm", {}).get("chunk_tokens_computed")
    for mode, name in (("vllm+kvcraft+craft", "craft_front"), ("vllm+kvcraft+blend", "blend")):
        if base and mode in by_mode:
            result[f"{name}_fewer_chunk_tokens_vs_vllm"] = fewer = 1 - by_mode[mode]["chunk_tokens_computed"] / base
            print(f"{mode}: {fewer:.1%} fewer chunk tokens computed than vLLM alone")
    results.save("vllm-rag", argv, result, a.json)
    return 0


def main(argv: list[str] | None = None) -> int:
    argv = list(argv if argv is not None else sys.argv[1:])
    if argv and argv[0] == "engine":
        return engine_main(argv[1:])
    return bench_main(argv)


if __name__ == "__main__":
    sys.exit(main())
