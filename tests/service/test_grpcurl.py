"""Admins use grpcurl with no proto files: reflection, health, Admin/Stats as JSON."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
import uuid
from pathlib import Path

import torch

from kvclient.client import KVClient
from kvcraft.keys import ModelSpec


def grpcurl(*args: str) -> str:
    exe = shutil.which("grpcurl") or str(Path(sys.executable).parent / "grpcurl")
    out = subprocess.run([exe, "-plaintext", *args], capture_output=True, text=True, timeout=60)
    assert out.returncode == 0, out.stderr
    return out.stdout


def test_grpcurl_lists_services_checks_health_and_reads_stats(kvserver):
    services = grpcurl(kvserver.address, "list").split()
    assert "kvcraft.v1.KVCache" in services and "kvcraft.v1.Admin" in services
    assert "grpc.health.v1.Health" in services

    health = json.loads(grpcurl(kvserver.address, "grpc.health.v1.Health/Check"))
    assert health["status"] == "SERVING"

    model = ModelSpec("m", 2, 1, 4, "float32").fingerprint()
    with KVClient(kvserver.address) as c:
        for n in range(3):
            c.store(model, [n, n + 1], [(torch.zeros(1, 2, 4), torch.ones(1, 2, 4))] * 2)
    stats = json.loads(grpcurl(kvserver.address, "kvcraft.v1.Admin/Stats"))
    assert stats["chunks"] == "3"  # proto3 JSON writes uint64 as a string
    assert {t["name"] for t in stats["tiers"]} == {"host", "disk"}

    described = grpcurl(kvserver.address, "describe", "kvcraft.v1.KVCache")
    assert "rpc FetchLayers" in described


def test_kvcraft_admin_prints_the_same_json_as_grpcurl(kvserver):
    model = ModelSpec("m", 2, 1, 4, "float32").fingerprint()
    with KVClient(kvserver.address) as c:
        key = c.store(model, [7, 8], [(torch.zeros(1, 2, 4), torch.ones(1, 2, 4))] * 2).chunk_key

    def admin(*args: str) -> object:
        out = subprocess.run([sys.executable, "-m", "kvcli.main", "admin", "--address", kvserver.address, *args],
                             capture_output=True, text=True, timeout=60)
        assert out.returncode == 0, out.stderr
        return json.loads(out.stdout)

    assert admin("stats") == json.loads(grpcurl(kvserver.address, "kvcraft.v1.Admin/Stats"))
    assert admin("list") == json.loads(grpcurl(kvserver.address, "kvcraft.v1.Admin/ListChunks"))
    by_grpcurl = json.loads(grpcurl("-d", json.dumps({"chunk_key": key}), kvserver.address,
                                    "kvcraft.v1.Admin/GetChunk"))
    assert admin("get", key) == by_grpcurl["variants"]
    assert "layer_checksums" in by_grpcurl["variants"][0]  # the proto's names, not camelCase


def test_grpcurl_plans_over_the_stream_as_docs_show(shared_server, request):
    """docs/operations.md's PlanStream command: one answer per request, in order, a bad
    request answered with its status while the next is planned."""
    model = ModelSpec(f"m-{request.node.name}-{uuid.uuid4().hex}", 2, 1, 4, "float32").fingerprint()  # chunks of its own
    requests = [{"model_id": model, "chunks": [{"token_ids": [1, 2, 3]}]}, {"model_id": "bad"},
                {"model_id": model, "chunks": [{"token_ids": [4, 5]}], "question_tokens": 3}]
    out = grpcurl("-d", " ".join(json.dumps(r) for r in requests), shared_server.address,
                  "kvcraft.v1.KVCache/PlanStream")
    answers = [json.loads(a) for a in out.replace("}\n{", "}\x00{").split("\x00")]
    assert [list(a) for a in answers] == [["plan"], ["error"], ["plan"]]
    assert answers[1]["error"]["code"] == 3 and "model_id" in answers[1]["error"]["message"]
    assert answers[2]["plan"]["chunks"][0]["source"] == "FRESH"
