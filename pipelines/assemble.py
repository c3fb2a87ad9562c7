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

Events of an episode an earlier commit wrote as incomplete are *late*
(:func:`resolve_late`, pipelines/late.py): counted, recorded, and used to
complete the episode when they can.

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

import math
import time
from collections.abc import Iterable, Iterator, Sequence
from typing import Any

import apache_beam as beam
import msgspec
from apache_beam.coders import PickleCoder
from apache_beam.metrics import Metrics
from apache_beam.transforms.timeutil import TimeDomain
from apache_beam.transforms.userstate import BagStateSpec, ReadModifyWriteStateSpec, TimerSpec, on_timer
from apache_beam.utils.timestamp import Duration, Timestamp

from pipelines.counts import BundleCounts
from pipelines.late import LATE_TAG, LateEpisode, LateState, LateStateReader
from pipelines.types import DEAD_LETTER_TAG, METRICS_NAMESPACE, Episode
from schemas.datasets import Verification
from schemas.deadletter import DeadLetter
from schemas.events import EpisodeFinished, EpisodeStarted, Event, Feedback, Step, StepVerified, make_event_id

__all__ = [
    "AssembleEpisodesStreaming",
    "dedupe_events",
    "assemble_episode",
    "decide",
    "resolve_late",
    "LateResolution",
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


def decide(events: list[Event], *, clock_s: float, incomplete_after_s: float,
           future_after_s: float = math.inf) -> tuple[str, str | None]:
    """What to do with an episode's events now: ``complete``, ``pending`` or ``incomplete``.

    Args:
        events: deduplicated events sorted by ``seq``.
        clock_s: the event-time clock (epoch seconds): the latest event time seen,
            future event times left out.
        incomplete_after_s: idle event time after which an unfinished episode
            is given up on.
        future_after_s: event times later than this (epoch seconds) are *future*
            (a producer's clock running fast): the episode's idle time counts
            from this instead.

    Returns:
        ``(decision, incomplete_reason)``; the reason is set unless complete.

    Examples:
        >>> from streams.synth import generate_episodes
        >>> evs = next(generate_episodes(1, seed=1))[:-1]
        >>> last = evs[-1].event_time.timestamp()
        >>> decide(evs, clock_s=last + 61, incomplete_after_s=60.0, future_after_s=last - 3600)
        ('incomplete', 'unfinished')
        >>> decide(evs, clock_s=last - 3600 + 59, incomplete_after_s=60.0, future_after_s=last - 3600)
        ('pending', 'unfinished')
    """
    complete, reason = _status(events)
    if complete:
        return "complete", None
    last = min(max(e.event_time for e in events).timestamp(), future_after_s)
    return ("incomplete" if clock_s - last > incomplete_after_s else "pending"), reason


def assemble_episode(episode_id: str, events: list[Event], *, complete: bool, reason: str | None,
                     completed_late: bool = False) -> Episode:
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
        completed_late=completed_late,
    )


def _conflict_letter(ev: Event) -> DeadLetter:
    return DeadLetter(
        reason="seq_conflict",
        message=f"{ev.event_type} {ev.event_id} repeats seq {ev.seq} of episode {ev.episode_id} with another event id",
        source_topic="", source_partition=-1, source_offset=-1, key=ev.episode_id.encode(), value=None,
        detected_by=_DETECTED_BY, event_type=ev.event_type,
    )


class _DecideFn(beam.DoFn):
    """Batch decision per episode against the run's event-time clock (a side input).

    With ``keep_events``, an episode decided incomplete also leaves its events on
    ``late`` (a :class:`~pipelines.late.LateEpisode` to keep in the late state).
    :class:`~pipelines.late.LateEpisode` elements (outcomes of late events,
    :class:`pipelines.frames.EpisodeAssembler`) pass through to ``late``.
    """

    def __init__(self, incomplete_after_s: float, *, future_after_s: float = math.inf,
                 keep_events: bool = False) -> None:
        self._after, self._future_after, self._keep = incomplete_after_s, future_after_s, keep_events
        self._counters = BundleCounts(("events_used", "events_incomplete", "events_pending_out",
                                       "episodes_complete", "episodes_incomplete", "episodes_pending"))

    def finish_bundle(self) -> Iterator[Any]:
        yield from self._counters.output()  # the counts as data (pipelines/counts.py)

    def process(self, element: tuple[str, list[Event]] | LateEpisode, clock_s: float) -> Iterator[Any]:
        if isinstance(element, LateEpisode):
            yield beam.pvalue.TaggedOutput(LATE_TAG, element)
            return
        episode_id, events = element
        decision, reason = decide(events, clock_s=clock_s, incomplete_after_s=self._after,
                                  future_after_s=self._future_after)
        if decision == "pending":
            self._counters["events_pending_out"].inc(len(events))
            self._counters["episodes_pending"].inc()
            yield beam.pvalue.TaggedOutput(PENDING_TAG, (episode_id, events))
            return
        complete = decision == "complete"
        self._counters["events_used" if complete else "events_incomplete"].inc(len(events))
        self._counters["episodes_complete" if complete else "episodes_incomplete"].inc()
        episode = assemble_episode(episode_id, events, complete=complete, reason=reason)
        if complete:
            yield episode
            return
        yield beam.pvalue.TaggedOutput(INCOMPLETE_TAG, episode)
        if self._keep:
            yield beam.pvalue.TaggedOutput(LATE_TAG, LateEpisode(episode_id=episode_id, reason=None, store=events))


