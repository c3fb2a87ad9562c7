"""CommittedView (the committed state the workers read) and the staged count files, on small inputs."""

from __future__ import annotations

import shutil

import apache_beam as beam
import polars as pl
import pytest
from apache_beam.testing.util import assert_that, equal_to

from pipelines.commit import DatasetLayout, committed_episodes, read_manifests
from pipelines.committed import CommittedView
from pipelines.counts import COUNTS_TAG, BundleCounts, StageCounts, read_staged_counts
from pipelines.recipes import load_recipe
from pipelines.testhooks import run_batch_on_records
from pipelines.types import RawRecords
from schemas.codec import encode_event
from tests.pipelines.helpers import episodes, flat, make_pipeline


def _batch(eps, first_offset: int = 0) -> RawRecords:
    events = flat(eps)
    return RawRecords(topic="trajpipe.events", partition=0,
                      offsets=list(range(first_offset, first_offset + len(events))),
                      keys=[e.episode_id.encode() for e in events], values=[encode_event(e) for e in events],
                      timestamps_ms=[0] * len(events))


def test_view_reads_what_the_driver_read_and_not_a_replaced_dataset(tmp_path):
    recipe = load_recipe("outcome")
    out = tmp_path / "out"
    layout = DatasetLayout(out=str(out), version=recipe.version, recipe_hash=recipe.content_hash)
    # whole GRPO groups (synthetic episodes come in groups of 4), so nothing is held back
    a, b = episodes(8, seed=1), episodes(8, seed=2)
    run = lambda eps: run_batch_on_records([_batch(eps)], out=out, recipe=recipe)  # noqa: E731
    assert run(a[:4])["episodes"] == 4
    assert run(a)["duplicates"] == len(flat(a[:4]))  # a[:4] again: duplicates, found through the view
    view = CommittedView.of(layout, read_manifests(layout))
    assert view.load().emitted == committed_episodes(layout, read_manifests(layout)).complete == {
        e[0].episode_id for e in a}
    # The same path rebuilt from other input: a worker must not take it for the cached one.
    shutil.rmtree(out)
    assert run(b[:4])["episodes"] == 4
    c = run(a[:4] + b)  # commit 2 again, on another history: a[:4] are new here, b[:4] duplicates
    assert (c["episodes"], c["duplicates"]) == (8, len(flat(b[:4])))
    ids = pl.read_parquet(f"{out}/trajectories/**/*.parquet", hive_partitioning=True)["episode_id"].to_list()
    assert sorted(ids) == sorted(e[0].episode_id for e in a[:4] + b)  # each once
    # a view planned on another dataset than the one the worker finds is an error, not a silent mix
    stale = CommittedView(out=str(out), version=recipe.version, recipe_hash=recipe.content_hash, through=2,
                          stamp="2000-01-01T00:00:00+00:00")
    with pytest.raises(Exception, match="not the dataset the job was planned on"):
        stale.load()


class _CountFn(beam.DoFn):
    def __init__(self):
        self._c = BundleCounts(("events_in", "duplicates"))

    def process(self, x):
        self._c["events_in"].inc()
        self._c.inc("duplicates", x % 2)
        yield x

    def finish_bundle(self):
        yield from self._c.output()


def test_bundle_counts_are_summed_into_one_staged_file(tmp_path):
    # 1..10: events_in 10, duplicates = the odd ones, 5; the clock is the max of the clock PCollection
    with make_pipeline() as p:
        out = p | beam.Create(list(range(1, 11))) | beam.ParDo(_CountFn()).with_outputs(COUNTS_TAG, main="main")
        clock = p | "Clock" >> beam.Create([12.5])
        written = (out[COUNTS_TAG], clock) | StageCounts(tmp_path)
        assert_that(written, equal_to(["_counts/bundles.json"]))
    assert read_staged_counts(tmp_path) == ({"events_in": 10, "duplicates": 5}, 12.5)


def test_a_job_that_staged_no_counts_is_an_error(tmp_path):
    with pytest.raises(FileNotFoundError, match="StageCounts"):
        read_staged_counts(tmp_path)
