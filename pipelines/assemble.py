"""Episode assembly: fragments → ordered, gap-checked episodes (core functions + streaming DoFn).

One pure core (:func:`dedupe_events`, :func:`assemble_episode`,
:func:`decide`) serves both modes:

* **batch / micro-batch** (:class:`pipelines.frames.AssembleEpisodesFromFrames`):
  ``GroupByKey`` the raw frames, decode, dedupe, then decide per episode with an
  event-time clock (the largest event time the run has seen, a side input):
  complete episodes go out as training data; unfinished ones are carried over as ``pending``
  (the job persists them under ``<out>/_state/`` and feeds them back next
  run) until they have been idle longer than ``incomplete_after`` seconds
  of event time, then they go out as ``incomplete``.
* **streaming** (:class:`AssembleEpisodesStreaming`): a stateful DoFn keeps
  each episode's events in a bag and sets an event-time timer at
  ``latest element timestamp + incomplete_after`` (the element timestamps are
  the source's event time, e.g. Kafka record time, the clock the watermark
  follows); the episode is emitted as soon as it is complete, or as
  ``incomplete`` when the timer fires (event-time timers only: Prism has no
  processing-time timers).

Examples:
    >>> from streams.synth import generate_episodes
    >>> evs = next(generate_episodes(1, seed=1))
    >>> unique, dups, conflicts = dedupe_events(evs + evs[:2])
    >>> len(unique) == len(evs), dups, conflicts
    (True, 2, [])
    >>> decide(unique, clock_s=0.0, incomplete_after_s=60.0)
    ('complete', None)
    >>> decide(unique[:-1], clock_s=unique[-2].event_time.timestamp() + 61, incomplete_after_s=60.0)
    ('incomplete', 'unfinished')
"""

from __future__ import annotations

from collections.abc import Iterable, Iterator
from typing import Any

import apache_beam as beam
from apache_beam.coders import PickleCoder
from apache_beam.metrics import Metrics
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import BagStateSpec, ReadModifyWriteStateSpec, TimerSpec, on_timer
from apache_beam.utils.timestamp import Duration, Timestamp

from pipelines.types import DEAD_LETTER_TAG, METRICS_NAMESPACE, Episode
from schemas.datasets import Verification
from schemas.deadletter import DeadLetter
from schemas.events import EpisodeFinished, EpisodeStarted, Event, Feedback, Step, StepVerified, make_event_id

__all__ = [
    "AssembleEpisodesStreaming",
    "dedupe_events",
    "assemble_episode",
    "decide",
    "PENDING_TAG",
    "INCOMPLETE_TAG",
]

PENDING_TAG = "pending"
#: Distribution metric (epoch ms) whose max is the run's event-time clock.
EVENT_TIME_METRIC = "event_time_ms"
INCOMPLETE_TAG = "incomplete"
_DETECTED_BY = "pipeline.dedupe"


def dedupe_events(events: Iterable[Event]) -> tuple[list[Event], int, list[Event]]:
    """Drop repeated events of one episode; ``(unique sorted by seq, duplicates, conflicts)``.

    Two copies with the same ``event_id`` are one event (ids are derived from
    ``(episode_id, seq)`` by :func:`schemas.events.make_event_id`, so a copy can
    only be in the same episode: deduplicating inside the episode after
    grouping is complete). Two *different* ids at the same ``seq`` are a
    conflict: the one with the canonical id (or else the smallest id) is kept,
    the others are returned as ``conflicts``. Deterministic whatever the
    input order.
    """
    by_id: dict[str, Event] = {}
    duplicates = 0
    for ev in events:
        if ev.event_id in by_id:
            duplicates += 1
        else:
            by_id[ev.event_id] = ev
    by_seq: dict[int, list[Event]] = {}
    for ev in by_id.values():
        by_seq.setdefault(ev.seq, []).append(ev)
    unique: list[Event] = []
    conflicts: list[Event] = []
    for seq in sorted(by_seq):
        cands = by_seq[seq]
        if len(cands) > 1:
            canonical = make_event_id(cands[0].episode_id, seq)
            cands.sort(key=lambda e: (e.event_id != canonical, e.event_id))
            conflicts.extend(cands[1:])
        unique.append(cands[0])
    return unique, duplicates, conflicts


def _status(events: list[Event]) -> tuple[bool, str | None]:
    """(complete, incomplete_reason) of deduplicated events sorted by seq."""
    if not events or not isinstance(events[0], EpisodeStarted):
        return False, "no_start"
    if events[-1].seq != len(events) - 1:
        return False, "gap"
    if not any(isinstance(e, EpisodeFinished) for e in events):
        return False, "unfinished"
    return True, None


