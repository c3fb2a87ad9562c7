"""The columnar path (issue 16, item 1; docs/pipelines.md, "The columnar path").

The tasks that read and assemble whole episodes (:class:`pipelines.frames.AssembleInPlace` for Kafka
partitions, :class:`pipelines.archive_source.ReadArchiveEpisodes` for archive files) hand their decoded
episodes to :class:`pipelines.frames.PlainPath`: the plain training episodes are verified, rewarded,
clipped and turned into rows here, many at once (:func:`plain_episodes`), and go straight to row
staging; every other episode goes through :class:`pipelines.frames.EpisodeAssembler` and the
per-episode stages as before. The committed files are the same bytes either way
(tests/pipelines/test_columnar_job.py, on real rollouts through Kafka and the archive).

**The split** (step 1).
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
  :class:`~schemas.events.EpisodeFinished`;
* its steps, in ``seq`` order, have ``step_index`` 0, 1, 2, ... (the object path orders steps by
  ``step_index``; here their ``seq`` order is their order), and every
  :class:`~schemas.events.StepVerified` judges one of them (the object path drops a verdict on a step
  it does not have).

The first five are the object path's own rules for an episode it assembles complete with no
duplicate, no conflict and no feedback (``split_feedback``, ``dedupe_events``, ``_status`` in
:meth:`EpisodeAssembler._episode <pipelines.frames.EpisodeAssembler>`); the last one keeps out the
episodes whose steps that path would reorder or whose verdicts it would drop. Tested equal on fuzzed event
sets and on real rollouts (tests/pipelines/test_columnar.py, tests/pipelines/test_counts_from_files.py).
The event-time clock and the assembler's counts of a plain episode are still the assembler's
(:meth:`pipelines.frames.EpisodeAssembler.count_plain`).

**Rewards** (step 2). :func:`segment_rewards` gives the per-step rewards, returns and advantages of many
episodes at once, their steps flat and cut into segments by offsets; :func:`plan_clips` and
:func:`clip_segments` apply :mod:`pipelines.clip`'s rule. The floats are those of the per-episode path
(:func:`pipelines.rewards.annotate_rewards`, :func:`pipelines.clip.clip_episode`) bit for bit: the same
IEEE operations in the same order, the return recurrence ``G_t = r_t + gamma G_{t+1}`` stepped back from
every episode's end at once (tested on every builtin recipe and on shaped, bounded and capped ones,
tests/pipelines/test_columnar.py). For episodes without feedback (plain ones have none) and recipes
without a process-reward model, whose scores the caller would have to ask for per episode.

**Rows** (step 3). :func:`plain_episodes` gives each plain episode's rows as a
:class:`~pipelines.types.PlainEpisode`: its verdicts (:func:`pipelines.verify.verify_steps`, the
function the object path calls; the domain verifiers are the only Python per step), each step's
verdict figures, the rewards and clips of step 2, and its trajectory row, with no
:class:`~pipelines.types.Episode` made; :class:`pipelines.sinks.RowsBuffer` stages it into the
columns a processed ``Episode`` fills (byte for byte, tests/pipelines/test_columnar.py).

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
from itertools import repeat
from collections.abc import Callable, Collection, Sequence
from typing import Any, NamedTuple

import numpy as np

from pipelines.clip import fold_tail
from pipelines.recipes import Recipe
from pipelines.types import PlainEpisode, excluded_reason_of
from pipelines.verify import _tokens_ok, verify_steps
from schemas.datasets import TrajectoryRow, Verification
from schemas.events import EpisodeFinished, EpisodeStarted, Event, Feedback, Step, StepVerified, termination_of

__all__ = ["EventColumns", "Split", "event_columns", "split_plain", "segment_rewards", "plan_clips", "clip_segments",
           "plain_episodes", "PLAIN_COUNTS",
           "KIND_OTHER", "KIND_STARTED", "KIND_STEP",
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
        step_index: int64 ``[n_events]``, the ``step_index`` of a step or a verdict (-1 for other events).
    """

    episode_ids: list[str]
    events: list[Event]
    episode: np.ndarray
    seq: np.ndarray
    kind: np.ndarray
    step_index: np.ndarray


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
        kind=np.fromiter((kind_of(type(ev), KIND_OTHER) for ev in events), np.int8, n),
        step_index=np.fromiter((getattr(ev, "step_index", -1) for ev in events), np.int64, n))


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
    is_step = kind == KIND_STEP
    step_index = cols.step_index[order]
    steps = np.bincount(episode[is_step], minlength=n_episodes)
    steps_before = np.concatenate([[0], np.cumsum(is_step)])  # in the task, before each event (and after all)
    nth_step = steps_before[:-1] - steps_before[offsets[:-1]][episode]  # ... in its episode
    plain &= np.bincount(episode[is_step & (step_index != nth_step)], minlength=n_episodes) == 0
    verdict = kind == KIND_VERIFIED
    plain &= np.bincount(episode[verdict & ((step_index < 0) | (step_index >= steps[episode]))],
                         minlength=n_episodes) == 0
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


