"""Element types that flow between the transforms of the trajectory job.

The unit of work is a *batch* or an *episode*, never a single event (Beam's
per-element cost is 10 µs–0.2 ms in Python):

* :class:`RawRecords` — a batch of consecutive Kafka records of one partition,
  as ``pipelines.sources_kafka.ReadKafkaRange`` emits them.
* :data:`Fragment` — ``(episode_id, list[Event])``: the events of one episode
  found in one batch / archive file, so a ``GroupByKey`` sees about one
  element per episode per batch.
* :class:`Episode` — one assembled episode (ordered, deduplicated), which the
  later transforms annotate (verdicts, rewards, advantages, clipping) by
  returning updated copies (``msgspec.structs.replace``), never mutating input.
* :class:`PlainEpisode` — a plain episode's rows as the columnar path worked them
  out (:mod:`pipelines.columnar`), on its way to row staging.

Dead letters use :class:`schemas.deadletter.DeadLetter`.

Examples:
    >>> rr = RawRecords(topic="t", partition=0, offsets=[5], keys=[b"ep"], values=[b"x"], timestamps_ms=[0])
    >>> len(rr)
    1
"""

from __future__ import annotations

from datetime import datetime
from typing import NamedTuple, Tuple

import msgspec
import numpy as np

from schemas.datasets import TrajectoryRow, Verification
from schemas.events import (
    JUDGED_TERMINATIONS,
    PURPOSE_TRAIN,
    EpisodeFinished,
    EpisodeStarted,
    Feedback,
    SamplingParams,
    Step,
    termination_of,
)

__all__ = [
    "RawRecords",
    "Fragment",
    "Episode",
    "PlainEpisode",
    "INCOMPLETE_REASONS",
    "GroupKey",
    "DEAD_LETTER_TAG",
    "METRICS_NAMESPACE",
]

#: Beam metrics namespace of every counter the job reports.
METRICS_NAMESPACE = "pipeline"
#: Tag of the dead-letter side output of every transform that has one.
DEAD_LETTER_TAG = "dead_letters"

#: Why an episode was emitted as ``incomplete`` (never as training data).
INCOMPLETE_REASONS = ("unfinished", "gap", "no_start")


