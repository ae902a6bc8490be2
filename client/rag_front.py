"""The CRAFT request front: the prompt a prefix-caching engine (vLLM) should see.

A RAG application calls it between its retriever and its engine:

    front = RAGFront("127.0.0.1:50051", model_id, encode=tokenizer.encode)
    p = front.build(conversation_id, retrieved_chunks, question)  # chunks in retriever order
    llm.generate(TokensPrompt(prompt_token_ids=p.token_ids), ...)

It sends the chunks to the service's Plan RPC, which drops chunks the conversation was
already sent (CRAFT §4.3) and, on a first turn, reorders the rest by how often recent
requests retrieved them (CRAFT §4.2). Popular chunks then lead the prompt, so many
more prompts share a chunk-prefix and the engine's prefix cache (and the kvcraft vLLM
connector's blocks) hit. The prompt is `preamble + chunks (planned order) + question`;
every chunk is tokenized on its own, so a chunk's tokens are the same in every prompt.

If the service does not answer within `timeout_s`, the prompt keeps the retriever order
(duplicates within the request removed) and `planned` is False: the front never fails
a request.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from dataclasses import dataclass
from typing import Callable, Sequence, Union

from kvcraft.keys import chunk_key

log = logging.getLogger("kvcraft.rag_front")

Chunk = Union[str, Sequence[int]]  # text (needs `encode`) or token ids


@dataclass(frozen=True)
class FrontPrompt:
    token_ids: list[int]       # the whole prompt: preamble + chunks + question
    order: list[str]           # chunk keys in prompt order
    dropped: list[str]         # chunk keys left out (already in the conversation)
    chunk_tokens: int          # tokens of the chunks in the prompt
    dropped_tokens: int        # tokens of the dropped chunks
    planned: bool              # False: the service did not answer, retriever order kept
    chunk_lengths: tuple[int, ...] = ()  # token count of each chunk in prompt order (the preamble first)

    def blend_params(self, policy: str | None = None, options: dict | None = None) -> dict:
        """`kv_transfer_params` asking the vLLM connector to blend this prompt's chunks
        (docs/vllm.md "Blending"); policy/options override its `blend_policy` for this request:

            SamplingParams(..., extra_args={"kv_transfer_params": p.blend_params()})"""
        ask: dict = {"chunks": list(self.chunk_lengths)}
        if policy is not None:
            ask["policy"] = policy
            ask["options"] = dict(options or {})
        return {"kvcraft": ask}


class RAGFront:
    """Builds prompts through the Plan RPC. Not thread-safe; one per serving thread."""

    def __init__(self, client: "str | object", model_id: str, *, encode: Callable[[str], list[int]] | None = None,
                 preamble: Sequence[int] = (), timeout_s: float = 0.5, max_remembered: int = 100_000) -> None:
        """`client`: a kvclient.KVClient or a service address. `model_id`: the namespace
        of the chunk keys the Plan counts (any stable id per model, e.g. a ModelSpec
        fingerprint)."""
        if isinstance(client, str):
            from kvclient.client import KVClient

            client = KVClient(client)
            self._owns_client = True
        else:
            self._owns_client = False
        self.client = client
        self.model_id = model_id
        self.encode = encode
        self.preamble = [int(t) for t in preamble]
        self.timeout_s = timeout_s
        self._tokens: OrderedDict[str, list[int]] = OrderedDict()  # chunk key -> token ids
        self._max = max_remembered
        self._down_logged = False

    def build(self, conversation_id: str, chunks: Sequence[Chunk], question: "str | Sequence[int]") -> FrontPrompt:
        toks = [self._tokenize(c) for c in chunks]
        keys = [chunk_key(self.model_id, t) for t in toks]
        by_key = dict(zip(keys, toks))
        for k, t in by_key.items():
            self._remember(k, t)
        q = self._tokenize(question)
        order, dropped, planned = self._plan(conversation_id, keys, toks, len(q))
        body = [t for k in order for t in by_key[k]]
        dropped_tokens = sum(len(by_key[k]) for k in dropped if k in by_key)
        lengths = ([len(self.preamble)] if self.preamble else []) + [len(by_key[k]) for k in order]
        return FrontPrompt(self.preamble + body + q, order, dropped, len(body), dropped_tokens, planned,
                           tuple(lengths))

    def chunk_tokens(self, key: str) -> list[int] | None:
        """Token ids of a chunk this front has seen (e.g. Plan.history)."""
        return self._tokens.get(key)

    def close(self) -> None:
        if self._owns_client:
            self.client.close()

    def _plan(self, conv: str, keys: list[str], toks: list[list[int]], q_tokens: int
              ) -> tuple[list[str], list[str], bool]:
        local = list(dict.fromkeys(keys))
        if not keys:
            return [], [], True
        old_timeout = self.client.timeout
        try:
            self.client.timeout = self.timeout_s
            plan = self.client.plan(self.model_id, [(k, len(t)) for k, t in zip(keys, toks)], q_tokens,
                                    conversation_id=conv)
        except Exception as e:  # noqa: BLE001 - the front must not fail a request
            if not self._down_logged:
                log.warning("kvcraft: Plan did not answer within %.2fs (%s); prompts keep the retriever order",
                            self.timeout_s, type(e).__name__)
                self._down_logged = True
            return local, [], False
        finally:
            self.client.timeout = old_timeout
        self._down_logged = False
        if plan.lease_id:  # the front fetches nothing: free the variants at once
            try:
                self.client.release(plan.lease_id)
            except Exception:  # noqa: BLE001 - the lease times out by itself
                pass
        order = [k for k in plan.order if k in set(keys)]
        if set(order) | set(plan.dropped) != set(keys):  # a service we do not understand: keep our order
            return local, [], False
        return order, list(plan.dropped), True

    def _tokenize(self, x: "str | Sequence[int]") -> list[int]:
        if isinstance(x, str):
            if self.encode is None:
                raise ValueError("text given but RAGFront has no encode function")
            return list(self.encode(x))
        return [int(t) for t in x]

    def _remember(self, key: str, tokens: list[int]) -> None:
        self._tokens[key] = tokens
        self._tokens.move_to_end(key)
        if len(self._tokens) > self._max:
            self._tokens.popitem(last=False)
