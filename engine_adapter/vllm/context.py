"""Blending inside vLLM, worker side: build a RAG request's context KV and write it into vLLM's cache.

For one `BlendLoad` (the scheduler side claimed the request's chunks, block-aligned,
and vLLM allocated blocks for them), on a loader thread (on a CPU and at tensor parallel > 1
on vLLM's step thread: `worker`):

  1. the layer step over the model's own layers (`vllm.layers.VllmLayers`: vLLM's modules of
     each decoder layer, from the `model.KVCraft...ForCausalLM` handle; no copy) serves the
     prompt with `engine_adapter.rag.RAGAdapter.serve`: the Plan the scheduler side got, the
     planned variants read through `engine_adapter.loader` (the service's shared memory when
     `local` and on this host, else one gRPC stream), RoPE re-rotation, the policy's selection
     (`engine_adapter.policies`: the same code the reference engine runs, so that engine is
     this path's oracle), fresh chunks stored back;
  2. each layer's K (post-RoPE) / V rows of the claimed tokens go into vLLM's paged
     cache through the attention backend's own `layer.impl.do_kv_cache_update(...)`,
     the call vLLM's attention layers use, so any backend that has it works (CPU_ATTN,
     flash-attention, ...), whatever its cache layout.

Anything short of the planned KV (a fetch that missed the per-layer wait or the
stream deadline, a variant evicted or corrupt after the Plan, the service gone) makes
the loop compute that chunk itself; the connector then reports the whole load
failed, so vLLM (kv_load_failure_policy "recompute") computes the request exactly as
it would alone. The question rows are computed here too (Cache-Craft's focus needs
their attention; the policies' KV equals the reference engine's only with them) and
again by vLLM: that cost is counted in the numbers the request reports.
"""

from __future__ import annotations

import logging
import threading
import time
from typing import Any

import torch

from engine_adapter.vllm.blend_request import computed_share, is_adaptive
from engine_adapter.vllm.blocks import BlendLoad
from engine_adapter.vllm.config import ConnectorSettings, make_blend_policy
from engine_adapter.vllm.last_token import LastToken, LastTokens

log = logging.getLogger("kvcraft.vllm")

DEFAULT_LAYER_WAIT_S = 0.5  # per-layer wait for fetched KV unless blend options set layer_budget_s


class BlendFailed(RuntimeError):
    """The context could not be built as planned; vLLM recomputes the request."""


