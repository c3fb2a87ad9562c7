"""The archiver against real brokers: exact counts, idempotent reruns, crash recovery."""

from __future__ import annotations

import json
import time
import subprocess
import sys
from pathlib import Path

import duckdb
import msgspec
import pytest
from kafka import KafkaProducer

from schemas.codec import encode_event
from streams import testhooks
from streams.archive import ArchiveError, Archiver, committed_files, read_commits, recover_archive
from streams.config import KafkaConnection, Topics
from streams.synth import generate_episodes

ENGINES = ["kafka", "tansu"]


def _cli(*args: str) -> str:
    out = subprocess.run(
        [sys.executable, "-m", "trajpipe", *args], check=True, capture_output=True, text=True, timeout=300
    )
    return out.stdout.strip().splitlines()[-1]


def _count(archive: Path) -> tuple[int, int]:
    return duckdb.execute(
        f"select count(*), count(distinct event_id) from read_parquet('{archive}/**/*.parquet', hive_partitioning=true)"
    ).fetchall()[0]


def _settings_env(monkeypatch, topic: str) -> None:
    # The CLI reads topic names from TRAJPIPE_* so each test gets its own topics.
    monkeypatch.setenv("TRAJPIPE_TOPICS__EVENTS", topic)
    monkeypatch.setenv("TRAJPIPE_TOPICS__DEAD_LETTERS", topic + ".dlq")
    monkeypatch.setenv("TRAJPIPE_TOPICS__CONTROL", topic + ".ctl")


@pytest.mark.integration
@pytest.mark.parametrize("engine", ENGINES)
def test_synth_then_archive_exact_counts(engine, request, topic_name, tmp_path, monkeypatch):
    broker = request.getfixturevalue(f"{engine}_broker")
    _settings_env(monkeypatch, topic_name)
    monkeypatch.setenv("TRAJPIPE_SPOOL_DIR", str(tmp_path / "spool"))
    synth = json.loads(_cli("synth", "--bootstrap", broker.bootstrap, "--episodes", "200", "--seed", "3"))
    assert synth["episodes"] == 200
    archive = tmp_path / "archive"
    first = json.loads(_cli("archive", "--bootstrap", broker.bootstrap, "--out", str(archive), "--until-end"))
    assert first["events"] == synth["events"] and first["dead_letters"] == 0
    assert _count(archive) == (synth["events"], synth["events"])
    again = json.loads(_cli("archive", "--bootstrap", broker.bootstrap, "--out", str(archive), "--until-end"))
    assert again == {"events": 0, "dead_letters": 0, "commits": 0}
    assert _count(archive) == (synth["events"], synth["events"])
    _assert_delta_matches_manifests(archive)


def _assert_delta_matches_manifests(archive: Path) -> None:
    """The archive's Delta table holds each commit once (its transaction) and exactly the manifests' rows."""
    import polars as pl
    from deltalake import DeltaTable

    from streams.archive import ARCHIVE_DELTA_APP

    commits = [c for c in read_commits(archive) if c.files]
    table = DeltaTable(str(archive))
    assert table.transaction_version(ARCHIVE_DELTA_APP) == commits[-1].commit
    assert [int(h["trajpipe.commit"]) for h in reversed(table.history()) if "trajpipe.commit" in h] == \
        [c.commit for c in commits]
    ids = pl.scan_delta(str(archive)).select("event_id").collect()["event_id"]
    assert ids.len() == ids.n_unique() == sum(c.events for c in commits)


def _produce(bootstrap: str, topic: str, episodes: int, seed: int, extra: list[bytes] = ()) -> int:
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", linger_ms=5)
    n = 0
    for ep in generate_episodes(episodes, seed=seed):
        for ev in ep:
            producer.send(topic, key=ev.episode_id.encode(), value=encode_event(ev))
            n += 1
    for raw in extra:
        producer.send(topic, key=b"bad", value=raw)
    producer.flush()
    producer.close()
    return n


