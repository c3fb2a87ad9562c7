"""CommitWindows: the streaming job's sink — one dataset commit per event-time window pane.

The batch job stages files in Beam and commits from the driver. A streaming
job never returns to the driver, so here each commit is made by a DoFn: all
of a pane's elements are grouped on one constant key (one writer per window
pane), and that writer runs the protocol of :mod:`pipelines.commit` under the
version's commit lock (``flock``; on an object store, see below)::

    recover → drop episodes already committed or held (by episode_id, over all manifests; an episode
              committed as incomplete may still be committed complete, ``completed_late``)
    → decide GRPO groups (held state of the last commit ⊕ this pane's episodes)
    → normalize (persisted statistics ⊕ the released groups') → stage files and the new held state
    → commit n of the version's commit log, against the snapshot the commit was planned on (the commit
      point; its record the manifest: files, Kafka offsets covered, window, pane) → renames

Windowing: ``FixedWindows(window_s)`` on the elements' event time (the
source's Kafka record time), triggered when the watermark passes the end of
the window and again for every late element (``AfterWatermark(late=AfterCount(1))``,
discarding fired panes) for ``allowed_lateness_s``, so a batch the runner
delivers after its window fired lands in a later commit instead of being
dropped. Elements later than that are dropped by the runner: the job counts
their events as ``events_uncommitted`` (outcomes the assembler counted that no
commit holds, :func:`pipelines.stream_job.run_stream`); keep
``allowed_lateness_s`` well above the source's read lag.

Normalization and GRPO groups are done here, not with side inputs: the
persisted statistics and the held groups change with every commit of the
running job, and a pane must be decided and normalized against the state of
every commit before it plus its own, exactly as a batch micro-batch is; a
side input would freeze that state at job start. The functions are the batch
writer's (:func:`pipelines.sinks.stage_files`: :func:`pipelines.groups.decide_commit`,
:func:`pipelines.sinks.finalize_shard`); the held state is read under the
commit lock (:func:`pipelines.commit.load_held_state`) and committed with each
window commit. Each commit also writes the pane's late events and the events
it keeps for its incomplete episodes, and carries the late state
(:func:`pipelines.commit.carry_late_state`). The clock of a pane's group timeouts is its manifest's
``clock_s`` (the latest event time committed, each at most ``max_future_s``
ahead of the wall clock). The end-of-stream
pending-state commit decides no groups.

On an object store (``--out s3://...``) every file goes through :mod:`schemas.locations`, as
in the batch commit, and there is no ``flock``: the job's pane writers (threads of one
process on Prism's LOOPBACK worker) take turns on a process lock, each attempt stages under
``_staging/<V>/<n>-<job><pane><attempt>/`` and commits against the snapshot of the commit log it
was planned on. An attempt the log refuses because another run committed since
(:class:`pipelines.commit.CommitConflict`; or that finds its staging deleted by that run's recovery
once ``n`` is committed) deletes its staging and is **planned again** from the top -- recover, read the
manifests, drop what the winner committed, decide, stage, commit ``n + 1`` -- which is what a
local writer does after waiting for the lock: the pane's elements are in hand, the commit is
a function of them and of the committed state (:func:`made_by_job` tells the job's commits
from the winner's for its counts). The staging name also names the pane
(``<n>-<job><pane><attempt>``): a bundle the runner retries after its commit's manifest was
made (a store error in the moves or the Delta transactions) finds its pane committed,
recovers it, and commits nothing again.

Examples:
    >>> merge_offsets([(0, 5, 9, 4), (0, 2, 5, 3), (1, 7, 8, 1)])
    {0: [2, 9], 1: [7, 8]}
"""

from __future__ import annotations

import logging
import math
import threading
import time
import uuid
import zlib
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import msgspec
from apache_beam.metrics import Metrics
from apache_beam.transforms import trigger, window
from apache_beam.utils.windowed_value import PaneInfoTiming

