"""The event archive on an S3-compatible store (SeaweedFS) from a real Kafka broker, held to a local archive.

`trajpipe archive --out s3://...` writes through :mod:`schemas.locations`: data files under temporary names
that carry the run's id, the manifest (naming the run) committed to the archive's commit log (the commit
point), moves, one Delta transaction per commit. These tests hold it, and its readers, to the same archive on
local disk:

* the same manifests (but ``created_at`` and the S3 manifest's ``run``), the same Parquet files byte for
  byte, the same ``_archive.json`` and the same rows through ``deltalake`` and polars ``scan_delta``;
* a rerun reads nothing new and adds nothing;
* a crash at each commit point, then a rerun: the same archive, no temporary file left (and so locally);
* two archivers at once on one archive: every event once (a loser ends with one error line, exit 2);
* ``pipeline run --source archive --archive s3://...`` gives the dataset the local archive gives;
* ``trajpipe catalog --data s3://... --archive s3://...`` the catalog the local copies give.
"""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import duckdb
import polars as pl
import pyarrow as pa
import pytest
from deltalake import DeltaTable
from kafka.admin import KafkaAdminClient, NewTopic

import streams.archive as archive_mod
from pipelines.trajectory_job import run
from schemas import locations as loc
from schemas.codec import encode_event
from schemas.storage import delta_storage_options
from streams import testhooks
from streams.archive import ARCHIVE_DELTA_APP, ArchiveError, Archiver, commit_log, read_commits
from streams.config import KafkaConnection
from streams.synth import generate_episodes
from tests.helpers import produce_messages, race_two_archivers

# ~2 min here on 2 busy cores (a Kafka broker, SeaweedFS, archiver runs, four job runs)
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
EPISODES = 40
EVERY = 150  # messages per archive commit: several commits


@pytest.fixture(scope="module")
def events_topic(kafka_broker) -> tuple[str, str, int]:
    """``(bootstrap, topic, events)``: synthetic episodes on a 3-partition topic, plus one undecodable record."""
    topic = f"test.archive-s3.{uuid.uuid4().hex[:8]}"
    admin = KafkaAdminClient(bootstrap_servers=kafka_broker.bootstrap)
    try:
        admin.create_topics([NewTopic(t, num_partitions=3 if t == topic else 1, replication_factor=1)
                             for t in (topic, topic + ".dlq", topic + ".ctl")])
    finally:
        admin.close()
    events = [ev for ep in generate_episodes(EPISODES, seed=17) for ev in ep]
    produce_messages(kafka_broker.bootstrap, topic, [(e.episode_id.encode(), encode_event(e)) for e in events]
                     + [(b"bad", b"not an event")])
    return kafka_broker.bootstrap, topic, len(events)


def _archiver(out, events_topic, dead: list | None = None) -> Archiver:
    bootstrap, topic, _ = events_topic
    return Archiver(out, conn=KafkaConnection(bootstrap_servers=bootstrap), topic=topic, commit_every=EVERY,
                    dead_letter=lambda rec, err: (dead if dead is not None else []).append((rec.offset, err.reason)))


@pytest.fixture(scope="module")
def local_archive(events_topic, tmp_path_factory) -> str:
    out = str(tmp_path_factory.mktemp("local") / "archive")
    counts = _archiver(out, events_topic).run()
    assert counts.events == events_topic[2] and counts.dead_letters == 1 and counts.commits >= 3
    return out


def _manifests(root: str) -> list[dict]:
    """The records of the archive's commit log, but what differs between runs."""
    docs = [json.loads(r) for r in commit_log(root).snapshot().records()]
    for d in docs:
        d.pop("created_at")
        d.pop("run")  # the run whose temporary files the manifest commits
    return docs


def _files(root: str) -> dict[str, bytes]:
    """Relative path -> bytes of every file but the Delta logs (timestamps; the manifests are compared above)."""
    out = {}
    for path in loc.list_files(root):
        rel = path[len(root.rstrip("/")) + 1:]
        if not rel.startswith(("_delta_log/", "_commit_log/")):
            out[rel] = loc.read_bytes(path)
    return out


def _delta_rows(root: str) -> pa.Table:
    rows = DeltaTable(root, storage_options=delta_storage_options(root) or None).to_pyarrow_dataset().to_table()
    return rows.sort_by([("event_id", "ascending")]).select(sorted(rows.column_names))