def _archiver(tmp_path: Path, bootstrap: str, topic: str, dead: list, commit_every: int = 300) -> Archiver:
    return Archiver(
        tmp_path / "archive", conn=KafkaConnection(bootstrap_servers=bootstrap), topic=topic,
        dead_letter=lambda rec, err: dead.append((rec.offset, err.reason)), commit_every=commit_every,
    )


@pytest.mark.integration
def test_episode_locality_and_order(kafka_broker, topic_name, tmp_path):
    from streams.admin import ensure_topics

    ensure_topics(KafkaConnection(bootstrap_servers=kafka_broker.bootstrap), Topics(events=topic_name, partitions=3,
                  dead_letters=topic_name + ".dlq", control=topic_name + ".ctl"))
    n = _produce(kafka_broker.bootstrap, topic_name, 60, seed=5)
    counts = _archiver(tmp_path, kafka_broker.bootstrap, topic_name, []).run()
    assert counts.events == n and counts.commits >= 2
    con = duckdb.connect()
    rel = f"read_parquet('{tmp_path}/archive/**/*.parquet', hive_partitioning=true, filename=true)"
    # one bucket per episode across all commits
    assert con.execute(f"select max(c) from (select count(distinct bucket) c from {rel} group by episode_id)").fetchall()[0][0] == 1
    # seq gap-free from 0 per episode, rows sorted by (episode_id, seq) inside every file
    assert con.execute(f"select count(*) from (select episode_id, max(seq) m, count(*) c from {rel} "
                   f"group by episode_id) where m + 1 != c").fetchall()[0][0] == 0
    for f in committed_files(tmp_path / "archive"):
        keys = con.sql(f"select episode_id, seq from read_parquet('{f}')").fetchall()
        assert keys == sorted(keys)


@pytest.mark.integration
def test_crash_between_data_and_manifest_then_rerun(kafka_broker, topic_name, tmp_path):
    n = _produce(kafka_broker.bootstrap, topic_name, 50, seed=9)
    arch = _archiver(tmp_path, kafka_broker.bootstrap, topic_name, [], commit_every=200)
    with testhooks.crash_before_manifest(2), pytest.raises(ArchiveError, match="simulated crash"):
        arch.run()
    # commit 1 is in place; commit 2's files exist only under temporary names (which name the run)
    assert len(read_commits(tmp_path / "archive")) == 1
    assert list((tmp_path / "archive").glob("bucket=*/c00000002.parquet.*.tmp"))
    first_rows = _count(tmp_path / "archive")[0]
    assert 0 < first_rows < n
    counts = _archiver(tmp_path, kafka_broker.bootstrap, topic_name, [], commit_every=200).run()
    assert not list((tmp_path / "archive").glob("bucket=*/*.tmp"))
    assert _count(tmp_path / "archive") == (n, n)
    assert counts.events == n - first_rows
    # offsets are contiguous across commits: no gap, no overlap
    spans = sorted((p, r.start, r.end) for c in read_commits(tmp_path / "archive") for p, r in c.offsets.items())
    for (p1, _, e1), (p2, s2, _) in zip(spans, spans[1:]):
        if p1 == p2:
            assert e1 == s2
    _assert_delta_matches_manifests(tmp_path / "archive")


def test_recover_rolls_forward_a_committed_manifest(tmp_path):
    from streams.archive import write_commit
    from schemas.events import Feedback

    root = tmp_path / "a"
    ev = Feedback(event_id="f", episode_id="e", seq=0, producer_id="p", domain="d", task_id="t", source="s")
    m = write_commit(root, commit=1, topic="t", buckets=4, events=[ev], positions=[(0, 0)], offsets={}, run="r1")
    final = root / m.files[0]
    final.rename(final.with_name(final.name + ".r1.tmp"))  # as if the crash came after the commit, before the move
    other = final.with_name(final.name + ".r0.tmp")  # a rival's (or crashed run's) file of the same commit
    other.write_bytes(b"a loser's file")
    assert recover_archive(root) == 2
    assert final.exists() and not other.exists() and committed_files(root) == [final]


