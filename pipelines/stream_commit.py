"""CommitWindows: the streaming job's sink — one dataset commit per event-time window pane.

The batch job stages files in Beam and commits from the driver. A streaming
job never returns to the driver, so here each commit is made by a DoFn: all
of a pane's elements are grouped on one constant key (one writer per window
pane), and that writer runs the protocol of :mod:`pipelines.commit` under the
version's commit lock::

    recover → drop episodes already committed (by episode_id, over all manifests)
    → normalize (persisted statistics ⊕ this pane's) → stage files
    → manifest (commit point: files, Kafka offsets covered, window, pane) → renames

Windowing: ``FixedWindows(window_s)`` on the elements' event time (the
source's Kafka record time), triggered when the watermark passes the end of
the window and again for every late element (``AfterWatermark(late=AfterCount(1))``,
discarding fired panes) for ``allowed_lateness_s``, so a batch the runner
delivers after its window fired lands in a later commit instead of being
dropped. Elements later than that are dropped by the runner (counted nowhere);
keep ``allowed_lateness_s`` well above the source's read lag.

Normalization is done here, not with ``NormalizeByDomain``'s side input:
the persisted statistics change with every commit of the running job, and a
pane must be normalized with the statistics of every commit before it plus
its own, exactly as a batch micro-batch is (``prior ⊕ run``); a side input
would freeze the prior at job start. The functions are the same
(:func:`pipelines.normalize.stats_of_episodes`, :func:`~pipelines.normalize.normalize_rows`).

Examples:
    >>> merge_offsets([(0, 5, 9, 4), (0, 2, 5, 3), (1, 7, 8, 1)])
    {0: [2, 9], 1: [7, 8]}
"""

from __future__ import annotations

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
    commit_staged,
    committed_episode_ids,
    load_prior_norm,
    read_manifests,
    recover,
)
from pipelines.normalize import stats_of_episodes
from pipelines.recipes import Recipe
from pipelines.sinks import stage_files
from pipelines.types import METRICS_NAMESPACE, RawRecords

__all__ = ["CommitWindows", "CommitPending", "batch_offsets", "merge_offsets"]

#: Keys of a window pane's grouped elements.
_PARTS = ("episodes", "incomplete", "dead_letters", "offsets")


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

    def __init__(self, out: str, recipe: Recipe, *, topic: str, shards: int) -> None:
        self._out, self._recipe, self._topic, self._shards = out, recipe, topic, shards
        self._layout = DatasetLayout(out=out, version=recipe.version, recipe_hash=recipe.content_hash)
        self._committed: set[str] = set()
        self._manifests_seen = 0
        # Source batches of panes with nothing to commit (records of still-open episodes, or a
        # late pane of offsets alone): recorded with this writer's next commit.
        self._carried: list[tuple[int, int, int, int]] = []
        self._commits = Metrics.counter(METRICS_NAMESPACE, "stream_commits")
        self._replayed = Metrics.counter(METRICS_NAMESPACE, "episodes_already_committed")

    def _refresh(self, manifests: list[DatasetManifest]) -> None:
        # Other writers (other panes, earlier jobs) committed since we last looked.
        self._committed |= committed_episode_ids(self._layout, manifests[self._manifests_seen:])
        self._manifests_seen = len(manifests)

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
            fresh = lambda eps: sorted((e for e in eps if e.episode_id not in self._committed),  # noqa: E731
                                       key=lambda e: e.episode_id)
            got = {k: list(parts.get(k, ())) for k in (*_PARTS, "pending")}
            complete, incomplete = fresh(got["episodes"]), fresh(got["incomplete"])
            self._replayed.inc(len(got["episodes"]) + len(got["incomplete"]) - len(complete) - len(incomplete))
            pending = [f for f in got["pending"] if f[0] not in self._committed]
            dead = got["dead_letters"]
            if not (complete or incomplete or pending or dead):
                self._carried += got["offsets"]  # only open episodes' records, or a replayed pane
                return None
            offsets, self._carried = self._carried + got["offsets"], []
            n = len(manifests) + 1
            prior = load_prior_norm(layout)
            run = stats_of_episodes(complete)
            stage_files(layout.staging(n), recipe, commit=n, episodes=complete + incomplete, pending=pending,
                        dead_letters=dead, stats=run, prior=prior.stats, shards=self._shards)
            steps = sum(len(e.steps) for e in complete)
            counts = {
                "events_in": sum(r[3] for r in offsets), "episodes": len(complete), "steps": steps,
                "dead_letters": len(dead), "incomplete_episodes": len(incomplete), "pending_episodes": len(pending),
                "events_used": sum(e.num_events for e in complete),
                "events_incomplete": sum(e.num_events for e in incomplete),
                "events_pending_out": sum(len(f[1]) for f in pending),
            }
            times = [e.last_event_time.timestamp() for e in complete + incomplete]
            is_window = isinstance(win, window.IntervalWindow)
            manifest = DatasetManifest(
                commit=n, version=recipe.version, recipe_hash=recipe.content_hash, source="kafka", mode="stream",
                recipe=msgspec.to_builtins(recipe), counts=counts,
                offsets={self._topic: merge_offsets(offsets)} if offsets else {},
                window=[float(win.start), float(win.end)] if is_window else None,
                pane=f"{PaneInfoTiming.to_string(pane.timing)}/{pane.index}",
                clock_s=max([manifests[-1].clock_s if manifests else 0.0, *times]),
            )
            commit_staged(layout, manifest, prior_norm=prior)
            self._committed |= {e.episode_id for e in complete + incomplete}
            self._manifests_seen = n
        self._commits.inc()  # steps_written is counted by the shard writer
        return n


