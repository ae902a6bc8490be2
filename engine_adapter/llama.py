"""Reference Llama-family engine: the weights and a layer's linear parts.

One file, gpt-fast style. The engine owns the weights and the math of a layer that is not
the step's (`engine_adapter.step`: the rows, the rotation, the cache, the attention): the
input RMSNorm with the fused QKV projection (`qkv_heads`, q and k leave it without rotary
embedding, so a chunk's K can be stored RoPE-free and rotated to any new position later) and
what follows the attention (`layer_out`: o-proj, residual, RMSNorm, MLP, residual). Q/K/V and
gate/up are one matmul each (the HF weights are views into the fused ones).

`prefill` (`model.LayerModel`) is the plain full prefill, the layer step over every row (causal
SDPA, RoPE from the engine's own config): the ground truth a blended prefill is checked against,
and the fast path when nothing is reused.

On CUDA (`triton`) the steps between the matmuls are fused Triton kernels (`kvkernels.layer`):
RMSNorm, the residual add with the next RMSNorm, SiLU-mul (and, in the step, the rotation
with the write of the K/V). On CPU the same steps are plain torch (each kernel's reference);
tests run the Triton path on CPU too, under ``TRITON_INTERPRET=1``, against it.

Shapes: T prompt tokens, R selected rows, d hidden, Hq/Hkv heads, D head dim, V vocab.
"""

from __future__ import annotations

import json
import math
from dataclasses import dataclass
from pathlib import Path

import torch
import torch.nn.functional as F
from torch import Tensor

from engine_adapter.model import LayerModel
from kvcraft.keys import ModelSpec
from kvkernels import RopeConfig
from kvkernels.layer import add_rms_norm_reference, add_rms_norm_triton, rms_norm_reference, rms_norm_triton
from kvkernels.layer import silu_mul_reference, silu_mul_triton

# The architectures a layer's linear parts follow (HF `model_type` -> its class): they differ
# by a bias on the q/k/v projections (Qwen2; Llama's `attention_bias`, with o_proj's) and an
# RMSNorm of each q and k head before RoPE (Qwen3); Mistral's layer is Llama's.
ARCHITECTURES = {"llama": "LlamaForCausalLM", "mistral": "MistralForCausalLM", "qwen2": "Qwen2ForCausalLM",
                 "qwen3": "Qwen3ForCausalLM"}


