"""Sampled fidelity in the service: tallies per model, policy and budget, Wilson bounds, the
controller that holds the target, persistence across restarts, the edge's checks, the metrics
and `kvcraft admin fidelity`."""

from __future__ import annotations

import logging
import math
import random
import socket
import urllib.request
import uuid
from pathlib import Path

import pytest
from scipy.stats import binomtest

from kvcli import main as cli
from kvclient.client import KVClient
from kvclient.errors import InvalidArgumentError
from kvcraft.v1 import kvcraft_pb2 as pb
from kvservice.fidelity import (COLD_START, FIRST_SAMPLES, FULL, LADDER, LEAD_EDGES, MAX_GATED, MAX_MEASURING_SAMPLES,
                                MIN_LOST, MIN_VERDICT_SAMPLES, FidelityBook, Sample, Tally, wilson)
from kvservice.metadata import FIDELITY, FIDELITY_ANSWERS, FIDELITY_BLENDS, FIDELITY_FIRST, MetadataDB
from tests.conftest import wait_for


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
    wait_for(lambda: len(db.writes) >= 2, "the timer's write", 10.0)
    assert db.writes[-1][0].samples == 2
    book.close()


def test_metadata_keeps_tallies(tmp_path):
    db = MetadataDB(tmp_path / "metadata")
    kept = [Tally("a" * 32, "cacheblend", 2, 2, 0.0, 0.3), Tally("a" * 32, "naive", 5, 3, 1.25, 0.5),
            Tally("a" * 32, "query", 3, 2, 0.5, 0.2, budget=0.05, shadow_blends=3),
            Tally("a" * 32, "query", 4, 4, 0.5, 0.2, budget=0.25, answer_tokens=60, answer_agree=51),
            Tally("a" * 32, "query", 1, 0, 0.5, 0.2, budget=0.4),
            Tally("a" * 32, "query", 3, 2, 0.5, 0.2, budget=0.6, leads=(0, 2, 0, 0, 0, 0, 0, 0, 0, 1),
                  lost=(0, 1, 0, 0, 0, 0, 0, 0, 0, 0))]
    db.put_fidelity(kept)
    # records of data dirs from before answers were compared (four fields), before shadow
    # blends were counted (six) and before the leads were (seven)
    db._put("fidelity", [(b"b" * 32 + b"naive\x000.0000", FIDELITY_FIRST.pack(3, 2, 0.75, 0.25)),
                         (b"c" * 32 + b"naive\x000.0000", FIDELITY_ANSWERS.pack(3, 2, 0.75, 0.25, 16, 9)),
                         (b"d" * 32 + b"naive\x000.0000", FIDELITY_BLENDS.pack(3, 2, 0.75, 0.25, 16, 9, 1))], True)
    db.close()
    db = MetadataDB(tmp_path / "metadata")
    try:
        got = sorted(db.load_fidelity(), key=lambda t: (t.model_id, t.policy, t.budget))
    finally:
        db.close()
    assert got == [*kept, Tally("b" * 32, "naive", 3, 2, 0.75, 0.25),
                   Tally("c" * 32, "naive", 3, 2, 0.75, 0.25, answer_tokens=16, answer_agree=9),
                   Tally("d" * 32, "naive", 3, 2, 0.75, 0.25, answer_tokens=16, answer_agree=9, shadow_blends=1)]
    assert got[3].answer_agreement == pytest.approx(51 / 60) and got[0].answer_agreement is None


def _margin_by_brute_force(samples: list[Sample]) -> float:
    """The near-tie margin from its definition: the largest edge up to the least one above every
    lead a sample lost at, under which at most MAX_GATED of the leads lie, at least one lost, and at
    least MIN_LOST of them lost."""
    leads = [s.lead for s in samples if s.lead is not None]
    lost = [s.lead for s in samples if s.lead is not None and not s.top1_agree]
    if not lost:
        return 0.0
    want = min((e for e in LEAD_EDGES if e > max(lost)), default=LEAD_EDGES[-1])

    def gated(e: float) -> bool:
        under, lost_under = sum(x < e for x in leads), sum(x < e for x in lost)
        return under <= MAX_GATED * len(leads) and lost_under > 0 and lost_under >= MIN_LOST * under

    return max((e for e in LEAD_EDGES if e <= want and gated(e)), default=0.0)


