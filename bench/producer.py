"""trajpipe's EventProducer against raw kafka-python, same broker, same messages.

Both send the same synthetic events with the same batching and compression
(lz4, linger 10 ms, 256 KiB batches), ``acks=all`` and idempotence (kafka-python's
default with ``acks=all``), on topics of 4 partitions. The raw producer gets the
events **already encoded** and sends them without callbacks, with
kafka-python's default partitioner (the same partitions as trajpipe's
``KeyHashPartitioner``); trajpipe's ``emit`` encodes each event itself, so the
ratio charges trajpipe for its encoding, headers, error callbacks and spool
bookkeeping. The raw side differs in two ways that are not settings: no
per-record errback (trajpipe needs it to spool a failed record) and kafka-python's
default partitioner, pure-Python murmur2 of every key (trajpipe's
``KeyHashPartitioner`` picks the same partitions and remembers each key's hash).

Five rounds, each on fresh topics with fresh producers. A round sends every
event once per side, in ten slices: one side sends a slice and flushes, then
the other sends the same slice and flushes, which side goes first alternating
from slice to slice, so the other engineers' load on the shared machine hits
both sides alike. ``producer_vs_raw_kafka_python`` is the median over the 50
slice pairs of the ratio within the pair (robust to a burst that hits one slice);
``producer_events_per_s`` and ``raw_kafka_python_events_per_s`` are each side's
median over the rounds (events / summed slice times). The benchmark's own event
lists are frozen out of the garbage collector (``gc.freeze``), so neither side
pays for collecting them.
"""

from __future__ import annotations

import gc
import logging
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

log = logging.getLogger(__name__)

_BATCHING = dict(compression_type="lz4", linger_ms=10, batch_size=256 * 1024)


def _topic(conn: KafkaConnection, tag: str) -> str:
    name = f"bench.{tag}.{uuid.uuid4().hex[:8]}"
    ensure_topics(conn, Topics(events=name, dead_letters=name + ".dlq", control=name + ".ctl", partitions=4))
    return name


def bench_producer(bootstrap: str, workdir: Path, *, n_episodes: int = 1500, rounds: int = 5,
                   chunks: int = 10) -> dict[str, float]:
    """Events/s of ``EventProducer.emit`` vs ``KafkaProducer.send`` (pre-encoded), side by side.

    Args:
        bootstrap: Kafka bootstrap servers.
        workdir: scratch directory (spools).
        n_episodes: synthetic episodes (~10 events each) every side sends once per round.
        rounds: rounds, each on fresh topics and fresh producers.
        chunks: slices of the events per round, each sent and flushed by one side, then the other.
    """
    conn = KafkaConnection(bootstrap_servers=bootstrap, client_id="bench")
    events = [ev for ep in generate_episodes(n_episodes, seed=2) for ev in ep]
    frames = [(ev.episode_id.encode(), encode_event(ev), kafka_headers(ev)) for ev in events]
    bounds = [len(events) * c // chunks for c in range(chunks + 1)]
    ours: list[float] = []  # events/s per round
    raw: list[float] = []
    ratios: list[float] = []  # ours / raw per slice pair
    gc.collect()
    gc.freeze()  # the benchmark's own event lists out of the collector's way (else either side pays for them)
    try:
        for r in range(rounds):
            raw_s, ours_s = _round(conn, workdir / f"spool-{r}", events, frames, bounds, round_index=r,
                                   ratios=ratios)
            ours.append(len(events) / ours_s)
            raw.append(len(events) / raw_s)
    finally:
        gc.unfreeze()
    log.info("producer bench rounds: ours %s, raw %s; slice ratios %s", [round(x) for x in ours],
             [round(x) for x in raw], sorted(round(x, 3) for x in ratios))
    med = statistics.median
    return {
        "producer_events_per_s": round(med(ours)),
        "raw_kafka_python_events_per_s": round(med(raw)),
        "producer_vs_raw_kafka_python": round(med(ratios), 3),
    }


def _round(conn: KafkaConnection, spool_dir: Path, events: list, frames: list, bounds: list[int], *,
           round_index: int, ratios: list[float]) -> tuple[float, float]:
    """One round on fresh topics: every slice by both sides in turn; appends each slice pair's ratio.

    Returns:
        The raw side's and trajpipe's summed seconds.
    """
    raw_topic, our_topic = _topic(conn, "raw"), _topic(conn, "trajpipe")
    raw_producer = KafkaProducer(**conn.client_kwargs(), acks="all", **_BATCHING)
    try:
        with EventProducer(conn, our_topic, spool_dir=spool_dir, **_BATCHING) as ep:
            raw_producer.send(raw_topic, b"warm-up")
            raw_producer.flush()
            ep.emit(events[0])
            ep.flush()

            def run_raw(lo: int, hi: int) -> float:
                t0 = time.perf_counter()
                for key, value, headers in frames[lo:hi]:
                    raw_producer.send(raw_topic, key=key, value=value, headers=headers)
                raw_producer.flush()
                return time.perf_counter() - t0

            def run_ours(lo: int, hi: int) -> float:
                t0 = time.perf_counter()
                for ev in events[lo:hi]:
                    ep.emit(ev)
                ep.flush()
                return time.perf_counter() - t0

            raw_s = ours_s = 0.0
            for c in range(len(bounds) - 1):  # the sides take turns, first side alternating: load drift hits both
                lo, hi = bounds[c], bounds[c + 1]
                if (round_index + c) % 2 == 0:
                    raw_slice = run_raw(lo, hi)
                    ours_slice = run_ours(lo, hi)
                else:
                    ours_slice = run_ours(lo, hi)
                    raw_slice = run_raw(lo, hi)
                raw_s += raw_slice
                ours_s += ours_slice
                ratios.append(raw_slice / ours_slice)  # same events: the ratio of the rates
            stats = ep.flush()
    finally:
        raw_producer.close()
    if stats.spooled:
        raise RuntimeError(f"{stats.spooled} events were spooled: the broker went away during the benchmark")
    return raw_s, ours_s
