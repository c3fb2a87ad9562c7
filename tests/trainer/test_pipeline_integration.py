"""The trainer reads what the real trajectory job writes (its manifests and layout)."""

from __future__ import annotations

import duckdb
import pytest

from trainer.data import TrajectoryLoader, TrajectoryStream

pytestmark = pytest.mark.integration


def test_stream_reads_every_step_of_a_trajectory_job_commit(tmp_path):
    from pipelines.recipes import load_recipe
    from pipelines.trajectory_job import run_batch
    from pipelines.types import RawRecords
    from schemas.codec import encode_event
    from streams.synth import generate_episodes

    out = tmp_path / "datasets"
    for commit, seed in ((1, 0), (2, 1)):
        events = [e for ep in generate_episodes(12, seed=seed) for e in ep]
        batch = RawRecords(topic="trajpipe.events", partition=0, offsets=list(range(len(events))),
                           keys=[e.episode_id.encode() for e in events], values=[encode_event(e) for e in events],
                           timestamps_ms=[0] * len(events))
        counts = run_batch(out=out, recipe=load_recipe("outcome"), source="raw", raw_records=[batch])
        assert counts["steps"] > 0
    want = {r[0] for r in duckdb.sql(
        f"select event_id from read_parquet('{out}/steps/**/*.parquet', hive_partitioning=true)").fetchall()}
    got = [i for b in TrajectoryLoader(TrajectoryStream(out, seq_len=4096, batch_size=2)) for i in b.sample_ids]
    assert len(got) == len(want) and set(got) == want
