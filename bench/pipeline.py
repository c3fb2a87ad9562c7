"""The Beam trajectory job against its baselines, on the same data in one run.

* Kafka: raw kafka-python consume of the topic (large fetches, decoding nothing)
  vs the job reading the same offsets and committing datasets
  → ``pipeline_kafka_vs_raw_consume`` (goal >= 0.8). The job's source reads with
  :class:`streams.fetch.PartitionReader` (kafka-python's connection, aiokafka's
  compiled record parser); its bare read rate is ``fast_fetch_events_per_s``.
* Archive: the job vs a plain polars implementation of the same transforms on
  the same files → ``pipeline_archive_vs_polars`` (goal >= 0.5), from
  :func:`pipelines.bench.bench_archive`.

Both sides of a ratio run interleaved, ``repeats`` times each, and the best
time of each counts (the shared machine's noise only ever slows a run down).

Beside the wall times, the CPU time each Kafka side used (least of the repeats):
``raw_consume_cpu_s`` (this process; the consume is one thread's work) and
``pipeline_kafka_cpu_s`` (this process, all threads, and the job's forked workers:
:func:`bench.scale.job_cpu_s`), and ``pipeline_kafka_cpu_vs_raw_consume``, raw CPU over
the job's. The raw consume is one CPU-bound thread; the job runs on every core, so on ``c``
cores its wall ratio is at most ``c`` times the CPU ratio, less by whatever core time the job
leaves idle (1.83-1.86 times on this 2-core machine: docs/pipelines.md). On a shared machine
the neighbours move the CPU time of a run about as much as its wall time.

The input is 10,000 synthetic episodes (~100k events, ~200 MB): big enough
that the job's fixed cost (building and translating the Beam pipeline, ~1 s)
is a small part of its time, as in a real micro-batch.
"""

from __future__ import annotations

import shutil
import time
import uuid
from pathlib import Path

from kafka import KafkaProducer

from bench.scale import job_cpu_s
from pipelines.bench import bench_archive
from pipelines.inputs import KafkaInput
from pipelines.recipes import load_recipe
from pipelines.trajectory_job import run_batch
from schemas.codec import encode_event
from streams.admin import ensure_topics
from streams.archive import Archiver
from streams.config import KafkaConnection, Topics
from streams.consumer import end_offsets, ranges_from, read_range
from streams.fetch import PartitionReader, read_partition
from streams.synth import generate_episodes

__all__ = ["bench_pipeline"]


def bench_pipeline(bootstrap: str, workdir: Path, *, n_episodes: int = 10_000, repeats: int = 3) -> dict[str, float]:
    """Events/s of the job from Kafka and from the archive, each beside its baseline."""
    conn = KafkaConnection(bootstrap_servers=bootstrap, client_id="bench-pipeline")
    topic = f"bench.pipeline.{uuid.uuid4().hex[:8]}"
    ensure_topics(conn, Topics(events=topic, dead_letters=topic + ".dlq", control=topic + ".ctl", partitions=4))
    producer = KafkaProducer(**conn.client_kwargs(), acks="all", compression_type="lz4", linger_ms=10,
                             batch_size=256 * 1024)
    n_events = 0
    for episode in generate_episodes(n_episodes, seed=5):
        for ev in episode:
            producer.send(topic, key=ev.episode_id.encode(), value=encode_event(ev))
            n_events += 1
    producer.flush()
    producer.close()
    ranges = ranges_from(topic=topic, start={}, end=end_offsets(conn, topic))

    raw_s, fast_s, job_s, raw_cpu, job_cpu = [], [], [], [], []
    for i in range(repeats):
        t0, cpu0 = time.perf_counter(), time.process_time()
        consumed = sum(len(batch) for batch in read_range(conn, ranges))
        raw_s.append(time.perf_counter() - t0)
        raw_cpu.append(time.process_time() - cpu0)
        if consumed != n_events:
            raise RuntimeError(f"raw consume read {consumed} of {n_events} events")
        t0 = time.perf_counter()
        with PartitionReader(conn) as reader:
            fetched = sum(len(chunk) for r in ranges for chunk in read_partition(reader, r))
        fast_s.append(time.perf_counter() - t0)
        if fetched != n_events:
            raise RuntimeError(f"PartitionReader read {fetched} of {n_events} events")
        out = workdir / f"from-kafka-{i}"
        t0, cpu0 = time.perf_counter(), job_cpu_s()
        counts = run_batch(out=out, recipe=load_recipe("outcome"), input=KafkaInput(conn=conn, topic=topic))
        job_s.append(time.perf_counter() - t0)
        job_cpu.append(job_cpu_s() - cpu0)
        if counts["events_in"] != n_events:
            raise RuntimeError(f"the job read {counts['events_in']} of {n_events} events")
        shutil.rmtree(out)

    Archiver(workdir / "archive", conn=conn, topic=topic, dead_letter=lambda rec, err: None).run()
    figures = bench_archive(workdir / "archive", workdir / "from-archive", repeats=repeats)
    figures.update({
        "pipeline_events": n_events,
        "raw_consume_events_per_s": round(n_events / min(raw_s)),
        "fast_fetch_events_per_s": round(n_events / min(fast_s)),
        "pipeline_kafka_events_per_s": round(n_events / min(job_s)),
        "pipeline_kafka_vs_raw_consume": round(min(raw_s) / min(job_s), 3),
        "raw_consume_cpu_s": round(min(raw_cpu), 3),
        "pipeline_kafka_cpu_s": round(min(job_cpu), 3),
        "pipeline_kafka_cpu_vs_raw_consume": round(min(raw_cpu) / min(job_cpu), 3),
    })
    return figures

