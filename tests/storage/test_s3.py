"""The storage layer against a real S3-compatible server (SeaweedFS, the ``s3_store`` fixture).

* Parquet written and read through ``schemas.storage.resolve("s3://...")`` (pyarrow, DuckDB).
* A hive-partitioned Delta table written with deltalake and ``delta_storage_options``: commit
  metadata (a batch id) and an application transaction per commit, read back with polars
  ``scan_delta`` and with DuckDB over ``DeltaTable.to_pyarrow_dataset()``; time travel to version 0.
* Concurrent writers: a writer holding a stale snapshot, and two processes appending 20 commits
  each at the same time. delta-rs writes ``_delta_log/<version>.json`` with ``If-None-Match: *``;
  SeaweedFS refuses the second writer of a version (412), and delta-rs retries the commit on the
  next version: no commit is lost or doubled, and no lock service is needed.
"""

from __future__ import annotations

import multiprocessing
import os

import duckdb
import polars as pl
import pyarrow as pa
import pyarrow.dataset as pads
import pyarrow.fs as pafs
import pyarrow.parquet as pq
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from schemas.storage import delta_storage_options, resolve
from tests import s3_helpers

# ~1 min on an idle machine (the server starts once per session)
pytestmark = [pytest.mark.integration, pytest.mark.timeout(600)]

DOMAINS = ("code", "math", "docqa", "tools")
BATCH_KEY = "trajpipe.batch_id"
WRITERS, COMMITS_PER_WRITER, ROWS_PER_COMMIT = 2, 20, 3


def _steps(batch_id: str, n: int, *, start: int = 0) -> pa.Table:
    """``n`` step-like rows of one batch, spread over the four domains."""
    return pa.table({
        "event_id": [f"{batch_id}-{i}" for i in range(start, start + n)],
        "episode_id": [f"ep-{batch_id}-{i // 2}" for i in range(start, start + n)],
        "seq": pa.array([i % 2 for i in range(start, start + n)], pa.int32()),
        "domain": [DOMAINS[i % len(DOMAINS)] for i in range(start, start + n)],
        "reward": pa.array([float(i % 5) / 4 for i in range(start, start + n)], pa.float32()),
        "batch_id": [batch_id] * n,
    })


def _commit(batch_id: str, *, app_id: str, version: int) -> CommitProperties:
    return CommitProperties(custom_metadata={BATCH_KEY: batch_id},
                            app_transactions=[Transaction(app_id=app_id, version=version)])


def _batch_ids(table: DeltaTable) -> list[str]:
    return [c[BATCH_KEY] for c in table.history() if BATCH_KEY in c]


def test_a_disk_too_full_for_the_store_is_one_clear_error_before_any_server_starts(tmp_path, monkeypatch):
    """Below its free-space floor SeaweedFS makes every volume read-only and writes hang until the clients time
    out (30 tests x 180 s in one CI run): the fixture refuses to start instead, saying what to free."""
    real = s3_helpers.shutil.disk_usage
    monkeypatch.setattr(s3_helpers.shutil, "disk_usage",
                        lambda path: real(path)._replace(free=s3_helpers.MIN_FREE_BYTES))
    monkeypatch.setattr(s3_helpers.subprocess, "Popen", lambda *a, **kw: pytest.fail("a server was started"))
    with pytest.raises(RuntimeError, match=r"only 512 MiB free under .* read-only below 512 MiB"):
        s3_helpers.start_seaweedfs(tmp_path)


