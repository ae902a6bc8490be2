"""`kvbench.quality.fidelity_stream`: its report against brute force, and one short stream as deployed
(30 requests of the short task) whose service tallies are checked against the benchmark's own
full prefill of every request."""

from __future__ import annotations

import json
import math
import random

import pytest

from kvbench import results
from kvbench.quality import fidelity_stream as fs
from kvbench.quality import stream_report as sr
from kvbench.quality.modeling import MODEL_DIR
from kvservice.fidelity import ladder_budget, wilson


def _rows(budgets, seed=0):
    rng = random.Random(seed)
    return [{"budget": b, "blended": i > 0, "sampled": i > 0 and rng.random() < 0.5, "agree": rng.random() < 0.9,
             "share": b + 0.1 * rng.random(), "ttft_s": rng.random(), "prompt_tokens": 40, "fallbacks": 0,
             "plan_failed": False} for i, b in enumerate(budgets)]


def test_trajectory_and_settle():
    budgets = [0.25] * 11 + [0.4] * 12 + [0.25] * 3 + [0.15] * 4
    assert sr.trajectory(budgets) == [{"request": 0, "from": None, "to": 0.25},
                                      {"request": 11, "from": 0.25, "to": 0.4},
                                      {"request": 23, "from": 0.4, "to": 0.25},
                                      {"request": 26, "from": 0.25, "to": 0.15}]
    assert sr.settled_from(budgets) == 26
    assert sr.settled_from([0.25] * 5) == 0
    assert sr.settled_from([0.25]) == 0


def test_adaptive_report_against_brute_force():
    budgets = [0.25] * 40 + [0.15] * 60
    rows = _rows(budgets)
    tallies = []
    for b in (0.25, 0.15):
        mine = [r for r in rows if r["budget"] == b and r["sampled"]]
        agree = sum(r["agree"] for r in mine)
        lo, hi = wilson(agree, len(mine))
        tallies.append({"policy": "query", "budget": b, "samples": len(mine), "top1_agree": agree,
                        "agree_lower": lo, "agree_upper": hi})
    run = {"requests": rows, "service": {"fidelity": tallies, "budgets": []},
           "sampling_cost": {"row_share": 0.5, "shadow_s": 1.0, "served_compute_s": 2.0, "shadow_row_layers": 1,
                             "served_row_layers": 1}}
    rep = sr.adaptive_report(run, "query")
    after = rows[40:]
    assert rep["settled_budget"] == 0.15 and rep["settled_from_request"] == 40
    assert rep["settled"]["requests"] == 60
    assert rep["settled"]["agreement"] == pytest.approx(sum(r["agree"] for r in after) / 60)
    assert rep["settled"]["computed_share"] == pytest.approx(sum(r["share"] for r in after) / 60)
    p = rep["settled"]["agreement"]
    assert rep["settled"]["se"] == pytest.approx(math.sqrt(p * (1 - p) / 60))
    for h in rep["honesty"]:
        at = [r for r in rows if r["budget"] == h["budget"]]
        true = sum(r["agree"] for r in at) / len(at)
        lo, hi = wilson(h["service_top1_agree"], h["service_samples"])
        assert h["true_agreement_all"] == pytest.approx(true)
        assert h["covers_all"] == (lo <= true <= hi)
        assert h["sampled"] == h["service_samples"]
    # the sweep: the smallest budget meeting the target, and the ratio to it
    sweep = [{"policy": f"query:budget={b}", "requests": [{"agree": a, "share": s, "ttft_s": 0.0}
                                                          for a, s in zip(agree, [b] * len(agree))]}
             for b, agree in ((0.05, [1] * 90 + [0] * 10), (0.1, [1] * 96 + [0] * 4), (0.15, [1] * 100))]
    s = sr.sweep_report(sweep, rep["settled"]["computed_share"])
    assert s["smallest_budget_meeting_target"] == 0.1
    assert s["settled_share_ratio"] == pytest.approx(rep["settled"]["computed_share"] / 0.1)


