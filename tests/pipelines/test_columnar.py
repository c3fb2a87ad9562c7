"""The columnar path's steps (pipelines/columnar.py) against the object path they will stand beside.

Step 1, the split:
An episode is plain exactly when today's per-episode path (:class:`pipelines.frames.EpisodeAssembler`)
assembles it complete with nothing to resolve: no repeated copy, no conflict, no feedback, not an
episode of an earlier commit. Checked on fuzzed tasks (episodes with events dropped, copied, given a
rival id at the same seq, an id reused at another seq, feedback, shuffled, excluded); the same on real
rollouts in tests/pipelines/test_counts_from_files.py.

Step 2, rewards: the per-step rewards, returns, advantages and clips of many episodes at once are the per-episode
path's floats bit for bit, under every builtin recipe and shaped, bounded, feedback and capped ones.
"""

from __future__ import annotations

from collections import Counter

import msgspec
import numpy as np
import pyarrow as pa
import pytest
from hypothesis import given
from hypothesis import strategies as st

from pipelines.assemble import _status, assemble_episode, dedupe_events
from pipelines.clip import clip_episode
from pipelines.columnar import (KIND_FINISHED, KIND_STARTED, clip_segments, event_columns, plain_episodes, plan_clips,
                                segment_rewards, split_plain)
from pipelines.feedback import split_feedback
from pipelines.recipes import BUILTIN_RECIPES, load_recipe
from pipelines.rewards import annotate_rewards, step_scores
from pipelines.frames import EpisodeAssembler
from pipelines.sinks import RowsBuffer
from pipelines.types import Episode
from pipelines.verify import _import_verifiers, verify_steps
from schemas.events import Feedback, Step, StepVerified
from streams.feedback import FEEDBACK_SEQ
from streams.synth import generate_episodes
from tests.fuzzing import register_profiles

register_profiles()

MUTATIONS = ("drop", "drop_last", "copy", "conflict", "reuse_id", "restart", "feedback", "feedback_next",
             "swap_steps", "stray_verdict", "shuffle")


def _object_path(episode_id: str, events: list, exclude: set[str]) -> bool:
    """Today's rules, as :meth:`EpisodeAssembler._episode` applies them (same functions, same order)."""
    if episode_id in exclude:
        return False
    rest, feedback, repeated = split_feedback(events)
    if feedback or repeated:
        return False
    unique, dups, conflicts = dedupe_events(rest)
    if dups or conflicts or not unique or not _status(unique)[0]:
        return False
    # and the columnar path's own: steps in seq order are steps 0, 1, 2, ...; every verdict judges one of them
    steps = [e.step_index for e in unique if isinstance(e, Step)]
    return steps == list(range(len(steps))) and all(
        0 <= e.step_index < len(steps) for e in unique if isinstance(e, StepVerified))


def _assembled_plainly(episode_id: str, events: list, exclude: set[str]) -> bool:
    """What the assembler itself does: one complete episode out, nothing else, no duplicate or dead letter counted,
    its steps those of the events in seq order, and a verdict for every verdict event."""
    assembler = EpisodeAssembler(frozenset(exclude))
    out = list(assembler(episode_id, events))
    counts = {}
    for tagged in assembler.counts.emit():
        counts.update(tagged.value)
    if not (len(out) == 1 and isinstance(out[0], Episode) and out[0].complete
            and not counts.get("duplicates") and not counts.get("dead_letters")):
        return False
    in_seq_order = sorted(events, key=lambda e: e.seq)
    return (out[0].steps == [e for e in in_seq_order if isinstance(e, Step)]
            and sum(map(len, out[0].verdicts)) == sum(isinstance(e, StepVerified) for e in events))


