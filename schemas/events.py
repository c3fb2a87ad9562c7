"""The trajpipe event model: the one source of truth for every event on the log.

Every event is a ``msgspec.Struct`` carrying the same envelope (``event_id``,
``episode_id``, ``seq``, ...) plus the fields of its type. The Kafka binary
format (:mod:`schemas.codec`), the readable JSON form and the Arrow/Parquet
table schemas (:mod:`schemas.arrow`) are all derived from these classes; nothing
else describes the fields.

Token arrays (``TokenIds``, ``LogProbs``) are numpy arrays, never Python lists:
the binary codec writes them as packed little-endian ``int32``/``float32``
buffers and Arrow stores them as ``list<int32>``/``list<float32>``.

Examples:
    >>> import numpy as np
    >>> ev = Step(event_id="e1", episode_id="ep1", seq=1, producer_id="w0",
    ...           domain="math", task_id="t1", step_index=0, action_text="2+2=4",
    ...           action_token_ids=[17, 4, 99], behaviour_logprobs=[-0.1, -0.2, -0.05])
    >>> ev.event_type, ev.action_token_ids.dtype.name, ev.behaviour_logprobs.dtype.name
    ('step', 'int32', 'float32')
"""

from __future__ import annotations

import enum
import hashlib
from datetime import datetime, timezone
from typing import Any, ClassVar, Union

import msgspec
import numpy as np

__all__ = [
    "SCHEMA_VERSION",
    "TokenIds",
    "LogProbs",
    "EpisodeStatus",
    "Termination",
    "JUDGED_TERMINATIONS",
    "SamplingParams",
    "PURPOSES",
    "PURPOSE_TRAIN",
    "PURPOSE_EVAL",
    "Event",
    "EpisodeStarted",
    "Step",
    "StepVerified",
    "EpisodeFinished",
    "Feedback",
    "PolicyPublished",
    "AnyEvent",
    "EVENT_TYPES",
    "make_event_id",
    "termination_of",
    "utc_now",
]

#: Version of the event model this code writes. Bump it (and run
#: ``python -m schemas.evolution --record``) whenever a field is added; see
#: docs/schema-evolution.md for the rules.
SCHEMA_VERSION = 3

#: ``EpisodeStarted.purpose`` of an episode whose data may be trained on (the default).
PURPOSE_TRAIN = "train"
#: ``EpisodeStarted.purpose`` of a held-out evaluation episode: never trained on, never in dataset statistics.
PURPOSE_EVAL = "eval"
#: The documented values of ``EpisodeStarted.purpose``; any other value is rejected (dead-lettered).
PURPOSES = (PURPOSE_TRAIN, PURPOSE_EVAL)


class TokenIds(np.ndarray):
    """1-D ``int32`` array of token ids (a view type; build with :func:`as_token_ids`)."""


class LogProbs(np.ndarray):
    """1-D ``float32`` array of per-token log-probabilities, natural log, <= 0."""


def as_token_ids(value: Any) -> TokenIds:
    """Coerce a list/array of ints to a contiguous ``int32`` :class:`TokenIds` view.

    Raises:
        TypeError: if the values are not integral or do not fit in int32.
    """
    if isinstance(value, TokenIds):
        return value
    arr = np.asarray(value)
    if arr.size == 0:
        arr = arr.astype(np.int32)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"token ids must be a 1-D sequence of integers, got dtype={arr.dtype} ndim={arr.ndim}")
    if arr.dtype != np.int32:
        if arr.size and (arr.min() < np.iinfo(np.int32).min or arr.max() > np.iinfo(np.int32).max):
            raise TypeError("token ids must fit in int32")
        arr = arr.astype(np.int32)
    return np.ascontiguousarray(arr).view(TokenIds)


def as_logprobs(value: Any) -> LogProbs:
    """Coerce a list/array of floats to a contiguous ``float32`` :class:`LogProbs` view.

    Raises:
        TypeError: if the values are not numbers.
    """
    if isinstance(value, LogProbs):
        return value
    arr = np.asarray(value)
    if arr.size == 0:
        arr = arr.astype(np.float32)
    if arr.ndim != 1 or not (np.issubdtype(arr.dtype, np.floating) or np.issubdtype(arr.dtype, np.integer)):
        raise TypeError(f"logprobs must be a 1-D sequence of numbers, got dtype={arr.dtype} ndim={arr.ndim}")
    return np.ascontiguousarray(arr, dtype=np.float32).view(LogProbs)


