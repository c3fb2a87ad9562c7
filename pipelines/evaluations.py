"""Evaluation episodes (``EpisodeStarted.purpose == "eval"``): split off, one ``evaluations/`` row each.

The trajectory job splits assembled episodes by purpose right after the
assembler (:class:`SplitEvaluations`): training episodes go on to
verification, rewards, clipping, groups and normalization; evaluation
episodes skip all of it and become :class:`schemas.datasets.EvaluationRow`
rows (:func:`evaluation_row`) that the commit writes to
``<out>/evaluations/recipe=<V>/domain=<D>/c<commit>.parquet``, in the same
dataset commit (manifest, offsets, exactly-once) as the other tables, in both
the batch and the streaming job. They never reach ``steps/``,
``trajectories/``, the GRPO group state or the normalization statistics.

An evaluation episode's ``passed`` is its status ``success`` (what the rollout
worker and the scheduler count as a pass); ``eval_run`` comes from its
``task_group`` ``<task_id>@v<version>#<eval_run>.<n>`` (rollout.evaluate).

Examples:
    >>> eval_run_of("math-d0-1a2b@v3#eval-v3-9f8e7d6c.12")
    'eval-v3-9f8e7d6c'
    >>> eval_run_of("math-d0-1a2b")
    ''
"""

from __future__ import annotations

from collections.abc import Iterator

import apache_beam as beam
from apache_beam.metrics import Metrics

from pipelines.forked import ChainStage
from pipelines.recipes import Recipe
from pipelines.types import METRICS_NAMESPACE, Episode
from schemas.datasets import EvaluationRow
from schemas.events import PURPOSE_EVAL

__all__ = ["EVAL_TAG", "is_eval", "eval_run_of", "evaluation_row", "SplitEvaluations"]

#: Tagged output of :class:`SplitEvaluations` holding the evaluation episodes.
EVAL_TAG = "evaluations"


def is_eval(episode: Episode) -> bool:
    """Whether the episode is a held-out evaluation (its ``episode_started`` says ``purpose = "eval"``)."""
    return episode.purpose == PURPOSE_EVAL


def eval_run_of(task_group: str) -> str:
    """The evaluation run id inside an eval episode's ``task_group`` (empty if it has another form)."""
    _, sep, rest = task_group.partition("#")
    return rest.rpartition(".")[0] if sep and "." in rest else ""


def evaluation_row(episode: Episode, recipe: Recipe | str) -> EvaluationRow:
    """The ``evaluations/`` row of an evaluation episode (complete or not).

    Args:
        episode: an assembled episode with ``purpose == "eval"``.
        recipe: the job's recipe, or its version string (the ``recipe`` partition).
    """
    fin, started, complete = episode.finished, episode.started, episode.complete
    status = fin.status.value if fin is not None and complete else "incomplete"
    return EvaluationRow(
        episode_id=episode.episode_id, domain=episode.domain,
        recipe=recipe if isinstance(recipe, str) else recipe.version,
        task_id=episode.task_id, difficulty=started.difficulty if started is not None else 0,
        policy_version=episode.policy_version, policy_lineage=episode.policy_lineage,
        eval_run=eval_run_of(episode.task_group), passed=status == "success",
        outcome_reward=fin.outcome_reward if fin is not None and complete else 0.0, status=status,
        termination=episode.termination, complete=complete, completed_late=episode.completed_late,
        num_steps=len(episode.steps), prompt_tokens=sum(s.prompt_tokens for s in episode.steps),
        action_tokens=sum(s.action_tokens for s in episode.steps),
        temperature=episode.sampling.temperature,
        producer_id=started.producer_id if started is not None else "",
        started_time=started.event_time if started is not None else episode.first_event_time,
        event_time=fin.event_time if fin is not None and complete else episode.last_event_time,
    )


class _SplitFn(beam.DoFn):
    def __init__(self, counter: str | None) -> None:
        self._n = Metrics.counter(METRICS_NAMESPACE, counter) if counter else None

    def process(self, episode: Episode) -> Iterator[Episode | beam.pvalue.TaggedOutput]:
        if is_eval(episode):
            if self._n is not None:
                self._n.inc()
            yield beam.pvalue.TaggedOutput(EVAL_TAG, episode)
        else:
            yield episode


class SplitEvaluations(beam.PTransform):
    """Episodes → training episodes (main output ``train``) and evaluation episodes (``EVAL_TAG``).

    Args:
        counter: name of the job counter that counts the evaluation episodes (None: not counted).
    """

    def __init__(self, *, counter: str | None = "evaluations") -> None:
        super().__init__()
        self._counter = counter

    def stage(self, name: str = "split") -> ChainStage:
        """This split as a stage of a :class:`pipelines.forked.ForkedChain` (main output: ``train``)."""
        return ChainStage(name, _SplitFn(self._counter), (EVAL_TAG,))

    def expand(self, episodes):
        return episodes | "ByPurpose" >> beam.ParDo(self.stage().fn).with_output_types(Episode).with_outputs(
            EVAL_TAG, main="train")
