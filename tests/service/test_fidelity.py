"""Sampled fidelity in the service: tallies per model and policy, Wilson bounds, persistence
across restarts, the edge's checks, the metrics and `kvcraft admin fidelity`."""

from __future__ import annotations

import math
import socket
import time
import urllib.request
import uuid

import pytest
from scipy.stats import binomtest

from kvcli import main as cli
from kvclient.client import KVClient
from kvclient.errors import InvalidArgumentError
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.fidelity import FidelityBook, Sample, Tally, wilson
from kvservice.metadata import MetadataDB


@pytest.mark.parametrize("agree,samples", [(0, 1), (1, 1), (0, 12), (12, 12), (3, 7), (97, 100), (1, 300),
                                           (299, 300)])
def test_wilson_bounds_match_scipy(agree, samples):
    ci = binomtest(agree, samples).proportion_ci(confidence_level=0.95, method="wilson")
    lower, upper = wilson(agree, samples)
    assert lower == pytest.approx(ci.low, abs=1e-7) and upper == pytest.approx(ci.high, abs=1e-7)
    assert (lower == 0.0) == (agree == 0) and (upper == 1.0) == (agree == samples)


def test_wilson_without_samples_knows_nothing():
    assert wilson(0, 0) == (0.0, 1.0)


class _Db:
    def __init__(self) -> None:
        self.writes: list[list[Tally]] = []

    def load_fidelity(self) -> list[Tally]:
        return []

    def put_fidelity(self, tallies) -> None:  # noqa: ANN001
        self.writes.append(sorted(tallies, key=lambda t: t.policy))


def test_book_writes_at_most_once_a_second_and_the_rest_at_close():
    now = [100.0]
    db = _Db()
    book = FidelityBook(db, clock=lambda: now[0], every_s=3600.0)  # the timer never fires in this test
    book.observe("m" * 32, [Sample("naive", True, 0.5, 0.1)])
    book.observe("m" * 32, [Sample("naive", False, 1.5, 0.3), Sample("query", True, 0.0, 0.2)])
    assert [[(t.policy, t.samples) for t in w] for w in db.writes] == [[("naive", 1)]]
    book.close()
    assert [(t.policy, t.samples, t.top1_agree) for t in db.writes[-1]] == [("naive", 2, 1), ("query", 1, 1)]
    (naive, _) = book.tallies()
    assert naive.mean_kl == pytest.approx(1.0) and naive.mean_computed_share == pytest.approx(0.2)


def test_book_writes_a_quiet_services_samples_within_the_interval():
    db = _Db()
    book = FidelityBook(db, every_s=0.2)
    book.observe("m" * 32, [Sample("naive", True, 0.1, 0.1)])
    book.observe("m" * 32, [Sample("naive", True, 0.1, 0.1)])  # deferred: a timer writes it
    deadline = time.monotonic() + 10
    while len(db.writes) < 2 and time.monotonic() < deadline:
        time.sleep(0.05)
    assert db.writes[-1][0].samples == 2
    book.close()


def test_metadata_keeps_tallies(tmp_path):
    db = MetadataDB(tmp_path / "metadata")
    db.put_fidelity([Tally("a" * 32, "naive", 5, 3, 1.25, 0.5), Tally("a" * 32, "cacheblend", 2, 2, 0.0, 0.3)])
    db.close()
    db = MetadataDB(tmp_path / "metadata")
    try:
        got = sorted(db.load_fidelity(), key=lambda t: t.policy)
    finally:
        db.close()
    assert got == [Tally("a" * 32, "cacheblend", 2, 2, 0.0, 0.3), Tally("a" * 32, "naive", 5, 3, 1.25, 0.5)]


def _model() -> str:
    return uuid.uuid4().hex


def _plan(c: KVClient, model: str, samples: list[pb.FidelitySample]) -> None:
    c.plan(model, [[1, 2, 3, 4]], 2, timings=pb.TimingReport(fidelity=samples))


def _of(stats: pb.StatsResponse, model: str) -> dict[str, pb.FidelityStats]:
    return {f.policy: f for f in stats.fidelity if f.model_id == model}


