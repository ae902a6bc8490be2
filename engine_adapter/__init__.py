"""engine_adapter: the inference-worker side of kvcraft.

- `llama`    reference Llama-family engine, per-layer primitives on selected rows
- `prompt`   a prompt as ordered segments (chunks, question)
- `policy`   reuse policies as objects: Full, Prefix, Naive, CacheCraft (Alg. 1), CacheBlend
             (HKVD), QueryAware (the default); `Policy(name, **options)` builds one from a name
- `source`   LayerSource: where stored chunk KV comes from, layer by layer
- `driver`   the per-layer loop of a blended prefill
- `query`    the default policy's two passes (a question pass, then recompute what it read)
- `probe`    the per-model reuse gate (ReuseGate), runs the driver
- `blend`    `blend_prefill`: asks the gate, then runs the driver
- `generate` greedy decoding after a prefill (full or blended), stop tokens from the model
- `rag`      RAGAdapter: one RAG request against a kvcraft service (plan, fetch, blend, store back)
- `vllm`     the vLLM KV connector (a package; imports vLLM only when its modules load)
"""

from engine_adapter.blend import BlendResult, FreshChunk, LayerTiming, blend_prefill
from engine_adapter.generate import Generation, greedy, stop_tokens
from engine_adapter.llama import LlamaConfig, LlamaEngine, rope_for_spec
from engine_adapter.policy import CacheBlend, CacheCraft, Full, Naive, Policy, Prefix, QueryAware, ReusePolicy
from engine_adapter.probe import DEFAULT_GATE, ReuseGate, probe
from engine_adapter.prompt import Segment
from engine_adapter.source import InMemoryLayerSource, LayerSource, ScheduledLayerSource

__all__ = [
    "BlendResult", "FreshChunk", "LayerTiming", "blend_prefill",
    "LlamaConfig", "LlamaEngine", "rope_for_spec", "Generation", "greedy", "stop_tokens",
    "Policy", "ReusePolicy", "Full", "Prefix", "Naive", "CacheCraft", "CacheBlend", "QueryAware", "Segment",
    "DEFAULT_GATE", "ReuseGate", "probe",
    "InMemoryLayerSource", "LayerSource", "ScheduledLayerSource",
]
