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


def build_app(model: str, kvcraft: str, block_size: int = 32, max_conversations: int = 10_000,
              engine_args: dict | None = None):
    from fastapi import FastAPI, HTTPException
    from transformers import AutoTokenizer
    from vllm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from engine_adapter.vllm import kv_transfer_config
    from kvcraft.keys import ModelSpec
    from kvclient.rag_front import RAGFront

    tok = AutoTokenizer.from_pretrained(model)
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=model, block_size=block_size, enable_prefix_caching=True,
        kv_transfer_config=KVTransferConfig(**kv_transfer_config(kvcraft)), **(engine_args or {})))
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
        params = SamplingParams(temperature=req.temperature, max_tokens=req.max_tokens)
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
                            "planned": p.planned, "history_tokens": len(history)}}

    return app


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--model", required=True)
    ap.add_argument("--kvcraft", default="127.0.0.1:50051", help="address of `kvcraft serve`")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    ap.add_argument("--block-size", type=int, default=32)
    ap.add_argument("--max-model-len", type=int, default=None)
    ap.add_argument("--max-conversations", type=int, default=10_000)
    a = ap.parse_args()
    extra = {"max_model_len": a.max_model_len} if a.max_model_len else {}
    uvicorn.run(build_app(a.model, a.kvcraft, a.block_size, a.max_conversations, extra), host=a.host, port=a.port)


if __name__ == "__main__":
    main()
