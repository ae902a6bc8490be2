"""Crash points for recovery tests: `KVCRAFT_FAILPOINT=<name>` makes the process die
(os._exit, no cleanup, like SIGKILL) the first time it reaches that point.

Points, in write order: store:payload-written (before fsync/rename),
store:payload-committed (file in place, no metadata), store:metadata-committed
(before the ack), delete:metadata-deleted (payload not yet deleted);
fetch:after-first-layer (a FetchLayers stream has sent every variant's first layer).
"""

from __future__ import annotations

import os

_ARMED = os.environ.get("KVCRAFT_FAILPOINT", "")


def reach(name: str) -> None:
    if _ARMED == name:
        os._exit(137)