def test_the_store_holds_its_volumes_writable_down_to_an_absolute_floor(s3_store):
    """The volume server keeps :data:`~tests.s3_helpers.MIN_FREE_BYTES` of the disk back, not its default 1 % of it
    (2.5 GiB of a 250 GiB disk): what it reports available is the disk's free space less exactly that floor."""
    import re
    import time
    import urllib.request

    for _ in range(3):  # a scrape can fall between the two gauges' updates (once a minute, microseconds apart)
        with urllib.request.urlopen(f"http://127.0.0.1:{s3_store.metrics_port}/metrics", timeout=10) as reply:
            text = reply.read().decode()
        gauge = {m["type"]: float(m["value"]) for m in re.finditer(
            r'^SeaweedFS_volumeServer_resource\{name="[^"]*",type="(?P<type>\w+)"\} (?P<value>\S+)$', text, re.M)}
        assert {"free", "avail"} <= gauge.keys(), text[-2000:]
        if gauge["free"] - gauge["avail"] == s3_helpers.MIN_FREE_BYTES:
            break
        time.sleep(1)
    assert gauge["free"] - gauge["avail"] == s3_helpers.MIN_FREE_BYTES, gauge


def test_parquet_round_trip_through_resolve(s3_env):
    uri = s3_env.uri("parquet-round-trip", "steps")
    fs, path = resolve(uri)
    assert isinstance(fs, pafs.S3FileSystem) and path == f"{s3_env.bucket}/parquet-round-trip/steps"
    table = _steps("b0", 400)
    pq.write_to_dataset(table, path, filesystem=fs, partition_cols=["domain"])

    files = [f.path for f in fs.get_file_info(pafs.FileSelector(path, recursive=True)) if f.is_file]
    assert sorted({f.split("/")[-2] for f in files}) == [f"domain={d}" for d in sorted(DOMAINS)]
    back = pq.read_table(path, filesystem=fs, partitioning="hive")
    key = [("event_id", "ascending")]
    assert back.num_rows == 400
    assert back.select(table.column_names).cast(table.schema).sort_by(key).equals(table.sort_by(key))

    dataset = pads.dataset(path, filesystem=fs, partitioning="hive")  # noqa: F841 - queried by name
    per_domain = duckdb.sql("select domain, count(*) as n from dataset group by domain order by domain").fetchall()
    assert per_domain == [(d, 100) for d in sorted(DOMAINS)]


def test_delta_table_with_commit_metadata_read_by_polars_and_duckdb_and_time_travel(s3_env):
    uri = s3_env.uri("delta-readers", "steps")
    options = delta_storage_options(uri)
    assert "AWS_SECRET_ACCESS_KEY" not in options and options["AWS_ENDPOINT_URL"] == s3_env.endpoint
    sizes = (40, 24, 16)
    for version, n in enumerate(sizes):
        write_deltalake(uri, _steps(f"batch-{version}", n), mode="append", partition_by=["domain"],
                        storage_options=options, commit_properties=_commit(f"batch-{version}", app_id="job-a",
                                                                           version=version))
    table = DeltaTable(uri, storage_options=options)
    assert table.version() == len(sizes) - 1 and table.metadata().partition_columns == ["domain"]
    assert sorted(_batch_ids(table)) == ["batch-0", "batch-1", "batch-2"]
    assert table.transaction_version("job-a") == len(sizes) - 1  # the job's last committed batch, for idempotence
    # the table's files are real objects under the URI, hive-partitioned
    fs, path = resolve(uri)
    names = {f.path.removeprefix(path + "/").split("/")[0] for f in fs.get_file_info(pafs.FileSelector(path))}
    assert names == {"_delta_log", *(f"domain={d}" for d in DOMAINS)}

    by_polars = pl.scan_delta(uri, storage_options=options).select(pl.len()).collect().item()
    steps = table.to_pyarrow_dataset()  # noqa: F841 - queried by name
    by_duckdb = duckdb.sql("select count(*) from steps").fetchall()[0][0]
    per_batch = dict(duckdb.sql("select batch_id, count(*) from steps group by batch_id").fetchall())
    assert by_polars == by_duckdb == sum(sizes)
    assert per_batch == {f"batch-{v}": n for v, n in enumerate(sizes)}

    first = DeltaTable(uri, version=0, storage_options=options)  # `--as-of 0`
    assert first.to_pyarrow_dataset().count_rows() == sizes[0]
    assert pl.scan_delta(uri, version=1, storage_options=options).select(pl.len()).collect().item() == sum(sizes[:2])


