"""A part of ``trajpipe loop`` ends when the loop is killed (``trajpipe/lifeline.py``).

The real case: a supervisor process starts ``trajpipe archive`` exactly as the loop starts its parts
(:class:`trajpipe.loop.Child`, its own session), on a real broker; the supervisor is SIGKILLed and the
archiver stops by itself, cleanly (its last line, the counts, is printed on its SIGTERM stop). Without the
lifeline (the broker's starter, ``exit_with_loop=False``) the same archiver is left running, as every part was
before.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest

from streams.admin import ensure_topics
from streams.config import KafkaConnection, Topics
from streams.producer import EventProducer
from streams.synth import generate_episodes
from trajpipe.lifeline import ENV, exit_with_parent

REPO = Path(__file__).resolve().parents[2]

SUPERVISOR = """
import os, sys, time
from pathlib import Path
from trajpipe.loop import Child

out = Path(sys.argv[2])
child = Child("archiver", [sys.executable, "-m", "trajpipe", "archive", "--bootstrap", sys.argv[1], "--out",
                           str(out / "archive"), "--poll-interval", "0.5", "--commit-every", "1"],
              out / "archiver.log", spool=out / "spool", exit_with_loop=sys.argv[3] == "1")
child.start(dict(os.environ))
print(child.pid, flush=True)
time.sleep(600)
"""


def _alive(pid: int) -> bool:
    try:
        return "Z" not in Path(f"/proc/{pid}/status").read_text().split("State:", 1)[1][:4]
    except (OSError, IndexError):
        return False


def _wait(what: str, cond, timeout: float) -> None:
    deadline = time.monotonic() + timeout
    while not cond():
        assert time.monotonic() < deadline, f"timed out waiting for {what}"
        time.sleep(0.2)


def test_without_the_variable_nothing_is_set_and_a_bad_value_is_refused() -> None:
    env = {"OTHER": "1"}
    assert exit_with_parent(env) is False and env == {"OTHER": "1"}
    with pytest.raises(ValueError, match=ENV):
        exit_with_parent({ENV: "loop"})


@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_child_whose_parent_is_already_gone_stops_at_once() -> None:
    """The race: the loop dies between starting the child and the child's prctl call; the recorded pid is then
    not the child's parent any more (here: pid 1 never is)."""
    code = ("from trajpipe.lifeline import exit_with_parent; import os, time; exit_with_parent(); "
            "assert os.environ.get('" + ENV + "') is None; time.sleep(60)")
    proc = subprocess.run([sys.executable, "-c", code], env={**os.environ, "PYTHONPATH": str(REPO), ENV: "1"},
                          timeout=60, capture_output=True)
    assert proc.returncode == -signal.SIGTERM, proc.stderr


@pytest.mark.integration
@pytest.mark.skipif(not sys.platform.startswith("linux"), reason="PR_SET_PDEATHSIG is Linux's")
def test_a_loop_part_stops_cleanly_when_its_loop_is_killed(kafka_broker, topic_name, tmp_path: Path) -> None:
    topics = Topics(events=topic_name, control=f"{topic_name}.control", dead_letters=f"{topic_name}.dl",
                    partitions=1)
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, client_id="test-lifeline")
    ensure_topics(conn, topics)
    with EventProducer(conn, topics.events, spool_dir=tmp_path / "spool") as producer:
        for episode in generate_episodes(2, seed=7):
            for event in episode:
                producer.emit(event)
        assert producer.flush().spooled == 0
    env = {**os.environ, "PYTHONPATH": str(REPO), "TRAJPIPE_TOPICS__EVENTS": topics.events,
           "TRAJPIPE_TOPICS__CONTROL": topics.control, "TRAJPIPE_TOPICS__DEAD_LETTERS": topics.dead_letters,
           "TRAJPIPE_TOPICS__PARTITIONS": "1"}

    def supervise(name: str, lifeline: bool) -> tuple[subprocess.Popen, int, Path]:
        out = tmp_path / name
        out.mkdir()
        sup = subprocess.Popen([sys.executable, "-c", SUPERVISOR, kafka_broker.bootstrap, str(out),
                                "1" if lifeline else "0"], env=env, stdout=subprocess.PIPE, text=True)
        pid = int(sup.stdout.readline())
        # its SIGTERM handler is in place once it archives (the events above)
        _wait(f"{name}'s first commit", lambda: "events archived" in (out / "archiver.log").read_text(), 120)
        return sup, pid, out

    with_line, pid, out = supervise("with-lifeline", True)
    without, orphan, _ = supervise("without", False)
    try:
        for sup in (with_line, without):
            sup.kill()
            sup.wait()
        _wait("the archiver to stop after its loop was killed", lambda: not _alive(pid), 60)
        last = (out / "archiver.log").read_text().strip().splitlines()[-1]
        assert json.loads(last)["events"] >= 2, last  # the clean stop's counts line: stopped by its SIGTERM
        time.sleep(2)
        assert _alive(orphan), "without the lifeline the part outlives its loop (the bug the lifeline fixes)"
    finally:
        for p in (pid, orphan):
            if _alive(p):
                os.kill(p, signal.SIGKILL)