@pytest.mark.parametrize("seed", range(40))
def test_the_near_tie_margin_covers_the_leads_lost_and_sends_at_most_a_fifth_to_full_prefill(seed):
    """Samples at budgets below 1 with leads (some exactly on an edge), losses likelier at small
    leads (even seeds: near ties) or as likely at any lead (odd); some without a lead, and some at
    budget 1 (exact reuse), which never count, nor do those below the budget given."""
    rng = random.Random(seed)
    book, model = FidelityBook(target=0.95, sample=0.0), "m" * 32
    samples = []
    for _ in range(rng.randrange(1, 200)):
        lead = rng.choice([rng.expovariate(0.7), rng.choice(LEAD_EDGES), None])
        lost = rng.random() < ((0.5 if lead is not None and lead < 0.6 else 0.03) if seed % 2 == 0 else 0.06)
        samples.append(Sample("query", not lost, 0.1, 0.1, rng.choice([COLD_START] * 3 + list(LADDER[:-1])), lead=lead))
    exact = [Sample("query", False, 0.1, 1.0, FULL, lead=5.0)] * rng.randrange(3)  # exact reuse: no margin
    book.observe(model, samples + exact)
    d = book.decide(model, "query", True)
    served = [s for s in samples if s.budget >= d.budget]  # a budget below loses what the given one keeps
    assert d.near_tie == pytest.approx(_margin_by_brute_force(served) if d.budget < FULL else 0.0)


def _stream(book: FidelityBook, model: str, agreement: dict[float, float], n: int, seed: int = 0,
            proven: list[bool] | None = None) -> list[float]:
    """n Plans of an adaptive engine whose requests served (or blended by a shadow) at budget
    b agree with full prefill with probability agreement[b]; a measured request's samples go
    with the next Plan, as an engine's do, with the shadow blend's when the Plan names a
    budget below. The budgets the Plans gave, in order; `proven`, if given, gets whether each
    budget given was shown held by its own samples when given."""
    rng, pending, given = random.Random(seed), [], []
    for _ in range(n):
        book.observe(model, pending)
        pending = []
        budget, sample, below, no_reuse, near_tie = book.decide(model, "query", True)
        given.append(budget)
        assert not no_reuse or (budget == FULL and not sample)
        if proven is not None:
            held = {t.budget for t in book.tallies() if t.model_id == model and t.verdict(book.target) == "held"}
            proven.append(budget in held)
        if sample:
            pending.append(Sample("query", rng.random() < agreement.get(budget, 1.0), 0.0, budget, budget))
            if below:
                assert below < budget
                pending.append(Sample("query", rng.random() < agreement[below], 0.0, below, below, shadow_blend=True))
        else:
            assert below == 0.0  # a budget below is measured only on sampled requests
    return given


def _moves(given: list[float]) -> list[tuple[float, float]]:
    return [(a, b) for a, b in zip(given, given[1:]) if a != b]


@pytest.mark.parametrize("seed", range(5))
def test_the_controller_settles_at_the_cheapest_budget_that_holds_and_stays(seed):
    """Budgets 0.15 and up agree 99%, 0.10 90%, 0.05 80%; target 0.95. The budget ends at
    0.15 and never serves 0.05 or 0.10 (measured by shadow blends alone, shown short), and
    moves at most twice per budget."""
    book = FidelityBook(target=0.95, sample=0.03, seed=seed)
    agreement = {0.05: 0.80, 0.10: 0.90, 0.15: 0.99, 0.25: 0.99, 0.40: 0.99, 0.60: 0.99}
    given = _stream(book, "m" * 32, agreement, 4000, seed)
    assert given[0] == COLD_START and given[-1] == 0.15 and not {0.05, 0.10} & set(given)
    assert len(set(given[-1500:])) == 1  # settled
    assert len(_moves(given)) <= 2 * len(LADDER)
    (choice,) = book.choices()
    assert (choice.budget, choice.state, choice.below) == (0.15, "held", 0.0)
    shadow = {t.budget: t.shadow_blends for t in book.tallies()}
    assert shadow[0.05] >= MIN_VERDICT_SAMPLES and shadow[0.10] >= MIN_VERDICT_SAMPLES and shadow[COLD_START] == 0


