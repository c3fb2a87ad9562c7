"""Row types of the datasets the trajectory job writes (``steps/``, ``trajectories/``, ``evaluations/``).

The trainer reads the datasets through these classes; the Parquet schemas are
derived from them with :func:`schemas.arrow.arrow_schema_for` (see
:func:`step_file_schema`). Layout (docs/pipelines.md)::

    <out>/steps/recipe=<name>-<hash8>/domain=<domain>/c<commit>-s<shard>.parquet
    <out>/trajectories/recipe=<name>-<hash8>/domain=<domain>/c<commit>-s<shard>.parquet
    <out>/evaluations/recipe=<name>-<hash8>/domain=<domain>/c<commit>.parquet

``recipe`` and ``domain`` are **hive partition keys only**: they are fields
of the row classes (so a reader gets them back) but are not stored inside the
files, so ``read_parquet('<out>/steps/**/*.parquet', hive_partitioning=true)``
works without a column clash.

Examples:
    >>> sch = step_file_schema()
    >>> "domain" in sch.names, "recipe" in sch.names, sch.field("action_token_ids").type
    (False, False, ListType(list<item: int32>))
    >>> trajectory_file_schema().field("episode_return").type
    DataType(double)
"""

from __future__ import annotations

from datetime import datetime

import msgspec
import numpy as np
import pyarrow as pa

from schemas.events import LogProbs, TokenIds

__all__ = [
    "DATASET_SCHEMA_VERSION",
    "PARTITION_KEYS",
    "Verification",
    "StepRow",
    "TrajectoryRow",
    "EvaluationRow",
    "step_file_schema",
    "context_tokens_of",
    "trajectory_file_schema",
    "evaluation_file_schema",
]

#: Version of the dataset row layout; recorded in every commit manifest.
#: 3: ``steps`` rows carry ``observation_tokens``, ``action_tokens`` and ``context_tokens``
#: (files of layout 2 read them as null).
DATASET_SCHEMA_VERSION = 3

#: Hive partition keys, in directory order; never stored as file columns.
PARTITION_KEYS: tuple[str, ...] = ("recipe", "domain")