def _same_archive(uri: str, local: str) -> None:
    assert _manifests(uri) == _manifests(local)
    files = _files(uri)
    assert not [f for f in files if f.endswith(".tmp")], sorted(files)
    assert files == _files(local)  # _archive.json and every Parquet file, byte for byte
    s3_rows, local_rows = _delta_rows(uri), _delta_rows(local)
    assert s3_rows.num_rows == local_rows.num_rows > 0 and s3_rows.equals(local_rows)
    commits = read_commits(uri)
    dt = DeltaTable(uri, storage_options=delta_storage_options(uri))
    assert dt.transaction_version(ARCHIVE_DELTA_APP) == commits[-1].commit
    assert [int(h["trajpipe.commit"]) for h in reversed(dt.history()) if "trajpipe.commit" in h] == \
        [c.commit for c in commits]
    ids = pl.scan_delta(uri, storage_options=delta_storage_options(uri)).select("event_id").collect()["event_id"]
    assert ids.len() == ids.n_unique() == sum(c.events for c in commits)


def test_s3_archive_is_the_local_archive_and_a_rerun_adds_nothing(events_topic, local_archive, s3_env):
    uri = s3_env.uri(f"arch-{uuid.uuid4().hex[:8]}", "archive")
    dead: list = []
    counts = _archiver(uri, events_topic, dead).run()
    assert (counts.events, counts.dead_letters) == (events_topic[2], 1) and len(dead) == 1
    _same_archive(uri, local_archive)
    before = _files(uri)
    again = _archiver(uri, events_topic).run()
    assert (again.events, again.dead_letters, again.commits) == (0, 0, 0)
    assert _files(uri) == before and len(_manifests(uri)) == counts.commits


@pytest.mark.parametrize("where", ["s3", "local"])
@pytest.mark.parametrize("crash_at", ["before_manifest", "after_manifest", "before_delta"])
def test_crash_at_a_commit_point_then_rerun_gives_the_same_archive(events_topic, local_archive, request, tmp_path,
                                                                   monkeypatch, crash_at, where):
    """One commit protocol for both stores: a crash at each of its points, then a rerun, gives the archive an
    uninterrupted run gives."""
    if where == "s3":
        uri = request.getfixturevalue("s3_env").uri(f"crash-{crash_at}-{uuid.uuid4().hex[:8]}", "archive")
    else:
        uri = str(tmp_path / "archive")
    arch = _archiver(uri, events_topic)
    with monkeypatch.context() as m, contextlib.ExitStack() as hooks:
        if crash_at == "before_manifest":
            hooks.enter_context(testhooks.crash_before_manifest(2))
        elif crash_at == "after_manifest":  # commit 2's manifest committed, one of its files moved
            moves = []
            real_move = loc.move

            def move(src, dst):
                if "/c00000002.parquet." in os.fspath(src):
                    moves.append(src)
                    if len(moves) == 2:
                        raise ArchiveError("simulated crash after the manifest")
                real_move(src, dst)

            m.setattr(loc, "move", move)
        else:  # commit 2's files in place, no Delta transaction
            real_publish = archive_mod._publish_delta

            def publish(root, manifest, rows=None):
                if manifest.commit == 2:
                    raise ArchiveError("simulated crash before the Delta transaction")
                return real_publish(root, manifest, rows)

            m.setattr(archive_mod, "_publish_delta", publish)
        with pytest.raises(ArchiveError, match="simulated crash"):
            arch.run()
    assert len(read_commits(uri)) == (1 if crash_at == "before_manifest" else 2)
    if crash_at != "before_delta":
        assert loc.list_files(uri, suffix=".tmp")  # the crash left temporary files
    counts = _archiver(uri, events_topic).run()
    assert counts.commits >= 1
    _same_archive(uri, local_archive)