class LateResolution(msgspec.Struct, kw_only=True, gc=False):
    """:func:`resolve_late`'s answer.

    Attributes:
        late: new events, sorted by seq.
        duplicates: copies of kept events, or repeated within the new ones.
        conflicts: new events at a ``seq`` taken by another event (dead letters).
        events: kept + late events, sorted by seq.
        complete: ``events`` make a complete episode (never without kept events).
    """

    late: list[Event]
    duplicates: int
    conflicts: list[Event]
    events: list[Event]
    complete: bool


def resolve_late(new: Iterable[Event], kept: Sequence[Event]) -> LateResolution:
    """Sort the new events of an episode written as incomplete into duplicates, conflicts and late ones.

    The kept events win: they were written (as the incomplete episode) first.

    Args:
        new: events of the episode read now (any order, maybe repeated).
        kept: its events in the late state (deduplicated; empty when none are kept).

    Examples:
        >>> from streams.synth import generate_episodes
        >>> ep = next(generate_episodes(1, seed=2))
        >>> kept = ep[:-2]  # what the incomplete commit kept
        >>> res = resolve_late(ep[-3:] + ep[-1:], kept)  # a copy of a kept event, the tail, the tail's last again
        >>> [e.seq for e in res.late] == [ep[-2].seq, ep[-1].seq], res.duplicates, res.complete
        (True, 2, True)
    """
    unique, duplicates, conflicts = dedupe_events(new)
    kept_ids = {e.event_id for e in kept}
    kept_seqs = {e.seq for e in kept}
    late: list[Event] = []
    for ev in unique:
        if ev.event_id in kept_ids:
            duplicates += 1
        elif ev.seq in kept_seqs:
            conflicts.append(ev)
        else:
            late.append(ev)
    events = sorted([*kept, *late], key=lambda e: e.seq)
    complete = bool(kept) and bool(late) and _status(events)[0]
    return LateResolution(late=late, duplicates=duplicates, conflicts=conflicts, events=events, complete=complete)


#: ``done`` state of the streaming assembler: how the episode went out (older state holds ``True``: complete).
_COMPLETE, _INCOMPLETE = "complete", "incomplete"


