"""Fixtures of the service tests."""

from __future__ import annotations

import pytest

from kvservice.cluster.master import MasterProcess
from tests.service.remote_helpers import Cluster


@pytest.fixture(scope="module")
def cluster(tmp_path_factory):
    """One master per test module (a client's close takes ~2 s: the tests share them)."""
    with MasterProcess(tmp_path_factory.mktemp("mooncake") / "master.log") as m:
        c = Cluster(m)
        try:
            yield c
        finally:
            if m.proc is None or m.proc.poll() is not None:
                m.start()  # a test that killed it: let the clients leave cleanly
            for cl in c.clients:
                cl.close()
