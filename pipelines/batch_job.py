"""The batch trajectory job: one dataset commit of the input no earlier commit covers.

Its input: a bounded Kafka offset range (from the last commit's end offsets to the end
offsets at job start) or the archive commits no earlier dataset commit covers
(:mod:`pipelines.inputs`), plus the pending events carried over from the last commit.
The stages, from decoding to the dataset tables, are drawn in :mod:`pipelines.trajectory_job`
and docs/pipelines.md.

Run locally (FnApiRunner, the default)::

    python -m pipelines.batch_job --source archive --archive data/archive --out data/datasets
    python -m pipelines.batch_job --source kafka --bootstrap 127.0.0.1:9092 --out data/datasets \\
        --recipe pipelines/recipes/shaped.yaml --loop 60
    trajpipe pipeline run --source archive --archive data/archive --out data/datasets

On a cluster, name the runner and pass its options through (every option the job
does not know goes to Beam's ``PipelineOptions``); ``--out`` must be a filesystem
the workers and the driver share, or an S3-compatible store::

    python -m pipelines.batch_job --source archive --archive /shared/archive --out /shared/datasets \\
        --runner FlinkRunner --flink_master flink:8081 --environment_type DOCKER

The options, the counts printed as the last line and how they reconcile: the
entry point both jobs are run through, :mod:`pipelines.trajectory_job`
(``trajpipe pipeline run``); the options are parsed in :mod:`pipelines.job_args`,
the counts' keys are :data:`pipelines.job_counts.COUNT_KEYS`. A batch run's counts
come from what it staged (count files and the staged files' footers,
pipelines/counts.py), not from the runner's metrics.
"""

from __future__ import annotations

import json
import logging
import os
import time
import uuid
from collections.abc import Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any, List, Tuple

import apache_beam as beam
import msgspec
from apache_beam.options.pipeline_options import DirectOptions, PipelineOptions
from kafka.errors import KafkaError

from pipelines import testhooks
from pipelines.archive_source import ArchiveFile, ReadArchiveEpisodes, list_archive_files, split_episode_ids
from pipelines.assemble import INCOMPLETE_TAG, PENDING_TAG
from pipelines.beam_overhead import (ViewCachingOptions, in_process_pickles, memoize_signatures,
                                     shorten_state_sampling)
from pipelines.commit import (
    CommitConflict,
    DatasetLayout,
    DatasetManifest,
    carry_late_state,
    commit_lock,
    commit_staged,
    covered_offsets,
    load_held_state,
    load_prior_norm,
    read_manifests,
    read_snapshot,
    recover,
)
from pipelines.committed import CommittedView
from pipelines.counts import COUNTS_TAG, StageCounts, read_staged_counts
from pipelines.evaluations import EVAL_TAG, SplitEvaluations
from pipelines.feedback import FEEDBACK_TAG, WriteFeedback, load_correction_tokenizer, stage_corrections
from pipelines.forked import ChainStage, close_pools, output_tag, per_task, prestart_scope, usable_cpus
from pipelines.frames import (
    CLOCK_TAG,
    FRAMES_TAG,
    IN_PLACE_DIR,
    PlainPlan,
    UNDECIDED_TAG,
    AssembleEpisodesFromFrames,
    AssembleInPlace,
    EventsToFrames,
    KeyFrames,
    in_place_collisions,
    shuffle_buckets,
)
from pipelines.gcpause import gc_frozen
from pipelines.groups import DEFAULT_GROUP_TIMEOUT_S
from pipelines.inputs import ArchiveInput, ArchivePlan, BatchInput, KafkaInput, KafkaPlan
from pipelines.job_args import (
    DEFAULT_MAX_FUTURE_S,
    JobError,
    PreparedJob,
    batch_options,
    check_flink_master,
    flink_job_failed,
    prepare,
)
from pipelines.job_counts import COUNT_KEYS, METRIC_FOR, check_accounted, counts_from_metrics
from pipelines.late import DEFAULT_LATE_RETENTION_S, LATE_TAG
from pipelines.normalize import STATS_TAG
from pipelines.process import ProcessEpisodes
from pipelines.recipes import Recipe
from pipelines.sinks import STAGED_SUFFIX, WriteDatasets
from pipelines.types import DEAD_LETTER_TAG, METRICS_NAMESPACE, RawRecords
from schemas import locations as loc
from schemas.events import Event
from schemas.locations import is_remote
from streams.config import KafkaConnection, Topics
from streams.consumer import StreamTimeoutError
from streams.errors import KafkaUnavailable, kafka_access_errors