from pipelines.commit import (
    CommitConflict,
    DatasetLayout,
    DatasetManifest,
    commit_lock,
    carry_late_state,
    commit_staged,
    committed_episodes,
    held_episode_ids,
    load_held_state,
    load_prior_norm,
    read_manifests,
    read_snapshot,
    recover,
)
from pipelines.groups import DEFAULT_GROUP_TIMEOUT_S
from pipelines.late import DEFAULT_LATE_RETENTION_S
from pipelines.recipes import Recipe
from pipelines.sinks import STAGED_SUFFIX, stage_files
from pipelines.types import METRICS_NAMESPACE, RawRecords
from schemas import locations as loc
from schemas.commit_log import Snapshot
from schemas.locations import join, parquet_rows

__all__ = ["CommitWindows", "CommitPending", "batch_offsets", "merge_offsets", "made_by_job"]

_LOG = logging.getLogger(__name__)

#: Keys of a window pane's grouped elements.
_PARTS = ("episodes", "incomplete", "evaluations", "dead_letters", "late", "offsets", "feedback")


_LOCKS: dict[tuple[str, str], threading.Lock] = {}
_LOCKS_GUARD = threading.Lock()


def _process_lock(layout: DatasetLayout) -> threading.Lock:
    """The lock this process's pane writers of one dataset version take turns on (object stores: no ``flock``)."""
    with _LOCKS_GUARD:
        return _LOCKS.setdefault((layout.root, layout.version), threading.Lock())


def _pane_key(win: Any, pane: Any) -> str:
    """8 hex digits naming a window pane within a job (its window, timing and index)."""
    where = f"{float(win.start)},{float(win.end)}" if isinstance(win, window.IntervalWindow) else "global"
    return f"{zlib.crc32(f'{where}/{pane.timing}/{pane.index}'.encode()):08x}"


def made_by_job(manifest: DatasetManifest, job: str) -> bool:
    """Whether a stream commit on an object store was made by ``job`` (staged as ``<n>-<job><pane><attempt>``).

    ``job`` may be a job's id or a job's id and a pane's key (that pane's commit).

    Examples:
        >>> from pipelines.commit import CommittedFile
        >>> m = DatasetManifest(commit=2, version="v", recipe_hash="h", source="kafka", files=[
        ...     CommittedFile(path="_state/norm-h.json", staged="_staging/v/00000002-0a1b2c3dee/state/norm.json")])
        >>> made_by_job(m, "0a1b2c3d"), made_by_job(m, "ffffffff")
        (True, False)
    """
    name = manifest.files[0].staged.split("/")[2] if manifest.files else ""  # _staging/<V>/<name>/...
    return bool(job) and "-" in name and name.split("-", 1)[1].startswith(job)


def batch_offsets(batch: RawRecords) -> tuple[int, int, int, int]:
    """``(partition, first offset, last offset + 1, records)`` of a source batch."""
    return batch.partition, min(batch.offsets), max(batch.offsets) + 1, len(batch)


def merge_offsets(ranges: Iterable[tuple[int, int, int, int]]) -> dict[int, list[int]]:
    """``partition -> [min start, max end)`` of the batches of one pane."""
    out: dict[int, list[int]] = {}
    for partition, start, end, _ in ranges:
        cur = out.setdefault(partition, [start, end])
        cur[0], cur[1] = min(cur[0], start), max(cur[1], end)
    return dict(sorted(out.items()))


