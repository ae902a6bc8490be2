"""An inference engine on a simulated host: the trained quality model behind a RAGAdapter.

Run in a host's network namespace (`ip netns exec <ns> python -m tests.cluster.engine_worker`);
reads one JSON request per line on stdin, answers one JSON line on stdout:

    {"service": "198.18.7.11:40001", "prompt": 3}   -> the prefill's answer and report
    {"service": ..., "flush": true}                  -> waits for its store-backs

Prompts are the held-out examples of the multi-hop task (kvbench.quality.data, draw 7),
each chunk in the retriever's order (reorder off), so the first request that computes a
prompt stores every chunk behind the ones before it, and a later one, on any node, can
reuse them exactly. Its adapters run the default policy with `local=True`, as an engine
beside its service would: one whose service is on another host must find out and stream.
"""

from __future__ import annotations

import json
import logging
import sys

import torch

from engine_adapter import LlamaEngine
from engine_adapter.rag import RAGAdapter
from kvbench.quality import data, modeling
from kvclient.client import KVClient
from kvcraft.keys import chunk_key

PROMPTS = 24


def main() -> None:
    logging.basicConfig(level=logging.WARNING, stream=sys.stderr, format="%(levelname)s %(name)s: %(message)s")
    torch.set_num_threads(1)
    engine = LlamaEngine.from_pretrained(modeling.MODEL_DIR)
    tok = modeling.build_tokenizer()
    prompts = [modeling.encode(tok, ex) for ex in data.examples("heldout", PROMPTS, seed=7)]
    adapters: dict[str, RAGAdapter] = {}
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        req = json.loads(line)
        service = req["service"]
        if service not in adapters:
            adapters[service] = RAGAdapter(engine, KVClient(service, timeout=30.0), local=True)
        adapter = adapters[service]
        if req.get("flush"):
            adapter.flush()
            print(json.dumps({"flushed": True}), flush=True)
            continue
        p = prompts[req["prompt"]]
        tried_local = adapter.local
        result, report = adapter.prefill(p.chunk_ids, p.question_ids, reorder=False)
        full = engine.prefill(torch.tensor(p.prompt_ids), all_logits=False)[0][-1]
        print(json.dumps({
            "answer": int(result.logits.argmax()), "full_answer": int(full.argmax()),
            "max_logit_diff": float((result.logits - full).abs().max()),
            "reused": report.reused_chunks, "fresh": report.fresh_chunks, "chunks": len(p.chunk_ids),
            "fallbacks": len(report.fallbacks), "plan_error": report.plan_error,
            "ttft_s": report.ttft_s, "chunk_keys": [chunk_key(adapter.model_id, c) for c in p.chunk_ids],
            "tried_local": tried_local, "local_after": adapter.local,
        }), flush=True)


if __name__ == "__main__":
    main()
