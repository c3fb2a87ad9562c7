"""Small helpers shared by the tests (import as ``from tests.helpers import ...``)."""

from __future__ import annotations

import json
import subprocess
import sys
import time
from pathlib import Path

import duckdb
import polars as pl
from kafka import KafkaConsumer, KafkaProducer, TopicPartition
from polars.testing import assert_frame_equal

from schemas import locations as loc
from schemas.storage import delta_storage_options
from streams.broker import free_port

__all__ = ["consume_messages", "create_topics", "free_port", "produce_messages"]


def topic_env(topic: str, spool, *, partitions: int = 2) -> dict[str, str]:
    """The environment of a ``trajpipe`` subprocess on its own topics (events, ``.ctl``, ``.dl``) and spool dir."""
    import os
    from pathlib import Path

    return {**os.environ, "PYTHONPATH": str(Path(__file__).resolve().parents[1]), "TRAJPIPE_TOPICS__EVENTS": topic,
            "TRAJPIPE_TOPICS__CONTROL": f"{topic}.ctl", "TRAJPIPE_TOPICS__DEAD_LETTERS": f"{topic}.dl",
            "TRAJPIPE_TOPICS__PARTITIONS": str(partitions), "TRAJPIPE_SPOOL_DIR": str(spool)}


def create_topics(bootstrap: str, *names: str, partitions: int = 2) -> str:
    """Create ``names`` (``partitions`` each, replication 1) on the broker; return the first."""
    from kafka.admin import KafkaAdminClient, NewTopic

    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(n, num_partitions=partitions, replication_factor=1) for n in names])
    finally:
        admin.close()
    return names[0]


def produce_messages(bootstrap: str, topic: str, messages: list[tuple[bytes, bytes]]) -> None:
    """Send ``(key, value)`` pairs with ``acks=all`` and wait until every one is acknowledged."""
    producer = KafkaProducer(bootstrap_servers=bootstrap, acks="all", client_id="trajpipe-test-producer")
    try:
        futures = [producer.send(topic, key=key, value=value) for key, value in messages]
        producer.flush(timeout=30)
        for future in futures:
            future.get(timeout=30)  # raises the send's error, if any
    finally:
        producer.close(timeout=10)


def consume_messages(bootstrap: str, topic: str, count: int, *, timeout_s: float = 30.0) -> list[tuple[bytes, bytes]]:
    """Read ``count`` records of ``topic`` from the start of every partition, without a consumer group.

    Stops at ``count`` records (fewer if ``timeout_s`` runs out) so it does not depend on
    end offsets, which the Tansu broker reports wrongly after multi-record batches.
    """
    consumer = KafkaConsumer(
        bootstrap_servers=bootstrap, group_id=None, enable_auto_commit=False, client_id="trajpipe-test-consumer"
    )
    try:
        deadline = time.monotonic() + timeout_s
        partitions = consumer.partitions_for_topic(topic)
        while not partitions and time.monotonic() < deadline:
            time.sleep(0.2)
            partitions = consumer.partitions_for_topic(topic)
        consumer.assign([TopicPartition(topic, p) for p in sorted(partitions or ())])
        consumer.seek_to_beginning()
        records: list[tuple[bytes, bytes]] = []
        while len(records) < count and time.monotonic() < deadline:
            for batch in consumer.poll(timeout_ms=500).values():
                records.extend((r.key, r.value) for r in batch)
        return records
    finally:
        consumer.close()


def race_two_archivers(bootstrap: str, out: str, *, commit_every: int, spool_root: Path, cwd: Path,
                       env_of) -> int:
    """Two ``trajpipe archive --until-end`` processes on one archive at once; returns the events the winners archived.

    Each must end with exit 0, or exit 2 and the one ``ArchiveConflict`` line (a commit the other made first),
    no traceback; at least one wins. ``env_of(i)``: the environment of process ``i`` (topics, spool).
    """
    argv = [sys.executable, "-m", "trajpipe", "archive", "--bootstrap", bootstrap, "--out", out, "--until-end",
            "--commit-every", str(commit_every)]
    procs = [subprocess.Popen([*argv, "--spool-dir", str(spool_root / f"spool-{i}")], env=env_of(i), cwd=cwd,
                              stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True) for i in range(2)]
    results = [(p.wait(timeout=600), *p.communicate()) for p in procs]
    for rc, out_text, err in results:
        assert rc in (0, 2) and "Traceback" not in err, err[-3000:]
        if rc == 2:
            lines = [line for line in err.splitlines() if line.startswith("error:")]
            assert len(lines) == 1 and "another archiver made commit" in lines[0] and out_text == "", err[-3000:]
    assert any(rc == 0 for rc, _, _ in results), results
    return sum(json.loads(out_text.strip().splitlines()[-1])["events"] for rc, out_text, _ in results if rc == 0)


def read_rows(out: Path | str, name: str, *, delta: bool = False) -> pl.DataFrame:
    """All rows of the dataset table ``<out>/<name>/`` (hive columns included), in a canonical order.

    Sorted by ``episode_id`` and ``step_index`` (where present), then every other sortable column, so
    two datasets whose float columns differ in the last bits still line up row for row. ``delta``: from
    the table's latest Delta snapshot instead of the directory glob (``out`` may then be an ``s3://``
    URI; the AWS variables come from the environment).
    """
    if delta:
        uri = loc.join(str(out), name)
        df = pl.read_delta(uri, storage_options=delta_storage_options(uri) or None)
    else:
        df = pl.from_arrow(duckdb.connect().sql(
            f"select * from read_parquet('{out}/{name}/**/*.parquet', hive_partitioning=true)").arrow())
    df = df.select(sorted(df.columns))
    # DuckDB names the zone Etc/UTC, delta-rs UTC: the same instants
    df = df.with_columns(pl.col(pl.Datetime("us", "Etc/UTC")).dt.convert_time_zone("UTC"))
    keys = [c for c, t in df.schema.items() if not isinstance(t, (pl.List, pl.Struct, pl.Array))]
    first = [c for c in ("episode_id", "step_index") if c in keys]
    return df.sort(first + [c for c in keys if c not in first])


def assert_same_rows(got: pl.DataFrame, expected: pl.DataFrame) -> None:
    """Equal rows (:func:`read_rows` order): exact but for floats, equal within 1e-9 relative.

    Float statistics merged in another order (another runner's bundles, forked workers' parts)
    differ in the last bits; anything more is a difference.
    """
    assert got.height > 0
    assert_frame_equal(got, expected, check_exact=False, rel_tol=1e-9, abs_tol=1e-12)
