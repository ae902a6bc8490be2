"""The model handle blending needs: vLLM's Llama, registered under another architecture name.

The connector's worker side builds a RAG request's context KV with the model's own
weights (engine_adapter.blend, the reference engine's code). vLLM gives a connector no
handle to the model, so this subclass of vLLM's `LlamaForCausalLM` publishes one:

    LLM(model_dir, hf_overrides={"architectures": ["KVCraftLlamaForCausalLM"]}, ...)

It is registered through vLLM's plugin entry point (pyproject.toml:
`[project.entry-points."vllm.general_plugins"] kvcraft = "engine_adapter.vllm.model:register"`),
which vLLM runs in every process it starts; no vLLM source is patched. Without the
installed entry point (a source checkout on PYTHONPATH), call `register()` before
`LLM(...)` in the process that builds the model.

The class adds nothing to vLLM's forward pass. At construction it keeps references to
the weight tensors (vLLM's CPU backend repacks linear weights after loading and drops
its own reference to the unpacked ones: the kept ones then cost one more copy of the
linear weights on CPU; on GPU backends nothing is repacked, nothing is copied), and
`engine()` wraps them as an `engine_adapter.llama.LlamaEngine` without copying: the
fused QKV and gate/up weights are the engine's fused matrices as they are.
"""

from __future__ import annotations

import threading
import weakref
from pathlib import Path
from typing import Any

import torch

from engine_adapter.llama import LlamaConfig, LlamaEngine

ARCHITECTURE = "KVCraftLlamaForCausalLM"
_CLASS_PATH = "engine_adapter.vllm.model:KVCraftLlamaForCausalLM"

_lock = threading.Lock()
_current: "weakref.ref[Any] | None" = None


def register() -> None:
    """vLLM general plugin: make `ARCHITECTURE` known to vLLM's ModelRegistry (idempotent;
    the class is imported lazily, when vLLM builds the model)."""
    from vllm import ModelRegistry

    if ARCHITECTURE not in ModelRegistry.get_supported_archs():
        ModelRegistry.register_model(ARCHITECTURE, _CLASS_PATH)


def current_model() -> Any | None:
    """The KVCraftLlamaForCausalLM built last in this process (None if none is alive)."""
    with _lock:
        return _current() if _current is not None else None


class _SharedWeightsEngine(LlamaEngine):
    """A LlamaEngine over vLLM's weight tensors: the fused matrices are taken as they are."""

    def __init__(self, cfg: LlamaConfig, weights: dict[str, torch.Tensor], qkv: list[torch.Tensor],
                 gate_up: list[torch.Tensor]) -> None:
        self._given = (qkv, gate_up)
        super().__init__(cfg, weights)

    def _fuse(self) -> None:
        self.w_qkv, self.w_gate_up = list(self._given[0]), list(self._given[1])


def _kvcraft_model_class() -> type:
    from vllm.model_executor.models.llama import LlamaForCausalLM

    class KVCraftLlamaForCausalLM(LlamaForCausalLM):
        """vLLM's Llama plus a handle kvcraft's connector builds context KV with."""

        def __init__(self, *, vllm_config: Any, prefix: str = "", **kw: Any) -> None:
            super().__init__(vllm_config=vllm_config, prefix=prefix, **kw)
            self.kvcraft_name = Path(str(vllm_config.model_config.model)).name
            self._kvcraft_params = _weight_params(self)  # before vLLM's CPU repacking drops them
            self._kvcraft_engine: LlamaEngine | None = None
            global _current
            with _lock:
                _current = weakref.ref(self)

        def kvcraft_engine(self) -> LlamaEngine:
            """The reference engine over this model's weights (built once, no copy)."""
            if self._kvcraft_engine is None:
                self._kvcraft_engine = _engine(self.config, self.kvcraft_name, self._kvcraft_params)
            return self._kvcraft_engine

    KVCraftLlamaForCausalLM.__module__ = __name__
    KVCraftLlamaForCausalLM.__qualname__ = "KVCraftLlamaForCausalLM"
    return KVCraftLlamaForCausalLM


def _weight_params(model: Any) -> dict[str, Any]:
    """name -> Parameter, in vLLM's names (fused qkv_proj and gate_up_proj)."""
    out = {}
    m = model.model
    out["embed"] = m.embed_tokens.weight
    out["norm"] = m.norm.weight
    for i, layer in enumerate(m.layers):
        out[f"{i}.in_norm"] = layer.input_layernorm.weight
        out[f"{i}.qkv"] = layer.self_attn.qkv_proj.weight
        out[f"{i}.o"] = layer.self_attn.o_proj.weight
        out[f"{i}.post_norm"] = layer.post_attention_layernorm.weight
        out[f"{i}.gate_up"] = layer.mlp.gate_up_proj.weight
        out[f"{i}.down"] = layer.mlp.down_proj.weight
    if not getattr(model.config, "tie_word_embeddings", False):
        out["lm_head"] = model.lm_head.weight
    return out


def _engine(hf_config: Any, name: str, params: dict[str, Any]) -> LlamaEngine:
    """LlamaEngine over the kept vLLM parameters. `name` is the model folder's name, as
    `LlamaEngine.from_pretrained` names it: the chunk namespace equals the reference
    engine's (`model_spec().fingerprint()`), so chunks either one stored serve both."""
    cfg = LlamaConfig.from_hf(hf_config.to_dict(), name=name)
    c = cfg
    if getattr(hf_config, "attention_bias", False) or getattr(hf_config, "mlp_bias", False):
        raise ValueError("kvcraft blending supports Llama without attention/MLP biases")
    t = {k: p.data for k, p in params.items()}
    qd, kd = c.num_heads * c.head_dim, c.num_kv_heads * c.head_dim
    w = {"model.embed_tokens.weight": t["embed"], "model.norm.weight": t["norm"]}
    qkv, gate_up = [], []
    for i in range(c.num_layers):
        p = f"model.layers.{i}."
        fq, fg = t[f"{i}.qkv"], t[f"{i}.gate_up"]
        if fq.shape != (qd + 2 * kd, c.hidden_size) or fg.shape != (2 * c.intermediate_size, c.hidden_size):
            raise ValueError(f"layer {i}: vLLM weights of shape {tuple(fq.shape)} / {tuple(fg.shape)} are not "
                             "an unquantized, unsharded Llama's (tensor parallel 1, no quantization)")
        qkv.append(fq)
        gate_up.append(fg)
        w |= {
            p + "input_layernorm.weight": t[f"{i}.in_norm"],
            p + "self_attn.q_proj.weight": fq[:qd],
            p + "self_attn.k_proj.weight": fq[qd:qd + kd],
            p + "self_attn.v_proj.weight": fq[qd + kd:],
            p + "self_attn.o_proj.weight": t[f"{i}.o"],
            p + "post_attention_layernorm.weight": t[f"{i}.post_norm"],
            p + "mlp.gate_proj.weight": fg[:c.intermediate_size],
            p + "mlp.up_proj.weight": fg[c.intermediate_size:],
            p + "mlp.down_proj.weight": t[f"{i}.down"],
        }
    if "lm_head" in t:
        w["lm_head.weight"] = t["lm_head"]
    return _SharedWeightsEngine(cfg, w, qkv, gate_up)


def __getattr__(name: str) -> Any:
    # vLLM imports "engine_adapter.vllm.model:KVCraftLlamaForCausalLM" lazily; vllm is imported then.
    if name == "KVCraftLlamaForCausalLM":
        cls = _kvcraft_model_class()
        globals()[name] = cls
        return cls
    raise AttributeError(name)


__all__ = ["ARCHITECTURE", "current_model", "register"]