def _segments(offsets: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """``(lengths [E], each step's segment [S])`` of segment ``offsets`` ``[E + 1]``."""
    lengths = np.diff(offsets)
    return lengths, np.repeat(np.arange(len(lengths), dtype=np.int64), lengths)


def _returns_to_go(r: np.ndarray, offsets: np.ndarray, gamma: float) -> np.ndarray:
    """``G_t = r_t + gamma * G_{t+1}`` (``G_T = 0``) within every segment: ``discounted_returns``' loop, run from
    all segment ends at once (the same operations on the same values, so the same floats). One numpy step per
    step back over every episode: O(episodes x longest episode), fine for the rollouts' few steps an episode."""
    lengths, _ = _segments(offsets)
    G = np.zeros(len(r), dtype=np.float64)
    ends = offsets[1:] - 1
    running = np.zeros(len(lengths), dtype=np.float64)
    for back in range(int(lengths.max(initial=0))):
        active = lengths > back
        t = ends[active] - back
        running[active] = r[t] + gamma * running[active]
        G[t] = running[active]
    return G


def segment_rewards(recipe: Recipe, *, offsets: np.ndarray, sigma: np.ndarray, outcome: np.ndarray,
                    trainable: np.ndarray) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """``(r, G, A)`` float64 ``[S]`` of many episodes' steps under ``recipe`` (:mod:`pipelines.recipes`).

    Per episode what :func:`pipelines.rewards.annotate_rewards` computes for it without feedback: the
    recipe's step rewards (outcome at the last step; shaping by ``sigma`` and the step penalty for
    ``verification_shaped``; the bounds), ``G_t = r_t + gamma G_{t+1}`` and the zero-baseline GAE
    ``A_t = sum_l (gamma lambda)^l r_{t+l}`` (Schulman et al. 2016, arXiv:1506.02438, eq. 16 with
    ``V = 0``); zeros for an episode that is not trainable.

    Args:
        recipe: the recipe (not a ``prm`` one: its scores come from a model called per episode).
        offsets: int ``[E + 1]``: episode ``e``'s steps are ``offsets[e]:offsets[e + 1]``, in step order.
        sigma: ``s_t`` ``[S]``, each step's weighted verification score
            (:func:`pipelines.rewards.step_scores`).
        outcome: ``R`` ``[E]``, each episode's ``episode_finished.outcome_reward``.
        trainable: bool ``[E]``, :attr:`pipelines.types.Episode.trainable`.

    Raises:
        ValueError: a ``prm`` recipe.

    Examples:
        >>> from pipelines.recipes import load_recipe
        >>> r, G, A = segment_rewards(load_recipe("discounted"), offsets=np.array([0, 2, 3]), sigma=np.zeros(3),
        ...                           outcome=np.array([1.0, 2.0]), trainable=np.array([True, True]))
        >>> r.tolist(), G.tolist()  # G_0 = 0 + 0.95 * 1
        ([0.0, 1.0, 2.0], [0.95, 1.0, 2.0])
    """
    if recipe.reward == "prm":
        raise ValueError(f"recipe {recipe.name!r} scores steps with a process-reward model; "
                         "its episodes take the per-episode path")
    lengths, segment = _segments(offsets)
    judged = trainable & (lengths > 0)
    ends = offsets[1:][judged] - 1
    if recipe.feedback == "add":  # feedback_outcome with no rating: R + w_f * 0
        outcome = outcome + recipe.feedback_weight * 0.0
    r = np.zeros(len(sigma), dtype=np.float64)
    if recipe.reward == "verification_shaped":
        w = recipe.shaping_weight
        if recipe.shaping == "potential":  # recipes.potential_shaping per segment: F_t = gamma Phi_{t+1} - Phi_t
            phi_next = w * np.asarray(sigma, dtype=np.float64)
            phi_next[offsets[1:][lengths > 0] - 1] = 0.0  # the state after an episode's last step is terminal
            phi = np.concatenate([[0.0], phi_next[:-1]])  # Phi_0 = 0 (the prompt): the step before is terminal
            r += recipe.gamma * phi_next - phi
        else:
            r += w * sigma
        r -= recipe.step_penalty
    r[ends] += recipe.outcome_weight * outcome[judged]
    if recipe.reward_min is not None or recipe.reward_max is not None:
        r = np.clip(r, recipe.reward_min, recipe.reward_max)
    r[~judged[segment]] = 0.0
    G = _returns_to_go(r, offsets, recipe.gamma)
    A = _returns_to_go(r, offsets, recipe.gamma * recipe.lam)
    return r, G, A


def plan_clips(offsets: np.ndarray, action_tokens: np.ndarray, *, max_steps: int,
               max_action_tokens: int) -> tuple[np.ndarray, np.ndarray]:
    """:func:`pipelines.clip.plan_clip` of every segment: ``(steps kept [E], first masked token [E], -1: none)``.

    Examples:
        >>> keep, masked_from = plan_clips(np.array([0, 3, 4]), np.array([100, 300, 50, 400]), max_steps=0,
        ...                                max_action_tokens=250)
        >>> keep.tolist(), masked_from.tolist()  # as plan_clip: (2, 150) and (1, 250)
        ([2, 1], [150, 250])
    """
    lengths, segment = _segments(offsets)
    keep = np.minimum(lengths, max_steps) if max_steps else lengths.copy()
    masked_from = np.full(len(lengths), -1, dtype=np.int64)
    if not max_action_tokens:
        return keep, masked_from
    n_tok = np.asarray(action_tokens, dtype=np.int64)
    before = np.cumsum(n_tok) - n_tok  # tokens before each step, from the first segment's start
    before -= before[offsets[:-1][segment]]  # ... from its own segment's start
    inside = np.bincount(segment[before < max_action_tokens], minlength=len(lengths))
    keep = np.minimum(keep, inside)
    keep[keep == 0] = np.minimum(1, lengths[keep == 0])
    has = keep > 0
    last = offsets[:-1][has] + keep[has] - 1
    over = before[last] + n_tok[last] - max_action_tokens
    masked_from[np.flatnonzero(has)[over > 0]] = (max_action_tokens - before[last])[over > 0]
    return keep, masked_from


def clip_segments(offsets: np.ndarray, keep: np.ndarray, r: np.ndarray, G: np.ndarray, A: np.ndarray, *,
                  gamma: float, lam: float, reward_min: float | None,
                  reward_max: float | None) -> tuple[np.ndarray, np.ndarray, np.ndarray, np.ndarray]:
    """The kept steps' ``(offsets [E + 1], r', G, A)`` after :func:`plan_clips` (rules 3 and 4 of
    :mod:`pipelines.clip`; the fold itself is :func:`pipelines.clip.fold_tail`, per clipped episode)."""
    new_offsets = np.zeros(len(keep) + 1, np.int64)
    np.cumsum(keep, out=new_offsets[1:])
    if (keep == np.diff(offsets)).all():
        return new_offsets, r.copy(), G.copy(), A.copy()
    lengths, segment = _segments(offsets)
    kept = np.arange(len(r), dtype=np.int64) - offsets[:-1][segment] < keep[segment]  # the step starts in its cap
    r2, G2, A2 = r[kept], G[kept], A[kept]
    for e in np.flatnonzero(keep < lengths):
        a, b, k = offsets[e], offsets[e + 1], new_offsets[e]
        r2[k:k + keep[e]], G2[k:k + keep[e]], A2[k:k + keep[e]] = fold_tail(
            r[a:b], G[a:b], A[a:b], keep=int(keep[e]), gamma=gamma, lam=lam, reward_min=reward_min,
            reward_max=reward_max)
    return new_offsets, r2, G2, A2


#: The counts :func:`plain_episodes` keeps: the names the per-episode stages count under (verify, rewards, clip).
PLAIN_COUNTS = ("steps_verified", "steps_failed_token_consistency", "episodes_without_domain_verifier",
                "episodes_domain_verifiers_skipped", "verifier_errors", "verifier_disagreements",
                "verifier_agreements", "steps_rewarded", "episodes_excluded", "episodes_clipped",
                "steps_dropped_by_clip")


def plain_episodes(cols: EventColumns, split: Split, picks: np.ndarray, recipe: Recipe, *,
                   verify_step: Callable[..., Any] | None = None,
                   not_found: type[Exception] = LookupError) -> tuple[list[PlainEpisode], dict[str, int]]:
    """The rows of the ``picks`` episodes (plain ones) as verify → rewards → clip → row staging would make them.

    The plan's step 3 (docs/pipelines.md). For each picked episode, what the object path does to it
    once :class:`pipelines.frames.EpisodeAssembler` has assembled it, with no
    :class:`~pipelines.types.Episode` made: its recorded verdicts grouped by step, then the pipeline's
    (:func:`pipelines.verify.verify_steps`, the same function :class:`~pipelines.verify.VerifySteps` calls; the
    domain verifiers stay per step); each step's verdict figures (:func:`pipelines.sinks.step_figures`);
    the rewards, returns and advantages of all of them at once (:func:`segment_rewards`) and the clip
    (:func:`plan_clips`, :func:`clip_segments`); its trajectory row with
    :func:`pipelines.sinks.trajectory_row`'s values. :class:`pipelines.sinks.RowsBuffer` stages a
    :class:`~pipelines.types.PlainEpisode` into the same columns as the processed ``Episode``
    (tests/pipelines/test_columnar.py holds the staged tables equal, byte for byte).

    Args:
        cols: the task's valid events.
        split: :func:`split_plain` of ``cols``.
        picks: bool ``[n_episodes]``, the episodes to do: plain ones (and no evaluation episodes,
            which leave for the evaluations table before these stages).
        recipe: the recipe (not a ``prm`` one).
        verify_step: ``rollout.verifiers.verify_step`` (None: the generic check only).
        not_found: the exception ``verify_step`` raises for a domain without verifiers.

    Returns:
        The picked episodes' :class:`~pipelines.types.PlainEpisode` (in ``cols`` order) and the counts
        of :data:`PLAIN_COUNTS` the stages would have made.
    """
    from pipelines.sinks import _recipe_ids, step_figures

    counts = dict.fromkeys(PLAIN_COUNTS, 0)
    picked = np.flatnonzero(picks)
    E = len(picked)
    if not E:
        return [], counts
    version, recipe_hash = _recipe_ids(recipe)
    weights = recipe.verifier_weights
    # The picked episodes' events in seq order, flat; each kind's positions in it, found for all of them at once.
    lengths = np.diff(split.offsets)[picked]
    event_offsets = np.zeros(E + 1, np.int64)
    np.cumsum(lengths, out=event_offsets[1:])
    episode_of = np.repeat(np.arange(E, dtype=np.int64), lengths)
    where = split.order[np.arange(int(event_offsets[-1]), dtype=np.int64) - event_offsets[:-1][episode_of]
                        + split.offsets[picked][episode_of]]
    kind = cols.kind[where]
    events = cols.events
    flat = [events[i] for i in where.tolist()]
    starts = [flat[i] for i in event_offsets[:-1].tolist()]  # plain: the event at seq 0 is episode_started
    finished_at = np.flatnonzero(kind == KIND_FINISHED)
    _, first = np.unique(episode_of[finished_at], return_index=True)  # the first, as assemble_episode takes it
    finishes = [flat[i] for i in finished_at[first].tolist()]
    step_at = np.flatnonzero(kind == KIND_STEP)
    n_steps = np.bincount(episode_of[step_at], minlength=E)
    step_offsets = np.zeros(E + 1, np.int64)
    np.cumsum(n_steps, out=step_offsets[1:])
    steps = [flat[i] for i in step_at.tolist()]
    S = len(steps)
    recorded: list[list[Verification]] = [[] for _ in range(S)]
    verdict_at = np.flatnonzero(kind == KIND_VERIFIED)
    if len(verdict_at):  # plain: each judges one of its episode's steps, which are steps 0, 1, 2, ... in seq order
        step_of = step_offsets[:-1][episode_of[verdict_at]] + cols.step_index[where[verdict_at]]
        for g, i in zip(step_of.tolist(), verdict_at.tolist()):
            ev = flat[i]
            recorded[g].append(Verification(verifier=ev.verifier, passed=ev.passed, score=ev.score,
                                            details=ev.details, source="rollout"))
    times = [ev.event_time for ev in flat]
    ev_bounds = event_offsets.tolist()
    first_time = [min(times[a:b]) for a, b in zip(ev_bounds, ev_bounds[1:])]
    last_time = [max(times[a:b]) for a, b in zip(ev_bounds, ev_bounds[1:])]
    tokens_ok = _tokens_ok(steps)  # one pass over every step's log-probs instead of one an episode

    verdicts: list[list[Verification]] = []
    bounds = step_offsets.tolist()
    for started, a, b in zip(starts, bounds, bounds[1:]):
        out = verify_steps(started.domain, started, steps[a:b], recorded[a:b], verify_step=verify_step,
                           not_found=not_found, tokens_ok=tokens_ok[a:b])
        counts["episodes_domain_verifiers_skipped"] += out.spec_skipped
        counts["steps_failed_token_consistency"] += out.tokens_failed
        counts["episodes_without_domain_verifier"] += out.no_verifier
        counts["verifier_errors"] += out.errors
        counts["verifier_disagreements"] += out.disagreements
        counts["verifier_agreements"] += out.agreements
        verdicts += out.verdicts
    scores, passed, disagreements = (list(x) for x in zip(*map(step_figures, verdicts, repeat(weights)))) \
        if S else ([], [], [])
    terminations = [termination_of(f) for f in finishes]
    trainable = np.fromiter((excluded_reason_of(t, n) is None for t, n in zip(terminations, n_steps.tolist())),
                            bool, E)  # Episode.trainable, before the clip
    counts["steps_verified"] = counts["steps_rewarded"] = S
    counts["episodes_excluded"] = int(E - trainable.sum())
    r, G, A = segment_rewards(recipe, offsets=step_offsets, sigma=np.asarray(scores, np.float64),
                              outcome=np.fromiter((f.outcome_reward for f in finishes), np.float64, E),
                              trainable=trainable)
    action_tokens = np.fromiter((len(s.action_token_ids) for s in steps), np.int64, S)
    keep, masked_from = plan_clips(step_offsets, action_tokens, max_steps=recipe.max_steps,
                                   max_action_tokens=recipe.max_action_tokens)
    kept_offsets, r, G, A = clip_segments(step_offsets, keep, r, G, A, gamma=recipe.gamma, lam=recipe.lam,
                                          reward_min=recipe.reward_min, reward_max=recipe.reward_max)
    # Loss masks: every kept step's action tokens True (views of one array), but past a token cap.
    _, segment = _segments(step_offsets)
    kept = np.arange(S, dtype=np.int64) - step_offsets[:-1][segment] < keep[segment]
    kept_tokens = np.bincount(segment[kept], weights=action_tokens[kept], minlength=E).astype(np.int64).tolist()
    true = np.ones(int(action_tokens.sum()), dtype=bool)
    token_bounds = np.concatenate([[0], np.cumsum(action_tokens)]).tolist()
    masks = [true[a:b] for a, b in zip(token_bounds, token_bounds[1:])]

    out_episodes = []
    keep, masked_from, kept_bounds = keep.tolist(), masked_from.tolist(), kept_offsets.tolist()
    n_steps, n_events = n_steps.tolist(), lengths.tolist()
    for k, (started, finished, termination) in enumerate(zip(starts, finishes, terminations)):
        T, n, a = n_steps[k], keep[k], bounds[k]
        tokens_masked = 0
        if masked_from[k] >= 0:
            last = masks[a + n - 1]
            tokens_masked = len(last) - masked_from[k]
            last[masked_from[k]:] = False
        clipped = n < T or masked_from[k] >= 0
        if clipped:
            counts["episodes_clipped"] += 1
            counts["steps_dropped_by_clip"] += T - n
        excluded = excluded_reason_of(termination, n)  # after the clip, as the row is staged
        x, y = kept_bounds[k], kept_bounds[k + 1]
        returns = G[x:y]
        its_disagreements = disagreements[a:a + n]
        episode_id = cols.episode_ids[picked[k]]
        row = TrajectoryRow(
            episode_id=episode_id, domain=started.domain, recipe=version, recipe_hash=recipe_hash,
            task_id=started.task_id, task_group=started.task_group or started.task_id,
            policy_version=started.policy_version, difficulty=started.difficulty,
            status=finished.status.value, termination=termination, trainable=excluded is None,
            excluded_reason=excluded, complete=True, incomplete_reason=None, num_events=n_events[k],
            num_steps=n, steps_dropped=T - n, action_tokens=kept_tokens[k],
            tokens_masked=tokens_masked, clipped=clipped, outcome_reward=finished.outcome_reward,
            episode_return=float(returns[0]) if n else 0.0, normalized_return=0.0, group_advantage=0.0,
            group_size=started.group_size, group_member=started.group_member, group_members=0,
            group_timed_out=False, policy_lineage=started.policy_lineage,
            verifier_summary=finished.verifier_summary, verifier_disagreements=sum(its_disagreements),
            completed_late=False, steps_passed=sum(passed[a:a + n]),
            first_event_time=first_time[k], last_event_time=last_time[k])
        out_episodes.append(PlainEpisode(
            episode_id=episode_id, domain=started.domain, row=row, steps=steps[a:a + n],
            verdicts=verdicts[a:a + n], scores=scores[a:a + n], disagreements=its_disagreements, rewards=r[x:y],
            returns=returns, advantages=A[x:y], loss_masks=masks[a:a + n], sampling=started.sampling))
    return out_episodes, counts
