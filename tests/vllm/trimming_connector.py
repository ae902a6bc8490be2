"""A KVCraftConnector behind which vLLM accepts fewer tokens than kvcraft offers.

vLLM trims an external offer in some cases (a local hit with a partial tail, a replay
window; vllm/v1/core/sched/scheduler.py); with a plain Llama those paths do not run, so
this subclass plays vLLM's part: it hands vLLM a smaller count than the connector
offered, and vLLM then calls update_state_after_alloc with that count, exactly as after a
trim. The trim depends on the prompt: 16 tokens (a partly accepted block), 48 (one block
fewer, the next partly) or none.
"""

from __future__ import annotations

from engine_adapter.vllm.connector import KVCraftConnector


class TrimmingConnector(KVCraftConnector):
    def get_num_new_matched_tokens(self, request, num_computed_tokens):  # noqa: ANN001 - vLLM's signature
        n, load_async = super().get_num_new_matched_tokens(request, num_computed_tokens)
        if not n:
            return n, load_async
        trim = (16, 48, 0)[request.prompt_token_ids[0] % 3]
        n = max(0, n - trim)
        return n, load_async and n > 0
