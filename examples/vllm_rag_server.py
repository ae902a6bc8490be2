"""An OpenAI-compatible RAG endpoint: CRAFT front -> vLLM with the kvcraft connector.

    kvcraft serve &                                    # the kvcraft sidecar, 127.0.0.1:50051
    python examples/vllm_rag_server.py --model /path/to/hf-model --port 8000

    curl localhost:8000/v1/chat/completions -H 'content-type: application/json' -d '{
      "model": "rag", "max_tokens": 64,
      "messages": [{"role": "user", "content": "Who wrote the report?"}],
      "documents": ["<retrieved chunk 1>", "<retrieved chunk 2>"],   # retriever order
      "conversation_id": "user-42"}'

`documents` and `conversation_id` are this server's extensions of the OpenAI request
(send them with `extra_body=` from the openai client). The retriever stays in the
application; this server only orders, dedups and serves.
"""

from __future__ import annotations

import argparse
import time
import uuid


def build_app(model: str, kvcraft: str, block_size: int = 32):
    from fastapi import FastAPI
    from pydantic import BaseModel
    from transformers import AutoTokenizer
    from vllm import AsyncEngineArgs, AsyncLLMEngine, SamplingParams
    from vllm.config import KVTransferConfig
    from vllm.inputs import TokensPrompt

    from engine_adapter.vllm_connector import kv_transfer_config
    from kvcraft.keys import ModelSpec
    from kvclient.rag_front import RAGFront

    tok = AutoTokenizer.from_pretrained(model)
    engine = AsyncLLMEngine.from_engine_args(AsyncEngineArgs(
        model=model, block_size=block_size, enable_prefix_caching=True,
        kv_transfer_config=KVTransferConfig(**kv_transfer_config(kvcraft))))
    preamble = tok.encode("Answer from the documents below.\n", add_special_tokens=True)
    front = RAGFront(kvcraft, ModelSpec(f"rag-front/{model}", 0, 0, 0, "none").fingerprint(),
                     encode=lambda s: tok.encode(s + "\n\n", add_special_tokens=False), preamble=preamble)

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

    app = FastAPI()

    @app.post("/v1/chat/completions")
    async def chat(req: ChatRequest) -> dict:
        question = "Question: " + req.messages[-1].content + "\nAnswer:"
        # one Plan RPC (bounded by the front's timeout); it never raises
        p = front.build(req.conversation_id, req.documents, tok.encode(question, add_special_tokens=False))
        params = SamplingParams(temperature=req.temperature, max_tokens=req.max_tokens)
        rid = f"chatcmpl-{uuid.uuid4().hex}"
        final = None
        async for out in engine.generate(TokensPrompt(prompt_token_ids=p.token_ids), params, rid):
            final = out
        text = final.outputs[0].text if final else ""
        n_out = len(final.outputs[0].token_ids) if final else 0
        return {"id": rid, "object": "chat.completion", "created": int(time.time()), "model": req.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": final.outputs[0].finish_reason if final else "error"}],
                "usage": {"prompt_tokens": len(p.token_ids), "completion_tokens": n_out,
                          "total_tokens": len(p.token_ids) + n_out,
                          "prompt_tokens_details": {"cached_tokens": int(final.num_cached_tokens or 0) if final else 0}},
                "kvcraft": {"order": p.order, "dropped": p.dropped, "planned": p.planned}}

    return app


def main() -> None:
    import uvicorn

    ap = argparse.ArgumentParser()
    ap.add_argument("--model", required=True)
    ap.add_argument("--kvcraft", default="127.0.0.1:50051")
    ap.add_argument("--host", default="127.0.0.1")
    ap.add_argument("--port", type=int, default=8000)
    a = ap.parse_args()
    uvicorn.run(build_app(a.model, a.kvcraft), host=a.host, port=a.port)


if __name__ == "__main__":
    main()