def decide(events: list[Event], *, clock_s: float, incomplete_after_s: float) -> tuple[str, str | None]:
    """What to do with an episode's events now: ``complete``, ``pending`` or ``incomplete``.

    Args:
        events: deduplicated events sorted by ``seq``.
        clock_s: the event-time clock (epoch seconds): the latest event time seen.
        incomplete_after_s: idle event time after which an unfinished episode
            is given up on.

    Returns:
        ``(decision, incomplete_reason)``; the reason is set unless complete.
    """
    complete, reason = _status(events)
    if complete:
        return "complete", None
    last = max(e.event_time for e in events).timestamp()
    return ("incomplete" if clock_s - last > incomplete_after_s else "pending"), reason


def assemble_episode(episode_id: str, events: list[Event], *, complete: bool, reason: str | None) -> Episode:
    """Build an :class:`Episode` from deduplicated events sorted by seq."""
    started = next((e for e in events if isinstance(e, EpisodeStarted)), None)
    finished = next((e for e in events if isinstance(e, EpisodeFinished)), None)
    steps = sorted((e for e in events if isinstance(e, Step)), key=lambda s: s.step_index)
    index_of = {s.step_index: i for i, s in enumerate(steps)}
    verdicts: list[list[Verification]] = [[] for _ in steps]
    for e in events:
        if isinstance(e, StepVerified) and e.step_index in index_of:
            verdicts[index_of[e.step_index]].append(
                Verification(verifier=e.verifier, passed=e.passed, score=e.score, details=e.details, source="rollout")
            )
    first = events[0]
    task_group = (started.task_group if started is not None else "") or first.task_id
    times = [e.event_time for e in events]
    return Episode(
        episode_id=episode_id, domain=first.domain, task_id=first.task_id, task_group=task_group,
        policy_version=first.policy_version, started=started, finished=finished, steps=steps,
        verdicts=verdicts, feedback=[e for e in events if isinstance(e, Feedback)], num_events=len(events),
        first_event_time=min(times), last_event_time=max(times), complete=complete, incomplete_reason=reason,
    )


def _conflict_letter(ev: Event) -> DeadLetter:
    return DeadLetter(
        reason="seq_conflict",
        message=f"{ev.event_type} {ev.event_id} repeats seq {ev.seq} of episode {ev.episode_id} with another event id",
        source_topic="", source_partition=-1, source_offset=-1, key=ev.episode_id.encode(), value=None,
        detected_by=_DETECTED_BY, event_type=ev.event_type,
    )


class _DecideFn(beam.DoFn):
    """Batch decision per episode against the run's event-time clock (a side input)."""

    def __init__(self, incomplete_after_s: float) -> None:
        self._after = incomplete_after_s
        self._counters = {
            k: Metrics.counter(METRICS_NAMESPACE, k)
            for k in ("events_used", "events_incomplete", "events_pending_out",
                      "episodes_complete", "episodes_incomplete", "episodes_pending")
        }

    def process(self, element: tuple[str, list[Event]], clock_s: float) -> Iterator[Any]:
        episode_id, events = element
        decision, reason = decide(events, clock_s=clock_s, incomplete_after_s=self._after)
        if decision == "pending":
            self._counters["events_pending_out"].inc(len(events))
            self._counters["episodes_pending"].inc()
            yield beam.pvalue.TaggedOutput(PENDING_TAG, (episode_id, events))
            return
        complete = decision == "complete"
        self._counters["events_used" if complete else "events_incomplete"].inc(len(events))
        self._counters["episodes_complete" if complete else "episodes_incomplete"].inc()
        episode = assemble_episode(episode_id, events, complete=complete, reason=reason)
        yield episode if complete else beam.pvalue.TaggedOutput(INCOMPLETE_TAG, episode)


