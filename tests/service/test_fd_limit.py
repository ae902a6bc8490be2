"""A service out of file descriptors (its RLIMIT_NOFILE reached by client connections, as a
burst of engines or a client leaking channels does), for real: reads of variants on disk answer
UNAVAILABLE (retry) and lose nothing, where a failed open of a payload file once dropped the
variant as unreadable; once connections close, every variant reads back bit for bit."""

from __future__ import annotations

import os
import resource
import time

import grpc
import torch

from kvclient.client import KVClient
from kvclient.errors import UnavailableError
from kvcraft.keys import ModelSpec
from kvcraft.v1 import kvcraft_pb2 as pb
from kvcraft.v1 import kvcraft_pb2_grpc as pb_grpc
from kvservice.launcher import ServiceProcess

MODEL = ModelSpec("fd-limit", num_layers=2, num_kv_heads=1, head_dim=16, dtype="float32").fingerprint()


def _layers(i: int) -> list[tuple[torch.Tensor, torch.Tensor]]:
    return [(torch.full((1, 3, 16), float(i)), torch.full((1, 3, 16), -float(i)))] * 2


def _fds(pid: int) -> int:
    return len(os.listdir(f"/proc/{pid}/fd"))


def test_out_of_file_descriptors_reads_answer_unavailable_and_lose_no_variant(tmp_path):
    server = ServiceProcess(tmp_path / "data", host_budget_bytes=1).start()  # no host tier: reads open payload files
    channels: list[grpc.Channel] = []
    try:
        pid = server.proc.pid
        with KVClient(server.address, local_store=False, timeout=20) as c:
            keys = {i: c.store(MODEL, [i, i + 1, i + 2], _layers(i)).chunk_key for i in range(5)}
            idle = _fds(pid)
            resource.prlimit(pid, resource.RLIMIT_NOFILE, (idle + 3, idle + 3))
            for _ in range(20):  # connections, each the service's descriptor, until it has none left
                ch = grpc.insecure_channel(server.address, options=[("grpc.use_local_subchannel_pool", 1)])
                channels.append(ch)
                try:
                    pb_grpc.AdminStub(ch).Stats(pb.StatsRequest(), timeout=2)
                except grpc.RpcError:
                    break
            refused = 0
            for key in keys.values():
                try:
                    c.fetch(key)
                except UnavailableError as e:
                    assert "Too many open files" in e.message and "retry" in e.message
                    refused += 1
            assert refused, "the service never ran out of descriptors: nothing was tested"
            for ch in channels:
                ch.close()
            deadline = time.monotonic() + 20
            while _fds(pid) > idle and time.monotonic() < deadline:  # the service closes their sockets
                time.sleep(0.05)
            for i, key in keys.items():
                assert all(bool((k == i).all()) and bool((v == -i).all()) for k, v in c.fetch(key)), i
        log = server.log()
        assert "dropping variant" not in log and "Traceback" not in log, log[-3000:]
    finally:
        for ch in channels:
            ch.close()
        server.close()
