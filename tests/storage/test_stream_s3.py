"""The streaming trajectory job (``--mode stream`` on Prism) writing its dataset to SeaweedFS from a real Kafka broker.

Each window pane's commit goes through :mod:`schemas.locations` as the batch job's does: staged
under ``_staging/<V>/<n>-<attempt>/``, the manifest written create-only, the staged files moved,
one Delta transaction per table. These tests hold it to the same stream written to a local directory:

* the same rows through ``deltalake.DeltaTable`` and polars ``scan_delta``, the same counts and
  commits, and ``trajpipe query --data s3://...`` counts what it counts locally;
* a restart with no new input adds no row; a restart after the open episodes' tails are produced
  reads from the covered offsets, feeds the pending state back and completes them, each once;
* a crash between a pane's manifest and its Delta transactions fails the job; the restart
  makes the transactions and gives the same dataset;
* a pane that loses the create-only manifest PUT to another run is planned again on top of its commit;
* a bundle the runner retries after its pane's commit was made commits nothing again.

Every job stops with ``--stop-at-end`` (tests/pipelines/test_streaming.py drives the same job).
"""

from __future__ import annotations

import contextlib
import json
import os
import signal
import subprocess
import sys
import time
import uuid
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from kafka import KafkaProducer

from pipelines.delta_tables import delta_batches
from pipelines.trajectory_job import run
from schemas import locations as loc
from schemas.codec import encode_event
from schemas.manifests import list_dataset_versions, read_dataset_records
from schemas.storage import delta_storage_options
from tests.helpers import create_topics, produce_messages
from tests.pipelines.helpers import episodes

pytestmark = [
    pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1800),
    # Beam's LOOPBACK worker logs a CANCELLED gRPC stream from a thread when Prism hangs up.
    pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning"),
]

REPO = Path(__file__).resolve().parents[2]
DONE, OPEN = 10, 4  # finished episodes, and episodes whose first 4 events only are sent at first
TABLES = ("steps", "trajectories", "dead_letters")
#: Counts that say when, not what: equal between two streams of the same events only by chance.
TIMING = ("commits",)


def _records(eps: list[list]) -> list[tuple[bytes, bytes]]:
    return [(ev.episode_id.encode(), encode_event(ev)) for ep in eps for ev in ep]


