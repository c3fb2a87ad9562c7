"""The trajectory job: event log → verified, reward-annotated, versioned Parquet datasets.

Reads the events of the Kafka ``events`` topic (a bounded offset range: from the
last commit's end offsets to the end offsets at job start) or of an event
archive (the archive commits no earlier dataset commit covers), plus the
pending events of unfinished episodes carried over from the last commit, and
writes one dataset commit (docs/pipelines.md)::

    decode/read → dedupe → assemble episodes → verify steps → process rewards
    → clip trajectories → normalize by domain → <out>/steps, <out>/trajectories
                       └→ evaluation episodes (purpose eval) → <out>/evaluations

Run locally (FnApiRunner, the default for batch)::

    python -m pipelines.trajectory_job --source archive --archive data/archive --out data/datasets
    python -m pipelines.trajectory_job --source kafka --bootstrap 127.0.0.1:9092 --out data/datasets \\
        --recipe pipelines/recipes/shaped.yaml --loop 60
    trajpipe pipeline run --source archive --archive data/archive --out data/datasets

Streaming (``--mode stream``, Kafka only): follow the topic on a streaming
runner, one dataset commit per event-time window pane, until cancelled (or
``--stop-after-s``, ``--stop-at-end``, ``--stop-file``); semantics in docs/pipelines.md, "Streaming mode"::

    python -m pipelines.trajectory_job --source kafka --bootstrap 127.0.0.1:9092 --out data/datasets \\
        --mode stream --runner PrismRunner --window-s 10 --incomplete-after 600

On a cluster, name the runner and pass its options through (every option this
module does not know goes to Beam's ``PipelineOptions``); ``--out`` must be a
filesystem the workers and the driver share::

    python -m pipelines.trajectory_job --source archive --archive /shared/archive --out /shared/datasets \\
        --runner FlinkRunner --flink_master flink:8081 --environment_type DOCKER

or an S3-compatible store, which the workers write to directly (the AWS variables of
docs/storage.md in the driver's and the workers' environment), in either mode::

    python -m pipelines.trajectory_job --source kafka --bootstrap 127.0.0.1:9092 --out s3://bucket/datasets
    python -m pipelines.trajectory_job --source kafka --bootstrap 127.0.0.1:9092 --out s3://bucket/datasets \\
        --mode stream --runner PrismRunner --window-s 10

GRPO groups whose members have not all arrived are held (not written) until
they have, or for ``--group-timeout`` seconds of event time (pipelines/groups.py)::

    python -m pipelines.trajectory_job --source kafka --bootstrap 127.0.0.1:9092 --out data/datasets \
        --recipe grpo.yaml --group-timeout 600 --loop 60

Events of an episode a commit wrote as incomplete are *late*: kept events of
such episodes (``--late-retention`` seconds of event time, default 7 days) are
completed by them when they can (pipelines/late.py); event times more than
``--max-future-s`` (default 300) ahead of the processing time are *future*:
counted, used, never on the event-time clock::

    python -m pipelines.trajectory_job --source archive --archive data/archive --out data/datasets \
        --incomplete-after 600 --late-retention 86400 --max-future-s 120

The last line printed is one JSON object of counts (stream mode adds
``commits``), which reconcile as
``events_in + events_pending_in == events_used + events_incomplete
+ events_pending_out + dead_letters + duplicates + late_events + feedback_events``
(``feedback_events``: feedback rows written, pipelines/feedback.py; ``corrections`` and
``corrections_unresolved`` count what became of the corrections among them) (held groups are events
already used, held as rows: ``groups_held``/``episodes_held`` are what is held
after the run, ``groups_released`` what it wrote, ``episodes_excluded`` the
complete episodes it found untrainable; ``episodes_completed_late`` and
``future_events`` are outside the sum). ``evaluations`` counts the complete
evaluation episodes (``purpose = "eval"``) written to ``evaluations/``; they
are among ``episodes`` and their events among ``events_used``. A batch run's
counts come from what it staged (count files and the staged files' footers,
pipelines/counts.py), not from the runner's metrics; what earlier commits hold
(emitted episodes, the late state, feedback ids) is read by the workers from
the dataset (pipelines/committed.py), so the job graph does not grow with the
dataset's history.
"""

from __future__ import annotations

import argparse
import json
import os
import logging
import time
import uuid
from collections.abc import Sequence
from pathlib import Path
from typing import Any, List, NoReturn, Tuple

import apache_beam as beam
import msgspec
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions
from kafka.errors import KafkaError