class _AssembleStatefulFn(beam.DoFn):
    """Streaming assembly: per-episode bag of events + an event-time idle timer."""

    EVENTS = BagStateSpec("events", PickleCoder())
    DONE = ReadModifyWriteStateSpec("done", PickleCoder())
    LAST = ReadModifyWriteStateSpec("last", PickleCoder())  # latest element timestamp (micros)
    IDLE = TimerSpec("idle", TimeDomain.WATERMARK)

    def __init__(self, incomplete_after_s: float, end_of_input_s: float | None) -> None:
        self._after = incomplete_after_s
        self._end_of_input_s = end_of_input_s
        self._counters = {
            k: Metrics.counter(METRICS_NAMESPACE, k)
            for k in ("duplicates", "dead_letters", "events_used", "events_incomplete", "events_pending_out",
                      "episodes_complete", "episodes_incomplete", "episodes_pending")
        }

    #: outcome -> (events counter, episodes counter)
    _OUTCOME = {"complete": ("events_used", "episodes_complete"),
                "incomplete": ("events_incomplete", "episodes_incomplete"),
                "pending": ("events_pending_out", "episodes_pending")}

    def _finish(self, unique: list[Event], dups: int, conflicts: list[Event], outcome: str) -> Iterator[Any]:
        """Count an episode's final events under ``outcome`` and emit its seq conflicts as dead letters."""
        events, episodes = self._OUTCOME[outcome]
        self._counters["duplicates"].inc(dups)
        self._counters[events].inc(len(unique))
        self._counters[episodes].inc()
        if conflicts:
            self._counters["dead_letters"].inc(len(conflicts))
            for ev in conflicts:
                yield beam.pvalue.TaggedOutput(DEAD_LETTER_TAG, _conflict_letter(ev))

    def process(self, element: tuple[str, list[Event]], timestamp=beam.DoFn.TimestampParam,
                events_state=beam.DoFn.StateParam(EVENTS), done_state=beam.DoFn.StateParam(DONE),
                last_state=beam.DoFn.StateParam(LAST), idle=beam.DoFn.TimerParam(IDLE)) -> Iterator[Any]:
        episode_id, fragment = element
        if done_state.read():
            self._counters["duplicates"].inc(len(fragment))  # late copies of an episode already emitted
            return
        for ev in fragment:
            events_state.add(ev)
        unique, dups, conflicts = dedupe_events(events_state.read())
        complete, _ = _status(unique)
        if complete:
            events_state.clear()
            last_state.clear()
            done_state.write(True)
            yield from self._finish(unique, dups, conflicts, "complete")
            yield assemble_episode(episode_id, unique, complete=True, reason=None)
            return
        prev = last_state.read()
        last = timestamp.micros if prev is None else max(prev, timestamp.micros)
        last_state.write(last)
        idle.set(Timestamp(micros=last) + Duration(seconds=self._after))

    @on_timer(IDLE)
    def on_idle(self, fired=beam.DoFn.TimestampParam, events_state=beam.DoFn.StateParam(EVENTS),
                done_state=beam.DoFn.StateParam(DONE), last_state=beam.DoFn.StateParam(LAST),
                key=beam.DoFn.KeyParam) -> Iterator[Any]:
        unique, dups, conflicts = dedupe_events(events_state.read())
        events_state.clear()
        last_state.clear()
        if not unique or done_state.read():
            return
        if self._end_of_input_s is not None and fired.micros >= self._end_of_input_s * 1e6:
            # Only the end of input (watermark to +inf) fired this timer: the episode is still open.
            yield from self._finish(unique, dups, conflicts, "pending")
            yield beam.pvalue.TaggedOutput(PENDING_TAG, (key, unique))
            return
        done_state.write(True)
        yield from self._finish(unique, dups, conflicts, "incomplete")
        _, reason = _status(unique)
        yield beam.pvalue.TaggedOutput(INCOMPLETE_TAG, assemble_episode(key, unique, complete=False, reason=reason))


class AssembleEpisodesStreaming(beam.PTransform):
    """Streaming twin of :class:`pipelines.frames.AssembleEpisodesFromFrames` (same core functions, stateful DoFn).

    Input elements must carry event-time timestamps (the source's job); the
    idle clock of an episode is its latest element timestamp. An episode is
    emitted once complete; one idle for ``incomplete_after_s`` of event time
    (watermark) goes to ``incomplete``. A late copy of an emitted episode's
    event is counted as a duplicate (the ``done`` flag stays in state for the
    key's lifetime); different events at one ``seq`` go to ``dead_letters``
    (``seq_conflict``) when the episode is emitted.

    A stream that ends (a stop condition moves the watermark to the end of
    time) fires every idle timer. With ``end_of_input_s`` set, a timer due at
    or after that event time (epoch seconds) can only have fired for that
    reason, so its episode goes to ``pending`` as ``(episode_id, events)``
    for the next run instead of ``incomplete``.

    Args:
        incomplete_after_s: idle event time before giving up on an episode.
        end_of_input_s: event time from which firing timers mean "input ended"
            (None: every firing timer means idle).

    Returns:
        A ``DoOutputsTuple`` with ``episodes`` (main), ``incomplete``,
        ``pending`` and ``dead_letters``.
    """

    def __init__(self, *, incomplete_after_s: float = 3600.0, end_of_input_s: float | None = None) -> None:
        super().__init__()
        if incomplete_after_s < 0:
            raise ValueError(f"`incomplete_after_s` must be >= 0, got {incomplete_after_s}")
        self._after = incomplete_after_s
        self._end_of_input_s = end_of_input_s

    def expand(self, fragments):
        return fragments | "AssembleStateful" >> beam.ParDo(
            _AssembleStatefulFn(self._after, self._end_of_input_s)
        ).with_output_types(Episode).with_outputs(INCOMPLETE_TAG, PENDING_TAG, DEAD_LETTER_TAG, main="episodes")