def _mutate(episode_id: str, events: list, op: str, i: int, permute=lambda evs: evs[::-1]) -> list:
    """``events`` with one mutation ``op`` applied at event ``i`` (``permute`` orders them for ``shuffle``)."""
    events, ev = list(events), events[i]
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
    elif op == "swap_steps":  # two steps' indices swapped: their seq order is no longer their order
        steps = [k for k, e in enumerate(events) if isinstance(e, Step)]
        if len(steps) > 1:
            a, b = steps[0], steps[-1]
            events[a], events[b] = (msgspec.structs.replace(events[a], step_index=events[b].step_index),
                                    msgspec.structs.replace(events[b], step_index=events[a].step_index))
    elif op == "stray_verdict":  # a verdict on a step the episode does not have, just past its end
        seq = max(e.seq for e in events) + 1
        events.append(StepVerified(event_id=f"sv-{episode_id}-{seq}", episode_id=episode_id, seq=seq,
                                   producer_id="p", domain=ev.domain, task_id=ev.task_id,
                                   step_index=seq - 1, verifier="v", passed=True, score=1.0))
    elif op == "shuffle":
        events = list(permute(events))
    return events


@st.composite
def _tasks(draw) -> tuple[list[tuple[str, list]], set[str]]:
    n, seed = draw(st.integers(1, 6)), draw(st.integers(0, 2**16))
    task, exclude = [], set()
    for ep in generate_episodes(n, seed=seed):
        episode_id, events = ep[0].episode_id, list(ep)
        for op in draw(st.lists(st.sampled_from(MUTATIONS), max_size=3)):
            if not events:
                break
            events = _mutate(episode_id, events, op, draw(st.integers(0, len(events) - 1)),
                             permute=lambda evs: draw(st.permutations(evs)))
        if draw(st.booleans()) and draw(st.booleans()):
            exclude.add(episode_id)
        task.append((episode_id, events))
    return task, exclude


@pytest.mark.parametrize("op", MUTATIONS)
def test_each_mutation_alone_is_judged_as_the_object_path_judges_it(op):
    """Every rule met on its own, beside clean episodes (the fuzz test mostly meets them stacked)."""
    episodes = list(generate_episodes(4, seed=9))
    task = [(ep[0].episode_id, list(ep)) for ep in episodes]
    target, events = task[1]
    task[1] = (target, _mutate(target, events, op, 2))
    split = split_plain(event_columns(task))
    expected = [_object_path(e, evs, set()) for e, evs in task]
    assert split.plain.tolist() == expected == [_assembled_plainly(e, evs, set()) for e, evs in task]
    assert expected[1] == (op == "shuffle")  # a shuffled episode is still plain: its events come in any order


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


# --- step 2: rewards, returns, advantages and clipping over many episodes at once, bit for bit -----------------

RECIPES = [
    *BUILTIN_RECIPES.values(),
    load_recipe("verification_shaped", shaping="additive", step_penalty=0.5),
    load_recipe("verification_shaped", gamma=0.9, **{"lambda": 0.7}, verification_weight=0.3, step_penalty=0.05,
                verifier_weights={"pipeline.token_consistency": 0.0, "code.tests": 2.0}),
    load_recipe("discounted", gamma=0.9, **{"lambda": 0.7}, outcome_weight=2.0, reward_min=-0.5, reward_max=0.8),
    load_recipe("outcome", feedback="add", feedback_weight=0.5),
    load_recipe("outcome", feedback="override"),
    load_recipe("verification_shaped", max_steps=2),
    load_recipe("discounted", max_action_tokens=400),
    load_recipe("verification_shaped", max_steps=3, max_action_tokens=300),
]


def _episode_events(n: int = 40, seed: int = 11) -> list[tuple[str, list]]:
    """Synthetic episodes' events, every fifth one timed out (not trainable), outcomes off the 0/1 grid."""
    rng = np.random.default_rng(seed)
    out = []
    for i, events in enumerate(generate_episodes(n, seed=seed)):
        fin = events[-1]
        fin = msgspec.structs.replace(fin, termination="timeout" if i % 5 == 0 else fin.termination,
                                      outcome_reward=float(rng.uniform(-1.0, 2.0)) if i % 3 else fin.outcome_reward)
        out.append((events[0].episode_id, [*events[:-1], fin]))
    return out


