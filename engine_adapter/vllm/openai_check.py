"""kv_transfer_params["kvcraft"] checked in front of vLLM's OpenAI server: a bad one is
answered 400 with a message, before vLLM starts the request.

    python -m vllm.entrypoints.openai.api_server ... \\
        --middleware engine_adapter.vllm.openai_check.KVCraftParamsCheck

Why a middleware: the connector runs in vLLM's engine, once the server has accepted the
request; all it can give a request is KV and the dict `request_finished` returns (the
report), and a failed request answers 500, never 400 (docs/vllm.md "The report over
HTTP: streaming, several prompts, bad parameters"). `--middleware` is vLLM's own option
for adding ASGI middleware to its server, so this needs no change to vLLM.

What it refuses (the same checks as the connector, `blend_request.check_ask`):
- a `kvcraft` value that is not a mapping, unknown keys, chunks that are not positive
  token counts, an unknown policy or bad options for a policy the request names;
- chunks that cover the whole prompt, when the prompt is token ids (`/v1/completions`
  with `prompt: [ids]`); a text or chat prompt's length is known only after vLLM
  tokenizes it, so that check stays with the connector (warning, counter, report);
- `/v1/completions` with several prompts: vLLM hands every prompt of a request the same
  kv_transfer_params and returns only the first prompt's report, so per-prompt
  boundaries would be reported for the first prompt only.

Anything else (no `kvcraft` key, a body that is not JSON, other paths) passes untouched.
vLLM adds `--middleware` outermost, so this runs before its API-key check: a bad
`kvcraft` value is answered 400 before the key is looked at (neither reaches the engine).
"""

from __future__ import annotations

import json
from typing import Any, Awaitable, Callable

from engine_adapter.vllm.blend_request import check_ask

CHECKED_PATHS = ("/v1/completions", "/v1/chat/completions", "/v1/responses")

Scope = dict[str, Any]
Message = dict[str, Any]
Receive = Callable[[], Awaitable[Message]]
Send = Callable[[Message], Awaitable[None]]


def problem(path: str, body: Any) -> str | None:
    """Why the request's kv_transfer_params["kvcraft"] is refused, or None."""
    if not isinstance(body, dict):
        return None
    params = body.get("kv_transfer_params")
    if not isinstance(params, dict) or "kvcraft" not in params:
        return None
    prompt_tokens = None
    if path == "/v1/completions":
        prompts = prompt_list(body.get("prompt"))
        if len(prompts) > 1:
            return (f"kv_transfer_params.kvcraft describes one prompt's chunks; this request has "
                    f"{len(prompts)} prompts: send one request per prompt")
        if prompts and isinstance(prompts[0], list):
            prompt_tokens = len(prompts[0])
    try:
        check_ask(params["kvcraft"], prompt_tokens)
    except ValueError as e:
        return f"kv_transfer_params.kvcraft: {e}"
    return None


def prompt_list(prompt: Any) -> list:
    """The completions API's prompt as a list of prompts (text or token-id lists)."""
    if isinstance(prompt, str):
        return [prompt]
    if isinstance(prompt, list) and prompt and all(isinstance(t, int) for t in prompt):
        return [prompt]
    return list(prompt) if isinstance(prompt, list) else []


class KVCraftParamsCheck:
    """ASGI middleware (vLLM's `--middleware`): 400 for a bad kv_transfer_params["kvcraft"]."""

    def __init__(self, app: Callable[[Scope, Receive, Send], Awaitable[None]]) -> None:
        self.app = app

    async def __call__(self, scope: Scope, receive: Receive, send: Send) -> None:
        if scope["type"] != "http" or scope.get("method") != "POST" or scope.get("path") not in CHECKED_PATHS:
            await self.app(scope, receive, send)
            return
        chunks, more = [], True
        while more:  # the whole body: vLLM reads it whole anyway
            message = await receive()
            if message["type"] != "http.request":  # the client went away
                await self.app(scope, _replay([], message, receive), send)
                return
            chunks.append(message.get("body", b""))
            more = message.get("more_body", False)
        body = b"".join(chunks)
        try:
            why = problem(scope["path"], json.loads(body))
        except ValueError:  # not JSON: vLLM answers that itself
            why = None
        if why is None:
            await self.app(scope, _replay([body], None, receive), send)
            return
        payload = json.dumps({"error": {"message": why, "type": "BadRequestError",
                                        "param": "kv_transfer_params.kvcraft", "code": 400}}).encode()
        await send({"type": "http.response.start", "status": 400,
                    "headers": [(b"content-type", b"application/json"),
                                (b"content-length", str(len(payload)).encode())]})
        await send({"type": "http.response.body", "body": payload})


def _replay(bodies: list[bytes], last: Message | None, receive: Receive) -> Receive:
    """A receive that hands the app the body already read, then the client's own messages
    (vLLM's streaming responses watch them for a disconnect)."""
    queue: list[Message] = [{"type": "http.request", "body": b, "more_body": False} for b in bodies]
    if last is not None:
        queue.append(last)

    async def replayed() -> Message:
        return queue.pop(0) if queue else await receive()

    return replayed
