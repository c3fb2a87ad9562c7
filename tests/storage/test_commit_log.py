"""The Delta commit log (schemas/commit_log.py): gap-free commits, one winner per commit number, time travel.

Locally and against a real S3-compatible server (SeaweedFS, the ``s3_env`` fixture); the race is two
processes committing as fast as they can to one log.
"""

from __future__ import annotations

import concurrent.futures
import json
import multiprocessing
import os
import shutil
import time

import pytest
from deltalake import DeltaTable

from schemas import locations as loc
from schemas.commit_log import CommitLog, CommitLogError, CommitTaken

RACE_COMMITS = 15


def _where(tmp_path, s3_env, kind: str, name: str) -> str:
    return str(tmp_path / name) if kind == "local" else s3_env.uri("commit-log", name)


@pytest.fixture(params=["local", "s3"])
def kind(request):
    return request.param


@pytest.fixture
def maybe_s3(kind, request):
    return request.getfixturevalue("s3_env") if kind == "s3" else None


def test_commits_are_numbered_from_one_and_read_back_in_order(tmp_path, kind, maybe_s3):
    log = CommitLog(_where(tmp_path, maybe_s3, kind, "log-a"), app_id="trajpipe.a")
    assert not log.exists() and log.head() == 0 and log.snapshot().records() == []
    snap = log.snapshot()
    for n in range(1, 4):
        assert snap.commit(json.dumps({"commit": n}).encode(), metadata={"trajpipe.batch_id": f"a/{n}"}) == n
    assert log.exists() and log.head() == 3
    fresh = log.snapshot()
    assert [json.loads(r)["commit"] for r in fresh.records()] == [1, 2, 3]
    assert [json.loads(r)["commit"] for r in fresh.records(after=1)] == [2, 3]
    # time travel: the log as of commit 2 (and of commit 0: empty)
    assert [json.loads(r)["commit"] for r in log.snapshot(as_of=2).records()] == [1, 2]
    assert log.snapshot(as_of=0).records() == []
    with pytest.raises(CommitLogError, match="has commits 1..3, not 7"):
        log.snapshot(as_of=7)
    # the log table version n is commit n, and the extra metadata is on it; the log adds no data file
    dt = DeltaTable(log.root, storage_options=log._options)
    assert dt.version() == 3 and dt.transaction_version("trajpipe.a") == 3
    assert dt.history(limit=1)[0]["trajpipe.batch_id"] == "a/3"
    assert dt.file_uris() == []


def _records_in_a_fork(log: CommitLog, after: int, queue) -> None:
    queue.put(log.read_records(after=after))


def test_a_reader_reads_the_same_records_from_the_files_even_in_a_forked_process(tmp_path, kind, maybe_s3):
    """read_records parses the commit files itself: the same records as a snapshot, and it works in a child
    forked after deltalake ran in the parent (the trainer's DataLoader workers), where deltalake panics."""
    log = CommitLog(_where(tmp_path, maybe_s3, kind, "log-r"), app_id="trajpipe.r")
    assert log.read_records() == []
    snap = log.snapshot()
    for n in range(1, 4):
        snap.commit(json.dumps({"commit": n}).encode())
    assert log.read_records() == log.snapshot().records() and len(log.read_records()) == 3
    assert log.read_records(after=1) == log.snapshot().records(after=1)
    assert log.read_records(as_of=2) == log.snapshot(as_of=2).records()
    with pytest.raises(CommitLogError, match="has commits 1..3, not 4"):
        log.read_records(as_of=4)
    queue = multiprocessing.get_context("fork").Queue()
    child = multiprocessing.get_context("fork").Process(target=_records_in_a_fork, args=(log, 1, queue))
    child.start()
    got = queue.get(timeout=60)
    child.join(timeout=60)
    assert child.exitcode == 0 and got == log.read_records(after=1)


def test_a_stale_snapshot_cannot_commit_over_a_rival(tmp_path, kind, maybe_s3):
    """Two writers plan commit 2 from the same read: one commits, the other is told (and made nothing)."""
    log = CommitLog(_where(tmp_path, maybe_s3, kind, "log-b"), app_id="trajpipe.b")
    log.snapshot().commit(b'{"commit": 1}')
    mine, rival = log.snapshot(), log.snapshot()
    assert mine.commit(b'{"commit": 2, "who": "mine"}') == 2
    with pytest.raises(CommitTaken, match="commit 2 of .* was made by another writer first"):
        rival.commit(b'{"commit": 2, "who": "rival"}')
    assert [json.loads(r).get("who") for r in log.snapshot().records()] == [None, "mine"]
    # the winner goes on from its snapshot; a rival's later commit from the old read is refused too
    assert mine.commit(b'{"commit": 3}') == 3
    with pytest.raises(CommitTaken):
        rival.commit(b'{"commit": 2}')
    # a fresh read can commit again
    assert log.snapshot().commit(b'{"commit": 4}') == 4


def test_two_logs_in_one_directory_tree_do_not_interfere(tmp_path, kind, maybe_s3):
    a = CommitLog(_where(tmp_path, maybe_s3, kind, "logs/v1"), app_id="trajpipe.v1")
    b = CommitLog(_where(tmp_path, maybe_s3, kind, "logs/v2"), app_id="trajpipe.v2")
    a.snapshot().commit(b"1")
    b.snapshot().commit(b"x")
    b.snapshot().commit(b"y")
    assert a.snapshot().records() == [b"1"] and b.snapshot().records() == [b"x", b"y"]