def _episodes(n: int = 40, seed: int = 11) -> list[Episode]:
    """:func:`_episode_events` assembled."""
    return [assemble_episode(eid, events, complete=True, reason=None) for eid, events in _episode_events(n, seed)]


def _bits(x: np.ndarray) -> np.ndarray:
    return np.ascontiguousarray(x, dtype=np.float64).view(np.int64)


@pytest.mark.parametrize("recipe", RECIPES, ids=lambda r: f"{r.name}-{r.content_hash[:6]}")
def test_rewards_returns_advantages_and_clips_are_the_per_episode_floats(recipe):
    episodes = _episodes()
    assert {e.trainable for e in episodes} == {True, False}
    offsets = np.concatenate([[0], np.cumsum([len(e.steps) for e in episodes])]).astype(np.int64)
    sigma = np.concatenate([step_scores(e.verdicts, recipe.verifier_weights) for e in episodes])
    r, G, A = segment_rewards(recipe, offsets=offsets, sigma=sigma,
                              outcome=np.array([e.finished.outcome_reward for e in episodes]),
                              trainable=np.array([e.trainable for e in episodes]))
    n_tok = np.array([len(s.action_token_ids) for e in episodes for s in e.steps])
    keep, masked_from = plan_clips(offsets, n_tok, max_steps=recipe.max_steps,
                                   max_action_tokens=recipe.max_action_tokens)
    kept, r, G, A = clip_segments(offsets, keep, r, G, A, gamma=recipe.gamma, lam=recipe.lam,
                                  reward_min=recipe.reward_min, reward_max=recipe.reward_max)
    clipped = 0
    for e, episode in enumerate(episodes):
        one = clip_episode(annotate_rewards(episode, recipe), max_steps=recipe.max_steps,
                           max_action_tokens=recipe.max_action_tokens, gamma=recipe.gamma, lam=recipe.lam,
                           reward_min=recipe.reward_min, reward_max=recipe.reward_max)
        a, b = kept[e], kept[e + 1]
        assert b - a == len(one.steps) == keep[e]
        for mine, theirs in ((r, one.rewards), (G, one.returns), (A, one.advantages)):
            assert np.array_equal(_bits(mine[a:b]), _bits(theirs)), (e, mine[a:b], theirs)
        first_masked = np.flatnonzero(~one.loss_masks[-1]) if one.steps else []
        assert masked_from[e] == (first_masked[0] if len(first_masked) else -1)
        clipped += one.clipped
    assert (clipped > 0) == bool(recipe.max_steps or recipe.max_action_tokens)


def test_a_prm_recipe_is_refused():
    recipe = load_recipe("verification_shaped", reward="prm", prm="builtins:len")
    with pytest.raises(ValueError, match="process-reward model"):
        segment_rewards(recipe, offsets=np.array([0, 1]), sigma=np.zeros(1), outcome=np.zeros(1),
                        trainable=np.array([True]))


# --- step 3: the rows of plain episodes, staged as the object path stages them ------------------------------------

