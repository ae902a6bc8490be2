"""A blended request's last prompt token answered by its blend: vLLM runs no layer over it.

The blend computes the prompt's last row at every layer (the first token's logits are read from
it, as the reference engine reads them), so when it ends it holds that row's final hidden state
and its K/V at every layer. vLLM claims every prompt token but that one from the connector
(`scheduler.SchedulerSide._blend_matched`) and would then run its whole model over the one
token: every weight read for one row (the TTFT benchmark's 12-layer model on the 2-core VM:
17-36 ms, median ~28, of a ~330 ms CacheBlend request). Instead:

  - the worker side holds each finished blend's last token (`LastTokens`, from
    `context.ContextBuilder.build`) and tells the scheduler side which it holds;
  - the scheduler side names a step's requests (`KVCraftMetadata.last_tokens`,
    `scheduler.SchedulerSide._last_tokens`) when every token the step schedules is the last
    prompt token of a request whose blend left one, no two alike in position and token, and
    reports vLLM as computing none of those requests' tokens;
  - in that step kvcraft's model class (`model.KVCraft...ForCausalLM.forward`, `answer`) writes
    each layer's K/V of those tokens at the slots vLLM's attention layers would write them (the
    forward context's slot mapping, the backend's `do_kv_cache_update`), hands each layer to
    the connector's `save_kv_layer` as vLLM's attention layers do, and returns their final
    hidden states through the model's final norm, which vLLM's logits and sampler take as
    they take its own.

So the first token is the blend's (the reference engine's, on the same rows) and decoding
attends to the K/V the blend computed. Any other step runs vLLM's forward pass as always: one
that also holds other tokens (other requests', a chunked prefill's), tensor parallel > 1 (each
rank would have to answer alike; not built), vLLM replaying full CUDA graphs (the replay never
calls the model class's forward: the connector names no step then), a blend served by full
prefill (the reuse gate). Should a named step still not match what is held (its tokens padded,
say), vLLM computes it, the counter `last_token_misses` counts it and the log says so once. A
held token is let go when its step is answered or its request finishes.
"""

from __future__ import annotations

import logging
import threading
from dataclasses import dataclass
from typing import Any, Iterable, Sequence

import torch
from torch import Tensor

log = logging.getLogger("kvcraft.vllm")


@dataclass(frozen=True)
class LastToken:
    position: int
    token: int
    hidden: Tensor  # [d] final hidden state, before the model's final norm
    k: Tensor  # [L, Hkv, D] K after RoPE, every layer
    v: Tensor  # [L, Hkv, D]

    @staticmethod
    def of(prompt: Sequence[int], kv: list[tuple[Tensor, Tensor]], hidden: Tensor) -> "LastToken":
        """The last token of `prompt` from a blend's merged cache `kv` (per layer [Hkv, N, D])."""
        n = len(prompt)
        return LastToken(n - 1, int(prompt[-1]), hidden, torch.stack([k[:, n - 1] for k, _ in kv]),
                         torch.stack([v[:, n - 1] for _, v in kv]))


class LastTokens:
    """Finished blends' last tokens, by request: held from the blend's end until a step answers
    them (`take`) or the request finishes (`drop`); the requests added since the scheduler side
    last heard (`take_ready`: it lists a step's last tokens only where every one is held)."""

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._held: dict[str, LastToken] = {}
        self._ready: set[str] = set()
        self.missed_logged = False

    def add(self, req_id: str, last: LastToken) -> None:
        with self._lock:
            self._held[req_id] = last
            self._ready.add(req_id)

    def take_ready(self) -> set[str]:
        with self._lock:
            out, self._ready = self._ready, set()
        return out

    def drop(self, req_ids: Iterable[str]) -> None:
        with self._lock:
            for r in req_ids:
                self._held.pop(r, None)
                self._ready.discard(r)

    def take(self, req_ids: Sequence[str], input_ids: Tensor, positions: Tensor) -> list[LastToken] | str:
        """The last tokens of `req_ids` (every request of the step, one token each) in the order
        of the step's tokens, no longer held; or why not (the step's tokens are not exactly those)."""
        with self._lock:
            lasts = [self._held.get(r) for r in req_ids]
        if not lasts or any(x is None for x in lasts):
            return "a request of the step holds no finished blend's last token"
        if input_ids.shape != positions.shape or input_ids.shape != (len(lasts),):
            return f"the step has {input_ids.shape[0]} tokens for {len(lasts)} requests"
        by_place = {(x.position, x.token): x for x in lasts}
        got = [by_place.get(place) for place in zip(positions.tolist(), input_ids.tolist())]
        if len(by_place) < len(lasts) or any(x is None for x in got) or len({id(x) for x in got}) < len(got):
            return "the step's positions and tokens are not the blends' last tokens"
        self.drop(req_ids)
        return got  # type: ignore[return-value]


def answer(model: Any, input_ids: Tensor | None, positions: Tensor | None) -> Tensor | None:
    """The step's final hidden states [T, d] where the blends answer its every token (the module
    docstring), their K/V written into vLLM's cache; None: vLLM runs its forward pass."""
    from vllm.distributed.kv_transfer import get_kv_transfer_group, has_kv_transfer_group
    from vllm.forward_context import get_forward_context

    if not has_kv_transfer_group():
        return None
    conn = get_kv_transfer_group()
    worker = getattr(conn, "worker", None)
    context = getattr(worker, "context", None)
    if context is None or not conn.has_connector_metadata():
        return None
    meta = conn._meta()
    if not meta.last_tokens:
        return None
    slots = get_forward_context().slot_mapping
    if input_ids is None or positions is None or positions.dim() != 1:
        lasts: list[LastToken] | str = "the step's tokens are not token ids at flat positions"
    elif not isinstance(slots, dict):
        lasts = "the step's slot mapping is not one per layer"
    else:
        lasts = context.last_tokens.take(meta.last_tokens, input_ids, positions)
    if isinstance(lasts, str):  # the scheduler side counted them as answered: say it was not so
        worker.metrics.add(last_token_misses=len(meta.last_tokens))
        if not context.last_tokens.missed_logged:
            context.last_tokens.missed_logged = True
            log.warning("kvcraft: vLLM computes the last prompt tokens of blended requests %s (%s); their "
                        "reports count them as kvcraft's (counter last_token_misses)",
                        ", ".join(meta.last_tokens), lasts)
        return None
    t = len(lasts)
    names = worker.layer_names
    dtype, device = model.model.embed_tokens.weight.dtype, input_ids.device
    k = torch.stack([x.k for x in lasts], 1).to(device=device, dtype=dtype)  # [L, T, Hkv, D]
    v = torch.stack([x.v for x in lasts], 1).to(device=device, dtype=dtype)
    for i, (name, layer) in enumerate(zip(names, context.attention_layers(names))):
        layer.impl.do_kv_cache_update(layer, k[i], v[i], layer.kv_cache, slots[name][:t])
        worker.save_layer(meta, name)
    worker.metrics.add(answered_last_tokens=t)
    return model.model.norm(torch.stack([x.hidden for x in lasts]).to(device=device, dtype=dtype))


__all__ = ["LastToken", "LastTokens", "answer"]