def test_two_archivers_at_once_archive_every_event_once(events_topic, local_archive, s3_env, tmp_path):
    """No lock on S3: two archivers plan the same commits; the commit log lets one make each. A loser
    ends with one error line (exit 2) and loses nothing: the next run reads its offsets again. A loser
    may have made commits before the one it lost (it started later, or won earlier ones): they count
    as archived although its run reports no counts, so the total is taken from the commit log."""
    bootstrap, topic, n = events_topic
    uri = s3_env.uri(f"race-{uuid.uuid4().hex[:8]}", "archive")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAJPIPE_")}, "PYTHONPATH": str(REPO),
           "TRAJPIPE_TOPICS__EVENTS": topic, "TRAJPIPE_TOPICS__DEAD_LETTERS": topic + ".dlq",
           "TRAJPIPE_TOPICS__CONTROL": topic + ".ctl", "TRAJPIPE_TOPICS__PARTITIONS": "3"}
    archived = race_two_archivers(bootstrap, uri, commit_every=EVERY, spool_root=tmp_path, cwd=REPO,
                                  env_of=lambda i: env)
    committed = sum(d["events"] for d in _manifests(uri))  # by either archiver
    assert archived <= committed <= n
    again = _archiver(uri, events_topic).run()  # a loser's rerun: what nobody committed
    assert committed + again.events == n
    assert set(_manifests(uri)[-1]["offsets"]) == set(_manifests(local_archive)[-1]["offsets"])
    s3_rows, local_rows = _delta_rows(uri), _delta_rows(local_archive)
    assert s3_rows.equals(local_rows)  # every event once, none lost
    assert not loc.list_files(uri, suffix=".tmp")


def _sorted_rows(root: str, table: str) -> pa.Table:
    rows = DeltaTable(loc.join(root, table)).to_pyarrow_dataset().to_table()
    keys = [("episode_id", "ascending")] + ([("step_index", "ascending")] if table == "steps" else [])
    return rows.sort_by(keys).select(sorted(rows.column_names))


@pytest.fixture(scope="module")
def s3_archive(events_topic, s3_store) -> str:
    from tests.s3_helpers import aws_environment

    with aws_environment(s3_store):
        uri = s3_store.uri(f"src-{uuid.uuid4().hex[:8]}", "archive")
        _archiver(uri, events_topic).run()
    return uri


def test_pipeline_reads_the_s3_archive_as_the_local_one(local_archive, s3_archive, s3_env, tmp_path):
    from_s3, from_local = str(tmp_path / "from-s3"), str(tmp_path / "from-local")
    counts = run(["--source", "archive", "--archive", s3_archive, "--out", from_s3])
    assert counts == run(["--source", "archive", "--archive", local_archive, "--out", from_local])
    assert counts["episodes"] == EPISODES
    for table in ("steps", "trajectories"):
        assert _sorted_rows(from_s3, table).equals(_sorted_rows(from_local, table)), table
    assert set(run(["--source", "archive", "--archive", s3_archive, "--out", from_s3]).values()) == {0}


def _cli(*args: str, env: dict[str, str] | None = None) -> tuple[int, str, str]:
    proc = subprocess.run([sys.executable, "-m", "trajpipe", *args], cwd=REPO, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO), **(env or {})})
    return proc.returncode, proc.stdout, proc.stderr


def test_catalog_over_s3_is_the_catalog_over_local_copies(local_archive, s3_archive, s3_env, tmp_path):
    data_uri = s3_env.uri(f"cat-{uuid.uuid4().hex[:8]}", "datasets")
    data_local = str(tmp_path / "datasets")
    assert run(["--source", "archive", "--archive", s3_archive, "--out", data_uri]) == \
        run(["--source", "archive", "--archive", local_archive, "--out", data_local])
    dbs = {}
    for name, data, arch in (("s3", data_uri, s3_archive), ("local", data_local, local_archive)):
        db = tmp_path / f"{name}.duckdb"
        rc, out, err = _cli("catalog", "--db", str(db), "--data", data, "--archive", arch)
        assert rc == 0, err[-3000:]
        counts = json.loads(out.strip().splitlines()[-1])
        assert counts.pop("db") == str(db)
        dbs[name] = (db, counts)
    assert dbs["s3"][1] == dbs["local"][1]
    assert set(dbs["s3"][1]["tables"]) >= {"events", "steps", "trajectories"}
    rows = {}
    for name, (db, counts) in dbs.items():
        con = duckdb.connect(str(db), read_only=True)  # the file alone: no AWS settings needed to read it
        try:
            rows[name] = {}
            for view in sorted(counts["tables"]) + ["commits", "dataset_versions"]:
                cols = [d[0] for d in con.execute(f"select * from {view} limit 0").description
                        if d[0] not in ("filename", "created_at", "opened_at", "newest_commit_at")]
                rows[name][view] = con.execute(f"select {', '.join(cols)} from {view} order by all").fetchall()
        finally:
            con.close()
    assert rows["s3"] == rows["local"]
    assert len(rows["s3"]["events"]) == len(rows["local"]["events"]) > 0


