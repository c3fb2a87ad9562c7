"""DecodeAndValidate: raw Kafka record batches → per-episode fragments + dead letters.

Examples:
    >>> from schemas.events import Step
    >>> ev = Step(event_id="s", episode_id="ep", seq=1, producer_id="w", domain="math", task_id="t",
    ...           step_index=3, action_token_ids=[1], behaviour_logprobs=[-0.1])
    >>> validate_event(ev, key=b"ep")
    ('invalid_event', 'step ep/1 has step_index 3 but seq 1; a step needs step_index < seq')
"""

from __future__ import annotations

import math
import time
from collections import defaultdict
from collections.abc import Iterator
from datetime import datetime, timezone
from typing import Any, List, Tuple

import apache_beam as beam
from apache_beam.metrics import Metrics

import pipelines.coders  # noqa: F401  (registers the element coders)
from pipelines.types import DEAD_LETTER_TAG, METRICS_NAMESPACE, RawRecords
from schemas.codec import EventDecodeError, decode_event
from schemas.deadletter import DeadLetter
from schemas.events import EpisodeFinished, EpisodeStarted, Event, PolicyPublished, Step, StepVerified

__all__ = ["DecodeAndValidate", "validate_event", "record_dead_letter", "DETECTED_BY"]

#: ``DeadLetter.detected_by`` of everything this transform quarantines.
DETECTED_BY = "pipeline.decode"


def validate_event(event: Event, *, key: bytes | None) -> tuple[str, str] | None:
    """Semantic checks the codec cannot make; ``(reason, message)`` or None if valid.

    Reasons: ``key_mismatch`` (the Kafka key is not the episode id, so
    per-episode ordering is not guaranteed), ``wrong_topic`` (a control event on
    the events topic), ``invalid_seq`` (negative seq, or ``episode_started``
    not at seq 0), ``invalid_event`` (step/verdict indices inconsistent with seq,
    negative counts).
    """
    if key is not None and key != event.episode_id.encode():
        return "key_mismatch", f"{_where(event)} has Kafka key {key[:64]!r}; events must be keyed by episode_id"
    seq = event.seq
    if isinstance(event, Step) and seq > 0:  # the common case first; messages are built only on failure
        if not 0 <= event.step_index < seq:
            return "invalid_event", (f"{_where(event)} has step_index {event.step_index} but seq {seq}; "
                                     "a step needs step_index < seq")
        if event.action_tokens != len(event.action_token_ids):
            return "invalid_event", (f"{_where(event)} says action_tokens={event.action_tokens} but has "
                                     f"{len(event.action_token_ids)} ids")
        return None
    if isinstance(event, PolicyPublished):
        return "wrong_topic", f"{_where(event)} is a control event; it belongs on the control topic"
    if seq < 0:
        return "invalid_seq", f"{_where(event)} has negative seq"
    if isinstance(event, EpisodeStarted):
        return None if seq == 0 else ("invalid_seq", f"{_where(event)}: episode_started must have seq 0")
    if seq == 0:
        return "invalid_seq", f"{_where(event)}: only episode_started may have seq 0"
    if isinstance(event, StepVerified) and not 0 <= event.step_index < seq:  # (a Step got here only with seq <= 0)
        return "invalid_event", (f"{_where(event)} has step_index {event.step_index} but seq {seq}; "
                                 "a step needs step_index < seq")
    if isinstance(event, EpisodeFinished) and event.num_steps < 0:
        return "invalid_event", f"{_where(event)} has negative num_steps"
    return None


def _where(event: Event) -> str:
    return f"{event.event_type} {event.episode_id}/{event.seq}"


class _DecodeBatchFn(beam.DoFn):
    """One RawRecords batch → one fragment per episode in it (+ dead letters); counts future events."""

    def __init__(self, max_event_bytes: int, max_future_s: float) -> None:
        self._max_event_bytes = max_event_bytes
        self._max_future_s = max_future_s
        self._future = Metrics.counter(METRICS_NAMESPACE, "future_events")
        self._events_in = Metrics.counter(METRICS_NAMESPACE, "events_in")
        self._dead = Metrics.counter(METRICS_NAMESPACE, "dead_letters")
        self._batches = Metrics.counter(METRICS_NAMESPACE, "batches_in")

    def process(self, batch: RawRecords) -> Iterator[Any]:
        by_episode: dict[str, list[Event]] = defaultdict(list)
        dead = future = 0
        limit_s = time.time() + self._max_future_s  # processing time + tolerance
        limit_ms = limit_s * 1000 if math.isfinite(limit_s) else math.inf
        limit = datetime.fromtimestamp(limit_s, timezone.utc) if math.isfinite(limit_s) else datetime.max.replace(
            tzinfo=timezone.utc)
        for offset, key, value, ts in zip(batch.offsets, batch.keys, batch.values, batch.timestamps_ms):
            try:
                event = decode_event(value, max_bytes=self._max_event_bytes)
            except EventDecodeError as err:
                dead += 1
                yield beam.pvalue.TaggedOutput(DEAD_LETTER_TAG, record_dead_letter(
                    batch.topic, batch.partition, offset, ts, key, value, err.reason, str(err), err.event_type))
                continue
            problem = validate_event(event, key=key)
            if problem is not None:
                dead += 1
                yield beam.pvalue.TaggedOutput(DEAD_LETTER_TAG, record_dead_letter(
                    batch.topic, batch.partition, offset, ts, key, value, problem[0], problem[1], event.event_type))
                continue
            if ts > limit_ms or event.event_time > limit:
                future += 1
            by_episode[event.episode_id].append(event)
        self._batches.inc()
        self._events_in.inc(len(batch))
        if dead:
            self._dead.inc(dead)
        if future:
            self._future.inc(future)
        yield from by_episode.items()


def record_dead_letter(topic: str, partition: int, offset: int, ts: int, key: bytes | None, value: bytes | None,
                       reason: str, message: str, event_type: str | None) -> DeadLetter:
    """The dead letter of one Kafka record this stage rejects (its position, raw key and value)."""
    return DeadLetter(
        reason=reason, message=message, source_topic=topic, source_partition=partition, source_offset=offset,
        key=key, value=value, detected_by=DETECTED_BY, source_timestamp_ms=ts, event_type=event_type,
    )


class DecodeAndValidate(beam.PTransform):
    """Decode :class:`~pipelines.types.RawRecords` into per-episode fragments.

    Every record is decoded with :func:`schemas.codec.decode_event` and checked
    with :func:`validate_event`. Bad records never fail the job: they leave on
    the ``dead_letters`` output as :class:`schemas.deadletter.DeadLetter`
    (reason code, message, source topic/partition/offset, raw key and value).
    Counters ``pipeline/events_in`` and ``pipeline/dead_letters``, and
    ``pipeline/future_events``: events whose ``event_time`` or Kafka record
    timestamp is more than ``max_future_s`` ahead of the wall clock when the
    batch is decoded (a producer's clock running fast; they are kept).

    Returns:
        A ``DoOutputsTuple`` with ``fragments`` (``(episode_id, list[Event])``,
        one per episode per batch) and ``dead_letters``.
    """

    def __init__(self, *, max_event_bytes: int = 1 << 20, max_future_s: float = math.inf) -> None:
        super().__init__()
        self._max_event_bytes = max_event_bytes
        self._max_future_s = max_future_s

    def expand(self, batches):
        return batches | "DecodeBatches" >> beam.ParDo(
            _DecodeBatchFn(self._max_event_bytes, self._max_future_s)).with_output_types(
            Tuple[str, List[Event]]).with_outputs(
            DEAD_LETTER_TAG, main="fragments"
        )