class _CommitPaneFn(beam.DoFn):
    """All elements of one window pane (or the end-of-stream pending state) → one dataset commit."""

    def __init__(self, out: str, recipe: Recipe, *, topic: str, shards: int,
                 group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
                 late_retention_s: float = DEFAULT_LATE_RETENTION_S, max_future_s: float = math.inf,
                 tokenizer: str | None = None, job: str = "") -> None:
        self._out, self._recipe, self._topic, self._shards = out, recipe, topic, shards
        self._job = job
        self._tokenizer_dir = tokenizer
        self._tokenizer = None  # loaded in setup() (a worker-side object, not pickled with the DoFn)
        self._feedback = {k: Metrics.counter(METRICS_NAMESPACE, k) for k in ("feedback_events", "duplicates")}
        self._timeout_s, self._retention_s, self._max_future_s = group_timeout_s, late_retention_s, max_future_s
        self._layout = DatasetLayout(out=out, version=recipe.version, recipe_hash=recipe.content_hash)
        self._complete: set[str] = set()  # episode ids committed complete
        self._incomplete: set[str] = set()  # ... and committed as incomplete
        self._manifests_seen = 0
        # Source batches of panes with nothing to commit (records of still-open episodes, or a
        # late pane of offsets alone): recorded with this writer's next commit.
        self._carried: list[tuple[int, int, int, int]] = []
        self._commits = Metrics.counter(METRICS_NAMESPACE, "stream_commits")
        self._conflicts = Metrics.counter(METRICS_NAMESPACE, "stream_commit_conflicts")
        self._replayed = Metrics.counter(METRICS_NAMESPACE, "episodes_already_committed")
        self._groups = {k: Metrics.counter(METRICS_NAMESPACE, k) for k in ("groups_released", "groups_timed_out")}

    def _refresh(self, manifests: list[DatasetManifest]) -> None:
        # Other writers (other panes, earlier jobs) committed since we last looked.
        self._add(manifests[self._manifests_seen:])
        self._manifests_seen = len(manifests)

    def _add(self, manifests: list[DatasetManifest]) -> None:
        new = committed_episodes(self._layout, manifests)
        self._complete |= new.complete
        self._incomplete |= new.incomplete

    def setup(self) -> None:
        from pipelines.feedback import load_correction_tokenizer

        self._tokenizer = load_correction_tokenizer(self._tokenizer_dir) if self._tokenizer_dir else None

    def _stage_feedback(self, layout: DatasetLayout, items: list, n: int,
                        manifests: list[DatasetManifest]) -> dict[str, int]:
        """The pane's feedback file and corrections (pipelines/feedback.py); never applied to rewards here."""
        from pipelines.feedback import committed_feedback_ids, stage_corrections, write_feedback_file

        _, written, dups = write_feedback_file(items, layout.staging(n), recipe=self._recipe, commit=n,
                                               seen=committed_feedback_ids(layout.out, manifests))
        corrections = stage_corrections(layout.out, layout.staging(n), recipe=self._recipe, commit=n,
                                        manifests=manifests, tokenizer=self._tokenizer,
                                        tokenizer_name=self._tokenizer_dir or "")
        return {"feedback_events": written, "feedback_duplicates": dups, **corrections}

    def process(self, element: tuple[Any, dict[str, Iterable[Any]]], win=beam.DoFn.WindowParam,
                pane=beam.DoFn.PaneInfoParam) -> Iterator[int]:
        n = self._commit(element[1], win, pane)
        if n is not None:
            yield n

    def _commit(self, parts: dict[str, Iterable[Any]], win: Any, pane: Any) -> int | None:
        got = {k: list(parts.get(k, ())) for k in (*_PARTS, "pending")}
        if not self._layout.remote:
            with commit_lock(self._layout):
                done = self._commit_once(self._layout, got, win, pane)
        else:
            # No flock on an object store: this job's pane writers (parallel bundles of one process) take turns
            # on a process lock, and a commit the commit log refuses (another process committed since the
            # snapshot it was planned on) is planned again on top of the winner's commit -- what a local
            # writer does after waiting for the lock.
            # The staging name <n>-<job><pane><attempt> also tells a retried bundle that its pane is committed.
            pane_id = self._job + _pane_key(win, pane) if self._job else None
            with _process_lock(self._layout):
                while True:
                    layout = msgspec.structs.replace(self._layout, run=(pane_id or "") + uuid.uuid4().hex[:8])
                    try:
                        done = self._commit_once(layout, got, win, pane, pane_id=pane_id)
                        break
                    except CommitConflict as err:
                        self._conflicts.inc()
                        _LOG.warning("%s; planning the pane's commit again on top of it", err)
        if done is None:
            return None
        n, increments = done
        for counter, k in increments:
            counter.inc(k)
        self._commits.inc()  # steps are counted in the manifests (run_stream sums them)
        return n

    def _commit_once(self, layout: DatasetLayout, got: dict[str, list[Any]], win: Any, pane: Any, *,
                     pane_id: str | None = None) -> tuple[int, list[tuple[Any, int]]] | None:
        """One attempt at the pane's commit (under the commit lock, or its object-store stand-in).

        ``pane_id`` (object stores): ``<job><pane>``, the prefix of this pane's staging names; a manifest
        staged under it means a retry of a bundle whose commit was made (it failed after its manifest):
        recovered, nothing more to commit.

        Returns:
            None when the pane has nothing to commit, else ``(commit number, metric increments)``: the
            increments are applied by the caller once the commit is made (an attempt that loses the race
            counts nothing).

        Raises:
            CommitConflict: (object stores) another process made this commit number first.
        """
        recover(layout)
        snapshot, manifests = read_snapshot(layout)  # the commit is made against this read of the log
        self._refresh(manifests)
        if pane_id is not None:
            made = [m.commit for m in manifests if made_by_job(m, pane_id)]
            if made:
                _LOG.warning("pane %s of window %s was committed as %s before its bundle failed (recovered); "
                             "not committing it again", pane, win, made[0])
                return None
        is_window = isinstance(win, window.IntervalWindow)
        held = load_held_state(layout, manifests)
        emitted = self._complete | held_episode_ids(held)  # held rows were emitted too
        seen = emitted | self._incomplete
        # Complete rows once per episode (a late completion follows its incomplete row); incomplete ones once.
        complete = sorted((e for e in got["episodes"] if e.episode_id not in emitted), key=lambda e: e.episode_id)
        incomplete = sorted((e for e in got["incomplete"] if e.episode_id not in seen), key=lambda e: e.episode_id)
        # Evaluation episodes (pipelines/evaluations.py) go to evaluations/ only, once each the same way.
        evals = sorted((e for e in got["evaluations"]
                        if e.episode_id not in (emitted if e.complete else seen)), key=lambda e: e.episode_id)
        replayed = (len(got["episodes"]) + len(got["incomplete"]) + len(got["evaluations"])
                    - len(complete) - len(incomplete) - len(evals))
        pending = [f for f in got["pending"] if f[0] not in seen]
        dead = got["dead_letters"]
        # Events kept for an incomplete episode go with its row; a completion's late events with its row.
        late = [i for i in got["late"] if not (i.reason is None and i.episode_id in seen)
                and not (i.reason == "completed" and i.episode_id in emitted)]
        offsets = self._carried + got["offsets"]
        if not (complete or incomplete or evals or pending or dead or late or got["feedback"]):
            self._carried = offsets  # only open episodes' records, or a replayed pane
            self._replayed.inc(replayed)
            return None
        n = len(manifests) + 1
        try:
            written, increments = self._stage_and_commit(
                layout, snapshot, manifests, held=held if is_window else None, emitted=emitted, complete=complete,
                incomplete=incomplete, evals=evals, pending=pending, dead=dead, late=late, offsets=offsets,
                feedback=got["feedback"], win=win if is_window else None, pane=pane)
        except CommitConflict:
            raise
        except Exception as err:
            # On an object store a recovery by another process deletes the staging of a number it has seen
            # committed: this attempt then fails on its own files being gone -- it lost the race for n.
            if layout.remote and len(read_manifests(layout)) >= n:
                loc.delete_dir(layout.staging(n))
                raise CommitConflict.of(n, layout.version, layout.out) from err
            raise
        self._carried = []
        self._add([written])  # held episodes are not in it
        self._manifests_seen = n
        return n, [(self._replayed, replayed), *increments]

    def _stage_and_commit(self, layout: DatasetLayout, snapshot: Snapshot, manifests: list[DatasetManifest], *,
                          held: Any, emitted: set[str], complete: list, incomplete: list, evals: list,
                          pending: list, dead: list, late: list, offsets: list, feedback: list, win: Any,
                          pane: Any) -> tuple[DatasetManifest, list[tuple[Any, int]]]:
        """Stage the pane's commit on top of ``snapshot`` and make it: ``(the manifest written, metric increments)``.

        Raises:
            CommitConflict: another writer committed since ``snapshot`` (its staging is deleted).
        """
        n = snapshot.head + 1
        recipe = self._recipe
        prior = load_prior_norm(layout)
        # An event time further ahead of the wall clock than max_future_s (a fast producer) is not news of
        # the clock: it would time out every held group and age the late state at once.
        latest = time.time() + self._max_future_s
        times = [min(e.last_event_time.timestamp(), latest) for e in complete + incomplete + evals]
        clock_s = max([manifests[-1].clock_s if manifests else 0.0, *times])
        staged = stage_files(layout.staging(n), recipe, commit=n, episodes=complete + incomplete,
                             evaluations=evals, pending=pending, dead_letters=dead, late=late, prior=prior.stats,
                             held=held, clock_s=clock_s,
                             group_timeout_s=self._timeout_s, shards=self._shards)
        feedback_counts = self._stage_feedback(layout, feedback, n, manifests)
        # Steps written: this pane's released groups plus the held members released with them.
        steps = sum(parquet_rows(join(layout.staging(n), f + STAGED_SUFFIX))
                    for f in staged.files if f.startswith("steps/"))
        eval_done = [e for e in evals if e.complete]
        eval_open = [e for e in evals if not e.complete]
        fresh = [e for e in complete + eval_done if not e.completed_late]
        counts = {
            "events_in": sum(r[3] for r in offsets), "episodes": len(fresh), "steps": steps,
            "dead_letters": len(dead), "incomplete_episodes": len(incomplete) + len(eval_open),
            "pending_episodes": len(pending),
            "events_used": sum(e.num_events for e in fresh),
            "events_incomplete": sum(e.num_events for e in incomplete + eval_open),
            "events_pending_out": sum(len(f[1]) for f in pending),
            "episodes_excluded": sum(not e.trainable for e in complete),
            "late_events": sum(len(i.late) for i in late),
            "episodes_completed_late": len(complete) + len(eval_done) - len(fresh),
            "evaluations": len(eval_done),
            **staged.counts, **feedback_counts,
        }
        increments = [(c, staged.counts.get(k, 0)) for k, c in self._groups.items()]
        increments += [(self._feedback["feedback_events"], feedback_counts["feedback_events"]),
                       (self._feedback["duplicates"], feedback_counts["feedback_duplicates"])]
        manifest = DatasetManifest(
            commit=n, version=recipe.version, recipe_hash=recipe.content_hash, source="kafka", mode="stream",
            recipe=msgspec.to_builtins(recipe), counts=counts,
            offsets={self._topic: merge_offsets(offsets)} if offsets else {},
            window=[float(win.start), float(win.end)] if win is not None else None,
            pane=f"{PaneInfoTiming.to_string(pane.timing)}/{pane.index}",
            clock_s=clock_s,
            late_state=carry_late_state(layout, manifests[-1] if manifests else None, layout.staging(n),
                                        clock_s=clock_s, retention_s=self._retention_s, drop=emitted),
        )
        return commit_staged(layout, manifest, prior_norm=prior, snapshot=snapshot), increments


