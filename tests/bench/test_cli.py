"""The `kvcraft` command front (kvcli.main): it reaches the service, the client and the benchmarks."""

from __future__ import annotations

import json
import signal
import subprocess
import sys

import pytest

from kvbench.catalog import BENCHMARKS
from kvcli import main as cli
from kvclient.client import KVClient


def test_serve_through_the_front_runs_the_service(tmp_path):
    proc = subprocess.Popen(
        [sys.executable, "-m", "kvcli.main", "serve", "--host", "127.0.0.1", "--port", "0",
         "--data-dir", str(tmp_path / "data")],
        stdout=subprocess.PIPE, stderr=subprocess.DEVNULL, text=True,
    )
    try:
        line = proc.stdout.readline()
        assert line.startswith("kvcraft serving on 127.0.0.1:"), line
        address = line.split()[3]
        with KVClient(address) as c:
            assert [t.name for t in c.stats().tiers]
    finally:
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=30) == 0


def test_admin_stats_prints_what_the_client_reads(shared_server, capsys):
    """The tiers' names only: the settings name them, whatever other tests stored."""
    assert cli.main(["admin", "--address", shared_server.address, "stats"]) == 0
    printed = json.loads(capsys.readouterr().out)
    with KVClient(shared_server.address) as c:
        names = [t.name for t in c.stats().tiers]
    assert [t["name"] for t in printed["tiers"]] == names


def test_admin_needs_a_chunk_key_for_get(shared_server, capsys):
    assert cli.main(["admin", "--address", shared_server.address, "get"]) == 2
    assert "give a chunk key" in capsys.readouterr().err


def test_bench_lists_every_benchmark_with_its_line(capsys):
    assert cli.main(["bench"]) == 0
    listed = capsys.readouterr().out
    for name, b in BENCHMARKS.items():
        assert f"  {name} " in listed and b.about in listed
    assert "kvcraft bench report" in listed


@pytest.mark.parametrize("name", sorted(BENCHMARKS))
def test_bench_name_help_says_how_to_run_it_and_runs_nothing(name, capsys, tmp_path, monkeypatch):
    monkeypatch.chdir(tmp_path)  # a benchmark that ran would leave files here
    try:
        code = cli.main(["bench", name, "--help"])
    except SystemExit as e:
        code = e.code
    assert code == 0
    out = capsys.readouterr().out
    assert f"usage: kvcraft bench {name} " in out if BENCHMARKS[name].parses_help else BENCHMARKS[name].module in out
    assert not list(tmp_path.iterdir())


def test_bench_refuses_an_unknown_name(capsys):
    assert cli.main(["bench", "no-such-bench"]) == 2
    assert "no benchmark 'no-such-bench'" in capsys.readouterr().err


@pytest.mark.parametrize("argv", [["vllm-ttft", "--requests", "0"], ["vllm-ttft", "--layers", "0"],
                                  ["vllm-quality", "--examples", "0"], ["ttft", "--repeats", "0"],
                                  ["fetch", "--tokens", "-1"], ["planner", "--conversations", "0"],
                                  ["eviction", "--victims", "0"], ["load", "--workers", "0"],
                                  ["real-bound", "--new-tokens", "0"], ["vllm-ttft", "--warmup", "-1"],
                                  ["vllm-ttft", "--requests", "two"]])
def test_bench_refuses_a_count_below_its_least_before_running_anything(argv, capsys, tmp_path, monkeypatch):
    """A usage line and exit 2 naming the argument (a count of 0 once ran until a ZeroDivisionError,
    or started vLLM engines for nothing)."""
    monkeypatch.chdir(tmp_path)
    with pytest.raises(SystemExit) as e:
        cli.main(["bench", *argv])
    assert e.value.code == 2
    err = capsys.readouterr().err
    assert f"argument {argv[1]}: must be" in err and "Traceback" not in err
    assert not list(tmp_path.iterdir())


def test_a_count_argument_takes_whole_numbers_from_its_least():
    import argparse

    from kvbench.common.args import count

    assert count()("3") == 3 and count(0)("0") == 0
    for parse, text in ((count(), "0"), (count(0), "-1"), (count(), "1.5"), (count(), "")):
        with pytest.raises(argparse.ArgumentTypeError, match="must be"):
            parse(text)


def test_model_fetch_into_a_folder_it_cannot_make_says_so_without_a_traceback(capsys):
    assert cli.main(["model", "fetch", "--dir", "/proc/kvcraft-model"]) == 1  # (/proc: not even root writes there)
    err = " ".join(capsys.readouterr().err.split())
    assert "kvcraft model fetch: No such file or directory: /proc/" in err and "writable --dir" in err
    assert "Traceback" not in err


def test_bench_runs_the_named_benchmark_and_writes_its_results(tmp_path, capsys):
    out = tmp_path / "fetch.json"
    assert cli.main(["bench", "fetch", "--chunks", "1", "--tokens", "8", "--repeat", "1", "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    assert result["name"] == "fetch" and result["command"].startswith("kvcraft bench fetch --chunks 1")
    rows = result["servers"]["current"]
    timed = [r for r in rows if "seconds" in r]
    assert timed and all(r["bytes"] > 0 and r["seconds"] > 0 for r in timed)
    printed = capsys.readouterr().out
    assert all(r["path"] in printed for r in rows)


def test_bench_eviction_chooses_the_scans_victims(tmp_path):
    """`kvcraft bench eviction` checks each of its first victims against a scan and sort
    of every variant (it raises on a difference) while reuses leave entries stale."""
    out = tmp_path / "eviction.json"
    assert cli.main(["bench", "eviction", "--sizes", "2000", "--victims", "200", "--deletes", "6", "--delete-mib", "2",
                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    (row,) = result["victims"]
    assert row["variants"] == 2000 and row["victims"] == 200
    assert result["delete"]["victims"] == 6  # it raises if a variant or a file was left behind


def test_bench_reuse_writes_reads_back_the_scores_it_wrote(tmp_path):
    """`kvcraft bench reuse-writes` checks, after each round, that what each way wrote to
    RocksDB reads back as the scores the store holds (it raises on a difference)."""
    out = tmp_path / "reuse.json"
    assert cli.main(["bench", "reuse-writes", "--tokens", "16", "--fetches", "20", "--rounds", "2",
                     "--json", str(out)]) == 0
    (row,) = json.loads(out.read_text())["rows"]
    assert row["tokens"] == 16 and row["fetches"] == 40 and row["record_bytes"] > 16
    assert row["access_n"] == row["record_n"] == 40
