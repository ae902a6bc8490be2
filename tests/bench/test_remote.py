"""`kvcraft bench remote`: its nodes on simulated hosts (network namespaces) where they can
be made, on loopback otherwise, and the JSON says which; nothing is left behind (the
suite's leak check covers namespaces, processes and shared memory)."""

from __future__ import annotations

import json

import pytest

from kvbench.common import netns

from kvbench.service import remote
from kvcli import main as cli

pytestmark = pytest.mark.slow  # over ~10 s: after the inner loop (README, "Developing")


def test_bench_remote_runs_three_nodes_on_their_hosts(tmp_path, capsys):
    out = tmp_path / "remote.json"
    assert cli.main(["bench", "remote", "--chunks", "2", "--tokens", "16", "--repeat", "1", "--requests", "40",
                     "--json", str(out)]) == 0
    result = json.loads(out.read_text())
    why = netns.unavailable()
    assert result["hosts"] == ("loopback" if why else "namespaces")
    assert result.get("loopback_because") == why
    printed = capsys.readouterr().out
    assert printed.startswith(remote.describe_hosts(result["hosts"], why))
    assert result["chunks"] == 2 and result["tokens"] == 16
    timed = [r for r in result["fetch"] if r["bytes"]]
    assert [r["path"].split()[0] for r in timed] == ["grpc-remote:", "grpc-stream:", "remote-tier", "disk-tier",
                                                     "host-tier"]
    assert all(r["bytes"] == timed[0]["bytes"] > 0 and r["seconds"] > 0 for r in timed)
    assert all(r["path"] in printed for r in result["fetch"])
    if not why:  # node B joined after node A's write-through: every payload is in A's segment
        assert result["payload_placement"] == {"a": 2}
    assert [s["arm"] for s in result["sharing"]] == ["local", "remote"]
    for s in result["sharing"]:
        assert s["requests"] == 40 and set(s["node_share"]) == {"a", "b", "c"}
        assert all(0 < v <= 1 for v in s["node_share"].values()) and 0 < s["total_share"] <= 1


def test_loopback_is_said_and_why(monkeypatch):
    monkeypatch.setattr(netns, "unavailable", lambda: "network namespaces need root")
    assert remote.choose_hosts("auto") == ("loopback", "network namespaces need root")
    assert remote.choose_hosts("loopback") == ("loopback", None)
    with pytest.raises(SystemExit, match="need root"):
        remote.choose_hosts("namespaces")
    assert remote.describe_hosts("loopback", "network namespaces need root") == (
        "hosts: loopback (master and every node on 127.0.0.1; simulated hosts unavailable: "
        "network namespaces need root)")