def test_answer_agreement_and_requests_as_retrieved_against_brute_force():
    rows = _rows([0.25] * 30)
    rng = random.Random(3)
    for r in rows:
        r["answer_tokens"] = rng.randrange(0, 17)
        r["answer_agree"] = rng.randrange(0, r["answer_tokens"] + 1)
    # every chunk in an earlier request: a second retrieval that reorders them is, one that brings a new chunk not
    assert fs.retrieved([([[0], [1], [2]], [9]), ([[0], [2], [1]], [8]), ([[0], [2], [3]], [9]),
                         ([[0], [3], [1]], [9])]) == [False, True, False, True]
    assert fs.retrieved(fs.synthetic_stream("short", 8, seed=1)) == [False, True] * 4  # each example's second
    flags = [i % 2 == 1 and i < 20 for i in range(30)]  # 10 records: 20 requests, then 10 second retrievals
    for r, f in zip(rows, flags):
        r["as_retrieved"] = f
    got = sr.rate(rows)
    assert got["answer_tokens"] == sum(r["answer_tokens"] for r in rows)
    assert got["answer_agreement"] == pytest.approx(sum(r["answer_agree"] for r in rows) / got["answer_tokens"])
    assert got["computed_share_as_retrieved"] == pytest.approx(
        sum(r["share"] for r in rows[1:20:2]) / 10)  # the second retrievals bring a fresh chunk: not counted
    assert sr.rate(_rows([0.25] * 4))["answer_agreement"] is None  # no answers compared


def test_the_settled_requests_as_retrieved_are_timed_beside_full_prefill_on_the_same_requests():
    # 8 requests, settled from request 2; as retrieved: 3, 5, 7; full prefill timed on 3 and 7 only
    rows = [{"ttft_s": 1.0 + i, "share": 0.1 * i, "agree": int(i != 5), "as_retrieved": i % 2 == 1} for i in range(8)]
    reference = [9.0, 9.0, 9.0, 16.0, 9.0, None, 9.0, 20.0]
    got = sr.as_retrieved_speed(rows, reference, start=2)
    assert got["requests"] == 3 and got["timed"] == 2
    assert got["agreement"] == pytest.approx(2 / 3) and got["computed_share"] == pytest.approx(0.5)
    assert got["ttft_s"] == pytest.approx(6.0) and got["full_ttft_s"] == pytest.approx(18.0)  # (4 + 8) / 2, (16 + 20) / 2
    assert got["speedup"] == pytest.approx(3.0)
    assert sr.as_retrieved_speed(rows, [None] * 8, start=2) is None
    settled = sr.speed(rows, reference, range(2, 8))  # every settled request: 2-7, full prefill timed on 5 of them
    assert settled["requests"] == 6 and settled["timed"] == 5
    assert settled["ttft_s"] == pytest.approx((3 + 4 + 5 + 7 + 8) / 5)
    assert settled["full_ttft_s"] == pytest.approx((9 + 16 + 9 + 9 + 20) / 5)


def test_columns_round_trip():
    rows = _rows([0.25, 0.4])
    back = fs.unpack(json.loads(json.dumps(fs.columns(rows))))
    assert [r["agree"] for r in back] == [int(r["agree"]) for r in rows]
    assert back[1]["share"] == pytest.approx(rows[1]["share"], abs=1e-5)


