"""What the layer step asks of a model (`step.layer_step`): its linear parts on selected rows.

A model is the reference engine (`llama.LlamaEngine`, plain torch or its Triton kernels over
its own weights) or an inference engine's own layers (`vllm.layers.VllmLayers`: vLLM's modules
of each decoder layer, sharded and quantized as vLLM built them, on vLLM's kernels). Either way
kvcraft owns the rows, the merged cache, the rotation and the attention; the model supplies:

    embed(tokens [R]) -> h [R, d]
    qkv_heads(layer, h [R, d]) -> [Hq+2Hkv, R, D]   the input norm and the QKV projection (with
                                                    its biases, q/k norms), q and k WITHOUT RoPE
    layer_out(layer, h [R, d], o [Hq, R, D]) -> h'  o-proj, residual, norm, MLP, residual
    logits(h [R, d]) -> [R, V]

and `cfg` (the shapes: this process's heads where a model is sharded), `rope` (its own RoPE, for
`prefill`), `scale`, `dtype`, `device`, `triton` (the step's own Triton kernels: rotation with
the K/V write, attention by position), `max_rows` (the most rows `layer_out` is given at once:
an inference engine's tokens per forward pass; None: no bound), `attention` (the engine's own
attention kernel, for what kvcraft's attention decides: which keys each row reads; None:
kvcraft's own arithmetic, `engine_adapter.attention`), `ranks` (`ranks.TensorRanks` where the
model is one rank of a tensor-parallel engine: `cfg` counts this rank's heads, `model_spec()` the
whole model's; None: one process). `prefill` is the plain full prefill: the layer step over every row.
"""

from __future__ import annotations

from typing import Any

import torch
from torch import Tensor

from engine_adapter.attention import CAUSAL
from engine_adapter.step import LayerCache, Rotation, Rows, layer_step
from kvcraft.keys import ModelSpec
from kvkernels import RopeConfig, rope_tables


class LayerModel:
    """The base of a model the layer step runs (the module docstring)."""

    cfg: Any  # llama.LlamaConfig
    rope: RopeConfig
    scale: float
    triton: bool
    dtype: torch.dtype
    device: torch.device
    max_rows: int | None = None  # rows `layer_out` takes at once (None: every row; `step._layer_out`)
    attention: Any = None  # the engine's attention kernel (`vllm.attention.VllmCpuAttention`); None: kvcraft's
    ranks: Any = None  # `ranks.TensorRanks` of a tensor-parallel engine; None: the whole model in this process
    # seconds per row-layer of the last blended pass over this model: the next pass's price of
    # falling back before it has computed a layer of its own (`merge.Merge.patience`)
    row_layer_s: float | None = None

    def embed(self, tokens: Tensor) -> Tensor:
        raise NotImplementedError

    def qkv_heads(self, layer: int, h: Tensor) -> Tensor:
        raise NotImplementedError

    def layer_out(self, layer: int, h: Tensor, o: Tensor) -> Tensor:
        raise NotImplementedError

    def logits(self, h: Tensor) -> Tensor:
        raise NotImplementedError

    def model_spec(self) -> ModelSpec:
        """The identity stored KV of this model is keyed by (`kvcraft.keys.ModelSpec`)."""
        c = self.cfg
        return ModelSpec(name=c.name, num_layers=c.num_layers, num_kv_heads=c.num_kv_heads,
                         head_dim=c.head_dim, dtype=str(self.dtype).removeprefix("torch."),
                         rope_theta=c.rope_theta, rope_scaling=c.rope_scaling)

    @torch.no_grad()
    def prefill(self, tokens: Tensor, start_pos: int = 0, *, all_logits: bool = True, last: int = 1,
                kv: bool = True) -> tuple[Tensor, list[tuple[Tensor, Tensor]]]:
        """Logits and per-layer KV (K post-RoPE [Hkv,T,D], V) of tokens at start_pos..

        Logits are [T, V], or [last, V] for the last `last` tokens alone with
        all_logits=False (what serving needs: the first output token; the vocabulary
        projection of every row is a large share of a small model's prefill).
        kv=False: no KV kept (an empty list), so a layer's tensors are let go once the
        next layer has its input (a prefill for its logits alone: a fidelity shadow's).
        """
        tokens = torch.as_tensor(tokens, dtype=torch.long)
        pos = torch.arange(start_pos, start_pos + len(tokens))
        rows = Rows(torch.arange(len(tokens)), pos, Rotation(*rope_tables(self.rope, pos), self.triton), CAUSAL)
        h = self.embed(tokens)  # [T, d]
        cache = []
        for layer in range(self.cfg.num_layers):
            out = layer_step(self, layer, h, rows, LayerCache(None, None, None))
            if kv:
                cache.append((own(out.K), own(out.V)))
            h = out.h
        return self.logits(h if all_logits else h[-last:]), cache


def own(t: Tensor) -> Tensor:
    """`t` in storage of its own size. A full prefill's K/V are views of the layer's QKV
    projection (V) and of its rotated q and k (K): kept as they are, each would hold every
    query head's rows too (5x the KV for SmolLM2's 9 query and 3 kv heads)."""
    return t if t.untyped_storage().nbytes() == t.nbytes else t.clone()


__all__ = ["LayerModel", "own"]
