"""The trainer reads what the real trajectory job writes (its manifests, layout and row groups)."""

from __future__ import annotations

import duckdb
import pytest

from trainer.data import TrajectoryLoader, TrajectoryStream

pytestmark = pytest.mark.integration


def test_stream_reads_every_trainable_episode_of_a_trajectory_job_commit(tmp_path):
    from pipelines.recipes import load_recipe
    from pipelines.testhooks import run_batch_on_records
    from pipelines.types import RawRecords
    from schemas.codec import encode_event
    from streams.synth import generate_episodes

    out = tmp_path / "datasets"
    for commit, seed in ((1, 0), (2, 1)):
        events = [e for ep in generate_episodes(12, seed=seed) for e in ep]
        batch = RawRecords(topic="trajpipe.events", partition=0, offsets=list(range(len(events))),
                           keys=[e.episode_id.encode() for e in events], values=[encode_event(e) for e in events],
                           timestamps_ms=[0] * len(events))
        counts = run_batch_on_records([batch], out=out, recipe=load_recipe("outcome"))
        assert counts["steps"] > 0
    # episodes the trainer must train: a trainable step with a loss token, and a recorded prompt at step 0
    want = {r[0] for r in duckdb.sql(f"""
        select episode_id from read_parquet('{out}/steps/**/*.parquet', hive_partitioning=true)
        group by episode_id
        having bool_or(trainable and list_bool_or(loss_mask))
           and max(case when step_index = 0 then len(observation_token_ids) end) > 0""").fetchall()}
    got = [e for b in TrajectoryLoader(TrajectoryStream(out, seq_len=4096, batch_size=2)) for e in b.episode_ids]
    assert want and len(got) == len(want) and set(got) == want