def _two_handles_on_version_0(uri: str, *, rows: int, app_id: str, version: int):
    """``(uri, options, a, b)``: a new table (batch ``v0``, ``rows`` rows) and two handles on its version 0."""
    options = delta_storage_options(uri)
    write_deltalake(uri, _steps("v0", rows), mode="append", storage_options=options, commit_properties=_commit(
        "v0", app_id=app_id, version=version))
    return uri, options, DeltaTable(uri, storage_options=options), DeltaTable(uri, storage_options=options)


def test_a_stale_writer_is_refused_by_the_conditional_put_and_retried_on_the_next_version(s3_env):
    """Two handles on version 0; the second commits after the first took version 1 -> it lands on version 2.

    Without the server's ``If-None-Match: *`` the second commit's plain PUT would overwrite
    ``00000000000000000001.json`` and batch ``a`` would be lost.
    """
    uri, options, a, b = _two_handles_on_version_0(s3_env.uri("delta-stale-writer", "steps"), rows=8, app_id="w",
                                                   version=0)
    write_deltalake(a, _steps("a", 4), mode="append", commit_properties=_commit("a", app_id="a", version=0))
    write_deltalake(b, _steps("b", 4), mode="append", commit_properties=_commit("b", app_id="b", version=0))
    table = DeltaTable(uri, storage_options=options)
    assert table.version() == 2 and table.to_pyarrow_dataset().count_rows() == 16
    assert sorted(_batch_ids(table)) == ["a", "b", "v0"]


def test_two_writers_of_one_application_transaction_version_one_commits_the_other_is_refused(s3_env):
    """The Delta log itself can be a create-only commit point (what the manifests are today).

    Two handles read the same snapshot and both commit application transaction ``trajpipe.V`` = 1
    (the same dataset commit): blind appends of *different* app ids are retried onto the next version
    (the test above), but the second commit of the *same* app id is refused by delta-rs' conflict
    checker (``CommitFailedError``, "Concurrent transaction failed"), on SeaweedFS as on a local disk.
    A stale handle committing a version the table already has is refused too. So two runs racing
    for dataset commit ``n`` can be decided by the Delta commit alone: one commits, the other
    learns it lost (the design note in docs/storage.md, "Next: the Delta log as the commit point").
    """
    from deltalake.exceptions import CommitFailedError

    uri, options, a, b = _two_handles_on_version_0(s3_env.uri("delta-same-app-txn", "steps"), rows=4,
                                                   app_id="other", version=1)
    write_deltalake(a, _steps("a", 4), mode="append", commit_properties=_commit("a", app_id="trajpipe.V", version=1))
    with pytest.raises(CommitFailedError, match="[Cc]oncurrent transaction"):
        write_deltalake(b, _steps("b", 4), mode="append", commit_properties=_commit("b", app_id="trajpipe.V",
                                                                                    version=1))
    table = DeltaTable(uri, storage_options=options)
    assert table.version() == 1 and table.transaction_version("trajpipe.V") == 1
    assert sorted(_batch_ids(table)) == ["a", "v0"] and table.to_pyarrow_dataset().count_rows() == 8
    # the next commit of the same app id from an up-to-date handle goes through
    write_deltalake(table, _steps("c", 4), mode="append", commit_properties=_commit("c", app_id="trajpipe.V",
                                                                                    version=2))
    assert DeltaTable(uri, storage_options=options).transaction_version("trajpipe.V") == 2