def utc_now() -> datetime:
    """Current time, timezone-aware UTC (the only kind of time the model stores)."""
    return datetime.now(timezone.utc)


def make_event_id(episode_id: str, seq: int) -> str:
    """Deterministic event id: the same (episode, seq) always gets the same id.

    A producer that retries, or a worker that re-emits after a crash, therefore
    writes the same ``event_id`` and downstream dedupe removes the copy.

    Examples:
        >>> make_event_id("ep-1", 0) == make_event_id("ep-1", 0)
        True
        >>> len(make_event_id("ep-1", 0))
        32
    """
    return hashlib.blake2b(f"{episode_id}\x1f{seq}".encode(), digest_size=16).hexdigest()


class EpisodeStatus(str, enum.Enum):
    """How an episode ended."""

    SUCCESS = "success"
    FAILURE = "failure"
    TIMEOUT = "timeout"
    ERROR = "error"
    ABORTED = "aborted"


class Termination(str, enum.Enum):
    """Why an episode stopped (``EpisodeFinished.termination``).

    ``done`` and ``max_steps`` episodes were judged by the environment: their
    ``outcome_reward`` is a verdict. ``timeout``, ``error`` and ``aborted``
    episodes were cut off by the infrastructure (wall-clock budget, a failure,
    a worker shutdown) and carry no verdict: their ``outcome_reward`` of 0 is
    not an outcome, so datasets exclude them from training and statistics.
    """

    DONE = "done"
    MAX_STEPS = "max_steps"
    TIMEOUT = "timeout"
    ERROR = "error"
    ABORTED = "aborted"


class SamplingParams(msgspec.Struct, kw_only=True, frozen=True, gc=False):
    """Sampling parameters the policy used for an episode.

    Attributes:
        temperature: softmax temperature; 0 means greedy.
        top_p: nucleus sampling mass in (0, 1].
        top_k: top-k cutoff; -1 disables it.
        max_tokens: cap on generated tokens per step.
        seed: sampling seed, if the engine was seeded.
    """

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = -1
    max_tokens: int = 256
    seed: int | None = None


# gc=False: events are plain data (no reference cycles), and a batch job holds ~10^5 of them; untracked,
# they cost the cyclic collector nothing (decoding 100k events: 22 -> 10 µs each with the collector on).
class Event(msgspec.Struct, kw_only=True, tag_field="event_type", gc=False):
    """Envelope shared by every event. Not emitted itself; see the subclasses.

    Attributes:
        event_id: unique id, stable across retries (see :func:`make_event_id`).
        episode_id: the episode the event belongs to; the Kafka message key.
        seq: position in the episode, gap-free from 0 (``episode_started`` is 0).
        producer_id: the worker/process that emitted it.
        domain: environment domain, e.g. ``code``, ``math``, ``docqa``, ``tools``.
        task_id: id of the task inside its domain.
        policy_version: version of the policy that acted (0 = base model).
        event_time: when it happened, timezone-aware UTC.
        schema_version: event-model version the producer wrote.
    """

    event_type: ClassVar[str]

    event_id: str
    episode_id: str
    seq: int
    producer_id: str
    domain: str
    task_id: str
    policy_version: int = 0
    event_time: datetime = msgspec.field(default_factory=utc_now)
    schema_version: int = SCHEMA_VERSION

    def __post_init__(self) -> None:
        if self.seq < 0:
            raise ValueError(f"`seq` must be >= 0, got {self.seq}")
        if not self.event_id or not self.episode_id:
            raise ValueError("`event_id` and `episode_id` must be non-empty")
        if self.event_time.tzinfo is None:
            raise ValueError("`event_time` must be timezone-aware (UTC)")

    def __eq__(self, other: object) -> bool:
        # Field-wise, with token arrays compared by value (numpy's == is element-wise).
        if type(other) is not type(self):
            return NotImplemented
        for a, b in zip(msgspec.structs.astuple(self), msgspec.structs.astuple(other)):
            if isinstance(a, np.ndarray) or isinstance(b, np.ndarray):
                if not np.array_equal(a, b):
                    return False
            elif a != b:
                return False
        return True

    __hash__ = None  # type: ignore[assignment]  # mutable, compared by value


