"""The CRAFT front hands the vLLM connector the chunk boundaries of the prompt it built
(`FrontPrompt.blend_params`), against a real service on loopback."""

from __future__ import annotations

import uuid

from kvclient.rag_front import RAGFront


def test_blend_params_name_each_chunk_of_the_prompt_in_order(shared_server):
    chunks = [[10, 11, 12], [20, 21], [30, 31, 32, 33], [20, 21]]  # one duplicate: dropped by the Plan
    model_id = uuid.uuid4().hex  # in the shared service: chunk keys and a conversation of this test's own
    front = RAGFront(shared_server.address, model_id, preamble=[1, 2], timeout_s=5.0)
    p = front.build(f"conv-1-{model_id}", chunks, [7, 8, 9])
    front.close()
    assert p.planned
    ask = p.blend_params()["kvcraft"]
    lengths = ask["chunks"]
    assert lengths[0] == 2 and sum(lengths) + 3 == len(p.token_ids)
    at, seen = 0, []
    for n in lengths:
        seen.append(p.token_ids[at:at + n])
        at += n
    assert seen[0] == [1, 2] and sorted(map(tuple, seen[1:])) == sorted({tuple(c) for c in chunks})
    assert p.token_ids[at:] == [7, 8, 9]
    assert p.blend_params("cacheblend", {"ratio": 0.3})["kvcraft"] == {
        "chunks": lengths, "policy": "cacheblend", "options": {"ratio": 0.3}}
