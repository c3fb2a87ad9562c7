"""Kafka episodes assembled in the forked task that read their partition (pipelines.frames.AssembleInPlace).

The rows must be those of the shuffle path; an episode whose events are in two partitions (a producer
that did not key by episode) must not be assembled twice: the run is made again through the shuffle.
"""

from __future__ import annotations

import logging
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from kafka import KafkaProducer
from kafka.admin import KafkaAdminClient, NewTopic

from pipelines import batch_job
from pipelines.forked import close_pools
from pipelines.frames import IN_PLACE_DIR, InPlaceLedger, in_place_collisions
from pipelines.inputs import KafkaInput
from pipelines.job_counts import counts_from_metrics
from pipelines.recipes import load_recipe
from pipelines.trajectory_job import run_batch
from schemas.codec import encode_event
from streams.config import KafkaConnection
from tests.helpers import produce_messages
from tests.pipelines.helpers import episodes, flat

_ENC = __import__("msgspec").msgpack.Encoder()


def _ledger(d: Path, name: str, in_place: list[str], shuffled: list[str]) -> None:
    d.mkdir(parents=True, exist_ok=True)
    (d / name).write_bytes(_ENC.encode(InPlaceLedger(in_place=in_place, shuffled=shuffled)))


def test_collisions_are_episodes_assembled_in_one_task_and_read_by_another(tmp_path):
    d = tmp_path / IN_PLACE_DIR
    assert in_place_collisions(str(d)) == []  # no ledger: nothing assembled in place
    _ledger(d, "a.ledger", ["e1", "e2", "e3"], ["p1"])
    _ledger(d, "b.ledger", ["e4"], ["p1"])  # a pending episode's events in two tasks: both shuffled, fine
    assert in_place_collisions(str(d)) == []
    _ledger(d, "c.ledger", ["e2"], ["e3"])  # e2 assembled twice, e3 assembled in a and shuffled from c
    assert in_place_collisions(str(d)) == ["e2", "e3"]


def _rows(out: Path, table: str, keys: list[str]) -> pl.DataFrame:
    return pl.read_parquet(f"{out}/{table}/**/*.parquet").sort(keys)


def _same_rows(a: Path, b: Path) -> None:
    """The datasets' rows equal; GRPO and domain statistics merged in another order may differ in the last bits."""
    for table, keys in (("trajectories", ["episode_id"]), ("steps", ["episode_id", "step_index"])):
        x, y = _rows(a, table, keys), _rows(b, table, keys)
        assert x.columns == y.columns and x.height == y.height > 0
        for col in x.columns:
            if x[col].dtype in (pl.Float64, pl.Float32):
                np.testing.assert_allclose(x[col].to_numpy(), y[col].to_numpy(), rtol=1e-12, atol=1e-12, err_msg=col)
            else:
                assert x[col].to_list() == y[col].to_list(), col


def _topic(bootstrap: str, name: str, partitions: int) -> None:
    admin = KafkaAdminClient(bootstrap_servers=bootstrap)
    try:
        admin.create_topics([NewTopic(name, num_partitions=partitions, replication_factor=1)])
    finally:
        admin.close()