class EpisodeStarted(Event, tag="episode_started"):
    """An episode began: what task, in which environment, sampled how.

    Attributes:
        task_spec: the task as the environment states it (JSON document).
        env_config: environment configuration (JSON document): limits, image, tools.
        difficulty: task difficulty level, 0 = easiest.
        prompt: the initial prompt shown to the policy.
        sampling: sampling parameters for the whole episode; the behaviour
            log-probs of its steps are log-probs of this distribution (after
            temperature, top-k and top-p; raw model log-probs when greedy).
        task_group: id of the group of rollouts this episode belongs to (GRPO
            baselines): ``<task_id>@v<policy_version>#<round>`` for groups the
            scheduler formed; empty means the task id.
        group_size: episodes the scheduler started in ``task_group`` (0: not
            declared, e.g. events written before schema version 2).
        group_member: index of this episode in its group, ``0..group_size-1``
            (part of its sampling seed, so members draw different samples).
        policy_lineage: lineage of the acting policy: the id of the chain of
            published versions it belongs to (empty: the base model or unknown).
            Staleness is measured only within one lineage.
        purpose: why the episode ran: ``"train"`` (experience to learn from)
            or ``"eval"`` (a held-out evaluation of a policy version: its steps
            never reach the training datasets or their statistics, only the
            ``evaluations`` table). Events written before schema version 3
            have no field and read as ``"train"``. Evaluation episodes have
            ``group_size`` 1 and ``task_group`` ``<task_id>@v<version>#<eval
            run>.<n>``.
    """

    task_spec: str
    env_config: str = "{}"
    difficulty: int = 0
    prompt: str = ""
    sampling: SamplingParams = msgspec.field(default_factory=SamplingParams)
    task_group: str = ""
    group_size: int = 0
    group_member: int = 0
    policy_lineage: str = ""
    purpose: str = PURPOSE_TRAIN

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.purpose not in PURPOSES:
            # An unknown purpose must not be read as "train": the event goes to the dead letters.
            raise ValueError(f"`purpose` must be one of {', '.join(PURPOSES)}, got {self.purpose!r}")


class Step(Event, tag="step"):
    """One policy action and what the environment answered.

    Attributes:
        step_index: 0-based index of the step inside the episode.
        observation: what the policy saw new since its last action (for step 0
            empty: its input is ``EpisodeStarted.prompt``), as text.
        observation_token_ids: the token ids appended to the episode's context
            since the previous action, exactly as the model was fed them: for
            step 0 the rendered prompt (chat template applied once), for later
            steps the previous turn's closing markers plus the observation turn
            and the next assistant marker. Concatenating ``observation_token_ids``
            and ``action_token_ids`` of steps ``0..k`` gives the episode's token
            stream; the model's input at step ``k`` is that stream up to step
            ``k``'s observation, minus the context cut below. Empty when the
            policy has no tokenizer (scripted rollouts without ``--model``).
        action_text: what the policy produced.
        action_token_ids: the ids the model generated, shape ``[action_tokens]``
            (including the end-of-sequence token when it stopped on one).
        behaviour_logprobs: per-token log-prob of each action token under the
            behaviour policy, shape ``[action_tokens]``.
        tool_name: tool the action invoked, if any.
        tool_args: the tool's arguments (JSON document), if any.
        tool_result: the tool's output (bounded), if any.
        exit_status: exit status of the executed command, if any.
        latency_ms: wall time of policy + environment for this step, milliseconds.
        prompt_tokens: number of prompt tokens the policy consumed this step
            (the length of its input after any context cut).
        action_tokens: number of generated tokens (== len(action_token_ids)).
        context_cut_start: position in the episode's token stream where tokens
            were cut out of this step's input to fit the model's context.
        context_cut_tokens: how many tokens were cut there (0: the model saw
            the whole stream). The input was ``stream[:context_cut_start] +
            stream[context_cut_start + context_cut_tokens:]``.
    """

    step_index: int
    observation: str = ""
    observation_token_ids: TokenIds = msgspec.field(default_factory=lambda: as_token_ids([]))
    action_text: str = ""
    action_token_ids: TokenIds = msgspec.field(default_factory=lambda: as_token_ids([]))
    behaviour_logprobs: LogProbs = msgspec.field(default_factory=lambda: as_logprobs([]))
    tool_name: str | None = None
    tool_args: str | None = None
    tool_result: str | None = None
    exit_status: int | None = None
    latency_ms: float = 0.0
    prompt_tokens: int = 0
    action_tokens: int = 0
    context_cut_start: int = 0
    context_cut_tokens: int = 0

    def __post_init__(self) -> None:
        super().__post_init__()
        if self.context_cut_start < 0 or self.context_cut_tokens < 0:
            raise ValueError("`context_cut_start` and `context_cut_tokens` must be >= 0")
        self.observation_token_ids = as_token_ids(self.observation_token_ids)
        self.action_token_ids = as_token_ids(self.action_token_ids)
        self.behaviour_logprobs = as_logprobs(self.behaviour_logprobs)
        if len(self.behaviour_logprobs) not in (0, len(self.action_token_ids)):
            raise ValueError(
                f"`behaviour_logprobs` has {len(self.behaviour_logprobs)} entries but "
                f"`action_token_ids` has {len(self.action_token_ids)}; they must match"
            )
        if self.action_tokens == 0:
            self.action_tokens = len(self.action_token_ids)