def _keyed():
    return beam.Map(lambda x: (0, x)).with_input_types(Any).with_output_types(tuple[int, Any])


class CommitWindows(beam.PTransform):
    """Window the job's outputs by event time and commit each window pane (see the module docstring).

    Input: a dict of PCollections — ``episodes`` (complete, rewarded and
    clipped, not yet normalized), ``incomplete`` (Episodes), ``evaluations``
    (evaluation episodes, complete or not: pipelines/evaluations.py), ``dead_letters``
    (DeadLetter), ``late`` (:class:`~pipelines.late.LateEpisode`),
    ``offsets`` (:func:`batch_offsets` of every source batch) and ``feedback``
    (``(Feedback, attached)``: a pane's feedback file and corrections, pipelines/feedback.py).

    Args:
        out: the dataset root (a filesystem every worker shares).
        recipe: the recipe (names the version).
        topic: the Kafka topic (names the offsets in the manifests).
        window_s: fixed event-time window length, seconds.
        allowed_lateness_s: how long after a window's end late elements still
            get a (late) commit.
        shards: files per (table, domain) per commit.
        group_timeout_s: event-time seconds a GRPO group waits for missing members.
        late_retention_s: event-time seconds the late state keeps an incomplete episode's events.
        max_future_s: an episode's last event time counts on a commit's clock at most this far
            ahead of the wall clock at the commit.
        tokenizer: model directory whose tokenizer turns corrections into samples (pipelines/feedback.py).
        job: (object stores) 8 hex digits naming this job run in its staging names (:func:`made_by_job`);
            empty: panes are not told apart from other jobs' (no retried-bundle check).

    Returns:
        PCollection of the commit numbers made.
    """

    def __init__(self, out: str | Path, recipe: Recipe, *, topic: str, window_s: float = 10.0,
                 allowed_lateness_s: float = 3600.0, shards: int = 1,
                 group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
                 late_retention_s: float = DEFAULT_LATE_RETENTION_S, max_future_s: float = math.inf,
                 tokenizer: str | None = None, job: str = "") -> None:
        super().__init__()
        if window_s <= 0 or allowed_lateness_s < 0 or shards < 1 or group_timeout_s < 0:
            raise ValueError("`window_s` must be > 0, `allowed_lateness_s` and `group_timeout_s` >= 0 and "
                             "`shards` >= 1")
        self._out, self._recipe, self._topic = str(out), recipe, topic
        self._window_s, self._lateness_s, self._shards = window_s, allowed_lateness_s, shards
        self._timeout_s, self._retention_s, self._max_future_s = group_timeout_s, late_retention_s, max_future_s
        self._tokenizer, self._job = tokenizer, job

    def expand(self, pcolls: dict[str, beam.PCollection]):
        windowed = {}
        for name in _PARTS:
            if name == "feedback" and name not in pcolls:  # optional: a job that splits out no feedback
                continue
            windowed[name] = (
                pcolls[name]
                | f"Window{name.title()}" >> beam.WindowInto(
                    window.FixedWindows(self._window_s),
                    trigger=trigger.AfterWatermark(late=trigger.AfterCount(1)),
                    accumulation_mode=trigger.AccumulationMode.DISCARDING,
                    allowed_lateness=self._lateness_s,
                )
                | f"Key{name.title()}" >> _keyed()
            )
        return (
            windowed
            | "GroupPane" >> beam.CoGroupByKey()
            | "CommitPane" >> beam.ParDo(_CommitPaneFn(self._out, self._recipe, topic=self._topic,
                                                       shards=self._shards, group_timeout_s=self._timeout_s,
                                                       late_retention_s=self._retention_s,
                                                       max_future_s=self._max_future_s, tokenizer=self._tokenizer,
                                                       job=self._job))
        )