def _keyed():
    return beam.Map(lambda x: (0, x)).with_input_types(Any).with_output_types(tuple[int, Any])


class CommitWindows(beam.PTransform):
    """Window the job's outputs by event time and commit each window pane (see the module docstring).

    Input: a dict of PCollections — ``episodes`` (complete, rewarded and
    clipped, not yet normalized), ``incomplete`` (Episodes), ``dead_letters``
    (DeadLetter) and ``offsets`` (:func:`batch_offsets` of every source batch).

    Args:
        out: the dataset root (a filesystem every worker shares).
        recipe: the recipe (names the version).
        topic: the Kafka topic (names the offsets in the manifests).
        window_s: fixed event-time window length, seconds.
        allowed_lateness_s: how long after a window's end late elements still
            get a (late) commit.
        shards: files per (table, domain) per commit.

    Returns:
        PCollection of the commit numbers made.
    """

    def __init__(self, out: str | Path, recipe: Recipe, *, topic: str, window_s: float = 10.0,
                 allowed_lateness_s: float = 3600.0, shards: int = 1) -> None:
        super().__init__()
        if window_s <= 0 or allowed_lateness_s < 0 or shards < 1:
            raise ValueError("`window_s` must be > 0, `allowed_lateness_s` >= 0 and `shards` >= 1")
        self._out, self._recipe, self._topic = str(out), recipe, topic
        self._window_s, self._lateness_s, self._shards = window_s, allowed_lateness_s, shards

    def expand(self, pcolls: dict[str, beam.PCollection]):
        windowed = {}
        for name in _PARTS:
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
                                                       shards=self._shards))
        )


class CommitPending(beam.PTransform):
    """Commit the episodes still open when the stream ends (one global-window pane) as pending state.

    Input: ``(episode_id, events)`` from :class:`pipelines.assemble.AssembleEpisodesStreaming`'s
    ``pending`` output. The commit writes ``_state/<V>/pending-<n>.arrow``, which
    the next run of the streaming job feeds back into the assembler.
    """

    def __init__(self, out: str | Path, recipe: Recipe, *, topic: str) -> None:
        super().__init__()
        self._out, self._recipe, self._topic = str(out), recipe, topic

    def expand(self, pending: beam.PCollection):
        return (
            pending
            # Fires once, when the watermark reaches the end of time (the stream stopped).
            | "GlobalWindow" >> beam.WindowInto(window.GlobalWindows(), trigger=trigger.AfterWatermark(),
                                                accumulation_mode=trigger.AccumulationMode.DISCARDING)
            | "Key" >> beam.Map(lambda f: (0, f))
            | "GroupAll" >> beam.GroupByKey()
            | "AsParts" >> beam.MapTuple(lambda k, fs: (k, {"pending": list(fs)}))
            | "CommitPending" >> beam.ParDo(_CommitPaneFn(self._out, self._recipe, topic=self._topic, shards=1))
        )