@dataclass(frozen=True)
class LlamaConfig:
    name: str
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-5
    rope_theta: float = 10000.0
    # Llama-3 RoPE scaling as (key, value) pairs from HF "rope_scaling"; empty = none.
    rope_scaling: tuple[tuple[str, object], ...] = ()
    tie_word_embeddings: bool = False
    max_position_embeddings: int = 8192
    architecture: str = "llama"  # HF model_type (`ARCHITECTURES`)
    qkv_bias: bool = False  # q, k and v projections with a bias (Qwen2; Llama's attention_bias)
    o_bias: bool = False  # o_proj with a bias (Llama's attention_bias)
    qk_norm: bool = False  # RMSNorm of each q and k head over the head dim, before RoPE (Qwen3)

    def __post_init__(self) -> None:
        if self.architecture not in ARCHITECTURES:
            raise ValueError(f"architecture {self.architecture!r} is not one kvcraft blends "
                             f"(known: {', '.join(ARCHITECTURES)})")

    @classmethod
    def named(cls, name: str) -> "LlamaConfig":
        """Named shapes: `tiny` (mechanics and tests) and `llama3-8b` (Meta-Llama-3-8B)."""
        shapes = {
            "tiny": cls("tiny", vocab_size=256, hidden_size=64, intermediate_size=128, num_layers=4,
                        num_heads=4, num_kv_heads=2, head_dim=16, rope_theta=10000.0,
                        max_position_embeddings=2048),
            "llama3-8b": cls("llama3-8b", vocab_size=128256, hidden_size=4096, intermediate_size=14336,
                             num_layers=32, num_heads=32, num_kv_heads=8, head_dim=128,
                             rope_theta=500000.0),
        }
        if name not in shapes:
            raise ValueError(f"unknown model shape {name!r}; known: {sorted(shapes)}")
        return shapes[name]

    @classmethod
    def from_hf(cls, hf: dict, name: str | None = None) -> "LlamaConfig":
        """From an HF config.json dict (transformers 4 `rope_theta`/`rope_scaling`, or 5 `rope_parameters`)
        of a Llama, Mistral, Qwen2 or Qwen3 model. Refused: sliding-window attention (the blend's
        attention sees every earlier key) and an MLP with biases."""
        arch = hf.get("model_type", "llama")
        if arch not in ARCHITECTURES:
            raise ValueError(f"model_type {arch!r} is not one kvcraft blends (known: {', '.join(ARCHITECTURES)})")
        window = hf.get("sliding_window")
        if hf.get("use_sliding_window") or (arch == "mistral" and window and window < hf.get(
                "max_position_embeddings", 0)):
            raise ValueError(f"{arch} with sliding-window attention (sliding_window={window}) is not supported: "
                             "the blend's attention sees every earlier key")
        if hf.get("mlp_bias"):
            raise ValueError("an MLP with biases (mlp_bias) is not supported")
        params = dict(hf.get("rope_parameters") or {})
        theta = params.pop("rope_theta", hf.get("rope_theta", 10000.0))
        scaling = params if params.get("rope_type", "default") != "default" else dict(hf.get("rope_scaling") or {})
        llama_bias = arch in ("llama", "mistral") and bool(hf.get("attention_bias", False))
        return cls(
            name=name or hf.get("_name_or_path") or hf.get("model_type", "llama"),
            vocab_size=hf["vocab_size"],
            hidden_size=hf["hidden_size"],
            intermediate_size=hf["intermediate_size"],
            num_layers=hf["num_hidden_layers"],
            num_heads=hf["num_attention_heads"],
            num_kv_heads=hf.get("num_key_value_heads") or hf["num_attention_heads"],
            head_dim=hf.get("head_dim") or hf["hidden_size"] // hf["num_attention_heads"],
            rms_norm_eps=hf.get("rms_norm_eps", 1e-5),
            rope_theta=float(theta),
            rope_scaling=tuple(sorted(scaling.items())),
            tie_word_embeddings=bool(hf.get("tie_word_embeddings", False)),
            max_position_embeddings=hf.get("max_position_embeddings", 8192),
            architecture=arch,
            qkv_bias=arch == "qwen2" or llama_bias or (arch == "qwen3" and bool(hf.get("attention_bias", False))),
            o_bias=llama_bias or (arch == "qwen3" and bool(hf.get("attention_bias", False))),
            qk_norm=arch == "qwen3",
        )

    def to_hf(self) -> dict:
        """HF config.json content (transformers 5 `rope_parameters` form)."""
        if self.qkv_bias != self.o_bias and self.architecture != "qwen2" or self.qk_norm != (self.architecture == "qwen3"):
            raise ValueError(f"no HF {self.architecture} config has these biases and norms")
        rope = {"rope_type": "default", **dict(self.rope_scaling), "rope_theta": self.rope_theta}
        return {
            "architectures": [ARCHITECTURES[self.architecture]], "model_type": self.architecture,
            "_name_or_path": self.name, "sliding_window": None, "use_sliding_window": False,
            "vocab_size": self.vocab_size, "hidden_size": self.hidden_size,
            "intermediate_size": self.intermediate_size, "num_hidden_layers": self.num_layers,
            "num_attention_heads": self.num_heads, "num_key_value_heads": self.num_kv_heads,
            "head_dim": self.head_dim, "rms_norm_eps": self.rms_norm_eps, "hidden_act": "silu",
            "rope_parameters": rope, "tie_word_embeddings": self.tie_word_embeddings,
            "max_position_embeddings": self.max_position_embeddings,
            "attention_bias": self.o_bias, "mlp_bias": False,
        }

    def rope(self) -> RopeConfig:
        return RopeConfig.from_hf_config(self.to_hf())


def rope_for_spec(spec: ModelSpec) -> RopeConfig:
    """The RoPE a stored cache of `spec` was keyed with: the adapter rotates with this one."""
    rope = {"rope_type": "default", **dict(spec.rope_scaling), "rope_theta": spec.rope_theta}
    return RopeConfig.from_hf_config({"head_dim": spec.head_dim, "rope_parameters": rope})


