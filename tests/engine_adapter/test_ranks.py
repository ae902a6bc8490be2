"""`engine_adapter.ranks` on two real processes (torch.distributed's gloo over loopback): which KV
heads a rank holds (vLLM's split, and its replicas where KV heads are fewer than ranks), the
stored KV gathered whole again, sums and agreement; and a blend's wait for stored KV
(`merge.Merge.wait`) on ranks that did not all receive a chunk: every rank computes it."""

from __future__ import annotations

import multiprocessing as mp
import socket

import pytest
import torch

from engine_adapter.ranks import RanksDiverged, TensorRanks

SIZE = 2

pytestmark = pytest.mark.slow  # over ~10 s (two processes importing torch): after the inner loop


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@pytest.fixture(scope="module")
def ranks_ran() -> dict:
    """What each of the checks below returned on each rank, from one run of SIZE processes."""
    got = _on_ranks(_checks)
    return {name: [g[name] for g in got] for name in got[0]}


def _checks(ranks: TensorRanks) -> dict:
    return {"heads": _heads_and_gather(ranks), "reductions": _reductions(ranks), "wait": _wait(ranks)}


def _on_ranks(fn) -> list:
    """fn(ranks) on SIZE processes of one gloo group; each rank's return value (plain Python:
    a tensor would be shared through a file its process takes with it)."""
    ctx = mp.get_context("spawn")
    port, results = _free_port(), ctx.Queue()
    procs = [ctx.Process(target=_rank, args=(r, port, results, fn)) for r in range(SIZE)]
    for p in procs:
        p.start()
    got = dict(results.get(timeout=120) for _ in procs)
    for p in procs:
        p.join(30)
        assert p.exitcode == 0
    return [got[r] for r in range(SIZE)]


def _rank(rank: int, port: int, results, fn) -> None:
    import torch.distributed as dist

    dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=rank, world_size=SIZE)
    try:
        results.put((rank, fn(TensorRanks(rank, SIZE, dist.group.WORLD))))
    finally:
        dist.destroy_process_group()


def _kv(total: int) -> torch.Tensor:
    return torch.arange(total * 3 * 4, dtype=torch.float32).view(total, 3, 4)  # [heads, tokens, dim]


def _heads_and_gather(ranks: TensorRanks) -> dict:
    out = {}
    for total in (4, 2, 1):  # a share each; one each; one head held by both ranks
        a, b = ranks.kv_heads(total)
        out[total] = ((a, b), ranks.gather_heads(_kv(total)[a:b], total).tolist())
    return out


def test_each_rank_holds_vllms_share_of_the_kv_heads_and_gathering_them_gives_the_whole(ranks_ran):
    got = ranks_ran["heads"]
    assert [g[4][0] for g in got] == [(0, 2), (2, 4)]
    assert [g[2][0] for g in got] == [(0, 1), (1, 2)]
    assert [g[1][0] for g in got] == [(0, 1), (0, 1)]  # vLLM replicates a KV head over tp/heads ranks
    for g in got:
        for total in (4, 2, 1):
            assert g[total][1] == _kv(total).tolist()


def _reductions(ranks: TensorRanks) -> dict:
    r = ranks.rank
    out = {"sum": ranks.sum(torch.tensor([1.0, 2.0]) * (r + 1)).tolist(),
           "mean": ranks.mean(torch.tensor([2.0 * r])).tolist(), "have": ranks.all_have([True, r == 0, False])}
    ranks.same("the rows", [5, 10])
    try:
        ranks.same("the rows", [5, 10 + r])
        out["diverged"] = ""
    except RanksDiverged as e:
        out["diverged"] = str(e)
    return out


def test_sums_means_and_agreement_are_every_ranks_and_a_divergence_fails_on_every_rank(ranks_ran):
    for g in ranks_ran["reductions"]:
        assert g["sum"] == [3.0, 6.0] and g["mean"] == [1.0]
        assert g["have"] == [True, False, False]
        assert "disagree on the rows: from [5, 10] to [5, 11]" in g["diverged"]


def _wait(ranks: TensorRanks) -> dict:
    """Merge.wait of layer 0 over two stored chunks, the second missing on rank 1 alone."""
    from engine_adapter.llama import LlamaEngine
    from engine_adapter.merge import Merge
    from engine_adapter.prompt import Layout, Segment
    from engine_adapter.selection import Pass
    from engine_adapter.source import InMemoryLayerSource

    engine = LlamaEngine.random("tiny", seed=0)
    engine.ranks = ranks
    hkv, hd = engine.cfg.num_kv_heads, engine.cfg.head_dim
    segs = [Segment((1, 2, 3), cached=True), Segment((4, 5), cached=True), Segment((6,), question=True)]
    lay = Layout.of(segs, engine.model_spec().fingerprint())
    torch.manual_seed(0)
    stored = {s: [(torch.randn(hkv, len(segs[s].tokens), hd), torch.randn(hkv, len(segs[s].tokens), hd))]
              for s in (0, 1)}
    source = InMemoryLayerSource(stored, withhold=[(1, 0)] if ranks.rank else [])
    got = Merge(engine, lay, Pass(reused=(0, 1), first=(5,)), source, 1.0).wait(0)
    a, b = ranks.kv_heads(hkv)
    return {s: all(torch.equal(x, y[a:b]) for x, y in zip(kv, stored[s][0])) for s, kv in got.items()}


def test_a_chunk_one_rank_lacks_is_absent_on_every_rank_and_each_gets_its_heads_of_the_rest(ranks_ran):
    assert ranks_ran["wait"] == [{0: True}, {0: True}]
