"""engine_adapter: the inference-worker side of kvcraft.

- `llama`     reference Llama-family engine: weights and a layer's linear parts
- `step`      the one layer step every pass runs; `attention`, the one attention
- `prompt`    a prompt as ordered segments (chunks, question)
- `policy`    reuse policies by name: Full, Prefix, Naive, CacheCraft (Alg. 1), CacheBlend (HKVD),
              Epic, QueryAware (the default); `Policy(name, **options)`; each a plug-in of one
              file in `policies/` through `selection` (its passes, its choice of rows per layer)
- `source`    LayerSource: where stored chunk KV comes from, layer by layer
- `loop`      the per-layer loop of one pass (`merge`: the stored KV and the rows it keeps,
              `stats`: fresh chunks' statistics, `dispatch`/`graphs`: the static steps)
- `probe`     the per-model reuse gate (ReuseGate), runs the loop
- `blend`     `blend_prefill`: asks the gate, then runs the policy's passes
- `generate`  greedy decoding after a prefill (full or blended), stop tokens from the model
- `rag`       RAGAdapter: one RAG request against a kvcraft service (plan, fetch, blend, store back)
- `vllm`      the vLLM KV connector (a package; imports vLLM only when its modules load)
"""

from engine_adapter.blend import BlendResult, FreshChunk, LayerTiming, blend_prefill
from engine_adapter.generate import Generation, greedy, stop_tokens
from engine_adapter.llama import LlamaConfig, LlamaEngine, rope_for_spec
from engine_adapter.policy import CacheBlend, CacheCraft, Epic, Full, Naive, Policy, Prefix, QueryAware, ReusePolicy
from engine_adapter.probe import DEFAULT_GATE, ReuseGate, probe
from engine_adapter.prompt import Segment
from engine_adapter.source import InMemoryLayerSource, LayerSource, ScheduledLayerSource

__all__ = [
    "BlendResult", "FreshChunk", "LayerTiming", "blend_prefill",
    "LlamaConfig", "LlamaEngine", "rope_for_spec", "Generation", "greedy", "stop_tokens",
    "Policy", "ReusePolicy", "Full", "Prefix", "Naive", "CacheCraft", "CacheBlend", "Epic", "QueryAware", "Segment",
    "DEFAULT_GATE", "ReuseGate", "probe",
    "InMemoryLayerSource", "LayerSource", "ScheduledLayerSource",
]