@pytest.mark.skipif(not (MODEL_DIR / "model.safetensors").exists(), reason="no trained model committed")
def test_a_short_stream_as_deployed():
    """Every sample the service tallied is a request the benchmark saw sampled, or a shadow
    blend at a budget below the one served, and a served request's agreement is the one the
    benchmark's own full prefill gives (the shadow computes the same thing); the last
    request's samples may still be waiting for a next Plan."""
    from engine_adapter import LlamaEngine

    engine = LlamaEngine.from_pretrained(MODEL_DIR)
    reqs = fs.synthetic_stream("short", 30, seed=1)
    assert len(reqs) == 30
    run = fs.serve(engine, reqs, fs.ADAPTIVE, progress=False)
    rows = run["requests"]
    assert len(rows) == 30 and len(run["reference"]["tokens"]) == 30
    # a sampled request's reference is its shadow's full prefill (flushed before the reference);
    # a near tie's is the full prefill it was served by, its sample its blend's (no shadow prefill)
    assert run["reference"]["from_shadows"] == sum(r["sampled"] and not r["near_tie"] for r in rows) > 0
    assert all(r["blended"] or r["near_tie"] or not r["sampled"] for r in rows)
    rep = sr.adaptive_report(run, "query")
    pending = rows[-1]["sampled"]
    for h in rep["honesty"]:
        last = int(pending and ladder_budget(rows[-1]["budget"]) == h["budget"])
        blends = h.get("service_shadow_blends", 0)
        assert h.get("service_samples", 0) - blends == h["sampled"] - last
        if not last and not blends:  # a near tie's blend agrees at most as its full prefill does
            ties = sum(r["sampled"] and r["near_tie"] and ladder_budget(r["budget"]) == h["budget"] for r in rows)
            assert h["sampled_agree_by_reference"] - ties <= h.get("service_top1_agree", 0) \
                <= h["sampled_agree_by_reference"]
    blends, finished = sum(h.get("service_shadow_blends", 0) for h in rep["honesty"]), run["sampling_cost"]["shadow_blends"]
    assert 0 < finished and finished - int(pending) <= blends <= finished  # the cold start tries the least budget
    assert 0 < run["sampling_cost"]["row_share"] < 1
    assert rep["trajectory"][0] == {"request": 0, "from": None, "to": 0.25}  # the cold start


@pytest.mark.skipif(not (MODEL_DIR / "model.safetensors").exists(), reason="no trained model committed")
def test_a_stream_gated_on_every_lead_serves_each_blend_by_full_prefill_and_says_so():
    """`near_tie` above any lead the model gives: every request that stored KV would serve is
    computed again by full prefill (its first token is the reference's, nothing reused, its share
    the blend's plus every row's; sampled as the cold start asks, its blend the sample), and the
    rows and the report count those requests, the others not."""
    from engine_adapter import LlamaEngine

    engine = LlamaEngine.from_pretrained(MODEL_DIR)
    reqs = fs.synthetic_stream("short", 12, seed=1)
    rows = fs.serve(engine, reqs, fs.ADAPTIVE, progress=False, near_tie=1e9)["requests"]
    gated = [r for r in rows if r["near_tie"]]
    assert len(gated) >= 6  # every example's second request, at least, had its chunks stored
    assert all(r["agree"] and r["share"] > 1 and not r["blended"] and r["sampled"] for r in gated)
    assert not any(r["blended"] for r in rows) and all(r["share"] == 1 for r in rows if not r["near_tie"])
    assert sr.flagged(rows, 4, "near_tie") == {"overall": len(gated), "settled": sum(r["near_tie"] for r in rows[4:])}


@pytest.mark.skipif(not (MODEL_DIR / "model.safetensors").exists(), reason="no trained model committed")
def test_with_new_tokens_every_fixed_policy_compares_its_own_answers_under_teacher_forcing(tmp_path):
    """`--new-tokens`: the sweep's rows carry answers too. Full prefill served by the policy
    `full` decodes the answer full prefill predicts, so teacher forcing over it agrees on every
    token (an answer compared at the wrong position would not); naive reuse compares as many."""
    out = tmp_path / "stream.json"
    assert fs.main(["--task", "short", "--requests", "4", "--sweep", "full", "naive", "--new-tokens", "5",
                    "--json", str(out), "--quiet"]) == 0
    result = json.loads(out.read_text())
    runs = {r["policy"]: fs.unpack(r["requests"]) for r in result["runs"]}
    for policy in ("full", "naive"):
        rows = runs[policy]
        assert len(rows) == 4 and all(0 < r["answer_tokens"] <= 4 for r in rows), policy
    assert all(r["answer_agree"] == r["answer_tokens"] for r in runs["full"])
    assert all(r["answer_agree"] <= r["answer_tokens"] for r in runs["naive"])
    table = {t["policy"]: t for t in result["report"]["sweep"]["table"]}
    assert table["full"]["answer_agreement"] == 1.0
    # Reported again (`--resume`, nothing to serve): the machine that served it stays named; once
    # this one serves a run of it, this one is named.
    result["machine"] = {**result["machine"], "cpu": "the machine that served it"}
    out.write_text(json.dumps(result))
    again = ["--task", "short", "--requests", "4", "--resume", str(out), "--new-tokens", "5", "--json", str(out),
             "--quiet"]
    assert fs.main([*again, "--sweep", "full", "naive"]) == 0
    assert json.loads(out.read_text())["machine"]["cpu"] == "the machine that served it"
    assert fs.main([*again, "--sweep", "full", "naive", "prefix"]) == 0
    assert json.loads(out.read_text())["machine"] == results.machine()


