"""The trajectory job in ``--mode stream`` on Prism against a real Kafka broker.

A producer thread emits synthetic episodes, interleaved, over several seconds
while the job runs; the test thread polls the dataset's manifests. Proved:
commits (Parquet rows) become visible while the producer is still running,
and at the end every finished episode is in ``trajectories/`` exactly once
with all its steps, and the one never-finished episode once, as incomplete.

Every job here stops on a condition, never on a wall-clock budget (a busy
machine reads slower): ``--stop-at-end`` once its input is produced, or
``--stop-file`` written when the manifests show what the test waits for.
``WAIT_S`` only bounds how long a condition may take before the test fails.
"""

from __future__ import annotations

import threading
import time
from pathlib import Path

import duckdb
import pytest
from kafka.admin import KafkaAdminClient, NewTopic

from pipelines.commit import DatasetManifest, covered_offsets
from pipelines.trajectory_job import run
from schemas.manifests import list_dataset_versions, read_dataset_manifests
from streams.config import KafkaConnection
from streams.producer import EventProducer
from tests.pipelines.helpers import episodes

pytestmark = [
    pytest.mark.integration,
    # Beam's LOOPBACK worker logs a CANCELLED gRPC stream from a thread when Prism hangs up.
    pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning"),
]

N = 40  # finished episodes, ~12 events each
PRODUCE_S = 8.0
WAIT_S = 300.0  # a failure timeout only: the longest a condition may take on a loaded machine
# Event-time idleness before an open episode is given up. A caught-up partition's watermark follows the
# wall clock, so an event delivered this much later than the one before it (producer flushes behind a
# busy broker, the GIL shared with the in-process SDK worker on a loaded 2-core machine) makes a finished
# episode incomplete: 3 s flaked. The never-finished episode still times out well before the stop
# (~9 s + 12 s + lag < 30 s).
INCOMPLETE_AFTER_S = 12.0


def _manifests(out: Path) -> list[DatasetManifest]:
    return [m for v in list_dataset_versions(out) for m in read_dataset_manifests(out, v)]


def _committed(out: Path, key: str) -> int:
    return sum(m.counts.get(key, 0) for m in _manifests(out))


def _stop_when(condition, stop_file: Path, stop: threading.Event) -> threading.Thread:
    """Write ``stop_file`` (the job's ``--stop-file``) once ``condition()`` holds, or after WAIT_S (the test fails)."""
    def watch() -> None:
        deadline = time.monotonic() + WAIT_S
        while not stop.is_set() and not condition() and time.monotonic() < deadline:
            time.sleep(0.2)
        stop_file.touch()

    thread = threading.Thread(target=watch, name="stop-when")
    thread.start()
    return thread


def _produce(conn: KafkaConnection, topic: str, eps: list[list], spool: Path, done: dict) -> None:
    """Emit the episodes 8 at a time, their events interleaved, spread over PRODUCE_S seconds."""
    groups = [eps[i:i + 8] for i in range(0, len(eps), 8)]
    ticks = [[ep[k] for ep in g if k < len(ep)] for g in groups for k in range(max(map(len, g)))]
    with EventProducer(conn, topic, spool_dir=spool) as producer:
        for tick in ticks:
            for ev in tick:
                producer.emit(ev)
            producer.flush()
            time.sleep(PRODUCE_S / len(ticks))
        assert producer.stats().spooled == 0
    done["at"] = time.monotonic()


