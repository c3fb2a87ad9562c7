"""Feedback in the trajectory job: ``feedback`` events → the ``feedback/`` table, rewards and ``corrections/``.

A ``feedback`` event (``trajpipe feedback``, :class:`schemas.events.Feedback`)
travels on the events topic keyed by its episode, like the episode's own
events, but it is not part of the episode's ``seq`` sequence: it usually
comes long after the episode finished. So the assembler takes it out of the
episode's events first (:func:`split_feedback`): it never makes an episode
look gapped, late or complete, and it is never a duplicate of an episode an
earlier commit wrote. Then:

* every distinct feedback event (by ``event_id``: a re-sent copy is a
  duplicate, in the same run or against the version's earlier commits)
  becomes one :class:`~schemas.feedback.FeedbackRow` in
  ``feedback/recipe=V/c<n>.parquet`` of the commit that read it
  (:class:`WriteFeedback`): exactly once per dataset version;
* when the episode it is about is assembled complete *in the same commit*,
  it is attached to it (:attr:`pipelines.types.Episode.feedback`) and a
  recipe with ``feedback: override|add`` takes its rating into the rewards
  (:func:`feedback_outcome`, :func:`step_feedback_terms`; formulas in
  :mod:`pipelines.recipes`, "Feedback"). Feedback on an episode an earlier
  commit wrote is in the table but changes no committed reward: datasets are
  a pure function of the log, so it counts in the next version built from the
  archive (``trajpipe pipeline run --source archive`` with the feedback
  recipe into a new ``--out``, or a new recipe version), which reads the
  episode and its feedback together (docs/feedback.md, "When feedback counts");
* a correction becomes a supervised sample in ``corrections/``
  (:func:`stage_corrections`, run by the driver before the commit).

Examples:
    >>> from schemas.events import Feedback, Step
    >>> fb = Feedback(event_id="f1", episode_id="ep", seq=1, producer_id="cli", domain="math", task_id="t",
    ...               source="ann", rating=0.2)
    >>> step = Step(event_id="s", episode_id="ep", seq=1, producer_id="w", domain="math", task_id="t", step_index=0)
    >>> rest, feedback, dups = split_feedback([step, fb, fb])
    >>> [e.event_type for e in rest], [f.event_id for f in feedback], dups
    (['step'], ['f1'], 1)
"""

from __future__ import annotations

import logging
from collections import defaultdict
from collections.abc import Iterable, Iterator, Sequence
from pathlib import Path
from typing import Any

import apache_beam as beam
import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.dataset as pads
from apache_beam.metrics import Metrics

from pipelines.recipes import Recipe
from pipelines.types import METRICS_NAMESPACE
from schemas import locations as loc
from schemas.events import Event, Feedback
from schemas.feedback import CorrectionRow, FeedbackRow, correction_file_schema, feedback_file_schema

__all__ = [
    "FEEDBACK_TAG",
    "split_feedback",
    "feedback_outcome",
    "step_feedback_terms",
    "feedback_row",
    "committed_feedback_ids",
    "WriteFeedback",
    "SplitFeedback",
    "write_feedback_file",
    "stage_corrections",
    "load_correction_tokenizer",
    "CorrectionError",
]

_LOG = logging.getLogger(__name__)

#: Output tag of the assembler's feedback events: ``(Feedback, attached)`` (attached: to an episode assembled
#: complete in this run).
FEEDBACK_TAG = "feedback"
_STAGED_SUFFIX = ".tmp"  # pipelines.sinks.STAGED_SUFFIX (not imported: sinks imports the whole writer)


class CorrectionError(ValueError):
    """The corrections cannot be built as asked (e.g. an unloadable ``--tokenizer``)."""


def split_feedback(events: Iterable[Event]) -> tuple[list[Event], list[Feedback], int]:
    """``(other events, distinct feedback events, repeated copies)``: feedback out of an episode's events.

    Feedback is deduplicated by ``event_id`` and ordered by ``(event_time, event_id)``.
    """
    rest: list[Event] = []
    by_id: dict[str, Feedback] = {}
    dups = 0
    for ev in events:
        if isinstance(ev, Feedback):
            if ev.event_id in by_id:
                dups += 1
            else:
                by_id[ev.event_id] = ev
        else:
            rest.append(ev)
    return rest, sorted(by_id.values(), key=lambda f: (f.event_time, f.event_id)), dups