class _AssembleStatefulFn(beam.DoFn):
    """Streaming assembly: per-episode bag of events, an event-time idle timer, and the late-state timer."""

    EVENTS = BagStateSpec("events", PickleCoder())
    DONE = ReadModifyWriteStateSpec("done", PickleCoder())  # None, _COMPLETE or _INCOMPLETE
    LAST = ReadModifyWriteStateSpec("last", PickleCoder())  # latest element timestamp (micros)
    IDLE = TimerSpec("idle", TimeDomain.WATERMARK)
    RETAIN = TimerSpec("retain", TimeDomain.WATERMARK)  # end of the late retention of an incomplete episode

    def __init__(self, incomplete_after_s: float, end_of_input_s: float | None, *, late: LateState | None = None,
                 late_retention_s: float = 0.0, end_of_input_lag_s: float | None = None,
                 committed: Any = None) -> None:
        self._after = incomplete_after_s
        self._end_of_input_s = end_of_input_s
        self._end_of_input_lag_s = end_of_input_lag_s
        self._late = late or LateState()
        self._committed = committed
        self._retention = late_retention_s
        self._counters = {
            k: Metrics.counter(METRICS_NAMESPACE, k)
            for k in ("duplicates", "dead_letters", "events_used", "events_incomplete", "events_pending_out",
                      "episodes_complete", "episodes_incomplete", "episodes_pending", "late_events",
                      "episodes_completed_late")
        }

    def setup(self) -> None:
        if self._committed is not None:  # read from the dataset here, not shipped in the job graph
            self._late = self._committed.load().late
        self._reader = LateStateReader(self._late)

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
        yield from self._conflicts(conflicts)

    def _conflicts(self, conflicts: list[Event]) -> Iterator[Any]:
        if conflicts:
            self._counters["dead_letters"].inc(len(conflicts))
            for ev in conflicts:
                yield beam.pvalue.TaggedOutput(DEAD_LETTER_TAG, _conflict_letter(ev))

    def process(self, element: tuple[str, list[Event]], timestamp=beam.DoFn.TimestampParam,
                events_state=beam.DoFn.StateParam(EVENTS), done_state=beam.DoFn.StateParam(DONE),
                last_state=beam.DoFn.StateParam(LAST), idle=beam.DoFn.TimerParam(IDLE),
                retain=beam.DoFn.TimerParam(RETAIN)) -> Iterator[Any]:
        episode_id, fragment = element
        done = done_state.read()
        if done is None and episode_id in self._late.incomplete:  # an earlier run wrote it as incomplete
            done = self._restore(episode_id, timestamp, events_state, done_state, retain)
        if done == _INCOMPLETE:
            yield from self._late_events(episode_id, fragment, timestamp, events_state, done_state, retain)
            return
        if done:
            self._counters["duplicates"].inc(len(fragment))  # late copies of an episode already emitted complete
            return
        for ev in fragment:
            events_state.add(ev)
        unique, dups, conflicts = dedupe_events(events_state.read())
        complete, _ = _status(unique)
        if complete:
            events_state.clear()
            last_state.clear()
            done_state.write(_COMPLETE)
            yield from self._finish(unique, dups, conflicts, "complete")
            yield assemble_episode(episode_id, unique, complete=True, reason=None)
            return
        prev = last_state.read()
        last = timestamp.micros if prev is None else max(prev, timestamp.micros)
        last_state.write(last)
        idle.set(Timestamp(micros=last) + Duration(seconds=self._after))

    def _restore(self, episode_id: str, timestamp: Timestamp, events_state, done_state, retain) -> str:
        """State of an episode an earlier run wrote as incomplete: its kept events (if any), for the retention.

        The late state was read within the retention (:func:`pipelines.commit.load_late_state`); from
        here on, the retention counts from the element that brought the episode back (element time).
        """
        kept = self._reader.events(episode_id)
        for ev in kept:
            events_state.add(ev)
        done_state.write(_INCOMPLETE)
        if kept:
            retain.set(timestamp + Duration(seconds=self._retention))
        return _INCOMPLETE

    def _late_events(self, episode_id: str, fragment: list[Event], timestamp: Timestamp, events_state, done_state,
                     retain) -> Iterator[Any]:
        kept = list(events_state.read())
        res = resolve_late(fragment, kept)
        self._counters["duplicates"].inc(res.duplicates)
        self._counters["late_events"].inc(len(res.late))
        yield from self._conflicts(res.conflicts)
        if not res.late:
            return
        if not kept:
            yield beam.pvalue.TaggedOutput(LATE_TAG, LateEpisode(episode_id=episode_id, reason="expired",
                                                                 late=res.late))
            return
        if res.complete:
            events_state.clear()
            done_state.write(_COMPLETE)
            self._counters["episodes_completed_late"].inc()
            yield beam.pvalue.TaggedOutput(LATE_TAG, LateEpisode(episode_id=episode_id, reason="completed",
                                                                 late=res.late))
            yield assemble_episode(episode_id, res.events, complete=True, reason=None, completed_late=True)
            return
        for ev in res.late:
            events_state.add(ev)
        retain.set(timestamp + Duration(seconds=self._retention))
        yield beam.pvalue.TaggedOutput(LATE_TAG, LateEpisode(episode_id=episode_id, reason="stored", late=res.late,
                                                             store=res.events))

    @on_timer(IDLE)
    def on_idle(self, fired=beam.DoFn.TimestampParam, events_state=beam.DoFn.StateParam(EVENTS),
                done_state=beam.DoFn.StateParam(DONE), last_state=beam.DoFn.StateParam(LAST),
                retain=beam.DoFn.TimerParam(RETAIN), key=beam.DoFn.KeyParam) -> Iterator[Any]:
        if done_state.read():
            return
        unique, dups, conflicts = dedupe_events(events_state.read())
        last = last_state.read()
        events_state.clear()
        last_state.clear()
        if not unique:
            return
        if self._ended_input(fired):
            # Only the end of input (watermark to +inf) fired this timer: the episode is still open.
            yield from self._finish(unique, dups, conflicts, "pending")
            yield beam.pvalue.TaggedOutput(PENDING_TAG, (key, unique))
            return
        done_state.write(_INCOMPLETE)
        yield from self._finish(unique, dups, conflicts, "incomplete")
        _, reason = _status(unique)
        yield beam.pvalue.TaggedOutput(INCOMPLETE_TAG, assemble_episode(key, unique, complete=False, reason=reason))
        if self._retention > 0:  # kept for late events, in state and (for a restart) in the late state
            for ev in unique:
                events_state.add(ev)
            retain.set(max(fired, Timestamp(micros=last or fired.micros) + Duration(seconds=self._retention)))
            yield beam.pvalue.TaggedOutput(LATE_TAG, LateEpisode(episode_id=key, reason=None, store=unique))

    def _ended_input(self, fired: Timestamp) -> bool:
        if self._end_of_input_s is not None and fired.micros >= self._end_of_input_s * 1e6:
            return True
        # A caught-up source holds the watermark at the wall clock minus its lag: a timer due later than
        # that can only fire because the stream ended (a record stamped ahead of the clock may also move
        # the watermark there; its episode is then carried as pending, decided by the next run).
        return self._end_of_input_lag_s is not None and fired.micros > (time.time() - self._end_of_input_lag_s) * 1e6

    @on_timer(RETAIN)
    def on_retain(self, events_state=beam.DoFn.StateParam(EVENTS), done_state=beam.DoFn.StateParam(DONE)) -> None:
        if done_state.read() == _INCOMPLETE:
            events_state.clear()  # past the retention: later events of the episode are late, reason `expired`