__all__ = ["run", "run_prepared", "run_batch", "processing_time_s", "FORK_MIN_EVENTS"]

_LOG = logging.getLogger(__name__)

#: Input (events; an archive: bytes / 2 KB) from which a run processes its episodes in forked workers.
FORK_MIN_EVENTS = 20_000
_ARCHIVE_BYTES_PER_EVENT = 2048
#: Most events of one partition's range for its episodes to be assembled in the task that reads it (the task
#: holds the range's frames until its end: ~2 KB an event); a larger range takes the shuffle.
IN_PLACE_MAX_PARTITION_EVENTS = 1_000_000


def _in_process(runner_name: str, options: PipelineOptions | None) -> bool:
    """Whether the run's Beam workers are this process (and its forks): FnApiRunner, not ``multi_processing``."""
    mode = (options or PipelineOptions([])).view_as(DirectOptions).direct_running_mode
    return runner_name == "FnApiRunner" and mode != "multi_processing"


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


def run_batch(*, out: str | Path, recipe: Recipe, input: BatchInput | testhooks.InMemoryInput,
              **kwargs: Any) -> dict[str, int]:
    """One micro-batch of ``recipe``'s version, holding the version's commit lock throughout.

    Two runs on one dataset version at once (two terminals, two hosts on a shared ``--out``)
    would otherwise both build on commit ``n``: the second's ``recover`` would delete the
    first's staging directory, and the commit log would refuse the later one's commit
    ``n + 1`` (:class:`pipelines.commit.CommitConflict`: its work lost). With the lock
    (:func:`pipelines.commit.commit_lock`, ``flock``; released by the kernel if the holder
    dies) the second waits -- a log line says so -- then recovers, reads only the input the
    first left uncovered and commits that: disjoint work, nothing lost, nothing twice. Runs of
    different versions do not wait for each other; their Delta transactions on the shared
    tables are resolved by delta-rs' optimistic concurrency. Arguments: :func:`_run_batch_locked`.

    On an object store (``s3://``) there is no lock: each run stages under its own name and
    commits against the snapshot of the commit log it planned on, so of two runs racing for
    commit ``n`` one commits and the
    other raises :class:`pipelines.commit.CommitConflict` with its staging deleted (a rerun
    continues from the winner's commit); a run that starts after a commit reads what it left.
    """
    layout = DatasetLayout(out=str(out), version=recipe.version, recipe_hash=recipe.content_hash)
    with commit_lock(layout, waiting=lambda: _LOG.warning(
            "another run is committing %s in %s; waiting for its commit lock", recipe.version, out)):
        # Beam's pickles of an in-process run stay in this process and its forks: zlib, not bzip2 (beam_overhead.py).
        in_process = _in_process(kwargs.get("runner_name", "FnApiRunner"), kwargs.get("options"))
        try:
            # forked read tasks may start while the pipeline is built (pipelines/forked.py)
            with prestart_scope(), in_process_pickles(in_process):
                return _run_batch_locked(out=out, recipe=recipe, input=input, **kwargs)
        except _InPlaceCollision as err:
            _LOG.warning("%s; the micro-batch is made again through the shuffle (nothing was committed)", err)
            with prestart_scope(), in_process_pickles(in_process):
                return _run_batch_locked(out=out, recipe=recipe, input=input, **kwargs, in_place=False)