class StepVerified(Event, tag="step_verified"):
    """A verifier's verdict on one step.

    Attributes:
        step_index: the step it judges.
        verifier: verifier name, e.g. ``code.tests_pass``.
        passed: whether the step passed.
        score: graded score in [0, 1] (1.0/0.0 for binary verifiers).
        details: human-readable detail (bounded).
    """

    step_index: int
    verifier: str
    passed: bool
    score: float = 0.0
    details: str = ""


class EpisodeFinished(Event, tag="episode_finished"):
    """The episode ended.

    Attributes:
        status: how it ended.
        outcome_reward: the outcome reward from the final verifier.
        num_steps: number of ``step`` events the episode emitted.
        verifier_summary: summary of the outcome verification.
        termination: why it stopped, a :class:`Termination` value (empty in
            events written before schema version 2: readers derive it from
            ``status``, see :func:`termination_of`).
    """

    status: EpisodeStatus
    outcome_reward: float = 0.0
    num_steps: int = 0
    verifier_summary: str = ""
    termination: str = ""


class Feedback(Event, tag="feedback"):
    """An external correction or rating attached to an episode or one of its steps.

    Attributes:
        source: who gave it (annotator id, reward model name, ...).
        target_step: the step it refers to, or None for the whole episode.
        rating: a scalar rating, if any.
        correction: a corrected action text, if any.
        comment: free text.
    """

    source: str
    target_step: int | None = None
    rating: float | None = None
    correction: str | None = None
    comment: str = ""


class PolicyPublished(Event, tag="policy_published"):
    """A new policy version is available (on the control topic).

    ``episode_id`` is ``policy-<version>``, ``seq`` 0, ``domain`` the domain
    group it was trained for (or ``*``).

    Attributes:
        version: the new policy version.
        location: where it is stored (directory or URI).
        parent_version: the version it was trained from, if any.
        base_model: the base model it descends from.
        train_step: trainer step at which it was saved.
        lineage: id of the chain of versions it belongs to (one training run
            and its resumptions); every version of a lineage descends from the
            previous one. Staleness is measured within one lineage.
    """

    version: int
    location: str
    parent_version: int | None = None
    base_model: str = ""
    train_step: int = 0
    lineage: str = ""


#: Terminations whose outcome reward is an environment verdict.
JUDGED_TERMINATIONS = frozenset({Termination.DONE.value, Termination.MAX_STEPS.value})


def termination_of(finished: EpisodeFinished) -> str:
    """The episode's :class:`Termination` value, derived from ``status`` for events without one.

    Examples:
        >>> fin = EpisodeFinished(event_id="e", episode_id="ep", seq=3, producer_id="w", domain="math",
        ...                       task_id="t", status=EpisodeStatus.TIMEOUT)
        >>> termination_of(fin)
        'timeout'
        >>> termination_of(msgspec.structs.replace(fin, status=EpisodeStatus.SUCCESS))
        'done'
    """
    if finished.termination:
        return finished.termination
    return {EpisodeStatus.TIMEOUT: "timeout", EpisodeStatus.ERROR: "error",
            EpisodeStatus.ABORTED: "aborted"}.get(finished.status, "done")


AnyEvent = Union[EpisodeStarted, Step, StepVerified, EpisodeFinished, Feedback, PolicyPublished]

#: event_type name -> class, in a fixed order (the order also fixes the type codes).
EVENT_TYPES: dict[str, type[Event]] = {
    cls.__struct_config__.tag: cls  # type: ignore[misc]
    for cls in (EpisodeStarted, Step, StepVerified, EpisodeFinished, Feedback, PolicyPublished)
}

for _name, _cls in EVENT_TYPES.items():
    _cls.event_type = _name
