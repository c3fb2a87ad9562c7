"""Row types of the feedback tables the trajectory job writes (``feedback/``, ``corrections/``).

A ``feedback`` event (:class:`schemas.events.Feedback`) is a rating or a
correction someone gave an episode after it ran (``trajpipe feedback``). The
trajectory job writes each one once per dataset version into ``feedback/``;
a correction whose step it can find becomes a supervised sample in
``corrections/`` (docs/feedback.md). Layout::

    <out>/feedback/recipe=<name>-<hash8>/c<commit>.parquet
    <out>/corrections/recipe=<name>-<hash8>/domain=<domain>/c<commit>.parquet

A correction row *is* a one-step ``steps/`` row (:class:`schemas.datasets.StepRow`:
the trainer reads it with the steps schema) plus the columns saying where it
came from (:class:`CorrectionRow`).

Examples:
    >>> feedback_file_schema().field("rating").type, "recipe" in feedback_file_schema().names, "domain" in feedback_file_schema().names
    (DataType(double), False, True)
    >>> sch = correction_file_schema()
    >>> sch.field("target_episode_id").type, sch.field("observation_token_ids").type
    (DataType(string), ListType(list<item: int32>))
"""

from __future__ import annotations

from datetime import datetime

import msgspec
import pyarrow as pa

from schemas.datasets import PARTITION_KEYS, StepRow

__all__ = ["FeedbackRow", "CorrectionRow", "feedback_file_schema", "correction_file_schema"]


class FeedbackRow(msgspec.Struct, kw_only=True, gc=False):
    """One ``feedback`` event, as the dataset version saw it.

    Attributes:
        event_id: the feedback event's id (stable: retries and re-sends have the same one).
        episode_id: the episode it is about.
        recipe: dataset version ``<recipe name>-<hash8>``. Partition key: not stored in the file.
        domain: the episode's domain (from the event's envelope).
        task_id: the episode's task.
        policy_version: the version of the policy that acted in the episode.
        source: who gave it (annotator id, reviewer, reward model name).
        target_step: the step it is about; None for the whole episode.
        rating: the score given (``trajpipe feedback --score``), or None.
        correction: the corrected action text (``--correction``), or None.
        comment: free text.
        producer_id: the process that emitted it.
        event_time: when it was given (UTC).
        applied: the recipe took it into this version's rewards: the episode was
            written complete in the same commit and the recipe's ``feedback`` is
            not ``ignore`` (docs/feedback.md, "When feedback counts").
    """

    event_id: str
    episode_id: str
    recipe: str
    domain: str
    task_id: str
    policy_version: int
    source: str
    target_step: int | None
    rating: float | None
    correction: str | None
    comment: str
    producer_id: str
    event_time: datetime
    applied: bool


class CorrectionRow(StepRow, kw_only=True, gc=False):
    """A correction as a supervised sample: a one-step episode the trainer's BC path reads.

    The inherited :class:`~schemas.datasets.StepRow` columns hold the sample:
    ``episode_id`` is ``<target episode>/correction/<feedback event id>`` (one
    sample per correction), ``step_index`` 0, ``num_steps`` 1,
    ``observation_token_ids`` the exact model input of the corrected step
    (``rollout.context.model_input_of`` of the recorded steps, its recorded
    context cut applied), ``action_token_ids`` the correction tokenized with the
    policy's tokenizer (no special tokens) plus its end-of-sequence token,
    ``loss_mask`` all true, ``trainable`` true, ``status`` ``correction``,
    ``behaviour_logprobs`` empty (no policy sampled it), ``reward``,
    ``return_to_go`` and every advantage 1.0 (an endorsed demonstration: it
    passes filtered BC's ``min_advantage`` of 0), ``event_id`` the feedback
    event's id, ``policy_version``/``policy_lineage`` the corrected episode's.

    Attributes:
        target_episode_id: the corrected episode.
        target_step: the corrected step.
        source: who gave the correction.
        correction: the correction text.
        original_action_token_ids: what the policy did at that step (for comparison).
        tokenizer: the tokenizer (model directory) the correction was tokenized with.
    """

    target_episode_id: str
    target_step: int
    source: str
    correction: str
    original_action_token_ids: list[int]
    tokenizer: str


def feedback_file_schema() -> pa.Schema:
    """Arrow schema of a ``feedback/`` Parquet file (FeedbackRow minus ``recipe``, its partition key)."""
    return _FEEDBACK_SCHEMA


def correction_file_schema() -> pa.Schema:
    """Arrow schema of a ``corrections/`` Parquet file (CorrectionRow minus the partition keys)."""
    return _CORRECTION_SCHEMA


def _derive() -> tuple[pa.Schema, pa.Schema]:
    from schemas.arrow import arrow_schema_for

    return (arrow_schema_for(FeedbackRow, exclude=("recipe",)),  # partitioned by recipe only
            arrow_schema_for(CorrectionRow, exclude=PARTITION_KEYS))


_FEEDBACK_SCHEMA, _CORRECTION_SCHEMA = _derive()
