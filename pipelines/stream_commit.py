"""CommitWindows: the streaming job's sink — one dataset commit per event-time window pane.

The batch job stages files in Beam and commits from the driver. A streaming
job never returns to the driver, so here each commit is made by a DoFn: all
of a pane's elements are grouped on one constant key (one writer per window
pane), and that writer runs the protocol of :mod:`pipelines.commit` under the
version's commit lock::

    recover → drop episodes already committed or held (by episode_id, over all manifests; an episode
              committed as incomplete may still be committed complete, ``completed_late``)
    → decide GRPO groups (held state of the last commit ⊕ this pane's episodes)
    → normalize (persisted statistics ⊕ the released groups') → stage files and the new held state
    → manifest (commit point: files, Kafka offsets covered, window, pane) → renames

Windowing: ``FixedWindows(window_s)`` on the elements' event time (the
source's Kafka record time), triggered when the watermark passes the end of
the window and again for every late element (``AfterWatermark(late=AfterCount(1))``,
discarding fired panes) for ``allowed_lateness_s``, so a batch the runner
delivers after its window fired lands in a later commit instead of being
dropped. Elements later than that are dropped by the runner: the job counts
their events as ``events_uncommitted`` (outcomes the assembler counted that no
commit holds, :func:`pipelines.trajectory_job.run_stream`); keep
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

Examples:
    >>> merge_offsets([(0, 5, 9, 4), (0, 2, 5, 3), (1, 7, 8, 1)])
    {0: [2, 9], 1: [7, 8]}
"""

from __future__ import annotations

import math
import time
from collections.abc import Iterable, Iterator
from pathlib import Path
from typing import Any

import apache_beam as beam
import msgspec
from apache_beam.metrics import Metrics
from apache_beam.transforms import trigger, window
from apache_beam.utils.windowed_value import PaneInfoTiming

from pipelines.commit import (
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
    recover,
)
from pipelines.groups import DEFAULT_GROUP_TIMEOUT_S
from pipelines.late import DEFAULT_LATE_RETENTION_S
from pipelines.recipes import Recipe
from pipelines.sinks import STAGED_SUFFIX, stage_files
from pipelines.types import METRICS_NAMESPACE, RawRecords
from schemas.locations import join, parquet_rows

__all__ = ["CommitWindows", "CommitPending", "batch_offsets", "merge_offsets"]