def _mean(values: list[float]) -> float | None:
    return sum(values) / len(values) if values else None


def feedback_outcome(recipe: Recipe, outcome: float, feedback: Sequence[Feedback]) -> float:
    """The outcome ``R`` the recipe's rewards use, after episode-level feedback (pipelines.recipes, "Feedback").

    ``F`` is the mean rating of the episode-level feedback (``target_step`` None, a rating given).
    ``ignore``: ``R``; ``override``: ``F`` if there is one, else ``R``; ``add``: ``R + w_f * F`` (``F = 0`` if none).

    Examples:
        >>> from pipelines.recipes import load_recipe
        >>> fb = [Feedback(event_id=i, episode_id="ep", seq=1, producer_id="p", domain="d", task_id="t",
        ...                source="s", rating=r) for i, r in (("a", 0.0), ("b", 0.4))]
        >>> feedback_outcome(load_recipe("outcome", feedback="override"), 1.0, fb)  # F = (0 + 0.4) / 2
        0.2
        >>> round(feedback_outcome(load_recipe("outcome", feedback="add", feedback_weight=0.5), 1.0, fb), 6)
        1.1
        >>> feedback_outcome(load_recipe("outcome"), 1.0, fb)
        1.0
    """
    if recipe.feedback == "ignore":
        return outcome
    F = _mean([f.rating for f in feedback if f.target_step is None and f.rating is not None])
    if recipe.feedback == "override":
        return outcome if F is None else F
    return outcome + recipe.feedback_weight * (F or 0.0)


def step_feedback_terms(recipe: Recipe, feedback: Sequence[Feedback], step_indices: Sequence[int]) -> np.ndarray | None:
    """``w_f * f_t`` per step (float64, aligned with ``step_indices``), or None when nothing applies.

    ``f_t`` is the mean rating of the feedback on step ``t``; steps without any get 0.

    Examples:
        >>> from pipelines.recipes import load_recipe
        >>> fb = [Feedback(event_id="a", episode_id="ep", seq=1, producer_id="p", domain="d", task_id="t",
        ...                source="s", target_step=1, rating=-1.0)]
        >>> step_feedback_terms(load_recipe("outcome", feedback="add", feedback_weight=0.5), fb, [0, 1]).tolist()
        [0.0, -0.5]
    """
    if recipe.feedback == "ignore":
        return None
    by_step: dict[int, list[float]] = defaultdict(list)
    for f in feedback:
        if f.target_step is not None and f.rating is not None:
            by_step[f.target_step].append(f.rating)
    if not by_step:
        return None
    return np.array([recipe.feedback_weight * (_mean(by_step.get(t, [])) or 0.0) for t in step_indices],
                    dtype=np.float64)


def feedback_row(fb: Feedback, *, recipe: str, applied: bool) -> FeedbackRow:
    """The ``feedback/`` row of one feedback event."""
    return FeedbackRow(
        event_id=fb.event_id, episode_id=fb.episode_id, recipe=recipe, domain=fb.domain, task_id=fb.task_id,
        policy_version=fb.policy_version, source=fb.source, target_step=fb.target_step, rating=fb.rating,
        correction=fb.correction, comment=fb.comment, producer_id=fb.producer_id, event_time=fb.event_time,
        applied=applied,
    )


def feedback_path(version: str, commit: int) -> str:
    """Final path (relative to ``<out>``) of a commit's feedback file."""
    return f"feedback/recipe={version}/c{commit:08d}.parquet"


def committed_feedback_ids(out: str | Path, manifests: Sequence[Any]) -> frozenset[str]:
    """``event_id`` of every feedback row the version's commits hold (what a new commit must not repeat)."""
    paths = [loc.join(str(out), f.path) for m in manifests for f in m.files if f.path.startswith("feedback/")]
    if not paths:
        return frozenset()
    ids: set[str] = set()
    for p in paths:
        ids.update(loc.read_parquet(p, columns=["event_id"]).column(0).to_pylist())
    return frozenset(ids)


