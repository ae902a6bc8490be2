"""An OpenAI-style RAG endpoint: CRAFT front -> vLLM with the kvcraft connector.

    kvcraft serve &                                    # the kvcraft sidecar, 127.0.0.1:50051
    python examples/vllm_rag_server.py --model /path/to/hf-model --port 8000

    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' -d '{
      "model": "rag", "max_tokens": 64,
      "messages": [{"role": "user", "content": "Who wrote the report?"}],
      "documents": ["<retrieved chunk 1>", "<retrieved chunk 2>"],
      "conversation_id": "user-42"}'

`documents` (retriever order) and `conversation_id` are this server's extensions of the
OpenAI request (send them with `extra_body=` from the openai client). The retriever stays
in the application; this server only orders, dedups and serves.

Blending (docs/vllm.md, "Blending"): `--blend-policy cacheblend` (or `cachecraft`,
`naive`, `prefix`, `full`) has kvcraft build the documents' KV from stored chunks
wherever they sit in the prompt, with that reuse policy; `--blend-option ratio=0.15`
sets a policy option (repeatable, values read as JSON). Without it (`off`, the
default) only vLLM's prefix blocks are kept in kvcraft. `--no-local` reads stored KV
(prefix blocks and blended chunks) over gRPC instead of the service's shared memory. The first turn of a
conversation is blended; later turns start with the conversation so far, which vLLM's
prefix cache holds, and are sent without chunk boundaries. Each response's
`kvcraft.blend` is the connector's report of the request (`blended`, `reused_chunks`:
chunks whose stored KV was used, 0 with policy `full`, `fallback`, ...).

Conversations: the front drops a document that an earlier turn of the same
conversation already sent (CRAFT §4.3), so the server keeps each conversation's tokens
so far (its prompts and answers, in memory, the last `--max-conversations`), and a later
turn's prompt is that history + the new documents + the new question. The model thus
still sees every document of the conversation, and the history is a prefix vLLM's cache
(and kvcraft's blocks) already hold. Only the last message of `messages` is read; a
request without `conversation_id` is a conversation of its own.
"""

import argparse
import contextlib
import json
import threading
import time
import uuid
from collections import OrderedDict

from pydantic import BaseModel


class Message(BaseModel):
    role: str
    content: str


class ChatRequest(BaseModel):
    model: str = "rag"
    messages: list[Message]
    documents: list[str] = []
    conversation_id: str = ""
    max_tokens: int = 256
    temperature: float = 0.0


class Conversations:
    """conversation id -> token ids of the conversation so far (prompts and answers), LRU."""

    def __init__(self, max_conversations: int) -> None:
        self._max = max_conversations
        self._tokens: OrderedDict[str, list[int]] = OrderedDict()
        self._lock = threading.Lock()

    def get(self, conv: str) -> list[int]:
        with self._lock:
            return list(self._tokens.get(conv, []))

    def put(self, conv: str, tokens: list[int]) -> None:
        with self._lock:
            self._tokens[conv] = tokens
            self._tokens.move_to_end(conv)
            while len(self._tokens) > self._max:
                self._tokens.popitem(last=False)


def connector_args(kvcraft: str, blend_policy: str = "off", blend_options: dict | None = None,
                   local: bool = True) -> dict:
    """The engine arguments that plug in kvcraft: the connector (prefix blocks always;
    with a blend policy, the documents' KV built from stored chunks) and, to blend, the
    model class that keeps a handle on the weights (docs/vllm.md, "Blending").
    local=False: stored KV over gRPC even when the service runs on this host."""
    from engine_adapter.vllm import kv_transfer_config

    extra = {} if local else {"local": False}
    if blend_policy == "off":
        return {"kv_transfer_config": kv_transfer_config(kvcraft, **extra)}
    return {"kv_transfer_config": kv_transfer_config(kvcraft, blend_policy=blend_policy,
                                                     blend_options=dict(blend_options or {}), **extra),
            "hf_overrides": {"architectures": ["KVCraftLlamaForCausalLM"]}}


def blend_params(blending: bool, history: list[int], prompt) -> dict | None:  # noqa: ANN001 - rag_front.FrontPrompt
    """The request's `kv_transfer_params`: the front's chunk boundaries on a conversation's
    first turn when blending; None otherwise (a later turn's prompt starts with the
    conversation so far, which has no chunk boundaries and is in vLLM's prefix cache)."""
    return prompt.blend_params() if blending and not history else None


def parse_options(pairs: list[str]) -> dict:
    """`KEY=VALUE` pairs (VALUE read as JSON, else kept as a string) -> policy options."""
    out = {}
    for pair in pairs:
        key, sep, raw = pair.partition("=")
        if not sep or not key:
            raise ValueError(f"--blend-option {pair!r}: expected KEY=VALUE, e.g. ratio=0.15")
        try:
            out[key] = json.loads(raw)
        except json.JSONDecodeError:
            out[key] = raw
    return out