def test_a_snapshot_after_a_rivals_commit_plans_the_next_number(tmp_path):
    log = CommitLog(tmp_path / "log-c", app_id="trajpipe.c")
    mine = log.snapshot()
    log.snapshot().commit(b"theirs")
    with pytest.raises(CommitTaken):
        mine.commit(b"mine")  # the log did not exist when `mine` was read; the rival created it and made 1
    again = log.snapshot()
    assert again.head == 1 and again.commit(b"mine") == 2


def _create_and_commit(root: str, env: dict[str, str], writer: int, at: float) -> str:
    os.environ.update(env)
    while time.time() < at:  # the writers start together
        pass
    try:
        return str(CommitLog(root, app_id="trajpipe.c").snapshot().commit(b'{"writer": %d}' % writer))
    except CommitTaken:
        return "taken"


def _creates(log: CommitLog) -> int:
    names = loc.list_files(loc.join(log.root, "_delta_log"), suffix=".json")
    return sum(b'"operation":"CREATE TABLE"' in loc.read_bytes(name) for name in names)


@pytest.mark.slow
def test_writers_creating_the_log_at_once_create_it_once(tmp_path, kind, maybe_s3):
    """Four processes make the first commit of a new log at the same moment, several times: one creates the
    table and one makes commit 1. delta-rs retried a create that lost the race for version 0 as version 1 (a
    second CREATE TABLE: 8 rounds of 10 here), which moved commit 1 to version 2, and ``read_records`` (version v
    = commit v) failed 'lacks the record of commit 1' (seen once in CI on SeaweedFS)."""
    env = maybe_s3.env() if maybe_s3 is not None else {}
    rounds = 6 if kind == "local" else 3
    with concurrent.futures.ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("spawn")) as pool:
        list(pool.map(_create_and_commit, [_where(tmp_path, maybe_s3, kind, f"warm-{i}") for i in range(4)],
                      [env] * 4, range(4), [0.0] * 4))  # the workers have started and imported deltalake
        for r in range(rounds):
            root = _where(tmp_path, maybe_s3, kind, f"log-created-{r}")
            at = time.time() + 0.3
            got = list(pool.map(_create_and_commit, [root] * 4, [env] * 4, range(4), [at] * 4))
            # a worker done early may take a second writer's turn after commit 1: it makes commit 2
            made = {int(n): w for w, n in enumerate(got) if n != "taken"}
            assert sorted(made) == list(range(1, len(made) + 1)) and 1 in made, got
            log = CommitLog(root, app_id="trajpipe.c")
            assert _creates(log) == 1
            assert log.read_records() == log.snapshot().records() == [b'{"writer": %d}' % made[n] for n in sorted(made)]


def test_a_log_created_twice_before_the_fix_reads_the_same_both_ways(tmp_path):
    """A log with a second CREATE TABLE at version 1 (what the race above made before ``_create`` stopped
    retrying): commit n is at version n + 1, and both readers find every record by its commit number."""
    log = CommitLog(tmp_path / "log-twice", app_id="trajpipe.t")
    snap = log.snapshot()
    snap.commit(b"one"), snap.commit(b"two")
    d = tmp_path / "log-twice" / "_delta_log"
    names = [d / f"{v:020d}.json" for v in range(4)]
    names[2].rename(names[3]), names[1].rename(names[2])
    shutil.copyfile(names[0], names[1])
    assert _creates(log) == 2
    assert log.read_records() == log.snapshot().records() == [b"one", b"two"]
    assert log.read_records(after=1) == log.snapshot().records(after=1) == [b"two"]
    assert log.read_records(as_of=1) == log.snapshot(as_of=1).records() == [b"one"]
    assert log.snapshot().commit(b"three") == 3 and log.read_records(after=2) == [b"three"]


def _race(root: str, app_id: str, writer: str, env: dict[str, str], ready, start, results) -> None:
    """One writer: RACE_COMMITS commits, re-reading the log after each lost race."""
    os.environ.update(env)
    log = CommitLog(root, app_id=app_id)
    log.snapshot()  # warm up before the start line
    ready.put(writer)
    start.wait(180)
    made, lost = [], 0
    try:
        while len(made) < RACE_COMMITS:
            snap = log.snapshot()
            try:
                made.append(snap.commit(json.dumps({"writer": writer, "commit": snap.head + 1}).encode()))
            except CommitTaken:
                lost += 1
    except Exception as err:  # reported to the test, which fails naming it
        results.put((writer, made, f"{type(err).__name__}: {err}"))
        return
    results.put((writer, made, lost))


@pytest.mark.slow
def test_two_processes_racing_for_the_same_commits_each_number_is_made_once(tmp_path, kind, maybe_s3):
    root = _where(tmp_path, maybe_s3, kind, "log-race")
    env = maybe_s3.env() if maybe_s3 is not None else {}
    ctx = multiprocessing.get_context("spawn")
    ready, start, results = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_race, args=(root, "trajpipe.race", w, env, ready, start, results)) for w in "ab"]
    for p in procs:
        p.start()
    [ready.get(timeout=180) for _ in procs]
    start.set()
    got = dict((w, (made, lost)) for w, made, lost in (results.get(timeout=300) for _ in procs))
    for p in procs:
        p.join(60)
    assert all(isinstance(lost, int) for _made, lost in got.values()), got
    print("lost races:", {w: lost for w, (_m, lost) in got.items()})
    made = sorted(got["a"][0] + got["b"][0])
    assert made == list(range(1, 2 * RACE_COMMITS + 1))  # every number once, no gap
    records = [json.loads(r) for r in CommitLog(root, app_id="trajpipe.race").snapshot().records()]
    assert [r["commit"] for r in records] == made
    # each record is its winner's: the writer that was told it made commit n wrote record n
    owner = {n: w for w, (ns, _lost) in got.items() for n in ns}
    assert all(r["writer"] == owner[r["commit"]] for r in records)
