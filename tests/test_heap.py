"""kvcraft.heap.IdleTrim: a trim once the work has been idle, never while it is busy."""

from __future__ import annotations

import threading

from kvcraft.heap import IdleTrim


def test_it_trims_once_after_the_last_touch_and_not_while_busy():
    polled, trimmed, released = [], threading.Event(), threading.Event()
    third_poll = threading.Event()

    def busy() -> bool:
        polled.append(1)
        if len(polled) == 3:
            third_poll.set()
        return not released.is_set()

    trims, second = [], threading.Event()

    def on_trim() -> None:
        trims.append(1)
        (second if len(trims) == 2 else trimmed).set()

    trim = IdleTrim(busy, idle_s=0.001, on_trim=on_trim)
    trim.touch()
    assert third_poll.wait(30)  # three idle spells found busy
    assert not trimmed.is_set()
    released.set()
    assert trimmed.wait(30)
    trim.touch()  # work again, then idle: one trim more
    assert second.wait(30)
    trim.close()
    assert len(trims) == 2 and not trim._thread.is_alive()


def test_closing_before_any_work_starts_no_thread():
    trim = IdleTrim(lambda: False)
    trim.close()
    trim.touch()
    assert trim._thread is None
