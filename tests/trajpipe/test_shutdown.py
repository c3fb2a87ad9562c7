"""trajpipe/shutdown.py: the one close/flush tail of ``trajpipe rollout`` and ``trajpipe eval``."""

from __future__ import annotations

import threading
from types import SimpleNamespace

from trajpipe.shutdown import close_policy, flush_and_report


class _Producer:
    def __init__(self, spooled: int) -> None:
        self.flushes = 0
        self.spooled = spooled

    def flush(self):
        self.flushes += 1
        return SimpleNamespace(spooled=self.spooled)


def test_flush_and_report_flushes_and_says_what_a_stop_and_the_spool_left(capsys):
    stop = threading.Event()
    producer = _Producer(spooled=0)
    assert flush_and_report(producer, stop=stop, aborted=0).spooled == 0 and producer.flushes == 1
    assert capsys.readouterr().err == ""  # a run that ended normally says nothing

    stop.set()
    producer = _Producer(spooled=7)
    flush_and_report(producer, stop=stop, aborted=3, prefix="eval: ")
    assert capsys.readouterr().err.splitlines() == [
        "eval: stopped by signal: 3 episodes aborted, events flushed",
        "eval: Kafka unreachable: 7 events kept in the spool; they replay on the next run",
    ]


def test_close_policy_closes_what_has_an_engine_and_leaves_the_rest():
    closed = []
    close_policy(SimpleNamespace(close=lambda: closed.append(1)))
    close_policy(object())  # HF and scripted policies have no close()
    assert closed == [1]