def test_a_loser_whose_files_a_winners_recovery_removed_mid_write_gets_the_conflict(tmp_path, monkeypatch):
    """The race of test_two_archivers_at_once_...: the winner makes commit 1 and runs its recovery while the
    loser still writes commit 1's files; the recovery removes them (a commit made that does not name their
    run) and the loser's fsync found no file: it ended with "error: [Errno 2] No such file or directory"
    instead of the conflict. It is the conflict: nothing of the loser's is left, the winner's commit stands."""
    import pyarrow.parquet as pq

    from schemas.events import Feedback
    from streams import archive
    from streams.archive import ArchiveConflict, _snapshot, write_commit

    root = tmp_path / "a"
    evs = [Feedback(event_id=f"f{i}", episode_id=f"e{i}", seq=0, producer_id="p", domain="d", task_id="t",
                    source="s") for i in range(8)]
    write_commit(root, commit=1, topic="t", buckets=4, events=evs[:1], positions=[(0, 0)], offsets={}, run="w0")
    planned = _snapshot(root)  # both plan commit 2 from here
    real_write = pq.write_table
    raced = []

    def write_then_lose(table, path, **kw):
        real_write(table, path, **kw)
        if not raced:  # after the loser's first file: the winner commits 2, then recovers
            raced.append(path)
            monkeypatch.setattr(archive.pq, "write_table", real_write)
            write_commit(root, commit=2, topic="t", buckets=4, events=evs[1:2], positions=[(0, 1)], offsets={},
                         run="winner")
            assert recover_archive(root) >= 1  # the loser's file of commit 2: removed

    monkeypatch.setattr(archive.pq, "write_table", write_then_lose)
    with pytest.raises(ArchiveConflict, match="another archiver made commit 2"):
        write_commit(root, commit=2, topic="t", buckets=4, events=evs[2:], positions=[(0, i) for i in range(2, 8)],
                     offsets={}, run="loser", snapshot=planned)
    assert raced and not list(root.rglob("*.loser.tmp"))
    assert [c.events for c in read_commits(root)] == [1, 1]


def test_recover_adds_a_commit_missing_from_the_delta_table(tmp_path):
    """A crash after the renames, before the Delta transaction: recovery adds the commit, once."""
    import shutil

    from deltalake import DeltaTable

    from schemas.events import Feedback
    from streams.archive import ARCHIVE_DELTA_APP, write_commit

    root = tmp_path / "a"
    evs = [Feedback(event_id=f"f{i}", episode_id=f"e{i}", seq=0, producer_id="p", domain="d", task_id="t",
                    source="s") for i in range(6)]
    write_commit(root, commit=1, topic="t", buckets=4, events=evs[:3], positions=[(0, i) for i in range(3)],
                 offsets={})
    shutil.rmtree(root / "_delta_log")  # as if commit 1 had crashed before its transaction
    assert recover_archive(root) == 1 and recover_archive(root) == 0
    assert DeltaTable(str(root)).to_pyarrow_dataset().count_rows() == 3
    # and if a writer skipped recovery, the next commit adds the missing one first, in order
    shutil.rmtree(root / "_delta_log")
    write_commit(root, commit=2, topic="t", buckets=4, events=evs[3:], positions=[(0, i) for i in range(3, 6)],
                 offsets={})
    table = DeltaTable(str(root))
    assert table.to_pyarrow_dataset().count_rows() == 6 and table.transaction_version(ARCHIVE_DELTA_APP) == 2
    assert [h["trajpipe.commit"] for h in reversed(table.history())] == ["1", "2"]