from pipelines.archive_source import FRAMES_TAG, ArchiveFile, ReadArchiveEpisodes, list_archive_files, split_episode_ids
from pipelines.assemble import EVENT_TIME_METRIC, INCOMPLETE_TAG, PENDING_TAG
from pipelines.late import DEFAULT_LATE_RETENTION_S, LATE_TAG
from pipelines.clip import ClipTrajectories
from pipelines.commit import (
    CommitConflict,
    DatasetLayout,
    DatasetManifest,
    carry_late_state,
    commit_lock,
    commit_staged,
    covered_offsets,
    latest_pending_file,
    load_held_state,
    load_prior_norm,
    read_manifests,
    recover,
)
from pipelines.committed import CommittedView
from pipelines.counts import COUNTS_TAG, StageCounts, read_staged_counts
from pipelines.decode import DecodeAndValidate
from pipelines.evaluations import EVAL_TAG, SplitEvaluations
from pipelines.frames import (
    CLOCK_TAG,
    UNDECIDED_TAG,
    AssembleEpisodesFromFrames,
    EventsToFrames,
    KeyFrames,
    shuffle_buckets,
)
from pipelines.feedback import (
    FEEDBACK_TAG,
    CorrectionError,
    SplitFeedback,
    WriteFeedback,
    load_correction_tokenizer,
    stage_corrections,
)
from pipelines.groups import DEFAULT_GROUP_TIMEOUT_S
from pipelines.recipes import Recipe, load_recipe
from pipelines.rewards import ComputeProcessRewards
from pipelines.sinks import STAGED_SUFFIX, WriteDatasets
from pipelines import testhooks
from pipelines.types import DEAD_LETTER_TAG, METRICS_NAMESPACE, RawRecords
from pipelines.verify import VerifySteps
from schemas.events import Event
from schemas import locations as loc
from schemas.locations import filesystem, is_remote
from schemas.storage import StorageError, local_path, scheme_of
from streams.config import KafkaConnection, Topics
from streams.errors import KafkaUnavailable, check_kafka, kafka_access_errors
from streams.consumer import StreamTimeoutError

__all__ = ["run", "run_batch", "run_stream", "processing_time_s", "JobError", "COUNT_KEYS", "DEFAULT_MAX_FUTURE_S"]

_LOG = logging.getLogger(__name__)

#: Keys of the counts dict, in print order (the first five are the contract).
COUNT_KEYS = (
    "events_in", "episodes", "steps", "dead_letters", "duplicates",
    "events_used", "events_incomplete", "events_pending_in", "events_pending_out",
    "incomplete_episodes", "pending_episodes",
    "groups_released", "groups_held", "groups_timed_out", "episodes_held", "episodes_excluded",
    "late_events", "episodes_completed_late", "future_events", "evaluations",
    "feedback_events", "corrections", "corrections_unresolved",
)
_METRIC_FOR = {
    "events_in": "events_in", "episodes": "episodes_complete", "steps": "steps_written",
    "dead_letters": "dead_letters", "duplicates": "duplicates", "events_used": "events_used",
    "events_incomplete": "events_incomplete", "events_pending_in": "events_pending_in",
    "events_pending_out": "events_pending_out", "incomplete_episodes": "episodes_incomplete",
    "pending_episodes": "episodes_pending", "groups_released": "groups_released", "groups_held": "groups_held",
    "groups_timed_out": "groups_timed_out", "episodes_held": "episodes_held",
    "episodes_excluded": "episodes_excluded", "late_events": "late_events",
    "episodes_completed_late": "episodes_completed_late", "future_events": "future_events",
    "evaluations": "evaluations",
    "feedback_events": "feedback_events", "corrections": "corrections", "corrections_unresolved":
    "corrections_unresolved",
}
#: Seconds an event time may run ahead of the processing time before it is *future* (``--max-future-s``).
DEFAULT_MAX_FUTURE_S = 300.0


class JobError(ValueError):
    """Incompatible or missing options; the message names the option and the fix."""


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that raises :class:`JobError` (one line for the CLI) instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise JobError(f"{message} (see `trajpipe pipeline run --help`)")


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = _ArgumentParser(prog="trajectory_job", description=__doc__.split("\n")[0])
    parser.add_argument("--source", choices=("kafka", "archive"), required=True)
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (--source kafka)")
    parser.add_argument("--topic", default=None, help="events topic (default: settings' topics.events)")
    parser.add_argument("--archive", help="event archive directory (--source archive)")
    parser.add_argument("--out", required=True, help="dataset root: a directory, or s3://BUCKET/PREFIX")
    parser.add_argument("--mode", choices=("batch", "stream"), default="batch")
    parser.add_argument("--recipe", default="outcome", help="builtin recipe name or YAML file")
    parser.add_argument("--runner", default=None, help="Beam runner (default FnApiRunner for batch)")
    parser.add_argument("--loop", type=float, default=0.0, help="repeat a micro-batch every SECONDS (0: once)")
    parser.add_argument("--incomplete-after", type=float, default=3600.0,
                        help="event-time seconds without news after which an unfinished episode is incomplete")
    parser.add_argument("--shards", type=int, default=1, help="files per table and domain per commit")
    parser.add_argument("--group-timeout", type=float, default=DEFAULT_GROUP_TIMEOUT_S, metavar="SECONDS",
                        help="event-time seconds a GRPO group whose members have not all arrived is held before it "
                             "is written with the members it has")
    parser.add_argument("--late-retention", type=float, default=DEFAULT_LATE_RETENTION_S, metavar="SECONDS",
                        help="event-time seconds after its last event that an incomplete episode's events are kept, "
                             "so late events can complete it (0: keep none)")
    parser.add_argument("--max-future-s", type=float, default=DEFAULT_MAX_FUTURE_S, metavar="SECONDS",
                        help="event times more than this ahead of the processing time are future: counted "
                             "(future_events) and used, never on the event-time clock")
    parser.add_argument("--tokenizer", default=None, metavar="MODEL_DIR",
                        help="model directory of the policy whose tokenizer turns feedback corrections into "
                             "supervised samples (corrections/; docs/feedback.md); without it they stay in feedback/")
    parser.add_argument("--no-domain-verifiers", action="store_true",
                        help="do not re-run rollout.verifiers (keep the rollout-time verdicts and the generic checks)")
    stream = parser.add_argument_group("--mode stream")
    stream.add_argument("--window-s", type=float, default=10.0, help="event-time window per commit, seconds")
    stream.add_argument("--allowed-lateness-s", type=float, default=3600.0,
                        help="late elements within this many seconds after a window's end get a late commit")
    stream.add_argument("--idle-watermark-lag-s", type=float, default=10.0,
                        help="a caught-up partition's watermark trails the wall clock by this much")
    stream.add_argument("--stop-after-s", type=float, default=None,
                        help="stop reading after SECONDS of wall time and finish (demos); default: run "
                             "until cancelled")
    stream.add_argument("--stop-at-end", action="store_true",
                        help="stop each partition at its end offset at job start and finish (catch-up runs, tests); "
                             "episodes still open then are carried as pending, whatever the machine's speed")
    stream.add_argument("--stop-file", default=None, metavar="PATH",
                        help="stop reading once PATH exists and finish (a condition decided outside the job); "
                             "episodes still open then are carried as pending")
    return parser.parse_known_args(argv)