def test_tallies_survive_restarts_and_reach_the_metrics(start_server):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_server(metrics_port=port)
    model = _model()
    with KVClient(server.address) as c:
        _plan(c, model, [pb.FidelitySample(policy="naive", top1_agree=True, kl=0.25, computed_share=0.5)])
        _plan(c, model, [pb.FidelitySample(policy="naive", top1_agree=False, kl=0.75, computed_share=0.25),
                         pb.FidelitySample(policy="query", top1_agree=True, kl=0.0, computed_share=0.125)])
    server.restart()  # SIGTERM: the close writes what the once-a-second writes had not
    with KVClient(server.address) as c:
        got = _of(c.stats(), model)
        assert (got["naive"].samples, got["naive"].top1_agree, got["query"].samples) == (2, 1, 1)
        assert got["naive"].mean_kl == pytest.approx(0.5) and got["naive"].mean_computed_share == pytest.approx(0.375)
        assert (got["naive"].agree_lower, got["naive"].agree_upper) == pytest.approx(wilson(1, 2))
        for _ in range(2):  # the first is written at once, the second within the second after it
            _plan(c, model, [pb.FidelitySample(policy="query", top1_agree=True, kl=0.0, computed_share=0.125)])
    time.sleep(1.5)  # quiet: the deferred write happens without another Plan
    server.restart(crash=True)
    with KVClient(server.address) as c:
        assert _of(c.stats(), model)["query"].samples == 3
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    assert f'kvcraft_fidelity_samples_total{{model="{model}",policy="naive"}} 2.0' in text
    lower, upper = wilson(1, 2)
    assert f'kvcraft_fidelity_top1_agreement{{bound="lower",model="{model}",policy="naive"}} {lower!r}' in text
    assert f'kvcraft_fidelity_top1_agreement{{bound="upper",model="{model}",policy="naive"}} {upper!r}' in text
    assert f'kvcraft_fidelity_mean_kl{{model="{model}",policy="naive"}} 0.5' in text


@pytest.mark.parametrize("sample,field", [
    (dict(policy="", kl=0.1, computed_share=0.1), "timings.fidelity[0].policy"),
    (dict(policy="x" * 65, kl=0.1, computed_share=0.1), "timings.fidelity[0].policy"),
    (dict(policy="naive\n", kl=0.1, computed_share=0.1), "timings.fidelity[0].policy"),
    (dict(policy="naive", kl=math.nan, computed_share=0.1), "timings.fidelity[0].kl"),
    (dict(policy="naive", kl=math.inf, computed_share=0.1), "timings.fidelity[0].kl"),
    (dict(policy="naive", kl=-0.5, computed_share=0.1), "timings.fidelity[0].kl"),
    (dict(policy="naive", kl=0.1, computed_share=4.5), "timings.fidelity[0].computed_share"),
    (dict(policy="naive", kl=0.1, computed_share=math.nan), "timings.fidelity[0].computed_share"),
])
def test_bad_samples_are_refused_naming_the_field(shared_server, sample, field):
    model = _model()
    with KVClient(shared_server.address) as c:
        with pytest.raises(InvalidArgumentError, match=field.replace("[", r"\[").replace("]", r"\]")):
            _plan(c, model, [pb.FidelitySample(**sample)])
        assert not _of(c.stats(), model)


def test_more_than_64_samples_in_a_plan_are_refused(shared_server):
    model = _model()
    with KVClient(shared_server.address) as c:
        with pytest.raises(InvalidArgumentError, match="timings.fidelity has 65 samples"):
            _plan(c, model, [pb.FidelitySample(policy="naive", kl=0.0, computed_share=0.1)] * 65)
        _plan(c, model, [pb.FidelitySample(policy="naive", kl=0.0, computed_share=0.1)] * 64)
        assert _of(c.stats(), model)["naive"].samples == 64


def test_admin_fidelity_prints_a_line_per_model_and_policy(shared_server, capsys):
    model = _model()
    with KVClient(shared_server.address) as c:
        _plan(c, model, [pb.FidelitySample(policy="cacheblend", top1_agree=a, kl=0.5, computed_share=0.2)
                         for a in (True, True, False)])
    assert cli.main(["admin", "--address", shared_server.address, "fidelity"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0].split()[:4] == ["model", "policy", "samples", "top1_agree"]
    (row,) = [line.split() for line in lines if line.startswith(model)]
    lower, upper = wilson(2, 3)
    assert row[:5] == [model, "cacheblend", "3", "2", "0.667"]
    assert " ".join(row[5:7]) == f"[{lower:.3f}, {upper:.3f}]"