@pytest.mark.integration
def test_bad_messages_go_to_dead_letters_and_are_counted(tansu_broker, topic_name, tmp_path):
    good = encode_event(next(iter(generate_episodes(1, seed=1)))[0])
    bad = [b"garbage", good[:10], good[:4] + b"\x00\x63" + good[6:]]
    n = _produce(tansu_broker.bootstrap, topic_name, 5, seed=2, extra=bad)
    dead: list = []
    counts = _archiver(tmp_path, tansu_broker.bootstrap, topic_name, dead).run()
    assert counts.events == n and counts.dead_letters == 3 and counts.messages == n + 3
    assert sorted(r for _, r in dead) == ["bad_magic", "future_version", "truncated"]
    assert sum(c.dead_letters for c in read_commits(tmp_path / "archive")) == 3


def test_archive_refuses_another_topic(tmp_path):
    _archiver(tmp_path, "127.0.0.1:1", "topic-a", [])
    with pytest.raises(ArchiveError, match="topic-a"):
        _archiver(tmp_path, "127.0.0.1:1", "topic-b", [])


def test_damaged_archive_metadata_is_an_archive_error(tmp_path):
    # Found by the fuzzer (tests/streams/test_archive_fuzz.py): a damaged _archive.json raised JSONDecodeError,
    # KeyError or AttributeError, and `buckets: 0` would divide by zero in bucket_of.
    from streams.archive import _init_archive

    _init_archive(tmp_path, topic="t", buckets=4)
    for text, says in [("{not json", "is not JSON"), ("[1]", "holds a list"),
                       ('{"format": 1, "topic": "t"}', "`buckets` must be an integer >= 1"),
                       ('{"format": 1, "topic": "t", "buckets": 0}', "got 0"),
                       ('{"format": 1, "topic": "t", "buckets": null}', "got None")]:
        (tmp_path / "_archive.json").write_text(text)
        with pytest.raises(ArchiveError, match=says):
            _init_archive(tmp_path, topic="t", buckets=4)


def test_a_manifest_naming_a_file_outside_the_archive_is_an_archive_error(tmp_path):
    from streams.archive import CommitManifest, PartitionRange, commit_log, read_commits

    for i, outside in enumerate(("/etc/passwd", "../other/c00000001.parquet", "bucket=00/../../x.parquet")):
        manifest = CommitManifest(commit=1, topic="t", offsets={0: PartitionRange(0, 1)}, files=[outside], events=1)
        in_log, legacy = tmp_path / f"log-{i}", tmp_path / f"legacy-{i}"
        commit_log(in_log).snapshot().commit(msgspec.json.encode(manifest))  # the commit log's record
        (legacy / "_commits").mkdir(parents=True)  # a manifest file of the earlier layout
        (legacy / "_commits" / "00000001.json").write_bytes(msgspec.json.encode(manifest))
        for root in (in_log, legacy):
            with pytest.raises(ArchiveError, match="outside the archive"):
                read_commits(root)


def test_following_archiver_waits_for_a_broker_that_went_away(tmp_path, caplog):
    """A broker outage must not end a following archiver: it logs, waits and reads again from its last commit
    (before, the first failed offset lookup raised out of `trajpipe archive` and the archiver was gone)."""
    import logging
    import threading

    from tests.helpers import free_port

    archiver = Archiver(tmp_path / "archive", conn=KafkaConnection(bootstrap_servers=f"127.0.0.1:{free_port()}",
                                                                    request_timeout_ms=1_000),
                        topic="t", dead_letter=lambda rec, err: None)
    stop = threading.Event()
    result: dict = {}

    def follow() -> None:
        try:
            result["counts"] = archiver.run(until_end=False, stop=stop, poll_interval_s=0.1, retry_s=0.1)
        except Exception as err:  # noqa: BLE001 - the assertion below names it
            result["error"] = err

    with caplog.at_level(logging.WARNING, logger="streams.archive"):
        thread = threading.Thread(target=follow)
        thread.start()
        deadline = time.monotonic() + 120  # a failure bound only: two failed lookups are the condition
        while sum("Kafka unreachable" in r.getMessage() for r in caplog.records) < 2 and time.monotonic() < deadline:
            time.sleep(0.1)
        stop.set()
        thread.join(timeout=60)
    assert "error" not in result, result
    assert result["counts"].events == 0
    assert sum("Kafka unreachable" in r.getMessage() for r in caplog.records) >= 2