def _check(args: argparse.Namespace) -> None:
    # First, before any Kafka read or manifest. Both modes write `--out` through schemas.locations (a local
    # directory or s3://); a batch run reads `--archive` through it too, the streaming job's archive reader is local.
    remote_archive = args.mode != "stream" and args.archive and scheme_of(args.archive) == "s3"
    local_flags = () if remote_archive else ("archive",)
    if remote_archive:
        try:
            filesystem(args.archive)  # a bucket is named, the AWS_* settings parse
        except StorageError as err:
            raise JobError(f"`--archive` {err} (see `trajpipe pipeline run --help`)") from err
        args.archive = args.archive.rstrip("/")
    for flag in local_flags:
        if getattr(args, flag):
            try:
                setattr(args, flag, str(local_path(getattr(args, flag), flag=f"--{flag}")))
            except StorageError as err:
                raise JobError(f"{err} (see `trajpipe pipeline run --help`)") from err
    if args.out:
        try:
            filesystem(args.out)  # refuses gs://, az://, ... naming the scheme
        except StorageError as err:
            raise JobError(f"`--out` {err} (see `trajpipe pipeline run --help`)") from err
        if not is_remote(args.out):
            args.out = str(local_path(args.out, flag="--out"))
    if args.mode == "stream":
        runner = args.runner or "PrismRunner"
        if runner in ("FnApiRunner", "DirectRunner", "BundleBasedDirectRunner"):
            raise JobError(
                f"`--runner` {runner} cannot run --mode stream (no unbounded sources, watermarks or timers); use "
                "--runner PrismRunner locally (--prism_location <prism binary>), or FlinkRunner/DataflowRunner"
            )
        if args.source != "kafka":
            raise JobError("`--mode stream` reads Kafka: use --source kafka (an archive is read in --mode batch)")
        if args.loop:
            raise JobError("`--loop` is for --mode batch; a stream runs until cancelled or --stop-after-s")
        if args.window_s <= 0 or args.allowed_lateness_s < 0 or args.idle_watermark_lag_s < 0:
            raise JobError("`--window-s` must be > 0, `--allowed-lateness-s` and `--idle-watermark-lag-s` >= 0")
        if args.stop_after_s is not None and args.stop_after_s <= 0:
            raise JobError(f"`--stop-after-s` must be > 0, got {args.stop_after_s}")
    elif args.stop_at_end or args.stop_file:
        raise JobError("`--stop-at-end` and `--stop-file` stop a --mode stream job; a batch run always stops at the "
                       "end offsets it saw at start")
    if args.source == "archive" and not args.archive:
        raise JobError("`--archive` is required with --source archive")
    if not is_remote(args.out) and os.path.exists(args.out) and not os.path.isdir(args.out):
        raise JobError(f"`--out` {args.out} is a file, not a directory; give the dataset root directory")
    if args.source == "kafka" and not args.bootstrap:
        raise JobError("`--bootstrap` is required with --source kafka")
    if args.loop < 0 or args.incomplete_after < 0 or args.shards < 1:
        raise JobError("`--loop` and `--incomplete-after` must be >= 0 and `--shards` >= 1")
    if args.group_timeout < 0:
        raise JobError(f"`--group-timeout` must be >= 0 seconds (0 writes incomplete groups at once), "
                       f"got {args.group_timeout}")
    if args.late_retention < 0 or args.max_future_s < 0:
        raise JobError(f"`--late-retention` ({args.late_retention}) and `--max-future-s` ({args.max_future_s}) "
                       "must be >= 0 seconds")