@pytest.mark.skipif(not (MODEL_DIR / "model.safetensors").exists(), reason="no trained model committed")
def test_a_stream_stopped_killed_and_gone_on_with_is_the_whole_stream_and_its_service_kept_its_tallies(
        tmp_path, monkeypatch):
    """`--state`: a stream served in three parts (stopped after 12 requests; then killed in
    its 18th request; each time the service restarted on its data) serves every request
    once, in order: the references are the ones a full prefill of each request gives
    (computed here again, apart), and the service's tallies at the end count the earlier
    parts' samples too (a restart that lost them would hold fewer samples than the requests
    the benchmark saw sampled)."""
    from engine_adapter import LlamaEngine

    engine = LlamaEngine.from_pretrained(MODEL_DIR)
    reqs = fs.synthetic_stream("short", 24, seed=1)
    first = fs.serve(engine, reqs, fs.ADAPTIVE, progress=False, state=tmp_path / "state", stop_after=12)
    assert len(first["requests"]) == 12 and "parts" not in first
    full, calls = fs._full, []

    def killed(*args, **kwargs):  # the benchmark's reference of request 17: the process dies there
        calls.append(1)
        if len(calls) == 6:
            raise KeyboardInterrupt
        return full(*args, **kwargs)

    monkeypatch.setattr(fs, "_full", killed)
    with pytest.raises(KeyboardInterrupt):
        fs.serve(engine, reqs, fs.ADAPTIVE, progress=False, state=tmp_path / "state")
    monkeypatch.setattr(fs, "_full", full)
    run = fs.serve(engine, reqs, fs.ADAPTIVE, progress=False, state=tmp_path / "state")
    rows = run["requests"]
    assert len(rows) == 24 and [(p["first_request"], p["last_request"]) for p in run["parts"]] == [(0, 11), (12, 16),
                                                                                                     (17, 23)]
    assert rows[:12] == first["requests"]
    alone = [full(engine, chunks, question, [])[0] for chunks, question in reqs]
    assert run["reference"]["tokens"] == alone
    rep = sr.adaptive_report(run, "query")
    lost = sum(int(rows[i]["sampled"]) for i in (11, 16, 23))  # a sample waits for the next Plan
    tallied = sum(h.get("service_samples", 0) - h.get("service_shadow_blends", 0) for h in rep["honesty"])
    assert sum(r["sampled"] for r in rows) - lost <= tallied <= sum(r["sampled"] for r in rows)
    assert tallied > sum(r["sampled"] for r in rows[12:])  # the first part's samples are still counted
    again = fs.serve(engine, reqs, fs.ADAPTIVE, progress=False, state=tmp_path / "state")  # run once done
    assert again["requests"] == rows and again["parts"] == run["parts"]
    with pytest.raises(SystemExit, match="another run"):
        fs.serve(engine, reqs[:20], fs.ADAPTIVE, progress=False, state=tmp_path / "state")
    with pytest.raises(SystemExit, match="another run"):  # the same stream, gated: not the run this folder holds
        fs.serve(engine, reqs, fs.ADAPTIVE, progress=False, state=tmp_path / "state", near_tie=0.5)


