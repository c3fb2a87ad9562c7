"""The trajectory jobs' command line: options, their checks, runner options, and one prepared run.

:mod:`pipelines.batch_job` and :mod:`pipelines.stream_job` (and the entry point both are run
through, :mod:`pipelines.trajectory_job`, i.e. ``trajpipe pipeline run``) take the same options;
:func:`prepare` parses and checks them, in this order, before any Beam job starts: the options
(:func:`parse_args`, :func:`check_args`), an object-store ``--out`` being readable, the recipe, the
``--tokenizer``, and the Kafka cluster answering with these credentials. Every option this module
does not know goes to Beam's ``PipelineOptions``.
"""

from __future__ import annotations

import argparse
import logging
import os
from collections.abc import Sequence
from dataclasses import dataclass
from typing import NoReturn

import msgspec
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

from pipelines.feedback import CorrectionError, load_correction_tokenizer
from pipelines.groups import DEFAULT_GROUP_TIMEOUT_S
from pipelines.inputs import ArchiveInput, BatchInput, KafkaInput
from pipelines.late import DEFAULT_LATE_RETENTION_S
from pipelines.recipes import Recipe, load_recipe
from schemas import locations as loc
from schemas.locations import filesystem, is_remote
from schemas.storage import StorageError, local_path, scheme_of
from streams.config import KafkaConnection, Topics
from streams.errors import check_kafka

__all__ = ["JobError", "PreparedJob", "DEFAULT_MAX_FUTURE_S", "DESCRIPTION", "prepare", "parse_args", "check_args",
           "check_out_readable", "batch_options", "stream_options", "check_flink_master", "flink_job_failed"]

_LOG = logging.getLogger(__name__)

#: The first line of ``--help`` (the same whichever module parses).
DESCRIPTION = "The trajectory job: event log → verified, reward-annotated, versioned Parquet datasets."
#: Seconds an event time may run ahead of the processing time before it is *future* (``--max-future-s``).
DEFAULT_MAX_FUTURE_S = 300.0


class JobError(ValueError):
    """Incompatible or missing options; the message names the option and the fix."""


class _ArgumentParser(argparse.ArgumentParser):
    """argparse that raises :class:`JobError` (one line for the CLI) instead of printing usage and exiting."""

    def error(self, message: str) -> NoReturn:
        raise JobError(f"{message} (see `trajpipe pipeline run --help`)")


def parse_args(argv: Sequence[str] | None, *, mode: str | None = None) -> tuple[argparse.Namespace, list[str]]:
    """(this job's options, Beam's) from ``argv``; ``mode`` (``batch``/``stream``): the ``--mode`` default, and the
    only one accepted (the job modules' own ``run``)."""
    parser = _ArgumentParser(prog="trajectory_job", description=DESCRIPTION)
    parser.add_argument("--source", choices=("kafka", "archive"), required=True)
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (--source kafka)")
    parser.add_argument("--topic", default=None, help="events topic (default: settings' topics.events)")
    parser.add_argument("--archive", help="event archive directory (--source archive)")
    parser.add_argument("--out", required=True, help="dataset root: a directory, or s3://BUCKET/PREFIX")
    parser.add_argument("--mode", choices=("batch", "stream"), default=mode or "batch")
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
    parser.add_argument("--local-workers", type=int, default=None, metavar="N",
                        help="batch, in-process runner, local --out: processes that assemble, verify, reward and "
                             "stage episodes (default: the usable CPUs for 20,000 events or more, else 1)")
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
    args, beam_args = parser.parse_known_args(argv)
    if mode and args.mode != mode:
        raise JobError(f"`--mode {args.mode}` is run by pipelines.{args.mode}_job (or `trajpipe pipeline run`), "
                       f"not pipelines.{mode}_job")
    return args, beam_args


def check_args(args: argparse.Namespace) -> None:
    """Incompatible or invalid options raise :class:`JobError`; local paths are made absolute in ``args``."""
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
    if args.local_workers is not None and args.local_workers < 1:
        raise JobError(f"`--local-workers` must be >= 1, got {args.local_workers}")
    if args.local_workers is not None and args.mode == "stream":
        raise JobError("`--local-workers` sets a batch run's processes; a --mode stream job runs on its runner's")
    if args.loop < 0 or args.incomplete_after < 0 or args.shards < 1:
        raise JobError("`--loop` and `--incomplete-after` must be >= 0 and `--shards` >= 1")
    if args.group_timeout < 0:
        raise JobError(f"`--group-timeout` must be >= 0 seconds (0 writes incomplete groups at once), "
                       f"got {args.group_timeout}")
    if args.late_retention < 0 or args.max_future_s < 0:
        raise JobError(f"`--late-retention` ({args.late_retention}) and `--max-future-s` ({args.max_future_s}) "
                       "must be >= 0 seconds")


