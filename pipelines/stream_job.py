"""The streaming trajectory job: follow the Kafka topic, one dataset commit per event-time window pane.

Reads the ``events`` topic from the offsets the last commit covers, on a streaming
runner, until cancelled (or ``--stop-after-s``, ``--stop-at-end``, ``--stop-file``),
and commits each event-time window pane as one dataset commit (pipelines/stream_commit.py);
episodes still open when the stream stops are committed as pending state and fed back
on the next start. Same transforms as the batch job (:mod:`pipelines.batch_job`);
semantics in docs/pipelines.md, "Streaming mode"::

    python -m pipelines.stream_job --source kafka --bootstrap 127.0.0.1:9092 --out data/datasets \\
        --runner PrismRunner --window-s 10 --incomplete-after 600
    trajpipe pipeline run --source kafka --bootstrap 127.0.0.1:9092 --out data/datasets --mode stream

or on an S3-compatible store (the AWS variables of docs/storage.md in the driver's and
the workers' environment)::

    python -m pipelines.stream_job --source kafka --bootstrap 127.0.0.1:9092 --out s3://bucket/datasets \\
        --runner PrismRunner --window-s 10

The options and the counts (plus ``commits``) printed as the last line: the entry point
both jobs are run through, :mod:`pipelines.trajectory_job` (``trajpipe pipeline run``);
the options are parsed in :mod:`pipelines.job_args`.
"""

from __future__ import annotations

import json
import logging
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import List, Tuple

import apache_beam as beam
from apache_beam.options.pipeline_options import PipelineOptions

from pipelines.assemble import INCOMPLETE_TAG, PENDING_TAG
from pipelines.commit import DatasetLayout, covered_offsets, latest_pending_file, read_manifests, recover
from pipelines.committed import CommittedView
from pipelines.decode import DecodeAndValidate
from pipelines.evaluations import EVAL_TAG, SplitEvaluations
from pipelines.feedback import FEEDBACK_TAG, SplitFeedback
from pipelines.groups import DEFAULT_GROUP_TIMEOUT_S
from pipelines.inputs import KafkaInput
from pipelines.job_args import DEFAULT_MAX_FUTURE_S, PreparedJob, prepare, stream_options
from pipelines.job_counts import check_accounted, counts_from_metrics
from pipelines.late import DEFAULT_LATE_RETENTION_S, LATE_TAG
from pipelines.process import ProcessEpisodes
from pipelines.recipes import Recipe
from pipelines.types import DEAD_LETTER_TAG, METRICS_NAMESPACE
from schemas import locations as loc
from schemas.events import Event
from streams.config import KafkaConnection, Topics

__all__ = ["run", "run_prepared", "run_stream"]

_LOG = logging.getLogger(__name__)


class _SkipCommittedFn(beam.DoFn):
    """Drop fragments of episodes an earlier run emitted complete or holds (replayed input): duplicates.

    Fragments of episodes written only as incomplete go on: their events are late (the assembler's job).
    The emitted ids are read from the dataset in ``setup`` (:class:`pipelines.committed.CommittedView`).
    """

    def __init__(self, committed: CommittedView) -> None:
        self._view = committed
        self._committed: frozenset[str] = frozenset()
        self._dups = beam.metrics.Metrics.counter(METRICS_NAMESPACE, "duplicates")

    def setup(self) -> None:
        self._committed = self._view.load().emitted

    def process(self, fragment: tuple[str, list[Event]]):
        if fragment[0] in self._committed:
            self._dups.inc(len(fragment[1]))
            return
        yield fragment


def _load_pending(path: str | None, committed: set[str]) -> list[tuple[str, list[Event]]]:
    """Fragments of the pending-state file, minus episodes committed since it was written."""
    if path is None:
        return []
    from pipelines.archive_source import table_to_fragments

    frags, _ = table_to_fragments(loc.read_feather(path))
    return [f for f in frags if f[0] not in committed]