#: Keys of a window pane's grouped elements.
_PARTS = ("episodes", "incomplete", "evaluations", "dead_letters", "late", "offsets", "feedback")


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
                 tokenizer: str | None = None) -> None:
        self._out, self._recipe, self._topic, self._shards = out, recipe, topic, shards
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

    def _stage_feedback(self, items: list, n: int, manifests: list[DatasetManifest]) -> dict[str, int]:
        """The pane's feedback file and corrections (pipelines/feedback.py); never applied to rewards here."""
        from pipelines.feedback import committed_feedback_ids, stage_corrections, write_feedback_file

        layout = self._layout
        _, written, dups = write_feedback_file(items, layout.staging(n), recipe=self._recipe, commit=n,
                                               seen=committed_feedback_ids(layout.out, manifests))
        self._feedback["feedback_events"].inc(written)
        self._feedback["duplicates"].inc(dups)
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
        layout, recipe = self._layout, self._recipe
        with commit_lock(layout):
            recover(layout)
            manifests = read_manifests(layout)
            self._refresh(manifests)
            is_window = isinstance(win, window.IntervalWindow)
            held = load_held_state(layout, manifests)
            emitted = self._complete | held_episode_ids(held)  # held rows were emitted too
            seen = emitted | self._incomplete
            got = {k: list(parts.get(k, ())) for k in (*_PARTS, "pending")}
            # Complete rows once per episode (a late completion follows its incomplete row); incomplete ones once.
            complete = sorted((e for e in got["episodes"] if e.episode_id not in emitted), key=lambda e: e.episode_id)
            incomplete = sorted((e for e in got["incomplete"] if e.episode_id not in seen), key=lambda e: e.episode_id)
            # Evaluation episodes (pipelines/evaluations.py) go to evaluations/ only, once each the same way.
            evals = sorted((e for e in got["evaluations"]
                            if e.episode_id not in (emitted if e.complete else seen)), key=lambda e: e.episode_id)
            self._replayed.inc(len(got["episodes"]) + len(got["incomplete"]) + len(got["evaluations"])
                               - len(complete) - len(incomplete) - len(evals))
            pending = [f for f in got["pending"] if f[0] not in seen]
            dead = got["dead_letters"]
            # Events kept for an incomplete episode go with its row; a completion's late events with its row.
            late = [i for i in got["late"] if not (i.reason is None and i.episode_id in seen)
                    and not (i.reason == "completed" and i.episode_id in emitted)]
            if not (complete or incomplete or evals or pending or dead or late or got["feedback"]):
                self._carried += got["offsets"]  # only open episodes' records, or a replayed pane
                return None
            offsets, self._carried = self._carried + got["offsets"], []
            n = len(manifests) + 1
            prior = load_prior_norm(layout)
            # An event time further ahead of the wall clock than max_future_s (a fast producer) is not news of
            # the clock: it would time out every held group and age the late state at once.
            latest = time.time() + self._max_future_s
            times = [min(e.last_event_time.timestamp(), latest) for e in complete + incomplete + evals]
            clock_s = max([manifests[-1].clock_s if manifests else 0.0, *times])
            staged = stage_files(layout.staging(n), recipe, commit=n, episodes=complete + incomplete,
                                 evaluations=evals, pending=pending, dead_letters=dead, late=late, prior=prior.stats,
                                 held=held if is_window else None, clock_s=clock_s,
                                 group_timeout_s=self._timeout_s, shards=self._shards)
            feedback = self._stage_feedback(got["feedback"], n, manifests)
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
                **staged.counts, **feedback,
            }
            for k, c in self._groups.items():
                c.inc(staged.counts.get(k, 0))
            manifest = DatasetManifest(
                commit=n, version=recipe.version, recipe_hash=recipe.content_hash, source="kafka", mode="stream",
                recipe=msgspec.to_builtins(recipe), counts=counts,
                offsets={self._topic: merge_offsets(offsets)} if offsets else {},
                window=[float(win.start), float(win.end)] if is_window else None,
                pane=f"{PaneInfoTiming.to_string(pane.timing)}/{pane.index}",
                clock_s=clock_s,
                late_state=carry_late_state(layout, manifests[-1] if manifests else None, layout.staging(n),
                                            clock_s=clock_s, retention_s=self._retention_s, drop=emitted),
            )
            written = commit_staged(layout, manifest, prior_norm=prior)
            self._add([written])  # held episodes are not in it
            self._manifests_seen = n
        self._commits.inc()  # steps are counted in the manifests (run_stream sums them)
        return n


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

    Returns:
        PCollection of the commit numbers made.
    """

    def __init__(self, out: str | Path, recipe: Recipe, *, topic: str, window_s: float = 10.0,
                 allowed_lateness_s: float = 3600.0, shards: int = 1,
                 group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
                 late_retention_s: float = DEFAULT_LATE_RETENTION_S, max_future_s: float = math.inf,
                 tokenizer: str | None = None) -> None:
        super().__init__()
        if window_s <= 0 or allowed_lateness_s < 0 or shards < 1 or group_timeout_s < 0:
            raise ValueError("`window_s` must be > 0, `allowed_lateness_s` and `group_timeout_s` >= 0 and "
                             "`shards` >= 1")
        self._out, self._recipe, self._topic = str(out), recipe, topic
        self._window_s, self._lateness_s, self._shards = window_s, allowed_lateness_s, shards
        self._timeout_s, self._retention_s, self._max_future_s = group_timeout_s, late_retention_s, max_future_s
        self._tokenizer = tokenizer

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
                                                       max_future_s=self._max_future_s, tokenizer=self._tokenizer))
        )


class CommitPending(beam.PTransform):
    """Commit the episodes still open when the stream ends (one global-window pane) as pending state.

    Input: ``(episode_id, events)`` from :class:`pipelines.assemble.AssembleEpisodesStreaming`'s
    ``pending`` output. The commit writes ``_state/<V>/pending-<n>.arrow``, which
    the next run of the streaming job feeds back into the assembler.
    """

    def __init__(self, out: str | Path, recipe: Recipe, *, topic: str,
                 late_retention_s: float = DEFAULT_LATE_RETENTION_S) -> None:
        super().__init__()
        self._out, self._recipe, self._topic = str(out), recipe, topic
        self._retention_s = late_retention_s

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
                                                          late_retention_s=self._retention_s))
        )
