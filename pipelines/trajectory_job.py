"""The trajectory job: event log → verified, reward-annotated, versioned Parquet datasets.

Reads the events of the Kafka ``events`` topic (a bounded offset range: from the
last commit's end offsets to the end offsets at job start) or of an event
archive (the archive commits no earlier dataset commit covers), plus the
pending events of unfinished episodes carried over from the last commit, and
writes one dataset commit (docs/pipelines.md)::

    decode/read → dedupe → assemble episodes → verify steps → process rewards
    → clip trajectories → normalize by domain → <out>/steps, <out>/trajectories

Run locally (FnApiRunner, the default for batch)::

    python -m pipelines.trajectory_job --source archive --archive data/archive --out data/datasets
    python -m pipelines.trajectory_job --source kafka --bootstrap 127.0.0.1:9092 --out data/datasets \\
        --recipe pipelines/recipes/shaped.yaml --loop 60
    trajpipe pipeline run --source archive --archive data/archive --out data/datasets

On a cluster, name the runner and pass its options through (every option this
module does not know goes to Beam's ``PipelineOptions``); ``--out`` must be a
filesystem the workers and the driver share::

    python -m pipelines.trajectory_job --source archive --archive /shared/archive --out /shared/datasets \\
        --runner FlinkRunner --flink_master flink:8081 --environment_type DOCKER

The last line printed is one JSON object of counts, which reconcile as
``events_in + events_pending_in == events_used + events_incomplete
+ events_pending_out + dead_letters + duplicates``.
"""

from __future__ import annotations

import argparse
import json
import logging
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any, List, Tuple

import apache_beam as beam
import msgspec
import pyarrow.dataset as pads
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.options.pipeline_options import PipelineOptions, StandardOptions

from pipelines.archive_source import ArchiveFile, ReadArchive, list_archive_files
from pipelines.assemble import EVENT_TIME_METRIC, INCOMPLETE_TAG, PENDING_TAG, AssembleEpisodes
from pipelines.clip import ClipTrajectories
from pipelines.commit import (
    DatasetLayout,
    DatasetManifest,
    commit_staged,
    load_prior_norm,
    read_manifests,
    recover,
)
from pipelines.decode import DecodeAndValidate
from pipelines.normalize import STATS_TAG, NormalizeByDomain
from pipelines.recipes import Recipe, load_recipe
from pipelines.rewards import ComputeProcessRewards
from pipelines.sinks import WriteDatasets
from pipelines.types import DEAD_LETTER_TAG, METRICS_NAMESPACE, RawRecords
from pipelines.verify import VerifySteps
from schemas.events import Event
from streams.config import KafkaConnection, Topics

__all__ = ["run", "run_batch", "JobError", "COUNT_KEYS"]

_LOG = logging.getLogger(__name__)

#: Keys of the counts dict, in print order (the first five are the contract).
COUNT_KEYS = (
    "events_in", "episodes", "steps", "dead_letters", "duplicates",
    "events_used", "events_incomplete", "events_pending_in", "events_pending_out",
    "incomplete_episodes", "pending_episodes",
)
_METRIC_FOR = {
    "events_in": "events_in", "episodes": "episodes_complete", "steps": "steps_written",
    "dead_letters": "dead_letters", "duplicates": "duplicates", "events_used": "events_used",
    "events_incomplete": "events_incomplete", "events_pending_in": "events_pending_in",
    "events_pending_out": "events_pending_out", "incomplete_episodes": "episodes_incomplete",
    "pending_episodes": "episodes_pending",
}


class JobError(ValueError):
    """Incompatible or missing options; the message names the option and the fix."""


def _parse(argv: Sequence[str] | None) -> tuple[argparse.Namespace, list[str]]:
    parser = argparse.ArgumentParser(prog="trajectory_job", description=__doc__.split("\n")[0])
    parser.add_argument("--source", choices=("kafka", "archive"), required=True)
    parser.add_argument("--bootstrap", help="Kafka bootstrap servers (--source kafka)")
    parser.add_argument("--topic", default=None, help="events topic (default: settings' topics.events)")
    parser.add_argument("--archive", help="event archive directory (--source archive)")
    parser.add_argument("--out", required=True, help="dataset root directory")
    parser.add_argument("--mode", choices=("batch", "stream"), default="batch")
    parser.add_argument("--recipe", default="outcome", help="builtin recipe name or YAML file")
    parser.add_argument("--runner", default=None, help="Beam runner (default FnApiRunner for batch)")
    parser.add_argument("--loop", type=float, default=0.0, help="repeat a micro-batch every SECONDS (0: once)")
    parser.add_argument("--incomplete-after", type=float, default=3600.0,
                        help="event-time seconds without news after which an unfinished episode is incomplete")
    parser.add_argument("--shards", type=int, default=1, help="files per table and domain per commit")
    return parser.parse_known_args(argv)