def _offsets_contiguous(archive: Path) -> None:
    """Across commits, each partition's ranges follow one another: no gap, no overlap."""
    spans = sorted((p, r.start, r.end) for c in read_commits(archive) for p, r in c.offsets.items())
    for (p1, _, e1), (p2, s2, _) in zip(spans, spans[1:]):
        if p1 == p2:
            assert e1 == s2, spans


@pytest.mark.integration
def test_two_archivers_at_once_on_a_local_archive_archive_every_event_once(kafka_broker, topic_name, tmp_path):
    """The local twin of tests/storage/test_archive_s3.py's race: two `trajpipe archive` processes plan the same
    commits of one local directory; the commit log lets one make each. A loser deletes its temporary files and
    ends with one error line (exit 2), losing nothing: the next run reads its offsets again. Commits a loser
    made before the one it lost stay archived (its run reports no counts: the archive is counted)."""
    from streams.admin import ensure_topics
    from tests.helpers import race_two_archivers, topic_env

    ensure_topics(KafkaConnection(bootstrap_servers=kafka_broker.bootstrap), Topics(
        events=topic_name, partitions=3, dead_letters=topic_name + ".dl", control=topic_name + ".ctl"))
    n = _produce(kafka_broker.bootstrap, topic_name, 40, seed=17)
    archive = tmp_path / "archive"
    archived = race_two_archivers(kafka_broker.bootstrap, str(archive), commit_every=150, spool_root=tmp_path,
                                  cwd=Path(__file__).resolve().parents[2],
                                  env_of=lambda i: topic_env(topic_name, tmp_path / f"spool-{i}", partitions=3))
    committed, distinct = _count(archive)
    assert committed == distinct and archived <= committed <= n  # each event once, the winners' among them
    again = _archiver(tmp_path, kafka_broker.bootstrap, topic_name, []).run()  # a loser's rerun
    assert committed + again.events == n
    assert _count(archive) == (n, n)
    assert not list(archive.glob("bucket=*/*.tmp"))
    _offsets_contiguous(archive)
    _assert_delta_matches_manifests(archive)


@pytest.mark.integration
def test_a_loser_that_made_commits_first_says_so_and_they_stay_archived(kafka_broker, topic_name, tmp_path):
    """The race the process test can hit in either order, made deterministic: archiver A makes commit 1, then B
    (started meanwhile) archives the rest as commits 2..; A's commit 2 is refused. Its one error says what A
    did archive, and the archive holds every event once."""
    from streams.archive import ArchiveConflict

    n = _produce(kafka_broker.bootstrap, topic_name, 20, seed=23)
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap)
    other: list = []

    def after_commit(counts) -> None:
        if counts.commits == 1 and not other:
            other.append(Archiver(tmp_path / "archive", conn=conn, topic=topic_name, dead_letter=lambda r, e: None,
                                  commit_every=60).run())

    loser = Archiver(tmp_path / "archive", conn=conn, topic=topic_name, dead_letter=lambda r, e: None,
                     commit_every=60, progress=after_commit)
    with pytest.raises(ArchiveConflict) as caught:
        loser.run()
    first = read_commits(tmp_path / "archive")[0].events
    assert first == 60 and other[0].commits >= 1 and first + other[0].events == n
    assert str(caught.value).startswith("another archiver made commit 2 of ")
    assert str(caught.value).endswith(f"; before it this run made 1 commit(s) of {first} events, which stay archived")
    assert _count(tmp_path / "archive") == (n, n)
    assert not list((tmp_path / "archive").glob("bucket=*/*.tmp"))