def _check_out_readable(out: str) -> None:
    """An object-store ``--out`` the credentials cannot read ends the run with one line, before any Kafka read."""
    if not is_remote(out):
        return
    try:
        loc.list_dir(out)
    except OSError as err:
        raise JobError(f"`--out` {out} cannot be read: {' '.join(str(err).split())}; check the bucket and the AWS_* "
                       "variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)") from err


def _options(args: argparse.Namespace, beam_args: list[str]) -> PipelineOptions:
    runner = args.runner or "FnApiRunner"
    if runner == "FnApiRunner":
        opts = PipelineOptions(beam_args)
        opts.view_as(StandardOptions).runner = runner
        return opts
    from pipelines.runners import RunnerConfigError, runner_options

    try:  # the runner's defaults (job server jar, Prism binary) and its option checks, as in stream mode
        return runner_options(runner, "batch", beam_args)
    except RunnerConfigError as err:
        raise JobError(str(err)) from err


def _check_flink_master(master: str) -> None:
    """A Flink cluster that does not answer ends the run here, in seconds, not after the job server's retries."""
    from pipelines.flink_cluster import FlinkClusterError, probe_rest

    try:
        probe_rest(master, "/overview", timeout_s=10.0)
    except FlinkClusterError as err:
        raise JobError(f"`--flink_master` {master}: {err}; start a session cluster (`trajpipe flink-cluster up`) "
                       "or give a running JobManager's REST address (host:8081)") from err


def _flink_job_failed(master: str, err: RuntimeError) -> JobError:
    """The one-line error of a job that failed on a Flink cluster: whether the cluster still answers, and why."""
    from pipelines.flink_cluster import FlinkClusterError, probe_rest

    try:
        probe_rest(master, "/overview", timeout_s=5.0)
        state = "the cluster is up; its JobManager log and REST /jobs/<id>/exceptions have the details"
    except FlinkClusterError:
        state = "the cluster no longer answers"
    first = next((line.strip() for line in str(err).splitlines() if line.strip()), type(err).__name__)
    # Beam stops the job server at interpreter exit and logs that as a WARNING, which would follow this error's
    # line on stderr; the stop itself still happens.
    logging.getLogger("apache_beam.utils.subprocess_server").setLevel(logging.ERROR)
    return JobError(f"the job failed on the Flink cluster at {master} ({state}); nothing was committed: {first[:500]}")


def _make_runner(name: str):
    # Named explicitly: the default DirectRunner may try to download Prism.
    if name == "FnApiRunner":
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        return FnApiRunner()
    return None  # Beam resolves the name from the options


class _ReadPendingFn(beam.DoFn):
    def __init__(self) -> None:
        self._n = beam.metrics.Metrics.counter(METRICS_NAMESPACE, "events_pending_in")

    def process(self, path: str):
        from pipelines.archive_source import table_to_fragments

        table = loc.read_feather(path)
        frags, _ = table_to_fragments(table)  # written by us from valid events: no dead letters
        self._n.inc(table.num_rows)
        yield from frags


def run_batch(*, out: str | Path, recipe: Recipe, **kwargs: Any) -> dict[str, int]:
    """One micro-batch of ``recipe``'s version, holding the version's commit lock throughout.

    Two runs on one dataset version at once (two terminals, two hosts on a shared ``--out``)
    would otherwise both build on commit ``n``: the second's ``recover`` would delete the
    first's staging directory, and both would write manifest ``n + 1``. With the lock
    (:func:`pipelines.commit.commit_lock`, ``flock``; released by the kernel if the holder
    dies) the second waits -- a log line says so -- then recovers, reads only the input the
    first left uncovered and commits that: disjoint work, nothing lost, nothing twice. Runs of
    different versions do not wait for each other; their Delta transactions on the shared
    tables are resolved by delta-rs' optimistic concurrency. Arguments: :func:`_run_batch_locked`.

    On an object store (``s3://``) there is no lock: each run stages under its own name and
    writes its manifest create-only, so of two runs racing for commit ``n`` one commits and the
    other raises :class:`pipelines.commit.CommitConflict` with its staging deleted (a rerun
    continues from the winner's commit); a run that starts after a commit reads what it left.
    """
    layout = DatasetLayout(out=str(out), version=recipe.version, recipe_hash=recipe.content_hash)
    with commit_lock(layout, waiting=lambda: _LOG.warning(
            "another run is committing %s in %s; waiting for its commit lock", recipe.version, out)):
        return _run_batch_locked(out=out, recipe=recipe, **kwargs)