def _check(args: argparse.Namespace) -> None:
    runner = args.runner or ("FnApiRunner" if args.mode == "batch" else None)
    if args.mode == "stream":
        if runner in (None, "FnApiRunner", "DirectRunner", "BundleBasedDirectRunner"):
            raise JobError(
                f"`--runner` {runner} cannot run --mode stream; use --runner PrismRunner --prism_location "
                "<prism binary> (or Flink/Dataflow with their options)"
            )
        raise JobError(
            "`--mode stream` needs an unbounded Kafka source, which pipelines.sources_kafka does not provide yet; "
            "run --mode batch with --loop SECONDS for continuous micro-batches"
        )
    if args.source == "archive" and not args.archive:
        raise JobError("`--archive` is required with --source archive")
    if args.source == "kafka" and not args.bootstrap:
        raise JobError("`--bootstrap` is required with --source kafka")
    if args.loop < 0 or args.incomplete_after < 0 or args.shards < 1:
        raise JobError("`--loop` and `--incomplete-after` must be >= 0 and `--shards` >= 1")


def _options(args: argparse.Namespace, beam_args: list[str]) -> PipelineOptions:
    opts = PipelineOptions(beam_args)
    opts.view_as(StandardOptions).runner = args.runner or "FnApiRunner"
    return opts


def _make_runner(name: str):
    # Named explicitly: the default DirectRunner may try to download Prism.
    if name == "FnApiRunner":
        from apache_beam.runners.portability.fn_api_runner import FnApiRunner

        return FnApiRunner()
    return None  # Beam resolves the name from the options


def _committed_episodes(layout: DatasetLayout, manifests: list[DatasetManifest]) -> set[str]:
    paths = [str(layout.root / f.path) for m in manifests for f in m.files if f.path.startswith("trajectories/")]
    paths = [p for p in paths if Path(p).exists()]
    if not paths:
        return set()
    return set(pads.dataset(paths, format="parquet").to_table(columns=["episode_id"]).column(0).to_pylist())


class _ReadPendingFn(beam.DoFn):
    def __init__(self) -> None:
        self._n = beam.metrics.Metrics.counter(METRICS_NAMESPACE, "events_pending_in")

    def process(self, path: str):
        import pyarrow.feather as feather

        from pipelines.archive_source import table_to_fragments

        table = feather.read_table(path)
        frags, _ = table_to_fragments(table)  # written by us from valid events: no dead letters
        self._n.inc(table.num_rows)
        yield from frags