class _InPlaceCollision(Exception):
    """Episodes assembled in one forked read task had events in another (:func:`pipelines.frames.in_place_collisions`)."""


def _run_batch_locked(
    *,
    out: str | Path,
    recipe: Recipe,
    input: BatchInput | testhooks.InMemoryInput,
    options: PipelineOptions | None = None,
    runner_name: str = "FnApiRunner",
    incomplete_after_s: float = 3600.0,
    shards: int = 1,
    group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    late_retention_s: float = DEFAULT_LATE_RETENTION_S,
    max_future_s: float = DEFAULT_MAX_FUTURE_S,
    use_domain_verifiers: bool = True,
    tokenizer: str | None = None,
    workers: int | None = None,
    in_place: bool = True,
    columnar: bool = True,
) -> dict[str, int]:
    """One micro-batch: recover, read the uncovered input, run the pipeline, commit (under the lock: :func:`run_batch`).

    Args:
        out: dataset root.
        recipe: the reward recipe (names the dataset version).
        input: what to read (:class:`~pipelines.inputs.ArchiveInput`, :class:`~pipelines.inputs.KafkaInput`;
            tests: :class:`~pipelines.testhooks.InMemoryInput`, records given in memory by
            :func:`pipelines.testhooks.run_batch_on_records`); the commit covers the part of it no earlier
            commit does (:func:`_plan`), and its manifest's ``source`` is ``input.source``.
        options: Beam options (runner options pass through).
        runner_name: the runner (FnApiRunner is instantiated explicitly).
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
        workers: processes that assemble, verify, reward, clip and stage the episodes (a
            :class:`pipelines.forked.ForkedChain`; FnApiRunner with a local ``out`` and input only, else 1).
            None: :func:`pipelines.forked.usable_cpus` for an input of :data:`FORK_MIN_EVENTS` events or
            more, else 1 (forking is not worth its few hundred milliseconds on less).
        in_place: with Kafka input and forked workers, assemble each partition's episodes in the task
            that read it (:class:`pipelines.frames.AssembleInPlace`; the shuffle carries only those of
            the pending state). :func:`run_batch` runs a micro-batch again with False when an episode's
            events were in two partitions.
        columnar: with forked workers, the plain episodes (complete, nothing to resolve) of the tasks that
            read and assemble (archive files; Kafka partitions with ``in_place``) are verified, rewarded,
            clipped and staged by the columnar path (:mod:`pipelines.columnar`), many at once: the same rows
            (False: every episode through the per-episode stages; for comparisons).

    Returns:
        The counts (keys :data:`COUNT_KEYS`); all zero when there was no new input.
    """
    layout = DatasetLayout(out=str(out), version=recipe.version, recipe_hash=recipe.content_hash,
                           run=uuid.uuid4().hex[:12] if is_remote(out) else "")
    fixed = recover(layout)
    snapshot, manifests = read_snapshot(layout)  # the commit is made against this read of the log
    last = manifests[-1] if manifests else None
    commit = len(manifests) + 1
    plan = _plan(input, manifests)
    manifest = DatasetManifest(commit=commit, version=recipe.version, recipe_hash=recipe.content_hash,
                               source=input.source, recipe=msgspec.to_builtins(recipe), **plan.manifest_fields())
    held = load_held_state(layout, manifests)
    if not plan.has_input:  # held groups wait for input to move the clock
        _LOG.info("no new input for %s (recovered: %s); nothing to commit", recipe.version, fixed)
        return {**dict.fromkeys(COUNT_KEYS, 0), "groups_held": len(held.groups.held),
                "episodes_held": sum(g.stats.episodes for g in held.groups.held)}

    prior = load_prior_norm(layout)
    pending_path = layout.at(last.pending_file) if last and last.pending_file else None
    staging = layout.staging(commit)
    if not layout.remote:
        os.makedirs(staging, exist_ok=True)
    _LOG.info("commit %d of %s: %s input, pending=%s, %d groups held", commit, recipe.version, input.source,
              pending_path, len(held.groups.held))

    # Held episodes were emitted too (as held rows): their events, seen again, are duplicates. Events of
    # episodes written only as incomplete are late (pipelines/late.py). The workers read both from the
    # dataset (commits 1..n): the graph carries the reference, not the sets, so it does not grow with them.
    committed = CommittedView.of(layout, manifests, late_retention_s=late_retention_s)
    clock_s = last.clock_s if last else 0.0
    files = plan.files if isinstance(plan, ArchivePlan) else ()
    raw_records = plan.records if isinstance(plan, _RecordsPlan) else None
    future_after_s = processing_time_s(input.source, files=files, raw_records=raw_records) + max_future_s
    workers = _workers(workers, plan, runner_name=runner_name, remote=layout.remote)
    runner = _make_runner(runner_name)
    memoize_signatures()  # two of Beam's fixed costs a run, paid once a process (pipelines/beam_overhead.py)
    shorten_state_sampling()  # and the wait for its state sampler at each bundle's end, cut to <= 10 ms
    p = beam.Pipeline(runner=runner, options=(options or PipelineOptions([])).view_as(ViewCachingOptions))
    write = WriteDatasets(staging, recipe, commit=commit, shards=shards, prior=prior.stats, held=held,
                          group_timeout_s=group_timeout_s)
    process = ProcessEpisodes(recipe, use_domain_verifiers=use_domain_verifiers, with_counts=True)

    def downstream() -> list[ChainStage]:  # what follows assembly, run in the forked workers with it
        return [SplitEvaluations().stage(), *process.stages(), write.stage_rows()] if workers > 1 else []

    # Plain episodes (pipelines/columnar.py) of the chains that read and assemble go straight to row staging,
    # processed many at once by the columnar path.
    plain = (PlainPlan(recipe, use_domain_verifiers, write.stage_rows().name)
             if columnar and workers > 1 and recipe.reward != "prm" else None)

    # Events cross the one shuffle as their raw frames (pipelines/frames.py), grouped in hash buckets of
    # episodes (a few elements per batch, not one per episode), decoded once, after it.
    # Archive files hold most episodes whole: those are assembled where the file is read, no shuffle.
    local = None
    shuffle_workers = workers
    if isinstance(plan, ArchivePlan):
        pending_ids = _pending_ids(pending_path)
        split = split_episode_ids(files, also=pending_ids)
        shuffled_events = len(split) * 16  # an upper estimate: only episodes spread over files take the shuffle
        buckets = shuffle_buckets(shuffled_events)
        if shuffled_events < FORK_MIN_EVENTS:  # a few episodes (often none): not worth a pool of forks
            shuffle_workers = 1
        read = p | "ReadArchive" >> ReadArchiveEpisodes(
            plan.input.location, files=files, split=split, committed=committed, buckets=buckets,
            future_after_s=future_after_s, downstream=downstream(), workers=workers, plain=plain)
        local, frames = read, read[FRAMES_TAG]
    else:
        if isinstance(plan, KafkaPlan):
            from pipelines.sources_kafka import ReadKafkaRange

            buckets = shuffle_buckets(sum(r.size for r in plan.ranges))
        else:
            buckets = shuffle_buckets(sum(len(r) for r in raw_records))
        # In-process, the frames go through the shuffle as references to files under the staging directory
        # (deleted with it on commit); a cluster runner's shuffle carries them itself.
        spill = loc.join(staging, "_frames") if runner_name == "FnApiRunner" and not layout.remote else None
        key_frames = KeyFrames(buckets=buckets, spill_dir=spill)
        if (isinstance(plan, KafkaPlan) and workers > 1 and in_place
                and max(r.size for r in plan.ranges) <= IN_PLACE_MAX_PARTITION_EVENTS):
            # Producers key events by episode: a partition's range holds its episodes whole, assembled in the
            # forked task that reads it (no shuffle, no second pass); only the pending state's take the shuffle.
            pending_ids = _pending_ids(pending_path)
            ledger_dir = loc.join(staging, IN_PLACE_DIR)
            if len(pending_ids) * 16 < FORK_MIN_EVENTS:
                shuffle_workers = 1
            in_place_stage = AssembleInPlace(split=pending_ids, buckets=buckets, ledger_dir=ledger_dir,
                                             committed=committed, future_after_s=future_after_s, spill_dir=spill,
                                             plain=plain)
            chain = p | "ReadKafka" >> ReadKafkaRange(plan.input.conn, plan.input.topic, list(plan.ranges),
                                                      downstream=[in_place_stage.stage(), *downstream()],
                                                      workers=workers)
            local = {"chain": chain, **{tag: chain[output_tag("assemble_in_place", tag)]
                                        for tag in AssembleInPlace.TAGS}}
            read, frames = local, local[FRAMES_TAG]
        elif isinstance(plan, KafkaPlan) and workers > 1:  # read and keyed in the forked workers
            chain = p | "ReadKafka" >> ReadKafkaRange(plan.input.conn, plan.input.topic, list(plan.ranges),
                                                      downstream=[key_frames.stage()], workers=workers)
            read = {tag: chain[output_tag("keyframes", tag)] for tag in (DEAD_LETTER_TAG, COUNTS_TAG)}
            frames = chain.main
        else:
            if isinstance(plan, KafkaPlan):
                batches = p | "ReadKafka" >> ReadKafkaRange(plan.input.conn, plan.input.topic, list(plan.ranges))
            else:
                batches = p | "RawRecords" >> beam.Create(list(raw_records), reshuffle=False)
            read = batches | "KeyFrames" >> key_frames
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
        downstream=downstream(), workers=shuffle_workers, per_task=per_task(buckets, shuffle_workers),
    )
    incomplete = assembled[INCOMPLETE_TAG] | "SplitIncompleteEvaluations" >> SplitEvaluations(counter=None)
    if workers > 1:  # split, processed and staged in the forked workers, the assembly's chains
        chains = [assembled["chain"]] + ([local["chain"]] if local is not None else [])
        evaluations = tuple(c[output_tag("split", EVAL_TAG)] for c in chains)
        process_counts = tuple(c[output_tag("rewards", COUNTS_TAG)] for c in chains)
        rows = {"staged_parts": tuple(c.main for c in chains),
                "staged_stats": tuple(c[output_tag("stage", STATS_TAG)] for c in chains)}
    else:
        # One chain per branch: a Flatten of Episodes would encode and decode every one of them.
        branches = [assembled["episodes"]] + ([local["episodes"]] if local is not None else [])
        # Evaluation episodes leave here for the evaluations table: no rewards, groups or statistics.
        splits = [b | f"SplitEvaluations{'Local' if i else ''}" >> SplitEvaluations()
                  for i, b in enumerate(branches)]
        processed = [s.train | f"Process{'Local' if i else ''}" >> process for i, s in enumerate(splits)]
        evaluations = tuple(s[EVAL_TAG] for s in splits)
        process_counts = tuple(pr[COUNTS_TAG] for pr in processed)
        rows = {"episodes": tuple(pr["episodes"] for pr in processed)}
    # Groups and normalization: the writer computes the run's group statistics from its staged rows,
    # holds groups not whole yet, and normalizes every shard with prior ⊕ the released groups'.
    dead = (read[DEAD_LETTER_TAG], assembled[DEAD_LETTER_TAG]) | "AllDeadLetters" >> beam.Flatten()
    _ = {
        **rows, "incomplete": incomplete.train,
        "pending": assembled[PENDING_TAG], "dead_letters": dead, "clock": assembled[CLOCK_TAG],
        "late": assembled[LATE_TAG], "evaluations": (*evaluations, incomplete[EVAL_TAG]),
    } | "WriteDatasets" >> write
    _ = assembled[FEEDBACK_TAG] | "WriteFeedback" >> WriteFeedback(staging, recipe, commit=commit,
                                                                   committed=committed)
    # The counts as data, staged beside the files (pipelines/counts.py): exact whatever the runner's metrics.
    _ = ((read[COUNTS_TAG], assembled[COUNTS_TAG], *process_counts), assembled[CLOCK_TAG]) \
        | "StageCounts" >> StageCounts(staging)
    try:
        with gc_frozen():  # the in-process runner's bundles run here (pipelines/gcpause.py)
            result = p.run()
            result.wait_until_finish()
        if local is not None and isinstance(plan, KafkaPlan):
            collisions = in_place_collisions(loc.join(staging, IN_PLACE_DIR))
            if collisions:
                loc.delete_dir(staging)
                raise _InPlaceCollision(
                    f"{len(collisions)} episode(s) had events in more than one partition of {plan.input.topic!r} "
                    f"(e.g. {collisions[0]!r}: keyed by something else than the episode id, or partitions added)")
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
    commit_staged(layout, manifest, prior_norm=prior, snapshot=snapshot)
    check_accounted(counts)
    return counts



