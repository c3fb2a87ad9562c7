"""The trajectory job on a Flink session cluster against FnApiRunner, on the same Kafka input in one run.

Both read the same topic (synthetic episodes, 4 partitions) into their own dataset
root through ``pipelines.trajectory_job.run`` (the command line's code path); the
Flink side is submitted through Beam's Flink job server to a session cluster of one
JobManager and two TaskManagers (:mod:`pipelines.flink_cluster`, PROCESS SDK workers).
Rows are the dataset rows written (``steps`` + ``episodes``: steps/ and trajectories/).
The Flink wall time counts what a user waits for from the command: job server start,
submission, the job, the commit (not the cluster start, which is once per session):

* ``pipeline_fnapi_rows_s``, ``pipeline_flink_cluster_rows_s``;
* ``pipeline_flink_vs_fnapi`` = their ratio (< 1: on one small machine a cluster only adds
  JVMs, a job server and per-stage SDK worker starts; it pays off with more machines and data).

Run alone (prints one JSON object)::

    python -m bench.flink_cluster --episodes 300
"""

from __future__ import annotations

import argparse
import json
import logging
import tempfile
import time
import uuid
from pathlib import Path

from kafka import KafkaProducer

from pipelines.flink_cluster import start_cluster, stop_cluster
from pipelines.trajectory_job import run
from schemas.codec import encode_event
from streams.admin import ensure_topics
from streams.config import KafkaConnection, Topics
from streams.synth import generate_episodes

__all__ = ["bench_flink_cluster"]


def bench_flink_cluster(bootstrap: str, workdir: Path, *, n_episodes: int = 300) -> dict[str, float]:
    """Rows/s of the batch job on FnApiRunner and on a 2-TaskManager Flink session cluster, and their ratio."""
    conn = KafkaConnection(bootstrap_servers=bootstrap, client_id="bench-flink")
    topic = f"bench.flink.{uuid.uuid4().hex[:8]}"
    ensure_topics(conn, Topics(events=topic, dead_letters=topic + ".dlq", control=topic + ".ctl", partitions=4))
    producer = KafkaProducer(**conn.client_kwargs(), acks="all", linger_ms=10)
    for episode in generate_episodes(n_episodes, seed=11):
        for ev in episode:
            producer.send(topic, key=ev.episode_id.encode(), value=encode_event(ev))
    producer.flush()
    producer.close()
    common = ["--source", "kafka", "--bootstrap", bootstrap, "--topic", topic]

    t0 = time.perf_counter()
    fn = run([*common, "--out", str(workdir / "fnapi")], conn=conn)
    fn_s = time.perf_counter() - t0

    cluster = start_cluster(workdir / "flink", task_managers=2, slots=1)
    try:
        t0 = time.perf_counter()
        flink = run([*common, "--out", str(workdir / "flink-out"), "--runner", "FlinkRunner", *cluster.beam_args()],
                    conn=conn)
        flink_s = time.perf_counter() - t0
        finished = sum(j["state"] == "FINISHED" for j in cluster.jobs())
    finally:
        stop_cluster(cluster)
    if flink != fn or finished != 1:
        raise RuntimeError(f"the Flink cluster run differs from FnApiRunner's ({finished} jobs finished): "
                           f"{flink} vs {fn}")
    rows = fn["steps"] + fn["episodes"]
    return {
        "pipeline_flink_rows": rows,
        "pipeline_fnapi_rows_s": round(rows / fn_s, 1),
        "pipeline_flink_cluster_rows_s": round(rows / flink_s, 1),
        "pipeline_flink_vs_fnapi": round(fn_s / flink_s, 4),
    }


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    parser.add_argument("--episodes", type=int, default=300)
    args = parser.parse_args()
    logging.basicConfig(level=logging.WARNING)
    from streams.broker import free_port, start_broker, stop_broker

    with tempfile.TemporaryDirectory(prefix="trajpipe-bench-flink-") as tmp:
        info = start_broker(engine="kafka", port=free_port(), data_dir=Path(tmp) / "broker")
        try:
            print(json.dumps(bench_flink_cluster(info.bootstrap, Path(tmp), n_episodes=args.episodes)), flush=True)
        finally:
            stop_broker(info.data_dir)