def run_batch(
    *,
    out: str | Path,
    recipe: Recipe,
    source: str,
    options: PipelineOptions | None = None,
    runner_name: str = "FnApiRunner",
    archive: str | Path | None = None,
    raw_records: Sequence[RawRecords] | None = None,
    kafka: dict[str, Any] | None = None,
    incomplete_after_s: float = 3600.0,
    shards: int = 1,
    use_domain_verifiers: bool = True,
    crash_at: str | None = None,
) -> dict[str, int]:
    """One micro-batch: recover, read the uncovered input, run the pipeline, commit.

    Args:
        out: dataset root.
        recipe: the reward recipe (names the dataset version).
        source: ``archive``, ``kafka`` or ``raw`` (``raw_records`` given in memory, for tests).
        options: Beam options (runner options pass through).
        runner_name: the runner (FnApiRunner is instantiated explicitly).
        archive: archive directory (``archive`` source).
        raw_records: record batches (``raw`` source).
        kafka: ``{"conn": KafkaConnection, "topic": str}`` (``kafka`` source).
        incomplete_after_s: idle event time before an unfinished episode is incomplete.
        shards: files per (table, domain) per commit.
        use_domain_verifiers: run ``rollout.verifiers`` in VerifySteps.
        crash_at: commit test hook (see :func:`pipelines.commit.commit_staged`).

    Returns:
        The counts (keys :data:`COUNT_KEYS`); all zero when there was no new input.
    """
    layout = DatasetLayout(out=str(out), version=recipe.version, recipe_hash=recipe.content_hash)
    fixed = recover(layout)
    manifests = read_manifests(layout)
    last = manifests[-1] if manifests else None
    commit = len(manifests) + 1
    manifest = DatasetManifest(commit=commit, version=recipe.version, recipe_hash=recipe.content_hash,
                               source=source, recipe=msgspec.to_builtins(recipe))
    files: list[ArchiveFile] = []
    ranges: list[Any] = []
    if source == "archive":
        covered = [c for m in manifests for c in m.archive_commits]
        files = list_archive_files(archive, skip_commits=covered)
        manifest.archive_dir = str(archive)
        manifest.archive_commits = sorted({f.commit for f in files})
        has_input = bool(files)
    elif source == "kafka":
        from streams.consumer import end_offsets, ranges_from

        topic = kafka["topic"]
        start = {int(p): r[1] for p, r in (last.offsets.get(topic, {}) if last else {}).items()}
        end = end_offsets(kafka["conn"], topic)
        ranges = ranges_from(topic=topic, start=start, end=end)
        manifest.offsets = {topic: {p: [start.get(p, 0), e] for p, e in sorted(end.items())}}
        has_input = bool(ranges)
    elif source == "raw":
        has_input = bool(raw_records)
    else:
        raise JobError(f"unknown source {source!r}")
    if not has_input:
        _LOG.info("no new input for %s (recovered: %s); nothing to commit", recipe.version, fixed)
        return dict.fromkeys(COUNT_KEYS, 0)

    prior = load_prior_norm(layout)
    pending_path = str(layout.root / last.pending_file) if last and last.pending_file else None
    staging = layout.staging(commit)
    staging.mkdir(parents=True, exist_ok=True)
    _LOG.info("commit %d of %s: %s input, pending=%s", commit, recipe.version, source, pending_path)

    runner = _make_runner(runner_name)
    p = beam.Pipeline(runner=runner, options=options or PipelineOptions())
    if source == "archive":
        read = p | "ReadArchive" >> ReadArchive(archive, files=files)
    elif source == "kafka":
        from pipelines.sources_kafka import ReadKafkaRange

        read = (p | "ReadKafka" >> ReadKafkaRange(kafka["conn"], kafka["topic"], ranges)
                | "DecodeAndValidate" >> DecodeAndValidate())
    else:
        read = (p | "RawRecords" >> beam.Create(list(raw_records), reshuffle=False)
                | "DecodeAndValidate" >> DecodeAndValidate())
    pending_in = (p | "PendingFile" >> beam.Create([pending_path] if pending_path else [], reshuffle=False)
                  | "ReadPending" >> beam.ParDo(_ReadPendingFn()).with_output_types(Tuple[str, List[Event]]))
    fragments = (read.fragments, pending_in) | "AllFragments" >> beam.Flatten()
    assembled = fragments | "AssembleEpisodes" >> AssembleEpisodes(
        incomplete_after_s=incomplete_after_s, clock_floor_s=last.clock_s if last else 0.0,
        already_emitted=_committed_episodes(layout, manifests),
    )
    normalized = (
        assembled["episodes"]
        | "VerifySteps" >> VerifySteps(use_domain_verifiers=use_domain_verifiers)
        | "ComputeProcessRewards" >> ComputeProcessRewards(recipe)
        | "ClipTrajectories" >> ClipTrajectories(max_steps=recipe.max_steps,
                                                 max_action_tokens=recipe.max_action_tokens, gamma=recipe.gamma)
        | "NormalizeByDomain" >> NormalizeByDomain(recipe, prior=prior.stats)
    )
    dead = (read[DEAD_LETTER_TAG], assembled[DEAD_LETTER_TAG]) | "AllDeadLetters" >> beam.Flatten()
    _ = {
        "episodes": normalized["episodes"], "incomplete": assembled[INCOMPLETE_TAG],
        "pending": assembled[PENDING_TAG], "dead_letters": dead, "stats": normalized[STATS_TAG],
    } | "WriteDatasets" >> WriteDatasets(staging, recipe, commit=commit, shards=shards)
    result = p.run()
    result.wait_until_finish()
    counts, clock_ms = _counts(result)
    manifest.counts = counts
    manifest.clock_s = max(last.clock_s if last else 0.0, clock_ms / 1000.0)
    commit_staged(layout, manifest, prior_norm=prior, crash_at=crash_at)
    return counts


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
    recipe = load_recipe(args.recipe)
    _LOG.info("trajectory job: %s; recipe %s = %s", vars(args), recipe.version, msgspec.to_builtins(recipe))
    kafka = None
    if args.source == "kafka":
        base = conn or KafkaConnection(client_id="trajpipe-pipeline")
        kafka = {"conn": msgspec.structs.replace(base, bootstrap_servers=args.bootstrap),
                 "topic": args.topic or default_topic}
    total = dict.fromkeys(COUNT_KEYS, 0)
    while True:
        counts = run_batch(
            out=args.out, recipe=recipe, source=args.source, options=_options(args, beam_args),
            runner_name=args.runner or "FnApiRunner", archive=args.archive, kafka=kafka,
            incomplete_after_s=args.incomplete_after, shards=args.shards,
        )
        total = {k: total[k] + counts[k] for k in COUNT_KEYS}
        _LOG.info("micro-batch done: %s", json.dumps(counts))
        if not args.loop:
            return total
        time.sleep(args.loop)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(json.dumps(run()), flush=True)