class ContextBuilder:
    """Builds blended context KV into vLLM's paged cache (see the module docstring)."""

    def __init__(self, settings: ConnectorSettings, client: Any, vllm_config: Any, chunk_model_id: str,
                 block_size: int, metrics: Any) -> None:
        from engine_adapter.fidelity import Serving
        from kvcraft.heap import IDLE_TRIM_S

        self.settings = settings
        self._client = client
        self._vllm_config = vllm_config
        self.chunk_model_id = chunk_model_id
        self.block_size = block_size
        self._lock = threading.Lock()
        # One RAGAdapter per thread that blends (an adapter holds one request's state while it
        # serves), all over the one engine: on loader threads blends of different requests run at once.
        self._thread = threading.local()
        self._adapters: list[Any] = []
        # every adapter's prefills (and vLLM's forward after them): shadows give way; the heap
        # trimmed once they and the shadows are idle (kvcraft.heap)
        self.serving = Serving(trim_idle_s=IDLE_TRIM_S, on_trim=lambda: metrics.add(heap_trims=1))
        self._engine: Any = None
        self._steps: Any = None  # the engine's static steps, with `blend_graphs`
        self._attn: list[Any] | None = None
        self._timings = b""  # the latest blend's TimingReport, serialized, until the scheduler takes it
        self.last_tokens = LastTokens()  # finished blends' last prompt tokens, until a step answers them

    # -- the pieces vLLM gives us lazily --------------------------------------------------
    def _rag_adapter(self) -> Any:
        """This thread's adapter over the model's engine."""
        adapter = getattr(self._thread, "adapter", None)
        if adapter is None:
            from engine_adapter.policy import Policy
            from engine_adapter.rag import RAGAdapter

            # Each request runs the policy its BlendLoad names (`build`); shadow prefills of the
            # requests Plans mark run on this adapter's background thread, over vLLM's weights
            # (not at tensor parallel > 1: the ranks would have to run them in step). No near-tie
            # gate: its full prefill would run through kvcraft's loop, not vLLM's (docs/vllm.md).
            engine = self._model_engine()
            adapter = RAGAdapter(engine, self._client, Policy("full"), store_back=self.settings.blend_store_back,
                                 local=self.settings.local, steps=self._steps, serving=self.serving,
                                 shadows=engine.ranks is None, near_tie=0.0)
            adapter.model_id = self.chunk_model_id
            self._thread.adapter = adapter
            with self._lock:
                self._adapters.append(adapter)
        return adapter

    def _model_engine(self) -> Any:
        with self._lock:
            if self._engine is None:
                from engine_adapter.vllm.model import ARCHITECTURE, current_model

                model = current_model()
                if model is None:
                    raise BlendFailed(f"no kvcraft blending model in this process: start vLLM with "
                                      f"hf_overrides={{'architectures': ['{ARCHITECTURE}']}} (or its Mistral, "
                                      "Qwen2, Qwen3 name)")
                engine = model.kvcraft_engine()
                got = engine.model_spec().fingerprint()
                if not self.settings.chunk_model_id and got != self.chunk_model_id:
                    raise BlendFailed(f"the model's chunk namespace {got} is not the scheduler side's "
                                      f"{self.chunk_model_id}")
                if self.settings.blend_graphs:
                    from engine_adapter.graphs import StepGraphs

                    self._steps = StepGraphs(engine)
                self._engine = engine
            return self._engine

    def take_timings(self) -> bytes:
        """The latest blend's per-layer load/compute timings (a serialized TimingReport; b""
        if none since the last call), for the scheduler side's next Plan."""
        with self._lock:
            out, self._timings = self._timings, b""
        return out

    def flush(self) -> None:
        """Wait for every adapter's store-backs."""
        with self._lock:
            adapters = list(self._adapters)
        for adapter in adapters:
            adapter.flush()

    def attention_layers(self, layer_names: list[str]) -> list[Any]:
        """vLLM's attention modules, in layer order (the forward context's static table)."""
        if self._attn is None:
            table = self._vllm_config.compilation_config.static_forward_context
            missing = [n for n in layer_names if n not in table]
            if missing:
                raise BlendFailed(f"vLLM has no attention layer named {missing[0]!r}")
            layers = [table[n] for n in layer_names]
            for n, a in zip(layer_names, layers):
                if not hasattr(getattr(a, "impl", None), "do_kv_cache_update"):
                    raise BlendFailed(f"attention backend of {n} ({type(getattr(a, 'impl', None)).__name__}) "
                                      "has no do_kv_cache_update")
            self._attn = layers
        return self._attn

    # -- one request ----------------------------------------------------------------------
    def build(self, ld: BlendLoad, layer_names: list[str]) -> dict[str, Any]:
        """Blend the request's context and write its claimed blocks; the request's numbers.
        Raises BlendFailed (or anything the blend raised) when vLLM must recompute."""
        adapter = self._rag_adapter()
        attn = self.attention_layers(layer_names)
        options = dict(ld.options)
        options.setdefault("layer_budget_s", DEFAULT_LAYER_WAIT_S)
        policy = make_blend_policy(ld.policy, options)
        if is_adaptive(ld.policy, ld.options):
            from engine_adapter.policy import with_budget

            policy = with_budget(policy, ld.plan.recompute_budget)
        at, chunks = 0, []
        for n in ld.chunk_tokens:
            chunks.append(list(ld.prompt[at:at + n]))
            at += n
        question = list(ld.prompt[at:])
        t1 = time.perf_counter()
        result, report = adapter.serve(ld.plan, chunks, question, policy=policy)
        report_bytes = adapter.take_timings().SerializeToString()  # the scheduler side sends them with a Plan
        ranks = adapter.engine.ranks
        if ranks is None or ranks.rank == 0:  # (the ranks' are alike: rank 0's are sent)
            with self._lock:
                self._timings = report_bytes  # the latest blend's: the controller's estimators decay anyway
        t2 = time.perf_counter()
        if result.fallbacks:
            chunk, layer = result.fallbacks[0]
            raise BlendFailed(f"stored KV of chunk {chunk} did not arrive intact by layer {layer} "
                              f"({len(result.fallbacks)} chunk(s) short)")
        self._write(result.kv, ld, attn)
        t3 = time.perf_counter()
        rotate = sum(t.rotate_s for t in result.timings)
        attend = sum(t.attend_s for t in result.timings)
        timings = {"blend_s": t2 - t1, "fetch_wait_s": report.fetch_wait_s,
                   "rotate_s": rotate, "attention_s": attend,
                   "recompute_s": sum(t.compute_s for t in result.timings) - rotate - attend,
                   "logits_s": result.logits_s, "kv_write_s": t3 - t2}
        n = len(ld.prompt)
        L = len(result.kv)
        row_layers = sum(result.computed_rows) if result.computed_rows else n * L
        vllm_tokens = n - (ld.first_token + ld.tokens)  # 1 unless vLLM trimmed the offer
        if vllm_tokens == 1 and ranks is None and result.last_hidden is not None:  # (`last_token`)
            self.last_tokens.add(ld.req_id, LastToken.of(ld.prompt, result.kv, result.last_hidden))
        numbers = {"blended": True, "policy": ld.policy, "prompt_tokens": n, "claimed_tokens": ld.tokens,
                   "vllm_computed_tokens": vllm_tokens, "kvcraft_row_layers": int(row_layers), "num_layers": L}
        return {**numbers, "computed_share": computed_share(numbers), "reused_chunks": report.reused_chunks,
                "fresh_chunks": report.fresh_chunks, "fallback": "", "budget": report.budget,
                "sampled": report.sampled, "timings": timings, "ranks": 1}

    def _write(self, kv: list[tuple[torch.Tensor, torch.Tensor]], ld: BlendLoad, attn: list[Any]) -> None:
        """Rows [first_token, first_token + tokens) of every layer into the blocks (the last
        block may be partly filled: vLLM computes the rest of it)."""
        bs = self.block_size
        if len(kv) != len(attn):
            raise BlendFailed(f"the blend computed {len(kv)} layers, vLLM has {len(attn)}")
        start, stop = ld.first_token, ld.first_token + ld.tokens
        if not 0 < ld.tokens <= len(ld.block_ids) * bs:
            raise BlendFailed(f"{ld.tokens} tokens do not fit {len(ld.block_ids)} blocks")
        ids = torch.tensor(ld.block_ids, dtype=torch.long)
        slots = (ids[:, None] * bs + torch.arange(bs)[None, :]).reshape(-1)[:ld.tokens]  # [T] slot of each token
        # vLLM's own K/V have the model's dtype before the cache update; the backend converts
        # (and scales, for fp8 caches) exactly as it does for vLLM's rows.
        dtype = self._vllm_config.model_config.dtype
        for (k, v), a in zip(kv, attn):
            cache = a.kv_cache
            if stop > k.shape[1]:
                raise BlendFailed(f"claimed tokens up to {stop}, the blend has {k.shape[1]}")
            # [Hkv, T, D] -> [T, Hkv, D], the layout vLLM's forward hands do_kv_cache_update;
            # vLLM's CPU backend reads it by its strides (as `vllm.attention` hands it kvcraft's
            # cache), the others as vLLM's forward lays it out: each token's heads in one run
            key = k[:, start:stop].transpose(0, 1).to(device=cache.device, dtype=dtype)
            value = v[:, start:stop].transpose(0, 1).to(device=cache.device, dtype=dtype)
            if not _reads_strides(a.impl):
                key, value = key.contiguous(), value.contiguous()
            a.impl.do_kv_cache_update(a, key, value, cache, slots.to(cache.device))


def _reads_strides(impl: Any) -> bool:
    """Does this attention backend's cache update read K/V [T, Hkv, D] of any strides (vLLM's
    CPU backend: `cpu_attn_reshape_and_cache`)?"""
    try:
        from vllm.v1.attention.backends.cpu_attn import CPUAttentionBackendImpl
    except ImportError:  # a vLLM without its CPU backend: every other backend gets them contiguous
        return False
    return isinstance(impl, CPUAttentionBackendImpl)