def build_app(model: str, kvcraft: str, block_size: int = 32, max_conversations: int = 10_000,
              engine_args: dict | None = None, blend_policy: str = "off", blend_options: dict | None = None,
              local: bool = True):
    from fastapi import FastAPI, HTTPException
    from transformers import AutoTokenizer
    from vllm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from kvcraft.keys import ModelSpec
    from kvclient.rag_front import RAGFront

    tok = AutoTokenizer.from_pretrained(model)
    kv = connector_args(kvcraft, blend_policy, blend_options, local)
    kv["kv_transfer_config"] = KVTransferConfig(**kv["kv_transfer_config"])
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=model, block_size=block_size, enable_prefix_caching=True, **kv, **(engine_args or {})))
    preamble = tok.encode("Answer from the documents below.\n", add_special_tokens=True)
    front = RAGFront(kvcraft, ModelSpec(f"rag-front/{model}", 0, 0, 0, "none").fingerprint(),
                     encode=lambda s: tok.encode(s + "\n\n", add_special_tokens=False), preamble=preamble)
    conversations = Conversations(max_conversations)
    front_lock = threading.Lock()  # RAGFront is not thread-safe

    @contextlib.asynccontextmanager
    async def lifespan(_app: FastAPI):  # noqa: ANN202
        yield
        # On SIGTERM / Ctrl-C: stop vLLM's engine process too (else it outlives this
        # server, holding its memory), and close the front's channel.
        engine.shutdown()
        front.close()

    app = FastAPI(lifespan=lifespan)

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest) -> dict:
        if not req.messages:
            raise HTTPException(status_code=400, detail="messages is empty: the last message is the question")
        conv = req.conversation_id or f"single-{uuid.uuid4().hex}"
        question = tok.encode("Question: " + req.messages[-1].content + "\nAnswer:", add_special_tokens=False)
        history = conversations.get(conv)
        with front_lock:  # one Plan RPC, bounded by the front's timeout; it never raises
            p = front.build(conv, req.documents, question)
        # the first turn's prompt starts with the preamble; later turns continue the history
        prompt = history + p.token_ids[len(front.preamble):] if history else p.token_ids
        blend = blend_params(blend_policy != "off", history, p)
        params = SamplingParams(temperature=req.temperature, max_tokens=req.max_tokens,
                                extra_args={"kv_transfer_params": blend} if blend else None)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        final = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=prompt), params, rid):
            final = out
        if final is None:
            raise HTTPException(status_code=503, detail="the engine returned no output")
        answer = final.outputs[0]
        conversations.put(conv, prompt + list(answer.token_ids))
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": req.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": answer.text},
                             "finish_reason": answer.finish_reason}],
                "usage": {"prompt_tokens": len(prompt), "completion_tokens": len(answer.token_ids),
                          "total_tokens": len(prompt) + len(answer.token_ids),
                          "prompt_tokens_details": {"cached_tokens": int(final.num_cached_tokens or 0)}},
                "kvcraft": {"conversation_id": conv, "order": p.order, "dropped": p.dropped,
                            "planned": p.planned, "history_tokens": len(history),
                            "blend": (getattr(final, "kv_transfer_params", None) or {}).get("kvcraft")}}

    return app


def main() -> None:
    import uvicorn

    from engine_adapter.policy import POLICIES

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--kvcraft", default="127.0.0.1:50051", help="address of `kvcraft serve`")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-conversations", type=int, default=10_000)
    ap.add_argument("--blend-policy", default="off", choices=("off", *POLICIES),
                    help="blend the documents' stored KV with this reuse policy (docs/vllm.md, Blending)")
    ap.add_argument("--blend-option", action="append", default=[], metavar="KEY=VALUE",
                    help="an option of the blend policy, e.g. ratio=0.15 (cacheblend); repeatable")
    ap.add_argument("--no-local", dest="local", action="store_false",
                    help="read stored KV over gRPC, not from the service's shared memory")
    ap.add_argument("--enforce-eager", action="store_true",
                    help="run the model eagerly, without torch.compile (vLLM's option): a shorter start")
    a = ap.parse_args()
    try:
        options = parse_options(a.blend_option)
    except ValueError as e:
        ap.error(str(e))
    extra = {"max_model_len": a.max_model_len} if a.max_model_len else {}
    if a.enforce_eager:
        extra["enforce_eager"] = True
    uvicorn.run(build_app(a.model, a.kvcraft, a.block_size, a.max_conversations, extra, a.blend_policy, options,
                          a.local), host=a.host, port=a.port)


if __name__ == "__main__":
    main()
