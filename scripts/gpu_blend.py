"""Blended prefill against full prefill on one GPU: TTFT, GPU-busy share, launches, logit
deviation (docs/gpu.md, "What the blend step measures").

    python scripts/gpu_blend.py [--shape smollm2-135m] [--dtype bf16 fp32] [--chunks 5 16] [--json blend.json]
    python scripts/gpu_blend.py --serve [--shape llama3-8b] [--dtype bf16] [--chunks 5] [--json serve.json]

A random-weight Llama of a real shape (`smollm2-135m`: 30 layers, hidden 576, 9 heads /
3 KV heads, head dim 64; `llama3-8b`; `tiny` for a dry run on CPU), retrieved chunks of
512 tokens and a 32-token question: `--chunks 5 16` measures both 5 x 512 + 32 = 2,592
and 16 x 512 + 32 = 8,224 prompt tokens with one set of weights. The engine and the blend
loop are the project's own (`engine_adapter.LlamaEngine`, `engine_adapter.blend_prefill`);
they build their index and mask tensors on torch's default device, so everything runs
inside `with torch.device(device)`.

Stored variants are made first, as earlier requests leave them: each chunk computed
behind an unrelated chunk, and "exact" variants computed behind the same chunks as in
this prompt. Cases, each the median of `--repeats` synchronised runs after a warm-up:

  full prefill          `LlamaEngine.prefill`, last-token logits: the reference
  exact reuse           the exact variants reused as they are: must equal full prefill
                        within the reuse probe's tolerance (RoPE re-rotation, the Triton
                        selective attention and the merged cache on the GPU)
  naive                 the behind-another-chunk variants reused, nothing recomputed
  cachecraft top 15%    each chunk's top 15% of tokens by stored inter-attention (eq. 14)
  cacheblend budget 15% HKVD selection (CacheBlend §4.3)
  default (query) 15%   the policy a deployment runs: the question first, then the tokens
                        it read (engine_adapter.policies.default), two passes over the stored KV
  naive, pinned host    naive with the stored KV in pinned host memory, copied into the
  default ..., pinned host  GPU layer by layer on a side stream while earlier layers
                        compute (kvclient.copy_stream.GpuLayerSource over an
                        InMemoryLayerSource, the project's layer-wise copy path); must
                        give the same logits as the same case from GPU memory, with no
                        layer computed for lack of its KV
  ..., graphs           CUDA only: exact reuse, naive, cachecraft, cacheblend and the default
                        again on the engine's static steps (`graphs.StepGraphs`, the
                        same weights): each layer that can runs as a CUDA graph, captured in the
                        warm-up run and replayed after (the kv column says how many layers);
                        must give the same case's logits within the probe's tolerance
  reuse probe           `engine_adapter.probe.probe`, the gate serving runs first
  gpu vs cpu            the fp32 full prefill against the same on the CPU (small shapes)

The other cases' stored KV is already in GPU memory (an `InMemoryLayerSource`).

Per case: TTFT; speed-up (full prefill's TTFT of the same run over the case's); logit dev
||logits - full|| / ||full|| at the last prompt token; top-1: same argmax as full
prefill; and from one more run under torch.profiler (CUDA only, "not measured" on CPU):
launches (kernel launch calls on the host: torch's and Triton's), kernels (kernels the
GPU ran), gpu kernel ms (their summed time) and GPU busy (the time at least one kernel
ran, over that run's wall time; the profiler's own overhead lengthens the wall time a
little, so this errs low). The host bounds this loop on a GPU, and launch counts do not
move between machines as times do.

--serve runs the service as users run it on a GPU host instead: `kvcraft serve` as its
own process (kvservice.launcher.ServiceProcess, real RocksDB and files) with
`gpu_budget_bytes` set, and this process as the engine (`engine_adapter.RAGAdapter`,
`local=True`): a first request computes the chunks and stores them; Plans preload them
into the gpu tier; then each request plans, Locates (the variants' layers handed out as
CUDA tensors aliasing the service's pool, CUDA IPC), blends and releases. Cases: full
prefill (the engine alone), served full prefill, served exact reuse (naive over the
variants stored behind the same chunks: must equal full prefill within the probe's
tolerance), served default (query) 15%, and on CUDA served default (query) 15%, graphs (the
same engine on static steps from then on (`RAGAdapter(steps=...)`): must give the eager served
default's logits within the probe's tolerance, and the kv column says how many layers ran as
graphs). Without CUDA it runs the same on the CPU (the
service logs that it has no CUDA driver; the KV comes from its host tier), and the gpu
tier check says "not measured".

Exit 1 if a check fails (exact reuse beyond tolerance, probe not ok, a non-finite logit,
streamed KV not matching, a served case not from the gpu tier, the GPU's fp32 prefill off
the CPU's, an exception), 2 if the device is absent.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import platform
import shutil
import statistics
import sys
import tempfile
import time
import traceback
from pathlib import Path
from typing import Callable, Iterator

import torch

from engine_adapter import CacheBlend, LlamaConfig, LlamaEngine, Policy, Segment, blend_prefill
from engine_adapter.graphs import StepGraphs
from engine_adapter.policy import DEFAULT_POLICY
from engine_adapter.llama import _hf_names  # noqa: PLC2701 - the parameter list random weights follow
from engine_adapter.probe import TOLERANCE, TRUSTED, probe
from engine_adapter.rag import RAGAdapter
from engine_adapter.source import InMemoryLayerSource
from kvclient.client import KVClient, Ref
from kvclient.copy_stream import GpuLayerSource

SHAPES = {
    # SmolLM2-135M-Instruct's shape (docs/real-model.md), random weights
    "smollm2-135m": LlamaConfig("smollm2-135m", vocab_size=49152, hidden_size=576, intermediate_size=1536,
                                num_layers=30, num_heads=9, num_kv_heads=3, head_dim=64, rope_theta=100000.0,
                                tie_word_embeddings=True),
    "llama3-8b": LlamaConfig.named("llama3-8b"),
    "tiny": LlamaConfig.named("tiny"),
}
DTYPES = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}
NOT_MEASURED = "not measured"  # how the printed table shows a GPU-only measure on CPU (JSON: null)
PINNED = ", pinned host"  # suffix of the cases whose KV streams from pinned host memory
GRAPHS = ", graphs"  # suffix of the cases on static steps captured as CUDA graphs (CUDA only)


def random_engine(cfg: LlamaConfig, dtype: torch.dtype, device: str, seed: int = 0) -> LlamaEngine:
    """Seeded random weights drawn on `device` (an 8B model's draw on the CPU takes minutes);
    projections with std 1/sqrt(hidden), norms at 1."""
    g = torch.Generator(device=device).manual_seed(seed)
    std = cfg.hidden_size ** -0.5
    w = {n: torch.ones(s, device=device, dtype=dtype) if len(s) == 1
         else (torch.randn(s, device=device, generator=g) * std).to(dtype)
         for n, s in _hf_names(cfg).items()}
    return LlamaEngine(cfg, w)


def _median_s(fn: Callable[[], object], repeats: int, sync: Callable[[], None]) -> tuple[float, object]:
    out = fn()  # warm-up: Triton compiles, the allocator grows
    times = []
    for _ in range(repeats):
        sync()
        t0 = time.perf_counter()
        out = fn()
        sync()
        times.append(time.perf_counter() - t0)
    return statistics.median(times), out


LAUNCHES = ("cudaLaunchKernel", "cudaLaunchKernelExC", "cuLaunchKernel", "cuLaunchKernelEx", "cudaGraphLaunch")
UNPROFILED = {"launches": None, "kernels": None, "gpu_kernel_ms": None, "gpu_busy_ms": None,
              "gpu_busy_share": None, "profiled_wall_ms": None}


def _is_kernel(e) -> bool:  # noqa: ANN001 - a torch.autograd.profiler_util.FunctionEvent
    """A kernel the GPU ran (Kineto's CONCURRENT_KERNEL activity, named "kernel"); copies,
    memsets and GPU-side annotations are not kernels."""
    kind = getattr(e, "activity_type", None)
    if kind is not None:
        return kind == "kernel"
    return (e.device_type == torch.autograd.DeviceType.CUDA
            and not e.name.startswith(("Memcpy", "Memset", "gpu_user_annotation")))


def _busy_us(spans: list[tuple[float, float]]) -> float:
    """Length of the union of [start, end) intervals (kernels of several streams overlap)."""
    total, end = 0.0, -math.inf
    for s, e in sorted(spans):
        if e <= end:
            continue
        total += e - max(s, end)
        end = e
    return total


def _profile(fn: Callable[[], object], sync: Callable[[], None], cuda: bool) -> dict:
    """One more call of `fn` under torch.profiler (CPU and CUDA activity): kernel launch
    calls on the host (Kineto records CUDA runtime and driver calls with the CPU activity,
    so they are counted as before the GPU activity was added), the kernels the GPU ran,
    their summed time, and the time at least one ran over the call's wall time. Without
    CUDA, every field None (not measured). A profiler that fails, or sees launches but no
    kernel (CUPTI unavailable), leaves the GPU fields None and says why in "profile_note"."""
    if not cuda:
        return dict(UNPROFILED)
    acts = [torch.profiler.ProfilerActivity.CPU, torch.profiler.ProfilerActivity.CUDA]
    try:
        with torch.profiler.profile(activities=acts) as prof:
            sync()
            t0 = time.perf_counter()
            fn()
            sync()
            wall_us = 1e6 * (time.perf_counter() - t0)
        events = prof.events()
    except Exception as e:  # noqa: BLE001 - a profiler problem costs the measure, not the case
        traceback.print_exc()
        return {**UNPROFILED, "profile_note": f"profiler failed: {type(e).__name__}: {e}"[:300]}
    launches = sum(1 for e in events if e.name in LAUNCHES)
    spans = [(e.time_range.start, e.time_range.end) for e in events if _is_kernel(e)]
    out = {"launches": launches, "kernels": len(spans), "profiled_wall_ms": wall_us / 1e3}
    if not spans:
        return {**UNPROFILED, **out, "profile_note": "the profiler saw no kernel on the GPU (CUPTI unavailable?)"}
    busy = _busy_us(spans)
    return {**out, "gpu_kernel_ms": sum(e - s for s, e in spans) / 1e3, "gpu_busy_ms": busy / 1e3,
            "gpu_busy_share": min(1.0, busy / wall_us) if wall_us > 0 else None}


class _HostOps:
    """`kvclient.copy_stream.CudaOps` for a CPU dry run: no streams, events already complete,
    a plain copy. The pinned-host cases then run the same GpuLayerSource code on the CPU."""

    class _Nothing:
        def record(self, stream: object = None) -> None: ...
        def query(self) -> bool: return True
        def wait_event(self, event: object) -> None: ...
        def synchronize(self) -> None: ...
        def __enter__(self) -> None: ...
        def __exit__(self, *exc: object) -> None: ...

    def new_stream(self, device: torch.device) -> "_HostOps._Nothing": return self._Nothing()
    def new_event(self) -> "_HostOps._Nothing": return self._Nothing()
    def use_stream(self, stream: object) -> "_HostOps._Nothing": return self._Nothing()
    def current_stream(self, device: torch.device) -> "_HostOps._Nothing": return self._Nothing()
    def to_device(self, t: torch.Tensor, device: torch.device) -> torch.Tensor: return t.to(device, copy=True)
    def record_stream(self, t: torch.Tensor, stream: object) -> None: ...


def _on_host(kv: dict[int, list[tuple[torch.Tensor, torch.Tensor]]], cuda: bool) -> dict:
    """The stored KV copied to host memory, page-locked where CUDA exists (what the service's
    pinned slab, mapped by `kvclient.local`, hands an engine)."""
    pin = (lambda t: t.to("cpu").pin_memory()) if cuda else (lambda t: t.to("cpu", copy=True))  # noqa: E731
    return {i: [(pin(k), pin(v)) for k, v in layers] for i, layers in kv.items()}


def _reuse_rows(engine: LlamaEngine, cfg, dtype: torch.dtype, texts: list[list[int]], others: list[list[int]],
                question: list[int], ref: torch.Tensor, full_s: float, repeats: int, device: str,
                sync: Callable[[], None], check: Callable[[str, bool, str], None],
                graphed: StepGraphs | None = None) -> list[dict]:
    """Every reuse case against full prefill (`ref`, `full_s`): the chunks' variants computed
    alone (exact reuse) or behind another chunk, blended under each policy, their KV in GPU
    memory or streamed from pinned host memory, and with `graphed` (the engine's static
    steps) some again as CUDA graphs; a row each, and a FAIL check for a case that
    raises or gives non-finite logits."""
    cuda = device.startswith("cuda")
    rows: list[dict] = []
    exact = blend_prefill(engine, [Segment(c) for c in texts], Policy("full"), InMemoryLayerSource({}),
                          gate=TRUSTED).fresh
    behind = {i: blend_prefill(engine, [Segment(o), Segment(c)], Policy("full"), InMemoryLayerSource({}),
                               gate=TRUSTED).fresh[1] for i, (o, c) in enumerate(zip(others, texts))}

    def segments(variants: dict, share: float = 0.0) -> list[Segment]:
        out = []
        for i, c in enumerate(texts):
            tia = torch.tensor(variants[i].stats.token_inter_attention, device="cpu")
            top = tia.topk(round(share * len(c))).indices.tolist() if share else []
            out.append(Segment(c, cached=True, cached_prefix=variants[i].prefix, recompute=top))
        return out + [Segment(question, question=True)]

    default = f"default ({DEFAULT_POLICY}) 15%"
    cases = [
        ("exact reuse", exact, 0.0, Policy("naive")),
        ("naive", behind, 0.0, Policy("naive")),
        ("cachecraft top 15%", behind, 0.15, Policy("cachecraft")),
    ]
    if 0.15 * cfg.num_layers >= 1:  # a budget under one layer in L is refused (CacheBlend.steady_ratio)
        cases.append(("cacheblend budget 15%", behind, 0.0, CacheBlend(budget=0.15)))
    cases.append((default, behind, 0.0, Policy(DEFAULT_POLICY)))
    cases += [("naive" + PINNED, behind, 0.0, Policy("naive")), (default + PINNED, behind, 0.0, Policy(DEFAULT_POLICY))]
    if graphed is not None:  # the same cases on static steps, each layer a CUDA graph replayed
        cases += [(name + GRAPHS, variants, share, policy) for name, variants, share, policy in cases
                  if name in ("exact reuse", "naive", "cachecraft top 15%", "cacheblend budget 15%", default)]
    tol = TOLERANCE.get(dtype, 6e-2) * max(1.0, float(ref.abs().max()))
    host = _on_host({i: v.kv for i, v in behind.items()}, cuda)  # pinned once, as a slab is
    in_gpu: dict[str, torch.Tensor] = {}  # case -> logits with the KV in GPU memory, eager steps
    ops = None if cuda else _HostOps()
    for name, variants, share, policy in cases:
        segs = segments(variants, share)
        streamed = name.endswith(PINNED)
        on_graphs = name.endswith(GRAPHS)
        steps = graphed if on_graphs else None
        kv = {i: v.kv for i, v in variants.items()}
        fallbacks: list = []
        calls: list = []

        def prefill(segs=segs, policy=policy, streamed=streamed, kv=kv,  # noqa: ANN202
                    fallbacks=fallbacks, calls=calls, steps=steps):
            calls.append(1)
            if not streamed:
                return blend_prefill(engine, segs, policy, InMemoryLayerSource(kv), gate=TRUSTED, stats=False,
                                     steps=steps)
            src = GpuLayerSource(InMemoryLayerSource(host), cfg.num_layers, device, ops=ops)
            try:
                r = blend_prefill(engine, segs, policy, src, gate=TRUSTED, stats=False, steps=steps)
            finally:
                src.close()
            fallbacks.extend(r.fallbacks)
            return r

        try:
            s, r = _median_s(prefill, repeats, sync)
            prof = _profile(prefill, sync, cuda)
        except Exception as e:  # noqa: BLE001 - report every case, go on with the next
            check(name, False, f"{type(e).__name__}: {e}")
            traceback.print_exc()
            continue
        logits = r.logits.float()
        dev = float((logits - ref).norm() / ref.norm())
        where = "device memory"
        if streamed:
            where = "pinned host, streamed by layer" if cuda else "host, streamed by layer"
        if on_graphs:
            where += f", {sum(t.static for t in r.timings)} of {cfg.num_layers} layers as graphs"
        rows.append({"case": name, "kv": where,
                     "ttft_ms": 1e3 * s, "speedup": full_s / s, "logit_dev": dev,
                     "top1": bool(logits.argmax() == ref.argmax()), "computed_share": r.computed_share,
                     **prof})
        if not torch.isfinite(logits).all():
            check(name, False, "non-finite logits")
        elif name.startswith("exact reuse"):
            diff = float((logits - ref).abs().max())
            check(name, diff <= tol, f"max |logit diff| {diff:.3g}, tolerance {tol:.3g} (the reuse probe's)")
        elif streamed:
            base = in_gpu.get(name[: -len(PINNED)])
            diff = float((logits - base).abs().max()) if base is not None else math.inf
            rows[-1]["layers_computed_for_lack_of_kv"] = len(fallbacks)
            check(name, base is not None and diff <= tol and not fallbacks,
                  f"vs the same case from GPU memory: max |logit diff| {diff:.3g} (tolerance {tol:.3g}); "
                  f"{len(fallbacks)} (chunk, layer) computed for lack of their KV in "
                  f"{len(calls)} runs" + ("" if cuda else "; CPU: not pinned, no side stream"))
        elif on_graphs:
            check(name, *_versus_eager(logits, in_gpu.get(name[: -len(GRAPHS)]), tol, graphed))
        else:
            in_gpu[name] = logits
    return rows


def _cpu_check(cfg, engine: LlamaEngine, tokens: list[int], ref: torch.Tensor, device: str, dtype: torch.dtype,
               check: Callable[[str, bool, str], None]) -> None:
    """The full prefill's logits on `device` against the same weights' on the CPU, in fp32."""
    names = _hf_names(cfg)
    cpu = LlamaEngine(cfg, {k: v.to("cpu", torch.float32) for k, v in engine.w.items() if k in names})
    cpu_ref = cpu.prefill(torch.tensor(tokens), all_logits=False)[0][-1]
    diff = float((ref.cpu() - cpu_ref).abs().max())
    ctol = TOLERANCE.get(dtype, 6e-2) * max(1.0, float(cpu_ref.abs().max()))
    check(f"full prefill on {device} vs cpu (fp32)", diff <= ctol,
          f"max |logit diff| {diff:.3g}, tolerance {ctol:.3g}")


def _prompt(cfg: LlamaConfig, chunks: int, chunk_len: int, question_len: int
            ) -> tuple[list[list[int]], list[list[int]], list[int]]:
    """Seeded random chunks, as many unrelated chunks to store them behind, and a question."""
    g = torch.Generator().manual_seed(1)
    rand = lambda n: torch.randint(0, cfg.vocab_size, (n,), generator=g, device="cpu").tolist()  # noqa: E731
    texts = [rand(chunk_len) for _ in range(chunks)]
    others = [rand(chunk_len) for _ in range(chunks)]
    return texts, others, rand(question_len)


def _header(shape: str, dtype_name: str, device: str, cfg: LlamaConfig, chunks: int, chunk_len: int,
            question_len: int, repeats: int) -> dict:
    name = torch.cuda.get_device_name() if device.startswith("cuda") else platform.processor() or "cpu"
    return {"benchmark": "scripts/gpu_blend.py", "date_utc": time.strftime("%Y-%m-%d %H:%M", time.gmtime()),
            "device": name, "torch": torch.__version__, "python": platform.python_version(),
            "shape": shape, "dtype": dtype_name, "layers": cfg.num_layers, "hidden": cfg.hidden_size,
            "heads": cfg.num_heads, "kv_heads": cfg.num_kv_heads, "head_dim": cfg.head_dim,
            "chunks": chunks, "chunk_len": chunk_len, "question_len": question_len,
            "prompt_tokens": chunks * chunk_len + question_len, "repeats": repeats}


def runs(shape: str, dtype_name: str, device: str, chunk_counts: list[int], chunk_len: int, question_len: int,
         repeats: int, cpu_check: bool) -> Iterator[dict]:
    """One run per prompt length (`chunk_counts`), all on one set of weights drawn once."""
    cfg, dtype = SHAPES[shape], DTYPES[dtype_name]
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    t_build = time.perf_counter()
    engine = random_engine(cfg, dtype, device)
    graphed = StepGraphs(engine) if cuda else None  # the engine's static steps
    sync()
    build_s = time.perf_counter() - t_build
    for n, chunks in enumerate(chunk_counts):
        texts, others, question = _prompt(cfg, chunks, chunk_len, question_len)
        rows: list[dict] = []
        checks: list[dict] = []

        def check(name: str, ok: bool, detail: str) -> None:
            checks.append({"check": name, "status": "PASS" if ok else "FAIL", "detail": detail})

        t_run = time.perf_counter()
        try:
            with torch.device(device), torch.no_grad():
                tokens = torch.tensor(sum(texts, []) + question)
                full = lambda: engine.prefill(tokens, all_logits=False)[0][-1]  # noqa: E731
                full_s, ref = _median_s(full, repeats, sync)
                ref = ref.float()
                rows.append({"case": "full prefill", "kv": "none (computed)", "ttft_ms": 1e3 * full_s, "speedup": 1.0,
                             "logit_dev": 0.0, "top1": True, "computed_share": 1.0, **_profile(full, sync, cuda)})
                check("full prefill logits finite", bool(torch.isfinite(ref).all()), f"{len(tokens)} tokens")
                rows += _reuse_rows(engine, cfg, dtype, texts, others, question, ref, full_s, repeats, device,
                                    sync, check, graphed)
                if n == 0:  # one probe per set of weights
                    try:
                        p = probe(engine)
                        check("reuse probe (engine_adapter.probe)", p.ok,
                              f"max |diff| {p.max_diff:.3g}, tolerance {p.tolerance:.3g}")
                    except Exception as e:  # noqa: BLE001
                        check("reuse probe (engine_adapter.probe)", False, f"{type(e).__name__}: {e}")
                        traceback.print_exc()
            # fp32 only: bf16 on one device against fp32 on another differs by bf16's rounding,
            # which the reuse probe's tolerance was not set for (exact reuse checks bf16 above).
            if cpu_check and n == 0 and device != "cpu" and dtype == torch.float32:
                _cpu_check(cfg, engine, sum(texts, []) + question, ref, device, dtype, check)
        except Exception as e:  # noqa: BLE001 - out of memory at the longer prompt: keep the shorter's numbers
            check(f"{chunks} chunks", False, f"{type(e).__name__}: {e}"[:500])
            traceback.print_exc()
        yield {**_header(shape, dtype_name, device, cfg, chunks, chunk_len, question_len, repeats),
               "weights_build_s": build_s, "run_s": time.perf_counter() - t_run, "rows": rows, "checks": checks}
        if cuda:
            torch.cuda.empty_cache()


# -- the service as users run it -------------------------------------------------------------


def _kv_bytes(cfg: LlamaConfig, dtype: torch.dtype, tokens: int) -> int:
    return tokens * cfg.num_layers * cfg.num_kv_heads * cfg.head_dim * 2 * torch.empty((), dtype=dtype).element_size()


def serve_run(shape: str, dtype_name: str, device: str, chunks: int, chunk_len: int, question_len: int,
              repeats: int, data_root: str | None, promote_timeout_s: float = 30.0) -> dict:
    """`kvcraft serve` in its own process with a gpu tier; this process the engine (see the
    module docstring)."""
    from kvservice.launcher import ServiceProcess

    cfg, dtype = SHAPES[shape], DTYPES[dtype_name]
    cuda = device.startswith("cuda")
    sync = torch.cuda.synchronize if cuda else (lambda: None)
    texts, _, question = _prompt(cfg, chunks, chunk_len, question_len)
    rows: list[dict] = []
    checks: list[dict] = []
    info: dict = {}

    def check(name: str, ok: bool, detail: str) -> None:
        checks.append({"check": name, "status": "PASS" if ok else "FAIL", "detail": detail})

    payload = _kv_bytes(cfg, dtype, chunks * chunk_len)
    # Room for every variant twice over in the gpu pool and the host slab (POSIX shared memory:
    # at most half of what /dev/shm has free; a variant the slab cannot hold is still mapped
    # from the gpu tier); the disk holds all.
    budget = max(64 << 20, 2 * payload)
    host = budget
    if os.path.isdir("/dev/shm"):
        host = max(16 << 20, min(budget, shutil.disk_usage("/dev/shm").free // 2))
    settings = {"gpu_budget_bytes": budget, "host_budget_bytes": host, "disk_budget_bytes": max(1 << 30, 4 * payload)}
    t_build = time.perf_counter()
    engine = random_engine(cfg, dtype, device)
    sync()
    info["weights_build_s"] = time.perf_counter() - t_build
    root = data_root if data_root and os.access(data_root, os.W_OK) else None
    with tempfile.TemporaryDirectory(prefix="kvcraft-gpu-serve.", dir=root) as d:
        service = ServiceProcess(Path(d) / "data", **settings)
        t0 = time.perf_counter()
        try:
            service.start(timeout=60)
            info["service_start_s"] = time.perf_counter() - t0
            info["service"] = {"address": service.address, **settings}
            with KVClient(service.address, timeout=60) as client, torch.device(device), torch.no_grad():
                _serve_cases(engine, client, texts, question, dtype, repeats, device, sync, promote_timeout_s,
                             rows, check, info)
        except Exception as e:  # noqa: BLE001 - report what ran, with the service's log
            check("served prefill", False, f"{type(e).__name__}: {e}"[:500])
            traceback.print_exc()
            print("kvcraft serve's log (tail):\n" + service.log()[-3000:])
        finally:
            try:
                service.stop()
            except Exception as e:  # noqa: BLE001
                print(f"stopping kvcraft serve: {type(e).__name__}: {e}")
            service.close()
            info["service_log_tail"] = service.log()[-1500:]
    return {**_header(shape, dtype_name, device, cfg, chunks, chunk_len, question_len, repeats), "mode": "serve",
            **info, "rows": rows, "checks": checks}


def _serve_cases(engine: LlamaEngine, client, texts: list[list[int]], question: list[int],  # noqa: ANN001
                 dtype: torch.dtype, repeats: int, device: str, sync: Callable[[], None], promote_timeout_s: float,
                 rows: list[dict], check: Callable[[str, bool, str], None], info: dict) -> None:
    cuda = device.startswith("cuda")
    n = len(texts)
    tokens = torch.tensor(sum(texts, []) + question)

    steps = StepGraphs(engine) if cuda else None  # the engine's static steps, for the ", graphs" case

    def adapter(policy: str, store_back: bool = False, graphs: bool = False):  # noqa: ANN202
        return RAGAdapter(engine, client, Policy(policy), gate=TRUSTED, store_back=store_back, local=True,
                          shadows=False, steps=steps if graphs else None)

    # 1. A first request computes every chunk (each behind the ones before it) and stores it.
    t0 = time.perf_counter()
    first = adapter("full", store_back=True)
    _, report = first.prefill(texts, question, reorder=False)
    first.close()  # waits for the store-backs
    info["store_s"] = time.perf_counter() - t0
    check("first request stores every chunk", report.fresh_chunks == n, f"{report.fresh_chunks} of {n} fresh")

    # 2. Plans preload the variants into the service's fastest tier: wait until a Plan says
    #    they are all in its gpu tier (where it runs one), then Locate them once.
    tiers_run = [(t.name, t.bytes_budget) for t in client.stats().tiers]
    info["service_tiers"] = [f"{name} ({budget} bytes)" for name, budget in tiers_run]
    has_gpu = any(name == "gpu" for name, _ in tiers_run)
    if cuda:
        check("kvcraft serve runs a gpu tier", has_gpu, f"its tiers: {', '.join(info['service_tiers'])}")
    t0 = time.perf_counter()
    while True:
        plan = client.plan(first.model_id, texts, len(question), first_turn=False)
        if plan.lease_id:
            client.release(plan.lease_id)
        tiers = [c.tier for c in plan.chunks]
        if not has_gpu or all(t == "gpu" for t in tiers) or time.perf_counter() - t0 > promote_timeout_s:
            break
        time.sleep(0.2)
    info["plan_tiers"] = tiers
    info["promote_s"] = time.perf_counter() - t0
    if has_gpu:
        check("Plans preloaded every variant into the gpu tier", all(t == "gpu" for t in tiers),
              f"tiers {tiers} after {info['promote_s']:.1f} s")
    refs = [Ref(c.chunk_key, c.variant_id, c.cfo) for c in plan.chunks if c.variant_id]
    info["located_tiers"], on_gpu = [], []
    if refs:  # none: the store failed (checked above); the cases below say what that costs
        with client.fetch_local(refs) as located:
            info["located_tiers"] = list(located.tier)
            on_gpu = [layers is not None and layers[0][0].is_cuda for layers in located.layers]
    if cuda:
        check("Locate hands out the gpu tier's KV as CUDA tensors (CUDA IPC)",
              len(refs) == n and all(on_gpu) and all(t == "gpu" for t in info["located_tiers"]),
              f"Locate: tiers {info['located_tiers']}, CUDA tensors {sum(on_gpu)} of {n}")
    else:
        info["gpu_tier"] = (f"{NOT_MEASURED}: this process has no CUDA, so Locate hands out host-slab tensors"
                            + ("" if has_gpu else " (and the service runs without a gpu tier)"))

    # 3. The cases, each the median of `repeats` synchronised requests after a warm-up.
    full = lambda: engine.prefill(tokens, all_logits=False)[0][-1]  # noqa: E731
    full_s, ref = _median_s(full, repeats, sync)
    ref = ref.float()
    rows.append({"case": "full prefill (engine alone)", "kv": "none (computed)", "ttft_ms": 1e3 * full_s,
                 "speedup": 1.0, "logit_dev": 0.0, "top1": True, "computed_share": 1.0, **_profile(full, sync, cuda)})
    tol = TOLERANCE.get(dtype, 6e-2) * max(1.0, float(ref.abs().max()))
    cases = [("served full prefill", "full"), ("served exact reuse", "naive"),
             (f"served default ({DEFAULT_POLICY}) 15%", DEFAULT_POLICY)]
    if cuda:  # the same engine on static steps (no second copy of the weights)
        cases.append((f"served default ({DEFAULT_POLICY}) 15%" + GRAPHS, DEFAULT_POLICY))
    eager_default = None
    for name, policy in cases:
        a = adapter(policy, graphs=name.endswith(GRAPHS))
        reports: list = []
        loads: set[str] = set()

        def request(a=a, reports=reports, loads=loads):  # noqa: ANN202
            result, rep = a.prefill(texts, question, reorder=False)
            reports.append(rep)
            loads.update(t.tier for t in a.take_timings().loads)
            return result

        try:
            s, r = _median_s(request, repeats, sync)
            prof = _profile(request, sync, cuda)
        except Exception as e:  # noqa: BLE001
            check(name, False, f"{type(e).__name__}: {e}"[:500])
            traceback.print_exc()
            a.close()
            continue
        a.close()
        logits = r.logits.float()
        reused = min(rep.reused_chunks for rep in reports)
        fallbacks = sum(len(rep.fallbacks) for rep in reports)
        kv = "none (computed)" if policy == "full" else "-"
        if loads and policy != "full":
            kv = f"service's {','.join(sorted(loads))} tier"
        rows.append({"case": name, "kv": kv,
                     "ttft_ms": 1e3 * s, "speedup": full_s / s,
                     "logit_dev": float((logits - ref).norm() / ref.norm()),
                     "top1": bool(logits.argmax() == ref.argmax()),
                     "computed_share": r.computed_share, "reused_chunks": reused, "fallbacks": fallbacks,
                     "plan_errors": sorted({rep.plan_error for rep in reports if rep.plan_error}), **prof})
        if not torch.isfinite(logits).all():
            check(name, False, "non-finite logits")
            continue
        if policy == "full":
            continue
        detail = f"reused {reused} of {n} chunks in every request, {fallbacks} (chunk, layer) computed for lack of KV"
        ok = reused == n and fallbacks == 0
        if cuda:
            ok = ok and loads == {"gpu"}
            detail += f"; KV read from tier(s) {sorted(loads)}"
        if policy == "naive":
            diff = float((logits - ref).abs().max())
            ok = ok and diff <= tol
            detail += f"; max |logit diff| to full prefill {diff:.3g}, tolerance {tol:.3g} (the reuse probe's)"
        if name.endswith(GRAPHS):
            static = sum(t.static for t in r.timings)
            rows[-1]["kv"] += f", {static} of {len(r.timings)} layers as graphs"
            same, versus = _versus_eager(logits, eager_default, tol, steps)
            ok, detail = ok and same, f"{detail}; {versus}"
        elif policy == DEFAULT_POLICY:
            eager_default = logits
        check(name, ok, detail)


def _versus_eager(logits: torch.Tensor, eager: torch.Tensor | None, tol: float,
                  steps: StepGraphs | None) -> tuple[bool, str]:
    """A ", graphs" case's check: its logits within `tol` of the same case's on eager steps
    (None: that case did not run), and the static steps still on."""
    diff = float((logits - eager).abs().max()) if eager is not None else math.inf
    failed = steps.failed if steps is not None else ""
    return diff <= tol and not failed, (f"vs the same case on eager steps: max |logit diff| {diff:.3g} "
                                        f"(tolerance {tol:.3g})"
                                        + (f"; the static steps failed, eager since: {failed}" if failed else ""))


def _fmt(v: object, fmt: str) -> str:
    return "n/m" if v is None else format(v, fmt)


def print_report(out: dict) -> None:
    what = "served by kvcraft serve" if out.get("mode") == "serve" else "blended vs full prefill"
    print(f"\n{what}: {out['shape']} ({out['layers']} layers, hidden {out['hidden']}), "
          f"{out['dtype']}, {out['chunks']} x {out['chunk_len']} + {out['question_len']} = {out['prompt_tokens']} "
          f"tokens, {out['device']}, median of {out['repeats']}")
    print(f"  {'case':<34} {'TTFT ms':>9} {'speed-up':>9} {'computed':>9} {'logit dev':>10} {'top-1':>6} "
          f"{'launches':>9} {'kernels':>8} {'GPU busy':>9}  KV")
    for r in out["rows"]:
        busy = _fmt(None if r.get("gpu_busy_share") is None else 100 * r["gpu_busy_share"], ".0f")
        print(f"  {r['case']:<34} {r['ttft_ms']:9.2f} {r.get('speedup', 1.0):8.2f}x {r['computed_share']:9.1%} "
              f"{r['logit_dev']:10.2e} {'same' if r['top1'] else 'diff':>6} {_fmt(r.get('launches'), 'd'):>9} "
              f"{_fmt(r.get('kernels'), 'd'):>8} {busy + ('%' if busy != 'n/m' else ''):>9}  {r.get('kv', '')}")
    if any(r.get("gpu_busy_share") is None for r in out["rows"]):
        notes = sorted({r["profile_note"] for r in out["rows"] if r.get("profile_note")})
        why = "; ".join(notes) if notes else "GPU-only: torch.profiler's CUDA activity"
        print(f"  n/m: {NOT_MEASURED} ({why})")
    for k in ("weights_build_s", "service_start_s", "store_s", "promote_s", "run_s"):
        if k in out:
            print(f"  {k}: {out[k]:.1f}")
    for k in ("service_tiers", "plan_tiers", "located_tiers", "gpu_tier"):
        if k in out:
            print(f"  {k}: {out[k]}")
    for c in out["checks"]:
        print(f"  {c['status']:<5} {c['check']}: {c['detail']}")


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--shape", choices=sorted(SHAPES), default="smollm2-135m")
    ap.add_argument("--dtype", nargs="+", choices=sorted(DTYPES), default=["bf16", "fp32"])
    ap.add_argument("--device", default="cuda")
    ap.add_argument("--chunks", type=int, nargs="+", default=[5],
                    help="chunk counts, one run each (5 and 16 of 512 + 32: 2,592 and 8,224 tokens)")
    ap.add_argument("--chunk-len", type=int, default=512)
    ap.add_argument("--question-len", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--no-cpu-check", action="store_true", help="skip the fp32 CPU prefill of the same weights")
    ap.add_argument("--serve", action="store_true",
                    help="the service as users run it: kvcraft serve with a gpu tier, this process the engine")
    ap.add_argument("--data-dir", help="--serve: where the service's data directory goes (default: a temporary one)")
    ap.add_argument("--json", type=Path, help="write the results here (a list, one entry per dtype and length)")
    a = ap.parse_args(argv)
    if a.device.startswith("cuda") and not torch.cuda.is_available():
        print("gpu_blend: torch sees no CUDA device; nothing measured (--device cpu for a dry run)")
        return 2
    results = []

    def done(out: dict) -> None:
        print_report(out)
        results.append(out)
        if a.json:  # after every run: a later one running out of time keeps the earlier numbers
            a.json.write_text(json.dumps(results, indent=1))

    if a.serve:
        for name in a.dtype:
            for chunks in a.chunks:
                done(serve_run(a.shape, name, a.device, chunks, a.chunk_len, a.question_len, a.repeats, a.data_dir))
    else:
        # The CPU reference of an 8B shape would take minutes: small shapes only.
        cpu_check = not a.no_cpu_check and a.shape != "llama3-8b"
        for name in a.dtype:
            for out in runs(a.shape, name, a.device, a.chunks, a.chunk_len, a.question_len, a.repeats, cpu_check):
                done(out)
    failed = [c for r in results for c in r["checks"] if c["status"] == "FAIL"]
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