def test_stream_commits_while_producing_and_ends_exactly_once(kafka_broker, topic_name, tmp_path):
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, client_id="test-stream-job")
    admin = KafkaAdminClient(**conn.client_kwargs())
    try:
        admin.create_topics([NewTopic(topic_name, 2, 1)])
    finally:
        admin.close()
    eps = episodes(N + 1, seed=41)
    finished, unfinished = eps[:N], eps[N][:-1]  # the last one never sends episode_finished
    out = tmp_path / "out"
    produced: dict = {}
    seen: dict = {}
    stop = threading.Event()

    def watch() -> None:  # polls the manifests, as a reader of the dataset would
        while not stop.is_set() and "first_commit" not in seen:
            if any(m.counts.get("episodes") for m in _manifests(out)):
                seen["first_commit"] = time.monotonic()
            time.sleep(0.1)

    t0 = time.monotonic()
    producer = threading.Thread(target=_produce, args=(conn, topic_name, [*finished, unfinished],
                                                       tmp_path / "spool", produced), name="producer")
    watcher = threading.Thread(target=watch, name="watcher")
    producer.start()
    watcher.start()
    # Stop once everything sent is committed: N complete episodes and the unfinished one, incomplete.
    stopper = _stop_when(lambda: "at" in produced and _committed(out, "episodes") >= N
                         and _committed(out, "incomplete_episodes") >= 1, tmp_path / "stop", stop)
    try:
        # The job runs in the main thread (Beam installs a signal handler while it waits).
        counts = run(["--source", "kafka", "--bootstrap", kafka_broker.bootstrap, "--topic", topic_name,
                      "--out", str(out), "--mode", "stream", "--runner", "PrismRunner",
                      "--window-s", "2", "--incomplete-after", str(INCOMPLETE_AFTER_S), "--idle-watermark-lag-s", "1",
                      "--stop-file", str(tmp_path / "stop")])
    finally:
        stop.set()
        producer.join(timeout=30)
        watcher.join(timeout=5)
        stopper.join(timeout=5)
    first_commit = seen.get("first_commit")
    assert first_commit is not None, "no commit with episodes"
    print(f"first commit {first_commit - t0:.1f}s, producer done {produced['at'] - t0:.1f}s, "
          f"job done {time.monotonic() - t0:.1f}s, {len(_manifests(out))} commits; counts {counts}")
    assert first_commit < produced["at"], "no trajectories were committed while the producer was running"

    sql = duckdb.connect()
    trajs = sql.sql(f"select episode_id, complete, incomplete_reason from "
                    f"read_parquet('{out}/trajectories/**/*.parquet', hive_partitioning=true)").fetchall()
    assert sorted(e for e, c, _ in trajs if c) == sorted(ep[0].episode_id for ep in finished)  # each once
    assert [(e, r) for e, c, r in trajs if not c] == [(unfinished[0].episode_id, "unfinished")]
    [(steps, distinct)] = sql.sql(f"select count(*), count(distinct (episode_id, step_index)) from "
                                  f"read_parquet('{out}/steps/**/*.parquet', hive_partitioning=true)").fetchall()
    assert steps == distinct == sum(ev.event_type == "step" for ep in finished for ev in ep)
    c = counts
    assert c["steps"] == steps
    assert c["events_in"] == sum(map(len, finished)) + len(unfinished)
    assert (c["episodes"], c["incomplete_episodes"], c["dead_letters"]) == (N, 1, 0)
    assert (c["events_in"] + c["events_pending_in"] == c["events_used"] + c["events_incomplete"]
            + c["events_pending_out"] + c["dead_letters"] + c["duplicates"] + c["late_events"])
    assert c["events_uncommitted"] == 0  # every event an outcome counted is in a commit
    # Window commits record the offsets they cover; a restart starts after the largest.
    manifests = _manifests(out)
    assert all(m.mode == "stream" and m.window and m.pane for m in manifests)
    assert set(covered_offsets(manifests, topic_name)) == {0, 1}
    assert sum(m.counts["episodes"] for m in manifests) == N


def _produce_now(conn: KafkaConnection, topic: str, events: list, spool: Path) -> None:
    with EventProducer(conn, topic, spool_dir=spool) as producer:
        for ev in events:
            producer.emit(ev)
        assert producer.flush().spooled == 0


def test_stop_carries_open_episodes_and_restart_completes_them(kafka_broker, topic_name, tmp_path):
    """A stop commits the open episodes as pending state; the restart reads from the covered offsets,
    feeds the pending events back and completes them: every episode once, nothing incomplete."""
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, client_id="test-stream-restart")
    admin = KafkaAdminClient(**conn.client_kwargs())
    try:
        admin.create_topics([NewTopic(topic_name, 2, 1)])
    finally:
        admin.close()
    eps = episodes(12, seed=43)
    done, open_ = eps[:6], eps[6:]
    out = tmp_path / "out"
    args = ["--source", "kafka", "--bootstrap", kafka_broker.bootstrap, "--topic", topic_name, "--out", str(out),
            "--mode", "stream", "--window-s", "2", "--incomplete-after", "60", "--idle-watermark-lag-s", "1",
            "--stop-at-end"]
    _produce_now(conn, topic_name, [ev for ep in done for ev in ep] + [ev for ep in open_ for ev in ep[:4]],
                 tmp_path / "spool")
    c1 = run(args)
    assert (c1["episodes"], c1["pending_episodes"], c1["incomplete_episodes"]) == (6, 6, 0), c1
    assert [m.counts["pending_episodes"] for m in _manifests(out) if m.pending_file] == [6]
    _produce_now(conn, topic_name, [ev for ep in open_ for ev in ep[4:]], tmp_path / "spool")
    c2 = run(args)
    assert (c2["episodes"], c2["events_pending_in"], c2["incomplete_episodes"]) == (6, 24, 0), c2
    for c in (c1, c2):
        assert (c["events_in"] + c["events_pending_in"] == c["events_used"] + c["events_incomplete"]
                + c["events_pending_out"] + c["dead_letters"] + c["duplicates"] + c["late_events"]), c
        assert c["events_uncommitted"] == 0, c
    rows = duckdb.connect().sql(f"select episode_id, complete from "
                                f"read_parquet('{out}/trajectories/**/*.parquet', hive_partitioning=true)").fetchall()
    assert sorted(rows) == sorted((ep[0].episode_id, True) for ep in eps)
    print(f"run 1 {c1}\nrun 2 {c2}")