@pytest.mark.parametrize("seed", range(5))
def test_a_budget_below_the_cold_start_is_served_only_once_its_samples_hold_the_target(seed):
    """Agreement 96% everywhere (just above the target: verdicts take hundreds of samples)
    and a model where every budget agrees: the controller never moves to a budget below the
    cold start that its own samples do not yet show held; where everything agrees it goes to
    the least budget in one step, as soon as that budget's 73 agreeing samples put Wilson's
    lower bound at the target."""
    for agreement, n in ((0.96, 3000), (1.0, 200)):
        book, proven = FidelityBook(target=0.95, sample=0.03, seed=seed), []
        given = _stream(book, "m" * 32, dict.fromkeys(LADDER[:-1], agreement), n, seed, proven)
        moved_to = [i for i, b in enumerate(given) if b < COLD_START and (i == 0 or given[i - 1] != b)]
        assert all(proven[i] for i in moved_to)
    assert _moves(given) == [(COLD_START, LADDER[0])]
    first = given.index(LADDER[0])
    assert wilson(first, first)[0] >= 0.95 > wilson(first - 1, first - 1)[0]


@pytest.mark.parametrize("seed", range(5))
def test_a_model_reuse_cannot_serve_ends_at_exact_reuse_logged_once(seed, caplog):
    """Agreement 50% at every budget below 1, exact reuse agreeing: budget 1 within 60 Plans,
    served as exact reuse (stored KV, not `no_reuse`), its first MIN_VERDICT_SAMPLES requests
    measured, then about `sample` of them."""
    book = FidelityBook(target=0.95, sample=0.03, seed=seed)
    with caplog.at_level(logging.INFO, logger="kvcraft.fidelity"):
        given = _stream(book, "m" * 32, dict.fromkeys(LADDER[:-1], 0.5), 400, seed)
    assert FULL in given[:60] and set(given[given.index(FULL):]) == {FULL}
    assert [m for m in _moves(given)] == [(0.25, 0.40), (0.40, 0.60), (0.60, FULL)]
    warned = [r for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 1 and "exact reuse only" in warned[0].getMessage()
    (exact,) = [t for t in book.tallies() if t.budget == FULL]
    assert MIN_VERDICT_SAMPLES <= exact.samples <= MIN_VERDICT_SAMPLES + 30  # then 3% of ~350 Plans
    assert [book.decide("m" * 32, "query", True).no_reuse for _ in range(50)] == [False] * 50
    (choice,) = book.choices()
    assert (choice.budget, choice.state) == (FULL, "exact")


@pytest.mark.parametrize("seed", range(3))
def test_stored_kv_that_even_exact_reuse_disagrees_with_ends_without_reuse(seed, caplog):
    """Agreement 0 at every budget, exact reuse included (stored KV that is noise): budget 1,
    then its own samples shown short within MIN_VERDICT_SAMPLES of them: `no_reuse`, nothing
    sampled again, warned once more."""
    book = FidelityBook(target=0.95, sample=0.03, seed=seed)
    with caplog.at_level(logging.INFO, logger="kvcraft.fidelity"):
        given = _stream(book, "m" * 32, dict.fromkeys(LADDER, 0.0), 200, seed)
    (exact,) = [t for t in book.tallies() if t.budget == FULL]
    assert exact.samples == MIN_VERDICT_SAMPLES and exact.top1_agree == 0  # short at the first verdict
    assert book.decide("m" * 32, "query", True) == (FULL, False, 0.0, True, 0.0)
    (choice,) = book.choices()
    assert (choice.budget, choice.state) == (FULL, "full")
    warned = [r.getMessage() for r in caplog.records if r.levelno == logging.WARNING]
    assert len(warned) == 2 and "exact reuse only" in warned[0] and "not what this engine computes" in warned[1]
    assert given.index(FULL) < 60


def test_a_margin_learned_and_then_lost_is_logged_each_time(caplog):
    """One blend lost at a lead of 0.25 among ten: a margin of 0.3 (one in ten under it), logged
    with its value; ten more blends leading by under 0.1 put over half the leads under any
    margin that catches it: none, logged as none (not as a margin of 0)."""
    book, model = FidelityBook(target=0.95, sample=0.0), "m" * 32
    lost = Sample("query", False, 0.1, 0.1, COLD_START, lead=0.25)
    with caplog.at_level(logging.INFO, logger="kvcraft.fidelity"):
        book.observe(model, [lost] + [Sample("query", True, 0.1, 0.1, COLD_START, lead=2.5)] * 9)
        assert book.decide(model, "query", True).near_tie == pytest.approx(0.3)
        book.observe(model, [Sample("query", True, 0.1, 0.1, COLD_START, lead=0.05)] * 10)
        assert book.decide(model, "query", True).near_tie == 0.0
    said = [r.getMessage() for r in caplog.records if "near tie" in r.getMessage()]
    assert len(said) == 2 and "under 0.30 logits" in said[0] and "serves no near tie" in said[1]


def test_the_budget_a_restart_finds_is_the_one_the_samples_say(tmp_path):
    db = MetadataDB(tmp_path / "metadata")
    book = FidelityBook(db, target=0.95, sample=0.0)
    given = _stream(book, "m" * 32, dict.fromkeys(LADDER[:-1], 1.0), 1000)
    assert given[-1] == LADDER[0]  # every budget holds: down to the least
    book.close()
    db.close()
    db = MetadataDB(tmp_path / "metadata")
    try:
        again = FidelityBook(db, target=0.95, sample=0.0)
        # held: measured at the rate, 0
        assert again.decide("m" * 32, "query", True) == (LADDER[0], False, 0.0, False, 0.0)
        # another model starts cold, the least budget measured beside it
        assert again.decide("n" * 32, "query", True) == (COLD_START, True, LADDER[0], False, 0.0)
    finally:
        db.close()


def test_engines_that_keep_their_own_budget_get_none_and_their_first_requests_measured():
    book = FidelityBook(target=0.95, sample=0.0)
    assert book.decide("m" * 32, "naive", False) == (0.0, True, 0.0, False, 0.0)
    book.observe("m" * 32, [Sample("naive", True, 0.0, 0.1)] * (FIRST_SAMPLES - 1))
    assert book.decide("m" * 32, "naive", False) == (0.0, True, 0.0, False, 0.0)
    book.observe("m" * 32, [Sample("naive", True, 0.0, 0.1)])
    assert book.decide("m" * 32, "naive", False) == (0.0, False, 0.0, False, 0.0)  # rate 0 after the first ones
    assert book.choices() == []
    # no target: no budget
    assert FidelityBook(target=0.0).decide("m" * 32, "query", True) == (0.0, True, 0.0, False, 0.0)


def _model() -> str:
    return uuid.uuid4().hex


def _plan(c: KVClient, model: str, samples: list[pb.FidelitySample], **fields: object):  # noqa: ANN202
    return c.plan(model, [[1, 2, 3, 4]], 2, timings=pb.TimingReport(fidelity=samples), **fields)


def _written_samples(data_dir: Path, model: str, policy: str) -> int:
    """Samples of (model, policy)'s tally as the live service has written them to its metadata,
    read through a read-only view of it (RocksDB allows one beside the writer and replays the
    write-ahead log as it stands)."""
    from rocksdict import AccessType, Options, Rdict

    db = Rdict(str(data_dir / "metadata"), Options(raw_mode=True), access_type=AccessType.read_only(),
               column_families={cf: Options(raw_mode=True) for cf in ("variants", "access", "fidelity", "meta")})
    try:
        raw = db.get_column_family("fidelity").get(f"{model}{policy}\0{0.0:.4f}".encode())
    finally:
        db.close()
    return FIDELITY.unpack(raw)[0] if raw else 0


def _of(stats: pb.StatsResponse, model: str) -> dict[str, pb.FidelityStats]:
    """A model's tallies without a budget, by policy."""
    return {f.policy: f for f in stats.fidelity if f.model_id == model and not f.budget}


def test_tallies_survive_restarts_and_reach_the_metrics(start_server):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    server = start_server(metrics_port=port)
    model = _model()
    with KVClient(server.address) as c:
        _plan(c, model, [pb.FidelitySample(policy="naive", top1_agree=True, kl=0.25, computed_share=0.5)])
        _plan(c, model, [pb.FidelitySample(policy="naive", top1_agree=False, kl=0.75, computed_share=0.25,
                                           answer_tokens=16, answer_agree=9),
                         pb.FidelitySample(policy="query", top1_agree=True, kl=0.0, computed_share=0.125),
                         pb.FidelitySample(policy="query", top1_agree=True, kl=0.0, computed_share=0.1, budget=0.05,
                                           shadow_blend=True),
                         pb.FidelitySample(policy="query", top1_agree=False, kl=0.0, computed_share=0.25,
                                           budget=COLD_START, lead=0.25),  # lost, among 10: a margin of 0.3
                         *[pb.FidelitySample(policy="query", top1_agree=True, kl=0.0, computed_share=0.25,
                                             budget=COLD_START, lead=4.0)] * 9])
    server.restart()  # SIGTERM: the close writes what the once-a-second writes had not
    with KVClient(server.address) as c:
        got = _of(c.stats(), model)
        assert (got["naive"].samples, got["naive"].top1_agree, got["query"].samples) == (2, 1, 1)
        (blend,) = [f for f in c.stats().fidelity if f.model_id == model and 0 < f.budget < COLD_START]
        assert (blend.budget, blend.samples, blend.shadow_blends) == (pytest.approx(0.05), 1, 1)
        assert (got["naive"].answer_tokens, got["naive"].answer_agree, got["query"].answer_tokens) == (16, 9, 0)
        assert got["naive"].mean_kl == pytest.approx(0.5) and got["naive"].mean_computed_share == pytest.approx(0.375)
        assert (got["naive"].agree_lower, got["naive"].agree_upper) == pytest.approx(wilson(1, 2))
        for _ in range(2):  # the first is written at once, the second within the second after it
            _plan(c, model, [pb.FidelitySample(policy="query", top1_agree=True, kl=0.0, computed_share=0.125)])
    # quiet: the deferred write happens within the second without another Plan
    wait_for(lambda: _written_samples(server.data_dir, model, "query") == 3, "the deferred tally write", 10.0)
    server.restart(crash=True)
    with KVClient(server.address) as c:
        assert _of(c.stats(), model)["query"].samples == 3
        _plan(c, model, [], policy="query", adaptive=True)  # the controller's budget: a metric
    text = urllib.request.urlopen(f"http://127.0.0.1:{port}/metrics", timeout=10).read().decode()
    labels = f'budget="0",model="{model}",policy="naive"'
    assert f'kvcraft_fidelity_samples_total{{{labels}}} 2.0' in text
    lower, upper = wilson(1, 2)
    assert f'kvcraft_fidelity_top1_agreement{{bound="lower",{labels}}} {lower!r}' in text
    assert f'kvcraft_fidelity_top1_agreement{{bound="upper",{labels}}} {upper!r}' in text
    assert f'kvcraft_fidelity_mean_kl{{{labels}}} 0.5' in text
    assert f'kvcraft_fidelity_answer_tokens_total{{{labels}}} 16.0' in text
    assert f'kvcraft_fidelity_answer_agree_total{{{labels}}} 9.0' in text
    assert f'kvcraft_fidelity_shadow_blends_total{{budget="0.05",model="{model}",policy="query"}} 1.0' in text
    assert f'kvcraft_fidelity_budget{{model="{model}",policy="query"}} {COLD_START!r}' in text
    assert f'kvcraft_fidelity_held{{model="{model}",policy="query"}} 0.0' in text
    assert f'kvcraft_fidelity_near_tie{{model="{model}",policy="query"}} 0.3' in text  # its leads survived both


@pytest.mark.parametrize("sample,field", [
    (dict(policy="", kl=0.1, computed_share=0.1), "timings.fidelity[0].policy"),
    (dict(policy="x" * 65, kl=0.1, computed_share=0.1), "timings.fidelity[0].policy"),
    (dict(policy="naive\n", kl=0.1, computed_share=0.1), "timings.fidelity[0].policy"),
    (dict(policy="naive", kl=math.nan, computed_share=0.1), "timings.fidelity[0].kl"),
    (dict(policy="naive", kl=math.inf, computed_share=0.1), "timings.fidelity[0].kl"),
    (dict(policy="naive", kl=-0.5, computed_share=0.1), "timings.fidelity[0].kl"),
    (dict(policy="naive", kl=0.1, computed_share=4.5), "timings.fidelity[0].computed_share"),
    (dict(policy="naive", kl=0.1, computed_share=math.nan), "timings.fidelity[0].computed_share"),
    (dict(policy="naive", kl=0.1, computed_share=0.1, budget=1.5), "timings.fidelity[0].budget"),
    (dict(policy="naive", kl=0.1, computed_share=0.1, budget=math.nan), "timings.fidelity[0].budget"),
    (dict(policy="naive", kl=0.1, computed_share=0.1, answer_tokens=4097), "timings.fidelity[0].answer_tokens"),
    (dict(policy="naive", kl=0.1, computed_share=0.1, lead=-0.5), "timings.fidelity[0].lead"),
    (dict(policy="naive", kl=0.1, computed_share=0.1, lead=math.nan), "timings.fidelity[0].lead"),
    (dict(policy="naive", kl=0.1, computed_share=0.1, lead=math.inf), "timings.fidelity[0].lead"),
    (dict(policy="naive", kl=0.1, computed_share=0.1, answer_tokens=3, answer_agree=4),
     "timings.fidelity[0].answer_agree"),
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


def test_a_plan_request_names_its_policy_to_be_adaptive(shared_server):
    with KVClient(shared_server.address) as c:
        with pytest.raises(InvalidArgumentError, match="adaptive needs policy"):
            _plan(c, _model(), [], adaptive=True)
        with pytest.raises(InvalidArgumentError, match="policy is 'x.*expected a policy name"):
            _plan(c, _model(), [], policy="x\nx")


def test_adaptive_plans_carry_the_controllers_budget_and_admin_fidelity_shows_it(shared_server, capsys):
    """The service's default target: a new model starts at COLD_START, measured; samples that
    show that budget short move the next Plan up a step."""
    model = _model()
    with KVClient(shared_server.address) as c:
        plan = _plan(c, model, [], policy="query", adaptive=True)
        assert (plan.recompute_budget, plan.fidelity_sample, plan.fidelity_below) == (COLD_START, True, LADDER[0])
        up = LADDER[LADDER.index(COLD_START) + 1]
        short = [pb.FidelitySample(policy="query", top1_agree=False, kl=2.0, computed_share=0.3, budget=COLD_START,
                                   lead=0.4)]
        plan = _plan(c, model, short * (MIN_VERDICT_SAMPLES - 1), policy="query", adaptive=True)
        assert plan.recompute_budget == COLD_START  # too few samples for a verdict
        # every sample lost: a margin that caught them would send every blend to full prefill
        assert plan.near_tie == 0.0
        assert _plan(c, model, short, policy="query", adaptive=True).recompute_budget == up
        _plan(c, model, [pb.FidelitySample(policy="cacheblend", top1_agree=a, kl=0.5, computed_share=0.2,
                                           answer_tokens=8, answer_agree=n) for a, n in ((True, 8), (True, 5), (False, 1))])
        _plan(c, model, [pb.FidelitySample(policy="query", top1_agree=True, kl=0.1, computed_share=0.1,
                                           budget=LADDER[0], shadow_blend=True)])
    assert cli.main(["admin", "--address", shared_server.address, "fidelity"]) == 0
    lines = capsys.readouterr().out.splitlines()
    assert lines[0] == "fidelity target: first-token agreement >= 0.950"
    assert lines[1].split() == ["model", "policy", "budget", "state", "measuring", "below", "near", "ties", "under"]
    # up a step from a short cold start: nothing below it is tried
    # (and no near-tie margin: the leads lost were the short budget's)
    assert [line.split() for line in lines if line.startswith(model)][0] == [model, "query", f"{up:.2f}", "measuring",
                                                                             "-", "-"]
    (head,) = [line.split()[:6] for line in lines if line.startswith("model") and "samples" in line]
    assert head == ["model", "policy", "budget", "samples", "shadow_blends", "top1_agree"]
    rows = {tuple(line.split()[1:3]): line.split() for line in lines if line.startswith(model)}
    lower, upper = wilson(2, 3)
    assert rows[("cacheblend", "-")][3:7] == ["3", "0", "2", "0.667"]
    assert " ".join(rows[("cacheblend", "-")][7:9]) == f"[{lower:.3f}, {upper:.3f}]"
    assert rows[("cacheblend", "-")][-3:] == [f"{14 / 24:.3f}", "of", "24"]  # answer tokens after the first
    assert rows[("query", f"{COLD_START:.2f}")][-1] == "-"  # no answer compared
    assert rows[("query", f"{COLD_START:.2f}")][3:6] == [str(MIN_VERDICT_SAMPLES), "0", "0"]
    assert rows[("query", f"{LADDER[0]:.2f}")][3:6] == ["1", "1", "1"]  # a shadow blend's sample


def test_a_budget_that_sits_at_the_target_is_left_after_the_measuring_cap():
    """Agreement just below the target everywhere below full prefill (0.93 against 0.95: an
    interval needs about 600 samples to exclude it): the controller does not measure every
    request for so long; each budget counts as short after MAX_MEASURING_SAMPLES samples at
    most, and the model ends at full prefill, then sampled no more."""
    book = FidelityBook(target=0.95, sample=0.0)
    agreement = dict.fromkeys(LADDER[:-1], 0.93)
    given = _stream(book, "m" * 32, agreement, 4 * MAX_MEASURING_SAMPLES, seed=3)
    assert given[-1] == FULL
    assert given.index(FULL) <= 3 * MAX_MEASURING_SAMPLES + 3  # three budgets, each at most the cap


def test_a_budget_given_once_held_stays_while_measuring_and_moves_up_only_when_short():
    """5% shown held by shadow blends is given; served samples that pull its lower bound under
    the target (its interval straddling it) keep it given, every request measured; once its
    upper bound falls under the target it is short: back to 25%, 10% tried below."""
    model, least = "m" * 32, LADDER[0]
    book = FidelityBook(target=0.95, sample=0.0)
    book.observe(model, [Sample("query", True, 0.0, 0.25, COLD_START)] * 80
                 + [Sample("query", True, 0.0, least, least, shadow_blend=True)] * 80)
    assert book.decide(model, "query", True) == (least, False, 0.0, False, 0.0)  # held: at the rate, 0
    book.observe(model, [Sample("query", False, 0.0, least, least)] * 3)  # 80 of 83: [0.899, 0.988]
    lower, upper = wilson(80, 83)
    assert lower < 0.95 <= upper
    assert book.decide(model, "query", True) == (least, True, 0.0, False, 0.0)  # still given, measured
    book.observe(model, [Sample("query", False, 0.0, least, least)] * 10)  # 80 of 93: upper < 0.95
    assert wilson(80, 93)[1] < 0.95
    assert book.decide(model, "query", True) == (COLD_START, True, LADDER[1], False, 0.0)  # 10% measured below


def test_at_the_cap_the_budget_given_is_kept_at_or_above_the_target_and_a_budget_below_is_not_given():
    """A budget still straddling the target after MAX_MEASURING_SAMPLES samples: the one Plans
    give (here the cold start) stays given while its observed agreement is at or above the
    target (dense sampling ends; a later short verdict still moves it up); one only tried
    below by shadow blends is not given at the same agreement, and the next one up is tried.
    An observed agreement below the target at the cap is short."""
    model, n = "m" * 32, MAX_MEASURING_SAMPLES
    above, under = round(0.9625 * n), round(0.9375 * n)  # both intervals straddle 0.95 at n
    for agree in (above, under):
        lower, upper = wilson(agree, n)
        assert lower < 0.95 <= upper

    def served(budget: float, agree: int, count: int) -> list[Sample]:
        return [Sample("query", i < agree, 0.0, budget, budget) for i in range(count)]

    def tried(budget: float, agree: int, count: int) -> list[Sample]:
        return [Sample("query", i < agree, 0.0, budget, budget, shadow_blend=True) for i in range(count)]

    book = FidelityBook(target=0.95, sample=0.0)
    book.observe(model, served(COLD_START, above, n) + tried(LADDER[0], 0, MIN_VERDICT_SAMPLES)
                 + tried(LADDER[1], above, n))
    # 10% kept unserved: 15% tried
    assert book.decide(model, "query", True) == (COLD_START, True, LADDER[2], False, 0.0)
    (choice,) = book.choices()
    assert choice.state == "kept"
    book.observe(model, tried(LADDER[2], above, n) + tried(LADDER[3], above, n))
    assert book.decide(model, "query", True) == (COLD_START, False, 0.0, False, 0.0)  # nothing left to try: at the rate
    # served samples that take its upper bound under the target: short, up a rung
    book.observe(model, served(COLD_START, 0, 60))
    assert wilson(above, n + 60)[1] < 0.95
    assert book.decide(model, "query", True)[0] == LADDER[LADDER.index(COLD_START) + 1]

    below_target = FidelityBook(target=0.95, sample=0.0)
    below_target.observe(model, served(COLD_START, under, n))
    assert below_target.decide(model, "query", True)[0] == LADDER[LADDER.index(COLD_START) + 1]
