"""`kvcraft demo`: start a service on a free loopback port and drive it end to end.

1. A random-weight tiny Llama computes the KV of a few retrieved chunks; each chunk's K
   is stored RoPE-free, layer by layer, and fetched back (bit-identical check).
2. RAG requests reuse those chunks in other orders through the engine adapter's
   blended prefill, compared with a full prefill of the same prompt.
"""

from __future__ import annotations

import tempfile
import time
from pathlib import Path


def run_demo(data_dir: str | None = None) -> int:
    import torch
    from rich.console import Console
    from rich.table import Table

    from engine_adapter import Policy, Segment, blend_prefill
    from engine_adapter.llama import LlamaEngine
    from kvclient.client import KVClient
    from kvservice.launcher import ServiceProcess

    console = Console(width=120)
    # The service runs in a second process on the same (small) machine: with torch's
    # default thread pool, every op's OpenMP region stalls whenever the service
    # takes a core, and timings turn to noise.
    torch.set_num_threads(1)
    torch.manual_seed(0)
    engine = LlamaEngine.random("tiny", seed=0)
    model_id = engine.model_spec().fingerprint()
    g = torch.Generator().manual_seed(1)
    chunks = [torch.randint(0, engine.cfg.vocab_size, (n,), generator=g) for n in (48, 64, 40, 56)]

    with tempfile.TemporaryDirectory(prefix="kvcraft-demo-") as tmp:
        root = Path(data_dir) if data_dir else Path(tmp) / "data"
        with ServiceProcess(root) as service:
            console.print(f"kvcraft service on {service.address}, data in {root}")
            table = Table(title="store -> fetch, one chunk computed alone per row")
            for col in ("chunk", "tokens", "layers", "bytes", "store ms", "fetch ms", "bit-identical"):
                table.add_column(col, justify="right")
            with KVClient(service.address) as client:
                keys = []
                for i, tokens in enumerate(chunks):
                    # The chunk computed alone: RoPE-free K/V plus its attention statistics.
                    fresh = blend_prefill(engine, [Segment(tuple(tokens.tolist()))], Policy("full"),
                                          _Nothing()).fresh[0]
                    layers = fresh.kv
                    t0 = time.perf_counter()
                    r = client.store(model_id, tokens.tolist(), layers, stats=fresh.stats)
                    t1 = time.perf_counter()
                    got = client.fetch(r.chunk_key)
                    t2 = time.perf_counter()
                    same = all(torch.equal(a, c) and torch.equal(b, d) for (a, b), (c, d) in zip(got, layers))
                    keys.append(r.chunk_key)
                    table.add_row(str(i), str(len(tokens)), str(len(layers)), f"{r.bytes_stored:,}",
                                  f"{(t1 - t0) * 1e3:.1f}", f"{(t2 - t1) * 1e3:.1f}", "yes" if same else "NO")
                    if not same:
                        console.print("[red]fetched KV differs from stored KV[/red]")
                        return 1
                console.print(table)
                _blended_requests(console, engine, client, chunks)
                stats = client.stats()
                console.print(f"service holds {stats.chunks} chunks, {stats.variants} variants; "
                              + ", ".join(f"{t.name}: {t.bytes_used:,} B" for t in stats.tiers))
            code = service.stop()
        console.print(f"service stopped cleanly (exit {code})")
    return 0 if code == 0 else 1


def _blended_requests(console, engine, client, chunks) -> None:  # noqa: ANN001 - rich/torch types
    """RAG requests over the stored chunks, in new orders, each policy beside full prefill."""
    import torch
    from rich.table import Table

    from engine_adapter import Policy, ReuseGate
    from engine_adapter.service import RAGAdapter

    question = [5, 9, 2, 7, 1, 3]
    table = Table(title="RAG requests: chunks stored above, reused in other orders")
    for col in ("request", "policy", "order (chunk #)", "reused", "recomputed rows", "fetch wait ms",
                "TTFT ms", "full ms", "logit dev"):
        table.add_column(col, justify="right")
    gate = ReuseGate()
    requests = [[2, 0, 3], [3, 1, 0, 2], [1, 2]]
    policies = [Policy("naive"), Policy("cacheblend", ratio=0.3), Policy("cachecraft", focus_window=2)]
    for n, idx in enumerate(requests):
        for policy in policies:
            adapter = RAGAdapter(engine, client, policy, gate=gate, store_back=False)
            result, rep = adapter.prefill([chunks[i].tolist() for i in idx], question)
            order_tokens = _tokens_in_order(engine, chunks, rep.order)
            t0 = time.perf_counter()
            ref = engine.prefill(torch.tensor(order_tokens + question))[0][-1]
            full_ms = (time.perf_counter() - t0) * 1e3
            diff = float((result.logits - ref).abs().max() / ref.abs().max())
            table.add_row(str(n), policy.name, " ".join(str(_index(engine, chunks, k)) for k in rep.order),
                          f"{rep.reused_chunks}/{len(idx)}", f"{rep.recomputed_rows}",
                          f"{rep.fetch_wait_s * 1e3:.1f}", f"{rep.ttft_s * 1e3:.1f}", f"{full_ms:.1f}", f"{diff:.3f}")
            adapter.close()
    console.print(table)
    console.print("naive reuses every chunk as stored; cacheblend recomputes 30% of reused tokens "
                  "(HKVD); cachecraft recomputes the planned top-N tokens per chunk. "
                  "logit dev = max |logits - full prefill| / max |full prefill|. Random weights: this "
                  "shows mechanics, not answer quality (docs/quality.md). A tiny model prefills in a few "
                  "ms, so here TTFT is the Plan and fetch round trips; reuse pays where prefill compute "
                  "dominates (long chunks, large models), see docs/benchmarks.md.")


def _index(engine, chunks, key: str) -> int:  # noqa: ANN001
    from kvcraft.keys import chunk_key

    model_id = engine.model_spec().fingerprint()
    return next(i for i, c in enumerate(chunks) if chunk_key(model_id, c.tolist()) == key)


def _tokens_in_order(engine, chunks, keys) -> list[int]:  # noqa: ANN001
    return [t for k in keys for t in chunks[_index(engine, chunks, k)].tolist()]


class _Nothing:
    """A LayerSource with nothing stored (first computation of a chunk)."""

    def wait_layer(self, layer: int, deadline: float) -> dict:
        return {}