def write_feedback_file(items: Iterable[tuple[Feedback, bool]], staging: str | Path, *, recipe: Recipe,
                        commit: int, seen: frozenset[str] = frozenset()) -> tuple[list[str], int, int]:
    """Stage a commit's feedback file; ``(files, rows written, duplicates skipped)``.

    Args:
        items: ``(feedback event, attached)`` pairs (attached: its episode was assembled complete with it).
        staging: ``<out>/_staging/<version>/<commit>``.
        recipe: the recipe (names the version; ``applied`` = attached and the recipe does not ignore feedback).
        commit: the commit number.
        seen: event ids earlier commits of the version hold (:func:`committed_feedback_ids`).
    """
    by_id: dict[str, tuple[Feedback, bool]] = {}
    dups = 0
    for fb, attached in items:
        if fb.event_id in seen:
            dups += 1
        elif fb.event_id in by_id:
            dups += 1
            by_id[fb.event_id] = (fb, by_id[fb.event_id][1] or attached)
        else:
            by_id[fb.event_id] = (fb, attached)
    if not by_id:
        return [], 0, dups
    apply = recipe.feedback != "ignore"
    rows = [feedback_row(fb, recipe=recipe.version, applied=attached and apply)
            for fb, attached in sorted(by_id.values(), key=lambda x: (x[0].episode_id, x[0].event_id))]
    rel = feedback_path(recipe.version, commit)
    _write_parquet(_rows_table(rows, feedback_file_schema()), loc.join(str(staging), rel + _STAGED_SUFFIX))
    return [rel], len(rows), dups


def _rows_table(rows: Sequence[msgspec.Struct], schema: pa.Schema) -> pa.Table:
    from pipelines.sinks import rows_to_table

    return rows_to_table(rows, schema)


def _write_parquet(table: pa.Table, path: str) -> None:
    from pipelines.sinks import write_parquet

    write_parquet(table, path)


class _WriteFeedbackFn(beam.DoFn):
    def __init__(self, staging: str, recipe: Recipe, commit: int, seen: frozenset[str], committed: Any = None) -> None:
        self._staging, self._recipe, self._commit, self._seen = staging, recipe, commit, seen
        self._committed = committed
        self._written = Metrics.counter(METRICS_NAMESPACE, "feedback_events")
        self._dups = Metrics.counter(METRICS_NAMESPACE, "duplicates")

    def setup(self) -> None:
        if self._committed is not None:  # the committed ids, read here rather than shipped in the graph
            self._seen = self._committed.feedback_ids()

    def process(self, items: list[tuple[Feedback, bool]]) -> Iterator[str]:
        from pipelines.counts import write_counts_file

        files, n, dups = write_feedback_file(items, self._staging, recipe=self._recipe, commit=self._commit,
                                             seen=self._seen)
        self._written.inc(n)
        self._dups.inc(dups)
        # One writer per commit: its counts beside its file, for the commit (pipelines/counts.py).
        write_counts_file(self._staging, "feedback", {"feedback_events": n, "duplicates": dups})
        yield from files


class WriteFeedback(beam.PTransform):
    """``(Feedback, attached)`` elements → the commit's staged ``feedback/`` file (one per commit, if any).

    Counts ``pipeline/feedback_events`` (rows written) and ``pipeline/duplicates``
    (copies of an event id this run or an earlier commit of the version already has).

    Args:
        staging: ``<out>/_staging/<version>/<commit>``.
        recipe: the recipe (names the version).
        commit: the commit number.
        seen: feedback event ids of the version's earlier commits (:func:`committed_feedback_ids`).
        committed: a :class:`pipelines.committed.CommittedView`: ``seen`` is read from the dataset by
            the worker instead (the job graph does not grow with the history).

    Returns:
        PCollection of the staged file's final relative path.
    """

    def __init__(self, staging: str | Path, recipe: Recipe, *, commit: int, seen: Iterable[str] = (),
                 committed: Any = None) -> None:
        super().__init__()
        self._staging, self._recipe, self._commit, self._seen = str(staging), recipe, commit, frozenset(seen)
        self._committed = committed

    def expand(self, feedback):
        return (
            feedback
            | "CollectFeedback" >> beam.combiners.ToList().without_defaults()
            | "WriteFeedbackFile" >> beam.ParDo(_WriteFeedbackFn(self._staging, self._recipe, self._commit,
                                                                 self._seen, self._committed))
        )


# ----------------------------------------------------------------------------- corrections