@dataclass(frozen=True)
class _RecordsPlan:
    """In-memory Kafka records (tests: :func:`pipelines.testhooks.run_batch_on_records`), all of them."""

    records: list[RawRecords]

    @property
    def has_input(self) -> bool:
        return bool(self.records)

    def manifest_fields(self) -> dict[str, Any]:
        return {}


def _plan(input: BatchInput | testhooks.InMemoryInput,
          manifests: Sequence[DatasetManifest]) -> KafkaPlan | ArchivePlan | _RecordsPlan:
    """The part of ``input`` the next commit covers: what no earlier commit (``manifests``) covers."""
    if isinstance(input, ArchiveInput):
        covered = [c for m in manifests for c in m.archive_commits]
        return ArchivePlan(input=input, files=tuple(list_archive_files(input.location, skip_commits=covered)))
    if isinstance(input, KafkaInput):
        from streams.consumer import end_offsets, ranges_from

        start = covered_offsets(manifests, input.topic)
        with kafka_access_errors(input.conn, what=f"read topic {input.topic!r}"):
            end = end_offsets(input.conn, input.topic)
        return KafkaPlan(input=input, start=start, end=end,
                         ranges=tuple(ranges_from(topic=input.topic, start=start, end=end)))
    if isinstance(input, testhooks.InMemoryInput):
        records = testhooks.injected_records()
        if records is None:
            raise JobError(f"source {input.source!r} reads in-memory records, which only tests give "
                           "(pipelines.testhooks.run_batch_on_records); use `archive` or `kafka`")
        return _RecordsPlan(records=records)
    raise JobError(f"unknown input {input!r}; give a pipelines.inputs.ArchiveInput or KafkaInput")