class Verification(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """One verifier verdict on one step.

    Attributes:
        verifier: verifier name, e.g. ``code.tests_pass`` or ``pipeline.token_consistency``.
        passed: whether the step passed.
        score: graded score in [0, 1] (1.0/0.0 for binary verifiers).
        details: human-readable detail (bounded).
        source: ``rollout`` (a ``step_verified`` event recorded at rollout time)
            or ``pipeline`` (computed by the trajectory job).
        counted: the verdict is a vote in the step's verification score. Each
            verifier votes once: a rollout verdict counts; the pipeline's re-run
            of the same verifier does not (it records agreement); data-quality
            checks (``pipeline.*``) never count.
    """

    verifier: str
    passed: bool
    score: float
    details: str = ""
    source: str = "rollout"
    counted: bool = True


class StepRow(msgspec.Struct, kw_only=True, gc=False):
    """One training step: what the policy saw and did, and the credit it gets.

    Attributes:
        episode_id: the episode.
        step_index: 0-based step position inside the episode.
        event_id: ``event_id`` of the source ``step`` event (stable across reruns).
        domain: environment domain. Partition key: not stored in the file.
        recipe: dataset version ``<recipe name>-<hash8>``. Partition key: not stored in the file.
        recipe_hash: full sha256 (hex) of the reward recipe's canonical JSON.
        task_id: task inside the domain.
        task_group: GRPO group of rollouts of the same task.
        policy_version: version of the behaviour policy that acted.
        status: how the episode ended (``success``, ``failure``, ...).
        num_steps: steps of the episode as written (after clipping).
        observation_token_ids: ids appended to the episode's context since the
            previous action (step 0: the rendered prompt), exactly as the model
            was fed them; context, not trained on. Shape ``[obs_tokens]``, int32.
            The episode's token stream is ``obs_0 + act_0 + obs_1 + act_1 + ...``.
        action_token_ids: tokens the policy produced, shape ``[action_tokens]``, int32.
        observation_tokens: ``len(observation_token_ids)``, stored so that
            token accounting (``trajpipe report token_cost``) reads one integer
            column instead of decoding token lists.
        action_tokens: ``len(action_token_ids)``.
        context_tokens: length of the episode's token stream before this
            step's action, ``sum_{k<=t} |obs_k| + sum_{k<t} |act_k|`` (step 0:
            the prompt); the model was fed ``context_tokens - context_cut_tokens``
            of them.
        behaviour_logprobs: log-prob of each action token under the behaviour
            policy's sampling distribution (natural log, <= 0), shape
            ``[action_tokens]``, float32; empty if the rollout did not record them.
        temperature: sampling temperature of the behaviour log-probs (0: greedy,
            the raw model distribution).
        top_p: nucleus mass of the behaviour log-probs' distribution (1: none).
        top_k: top-k cutoff of that distribution (-1 or 0: none).
        context_cut_start: where tokens were cut out of the stream for this
            step's input (see :class:`schemas.events.Step`).
        context_cut_tokens: how many (0: the model saw the whole stream).
        policy_lineage: lineage of the behaviour policy (empty: base/unknown).
        trainable: the step may be trained on: its episode was judged (not cut
            off by a timeout, error or shutdown) and the recipe keeps it.
        loss_mask: per action token, whether the loss uses it, shape ``[action_tokens]``.
        reward: per-step reward ``r_t`` from the recipe (after clipping limits;
            for the last kept step of a clipped episode it includes the folded tail).
        return_to_go: ``G_t = sum_{k>=t} gamma^(k-t) r_k`` over the full episode.
        advantage: ``A_t``, GAE(gamma, lambda) with a zero value baseline (see
            pipelines.recipes), before normalization.
        normalized_advantage: ``A_t`` normalized per the recipe's
            ``normalization`` mode (domain statistics or GRPO group).
        group_advantage: GRPO outcome advantage of the episode,
            ``(G_0 - mean_group) / (std_group + eps)`` over the trainable
            members of its complete group, repeated on every step (0 for a
            group of one, and for untrainable episodes).
        group_size: trainable members the group statistics were computed over.
        verifications: every verdict on this step (rollout-time and pipeline).
        verification_score: weighted mean score of the *counted* verdicts (0 if none).
        verifier_disagreements: pipeline re-runs whose verdict differs from the
            rollout's verdict of the same verifier.
        clipped: this step was changed by ClipTrajectories (tokens masked or tail folded in).
        event_time: event time of the step (UTC).
    """

    episode_id: str
    step_index: int
    event_id: str
    domain: str
    recipe: str
    recipe_hash: str
    task_id: str
    task_group: str
    policy_version: int
    status: str
    num_steps: int
    observation_token_ids: TokenIds
    action_token_ids: TokenIds
    observation_tokens: int
    action_tokens: int
    context_tokens: int
    behaviour_logprobs: LogProbs
    temperature: float
    top_p: float
    top_k: int
    context_cut_start: int
    context_cut_tokens: int
    policy_lineage: str
    trainable: bool
    loss_mask: list[bool]
    reward: float
    return_to_go: float
    advantage: float
    normalized_advantage: float
    group_advantage: float
    group_size: int
    verifications: list[Verification]
    verification_score: float
    verifier_disagreements: int
    clipped: bool
    event_time: datetime


class TrajectoryRow(msgspec.Struct, kw_only=True, gc=False):
    """One episode: its outcome, its credit and how it was processed.

    Incomplete episodes (never finished, or with a ``seq`` gap, after
    ``--incomplete-after`` seconds of event time without news) get a row with
    ``complete=False`` and no rows in ``steps/``: they are reported, never
    trained on.

    Attributes:
        episode_id: the episode.
        domain: environment domain. Partition key: not stored in the file.
        recipe: dataset version ``<recipe name>-<hash8>``. Partition key: not stored in the file.
        recipe_hash: full sha256 (hex) of the reward recipe's canonical JSON.
        task_id: task inside the domain.
        task_group: GRPO group of rollouts of the same task.
        policy_version: version of the behaviour policy.
        difficulty: task difficulty level from ``episode_started`` (0 if unknown).
        status: ``episode_finished.status``, or ``incomplete``.
        termination: why it stopped (:class:`schemas.events.Termination`
            value; empty when incomplete).
        trainable: judged and kept by the recipe: its steps may be trained on
            and it enters the normalization statistics.
        excluded_reason: why a complete episode is not trainable: ``timeout``,
            ``error``, ``aborted`` (cut off, no verdict) or ``no_steps``.
        complete: the episode is gap-free and finished (it has rows in ``steps/``).
        incomplete_reason: ``unfinished``, ``gap`` or ``no_start`` when not complete.
        num_events: distinct events the episode is made of.
        num_steps: steps written to ``steps/`` (after clipping).
        steps_dropped: steps removed by the step/token cap.
        action_tokens: action tokens of the written steps.
        tokens_masked: action tokens masked out of the loss by the token cap.
        clipped: ClipTrajectories changed this episode.
        outcome_reward: ``episode_finished.outcome_reward`` (0 if incomplete).
        episode_return: ``G_0`` under the recipe.
        normalized_return: ``(G_0 - mean_domain) / (std_domain + eps)`` with the
            domain's persisted return statistics.
        group_advantage: ``(G_0 - mean_group) / (std_group + eps)`` (GRPO).
        group_size: episodes the scheduler started in the group (0: not declared).
        group_member: this episode's index in its group.
        group_members: trainable members the group statistics were computed over.
        group_timed_out: the group was closed by its timeout before all
            ``group_size`` members arrived.
        policy_lineage: lineage of the behaviour policy.
        verifier_summary: ``episode_finished.verifier_summary``.
        verifier_disagreements: pipeline re-runs that disagreed with a rollout verdict.
        completed_late: an earlier commit reported the episode incomplete; late
            events completed it.
        steps_passed: steps whose verdicts all passed.
        first_event_time: earliest event time (UTC).
        last_event_time: latest event time (UTC).
    """

    episode_id: str
    domain: str
    recipe: str
    recipe_hash: str
    task_id: str
    task_group: str
    policy_version: int
    difficulty: int
    status: str
    termination: str
    trainable: bool
    excluded_reason: str | None
    complete: bool
    incomplete_reason: str | None
    num_events: int
    num_steps: int
    steps_dropped: int
    action_tokens: int
    tokens_masked: int
    clipped: bool
    outcome_reward: float
    episode_return: float
    normalized_return: float
    group_advantage: float
    group_size: int
    group_member: int
    group_members: int
    group_timed_out: bool
    policy_lineage: str
    verifier_summary: str
    verifier_disagreements: int
    completed_late: bool
    steps_passed: int
    first_event_time: datetime
    last_event_time: datetime


class EvaluationRow(msgspec.Struct, kw_only=True, gc=False):
    """One held-out evaluation episode (``EpisodeStarted.purpose == "eval"``): the ``evaluations/`` table.

    Evaluation episodes are never training data: the trajectory job writes them
    here only, never to ``steps/`` or ``trajectories/`` nor into their group or
    normalization statistics. Like ``trajectories/``, a commit may write an
    episode that has not finished (a worker died) as ``complete = False``; if
    late events finish it, a later commit writes its complete row
    (``completed_late``). The ``evaluations`` query view keeps complete rows.

    Attributes:
        episode_id: the episode.
        domain: environment domain. Partition key: not stored in the file.
        recipe: dataset version of the job that wrote it. Partition key: not stored in the file.
        task_id: the held-out task (rollout.heldout).
        difficulty: the task's level.
        policy_version: the policy version evaluated.
        policy_lineage: its lineage.
        eval_run: the evaluation run (one ``trajpipe eval`` of one version), from ``task_group``
            ``<task_id>@v<version>#<eval_run>.<n>``; empty if the group id has another form.
        passed: the episode ended with status ``success``.
        outcome_reward: the environment's outcome reward in [0, 1] (0 when not judged).
        status: ``success``, ``failure``, ``timeout``, ``error``, ``aborted``; ``incomplete`` if unfinished.
        termination: why it stopped (``done``, ``max_steps``, ``timeout``, ``error``, ``aborted``; empty if unfinished).
        complete: the episode's events are all there (started, gap-free, finished).
        completed_late: an earlier commit wrote it incomplete; late events finished it.
        num_steps: ``step`` events of the episode.
        prompt_tokens: sum over its steps of the prompt tokens the policy consumed.
        action_tokens: sum over its steps of the tokens the policy generated.
        temperature: sampling temperature of the evaluation (0: greedy, pass@1).
        producer_id: the evaluator process that emitted it.
        started_time: ``episode_started`` event time (UTC; the first event time if missing).
        event_time: ``episode_finished`` event time (UTC; the last event time if unfinished).
    """

    episode_id: str
    domain: str
    recipe: str
    task_id: str
    difficulty: int
    policy_version: int
    policy_lineage: str
    eval_run: str
    passed: bool
    outcome_reward: float
    status: str
    termination: str
    complete: bool
    completed_late: bool
    num_steps: int
    prompt_tokens: int
    action_tokens: int
    temperature: float
    producer_id: str
    started_time: datetime
    event_time: datetime


def context_tokens_of(obs: np.ndarray, act: np.ndarray, episode_steps: np.ndarray) -> np.ndarray:
    """``StepRow.context_tokens`` (the stream before each action) of consecutive episodes of ``episode_steps``
    steps, from their per-step token counts.

    >>> context_tokens_of(np.array([4, 2, 2, 5]), np.array([2, 3, 2, 1]), np.array([3, 1])).tolist()
    [4, 8, 13, 5]
    """
    total = np.cumsum(obs + act, dtype=np.int64)
    before = np.concatenate([[0], total])[np.cumsum(episode_steps) - episode_steps]  # stream before each episode
    return total - act - np.repeat(before, episode_steps)


def step_file_schema() -> pa.Schema:
    """Arrow schema of a ``steps/`` Parquet file (StepRow minus the partition keys)."""
    return _STEP_SCHEMA


def trajectory_file_schema() -> pa.Schema:
    """Arrow schema of a ``trajectories/`` Parquet file (TrajectoryRow minus the partition keys)."""
    return _TRAJ_SCHEMA


def evaluation_file_schema() -> pa.Schema:
    """Arrow schema of an ``evaluations/`` Parquet file (EvaluationRow minus the partition keys)."""
    return _EVAL_SCHEMA


def _derive() -> tuple[pa.Schema, pa.Schema, pa.Schema]:
    from schemas.arrow import arrow_schema_for  # schemas.arrow imports schemas.events only

    return (
        arrow_schema_for(StepRow, exclude=PARTITION_KEYS),
        arrow_schema_for(TrajectoryRow, exclude=PARTITION_KEYS),
        arrow_schema_for(EvaluationRow, exclude=PARTITION_KEYS),
    )


_STEP_SCHEMA, _TRAJ_SCHEMA, _EVAL_SCHEMA = _derive()