def load_correction_tokenizer(model_dir: str | Path) -> Any:
    """The tokenizer of a policy's model directory (``--tokenizer``).

    Raises:
        CorrectionError: it does not load.
    """
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(model_dir))
    except (OSError, ValueError) as err:
        raise CorrectionError(f"`--tokenizer` {model_dir}: no tokenizer loads from it ({err}); give the model "
                              "directory of the policy that ran the episodes (e.g. `trajpipe model init-tiny "
                              "--out DIR`'s DIR)") from err


_STEP_COLUMNS = ["episode_id", "step_index", "observation_token_ids", "action_token_ids", "context_cut_start",
                 "context_cut_tokens", "policy_version", "policy_lineage", "task_id", "task_group", "temperature",
                 "top_p", "top_k", "event_time"]


def _steps_of(files: Sequence[str], episode_ids: set[str]) -> dict[str, dict[int, dict[str, Any]]]:
    """episode id -> step index -> row (the columns above), from steps Parquet files or held Arrow parts."""
    found: dict[str, dict[int, dict[str, Any]]] = defaultdict(dict)
    if not episode_ids:
        return found
    want = pa.array(sorted(episode_ids), type=pa.string())
    for path in files:
        if path.endswith((".arrow", ".arrow" + _STAGED_SUFFIX)):
            table = loc.read_feather(path)
        else:
            table = loc.read_parquet(path, columns=_STEP_COLUMNS)
        table = table.filter(pads.field("episode_id").isin(want)) if table.num_rows else table
        for row in table.select(_STEP_COLUMNS).to_pylist():
            found[row["episode_id"]][row["step_index"]] = row
    return found