def _produce_in_one_window(bootstrap: str, topic: str, messages: list[tuple[bytes, bytes]]) -> None:
    """Send the records stamped with one Kafka time (the stream's event time), the middle of a 2 s window a
    few seconds ago: one window pane holds them all, whatever the machine's speed, so two streams of them
    commit the same panes."""
    stamp_ms = (int(time.time()) // 2 - 2) * 2000 + 1000
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", client_id="trajpipe-test-producer")
    try:
        futures = [producer.send(topic, key=k, value=v, timestamp_ms=stamp_ms) for k, v in messages]
        producer.flush(timeout=30)
        for future in futures:
            future.get(timeout=30)
    finally:
        producer.close(timeout=10)


@pytest.fixture(scope="module")
def events(kafka_broker) -> dict:
    """DONE finished episodes, the heads of OPEN more and one undecodable record on a 2-partition topic."""
    topic = create_topics(kafka_broker.bootstrap, f"test.stream-s3.{uuid.uuid4().hex[:8]}")
    eps = episodes(DONE + OPEN, seed=53)
    done, open_ = eps[:DONE], eps[DONE:]
    _produce_in_one_window(kafka_broker.bootstrap, topic, _records(done) + _records([ep[:4] for ep in open_])
                           + [(b"ep-x", b"junk")])
    return {"bootstrap": kafka_broker.bootstrap, "topic": topic, "done": done, "open": open_}


def _args(bootstrap: str, topic: str, out: str) -> list[str]:
    return ["--source", "kafka", "--bootstrap", bootstrap, "--topic", topic, "--out", out, "--mode", "stream",
            "--window-s", "2", "--incomplete-after", "600", "--idle-watermark-lag-s", "1", "--stop-at-end"]


@pytest.fixture(scope="module")
def local_stream(events, tmp_path_factory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("local-stream") / "datasets")
    return out, run(_args(events["bootstrap"], events["topic"], out))


def _rows(root: str, table: str) -> pa.Table:
    """A table's rows through deltalake, sorted, without the columns that say when the job ran."""
    uri = loc.join(root, table)
    rows = DeltaTable(uri, storage_options=delta_storage_options(uri) or None).to_pyarrow_dataset().to_table()
    keys = [("episode_id", "ascending")] + ([("step_index", "ascending")] if table == "steps" else [])
    if table == "dead_letters":
        rows, keys = rows.drop_columns(["timestamp"]), [("source_partition", "ascending"),
                                                        ("source_offset", "ascending")]
    return rows.sort_by(keys).select(sorted(rows.column_names))


def _manifests(root: str) -> list[dict]:
    return [json.loads(r) for v in list_dataset_versions(root) for r in read_dataset_records(root, v)]


def _same_rows(uri: str, local: str) -> None:
    for table in TABLES:
        on_s3, on_disk = _rows(uri, table), _rows(local, table)
        assert on_s3.num_rows > 0 and on_s3.equals(on_disk), table


def _query(env: dict, data: str) -> list[dict]:
    proc = subprocess.run(
        [sys.executable, "-m", "trajpipe", "query", "--data", data, "--format", "json",
         "select 'steps' as what, count(*) as n, count(distinct episode_id) as episodes from steps union all "
         "select 'trajectories', count(*), count(distinct episode_id) from trajectories order by what"],
        cwd=REPO, env={**{k: v for k, v in os.environ.items() if not k.startswith("TRAJPIPE_")},
                       "PYTHONPATH": str(REPO), **env}, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines()]


def test_stream_to_s3_is_the_local_stream_and_a_restart_adds_nothing(events, local_stream, s3_env):
    local, local_counts = local_stream
    uri = s3_env.uri(f"stream-{uuid.uuid4().hex[:8]}", "datasets")
    counts = run(_args(events["bootstrap"], events["topic"], uri))
    print(f"s3 {counts}\nlocal {local_counts}")
    assert {k: v for k, v in counts.items() if k not in TIMING} == \
        {k: v for k, v in local_counts.items() if k not in TIMING}
    assert (counts["episodes"], counts["pending_episodes"], counts["dead_letters"]) == (DONE, OPEN, 1), counts
    assert counts["events_uncommitted"] == 0
    _same_rows(uri, local)
    manifests = _manifests(uri)
    assert all(m["mode"] == "stream" and m["pane"] for m in manifests)
    assert [m["counts"]["pending_episodes"] for m in manifests if m["pending_file"]] == [OPEN]
    # One Delta transaction per table per commit that wrote to it, batch ids in commit order.
    [version] = list_dataset_versions(uri)
    steps_commits = [m["commit"] for m in manifests if any(f["path"].startswith("steps/") for f in m["files"])]
    assert [int(b["commit"]) for b in delta_batches(loc.join(uri, "steps"))] == steps_commits
    assert all(b["batch_id"].startswith(f"{version}/") for b in delta_batches(loc.join(uri, "steps")))
    options = delta_storage_options(uri)
    by_polars = pl.scan_delta(loc.join(uri, "trajectories"), storage_options=options).select(
        pl.len(), pl.col("episode_id").n_unique()).collect().row(0)
    written = DONE - counts["episodes_held"]  # a GRPO group not whole yet is held, not written
    assert counts["episodes_held"] == 2 and by_polars == (written, written), counts
    assert not [p for p in loc.list_files(uri) if "/_staging/" in p or p.endswith(".tmp")]
    # The readers: trajpipe query on the store counts what it counts on the local stream.
    on_s3, on_disk = _query(s3_env.env(), uri), _query({}, local)
    assert on_s3 == on_disk and on_s3[1] == {"what": "trajectories", "n": written, "episodes": written}, on_s3

    # A restart with no new input: the offsets are covered; the open episodes go back to the pending state.
    before = {t: _rows(uri, t) for t in TABLES}
    again = run(_args(events["bootstrap"], events["topic"], uri))
    print(f"restart {again}")
    assert (again["events_in"], again["episodes"], again["steps"], again["dead_letters"]) == (0, 0, 0, 0), again
    assert again["events_pending_in"] == again["events_pending_out"] > 0, again
    assert all(_rows(uri, t).equals(before[t]) for t in TABLES)


def test_restart_continues_from_the_committed_offsets(kafka_broker, s3_env):
    """Run 1 commits the finished episodes and the open ones as pending state; their tails are produced; run 2
    reads from the covered offsets only, feeds the pending events back and completes them: each episode once."""
    topic = create_topics(kafka_broker.bootstrap, f"test.stream-s3-restart.{uuid.uuid4().hex[:8]}")
    eps = episodes(12, seed=43)
    done, open_ = eps[:6], eps[6:]
    uri = s3_env.uri(f"restart-{uuid.uuid4().hex[:8]}", "datasets")
    args = _args(kafka_broker.bootstrap, topic, uri)
    produce_messages(kafka_broker.bootstrap, topic, _records(done) + _records([ep[:4] for ep in open_]))
    c1 = run(args)
    assert (c1["episodes"], c1["pending_episodes"], c1["incomplete_episodes"]) == (6, 6, 0), c1
    produce_messages(kafka_broker.bootstrap, topic, _records([ep[4:] for ep in open_]))
    c2 = run(args)
    assert (c2["episodes"], c2["events_pending_in"], c2["incomplete_episodes"]) == (6, 24, 0), c2
    assert c2["events_in"] == sum(len(ep) - 4 for ep in open_), c2  # only what run 1 did not cover
    for c in (c1, c2):
        assert (c["events_in"] + c["events_pending_in"] == c["events_used"] + c["events_incomplete"]
                + c["events_pending_out"] + c["dead_letters"] + c["duplicates"] + c["late_events"]), c
        assert c["events_uncommitted"] == 0, c
    trajs = _rows(uri, "trajectories")
    assert sorted(zip(trajs.column("episode_id").to_pylist(), trajs.column("complete").to_pylist())) == \
        sorted((ep[0].episode_id, True) for ep in eps)
    steps = _rows(uri, "steps")
    assert steps.num_rows == sum(ev.event_type == "step" for ep in eps for ev in ep) == c1["steps"] + c2["steps"]
    print(f"run 1 {c1}\nrun 2 {c2}")


#: ``trajpipe pipeline run`` whose process dies (no cleanup, no exception) when the commit of the pane with the
#: episodes reaches its Delta transactions: manifest written and files moved. (An exception there would not end
#: the job: Prism retries the bundle.) The SDK worker is in this process (LOOPBACK): the whole job dies with it.
CRASHING = """
import os, runpy, sys
from pipelines import delta_tables
publish = delta_tables.publish_commit
delta_tables.publish_commit = lambda root, m: os._exit(17) if any(
    f.path.startswith(("steps/", "trajectories/")) for f in m.files) else publish(root, m)
sys.argv = ["trajpipe", *sys.argv[1:]]
runpy.run_module("trajpipe", run_name="__main__")
"""


def test_crash_between_the_manifest_and_the_delta_transactions_then_restart(events, local_stream, s3_env,
                                                                          tmp_path):
    """The job's process dies after commit 1's manifest and moves, before its Delta transactions; the restart's
    recovery makes them, the stream continues from the covered offsets, and the dataset is the local stream's."""
    local, _ = local_stream
    uri = s3_env.uri(f"stream-crash-{uuid.uuid4().hex[:8]}", "datasets")
    args = _args(events["bootstrap"], events["topic"], uri)
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAJPIPE_")}, "PYTHONPATH": str(REPO)}
    proc = subprocess.Popen([sys.executable, "-c", CRASHING, "pipeline", "run", *args], cwd=tmp_path, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True, start_new_session=True)
    try:
        output, _ = proc.communicate(timeout=600)
    finally:
        with contextlib.suppress(ProcessLookupError):  # its Prism, orphaned by the crash
            os.killpg(proc.pid, signal.SIGKILL)
    assert proc.returncode == 17, output[-3000:]
    m = _manifests(uri)[-1]  # the commit point was passed (the pending-state commit may have come first) ...
    assert all(loc.exists(loc.join(uri, f["path"])) for f in m["files"])  # ... the files moved ...
    tables = {f["path"].split("/")[0] for f in m["files"] if f["path"].split("/")[0] in TABLES}
    assert tables and not any(loc.exists(loc.join(uri, t, "_delta_log")) for t in tables)  # ... no table holds it
    again = run(args)
    print(f"restart {again}")
    _same_rows(uri, local)
    assert [int(b["commit"]) for b in delta_batches(loc.join(uri, "trajectories"))] == [m["commit"]]
    trajs = _rows(uri, "trajectories").column("episode_id").to_pylist()
    assert len(trajs) == len(set(trajs)) == DONE - m["counts"]["episodes_held"]
    assert not [p for p in loc.list_files(uri) if "/_staging/" in p]
    # Everything read is covered by the crashed commit's offsets: the restart reads nothing new. (Had the crash
    # come before the end-of-stream pending commit, the open episodes' heads died with the job, as they do on a
    # local --out: docs/pipelines.md, "Semantics, honestly".)
    assert (again["events_in"], again["episodes"], again["steps"]) == (0, 0, 0), again


def test_a_pane_that_loses_the_manifest_race_is_planned_again_on_top_of_the_winner(events, local_stream, s3_env,
                                                                                  monkeypatch):
    """Another run commits number n (a dead letter of another topic) between the pane's planning and its
    commit: the commit log refuses the pane's commit (made against the snapshot it planned on), the pane
    deletes its staging, plans again
    on top of commit n and commits n + 1. Nothing is lost or doubled: the rows are the local stream's plus
    the rival's dead letter."""
    import msgspec

    from pipelines import stream_commit
    from pipelines.commit import DatasetManifest
    from pipelines.recipes import load_recipe
    from pipelines.sinks import stage_files
    from schemas.deadletter import DeadLetter

    local, local_counts = local_stream
    uri = s3_env.uri(f"stream-race-{uuid.uuid4().hex[:8]}", "datasets")
    commit_staged, rivals = stream_commit.commit_staged, []

    def a_rival_commits_first(layout, manifest, **kw):  # runs in the pane writer (LOOPBACK: this process)
        if not rivals:
            rival = msgspec.structs.replace(layout, run="rival")
            dead = DeadLetter(reason="bad_magic", message="a rival run's", source_topic="rival", source_partition=0,
                              source_offset=0, key=None, value=b"x", detected_by="test")
            stage_files(rival.staging(manifest.commit), load_recipe("outcome"), commit=manifest.commit,
                        dead_letters=[dead])
            rivals.append(commit_staged(rival, DatasetManifest(
                commit=manifest.commit, version=manifest.version, recipe_hash=manifest.recipe_hash, source="kafka",
                counts={"dead_letters": 1}), prior_norm=kw["prior_norm"], snapshot=rival.log.snapshot()))
        return commit_staged(layout, manifest, **kw)

    monkeypatch.setattr(stream_commit, "commit_staged", a_rival_commits_first)
    counts = run(_args(events["bootstrap"], events["topic"], uri))
    print(f"race {counts}")
    [rival] = rivals
    manifests = _manifests(uri)
    assert f"-rival/{rival.files[0].path}" in manifests[rival.commit - 1]["files"][0]["staged"]
    assert len(manifests) == rival.commit + local_counts["commits"]  # the pane's commit came after the rival's
    # The job's counts are its own commits' (the rival's commit is not among them).
    assert {k: v for k, v in counts.items() if k not in TIMING} == \
        {k: v for k, v in local_counts.items() if k not in TIMING}
    assert counts["commits"] == local_counts["commits"] and counts["events_uncommitted"] == 0
    for table in ("steps", "trajectories"):
        assert _rows(uri, table).equals(_rows(local, table)), table
    dead = _rows(uri, "dead_letters")
    assert sorted(dead.column("source_topic").to_pylist()) == sorted(["rival", events["topic"]])
    assert not [p for p in loc.list_files(uri) if "/_staging/" in p]


def test_a_bundle_retried_after_its_commit_commits_nothing_twice(events, local_stream, s3_env, monkeypatch):
    """The first pane commit fails after its manifest and Delta transactions (a store error there, say): Prism
    retries the bundle; the retry finds its pane committed (its staging name) and commits nothing again --
    no second dead letter, no extra commit."""
    from pipelines import stream_commit

    local, local_counts = local_stream
    uri = s3_env.uri(f"stream-retry-{uuid.uuid4().hex[:8]}", "datasets")
    commit_staged, failed = stream_commit.commit_staged, []

    def fail_once_after_the_commit(layout, manifest, **kw):  # in the pane writer (LOOPBACK: this process)
        written = commit_staged(layout, manifest, **kw)
        if not failed and any(f.path.startswith("dead_letters/") for f in written.files):
            failed.append(written.commit)
            raise OSError(f"simulated store error after commit {written.commit}")
        return written

    monkeypatch.setattr(stream_commit, "commit_staged", fail_once_after_the_commit)
    counts = run(_args(events["bootstrap"], events["topic"], uri))
    print(f"retried {counts}")
    assert failed, "no commit failed"
    assert len(_manifests(uri)) == local_counts["commits"]
    _same_rows(uri, local)  # the dead letter once
    assert not [p for p in loc.list_files(uri) if "/_staging/" in p]


@pytest.mark.parametrize("mode", ["batch", "stream"])
def test_credentials_the_store_refuses_are_one_line_before_any_kafka_read(mode, s3_env, tmp_path):
    uri = s3_env.uri(f"refused-{uuid.uuid4().hex[:8]}", "datasets")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAJPIPE_")}, "PYTHONPATH": str(REPO),
           "AWS_SECRET_ACCESS_KEY": "wrong"}
    proc = subprocess.run([sys.executable, "-m", "trajpipe", "pipeline", "run", "--source", "kafka", "--bootstrap",
                           "127.0.0.1:1", "--mode", mode, "--out", uri], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=300)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1, proc.stderr[-3000:]
    assert f"`--out` {uri} cannot be read" in lines[0] and "AWS_SECRET_ACCESS_KEY" in lines[0], lines
    assert "Traceback" not in proc.stderr and proc.stdout == ""