def _object_rows(episodes: list[Episode], recipe, verify_step, not_found) -> tuple[RowsBuffer, Counter]:
    """verify → rewards → clip → row staging, one episode at a time, as the job's stages do it; and their counts."""
    rows, counts = RowsBuffer(recipe), Counter()
    for episode in episodes:
        out = verify_steps(episode.domain, episode.started, episode.steps, episode.verdicts, verify_step=verify_step,
                           not_found=not_found)
        counts.update(steps_verified=len(episode.steps), steps_rewarded=len(episode.steps),
                      episodes_excluded=not episode.trainable, episodes_domain_verifiers_skipped=out.spec_skipped,
                      steps_failed_token_consistency=out.tokens_failed, verifier_errors=out.errors,
                      episodes_without_domain_verifier=out.no_verifier, verifier_agreements=out.agreements,
                      verifier_disagreements=out.disagreements)
        episode = annotate_rewards(msgspec.structs.replace(episode, verdicts=out.verdicts), recipe)
        episode = clip_episode(episode, max_steps=recipe.max_steps, max_action_tokens=recipe.max_action_tokens,
                               gamma=recipe.gamma, lam=recipe.lam, reward_min=recipe.reward_min,
                               reward_max=recipe.reward_max)
        counts.update(episodes_clipped=episode.clipped, steps_dropped_by_clip=episode.steps_dropped)
        rows.add(episode)
    return rows, counts


def _ipc(table: pa.Table) -> bytes:
    sink = pa.BufferOutputStream()
    with pa.ipc.new_stream(sink, table.schema) as writer:
        writer.write_table(table)
    return sink.getvalue().to_pybytes()


def assert_plain_rows_are_the_object_paths(by_episode: list[tuple[str, list]], recipe, *, domain_verifiers=True) -> int:
    """The plain episodes of ``by_episode``, staged from :func:`plain_episodes` and from the processed ``Episode``
    objects: the same trajectories and steps tables, byte for byte (Arrow IPC), and the same counts. Returns how
    many episodes were plain."""
    verify_step, not_found = _import_verifiers() if domain_verifiers else (None, LookupError)
    cols = event_columns(by_episode)
    split = split_plain(cols)
    plain, counts = plain_episodes(cols, split, split.plain, recipe, verify_step=verify_step, not_found=not_found)
    episodes = [assemble_episode(eid, sorted(evs, key=lambda e: e.seq), complete=True, reason=None)
                for (eid, evs), p in zip(by_episode, split.plain) if p]
    assert [p.episode_id for p in plain] == [e.episode_id for e in episodes]
    theirs, their_counts = _object_rows(episodes, recipe, verify_step, not_found)
    mine = RowsBuffer(recipe)
    for p in plain:
        mine.add(p)
    for a, b, name in zip(mine.tables(), theirs.tables(), ("trajectories", "steps")):
        assert a.equals(b), name
        assert _ipc(a) == _ipc(b), name
    assert {k: v for k, v in counts.items() if v} == {k: v for k, v in their_counts.items() if v}
    return len(plain)


@pytest.mark.parametrize("recipe", [r for r in RECIPES if r.reward != "prm"],
                         ids=lambda r: f"{r.name}-{r.content_hash[:6]}")
def test_plain_rows_are_the_object_paths_rows_byte_for_byte(recipe):
    by_episode = _episode_events()
    # non-plain episodes beside them (left out on both sides), and a plain one in reverse order
    others = [(eid, _mutate(eid, evs, op, 1)) for (eid, evs), op in zip(_episode_events(12, seed=5), MUTATIONS)]
    assert assert_plain_rows_are_the_object_paths(by_episode + others, recipe) == 40 + 1  # "shuffle" stays plain


def _no_steps(episode_id: str, events: list) -> list:
    """The episode with its steps and verdicts left out (started at seq 0, finished at 1): judged, nothing to train."""
    started, finished = events[0], events[-1]
    return [started, msgspec.structs.replace(finished, seq=1)]


@pytest.mark.parametrize("recipe", [load_recipe("verification_shaped", max_steps=2, max_action_tokens=300),
                                    load_recipe("outcome")], ids=["capped", "outcome"])
def test_plain_rows_of_episodes_without_steps_and_of_none_but_those(recipe):
    events = _episode_events(6, seed=3)
    bare = [(eid, _no_steps(eid, evs)) for eid, evs in events[:2]]
    assert assert_plain_rows_are_the_object_paths(bare, recipe) == 2  # no step at all in the chunk
    assert assert_plain_rows_are_the_object_paths(bare + events[2:], recipe) == 6