def _workers(workers: int | None, plan: KafkaPlan | ArchivePlan | _RecordsPlan, *, runner_name: str,
             remote: bool) -> int:
    """The processes of the run's forked chain (``run_batch``'s ``workers``; 1: none, all in the runner).

    Forking needs the in-process runner and local files only: the workers must reach the staging
    directory, and the object-store clients do not survive a fork (pipelines/forked.py).
    """
    archive = plan.input.location if isinstance(plan, ArchivePlan) else ""
    if runner_name != "FnApiRunner" or remote or is_remote(archive):
        return 1
    if workers is not None:
        return max(1, workers)
    if isinstance(plan, KafkaPlan):
        events = sum(r.size for r in plan.ranges)
    elif isinstance(plan, ArchivePlan):
        events = sum(os.path.getsize(f.path) for f in plan.files) // _ARCHIVE_BYTES_PER_EVENT
    else:
        events = sum(len(r) for r in plan.records)
    return usable_cpus() if events >= FORK_MIN_EVENTS else 1


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


def _pending_ids(path: str | None) -> list[str]:
    if not path:
        return []
    return loc.read_feather(path, columns=["episode_id"]).column(0).unique().to_pylist()



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
    return {k: totals.get(METRIC_FOR[k], 0) for k in COUNT_KEYS}, clock_s or 0.0