@pytest.mark.skipif(not (MODEL_DIR / "model.safetensors").exists(), reason="no trained model committed")
def test_a_stream_interrupted_and_gone_on_with_elsewhere_starts_its_service_on_the_kept_tallies(tmp_path, monkeypatch):
    """SIGINT stops a `--state` run once the request in flight is saved; the folder without the
    service's data (committed, on another machine) goes on with a service started on the
    tallies the progress file kept: the first part's samples still count, no chunk's KV is
    served from before (a request whose chunks an earlier one stored is computed whole), and
    the part says so. Without the tallies either, the folder is refused."""
    import os
    import shutil
    import signal

    from engine_adapter import LlamaEngine

    engine = LlamaEngine.from_pretrained(MODEL_DIR)
    reqs = fs.synthetic_stream("short", 20, seed=1)
    state = tmp_path / "state"
    full, calls = fs._full, []

    def interrupted(*args, **kwargs):  # Ctrl-C while request 9 is served (its reference)
        calls.append(1)
        if len(calls) == 10:
            os.kill(os.getpid(), signal.SIGINT)
        return full(*args, **kwargs)

    monkeypatch.setattr(fs, "_full", interrupted)
    first = fs.serve(engine, reqs, fs.ADAPTIVE, progress=False, state=state)
    monkeypatch.setattr(fs, "_full", full)
    assert len(first["requests"]) == 10
    kept = json.loads((state / "progress.json").read_text())["tallies"]
    sampled = sum(r["sampled"] for r in first["requests"])
    served_samples = sum(t["samples"] - t["shadow_blends"] for t in kept)
    assert sampled - 1 <= served_samples <= sampled and served_samples > 0
    shutil.rmtree(state / "data")
    run = fs.serve(engine, reqs, fs.ADAPTIVE, progress=False, state=state)
    rows = run["requests"]
    assert len(rows) == 20 and rows[:10] == first["requests"]
    assert [p.get("service_data") for p in run["parts"]] == [None, "tallies"]
    stored_before = {tuple(c) for chunks, _ in reqs[:10] for c in chunks}
    assert any(tuple(c) in stored_before for c in reqs[10][0]) and not rows[10]["blended"]
    rep = sr.adaptive_report(run, "query")
    tallied = sum(h.get("service_samples", 0) - h.get("service_shadow_blends", 0) for h in rep["honesty"])
    assert tallied >= served_samples + sum(r["sampled"] for r in rows[10:19])
    saved = json.loads((state / "progress.json").read_text())
    shutil.rmtree(state / "data")
    (state / "progress.json").write_text(json.dumps({**saved, "tallies": []}))
    with pytest.raises(SystemExit, match="neither the service's data"):
        fs.serve(engine, reqs, fs.ADAPTIVE, progress=False, state=state)


def test_a_stream_served_in_parts_says_where_each_began():
    from pathlib import Path

    from kvbench.report.streams import stream_tables

    result = json.loads((Path(__file__).parents[2] / "docs/results/fidelity-musique-300.json").read_text())
    assert "parts" not in stream_tables(result)
    result["runs"][0]["parts"] = [{"first_request": 0}, {"first_request": 140}, {"first_request": 230}]
    assert "Served in 3 parts: the service restarted on its data (and the engine's adapter afresh) before " \
           "requests 140, 230." in stream_tables(result)
    assert "data dir was not there" not in stream_tables(result)
    result["runs"][0]["parts"][2]["service_data"] = "tallies"
    assert "Before request 230 its data dir was not there (another machine): it restarted on the fidelity " \
           "tallies the benchmark kept, every chunk's KV computed again." in stream_tables(result)


def test_a_stream_says_how_many_near_ties_the_learned_margin_served_by_full_prefill():
    from pathlib import Path

    from kvbench.report.streams import stream_tables

    result = json.loads((Path(__file__).parents[2] / "docs/results/fidelity-musique-300.json").read_text())
    assert "Near ties" not in stream_tables(result)  # no margin: neither learned nor given
    adaptive = result["report"]["adaptive"]
    adaptive["near_ties"] = sr.flagged([{"near_tie": i in (5, 200)} for i in range(300)], 111, "near_tie")
    adaptive["service_budgets"][0]["near_tie"] = 0.7
    assert "Near ties (a blend whose first token leads by less than the margin the service learned (at the end " \
           "0.7 logits)) served by full prefill: 2 of 300 requests, 1 of the settled;" in stream_tables(result)


@pytest.mark.parametrize("margin", ["-1", "nan"])
def test_a_near_tie_margin_below_0_is_refused_before_anything_runs(margin, capsys):
    with pytest.raises(SystemExit) as e:
        fs.main(["--task", "short", "--requests", "4", "--near-tie", margin])
    assert e.value.code == 2 and "--near-tie must be a margin >= 0" in capsys.readouterr().err