class _StampPendingFn(beam.DoFn):
    """Pending fragments restart their idle clock at job start (their old Kafka times are gone)."""

    def __init__(self, at_s: float) -> None:
        self._at_s = at_s
        self._n = beam.metrics.Metrics.counter(METRICS_NAMESPACE, "events_pending_in")

    def process(self, fragment: tuple[str, list[Event]]):
        self._n.inc(len(fragment[1]))
        yield beam.window.TimestampedValue(fragment, self._at_s)


def run_stream(
    *,
    out: str | Path,
    recipe: Recipe,
    input: KafkaInput,
    options: PipelineOptions,
    window_s: float = 10.0,
    allowed_lateness_s: float = 3600.0,
    incomplete_after_s: float = 3600.0,
    idle_watermark_lag_s: float = 10.0,
    stop_after_s: float | None = None,
    stop_offsets: dict[int, int] | None = None,
    stop_at_end: bool = False,
    stop_file: str | Path | None = None,
    shards: int = 1,
    group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    late_retention_s: float = DEFAULT_LATE_RETENTION_S,
    max_future_s: float = DEFAULT_MAX_FUTURE_S,
    use_domain_verifiers: bool = True,
    tokenizer: str | None = None,
) -> dict[str, int]:
    """The streaming job: follow the topic, commit one dataset commit per event-time window pane.

    Same transforms as :func:`run_batch` (decode → dedupe/assemble → verify →
    rewards → clip → normalize → write); the source is
    :class:`~pipelines.sources_kafka.ReadKafkaStream` started at the offsets the
    manifests cover (:func:`pipelines.commit.covered_offsets`), the assembler is
    :class:`~pipelines.assemble.AssembleEpisodesStreaming`, and each window pane
    is committed by :class:`~pipelines.stream_commit.CommitWindows`. Episodes
    still open when a stop condition ends the stream are committed as pending
    state and fed back on the next start. Blocks until the job ends (a stop
    condition, or cancellation).

    Args:
        out: dataset root.
        recipe: the reward recipe.
        input: the topic to follow (its commits' manifests have ``source`` ``kafka``).
        options: Beam options with ``streaming`` set (:func:`pipelines.runners.runner_options`); runner
            splits are turned off in them (:func:`pipelines.runners.disable_runner_splits`).
        window_s: event-time window per commit, seconds.
        allowed_lateness_s: late elements this long after a window's end still get a late commit.
        incomplete_after_s: idle event time before an unfinished episode is emitted as incomplete.
        idle_watermark_lag_s: a caught-up partition's watermark trails the wall clock by this much.
        stop_after_s: stop reading after this much wall time (None: run until cancelled).
        stop_offsets: stop each partition at this offset (tests); partitions not named stop at once.
        stop_at_end: stop each partition at its end offset at start (overrides ``stop_offsets``); the source
            then never runs ahead of the records, so an idle timer due after the start fires only because the
            stream ended: its episode is pending, not incomplete, however long the run takes.
        stop_file: stop reading once this path exists; an idle timer due later than the wall clock minus
            ``idle_watermark_lag_s`` when it fires then means "input ended" (pending, not incomplete).
        shards: files per (table, domain) per commit.
        group_timeout_s: event-time seconds a GRPO group waits for missing members.
        late_retention_s: event-time seconds an incomplete episode's events are kept for late events.
        max_future_s: a record time or event time more than this ahead of the wall clock is future:
            counted (``future_events``); a record time is clamped to it before it can move a watermark.
        use_domain_verifiers: run ``rollout.verifiers`` in VerifySteps.
        tokenizer: model directory whose tokenizer turns corrections into samples (pipelines/feedback.py);
            feedback in a stream is written to ``feedback/`` but never applied to rewards (docs/feedback.md).

    Returns:
        The job's counts (keys :data:`COUNT_KEYS`: from the pipeline's metrics; ``steps``, ``groups_held``
        and ``episodes_held`` from this run's manifests) plus ``commits`` and ``events_uncommitted``: events
        the assembler counted in an outcome that none of this run's commits holds (0 unless the runner
        dropped them on the way, e.g. later than ``allowed_lateness_s`` at the window commit; logged).
    """
    from pipelines.assemble import AssembleEpisodesStreaming
    from pipelines.runners import disable_runner_splits
    from pipelines.sources_kafka import ReadKafkaStream
    from pipelines.stream_commit import CommitPending, CommitWindows, batch_offsets, made_by_job
    from streams.consumer import end_offsets

    # The assembler keeps each episode's events in keyed state: a runner split of its bundles loses some
    # on Prism (a finished episode goes out incomplete, its group stays held, the counts do not reconcile).
    disable_runner_splits(options)
    layout = DatasetLayout(out=str(out), version=recipe.version, recipe_hash=recipe.content_hash)
    fixed = recover(layout)
    manifests = read_manifests(layout)
    # On an object store this job's commits are staged as `<n>-<job><pane><attempt>`: another run's commits made
    # meanwhile (a pane whose commit the log refused was planned again on top of it) are not ours.
    job = uuid.uuid4().hex[:8] if layout.remote else ""
    topic = input.topic
    start = covered_offsets(manifests, topic)
    # The workers read the committed episodes and the late state from the dataset (pipelines/committed.py):
    # the graph carries the reference, not the sets. The driver reads them too (once, cached) to drop
    # the pending fragments of episodes committed since (the pending state is bounded by open episodes).
    committed = CommittedView.of(layout, manifests, late_retention_s=late_retention_s)
    state = committed.load()
    pending = _load_pending(latest_pending_file(layout, manifests), state.emitted | state.incomplete)
    if stop_at_end:
        stop_offsets = end_offsets(input.conn, topic)
    started = time.time()
    # A timer due after the stop (minus the idle lag) can only fire because the stream ended. Stopping at the
    # end offsets, the watermark follows the records (all written before the start), never the idle clock.
    end_of_input_s = started if stop_at_end else (started + stop_after_s - idle_watermark_lag_s if stop_after_s
                                                  else None)
    _LOG.info("stream of %s from %s: start offsets %s, %d pending episodes, %d committed, %d kept incomplete, "
              "recovered %s", topic, recipe.version, start, len(pending), len(state.emitted | state.incomplete),
              len(state.late.stored), fixed)

    p = beam.Pipeline(options=options)
    batches = p | "ReadKafkaStream" >> ReadKafkaStream(
        input.conn, topic, start_offsets=start, idle_watermark_lag_s=idle_watermark_lag_s,
        stop_after_s=stop_after_s, stop_offsets=stop_offsets, max_future_s=max_future_s,
        stop_file=str(stop_file) if stop_file else None)
    decoded = batches | "DecodeAndValidate" >> DecodeAndValidate(max_future_s=max_future_s)
    pending_in = (p | "PendingState" >> beam.Create(pending, reshuffle=False)
                  | "StampPending" >> beam.ParDo(_StampPendingFn(started)).with_output_types(Tuple[str, List[Event]]))
    fb_split = (decoded.fragments, pending_in) | "AllFragments" >> beam.Flatten() | "Feedback" >> SplitFeedback()
    assembled = (
        fb_split.fragments
        | "SkipCommitted" >> beam.ParDo(_SkipCommittedFn(committed)).with_output_types(
            Tuple[str, List[Event]])
        | "AssembleEpisodes" >> AssembleEpisodesStreaming(incomplete_after_s=incomplete_after_s,
                                                         end_of_input_s=end_of_input_s, committed=committed,
                                                         late_retention_s=late_retention_s,
                                                         end_of_input_lag_s=idle_watermark_lag_s if stop_file
                                                         else None)
    )
    split = assembled.episodes | "SplitEvaluations" >> SplitEvaluations()
    incomplete = assembled[INCOMPLETE_TAG] | "SplitIncompleteEvaluations" >> SplitEvaluations(counter=None)
    episodes = split.train | "Process" >> ProcessEpisodes(recipe, use_domain_verifiers=use_domain_verifiers)
    evaluations = (split[EVAL_TAG], incomplete[EVAL_TAG]) | "AllEvaluations" >> beam.Flatten()
    dead = (decoded[DEAD_LETTER_TAG], assembled[DEAD_LETTER_TAG]) | "AllDeadLetters" >> beam.Flatten()
    _ = {
        "episodes": episodes, "incomplete": incomplete.train, "dead_letters": dead, "evaluations": evaluations,
        "late": assembled[LATE_TAG], "offsets": batches | "BatchOffsets" >> beam.Map(batch_offsets),
        "feedback": fb_split[FEEDBACK_TAG],
    } | "CommitWindows" >> CommitWindows(out, recipe, topic=topic, window_s=window_s,
                                         allowed_lateness_s=allowed_lateness_s, shards=shards,
                                         group_timeout_s=group_timeout_s, late_retention_s=late_retention_s,
                                         max_future_s=max_future_s, tokenizer=tokenizer, job=job)
    _ = assembled[PENDING_TAG] | "CommitPending" >> CommitPending(out, recipe, topic=topic,
                                                                  late_retention_s=late_retention_s, job=job)
    result = p.run()
    result.wait_until_finish()
    counts, _ = counts_from_metrics(result)
    ours = [m for m in read_manifests(layout)[len(manifests):] if not job or made_by_job(m, job)]
    # Steps are counted where they are written, in this run's manifests: a metric bumped by the writer
    # of the last pane is not always reported before Prism ends the job.
    counts["steps"] = sum(m.counts.get("steps", 0) for m in ours)
    # What is held after the run is what the last commit that decided groups held (a sum over panes is not).
    deciding = [m for m in ours if m.groups_file is not None]
    for key in ("groups_held", "episodes_held"):
        counts[key] = deciding[-1].counts.get(key, 0) if deciding else 0
    counts["commits"] = len(ours)
    # An outcome's events are written by a commit, unless the runner dropped them between the assembler and
    # the window commit (later than allowed_lateness_s): counted, not silent.
    outcomes = ("events_used", "events_incomplete", "events_pending_out", "late_events", "dead_letters",
                "feedback_events")
    for key in ("corrections", "corrections_unresolved"):  # made by the pane writers: in the manifests only
        counts[key] = sum(m.counts.get(key, 0) for m in ours)
    counts["events_uncommitted"] = sum(counts[k] - sum(m.counts.get(k, 0) for m in ours) for k in outcomes)
    if counts["events_uncommitted"]:
        _LOG.error("%d events the assembler counted are in no commit of this run (dropped by the runner later "
                   "than --allowed-lateness-s %s?): %s", counts["events_uncommitted"], allowed_lateness_s,
                   json.dumps(counts))
    check_accounted(counts)
    return counts



