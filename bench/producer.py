"""trajpipe's EventProducer against raw kafka-python, same broker, same messages.

Both send the same synthetic events with the same batching and compression
(lz4, linger 10 ms, 256 KiB batches, acks=all). The raw producer gets the
events **already encoded** (the cheapest thing kafka-python can be asked to
do, without idempotence or callbacks); trajpipe's ``emit`` encodes each event
itself, so the ratio charges trajpipe for its encoding, headers, idempotence,
error callbacks and spool bookkeeping. Five rounds, each one send of every
event per side on fresh topics, which side goes first alternating; the
figure is the ratio of the medians.
"""

from __future__ import annotations

import statistics
import time
import uuid
from pathlib import Path

from kafka import KafkaProducer

from schemas.codec import encode_event, kafka_headers
from streams.admin import ensure_topics
from streams.config import KafkaConnection, Topics
from streams.producer import EventProducer
from streams.synth import generate_episodes

__all__ = ["bench_producer"]

_BATCHING = dict(compression_type="lz4", linger_ms=10, batch_size=256 * 1024)


def _topic(conn: KafkaConnection, tag: str) -> str:
    name = f"bench.{tag}.{uuid.uuid4().hex[:8]}"
    ensure_topics(conn, Topics(events=name, dead_letters=name + ".dlq", control=name + ".ctl", partitions=4))
    return name


def bench_producer(bootstrap: str, workdir: Path, *, n_episodes: int = 1500, rounds: int = 5) -> dict[str, float]:
    """Events/s of ``EventProducer.emit`` vs ``KafkaProducer.send`` (pre-encoded), side by side."""
    conn = KafkaConnection(bootstrap_servers=bootstrap, client_id="bench")
    events = [ev for ep in generate_episodes(n_episodes, seed=2) for ev in ep]
    frames = [(ev.episode_id.encode(), encode_event(ev), kafka_headers(ev)) for ev in events]
    ours, raw = [], []

    def run_raw() -> None:
        topic = _topic(conn, "raw")
        producer = KafkaProducer(**conn.client_kwargs(), acks="all", **_BATCHING)
        producer.send(topic, b"warm-up")
        producer.flush()
        t0 = time.perf_counter()
        for key, value, headers in frames:
            producer.send(topic, key=key, value=value, headers=headers)
        producer.flush()
        raw.append(len(frames) / (time.perf_counter() - t0))
        producer.close()

    def run_ours(r: int) -> None:
        topic = _topic(conn, "trajpipe")
        with EventProducer(conn, topic, spool_dir=workdir / f"spool-{r}", **_BATCHING) as ep:
            ep.emit(events[0])
            ep.flush()
            t0 = time.perf_counter()
            for ev in events:
                ep.emit(ev)
            stats = ep.flush()
            ours.append(len(events) / (time.perf_counter() - t0))
        assert stats.spooled == 0, "broker went away during the benchmark"

    for r in range(rounds):  # alternate which side goes first, so a drift in load hits both alike
        if r % 2 == 0:
            run_raw()
            run_ours(r)
        else:
            run_ours(r)
            run_raw()
    med = statistics.median
    return {
        "producer_events_per_s": round(med(ours)),
        "raw_kafka_python_events_per_s": round(med(raw)),
        "producer_vs_raw_kafka_python": round(med(ours) / med(raw), 3),
    }
