"""The columnar path's first step (issue 16, item 1; docs/pipelines.md, "The columnar path, as a plan"): the split.

A task's decoded events as columns (:func:`event_columns`: each event's episode, ``seq`` and kind), and
the vectorized checks that decide which episodes are *plain* (:func:`split_plain`): complete, with
nothing for the per-episode object path to resolve. Only plain episodes are for the columnar steps
that follow (rewards, returns and rows over many episodes at once); every other episode keeps going
through :class:`pipelines.frames.EpisodeAssembler` as today.

An episode is plain when, of its valid events (the dead letters already gone):

* it is not excluded by the caller (an episode an earlier commit emitted or wrote as incomplete, or one
  whose events were split over two tasks);
* it has no :class:`~schemas.events.Feedback` (attached to the episode by the object path);
* its ``seq`` values, sorted, are exactly ``0 .. n-1``: no gap, and no second event at a ``seq``
  (a repeated copy, or a conflict between two ids);
* its event ids are distinct (a copy is known by its id, whatever its ``seq``);
* the event at ``seq`` 0 is :class:`~schemas.events.EpisodeStarted`, and one of its events is an
  :class:`~schemas.events.EpisodeFinished`.

These are the object path's own rules for an episode it assembles complete with no duplicate, no
conflict and no feedback (``split_feedback``, ``dedupe_events``, ``_status`` in
:meth:`EpisodeAssembler._episode <pipelines.frames.EpisodeAssembler>`): tested equal on fuzzed event
sets and on real rollouts (tests/pipelines/test_columnar.py, tests/pipelines/test_counts_from_files.py).
Not wired into the job yet; the event-time clock and the counts stay the assembler's.

Examples:
    >>> from streams.synth import generate_episodes
    >>> a, b, c = generate_episodes(3, seed=1)
    >>> cols = event_columns([("a", a), ("b", b[:-1]), ("c", c + c[-1:])])  # b unfinished, c with a copy
    >>> split = split_plain(cols)
    >>> split.plain.tolist(), split_plain(cols, exclude={"a"}).plain.tolist()
    ([True, False, False], [False, False, False])
    >>> [int(cols.seq[i]) for i in split.order[split.offsets[0]:split.offsets[1]]] == list(range(len(a)))
    True
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Collection, Sequence
from typing import NamedTuple

import numpy as np

from schemas.events import EpisodeFinished, EpisodeStarted, Event, Feedback, Step, StepVerified

__all__ = ["EventColumns", "Split", "event_columns", "split_plain", "KIND_OTHER", "KIND_STARTED", "KIND_STEP",
           "KIND_VERIFIED", "KIND_FINISHED", "KIND_FEEDBACK"]

KIND_OTHER, KIND_STARTED, KIND_STEP, KIND_VERIFIED, KIND_FINISHED, KIND_FEEDBACK = range(6)
_KIND = {EpisodeStarted: KIND_STARTED, Step: KIND_STEP, StepVerified: KIND_VERIFIED,
         EpisodeFinished: KIND_FINISHED, Feedback: KIND_FEEDBACK}


class EventColumns(NamedTuple):
    """One task's events, flat, as columns.

    Attributes:
        episode_ids: the episodes, in the order the task handed them over.
        events: every event, episode after episode (the objects; later steps take their fields).
        episode: int64 ``[n_events]``, each event's index in ``episode_ids``.
        seq: int64 ``[n_events]``, each event's ``seq``.
        kind: int8 ``[n_events]``, each event's type (``KIND_*``; ``KIND_OTHER`` for any other type).
    """

    episode_ids: list[str]
    events: list[Event]
    episode: np.ndarray
    seq: np.ndarray
    kind: np.ndarray


class Split(NamedTuple):
    """:func:`split_plain`'s answer.

    Attributes:
        plain: bool ``[n_episodes]``: the episode is plain (the module docstring says what that means).
        order: int64 ``[n_events]``: the events sorted by ``(episode, seq)`` (a stable sort: repeated
            ``seq`` values keep the order they came in).
        offsets: int64 ``[n_episodes + 1]``: episode ``i``'s events are ``order[offsets[i]:offsets[i + 1]]``.
    """

    plain: np.ndarray
    order: np.ndarray
    offsets: np.ndarray


def event_columns(episodes: Sequence[tuple[str, Sequence[Event]]]) -> EventColumns:
    """Columns of ``(episode_id, events)`` pairs, each episode's events whole and in any order.

    Examples:
        >>> from streams.synth import generate_episodes
        >>> [ep] = generate_episodes(1, seed=1)
        >>> cols = event_columns([("e", ep)])
        >>> int(cols.kind[0]) == KIND_STARTED, int(cols.kind[-1]) == KIND_FINISHED, cols.seq.tolist() == list(range(len(ep)))
        (True, True, True)
    """
    events = [ev for _, evs in episodes for ev in evs]
    n = len(events)
    sizes = np.fromiter((len(evs) for _, evs in episodes), np.int64, len(episodes))
    kind_of = _KIND.get
    return EventColumns(
        episode_ids=[episode_id for episode_id, _ in episodes], events=events,
        episode=np.repeat(np.arange(len(episodes), dtype=np.int64), sizes),
        seq=np.fromiter((ev.seq for ev in events), np.int64, n),
        kind=np.fromiter((kind_of(type(ev), KIND_OTHER) for ev in events), np.int8, n))


def split_plain(cols: EventColumns, *, exclude: Collection[str] = ()) -> Split:
    """Which episodes of ``cols`` are plain, and their events in ``seq`` order (see :class:`Split`).

    Args:
        cols: the task's valid events (:func:`event_columns`).
        exclude: episode ids the object path must see (emitted or written incomplete by an earlier
            commit, split over two tasks).
    """
    n_episodes, n = len(cols.episode_ids), len(cols.events)
    order = np.lexsort((cols.seq, cols.episode))  # by episode, then seq; stable
    episode, seq, kind = cols.episode[order], cols.seq[order], cols.kind[order]
    sizes = np.bincount(cols.episode, minlength=n_episodes)
    offsets = np.zeros(n_episodes + 1, np.int64)
    np.cumsum(sizes, out=offsets[1:])
    position = np.arange(n, dtype=np.int64) - offsets[episode]  # each event's place in its episode
    plain = sizes > 0
    plain &= np.bincount(episode[seq != position], minlength=n_episodes) == 0  # seq exactly 0 .. n-1
    first = offsets[:-1][plain]
    plain[plain] = kind[first] == KIND_STARTED
    plain &= np.bincount(episode[kind == KIND_FINISHED], minlength=n_episodes) > 0
    plain &= np.bincount(episode[kind == KIND_FEEDBACK], minlength=n_episodes) == 0
    ids = [ev.event_id for ev in cols.events]
    if len(set(ids)) != n:  # rare: some id twice in the task; the same episode twice is a copy
        repeated = {k for k, c in Counter(ids).items() if c > 1}
        pairs = Counter((int(cols.episode[i]), ids[i]) for i in range(n) if ids[i] in repeated)
        for (e, _), c in pairs.items():
            if c > 1:
                plain[e] = False
    if exclude:
        plain &= np.fromiter((e not in exclude for e in cols.episode_ids), bool, n_episodes)
    return Split(plain=plain, order=order, offsets=offsets)