def _compare_with_metrics(counts: dict[str, int], result) -> None:
    """Log the counts the runner's committed metrics disagree on (absent metrics are no disagreement)."""
    try:
        metrics, _ = counts_from_metrics(result)
    except NotImplementedError:  # a runner without a metrics query
        return
    differ = {k: (metrics[k], counts[k]) for k in COUNT_KEYS if metrics[k] and metrics[k] != counts[k]}
    if differ:
        _LOG.warning("the runner's metrics differ from the counts staged with the files (metric, staged): %s; "
                     "the manifest has the staged counts", differ)



def run(argv: Sequence[str] | None = None, *, conn: KafkaConnection | None = None,
        default_topic: str = Topics().events) -> dict[str, int]:
    """Parse the command line (``--mode batch``), run one micro-batch (or loop), return the counts.

    Args: as :func:`pipelines.job_args.prepare`.

    Raises:
        JobError: missing or incompatible options.
        RecipeError: an unknown or invalid recipe.
    """
    return run_prepared(prepare(argv, conn=conn, default_topic=default_topic, mode="batch"))


def run_prepared(job: PreparedJob) -> dict[str, int]:
    """Run one micro-batch of a prepared command line, or one every ``--loop`` seconds; return the counts."""
    args, recipe, input = job.args, job.recipe, job.input
    from pipelines.runners import flink_cluster_master

    options = batch_options(args, job.beam_args)
    master = flink_cluster_master(args.runner or "FnApiRunner", job.beam_args)
    if master:
        check_flink_master(master)
    total = dict.fromkeys(COUNT_KEYS, 0)
    while True:
        try:
            counts = run_batch(
                out=args.out, recipe=recipe, input=input, options=options,
                runner_name=args.runner or "FnApiRunner",
                incomplete_after_s=args.incomplete_after, shards=args.shards, group_timeout_s=args.group_timeout,
                late_retention_s=args.late_retention, max_future_s=args.max_future_s,
                use_domain_verifiers=not args.no_domain_verifiers, tokenizer=args.tokenizer,
                workers=args.local_workers,
            )
        except (KafkaError, KafkaUnavailable, StreamTimeoutError) as err:
            if not args.loop:
                raise
            # A broker restart must not end a --loop job: nothing was committed; the next micro-batch
            # starts again from the last commit's end offsets.
            _LOG.warning("micro-batch failed, Kafka unreachable (%s: %s); retrying in %s s",
                         type(err).__name__, err, args.loop)
            _wait_for_the_next(args.loop)
            continue
        except RuntimeError as err:  # Beam's "Pipeline ... failed in state FAILED: ..."
            if not master:
                raise
            raise flink_job_failed(master, err) from err
        # Held counts are a state, not a flow: the loop's total is the last micro-batch's.
        total = {k: counts[k] if k in ("groups_held", "episodes_held") else total[k] + counts[k] for k in COUNT_KEYS}
        _LOG.info("micro-batch done: %s", json.dumps(counts))
        if not args.loop:
            return total
        _wait_for_the_next(args.loop)


#: A ``--loop`` wait at least this long ends the kept forked workers first (their memory back while idle).
IDLE_WORKERS_CLOSE_S = 30.0


def _wait_for_the_next(seconds: float) -> None:
    """Sleep until the next micro-batch of a ``--loop``.

    The forked workers a run used are kept for the next one (pipelines/forked.py: warm
    memory, ~0.25 s of page faults a worker saved per run), holding a few hundred MB each
    (a GB after a million-event run). Before a wait of :data:`IDLE_WORKERS_CLOSE_S` or
    more, where that saving is under 1 % of the interval, they are ended instead.
    """
    if seconds >= IDLE_WORKERS_CLOSE_S:
        close_pools()
    time.sleep(seconds)


if __name__ == "__main__":
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(levelname)s %(name)s: %(message)s")
    print(json.dumps(run()), flush=True)