def test_bad_s3_locations_are_one_line(s3_env, tmp_path):
    missing = f"s3://no-such-bucket-{uuid.uuid4().hex[:6]}/archive"
    for args, flag in ((["archive", "--bootstrap", "127.0.0.1:1", "--out", missing, "--until-end"], "--out"),
                       (["query", "select 1", "--archive", missing], "--archive"),
                       (["pipeline", "run", "--source", "archive", "--archive", s3_env.uri("empty-prefix"),
                         "--out", str(tmp_path / "d")], "--archive")):
        rc, out, err = _cli(*args)
        lines = [line for line in err.splitlines() if line.startswith("error:")]
        assert rc == 2 and len(lines) == 1 and flag in lines[0] and "Traceback" not in err, err[-3000:]


def test_feedback_looks_the_episode_up_in_the_s3_archive(local_archive, s3_archive, events_topic, s3_env, tmp_path):
    """`trajpipe feedback --archive s3://...` finds the episode's envelope the local archive gives, and sends it."""
    bootstrap, topic, _ = events_topic
    episode = next(generate_episodes(EPISODES, seed=17))[0].episode_id
    env = {"TRAJPIPE_TOPICS__EVENTS": topic, "TRAJPIPE_TOPICS__DEAD_LETTERS": topic + ".dlq",
           "TRAJPIPE_TOPICS__CONTROL": topic + ".ctl", "TRAJPIPE_TOPICS__PARTITIONS": "3"}
    sent = []
    for arch in (s3_archive, local_archive):
        rc, out, err = _cli("feedback", "--episode", episode, "--score", "1", "--archive", arch, "--bootstrap",
                            bootstrap, "--spool-dir", str(tmp_path / "spool"), env=env)
        assert rc == 0, err[-3000:]
        sent.append(json.loads(out.strip().splitlines()[-1]))
    assert sent[0] == sent[1] and sent[0]["episode_id"] == episode and sent[0]["sent"] == 1
    rc, _, err = _cli("feedback", "--episode", "nope", "--score", "1", "--archive", s3_archive, "--bootstrap",
                      bootstrap, env=env)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "is in neither" in lines[0], err[-3000:]


def test_feedback_looks_the_episode_up_in_an_s3_dataset(local_archive, events_topic, s3_env, tmp_path):
    """`trajpipe feedback --data s3://...` finds the envelope (domain, task, policy version, steps) a local copy gives."""
    bootstrap, topic, _ = events_topic
    data_uri, local = s3_env.uri(f"fb-{uuid.uuid4().hex[:8]}", "datasets"), str(tmp_path / "datasets")
    for out in (data_uri, local):
        assert run(["--source", "archive", "--archive", local_archive, "--out", out])["episodes"] == EPISODES
    episode = next(generate_episodes(EPISODES, seed=17))[0].episode_id
    env = {"TRAJPIPE_TOPICS__EVENTS": topic, "TRAJPIPE_TOPICS__DEAD_LETTERS": topic + ".dlq",
           "TRAJPIPE_TOPICS__CONTROL": topic + ".ctl", "TRAJPIPE_TOPICS__PARTITIONS": "3"}
    sent = []
    for data in (data_uri, local):
        rc, out, err = _cli("feedback", "--episode", episode, "--step", "0", "--score", "0.5", "--data", data,
                            "--bootstrap", bootstrap, "--spool-dir", str(tmp_path / "spool"), env=env)
        assert rc == 0, err[-3000:]
        sent.append(json.loads(out.strip().splitlines()[-1]))
    assert sent[0] == sent[1] and sent[0]["episode_id"] == episode and sent[0]["sent"] == 1
    rc, _, err = _cli("feedback", "--episode", "nope", "--score", "1", "--data", data_uri, "--bootstrap",
                      bootstrap, env=env)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "is in neither" in lines[0], err[-3000:]
    rc, _, err = _cli("feedback", "--episode", episode, "--score", "1", "--data", s3_env.uri("no-dataset-here"),
                      "--bootstrap", bootstrap, env=env)
    lines = [line for line in err.splitlines() if line.startswith("error:")]
    assert rc == 2 and len(lines) == 1 and "--data" in lines[0] and "Traceback" not in err, err[-3000:]
