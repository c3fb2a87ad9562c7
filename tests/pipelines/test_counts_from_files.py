"""A commit's counts come from what the job wrote, not from the runner's metrics (issue 16, item 5).

Real scripted rollouts in the sandboxed environments → a real Kafka broker
(plus one undecodable record and a replay of some of the rollouts' records:
dead letters and duplicates) → the batch job on FnApiRunner whose results
report **no metrics at all** (as a runner without committed metrics does) →
the counts it returns and writes into the manifest are still exact: they
equal what polars reads from the committed files and what the topic holds,
they reconcile (in = used + incomplete + pending + dead letters + duplicates
+ late + feedback), and a rerun adds nothing. On the same records, the columnar
split (pipelines/columnar.py) finds plain exactly the complete episodes without
a replayed record, and its rewards give those episodes' rows' rewards and returns.
"""

from __future__ import annotations

import json
import subprocess
import sys
from pathlib import Path

import numpy as np
import polars as pl
import pytest
from apache_beam.runners.portability.fn_api_runner import fn_runner

from pipelines.assemble import assemble_episode
from pipelines.columnar import event_columns, segment_rewards, split_plain
from pipelines.inputs import KafkaInput
from pipelines.recipes import load_recipe
from tests.pipelines.test_columnar import assert_plain_rows_are_the_object_paths
from pipelines.trajectory_job import COUNT_KEYS, run_batch
from schemas.codec import EventDecodeError, decode_event
from schemas.manifests import read_dataset_manifests
from streams.config import KafkaConnection
from streams.consumer import end_offsets
from tests.helpers import consume_messages, produce_messages, topic_env

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]

REPO = Path(__file__).resolve().parents[2]
OUTCOMES = ("events_used", "events_incomplete", "events_pending_out", "dead_letters", "duplicates", "late_events",
            "feedback_events")


class _NoMetrics:
    """What a runner without committed metrics answers: nothing."""

    def query(self, _filter=None):
        return {"counters": [], "distributions": [], "gauges": []}


def _rollouts(tmp: Path, bootstrap: str, topic: str, episodes: int) -> dict:
    from rollout.model import init_tiny_model

    tiny = init_tiny_model(tmp / "tiny", seed=0)
    env = topic_env(topic, tmp / "spool")
    proc = subprocess.run(
        [sys.executable, "-m", "trajpipe", "rollout", "--bootstrap", bootstrap, "--policy", "scripted", "--model",
         str(tiny), "--domains", "code,math,docqa,tools", "--concurrency", "4", "--no-follow-policies",
         "--episodes", str(episodes), "--seed", "7"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_counts_are_exact_without_runner_metrics(kafka_broker, topic_name, tmp_path, monkeypatch):
    bootstrap = kafka_broker.bootstrap
    sent = _rollouts(tmp_path, bootstrap, topic_name, episodes=12)
    records = consume_messages(bootstrap, topic_name, sent["events"])
    assert len(records) == sent["events"]
    replay = records[: len(records) // 4]  # a producer retry of a quarter of the records: duplicates
    produce_messages(bootstrap, topic_name, replay + [(b"junk-episode", b"not an event frame")])
    conn = KafkaConnection(bootstrap_servers=bootstrap, client_id="trajpipe-test")
    in_topic = sum(end_offsets(conn, topic_name).values())
    assert in_topic == sent["events"] + len(replay) + 1

    monkeypatch.setattr(fn_runner.RunnerResult, "metrics", lambda self: _NoMetrics())
    out = tmp_path / "out"
    kw = dict(out=out, recipe=load_recipe("outcome"), input=KafkaInput(conn=conn, topic=topic_name))
    counts = run_batch(**kw)

    version = load_recipe("outcome").version
    scan = lambda table: pl.scan_parquet(str(out / table / f"recipe={version}" / "**" / "*.parquet"),  # noqa: E731
                                         hive_partitioning=True)
    trajectories = scan("trajectories").collect()
    complete = trajectories.filter(pl.col("complete"))
    assert counts["events_in"] == in_topic
    assert counts["episodes"] == complete.height == sent["episodes"] == 12
    assert counts["events_used"] == complete["num_events"].sum() == sent["events"]
    assert counts["steps"] == scan("steps").select(pl.len()).collect().item() > 0
    assert counts["dead_letters"] == scan("dead_letters").select(pl.len()).collect().item() == 1
    assert counts["duplicates"] == len(replay) > 0
    assert counts["events_in"] + counts["events_pending_in"] == sum(counts[k] for k in OUTCOMES)
    [manifest] = read_dataset_manifests(out, version)
    assert {k: manifest.counts[k] for k in COUNT_KEYS} == counts
    # the event-time clock came from the staged files too (it was a metric distribution before)
    newest = trajectories["last_event_time"].max().timestamp()
    assert manifest.clock_s == pytest.approx(newest, abs=1e-3)
    assert not (out / "_staging").exists()  # the count files went with the staging directory

    assert set(run_batch(**kw).values()) == {0}  # exactly once: a rerun adds nothing

    # The columnar split (pipelines/columnar.py) on what the topic holds: the plain episodes are the complete ones
    # with no replayed record; the others are left to the object path, which counts their duplicates.
    by_episode: dict[str, list] = {}
    for key, frame in records + replay + [(b"junk-episode", b"not an event frame")]:
        try:
            by_episode.setdefault(key.decode(), []).append(decode_event(frame))
        except EventDecodeError:  # the junk record: a dead letter before the split
            continue
    split = split_plain(event_columns(list(by_episode.items())))
    plain = {e for e, is_plain in zip(by_episode, split.plain) if is_plain}
    replayed = {key.decode() for key, _ in replay}
    assert plain == set(complete["episode_id"]) - replayed and plain and replayed

    # Their rewards and returns by the columnar step 2, from the events alone: the job's rows, bit for bit.
    ids = sorted(plain)
    episodes = [assemble_episode(e, sorted(by_episode[e], key=lambda ev: ev.seq), complete=True, reason=None)
                for e in ids]
    offsets = np.concatenate([[0], np.cumsum([len(ep.steps) for ep in episodes])]).astype(np.int64)
    r, G, _ = segment_rewards(load_recipe("outcome"), offsets=offsets, sigma=np.zeros(offsets[-1]),
                              outcome=np.array([ep.finished.outcome_reward for ep in episodes]),
                              trainable=np.array([ep.trainable for ep in episodes]))
    rows = scan("steps").filter(pl.col("episode_id").is_in(ids)).sort("episode_id", "step_index").collect()
    assert rows.height == offsets[-1] > 0
    assert rows["reward"].to_numpy().tobytes() == r.tobytes()
    assert rows["return_to_go"].to_numpy().tobytes() == G.tobytes()

    # Their rows by the columnar step 3 (domain verifiers run on the real task specs), staged as the object path
    # stages the processed episodes: the same tables, byte for byte, and the same counts; with a clip too.
    for recipe in (load_recipe("verification_shaped"), load_recipe("discounted", max_steps=2, max_action_tokens=24)):
        assert assert_plain_rows_are_the_object_paths(list(by_episode.items()), recipe) == len(plain)
