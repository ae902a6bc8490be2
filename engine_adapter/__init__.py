"""engine_adapter: the inference-worker side of kvcraft.

- `llama`    reference Llama-family engine, per-layer primitives on selected rows
- `prompt`   a prompt as ordered segments (chunks, question)
- `policy`   reuse policies: full, prefix, naive, cachecraft (Alg. 1), cacheblend (HKVD)
- `source`   LayerSource: where stored chunk KV comes from, layer by layer
- `blend`    the blended prefill driver
- `probe`    per-model reuse probe (ReuseGate)
- `timeline` the per-layer timeline figure of docs/adapter.md
"""

from engine_adapter.blend import BlendResult, FreshChunk, LayerTiming, blend_prefill
from engine_adapter.llama import LlamaConfig, LlamaEngine, rope_for_spec
from engine_adapter.policy import Policy
from engine_adapter.probe import DEFAULT_GATE, ReuseGate, probe
from engine_adapter.prompt import Segment
from engine_adapter.source import InMemoryLayerSource, LayerSource, ScheduledLayerSource

__all__ = [
    "BlendResult", "FreshChunk", "LayerTiming", "blend_prefill",
    "LlamaConfig", "LlamaEngine", "rope_for_spec",
    "Policy", "Segment",
    "DEFAULT_GATE", "ReuseGate", "probe",
    "InMemoryLayerSource", "LayerSource", "ScheduledLayerSource",
]
