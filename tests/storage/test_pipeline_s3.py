"""The batch trajectory job writing its dataset to an S3-compatible store (SeaweedFS) from a real Kafka broker.

`pipeline run --out s3://...` stages, commits (manifest -> moves -> one Delta transaction per table)
and recovers through :mod:`schemas.locations`; these tests hold it to the local run:

* the same files (every Parquet file byte for byte, the same manifests and state files) and the
  same rows through ``deltalake.DeltaTable`` and polars ``scan_delta`` as a local ``--out``;
* a rerun reads nothing new and adds nothing;
* a crash at each commit point, then a rerun: the same dataset;
* two runs at once on one dataset version: every episode once (one commits, the other either
  finds the input covered or fails with one error line, exit 2, and its rerun adds nothing);
* the create-only PUT itself: SeaweedFS refuses the second ``If-None-Match: *`` write of a key.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import uuid
from pathlib import Path

import polars as pl
import pyarrow as pa
import pytest
from deltalake import DeltaTable

from pipelines import testhooks
from pipelines.commit import CommitError
from pipelines.delta_tables import app_id, delta_batches
from pipelines.inputs import KafkaInput
from pipelines.recipes import load_recipe
from pipelines.trajectory_job import run, run_batch
from schemas import locations as loc
from schemas.codec import encode_event
from schemas.manifests import commit_log_of, list_dataset_versions, read_dataset_records
from schemas.storage import delta_storage_options
from tests.helpers import create_topics, produce_messages
from tests.pipelines.helpers import episodes, flat

# ~3 min here on 2 busy cores (a Kafka broker, SeaweedFS, eight job runs)
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]
N = 24


@pytest.fixture(scope="module")
def events_topic(kafka_broker) -> tuple[str, str, int]:
    """``(bootstrap, topic, records)``: N synthetic episodes on a 2-partition topic, plus one undecodable record."""
    topic = create_topics(kafka_broker.bootstrap, f"test.pipeline-s3.{uuid.uuid4().hex[:8]}")
    msgs = [(e.episode_id.encode(), encode_event(e)) for e in flat(episodes(N, seed=41))] + [(b"ep-x", b"junk")]
    produce_messages(kafka_broker.bootstrap, topic, msgs)
    return kafka_broker.bootstrap, topic, len(msgs)


def _args(events_topic, out: str) -> list[str]:
    bootstrap, topic, _ = events_topic
    return ["--source", "kafka", "--bootstrap", bootstrap, "--topic", topic, "--out", out]


def _listing(root: str) -> dict[str, bytes]:
    """Relative path -> bytes of the dataset's data and state files, and the names of its dead letter files
    (their ``timestamp`` differs between runs: compared without it below); not the Delta logs (timestamps;
    the commit log is one: its manifests are compared by :func:`_manifests`), nor staging (checked on its own)."""
    out = {}
    for path in loc.list_files(root):
        rel = path[len(root.rstrip("/")) + 1:]
        if "/_delta_log/" in f"/{rel}" or rel.endswith("commit.lock") or rel.startswith("_staging/"):
            continue
        out[rel] = b"" if rel.startswith("dead_letters/") else loc.read_bytes(path)
    return out


def _manifests(root: str) -> list[dict]:
    docs = [json.loads(r) for v in list_dataset_versions(root) for r in read_dataset_records(root, v)]
    for d in docs:
        d.pop("created_at")
        for f in d["files"]:  # staged under <n>-<run> on S3 (runs racing for a commit never share staging)
            f["staged"] = re.sub(r"^(_staging/[^/]+/[0-9]{8})-[0-9a-f]+/", r"\1/", f["staged"])
    return docs


def _delta_rows(uri: str, table: str) -> pa.Table:
    rows = DeltaTable(uri, storage_options=delta_storage_options(uri) or None).to_pyarrow_dataset().to_table()
    keys = [("episode_id", "ascending")] + ([("step_index", "ascending")] if table == "steps" else [])
    if table == "dead_letters":  # when each run detected it
        rows, keys = rows.drop_columns(["timestamp"]), [("source_partition", "ascending"), ("source_offset", "ascending")]
    return rows.sort_by(keys).select(sorted(rows.column_names))


@pytest.fixture(scope="module")
def local_run(events_topic, tmp_path_factory) -> tuple[str, dict]:
    out = str(tmp_path_factory.mktemp("local") / "datasets")
    return out, run(_args(events_topic, out))


@pytest.fixture
def s3_run(events_topic, s3_env) -> tuple[str, dict]:
    uri = s3_env.uri(f"run-{uuid.uuid4().hex[:8]}", "datasets")
    return uri, run(_args(events_topic, uri))


def _same_dataset(uri: str, local: str) -> None:
    assert _listing(uri) == _listing(local)
    assert _manifests(uri) == _manifests(local)
    for table in ("steps", "trajectories", "dead_letters"):
        if not loc.exists(loc.join(local, table)):
            assert not loc.list_files(loc.join(uri, table)), table
            continue
        s3_rows, local_rows = _delta_rows(loc.join(uri, table), table), _delta_rows(loc.join(local, table), table)
        assert s3_rows.num_rows > 0 and s3_rows.equals(local_rows), table


def test_s3_run_writes_the_local_runs_dataset_and_a_rerun_adds_nothing(events_topic, local_run, s3_run):
    uri, counts = s3_run
    local, local_counts = local_run
    _, _, records = events_topic
    assert counts == local_counts
    assert (counts["episodes"], counts["dead_letters"], counts["events_in"]) == (N, 1, records)
    _same_dataset(uri, local)
    [version] = list_dataset_versions(uri)
    options = delta_storage_options(uri)
    for table in ("steps", "trajectories"):
        dt = DeltaTable(loc.join(uri, table), storage_options=options)
        assert dt.transaction_version(app_id(version)) == 1
        [batch] = delta_batches(loc.join(uri, table))
        assert batch["batch_id"] == f"{version}/00000001" and batch["source"] == "kafka"
    by_polars = pl.scan_delta(loc.join(uri, "steps"), storage_options=options).select(
        pl.len(), pl.col("episode_id").n_unique()).collect().row(0)
    assert by_polars == (counts["steps"], N)
    assert not [p for p in loc.list_files(uri) if "/_staging/" in p or p.endswith(".tmp")]

    before = _listing(uri)
    again = run(_args(events_topic, uri))
    assert set(again.values()) == {0} and _listing(uri) == before
    assert len(delta_batches(loc.join(uri, "steps"))) == 1


def test_micro_batches_then_a_rerun(kafka_broker, s3_env, tmp_path):
    """Two commits, then a rerun: the rerun adds nothing and leaves every commit's state files in place
    (an object store may still list the emptied staging prefixes of commits 1 and 2)."""
    topic = f"test.pipeline-s3-batches.{uuid.uuid4().hex[:8]}"
    events = (kafka_broker.bootstrap, topic, 0)
    uri, local = s3_env.uri(f"batches-{uuid.uuid4().hex[:8]}", "datasets"), str(tmp_path / "datasets")
    eps = episodes(2 * N, seed=43)
    for part in (eps[:N], eps[N:]):
        produce_messages(kafka_broker.bootstrap, topic, [(e.episode_id.encode(), encode_event(e)) for e in flat(part)])
        assert run(_args(events, uri)) == run(_args(events, local))
    before = _listing(uri)
    assert set(run(_args(events, uri)).values()) == {0} and _listing(uri) == before
    assert len(_manifests(uri)) == 2
    _same_dataset(uri, local)
    assert [b["commit"] for b in delta_batches(loc.join(uri, "steps"))] == ["1", "2"]


@pytest.mark.parametrize("crash_at", ["before_manifest", "after_manifest", "before_delta"])
def test_crash_at_a_commit_point_then_rerun_gives_the_same_dataset(events_topic, local_run, s3_env, crash_at):
    local, _ = local_run
    bootstrap, topic, _ = events_topic
    from streams.config import KafkaConnection

    uri = s3_env.uri(f"crash-{crash_at}-{uuid.uuid4().hex[:8]}", "datasets")
    kafka = KafkaInput(conn=KafkaConnection(bootstrap_servers=bootstrap, client_id="trajpipe-test"), topic=topic)
    with testhooks.crash_at(crash_at), pytest.raises(CommitError, match="simulated crash"):
        run_batch(out=uri, recipe=load_recipe("outcome"), input=kafka)
    assert len(_manifests(uri)) == (0 if crash_at == "before_manifest" else 1)
    again = run(_args(events_topic, uri))
    assert again["episodes"] == (N if crash_at == "before_manifest" else 0)
    _same_dataset(uri, local)
    assert len(delta_batches(loc.join(uri, "steps"))) == 1
    # No lock on S3: the rerun cannot tell the crashed run's staging of commit 1 from a live one's until
    # commit 1 is made; the next run's recovery deletes it, and adds nothing.
    staged = {p.split("/_staging/")[1].split("/")[1] for p in loc.list_files(uri) if "/_staging/" in p}
    assert len(staged) == (1 if crash_at == "before_manifest" else 0), staged
    assert set(run(_args(events_topic, uri)).values()) == {0}
    assert not [p for p in loc.list_files(uri) if "/_staging/" in p]
    _same_dataset(uri, local)


def _trajpipe(env: dict, args: list[str]) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-m", "trajpipe", "pipeline", "run", *args], cwd=REPO, env=env,
                            stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)


def test_two_runs_at_once_commit_every_episode_once(events_topic, local_run, s3_env):
    """No lock on S3: both plan commit 1; the commit log lets one win. The other ends with one error
    line (exit 2) and leaves nothing, or -- if it started after the commit -- finds the input covered."""
    local, _ = local_run
    uri = s3_env.uri(f"race-{uuid.uuid4().hex[:8]}", "datasets")
    env = {**{k: v for k, v in os.environ.items() if not k.startswith("TRAJPIPE_")}, "PYTHONPATH": str(REPO)}
    procs = [_trajpipe(env, _args(events_topic, uri)) for _ in range(2)]
    results = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    ok = [json.loads(out.strip().splitlines()[-1]) for rc, out, _ in results if rc == 0]
    refused = [err for rc, _, err in results if rc != 0]
    assert len(ok) >= 1 and sorted(c["episodes"] for c in ok)[-1] == N, results
    for rc, _, err in results:
        if rc != 0:
            assert rc == 2 and "Traceback" not in err, err[-3000:]
            lines = [line for line in err.splitlines() if line.startswith("error:")]
            assert len(lines) == 1 and "another run committed 1 of outcome-" in lines[0], err[-3000:]
    if len(ok) == 2:
        assert sorted(c["episodes"] for c in ok) == [0, N]
    assert len(refused) + len(ok) == 2
    again = run(_args(events_topic, uri))  # the refused run's rerun: the input is covered
    assert set(again.values()) == {0}
    _same_dataset(uri, local)
    assert len(_manifests(uri)) == 1 and not loc.list_files(loc.join(uri, "_manifests"))
    assert not [p for p in loc.list_files(uri) if "/_staging/" in p]


def test_create_only_put_refuses_a_second_writer(s3_env):
    key = s3_env.uri(f"create-only-{uuid.uuid4().hex[:8]}", "00000001.json")
    loc.write_new(key, b'{"run": 1}')
    with pytest.raises(FileExistsError, match="exists"):
        loc.write_new(key, b'{"run": 2}')
    assert loc.read_bytes(key) == b'{"run": 1}'
    loc.write_atomic(key, b'{"run": 3}')  # a plain PUT still replaces it
    assert loc.read_bytes(key) == b'{"run": 3}'


def test_a_legacy_dataset_on_s3_is_moved_into_the_commit_log_by_the_next_run(events_topic, local_run, s3_env):
    """A dataset written before the commit log (``_manifests/<V>/<n>.json``, no ``_commit_log/``): read as it
    is, then the next run imports the files into the log (same bytes) and deletes them, adding nothing."""
    local, _ = local_run
    uri = s3_env.uri(f"legacy-{uuid.uuid4().hex[:8]}", "datasets")
    run(_args(events_topic, uri))
    [version] = list_dataset_versions(uri)
    records = read_dataset_records(uri, version)
    for n, record in enumerate(records, start=1):
        loc.write_atomic(loc.join(uri, "_manifests", version, f"{n:08d}.json"), record)
    loc.delete_dir(loc.join(uri, "_commit_log"))
    assert not commit_log_of(uri, version).exists() and read_dataset_records(uri, version) == records
    before = _listing(uri)
    again = run(_args(events_topic, uri))
    assert set(again.values()) == {0}
    assert not loc.list_files(loc.join(uri, "_manifests"))
    assert commit_log_of(uri, version).head() == len(records) and read_dataset_records(uri, version) == records
    data_and_state = lambda listing: {k: v for k, v in listing.items() if not k.startswith("_manifests/")}  # noqa: E731
    assert data_and_state(_listing(uri)) == data_and_state(before)
    _same_dataset(uri, local)