def test_late_tails_complete_incomplete_episodes_in_the_stream_and_after_a_restart(kafka_broker, topic_name,
                                                                                    tmp_path):
    """Episodes a and b go idle without their tails and are committed incomplete. a's tail comes while the
    stream runs: its events are late (not duplicates) and a is committed complete with completed_late=True
    (its held group released whole). b's tail comes after a stop: the restart restores b's kept events from
    the late state and completes it the same way; a's tail sent again is a duplicate."""
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, client_id="test-stream-late")
    admin = KafkaAdminClient(**conn.client_kwargs())
    try:
        admin.create_topics([NewTopic(topic_name, 1, 1)])
    finally:
        admin.close()
    eps = episodes(8, seed=47)  # two GRPO groups of 4
    a, b = eps[0], eps[4]
    out = tmp_path / "out"
    args = ["--source", "kafka", "--bootstrap", kafka_broker.bootstrap, "--topic", topic_name, "--out", str(out),
            "--mode", "stream", "--window-s", "2", "--incomplete-after", "3", "--idle-watermark-lag-s", "1"]
    _produce_now(conn, topic_name, [ev for ep in eps if ep not in (a, b) for ev in ep] + a[:-3] + b[:-3],
                 tmp_path / "spool")
    sent: dict = {}
    stop = threading.Event()

    def send_a_tail_once_a_is_incomplete() -> bool:
        if "at" not in sent and _committed(out, "incomplete_episodes") >= 2:
            _produce_now(conn, topic_name, a[-3:] + a[:1], tmp_path / "spool")
            sent["at"] = time.monotonic()
        # Stop once a's tail completed it (its late commit) and every record sent is covered by a commit.
        return "at" in sent and _committed(out, "episodes_completed_late") >= 1 and _committed(out, "events_in") >= sent_n

    sent_n = sum(map(len, eps)) - 3 + 1  # all but b's tail, plus a copy of a's first event

    stopper = _stop_when(send_a_tail_once_a_is_incomplete, tmp_path / "stop", stop)
    try:
        c1 = run([*args, "--stop-file", str(tmp_path / "stop")])
    finally:
        stop.set()
        stopper.join(timeout=30)
    assert "at" in sent, "a and b were never committed incomplete"
    assert (c1["incomplete_episodes"], c1["late_events"], c1["episodes_completed_late"]) == (2, 3, 1), c1
    assert c1["duplicates"] == 1, c1  # the copy of a kept event
    _produce_now(conn, topic_name, b[-3:] + a[-3:], tmp_path / "spool")
    c2 = run([*args, "--stop-at-end"])
    assert (c2["late_events"], c2["episodes_completed_late"], c2["duplicates"]) == (3, 1, 3), c2
    for c in (c1, c2):
        assert (c["events_in"] + c["events_pending_in"] == c["events_used"] + c["events_incomplete"]
                + c["events_pending_out"] + c["dead_letters"] + c["duplicates"] + c["late_events"]), c
        assert c["events_uncommitted"] == 0, c
    sql = duckdb.connect()
    rows = sql.sql(f"select episode_id, complete, completed_late from "
                   f"read_parquet('{out}/trajectories/**/*.parquet', hive_partitioning=true)").fetchall()
    late_ids = {a[0].episode_id, b[0].episode_id}
    assert sorted(rows) == sorted([(ep[0].episode_id, True, ep[0].episode_id in late_ids) for ep in eps]
                                  + [(i, False, False) for i in late_ids])
    [(steps,)] = sql.sql(f"select count(*) from read_parquet('{out}/steps/**/*.parquet', hive_partitioning=true) "
                         f"where episode_id in ('{a[0].episode_id}', '{b[0].episode_id}')").fetchall()
    assert steps == a[-1].num_steps + b[-1].num_steps
    reasons = sql.sql(f"select episode_id, late_reason, count(*) from read_parquet('{out}/late_events/**/*.parquet') "
                      f"group by all order by all").fetchall()
    assert reasons == sorted([(a[0].episode_id, "completed", 3), (b[0].episode_id, "completed", 3)])
    print(f"run 1 {c1}\nrun 2 {c2}")
