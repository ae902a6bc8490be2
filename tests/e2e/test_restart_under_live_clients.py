"""A service restarted on the same data dir and port under a live client: the client's
same-host reads (shared memory) must come from the new service's memory, never from a
mapping of the old one. Each case compares the live client's blended prefill after the
restart, bit for bit, with its own before the restart and with a fresh client's."""

from __future__ import annotations

from pathlib import Path

import pytest
import torch

from engine_adapter import LlamaEngine, Policy, ReuseGate
from engine_adapter.rag import RAGAdapter
from kvclient.client import KVClient
from kvservice.launcher import ServiceProcess
from kvservice.segments import segment_name

ENGINE = LlamaEngine.random("tiny", seed=0)
QUESTION = [7, 11, 13, 17, 19]


def chunks(seed: int, n: int = 4, length: int = 20) -> list[list[int]]:
    g = torch.Generator().manual_seed(seed)
    return [torch.randint(0, 256, (length,), generator=g).tolist() for _ in range(n)]


def segments_of(data_dir) -> list[str]:
    prefix = segment_name(data_dir, "").rstrip("-")
    return [p.name for p in Path("/dev/shm").glob(prefix + "*")]


def naive(client: KVClient, local: bool) -> RAGAdapter:
    return RAGAdapter(ENGINE, client, Policy("naive"), gate=ReuseGate(), store_back=False, local=local)


def reused_prefill(adapter: RAGAdapter, order: list[list[int]]):
    """The first Plan after a restart may meet the broken stream and fall back to full
    prefill (right, but no reuse to check): the next one plans again."""
    for _ in range(2):
        result, report = adapter.prefill(order, QUESTION, reorder=False)
        if report.reused_chunks:
            return result, report
    raise AssertionError(f"no reuse after the restart: {report}")


@pytest.mark.parametrize("how", ["SIGTERM", "SIGKILL"])
def test_live_clients_local_reads_after_a_restart_equal_a_fresh_clients(tmp_path, how):
    cs = chunks(1)
    server = ServiceProcess(tmp_path / "data").start()
    try:
        with KVClient(server.address) as live:
            warm = RAGAdapter(ENGINE, live, Policy("full"), gate=ReuseGate())
            warm.prefill(cs, QUESTION, reorder=False)
            warm.flush()
            adapter = naive(live, local=True)
            order = [cs[1], cs[3], cs[0], cs[2]]
            reused_prefill(adapter, [cs[2], cs[0], cs[3], cs[1]])  # maps the service's memory
            before, report = reused_prefill(adapter, order)
            assert report.reused_chunks == 4
            server.restart(crash=how == "SIGKILL")
            # another order first: the new service places the variants at other offsets
            reused_prefill(adapter, [cs[3], cs[2], cs[1], cs[0]])
            after, report = reused_prefill(adapter, order)
            assert report.reused_chunks == 4
            with KVClient(server.address) as fresh:
                ref, ref_report = reused_prefill(naive(fresh, local=True), order)
            assert ref_report.reused_chunks == 4
            assert torch.equal(after.logits, ref.logits)
            assert torch.equal(after.logits, before.logits)
            # what the stopped or killed instance had in shared memory is gone
            assert len(segments_of(tmp_path / "data")) == 1
    finally:
        server.close()