def _run_batch_locked(
    *,
    out: str | Path,
    recipe: Recipe,
    source: str,
    options: PipelineOptions | None = None,
    runner_name: str = "FnApiRunner",
    archive: str | Path | None = None,
    kafka: dict[str, Any] | None = None,
    incomplete_after_s: float = 3600.0,
    shards: int = 1,
    group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    late_retention_s: float = DEFAULT_LATE_RETENTION_S,
    max_future_s: float = DEFAULT_MAX_FUTURE_S,
    use_domain_verifiers: bool = True,
    tokenizer: str | None = None,
) -> dict[str, int]:
    """One micro-batch: recover, read the uncovered input, run the pipeline, commit (under the lock: :func:`run_batch`).

    Args:
        out: dataset root.
        recipe: the reward recipe (names the dataset version).
        source: ``archive`` or ``kafka`` (tests: ``raw``, records given in memory by
            :func:`pipelines.testhooks.run_batch_on_records`).
        options: Beam options (runner options pass through).
        runner_name: the runner (FnApiRunner is instantiated explicitly).
        archive: archive directory (``archive`` source).
        kafka: ``{"conn": KafkaConnection, "topic": str}`` (``kafka`` source).
        incomplete_after_s: idle event time before an unfinished episode is incomplete.
        shards: files per (table, domain) per commit.
        group_timeout_s: event-time seconds a GRPO group waits for missing members (pipelines/groups.py).
        late_retention_s: event-time seconds an incomplete episode's events are kept for late events
            (pipelines/late.py; 0: none).
        max_future_s: event times more than this ahead of the processing time
            (:func:`processing_time_s`) are future: counted, used, never on the clock.
        use_domain_verifiers: run ``rollout.verifiers`` in VerifySteps.
        tokenizer: model directory whose tokenizer turns corrections into ``corrections/`` samples
            (pipelines/feedback.py; None: corrections stay in ``feedback/``, counted unresolved).

    Returns:
        The counts (keys :data:`COUNT_KEYS`); all zero when there was no new input.
    """
    layout = DatasetLayout(out=str(out), version=recipe.version, recipe_hash=recipe.content_hash,
                           run=uuid.uuid4().hex[:12] if is_remote(out) else "")
    fixed = recover(layout)
    manifests = read_manifests(layout)
    last = manifests[-1] if manifests else None
    commit = len(manifests) + 1
    manifest = DatasetManifest(commit=commit, version=recipe.version, recipe_hash=recipe.content_hash,
                               source=source, recipe=msgspec.to_builtins(recipe))
    files: list[ArchiveFile] = []
    ranges: list[Any] = []
    raw_records: list[RawRecords] | None = None
    if source == "archive":
        covered = [c for m in manifests for c in m.archive_commits]
        files = list_archive_files(archive, skip_commits=covered)
        manifest.archive_dir = str(archive)
        manifest.archive_commits = sorted({f.commit for f in files})
        has_input = bool(files)
    elif source == "kafka":
        from streams.consumer import end_offsets, ranges_from

        topic = kafka["topic"]
        start = covered_offsets(manifests, topic)
        with kafka_access_errors(kafka["conn"], what=f"read topic {topic!r}"):
            end = end_offsets(kafka["conn"], topic)
        ranges = ranges_from(topic=topic, start=start, end=end)
        manifest.offsets = {topic: {p: [start.get(p, 0), e] for p, e in sorted(end.items())}}
        has_input = bool(ranges)
    elif source == testhooks.RAW_SOURCE:
        raw_records = testhooks.injected_records()
        if raw_records is None:
            raise JobError(f"source {source!r} reads in-memory records, which only tests give "
                           "(pipelines.testhooks.run_batch_on_records); use `archive` or `kafka`")
        has_input = bool(raw_records)
    else:
        raise JobError(f"unknown source {source!r}")
    held = load_held_state(layout, manifests)
    if not has_input:  # held groups wait for input to move the clock
        _LOG.info("no new input for %s (recovered: %s); nothing to commit", recipe.version, fixed)
        return {**dict.fromkeys(COUNT_KEYS, 0), "groups_held": len(held.groups.held),
                "episodes_held": sum(g.stats.episodes for g in held.groups.held)}

    prior = load_prior_norm(layout)
    pending_path = layout.at(last.pending_file) if last and last.pending_file else None
    staging = layout.staging(commit)
    if not layout.remote:
        os.makedirs(staging, exist_ok=True)
    _LOG.info("commit %d of %s: %s input, pending=%s, %d groups held", commit, recipe.version, source,
              pending_path, len(held.groups.held))

    # Held episodes were emitted too (as held rows): their events, seen again, are duplicates. Events of
    # episodes written only as incomplete are late (pipelines/late.py). The workers read both from the
    # dataset (commits 1..n): the graph carries the reference, not the sets, so it does not grow with them.
    committed = CommittedView.of(layout, manifests, late_retention_s=late_retention_s)
    clock_s = last.clock_s if last else 0.0
    future_after_s = processing_time_s(source, files=files, raw_records=raw_records) + max_future_s
    runner = _make_runner(runner_name)
    p = beam.Pipeline(runner=runner, options=options or PipelineOptions([]))
    # Events cross the one shuffle as their raw frames (pipelines/frames.py), grouped in hash buckets of
    # episodes (a few elements per batch, not one per episode), decoded once, after it.
    # Archive files hold most episodes whole: those are assembled where the file is read, no shuffle.
    local = None
    if source == "archive":
        pending_ids = _pending_ids(pending_path)
        split = split_episode_ids(files, also=pending_ids)
        buckets = shuffle_buckets(len(split) * 16)  # only episodes spread over files take the shuffle
        read = p | "ReadArchive" >> ReadArchiveEpisodes(
            archive, files=files, split=split, committed=committed, buckets=buckets, future_after_s=future_after_s)
        local, frames = read, read[FRAMES_TAG]
    else:
        if source == "kafka":
            from pipelines.sources_kafka import ReadKafkaRange

            buckets = shuffle_buckets(sum(r.size for r in ranges))
            batches = p | "ReadKafka" >> ReadKafkaRange(kafka["conn"], kafka["topic"], ranges)
        else:
            buckets = shuffle_buckets(sum(len(r) for r in raw_records))
            batches = p | "RawRecords" >> beam.Create(list(raw_records), reshuffle=False)
        read = batches | "KeyFrames" >> KeyFrames(buckets=buckets)
        frames = read.frames
    if pending_path:
        pending_in = (p | "PendingFile" >> beam.Create([pending_path], reshuffle=False)
                      | "ReadPending" >> beam.ParDo(_ReadPendingFn()).with_output_types(Tuple[str, List[Event]])
                      | "PendingFrames" >> EventsToFrames(buckets=buckets))
        frames = (frames, pending_in) | "AllFrames" >> beam.Flatten()
    to_assemble = {"frames": frames}
    if local is not None:
        to_assemble.update(clock=local[CLOCK_TAG], undecided=local[UNDECIDED_TAG], feedback=local[FEEDBACK_TAG])
    assembled = to_assemble | "AssembleEpisodes" >> AssembleEpisodesFromFrames(
        incomplete_after_s=incomplete_after_s, clock_floor_s=clock_s, committed=committed,
        future_after_s=future_after_s, keep_incomplete=late_retention_s > 0,
    )
    # One chain per branch: a Flatten of Episodes would encode and decode every one of them.
    branches = [assembled["episodes"]] + ([local.episodes] if local is not None else [])
    # Evaluation episodes leave here for the evaluations table: no rewards, groups or statistics.
    splits = [b | f"SplitEvaluations{'Local' if i else ''}" >> SplitEvaluations() for i, b in enumerate(branches)]
    incomplete = assembled[INCOMPLETE_TAG] | "SplitIncompleteEvaluations" >> SplitEvaluations(counter=None)
    processed = [
        s.train | f"Process{'Local' if i else ''}" >> ProcessEpisodes(recipe, use_domain_verifiers=use_domain_verifiers,
                                                                     with_counts=True)
        for i, s in enumerate(splits)
    ]
    episodes = tuple(pr["episodes"] for pr in processed)
    # Groups and normalization: the writer computes the run's group statistics from its staged rows,
    # holds groups not whole yet, and normalizes every shard with prior ⊕ the released groups'.
    dead = (read[DEAD_LETTER_TAG], assembled[DEAD_LETTER_TAG]) | "AllDeadLetters" >> beam.Flatten()
    _ = {
        "episodes": episodes, "incomplete": incomplete.train,
        "pending": assembled[PENDING_TAG], "dead_letters": dead, "clock": assembled[CLOCK_TAG],
        "late": assembled[LATE_TAG], "evaluations": (*(s[EVAL_TAG] for s in splits), incomplete[EVAL_TAG]),
    } | "WriteDatasets" >> WriteDatasets(staging, recipe, commit=commit, shards=shards, prior=prior.stats,
                                         held=held, group_timeout_s=group_timeout_s)
    _ = assembled[FEEDBACK_TAG] | "WriteFeedback" >> WriteFeedback(staging, recipe, commit=commit,
                                                                   committed=committed)
    # The counts as data, staged beside the files (pipelines/counts.py): exact whatever the runner's metrics.
    _ = ((read[COUNTS_TAG], assembled[COUNTS_TAG], *(pr[COUNTS_TAG] for pr in processed)), assembled[CLOCK_TAG]) \
        | "StageCounts" >> StageCounts(staging)
    try:
        result = p.run()
        result.wait_until_finish()
        counts, run_clock_s = _counts_from_files(staging, pending_path)
        _compare_with_metrics(counts, result)
        counts.update(stage_corrections(out, staging, recipe=recipe, commit=commit, manifests=manifests,
                                        tokenizer=load_correction_tokenizer(tokenizer) if tokenizer else None,
                                        tokenizer_name=str(tokenizer or "")))
        manifest.counts = counts
        manifest.clock_s = max(clock_s, run_clock_s)
        manifest.late_state = carry_late_state(layout, last, staging, clock_s=manifest.clock_s,
                                               retention_s=late_retention_s, drop=lambda: committed.load().emitted)
    except Exception as err:
        # On an object store a run that starts once another run committed n deletes the staging of n it does not
        # name (:func:`pipelines.commit.recover`): a third run that is still at work on n then fails on its files
        # being gone -- it lost the race for n, and says so.
        if layout.remote and len(read_manifests(layout)) >= commit:
            loc.delete_dir(staging)
            raise CommitConflict.of(commit, recipe.version, str(out)) from err
        raise
    commit_staged(layout, manifest, prior_norm=prior)
    _check_accounted(counts)
    return counts