def _hf_names(cfg: LlamaConfig) -> dict[str, tuple[int, ...]]:
    """HF parameter names -> shapes."""
    d, hd = cfg.hidden_size, cfg.head_dim
    names = {"model.embed_tokens.weight": (cfg.vocab_size, d), "model.norm.weight": (d,)}
    for i in range(cfg.num_layers):
        p = f"model.layers.{i}."
        names |= {
            p + "input_layernorm.weight": (d,),
            p + "self_attn.q_proj.weight": (cfg.num_heads * hd, d),
            p + "self_attn.k_proj.weight": (cfg.num_kv_heads * hd, d),
            p + "self_attn.v_proj.weight": (cfg.num_kv_heads * hd, d),
            p + "self_attn.o_proj.weight": (d, cfg.num_heads * hd),
            p + "post_attention_layernorm.weight": (d,),
            p + "mlp.gate_proj.weight": (cfg.intermediate_size, d),
            p + "mlp.up_proj.weight": (cfg.intermediate_size, d),
            p + "mlp.down_proj.weight": (d, cfg.intermediate_size),
        }
        if cfg.qkv_bias:
            names |= {p + f"self_attn.{x}_proj.bias": (n * hd,)
                      for x, n in (("q", cfg.num_heads), ("k", cfg.num_kv_heads), ("v", cfg.num_kv_heads))}
        if cfg.o_bias:
            names[p + "self_attn.o_proj.bias"] = (d,)
        if cfg.qk_norm:
            names |= {p + "self_attn.q_norm.weight": (hd,), p + "self_attn.k_norm.weight": (hd,)}
    if not cfg.tie_word_embeddings:
        names["lm_head.weight"] = (cfg.vocab_size, d)
    return names


