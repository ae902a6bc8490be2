"""vLLM's own decoder layers as the layer step's linear parts (`model.LayerModel`).

Inside vLLM the blend computes its rows with the serving model's modules of each decoder layer,
called on the rows being computed: `input_layernorm`, `self_attn.qkv_proj` (with Qwen3's
`q_norm`/`k_norm` per head), `self_attn.o_proj`, `post_attention_layernorm` (vLLM's fused
residual add and RMSNorm) and `mlp`, sharded and quantized as vLLM built them, on vLLM's kernels
(on a CPU a plain RMSNorm by vLLM's C++ kernels, not the PyTorch form vLLM leaves to its
torch.compile: `rms_norm`); the embedding and the vocabulary projection are vLLM's too. kvcraft
owns the rows, the merged cache, the rotation and which keys each row attends to (`step.layer_step`); on a CPU vLLM's
attention kernel computes it (`vllm.attention`). No weight is copied. At tensor parallel > 1
each rank's modules hold its heads and add the ranks' parts themselves (vLLM's all-reduces): the
blend runs on every rank in step, its choices agreed (`engine_adapter.ranks`).

One class covers every architecture whose vLLM decoder layer has those modules (Llama, Mistral,
Qwen2, Qwen3: `llama.ARCHITECTURES`); the architecture's own config (biases, q/k norms) is
vLLM's business, read here only to name the shapes (`LlamaConfig.from_hf`).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from typing import Any

import torch
from torch import Tensor

from engine_adapter.llama import LlamaConfig
from engine_adapter.model import LayerModel
from engine_adapter.ranks import TensorRanks
from engine_adapter.vllm.attention import VllmCpuAttention
from kvcraft.keys import ModelSpec

CPU_ROW_MULTIPLE = 8  # rows of vLLM's linear parts on a CPU: a multiple of this (`VllmLayers.row_multiple`)


class VllmLayers(LayerModel):
    """A vLLM model (`KVCraft...ForCausalLM`, this process's) as the step's model. `name`: the
    model folder's, as `LlamaEngine.from_pretrained` names it, so chunks either stores serve both."""

    def __init__(self, model: Any, name: str) -> None:
        whole = LlamaConfig.from_hf(model.config.to_dict(), name=name)
        attn = model.model.layers[0].self_attn
        self.m = model
        # this process's heads (all of them at tensor parallel 1); stored KV holds every KV head
        self.cfg = dataclasses.replace(whole, head_dim=attn.head_dim, num_heads=attn.num_heads,
                                       num_kv_heads=attn.num_kv_heads)
        self.stored_kv_heads = whole.num_kv_heads
        self.ranks = TensorRanks.of_vllm()
        self.rope = whole.rope()
        self.scale = 1.0 / math.sqrt(self.cfg.head_dim)
        embed = model.model.embed_tokens.weight
        self.dtype, self.device = embed.dtype, embed.device
        self.triton = self.device.type == "cuda"
        self._layers = list(model.model.layers)
        self._turn = model.kvcraft_turn  # vLLM's forward pass and these calls take turns on a CPU
        # vLLM's token budget per forward pass (max_num_batched_tokens): the memory it profiled
        # its activations with, and left the rest to its KV cache. A blend of a longer prompt
        # runs its MLPs within it (`step._layer_out`).
        self.max_rows = model.kvcraft_max_rows
        # On a CPU vLLM's oneDNN matmuls take some row counts up to a third longer than the next
        # multiple of 8 (the TTFT benchmark's 12 layers: 1,311 rows 658 ms, 1,312 603; 703 rows 447,
        # 704 334): the linear parts run on rows padded up to one, 4% less over counts drawn at random.
        self.row_multiple = 1 if self.triton else CPU_ROW_MULTIPLE
        # On a CPU, vLLM's attention kernel computes the attention kvcraft decides (`vllm.attention`)
        self.attention = None if self.triton else VllmCpuAttention(self.cfg.num_heads, self.cfg.num_kv_heads,
                                                                   self.cfg.head_dim, self.dtype, self._turn)

    def model_spec(self) -> ModelSpec:
        """The whole model's (every KV head), whatever share of it this process holds."""
        return dataclasses.replace(super().model_spec(), num_kv_heads=self.stored_kv_heads)

    def embed(self, tokens: Tensor) -> Tensor:
        with self._turn:
            return self.m.model.embed_tokens(tokens)  # [R, d]

    def qkv_heads(self, layer: int, h: Tensor) -> Tensor:
        """[Hq+2Hkv, R, D] from vLLM's input norm and QKV projection (q/k norms where the
        architecture has them), before RoPE."""
        c, attn, n = self.cfg, self._layers[layer].self_attn, h.shape[0]
        x = _as_rows(h, self._linear_rows(n))
        with self._turn:
            qkv, _ = attn.qkv_proj(rms_norm(self._layers[layer].input_layernorm, x))  # [R', (Hq+2Hkv)*D]
            heads = qkv[:n].view(n, c.num_heads + 2 * c.num_kv_heads, c.head_dim)  # [R, H, D]
            if c.qk_norm:
                q, k, v = heads.split([c.num_heads, c.num_kv_heads, c.num_kv_heads], dim=1)
                heads = torch.cat((rms_norm(attn.q_norm, q.contiguous()),
                                   rms_norm(attn.k_norm, k.contiguous()), v), dim=1)
        return heads.transpose(0, 1)

    def layer_out(self, layer: int, h: Tensor, o: Tensor) -> Tensor:
        """vLLM's o-proj, its fused residual add and RMSNorm, its MLP, the residual."""
        dec, n = self._layers[layer], h.shape[0]
        m = self._linear_rows(n)
        with self._turn:
            out, _ = dec.self_attn.o_proj(_as_rows(o.transpose(0, 1), m).view(m, -1))  # [R', d]
            # (normed, the residual stream: h + out; added in place: into a copy of h)
            x, res = add_rms_norm(dec.post_attention_layernorm, out, _padded(h, m))
            return (res + dec.mlp(x))[:n]

    def _linear_rows(self, n: int) -> int:
        """The rows the linear parts run for n rows: n rounded up to `row_multiple`."""
        return -(-n // self.row_multiple) * self.row_multiple

    def logits(self, h: Tensor) -> Tensor:
        with self._turn:
            return self.m.compute_logits(self.m.model.norm(h))  # [R, V]


def rms_norm(norm: Any, x: Tensor) -> Tensor:
    """vLLM's RMSNorm module `norm` of x, by vLLM's C++ kernel where `_c_kernel` says."""
    if not _c_kernel(norm, x):
        return norm(x)
    out = torch.empty_like(x)
    torch.ops._C.rms_norm(out, x, norm.weight.data, norm.variance_epsilon)
    return out


def add_rms_norm(norm: Any, x: Tensor, residual: Tensor) -> tuple[Tensor, Tensor]:
    """(norm(x + residual), x + residual) as vLLM's `norm(x, residual)` gives them; by vLLM's
    C++ kernel where `_c_kernel` says, written over x and residual."""
    if not _c_kernel(norm, x):
        return norm(x, residual)
    torch.ops._C.fused_add_rms_norm(x, residual, norm.weight.data, norm.variance_epsilon)
    return x, residual


def _c_kernel(norm: Any, x: Tensor) -> bool:
    """Does vLLM's C++ RMSNorm compute `norm` of x? On a CPU vLLM's RMSNorm runs its PyTorch
    form, for torch.compile to fuse into vLLM's graph; called one module at a time, as the
    blend calls it, that form is a dozen operations, each a pass over the rows (1,312 x 768
    fp32 rows on one thread: 4.1 ms against the kernel's 0.19; in the blend of a `full`
    request, 8% of its time). Plain RMSNorm only (its own weight, in x's dtype; no variance
    override), on a CPU whose vLLM ships the kernels."""
    cls = _c_rms_norm_class()
    return (cls is not None and type(norm) is cls and x.device.type == "cpu" and norm.has_weight
            and norm.variance_size_override is None and norm.weight.dtype == x.dtype)


@functools.cache
def _c_rms_norm_class() -> type | None:
    """vLLM's RMSNorm where vLLM's build here ships its C++ kernels, else None."""
    from vllm.model_executor.layers.layernorm import RMSNorm

    try:
        ok = hasattr(torch.ops._C, "rms_norm") and hasattr(torch.ops._C, "fused_add_rms_norm")
    except (AttributeError, RuntimeError):
        ok = False
    return RMSNorm if ok else None


def _as_rows(x: Tensor, m: int) -> Tensor:
    """x [n, ...] as m >= n contiguous rows: itself where it is that already, else `_padded`."""
    return x.contiguous() if x.shape[0] == m else _padded(x, m)


def _padded(x: Tensor, m: int) -> Tensor:
    """A new contiguous [m, ...]: x's n rows [n, ...], then copies of its last (values the kernels
    take as they take x's: a row of zeros has no per-token quantization scale)."""
    out = x.new_empty((m, *x.shape[1:]))
    n = x.shape[0]
    out[:n].copy_(x)
    out[n:].copy_(x[n - 1:].expand(m - n, *x.shape[1:]))
    return out


__all__ = ["CPU_ROW_MULTIPLE", "VllmLayers", "add_rms_norm", "rms_norm"]