def run(argv: Sequence[str] | None = None, *, conn: KafkaConnection | None = None,
        default_topic: str = Topics().events) -> dict[str, int]:
    """Parse the command line (``--mode stream``, the default here), run the stream until it stops, return the counts.

    Args: as :func:`pipelines.job_args.prepare`.

    Raises:
        JobError: missing or incompatible options.
        RecipeError: an unknown or invalid recipe.
    """
    return run_prepared(prepare(argv, conn=conn, default_topic=default_topic, mode="stream"))


def run_prepared(job: PreparedJob) -> dict[str, int]:
    """Run the streaming job of a prepared command line until it stops; return its counts (plus ``commits``)."""
    args = job.args
    options = stream_options(args, job.beam_args)
    return run_stream(
        out=args.out, recipe=job.recipe, input=job.input, options=options,
        window_s=args.window_s, allowed_lateness_s=args.allowed_lateness_s,
        incomplete_after_s=args.incomplete_after, idle_watermark_lag_s=args.idle_watermark_lag_s,
        stop_after_s=args.stop_after_s, stop_at_end=args.stop_at_end, stop_file=args.stop_file,
        shards=args.shards, group_timeout_s=args.group_timeout,
        late_retention_s=args.late_retention, max_future_s=args.max_future_s,
        use_domain_verifiers=not args.no_domain_verifiers, tokenizer=args.tokenizer,
    )


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(json.dumps(run()), flush=True)