def processing_time_s(source: str, *, files: Sequence[ArchiveFile] = (),
                      raw_records: Sequence[RawRecords] | None = None) -> float:
    """The processing time a batch run judges event times against (epoch seconds; see ``--max-future-s``).

    The wall clock at job start, or earlier when the input says when it was
    written: an archive, the newest of its commits read (``created_at``);
    in-memory records, their newest Kafka timestamp. (A Kafka run takes the
    wall clock: producers stamp records with their own clock by default, the
    one that may be wrong.) Every event read was produced before it.
    """
    now = time.time()
    if source == "archive" and files:
        return min(now, max(f.created_s for f in files))
    if source == "raw" and raw_records:
        newest_ms = max((max(r.timestamps_ms) for r in raw_records if len(r)), default=0)
        return min(now, newest_ms / 1000.0) if newest_ms > 0 else now
    return now


class ProcessEpisodes(beam.PTransform):
    """verify → process rewards → clip: what happens to every assembled episode, in both modes.

    With ``with_counts``, returns ``{"episodes": ..., "counts": ...}`` (the rewards step's count dicts,
    pipelines/counts.py) instead of the episodes alone.
    """

    def __init__(self, recipe: Recipe, *, use_domain_verifiers: bool = True, with_counts: bool = False) -> None:
        super().__init__()
        self._recipe, self._use_domain, self._with_counts = recipe, use_domain_verifiers, with_counts

    def expand(self, episodes):
        recipe = self._recipe
        rewarded = (
            episodes
            | "VerifySteps" >> VerifySteps(use_domain_verifiers=self._use_domain)
            | "ComputeProcessRewards" >> ComputeProcessRewards(recipe, with_counts=True)
        )
        clipped = (
            rewarded.episodes
            | "ClipTrajectories" >> ClipTrajectories(
                max_steps=recipe.max_steps, max_action_tokens=recipe.max_action_tokens, gamma=recipe.gamma,
                lam=recipe.lam, reward_min=recipe.reward_min, reward_max=recipe.reward_max)
        )
        return {"episodes": clipped, COUNTS_TAG: rewarded[COUNTS_TAG]} if self._with_counts else clipped