@pytest.mark.integration
def test_in_place_rows_equal_the_shuffles_across_micro_batches(tansu_broker, topic_name, tmp_path, monkeypatch):
    """Three partitions, two micro-batches; an episode cut by the first batch's end waits as pending and is
    completed through the shuffle in the second; a junk record is a dead letter. Both ways, the same; and
    the runner's metrics (counted in the forked workers, whose pool the first run forks as it builds the
    pipeline) are the counts staged with the files."""
    metrics = []
    compare = batch_job._compare_with_metrics

    def _compare(counts, result):
        metrics.append((counts_from_metrics(result)[0], counts))
        compare(counts, result)

    monkeypatch.setattr(batch_job, "_compare_with_metrics", _compare)
    close_pools()
    _topic(tansu_broker.bootstrap, topic_name, 3)
    conn = KafkaConnection(bootstrap_servers=tansu_broker.bootstrap, client_id="trajpipe-test", request_timeout_ms=5_000)
    eps = episodes(24, seed=7)
    cut = eps[23][:len(eps[23]) // 2]
    first = [(e.episode_id.encode(), encode_event(e)) for e in flat(eps[:12]) + cut] + [(b"ep-x", b"junk")]
    second = [(e.episode_id.encode(), encode_event(e)) for e in flat(eps[12:23]) + eps[23][len(cut):]]
    counts = {}
    produce_messages(tansu_broker.bootstrap, topic_name, first)
    for in_place in (True, False):
        counts[in_place] = [run_batch(out=tmp_path / str(in_place), recipe=load_recipe("outcome"), workers=2,
                                      input=KafkaInput(conn=conn, topic=topic_name), in_place=in_place)]
    produce_messages(tansu_broker.bootstrap, topic_name, second)
    for in_place in (True, False):
        counts[in_place].append(run_batch(out=tmp_path / str(in_place), recipe=load_recipe("outcome"), workers=2,
                                          input=KafkaInput(conn=conn, topic=topic_name), in_place=in_place))
    assert counts[True] == counts[False]
    c1, c2 = counts[True]
    assert (c1["episodes"], c1["pending_episodes"], c1["dead_letters"], c1["events_in"]) == (12, 1, 1, len(first))
    assert (c2["episodes"], c2["pending_episodes"], c2["events_in"]) == (12, 0, len(second))
    _same_rows(tmp_path / "True", tmp_path / "False")
    assert len(metrics) == 4
    for got, staged in metrics:
        assert {k: got[k] for k in _COUNTED} == {k: staged[k] for k in _COUNTED}


#: Counts the job's DoFns count as Beam metrics (the others come from the staged files alone).
_COUNTED = ("events_in", "episodes", "dead_letters", "events_used", "events_incomplete", "events_pending_out",
            "pending_episodes", "groups_released")


@pytest.mark.integration
def test_an_episode_in_two_partitions_makes_the_run_again_through_the_shuffle(tansu_broker, topic_name, tmp_path,
                                                                              caplog):
    """A producer that chose partitions itself put one episode's events in both: assembled in place, each
    task would have made half an episode. The run sees it in the tasks' ledgers and runs again with the
    shuffle; the dataset is that of the shuffle path."""
    _topic(tansu_broker.bootstrap, topic_name, 2)
    conn = KafkaConnection(bootstrap_servers=tansu_broker.bootstrap, client_id="trajpipe-test", request_timeout_ms=5_000)
    eps = episodes(8, seed=11)
    produce_messages(tansu_broker.bootstrap, topic_name, [(e.episode_id.encode(), encode_event(e)) for e in flat(eps[:7])])
    producer = KafkaProducer(bootstrap_servers=tansu_broker.bootstrap, acks="all")
    try:
        for i, ev in enumerate(eps[7]):
            producer.send(topic_name, key=ev.episode_id.encode(), value=encode_event(ev), partition=i % 2).get(30)
    finally:
        producer.close(timeout=10)
    kw = dict(recipe=load_recipe("outcome"), workers=2, input=KafkaInput(conn=conn, topic=topic_name))
    with caplog.at_level(logging.WARNING, logger="pipelines.batch_job"):
        c = run_batch(out=tmp_path / "in_place", **kw)
    assert any("more than one partition" in r.getMessage() and eps[7][0].episode_id in r.getMessage()
               for r in caplog.records)
    shuffled = run_batch(out=tmp_path / "shuffle", in_place=False, **kw)
    assert c == shuffled and c["episodes"] == 8 and c["pending_episodes"] == 0
    _same_rows(tmp_path / "in_place", tmp_path / "shuffle")
    assert not list((tmp_path / "in_place").rglob(IN_PLACE_DIR))  # the ledgers go with the staging directory


@pytest.mark.integration
def test_unkeyed_records_and_tombstones_in_place_as_through_the_shuffle(tansu_broker, topic_name, tmp_path):
    """An episode sent without keys is grouped by the id its events name; a keyed record with no value (a
    tombstone) and an unkeyed one that does not decode are dead letters: in place as through the shuffle."""
    _topic(tansu_broker.bootstrap, topic_name, 1)
    conn = KafkaConnection(bootstrap_servers=tansu_broker.bootstrap, client_id="trajpipe-test", request_timeout_ms=5_000)
    eps = episodes(6, seed=13)
    msgs = [(e.episode_id.encode(), encode_event(e)) for e in flat(eps[:5])]
    msgs += [(None, encode_event(e)) for e in eps[5]] + [(None, b"junk")]
    produce_messages(tansu_broker.bootstrap, topic_name, msgs)
    producer = KafkaProducer(bootstrap_servers=tansu_broker.bootstrap, acks="all")
    try:
        producer.send(topic_name, key=eps[0][0].episode_id.encode(), value=None).get(30)
    finally:
        producer.close(timeout=10)
    counts = [run_batch(out=tmp_path / str(in_place), recipe=load_recipe("outcome"), workers=2, in_place=in_place,
                        input=KafkaInput(conn=conn, topic=topic_name)) for in_place in (True, False)]
    assert counts[0] == counts[1]
    assert (counts[0]["episodes"], counts[0]["dead_letters"], counts[0]["events_in"]) == (6, 2, len(msgs) + 1)
    _same_rows(tmp_path / "True", tmp_path / "False")