def stage_corrections(out: str | Path, staging: str | Path, *, recipe: Recipe, commit: int,
                      manifests: Sequence[Any], tokenizer: Any | None, tokenizer_name: str = "") -> dict[str, int]:
    """Turn the corrections of the commit's staged feedback file into staged ``corrections/`` samples.

    The corrected step's prompt is its exact model input, rebuilt from the
    recorded steps of its episode (:func:`rollout.context.model_input_of`:
    observation and action ids of steps ``0..K``, the step's context cut
    applied), looked up in this commit's staged ``steps/`` files and held
    parts, then in the version's committed ones. The target is the correction
    tokenized by the policy's tokenizer without special tokens, plus its
    end-of-sequence token (a generated action ends with it when the model
    stopped). Rows: :class:`schemas.feedback.CorrectionRow`, one file per
    domain, ``corrections/recipe=V/domain=D/c<n>.parquet``.

    A correction is *unresolved* (counted, logged, kept in ``feedback/`` only)
    when no tokenizer is given, when it names no step, or when its step is in
    no steps row of the version (the episode is not written yet, was written
    incomplete, or its step was clipped): a new version built from the archive
    resolves it once the episode is in it.

    Args:
        out: the dataset root.
        staging: ``<out>/_staging/<version>/<commit>``.
        recipe: the recipe (names the version).
        commit: the commit number.
        manifests: the version's earlier commits.
        tokenizer: a ``transformers`` tokenizer (:func:`load_correction_tokenizer`), or None.
        tokenizer_name: recorded in each row (the model directory).

    Returns:
        ``{"corrections": written, "corrections_unresolved": n}``.
    """
    from rollout.context import model_input_of

    staging = str(staging)
    fb_file = loc.join(staging, feedback_path(recipe.version, commit) + _STAGED_SUFFIX)
    counts = {"corrections": 0, "corrections_unresolved": 0}
    if not loc.is_file(fb_file):
        return counts
    fb = loc.read_parquet(fb_file).filter(pads.field("correction").is_valid()).to_pylist()
    if not fb:
        return counts
    if tokenizer is None:
        _LOG.warning("%d corrections not turned into samples: no --tokenizer given", len(fb))
        counts["corrections_unresolved"] = len(fb)
        return counts
    root = str(out)
    held_staged = loc.list_files(staging, suffix=".steps.arrow" + _STAGED_SUFFIX)
    files = loc.list_files(loc.join(staging, "steps"), suffix=".parquet" + _STAGED_SUFFIX) + held_staged
    files += [loc.join(root, f.path) for m in manifests for f in m.files if f.path.startswith("steps/")]
    if manifests and manifests[-1].held_parts and not held_staged:
        files += [loc.join(root, f"{base}.steps.arrow") for base in manifests[-1].held_parts]
    steps = _steps_of([f for f in files if loc.is_file(f)], {r["episode_id"] for r in fb})
    eos = tokenizer.eos_token_id
    by_domain: dict[str, list[CorrectionRow]] = defaultdict(list)
    for r in fb:
        ep = steps.get(r["episode_id"], {})
        k = r["target_step"]
        if k is None or k not in ep or any(i not in ep for i in range(k)):
            _LOG.warning("correction %s of episode %s step %s: the step is in no steps row of %s yet; kept in "
                         "feedback/ only", r["event_id"], r["episode_id"], k, recipe.version)
            counts["corrections_unresolved"] += 1
            continue
        row = ep[k]
        prompt = model_input_of([ep[i]["observation_token_ids"] for i in range(k + 1)],
                                [ep[i]["action_token_ids"] for i in range(k + 1)], step=k,
                                cut_start=row["context_cut_start"], cut_tokens=row["context_cut_tokens"])
        if not prompt:
            _LOG.warning("correction %s: episode %s recorded no context ids (a rollout without a tokenizer); "
                         "kept in feedback/ only", r["event_id"], r["episode_id"])
            counts["corrections_unresolved"] += 1
            continue
        target = list(tokenizer(r["correction"], add_special_tokens=False)["input_ids"])
        if eos is not None:
            target.append(int(eos))
        by_domain[r["domain"]].append(CorrectionRow(
            episode_id=f"{r['episode_id']}/correction/{r['event_id']}", step_index=0, event_id=r["event_id"],
            domain=r["domain"], recipe=recipe.version, recipe_hash=recipe.content_hash, task_id=row["task_id"],
            task_group=row["task_group"], policy_version=row["policy_version"], status="correction", num_steps=1,
            observation_token_ids=np.asarray(prompt, dtype=np.int32),
            action_token_ids=np.asarray(target, dtype=np.int32), observation_tokens=len(prompt),
            action_tokens=len(target), context_tokens=len(prompt), behaviour_logprobs=np.zeros(0, dtype=np.float32),
            temperature=row["temperature"], top_p=row["top_p"], top_k=row["top_k"], context_cut_start=0,
            context_cut_tokens=0, policy_lineage=row["policy_lineage"], trainable=True,
            loss_mask=[True] * len(target), reward=1.0, return_to_go=1.0, advantage=1.0, normalized_advantage=1.0,
            group_advantage=1.0, group_size=1, verifications=[], verification_score=0.0, verifier_disagreements=0,
            clipped=False, event_time=r["event_time"], target_episode_id=r["episode_id"], target_step=k,
            source=r["source"], correction=r["correction"],
            original_action_token_ids=[int(t) for t in row["action_token_ids"]], tokenizer=tokenizer_name,
        ))
    for domain, rows in sorted(by_domain.items()):
        rows.sort(key=lambda c: c.episode_id)
        rel = f"corrections/recipe={recipe.version}/domain={domain}/c{commit:08d}.parquet"
        _write_parquet(_rows_table(rows, correction_file_schema()), loc.join(staging, rel + _STAGED_SUFFIX))
        counts["corrections"] += len(rows)
    return counts


class _SplitFeedbackFn(beam.DoFn):
    def __init__(self) -> None:
        self._dups = Metrics.counter(METRICS_NAMESPACE, "duplicates")

    def process(self, fragment: tuple[str, list[Event]]) -> Iterator[Any]:
        episode_id, events = fragment
        rest, feedback, dups = split_feedback(events)
        self._dups.inc(dups)
        if rest:
            yield episode_id, rest
        for fb in feedback:
            yield beam.pvalue.TaggedOutput(FEEDBACK_TAG, (fb, False))


class SplitFeedback(beam.PTransform):
    """``(episode_id, events)`` fragments → the same without feedback (main) and ``(Feedback, False)`` on ``feedback``.

    The streaming job's split (:func:`split_feedback` before the stateful assembler): there feedback is
    written to the pane's ``feedback/`` file (and corrections) but never attached to an episode, so a
    stream's rewards never include it; a batch rebuild from the archive applies it (docs/feedback.md).
    """

    def expand(self, fragments):
        return fragments | "SplitFeedback" >> beam.ParDo(_SplitFeedbackFn()).with_output_types(
            tuple[str, list[Event]]).with_outputs(FEEDBACK_TAG, main="fragments")
