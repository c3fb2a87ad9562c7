"""The columnar split (pipelines/columnar.py) against the object path it will stand beside.

An episode is plain exactly when today's per-episode path (:class:`pipelines.frames.EpisodeAssembler`)
assembles it complete with nothing to resolve: no repeated copy, no conflict, no feedback, not an
episode of an earlier commit. Checked on fuzzed tasks (episodes with events dropped, copied, given a
rival id at the same seq, an id reused at another seq, feedback, shuffled, excluded); the same on real
rollouts in tests/pipelines/test_counts_from_files.py.
"""

from __future__ import annotations

import msgspec
import numpy as np
from hypothesis import given
from hypothesis import strategies as st

from pipelines.assemble import _status, dedupe_events
from pipelines.columnar import KIND_FINISHED, KIND_STARTED, event_columns, split_plain
from pipelines.feedback import split_feedback
from pipelines.frames import EpisodeAssembler
from pipelines.types import Episode
from schemas.events import Feedback
from streams.feedback import FEEDBACK_SEQ
from streams.synth import generate_episodes
from tests.fuzzing import register_profiles

register_profiles()

MUTATIONS = ("drop", "drop_last", "copy", "conflict", "reuse_id", "restart", "feedback", "feedback_next", "shuffle")


def _object_path(episode_id: str, events: list, exclude: set[str]) -> bool:
    """Today's rules, as :meth:`EpisodeAssembler._episode` applies them (same functions, same order)."""
    if episode_id in exclude:
        return False
    rest, feedback, repeated = split_feedback(events)
    if feedback or repeated:
        return False
    unique, dups, conflicts = dedupe_events(rest)
    return not dups and not conflicts and bool(unique) and _status(unique)[0]


def _assembled_plainly(episode_id: str, events: list, exclude: set[str]) -> bool:
    """What the assembler itself does: one complete episode out, nothing else, no duplicate or dead letter counted."""
    assembler = EpisodeAssembler(frozenset(exclude))
    out = list(assembler(episode_id, events))
    counts = {}
    for tagged in assembler.counts.emit():
        counts.update(tagged.value)
    return (len(out) == 1 and isinstance(out[0], Episode) and out[0].complete
            and not counts.get("duplicates") and not counts.get("dead_letters"))


@st.composite
def _tasks(draw) -> tuple[list[tuple[str, list]], set[str]]:
    n, seed = draw(st.integers(1, 6)), draw(st.integers(0, 2**16))
    task, exclude = [], set()
    for ep in generate_episodes(n, seed=seed):
        episode_id, events = ep[0].episode_id, list(ep)
        for op in draw(st.lists(st.sampled_from(MUTATIONS), max_size=3)):
            if not events:
                break
            i = draw(st.integers(0, len(events) - 1))
            ev = events[i]
            if op == "drop":
                del events[i]
            elif op == "drop_last":  # an unfinished episode
                events.remove(max(events, key=lambda e: e.seq))
            elif op == "copy":
                events.append(ev)
            elif op == "conflict":  # another id at the same seq
                events.append(msgspec.structs.replace(ev, event_id=ev.event_id + "-rival"))
            elif op == "reuse_id" and len(events) > 1:  # the id of another event, at this seq
                j = (i + 1) % len(events)
                events[j] = msgspec.structs.replace(events[j], event_id=ev.event_id)
            elif op == "restart":  # another type at seq 0 (validation refuses it; the split must not rely on that)
                k = min(range(len(events)), key=lambda k: events[k].seq)
                other = events[-1 if k != len(events) - 1 else 0]
                events[k] = msgspec.structs.replace(other, seq=0, event_id=other.event_id + "-at-0")
            elif op in ("feedback", "feedback_next"):  # at FEEDBACK_SEQ (1), or just past the episode's end
                seq = FEEDBACK_SEQ if op == "feedback" else max(e.seq for e in events) + 1
                events.append(Feedback(event_id=f"fb-{episode_id}-{i}", episode_id=episode_id, seq=seq,
                                       producer_id="p", domain=ev.domain, task_id=ev.task_id, source="s", rating=1.0))
            elif op == "shuffle":
                events = draw(st.permutations(events))
        if draw(st.booleans()) and draw(st.booleans()):
            exclude.add(episode_id)
        task.append((episode_id, list(events)))
    return task, exclude


@given(_tasks())
def test_plain_is_what_the_object_path_assembles_with_nothing_to_resolve(task_exclude):
    task, exclude = task_exclude
    task = [(e, evs) for e, evs in task if evs]  # the assembler is never handed an empty episode
    split = split_plain(event_columns(task), exclude=exclude)
    expected = [_object_path(e, evs, exclude) for e, evs in task]
    assert split.plain.tolist() == expected
    assert expected == [_assembled_plainly(e, evs, exclude) for e, evs in task]


def test_a_plain_episodes_events_come_out_in_seq_order_and_whole():
    a, b, c = generate_episodes(3, seed=3)
    rng = np.random.default_rng(0)
    shuffled = [list(np.array(ep, dtype=object)[rng.permutation(len(ep))]) for ep in (a, b, c)]
    cols = event_columns([(ep[0].episode_id, evs) for ep, evs in zip((a, b, c), shuffled)])
    split = split_plain(cols)
    assert split.plain.all()
    for k, ep in enumerate((a, b, c)):
        got = [cols.events[i] for i in split.order[split.offsets[k]:split.offsets[k + 1]]]
        assert got == ep  # every event of the episode, seq 0 .. n-1
        assert cols.kind[split.order[split.offsets[k]]] == KIND_STARTED
        assert KIND_FINISHED in cols.kind[split.order[split.offsets[k]:split.offsets[k + 1]]]


def test_an_id_in_two_episodes_is_not_a_copy_but_twice_in_one_is():
    a, b = generate_episodes(2, seed=4)
    b_with_as_id = [msgspec.structs.replace(b[1], event_id=a[1].event_id), *b[:1], *b[2:]]
    assert split_plain(event_columns([("a", a), ("b", b_with_as_id)])).plain.tolist() == [True, True]
    a_twice = [*a, msgspec.structs.replace(a[2], seq=len(a), event_id=a[1].event_id)]  # a copy with a new seq
    assert split_plain(event_columns([("a", a_twice), ("b", b)])).plain.tolist() == [False, True]


def test_no_events_no_episodes():
    split = split_plain(event_columns([]))
    assert split.plain.shape == (0,) and split.order.shape == (0,) and split.offsets.tolist() == [0]