class AssembleEpisodesStreaming(beam.PTransform):
    """Streaming twin of :class:`pipelines.frames.AssembleEpisodesFromFrames` (same core functions, stateful DoFn).

    Input elements must carry event-time timestamps (the source's job); the
    idle clock of an episode is its latest element timestamp. An episode is
    emitted once complete; one idle for ``incomplete_after_s`` of event time
    (watermark) goes to ``incomplete``. A late copy of an episode emitted
    complete is counted as a duplicate (the ``done`` flag stays in state for
    the key's lifetime); different events at one ``seq`` go to
    ``dead_letters`` (``seq_conflict``) when the episode is emitted.

    Late events (pipelines/late.py): an episode emitted incomplete keeps its
    events in state for ``late_retention_s`` of event time after its last
    element (and leaves them on ``late`` for the commit's late state). Its
    events that come later are resolved against them (:func:`resolve_late`):
    copies are duplicates, new ones ``late_events`` on ``late``; if they
    complete it, it is emitted complete with ``completed_late=True``. An
    episode in ``late.incomplete`` (written incomplete by an earlier run) is
    restored from the late state the first time its key is seen.

    A stream that ends (a stop condition moves the watermark to the end of
    time) fires every idle timer. With ``end_of_input_s`` set, a timer due at
    or after that event time (epoch seconds) can only have fired for that
    reason, so its episode goes to ``pending`` as ``(episode_id, events)``
    for the next run instead of ``incomplete``. With ``end_of_input_lag_s``
    set (a stop whose time is not known in advance), so does a timer due
    later than the wall clock at firing minus that lag (the source's idle
    watermark lag).

    Args:
        incomplete_after_s: idle event time before giving up on an episode.
        end_of_input_s: event time from which firing timers mean "input ended"
            (None: every firing timer means idle).
        late: the late state of the last commit (:func:`pipelines.commit.load_late_state`).
        late_retention_s: event-time seconds an incomplete episode's events are
            kept (0: none; its later events are late, reason ``expired``).
        end_of_input_lag_s: a timer due later than the wall clock minus this many
            seconds when it fires means "input ended" (None: only ``end_of_input_s``).
        committed: a :class:`pipelines.committed.CommittedView`: ``late`` is read from the dataset by
            the workers instead (the job graph does not grow with the history).

    Returns:
        A ``DoOutputsTuple`` with ``episodes`` (main), ``incomplete``,
        ``pending``, ``late`` and ``dead_letters``.
    """

    def __init__(self, *, incomplete_after_s: float = 3600.0, end_of_input_s: float | None = None,
                 late: LateState | None = None, late_retention_s: float = 0.0,
                 end_of_input_lag_s: float | None = None, committed: Any = None) -> None:
        super().__init__()
        self._committed = committed
        if incomplete_after_s < 0 or late_retention_s < 0:
            raise ValueError(f"`incomplete_after_s` and `late_retention_s` must be >= 0, got {incomplete_after_s} "
                             f"and {late_retention_s}")
        self._after = incomplete_after_s
        self._end_of_input_s = end_of_input_s
        self._late, self._retention = late, late_retention_s
        self._end_of_input_lag_s = end_of_input_lag_s

    def expand(self, fragments):
        return fragments | "AssembleStateful" >> beam.ParDo(
            _AssembleStatefulFn(self._after, self._end_of_input_s, late=self._late, late_retention_s=self._retention,
                                end_of_input_lag_s=self._end_of_input_lag_s, committed=self._committed)
        ).with_output_types(Episode).with_outputs(INCOMPLETE_TAG, PENDING_TAG, LATE_TAG, DEAD_LETTER_TAG,
                                                  main="episodes")