def check_out_readable(out: str) -> None:
    """An object-store ``--out`` the credentials cannot read ends the run with one line, before any Kafka read."""
    if not is_remote(out):
        return
    try:
        loc.list_dir(out)
    except OSError as err:
        raise JobError(f"`--out` {out} cannot be read: {' '.join(str(err).split())}; check the bucket and the AWS_* "
                       "variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)") from err


@dataclass(frozen=True)
class PreparedJob:
    """One run's checked options: what :func:`prepare` gives the jobs' ``run_prepared``."""

    #: This job's options (checked; local paths absolute).
    args: argparse.Namespace
    #: The options this module does not know: Beam's.
    beam_args: list[str]
    #: The reward recipe (``--recipe``).
    recipe: Recipe
    #: What ``--source`` names: the topic (``--bootstrap``, ``--topic``) or the archive (``--archive``).
    input: BatchInput


def prepare(argv: Sequence[str] | None, *, conn: KafkaConnection | None = None,
            default_topic: str = Topics().events, mode: str | None = None) -> PreparedJob:
    """Parse and check the command line, load the recipe, and check the Kafka cluster answers (``--source kafka``).

    Args:
        argv: command-line options (this job's and Beam's).
        conn: the full Kafka connection (security settings included) from the
            caller's settings; by default one built from ``--bootstrap``.
        default_topic: events topic when ``--topic`` is not given.
        mode: the one ``--mode`` accepted (and its default); None: either, default batch.

    Raises:
        JobError: missing or incompatible options.
        RecipeError: an unknown or invalid recipe.
    """
    args, beam_args = parse_args(argv, mode=mode)
    check_args(args)
    check_out_readable(args.out)
    recipe = load_recipe(args.recipe)
    if args.tokenizer:
        try:  # a wrong --tokenizer is found before any Beam job runs
            load_correction_tokenizer(args.tokenizer)
        except CorrectionError as err:
            raise JobError(str(err)) from err
    _LOG.info("trajectory job: %s; recipe %s = %s", vars(args), recipe.version, msgspec.to_builtins(recipe))
    input: BatchInput = ArchiveInput(args.archive)
    if args.source == "kafka":
        base = conn or KafkaConnection(client_id="trajpipe-pipeline")
        input = KafkaInput(conn=msgspec.structs.replace(base, bootstrap_servers=args.bootstrap),
                           topic=args.topic or default_topic)
        check_kafka(input.conn)  # down, or refusing these credentials: one clear error before Beam starts
    return PreparedJob(args=args, beam_args=beam_args, recipe=recipe, input=input)


def batch_options(args: argparse.Namespace, beam_args: list[str]) -> PipelineOptions:
    """Beam options of a batch run on ``--runner`` (default FnApiRunner)."""
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


def stream_options(args: argparse.Namespace, beam_args: list[str]) -> PipelineOptions:
    """Beam options of a streaming run on ``--runner`` (default PrismRunner), ``streaming`` set."""
    from pipelines.runners import RunnerConfigError, RunnerNotInstalledError, runner_options

    try:
        return runner_options(args.runner or "PrismRunner", "stream", beam_args)
    except (RunnerConfigError, RunnerNotInstalledError) as err:
        raise JobError(str(err)) from err


def check_flink_master(master: str) -> None:
    """A Flink cluster that does not answer ends the run here, in seconds, not after the job server's retries."""
    from pipelines.flink_cluster import FlinkClusterError, probe_rest

    try:
        probe_rest(master, "/overview", timeout_s=10.0)
    except FlinkClusterError as err:
        raise JobError(f"`--flink_master` {master}: {err}; start a session cluster (`trajpipe flink-cluster up`) "
                       "or give a running JobManager's REST address (host:8081)") from err


def flink_job_failed(master: str, err: RuntimeError) -> JobError:
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