def _pending_ids(path: str | None) -> list[str]:
    if not path:
        return []
    return loc.read_feather(path, columns=["episode_id"]).column(0).unique().to_pylist()


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
    kafka: dict[str, Any],
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
        kafka: ``{"conn": KafkaConnection, "topic": str}``.
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
    # meanwhile (a pane that lost the create-only manifest to one was planned again on top of it) are not ours.
    job = uuid.uuid4().hex[:8] if layout.remote else ""
    topic = kafka["topic"]
    start = covered_offsets(manifests, topic)
    # The workers read the committed episodes and the late state from the dataset (pipelines/committed.py):
    # the graph carries the reference, not the sets. The driver reads them too (once, cached) to drop
    # the pending fragments of episodes committed since (the pending state is bounded by open episodes).
    committed = CommittedView.of(layout, manifests, late_retention_s=late_retention_s)
    state = committed.load()
    pending = _load_pending(latest_pending_file(layout, manifests), state.emitted | state.incomplete)
    if stop_at_end:
        stop_offsets = end_offsets(kafka["conn"], topic)
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
        kafka["conn"], topic, start_offsets=start, idle_watermark_lag_s=idle_watermark_lag_s,
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
    counts, _ = _counts(result)
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
    _check_accounted(counts)
    return counts


def _check_accounted(counts: dict[str, int]) -> None:
    """Log an error when the counts do not reconcile (events read that no outcome counted, or counted twice)."""
    outcomes = ("events_used", "events_incomplete", "events_pending_out", "dead_letters", "duplicates", "late_events",
                "feedback_events")
    gap = counts["events_in"] + counts["events_pending_in"] - sum(counts[k] for k in outcomes)
    if gap:
        _LOG.error("the counts do not reconcile: %+d events read are in no outcome (lost, or counted twice if "
                   "negative) between the source and the assembler: %s", gap, json.dumps(counts))


def _counts_from_files(staging: str, pending_path: str | None) -> tuple[dict[str, int], float]:
    """(counts, the run's event-time clock in epoch seconds) from what the job staged, not from metrics.

    The DoFns' count files (:func:`pipelines.counts.read_staged_counts`), plus what the files say
    themselves: ``steps`` are the rows of the staged ``steps/`` files (Parquet footers), ``evaluations``
    the complete rows of ``evaluations/``, ``events_pending_in`` the rows of the pending state read.
    """
    totals, clock_s = read_staged_counts(staging)
    totals["steps_written"] = sum(loc.parquet_rows(f)
                                  for f in loc.list_files(loc.join(staging, "steps"), suffix=STAGED_SUFFIX))
    totals["evaluations"] = sum(
        loc.read_parquet(f, columns=["complete"]).column(0).to_pylist().count(True)
        for f in loc.list_files(loc.join(staging, "evaluations"), suffix=STAGED_SUFFIX))
    totals["events_pending_in"] = (loc.read_feather(pending_path, columns=["episode_id"]).num_rows
                                   if pending_path else 0)
    return {k: totals.get(_METRIC_FOR[k], 0) for k in COUNT_KEYS}, clock_s or 0.0