def _append_many(uri: str, writer: int, env: dict[str, str], ready: multiprocessing.Queue,
                 start: multiprocessing.Event, results: multiprocessing.Queue) -> None:
    """One writer process: COMMITS_PER_WRITER appends, each its own batch id and transaction version."""
    os.environ.update(env)
    from deltalake.exceptions import CommitFailedError

    options = delta_storage_options(uri)
    DeltaTable(uri, storage_options=options).version()  # warm up (runtime, connections) before the start line
    ready.put(writer)
    start.wait(180)
    retried = 0
    for i in range(COMMITS_PER_WRITER):
        batch = f"w{writer}-{i:02d}"
        for _attempt in range(10):
            try:
                write_deltalake(uri, _steps(batch, ROWS_PER_COMMIT), mode="append", partition_by=["domain"],
                                storage_options=options,
                                commit_properties=_commit(batch, app_id=f"writer-{writer}", version=i))
                break
            except CommitFailedError:  # delta-rs's own retries exhausted: the commit did not happen, retry it
                retried += 1
        else:
            results.put((writer, "gave up", batch))
            return
    results.put((writer, "done", retried))


@pytest.mark.slow
def test_two_processes_appending_at_once_lose_and_double_no_commit(s3_env):
    uri = s3_env.uri("delta-concurrent", "steps")
    options = delta_storage_options(uri)
    write_deltalake(uri, _steps("init", 4), mode="append", partition_by=["domain"], storage_options=options,
                    commit_properties=_commit("init", app_id="init", version=0))
    ctx = multiprocessing.get_context("spawn")  # fresh interpreters: no inherited runtime threads
    ready, start, results = ctx.Queue(), ctx.Event(), ctx.Queue()
    procs = [ctx.Process(target=_append_many, args=(uri, w, s3_env.env(), ready, start, results))
             for w in range(WRITERS)]
    for p in procs:
        p.start()
    # the start line once every writer is warmed up: a fresh interpreter's imports take seconds on a loaded
    # machine, and a fixed wait let one writer make all its commits before the other began (seen under xdist)
    [ready.get(timeout=180) for _ in procs]
    start.set()
    outcomes = [results.get(timeout=300) for _ in procs]
    for p in procs:
        p.join(60)
        assert p.exitcode == 0
    assert all(o[1] == "done" for o in outcomes), outcomes

    table = DeltaTable(uri, storage_options=options)
    expected = ["init", *(f"w{w}-{i:02d}" for w in range(WRITERS) for i in range(COMMITS_PER_WRITER))]
    assert sorted(_batch_ids(table)) == sorted(expected)  # every commit once: none lost, none doubled
    assert table.version() == WRITERS * COMMITS_PER_WRITER
    rows = table.to_pyarrow_dataset().count_rows()
    assert rows == 4 + WRITERS * COMMITS_PER_WRITER * ROWS_PER_COMMIT
    counts = dict(pl.scan_delta(uri, storage_options=options).group_by("batch_id").len().collect().iter_rows())
    assert counts == {"init": 4, **{b: ROWS_PER_COMMIT for b in expected[1:]}}
    assert [table.transaction_version(f"writer-{w}") for w in range(WRITERS)] == [COMMITS_PER_WRITER - 1] * WRITERS
    # the writers ran at the same time: their commits interleave in version order
    order = [c[BATCH_KEY][:2] for c in sorted(table.history(), key=lambda c: c["version"]) if c["version"] > 0]
    switches = sum(a != b for a, b in zip(order, order[1:]))
    assert switches >= 4, f"the writers barely overlapped ({order}): the test proved little"
    # commits that found their version taken (412 on If-None-Match) and were retried on a later one
    in_delta = sum(c.get("operationMetrics", {}).get("num_retries", 0) for c in table.history())
    by_writer = sum(o[2] for o in outcomes)  # CommitFailedError (delta-rs's retries exhausted), retried here
    print(f"concurrent appends: {WRITERS} x {COMMITS_PER_WRITER} commits, {switches} switches between writers; "
          f"{in_delta} retried by delta-rs after losing a race, {by_writer} CommitFailedError retried by a writer")