class RawRecords(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """A batch of consecutive records of one Kafka partition (what Kafka sources emit).

    All lists have the same length (one entry per record), in offset order.

    Attributes:
        topic: source topic.
        partition: source partition.
        offsets: offset of each record.
        keys: each record's key, raw bytes (None when the record had no key).
        values: each record's value, raw bytes (None for a null value/tombstone).
        timestamps_ms: each record's Kafka timestamp, epoch milliseconds.
    """

    topic: str
    partition: int
    offsets: list[int]
    keys: list[bytes | None]
    values: list[bytes | None]
    timestamps_ms: list[int]

    def __post_init__(self) -> None:
        n = len(self.offsets)
        if not (len(self.keys) == len(self.values) == len(self.timestamps_ms) == n):
            raise ValueError(
                f"RawRecords lists differ in length: offsets={n} keys={len(self.keys)} "
                f"values={len(self.values)} timestamps_ms={len(self.timestamps_ms)}"
            )

    def __len__(self) -> int:
        return len(self.offsets)


#: ``(episode_id, events)``: one episode's events from one batch, in any order.
Fragment = Tuple[str, list]

#: A GRPO group: ``(domain, task_group, policy_version)``. Statistics of one group never mix
#: policy versions (legacy events name a group by its task id alone, whatever version acted).
GroupKey = Tuple[str, str, int]

_DEFAULT_SAMPLING = SamplingParams()


# gc=False (as for events): plain data, never in a reference cycle, held by the ten thousand.
class Episode(msgspec.Struct, kw_only=True, gc=False):
    """One assembled episode, and the annotations the later transforms add.

    Attributes:
        episode_id: the episode.
        domain: environment domain (from the events' envelope).
        task_id: task inside the domain.
        task_group: GRPO group (``episode_started.task_group``; ``task_id`` if empty).
        policy_version: policy version that acted (first event's envelope).
        started: the ``episode_started`` event (None if it never arrived).
        finished: the ``episode_finished`` event (None if it never arrived).
        steps: ``step`` events ordered by ``step_index``.
        verdicts: per step, the verifier verdicts: the rollout-time
            ``step_verified`` ones first, then the pipeline's; ``len == len(steps)``.
        feedback: ``feedback`` events.
        num_events: distinct events the episode is made of.
        first_event_time: earliest event time (UTC).
        last_event_time: latest event time (UTC).
        complete: True when ``seq`` runs 0..last without gaps, starts with
            ``episode_started`` and ends with ``episode_finished``.
        incomplete_reason: one of :data:`INCOMPLETE_REASONS` when not complete.
        completed_late: complete, assembled from events an earlier commit kept when it
            wrote the episode as incomplete plus late events (pipelines/late.py).
        rewards: per-step reward ``r_t`` (set by ComputeProcessRewards), shape ``[len(steps)]``.
        returns: per-step return-to-go ``G_t``.
        advantages: per-step advantage ``A_t`` before normalization.
        normalized_advantages: per-step normalized advantage (NormalizeByDomain).
        group_advantage: the recipe's group advantage of the episode return (NormalizeByDomain).
        normalized_return: episode return normalized by the domain's return statistics.
        group_members: trainable members its group's statistics were computed over.
        group_timed_out: its group was closed by the timeout before all members arrived.
        loss_masks: per step, per action token: trained on (True) or not.
        clipped: ClipTrajectories dropped steps or masked tokens.
        steps_dropped: steps removed by the step cap.
        tokens_masked: action tokens masked out of the loss by the token cap.

    Derived (properties): ``termination``, ``excluded_reason``, ``trainable``
    (judged: ``done``/``max_steps`` with >= 1 step), ``sampling``,
    ``group_size``, ``group_member``, ``policy_lineage`` (from ``started``)
    and ``group_key``.
    """

    episode_id: str
    domain: str
    task_id: str
    task_group: str
    policy_version: int
    started: EpisodeStarted | None
    finished: EpisodeFinished | None
    steps: list[Step]
    verdicts: list[list[Verification]]
    feedback: list[Feedback]
    num_events: int
    first_event_time: datetime
    last_event_time: datetime
    complete: bool
    incomplete_reason: str | None = None
    completed_late: bool = False
    rewards: np.ndarray | None = None
    returns: np.ndarray | None = None
    advantages: np.ndarray | None = None
    normalized_advantages: np.ndarray | None = None
    group_advantage: float | None = None
    normalized_return: float | None = None
    group_members: int = 0
    group_timed_out: bool = False
    loss_masks: list[np.ndarray] | None = None
    clipped: bool = False
    steps_dropped: int = 0
    tokens_masked: int = 0

    @property
    def episode_return(self) -> float:
        """``G_0``, the return of the whole episode (0 before rewards are computed)."""
        return float(self.returns[0]) if self.returns is not None and len(self.returns) else 0.0

    @property
    def termination(self) -> str:
        """Why the episode stopped (:func:`schemas.events.termination_of`); empty when not complete."""
        return termination_of(self.finished) if self.complete and self.finished is not None else ""

    @property
    def excluded_reason(self) -> str | None:
        """Why a complete episode is not trained on, or None.

        ``timeout``, ``error`` or ``aborted`` (cut off by the infrastructure:
        its outcome of 0 is no verdict), else ``no_steps`` for a judged
        episode without steps. None for judged episodes with steps, and for
        incomplete ones (never training data anyway).
        """
        return excluded_reason_of(self.termination, len(self.steps)) if self.complete else None

    @property
    def trainable(self) -> bool:
        """Judged (``done``/``max_steps``) and complete with >= 1 step: its credit is a verdict's."""
        return self.complete and self.excluded_reason is None

    @property
    def sampling(self) -> SamplingParams:
        """Sampling parameters of the behaviour policy (defaults when ``episode_started`` is missing)."""
        return self.started.sampling if self.started is not None else _DEFAULT_SAMPLING

    @property
    def group_size(self) -> int:
        """Members the scheduler started in the episode's group (0: not declared)."""
        return self.started.group_size if self.started is not None else 0

    @property
    def group_member(self) -> int:
        """The episode's index in its group."""
        return self.started.group_member if self.started is not None else 0

    @property
    def policy_lineage(self) -> str:
        """Lineage of the behaviour policy (empty: base model or unknown)."""
        return self.started.policy_lineage if self.started is not None else ""

    @property
    def purpose(self) -> str:
        """``EpisodeStarted.purpose``: ``train``, or ``eval`` for a held-out evaluation (``train`` when missing)."""
        return self.started.purpose if self.started is not None else PURPOSE_TRAIN

    @property
    def group_key(self) -> GroupKey:
        """The GRPO group whose statistics the episode's group advantage uses."""
        return self.domain, self.task_group, self.policy_version



def excluded_reason_of(termination: str, steps: int) -> str | None:
    """Why a complete episode that stopped for ``termination`` with ``steps`` steps is not trained on, or None.

    Examples:
        >>> excluded_reason_of("timeout", 3), excluded_reason_of("done", 0), excluded_reason_of("max_steps", 2)
        ('timeout', 'no_steps', None)
    """
    if termination not in JUDGED_TERMINATIONS:
        return termination
    return None if steps else "no_steps"


class PlainEpisode(NamedTuple):
    """A plain episode's dataset rows as :func:`pipelines.columnar.plain_episodes` worked them out.

    What :class:`pipelines.sinks.RowsBuffer` reads from a processed (verified, rewarded, clipped)
    :class:`Episode`, with no ``Episode`` made: the episode's trajectory row, and its kept steps with
    their per-step values. ``episode_id``, ``domain`` and ``steps`` are read as an ``Episode``'s are
    (row staging keys and counts by them).

    Attributes:
        episode_id: the episode.
        domain: its domain.
        row: its ``trajectories/`` row (:func:`pipelines.sinks.trajectory_row`'s values).
        steps: the steps written (after clipping), in step order.
        verdicts: per written step, the recorded verdicts then the pipeline's.
        scores: per written step, ``verification_score``.
        disagreements: per written step, ``step_disagreements``.
        rewards: ``r_t`` of the written steps (after clipping).
        returns: ``G_t``.
        advantages: ``A_t`` (not normalized).
        loss_masks: per written step, per action token: trained on.
        sampling: the behaviour policy's sampling parameters.
    """

    episode_id: str
    domain: str
    row: TrajectoryRow
    steps: list[Step]
    verdicts: list[list[Verification]]
    scores: tuple[float, ...]
    disagreements: tuple[int, ...]
    rewards: np.ndarray
    returns: np.ndarray
    advantages: np.ndarray
    loss_masks: list[np.ndarray]
    sampling: SamplingParams