class CommitPending(beam.PTransform):
    """Commit the episodes still open when the stream ends (one global-window pane) as pending state.

    Input: ``(episode_id, events)`` from :class:`pipelines.assemble.AssembleEpisodesStreaming`'s
    ``pending`` output. The commit writes ``_state/<V>/pending-<n>.arrow``, which
    the next run of the streaming job feeds back into the assembler. ``job``: as for :class:`CommitWindows`.
    """

    def __init__(self, out: str | Path, recipe: Recipe, *, topic: str,
                 late_retention_s: float = DEFAULT_LATE_RETENTION_S, job: str = "") -> None:
        super().__init__()
        self._out, self._recipe, self._topic = str(out), recipe, topic
        self._retention_s, self._job = late_retention_s, job

    def expand(self, pending: beam.PCollection):
        return (
            pending
            # Fires once, when the watermark reaches the end of time (the stream stopped).
            | "GlobalWindow" >> beam.WindowInto(window.GlobalWindows(), trigger=trigger.AfterWatermark(),
                                                accumulation_mode=trigger.AccumulationMode.DISCARDING)
            | "Key" >> beam.Map(lambda f: (0, f))
            | "GroupAll" >> beam.GroupByKey()
            | "AsParts" >> beam.MapTuple(lambda k, fs: (k, {"pending": list(fs)}))
            | "CommitPending" >> beam.ParDo(_CommitPaneFn(self._out, self._recipe, topic=self._topic, shards=1,
                                                          late_retention_s=self._retention_s, job=self._job))
        )