def _compare_with_metrics(counts: dict[str, int], result) -> None:
    """Log the counts the runner's committed metrics disagree on (absent metrics are no disagreement)."""
    try:
        metrics, _ = _counts(result)
    except NotImplementedError:  # a runner without a metrics query
        return
    differ = {k: (metrics[k], counts[k]) for k in COUNT_KEYS if metrics[k] and metrics[k] != counts[k]}
    if differ:
        _LOG.warning("the runner's metrics differ from the counts staged with the files (metric, staged): %s; "
                     "the manifest has the staged counts", differ)


def _counts(result) -> tuple[dict[str, int], int]:
    """(counts, event-time clock in epoch ms) from the pipeline's metrics."""
    query = result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))
    totals: dict[str, int] = {}
    for c in query["counters"]:
        totals[c.key.metric.name] = totals.get(c.key.metric.name, 0) + int(c.committed or 0)
    clock_ms = max((d.committed.max for d in query["distributions"]
                    if d.key.metric.name == EVENT_TIME_METRIC and d.committed and d.committed.count), default=0)
    return {k: totals.get(_METRIC_FOR[k], 0) for k in COUNT_KEYS}, int(clock_ms)


def run(argv: Sequence[str] | None = None, *, conn: KafkaConnection | None = None,
        default_topic: str = Topics().events) -> dict[str, int]:
    """Parse the command line, run one micro-batch (or loop), return the counts.

    Args:
        argv: command-line options (this job's and Beam's).
        conn: the full Kafka connection (security settings included) from the
            caller's settings; by default one built from ``--bootstrap``.
        default_topic: events topic when ``--topic`` is not given.

    Raises:
        JobError: missing or incompatible options.
        RecipeError: an unknown or invalid recipe.
    """
    args, beam_args = _parse(argv)
    _check(args)
    _check_out_readable(args.out)
    recipe = load_recipe(args.recipe)
    if args.tokenizer:
        try:  # a wrong --tokenizer is found before any Beam job runs
            load_correction_tokenizer(args.tokenizer)
        except CorrectionError as err:
            raise JobError(str(err)) from err
    _LOG.info("trajectory job: %s; recipe %s = %s", vars(args), recipe.version, msgspec.to_builtins(recipe))
    kafka = None
    if args.source == "kafka":
        base = conn or KafkaConnection(client_id="trajpipe-pipeline")
        kafka = {"conn": msgspec.structs.replace(base, bootstrap_servers=args.bootstrap),
                 "topic": args.topic or default_topic}
        check_kafka(kafka["conn"])  # down, or refusing these credentials: one clear error before Beam starts
    if args.mode == "stream":
        from pipelines.runners import RunnerConfigError, RunnerNotInstalledError, runner_options

        try:
            options = runner_options(args.runner or "PrismRunner", "stream", beam_args)
        except (RunnerConfigError, RunnerNotInstalledError) as err:
            raise JobError(str(err)) from err
        return run_stream(
            out=args.out, recipe=recipe, kafka=kafka, options=options,
            window_s=args.window_s, allowed_lateness_s=args.allowed_lateness_s,
            incomplete_after_s=args.incomplete_after, idle_watermark_lag_s=args.idle_watermark_lag_s,
            stop_after_s=args.stop_after_s, stop_at_end=args.stop_at_end, stop_file=args.stop_file,
            shards=args.shards, group_timeout_s=args.group_timeout,
            late_retention_s=args.late_retention, max_future_s=args.max_future_s,
            use_domain_verifiers=not args.no_domain_verifiers, tokenizer=args.tokenizer,
        )
    from pipelines.runners import flink_cluster_master

    options = _options(args, beam_args)
    master = flink_cluster_master(args.runner or "FnApiRunner", beam_args)
    if master:
        _check_flink_master(master)
    total = dict.fromkeys(COUNT_KEYS, 0)
    while True:
        try:
            counts = run_batch(
                out=args.out, recipe=recipe, source=args.source, options=options,
                runner_name=args.runner or "FnApiRunner", archive=args.archive, kafka=kafka,
                incomplete_after_s=args.incomplete_after, shards=args.shards, group_timeout_s=args.group_timeout,
                late_retention_s=args.late_retention, max_future_s=args.max_future_s,
                use_domain_verifiers=not args.no_domain_verifiers, tokenizer=args.tokenizer,
            )
        except (KafkaError, KafkaUnavailable, StreamTimeoutError) as err:
            if not args.loop:
                raise
            # A broker restart must not end a --loop job: nothing was committed; the next micro-batch
            # starts again from the last commit's end offsets.
            _LOG.warning("micro-batch failed, Kafka unreachable (%s: %s); retrying in %s s",
                         type(err).__name__, err, args.loop)
            time.sleep(args.loop)
            continue
        except RuntimeError as err:  # Beam's "Pipeline ... failed in state FAILED: ..."
            if not master:
                raise
            raise _flink_job_failed(master, err) from err
        # Held counts are a state, not a flow: the loop's total is the last micro-batch's.
        total = {k: counts[k] if k in ("groups_held", "episodes_held") else total[k] + counts[k] for k in COUNT_KEYS}
        _LOG.info("micro-batch done: %s", json.dumps(counts))
        if not args.loop:
            return total
        time.sleep(args.loop)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(json.dumps(run()), flush=True)