def _to_legacy_layout(archive: Path) -> list[bytes]:
    """Turn an archive back into the earlier layout: its log's records as ``_commits/<n>.json``, no log."""
    import shutil

    from streams.archive import commit_log

    records = commit_log(archive).snapshot().records()
    (archive / "_commits").mkdir()
    for n, record in enumerate(records, start=1):
        (archive / "_commits" / f"{n:08d}.json").write_bytes(record)
    shutil.rmtree(archive / "_commit_log")
    return records


def _what_readers_see(archive: Path) -> dict:
    from pipelines.archive_source import list_archive_files

    files = committed_files(archive)
    rows = duckdb.execute(f"select * exclude (filename) from read_parquet({[str(f) for f in files]}, "
                          "hive_partitioning=true, filename=true) order by event_id").fetchall()
    query = json.loads(subprocess.run(
        [sys.executable, "-m", "trajpipe", "query", "--archive", str(archive), "--format", "json",
         "select count(*) n, count(distinct event_id) ids from events"],
        check=True, capture_output=True, text=True, timeout=300).stdout.strip().splitlines()[-1])
    return {"manifests": [msgspec.to_builtins(c) for c in read_commits(archive)], "files": files,
            "source": list_archive_files(archive), "rows": rows, "query": query}


@pytest.mark.integration
def test_an_archive_of_the_earlier_layout_is_read_then_imported_and_continued(kafka_broker, topic_name, tmp_path):
    """Manifest files `_commits/<n>.json` (no commit log): readers read them as they read the log; the next
    archiver run imports them (the same bytes, in order), removes them, and continues: every event once."""
    from streams.archive import commit_log

    first = _produce(kafka_broker.bootstrap, topic_name, 20, seed=21)
    archive = tmp_path / "archive"
    assert _archiver(tmp_path, kafka_broker.bootstrap, topic_name, [], commit_every=80).run().events == first
    seen = _what_readers_see(archive)
    assert seen["query"] == {"n": first, "ids": first} and len(seen["manifests"]) >= 2
    legacy = _to_legacy_layout(archive)
    assert not (archive / "_commit_log").exists() and _what_readers_see(archive) == seen
    more = _produce(kafka_broker.bootstrap, topic_name, 10, seed=22)
    counts = _archiver(tmp_path, kafka_broker.bootstrap, topic_name, [], commit_every=80).run()
    assert counts.events == more
    assert not (archive / "_commits").exists()
    assert commit_log(archive).snapshot().records()[: len(legacy)] == legacy  # imported byte for byte
    assert [c.commit for c in read_commits(archive)] == list(range(1, len(legacy) + counts.commits + 1))
    assert _count(archive) == (first + more, first + more)
    _offsets_contiguous(archive)
    _assert_delta_matches_manifests(archive)


def test_recovery_of_an_archive_of_the_earlier_layout_imports_it_and_settles_its_temporary_files(tmp_path):
    """A local archive that an earlier trajpipe left mid-commit: `_commits/` manifests and temporary files named
    `c<n>.parquet.tmp` (no run). Recovery imports the manifests, rolls forward the file of the made commit and
    removes the one no manifest names."""
    from schemas.events import Feedback
    from streams.archive import commit_log, write_commit

    root = tmp_path / "a"
    ev = Feedback(event_id="f", episode_id="e", seq=0, producer_id="p", domain="d", task_id="t", source="s")
    m = write_commit(root, commit=1, topic="t", buckets=4, events=[ev], positions=[(0, 0)], offsets={})
    legacy = _to_legacy_layout(root)
    final = root / m.files[0]
    final.rename(final.with_name(final.name + ".tmp"))  # the earlier layout's temporary name
    orphan = root / "bucket=00" / "c00000002.parquet.tmp"  # a commit whose manifest was never written
    orphan.parent.mkdir(exist_ok=True)
    orphan.write_bytes(b"half a commit")
    assert read_commits(root)[0].files == m.files  # read from _commits/ as it is
    assert recover_archive(root) == 2
    assert final.exists() and not orphan.exists() and not (root / "_commits").exists()
    assert commit_log(root).snapshot().records() == legacy and committed_files(root) == [final]