class LlamaEngine(LayerModel):
    """Weights + a layer's linear parts on selected rows (`model.LayerModel`).

    `rope` is the RoPE the engine's own `prefill` uses (default: from `cfg`). It exists
    separately so a misconfigured engine can be built on purpose (the reuse probe's test).
    `triton`: the layer's steps run as Triton kernels (default: where the weights are on
    CUDA; True on CPU needs ``TRITON_INTERPRET=1``, for tests).
    """

    def __init__(self, cfg: LlamaConfig, weights: dict[str, Tensor], *, rope: RopeConfig | None = None,
                 triton: bool | None = None):
        missing = set(_hf_names(cfg)) - set(weights)
        if missing:
            raise ValueError(f"weights lack {len(missing)} tensors, e.g. {sorted(missing)[:3]}")
        self.cfg = cfg
        self.w = dict(weights)
        self.dtype = weights["model.embed_tokens.weight"].dtype
        self.rope = rope or cfg.rope()
        self.scale = 1.0 / math.sqrt(cfg.head_dim)
        self.triton = self.device.type == "cuda" if triton is None else triton
        self._fuse()

    def _fuse(self) -> None:
        """One [Wq; Wk; Wv] and one [Wgate; Wup] per layer; the HF names become row views
        into them (no second copy of the weights)."""
        c = self.cfg
        self.w_qkv: list[Tensor] = []
        self.b_qkv: list[Tensor] = []  # with `qkv_bias`
        self.w_gate_up: list[Tensor] = []
        for layer in range(c.num_layers):
            p = f"model.layers.{layer}."
            self.w_qkv.append(self._fused([p + f"self_attn.{x}_proj.weight" for x in "qkv"]))
            if c.qkv_bias:
                self.b_qkv.append(self._fused([p + f"self_attn.{x}_proj.bias" for x in "qkv"]))
            self.w_gate_up.append(self._fused([p + "mlp.gate_proj.weight", p + "mlp.up_proj.weight"]))

    def _fused(self, names: list[str]) -> Tensor:
        fused = torch.cat([self.w[n] for n in names])
        start = 0
        for n in names:
            rows = self.w[n].shape[0]
            self.w[n] = fused[start:start + rows]
            start += rows
        return fused

    @classmethod
    def random(cls, cfg: LlamaConfig | str, *, seed: int = 0, dtype: torch.dtype = torch.float32,
               std: float = 0.02, **kw) -> "LlamaEngine":
        """Random weights (seeded); norms at 1 as in a freshly initialised HF model."""
        cfg = LlamaConfig.named(cfg) if isinstance(cfg, str) else cfg
        g = torch.Generator().manual_seed(seed)
        w = {n: (torch.ones(s) if len(s) == 1 else torch.randn(s, generator=g) * std).to(dtype)
             for n, s in _hf_names(cfg).items()}
        return cls(cfg, w, **kw)

    @classmethod
    def from_pretrained(cls, path: str | Path, *, dtype: torch.dtype | None = None, **kw) -> "LlamaEngine":
        """An HF directory with config.json and model.safetensors (HF parameter names)."""
        from safetensors.torch import load_file

        path = Path(path)
        hf = json.loads((path / "config.json").read_text())
        cfg = LlamaConfig.from_hf(hf, name=path.name)
        w = load_file(str(path / "model.safetensors"))
        if cfg.tie_word_embeddings:
            w.pop("lm_head.weight", None)
        if dtype is not None:
            w = {k: v.to(dtype) for k, v in w.items()}
        return cls(cfg, w, **kw)

    def save_pretrained(self, path: str | Path) -> None:
        from safetensors.torch import save_file

        path = Path(path)
        path.mkdir(parents=True, exist_ok=True)
        hf = self.cfg.to_hf() | {"dtype": str(self.dtype).removeprefix("torch.")}
        (path / "config.json").write_text(json.dumps(hf, indent=2))
        save_file({k: v.clone() for k, v in self.w.items()}, str(path / "model.safetensors"))  # clone: no shared views

    @property
    def device(self) -> torch.device:
        """Where the weights are (and so where a prefill computes)."""
        return self.w["model.embed_tokens.weight"].device

    # ---- a layer's linear parts, on selected rows ------------------------------------------

    def _norm(self, x: Tensor, name: str) -> Tensor:
        """RMSNorm over the last dim (rows [R, d], or a head's [H, R, D]: the kernel takes 2-D rows)."""
        if not self.triton:
            return rms_norm_reference(x, self.w[name], self.cfg.rms_norm_eps)
        if x.dim() == 2:
            return rms_norm_triton(x, self.w[name], self.cfg.rms_norm_eps)
        return rms_norm_triton(x.reshape(-1, x.shape[-1]), self.w[name], self.cfg.rms_norm_eps).view(x.shape)

    def embed(self, tokens: Tensor) -> Tensor:
        return self.w["model.embed_tokens.weight"][tokens]  # [R, d]

    def qkv_heads(self, layer: int, h: Tensor) -> Tensor:
        """[Hq+2Hkv, R, D]: q, k, v heads of hidden rows h [R, d] in one matmul (pre-RoPE; Qwen3's
        q and k heads normalized). Leading batch dims pass through ([..., R, d] -> [..., H, R, D];
        plain torch only)."""
        c = self.cfg
        p = f"model.layers.{layer}."
        x = self._norm(h, p + "input_layernorm.weight")  # [R, d]
        y = x @ self.w_qkv[layer].T if not c.qkv_bias else F.linear(x, self.w_qkv[layer], self.b_qkv[layer])
        heads = y.view(*y.shape[:-1], c.num_heads + 2 * c.num_kv_heads, c.head_dim).transpose(-3, -2)  # [R, H*D]
        if not c.qk_norm:
            return heads
        q, k, v = heads.split([c.num_heads, c.num_kv_heads, c.num_kv_heads], dim=-3)
        return torch.cat((self._norm(q, p + "self_attn.q_norm.weight"), self._norm(k, p + "self_attn.k_norm.weight"),
                          v), dim=-3)

    def layer_out(self, layer: int, h: Tensor, o: Tensor) -> Tensor:
        """The rest of the layer after attention, for hidden rows h [R, d] and their attention
        output o [Hq,R,D]: o_proj, residual, RMSNorm, MLP (gate/up, SiLU-mul, down), residual.
        Leading batch dims pass through, as in `qkv_heads`."""
        p = f"model.layers.{layer}."
        o = o.transpose(-3, -2).reshape(*o.shape[:-3], o.shape[-2], -1)  # [R, Hq*D]
        add_norm, act = ((add_rms_norm_triton, silu_mul_triton) if self.triton
                         else (add_rms_norm_reference, silu_mul_reference))
        wo = self.w[p + "self_attn.o_proj.weight"]
        out = o @ wo.T if not self.cfg.o_bias else F.linear(o, wo, self.w[p + "self_attn.o_proj.bias"])
        h, x = add_norm(h, out, self.w[p + "post_attention_layernorm.weight"], self.cfg.rms_norm_eps)  # [R, d] each
        return h + act(x @ self.w_gate_up[layer].T) @ self.w[p + "mlp.down_proj.weight"].T  # [R, d]

    def logits(self, h: Tensor) -> Tensor:
        head = self.w.get("lm_head.weight", self.w["model.embed_tokens.weight"])
        return self._norm(h, "model.norm.weight") @ head.T  # [R, V]


__all__ = ["LlamaConfig", "LlamaEngine", "rope_for_spec"]
