"""Evaluation episodes through Kafka: ``--mode stream`` and batch micro-batches write the same ``evaluations/``.

Synthetic training and evaluation episodes (``purpose = "eval"``) on a real
Kafka topic; the streaming job (Prism, ``--stop-at-end``) commits each
evaluation episode exactly once to ``evaluations/`` and never to the training
tables; a batch run over the same topic writes the same rows; a second
batch micro-batch (what ``--loop`` repeats) and a restarted stream add nothing.
"""

from __future__ import annotations

from pathlib import Path

import duckdb
import pytest
from kafka.admin import KafkaAdminClient, NewTopic

from pipelines.trajectory_job import run
from streams.config import KafkaConnection
from streams.producer import EventProducer
from tests.pipelines.helpers import episodes, flat
from tests.pipelines.test_evaluations import _as_eval

pytestmark = [
    pytest.mark.integration,
    pytest.mark.slow,
    pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning"),
]


def _rows(out: Path, table: str, cols: str) -> list[tuple]:
    return duckdb.connect().execute(f"select {cols} from read_parquet('{out}/{table}/**/*.parquet', "
                                    f"hive_partitioning=true) order by all").fetchall()


def test_stream_and_batch_commit_each_eval_episode_once(kafka_broker, topic_name, tmp_path):
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, client_id="test-eval-stream")
    admin = KafkaAdminClient(**conn.client_kwargs())
    try:
        admin.create_topics([NewTopic(topic_name, 2, 1)])
    finally:
        admin.close()
    train = episodes(12, seed=51)
    evals = [_as_eval(ep, n=i, passed=i % 3 == 0) for i, ep in enumerate(episodes(9, seed=52))]
    with EventProducer(conn, topic_name, spool_dir=tmp_path / "spool") as producer:
        for ev in flat(train + evals):
            producer.emit(ev)
        assert producer.flush().spooled == 0
    stream_out, batch_out = tmp_path / "stream", tmp_path / "batch"
    stream = ["--source", "kafka", "--bootstrap", kafka_broker.bootstrap, "--topic", topic_name,
              "--out", str(stream_out), "--mode", "stream", "--runner", "PrismRunner", "--window-s", "2",
              "--idle-watermark-lag-s", "1", "--stop-at-end"]
    c = run(stream)
    assert (c["evaluations"], c["episodes"], c["events_uncommitted"]) == (9, 21, 0)
    batch = ["--source", "kafka", "--bootstrap", kafka_broker.bootstrap, "--topic", topic_name,
             "--out", str(batch_out)]
    b = run(batch)
    assert (b["evaluations"], b["episodes"]) == (9, 21)

    cols = "episode_id, passed, status, policy_version, eval_run, num_steps, prompt_tokens, action_tokens"
    expected = sorted(ep[0].episode_id for ep in evals)
    for out in (stream_out, batch_out):
        rows = _rows(out, "evaluations", cols)
        assert [r[0] for r in rows] == expected  # each once
        assert sum(r[1] for r in rows) == 3
        for table in ("steps", "trajectories"):
            ids = {r[0] for r in _rows(out, table, "distinct episode_id")}
            assert ids == {ep[0].episode_id for ep in train}, (out, table)
    assert _rows(stream_out, "evaluations", cols) == _rows(batch_out, "evaluations", cols)

    # Nothing new: another micro-batch, and a restarted stream, commit no evaluation again.
    assert run(batch)["evaluations"] == 0
    assert run(stream)["evaluations"] == 0
    assert [r[0] for r in _rows(stream_out, "evaluations", "episode_id")] == expected
