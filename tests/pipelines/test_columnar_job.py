"""The columnar path in the job (issue 16, item 1): the same committed files as the per-episode stages, byte for byte.

Real sandboxed rollouts (scripted policy, all four domains) and held-out evaluation episodes (the tiny model through
``trajpipe eval``) → a real Kafka broker, plus a rating sent with ``trajpipe feedback``, a replay of a quarter of
the records (duplicates) and an undecodable record (a dead letter) → the batch job with forked workers assembling
each partition in place, and the same records archived and read back by the job, each once with the plain
episodes verified, rewarded, clipped and staged by the columnar path (:mod:`pipelines.columnar`) and once with
every episode through the per-episode stages. Every Parquet file committed (trajectories, steps, evaluations,
feedback, dead letters) is the same bytes, the counts are the same, and the columnar path took the plain
episodes: all the complete training episodes but those with a replayed record or the feedback.
"""

from __future__ import annotations

import hashlib
import json
import subprocess
import sys
from pathlib import Path

import pyarrow.parquet as pq
import pytest

from pipelines import frames
from pipelines.forked import close_pools
from pipelines.inputs import ArchiveInput, KafkaInput
from pipelines.recipes import load_recipe
from pipelines.trajectory_job import run_batch
from schemas.codec import decode_event
from streams.archive import Archiver
from streams.config import KafkaConnection
from tests.helpers import consume_messages, produce_messages, topic_env
from tests.pipelines.test_counts_from_files import REPO, _rollouts

pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(900)]


def _trajpipe(env: dict, *args: str) -> str:
    proc = subprocess.run([sys.executable, "-m", "trajpipe", *args], cwd=REPO, env=env, capture_output=True, text=True,
                          timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return proc.stdout


def _files(out: Path) -> dict[str, str]:
    return {str(f.relative_to(out)): hashlib.sha256(f.read_bytes()).hexdigest() for f in sorted(out.rglob("*.parquet"))}


def test_the_columnar_path_commits_the_per_episode_paths_files(kafka_broker, topic_name, tmp_path, monkeypatch):
    bootstrap = kafka_broker.bootstrap
    sent = _rollouts(tmp_path, bootstrap, topic_name, episodes=16)
    env = topic_env(topic_name, tmp_path / "spool")
    evaluated = _trajpipe(env, "eval", "--bootstrap", bootstrap, "--policy", "hf", "--model", str(tmp_path / "tiny"),
              "--domains", "math", "--tasks-per-level", "2", "--max-steps", "2", "--max-tokens", "8")
    evaluation = json.loads(evaluated.strip().splitlines()[-1])
    assert evaluation["episodes"] == 2
    records = consume_messages(bootstrap, topic_name, sent["events"] + evaluation["events"])
    assert len(records) == sent["events"] + evaluation["events"]
    training = {ev.episode_id for ev in map(decode_event, (v for _, v in records)) if not ev.episode_id.startswith("eval-")}
    assert len(training) == sent["episodes"]
    # a training episode rated by a reviewer: not plain (the feedback is attached to it)
    rated = next(ev for ev in map(decode_event, (v for _, v in records)) if ev.episode_id in training)
    first = rated.episode_id
    _trajpipe(env, "feedback", "--bootstrap", bootstrap, "--episode", first, "--score", "0.25", "--domain",
              rated.domain, "--task-id", rated.task_id, "--policy-version", str(rated.policy_version),
              "--feedback-id", "fb-1")
    replay = records[: len(records) // 4]
    produce_messages(bootstrap, topic_name, replay + [(b"junk-episode", b"not an event frame")])

    # Which episodes each task's columnar path took, written down by the forked workers (fresh pools see the patch).
    seen = tmp_path / "plain"
    seen.mkdir()
    real = frames.plain_episodes

    def counting(cols, split, picks, *args, **kw):
        out = real(cols, split, picks, *args, **kw)
        (seen / f"{len(list(seen.iterdir()))}-{id(out)}").write_text(json.dumps([p.episode_id for p in out[0]]))
        return out

    monkeypatch.setattr(frames, "plain_episodes", counting)
    monkeypatch.setattr(frames, "PLAIN_CHUNK_EVENTS", 40)  # a task's episodes in several chunks, not one
    close_pools()
    conn = KafkaConnection(bootstrap_servers=bootstrap, client_id="trajpipe-test")
    recipe = load_recipe("verification_shaped", max_steps=3, max_action_tokens=48)
    # The same records archived (streams/archive.py: bucket files, each episode's events together), then read back.
    archive = tmp_path / "archive"
    letters = []
    Archiver(archive, conn=conn, topic=topic_name, buckets=4, dead_letter=lambda rec, err: letters.append(err)).run()
    assert len(letters) == 1  # the junk record
    counts, files, taken, chunks = {}, {}, {}, {}
    try:
        for source, given in (("kafka", KafkaInput(conn=conn, topic=topic_name)), ("archive", ArchiveInput(archive))):
            for columnar in (False, True):
                out = tmp_path / f"{source}-columnar-{columnar}"
                counts[source, columnar] = run_batch(out=out, recipe=recipe, input=given, workers=2,
                                                     columnar=columnar)
                files[source, columnar] = _files(out)
            taken[source] = [e for f in seen.iterdir() for e in json.loads(f.read_text())]
            chunks[source] = len(list(seen.iterdir()))  # plain_episodes calls: one per chunk
            for f in seen.iterdir():
                f.unlink()
    finally:
        close_pools()
    replayed = {key.decode() for key, _ in replay}
    assert counts["archive", True] == counts["archive", False]
    assert files["archive", True] == files["archive", False]  # no dead letter there: the archiver kept the junk one
    assert counts["archive", True]["episodes"] == 18
    assert sorted(taken["archive"]) == sorted(training - replayed - {first})  # the archive keeps copies too

    mine, theirs = counts["kafka", True], counts["kafka", False]
    assert mine == theirs
    assert mine["dead_letters"] == 1 and mine["duplicates"] >= len(replay) > 0
    assert mine["feedback_events"] == 1 and mine["episodes"] == sent["episodes"] + 2 == 18
    mine, theirs = files["kafka", True], files["kafka", False]
    assert {"trajectories", "steps", "evaluations", "dead_letters"} <= {name.split("/")[0] for name in mine}
    # Every committed Parquet file byte for byte; a dead letter's row also says when the run found it.
    letters = {k for k in mine if k.startswith("dead_letters/")}
    assert {k: v for k, v in mine.items() if k not in letters} == {k: v for k, v in theirs.items() if k not in letters}
    assert letters == {k for k in theirs if k.startswith("dead_letters/")}
    for k in letters:
        a, b = (pq.read_table(tmp_path / f"kafka-columnar-{c}" / k) for c in (True, False))
        assert a.drop_columns(["timestamp"]).equals(b.drop_columns(["timestamp"]))

    # no evaluation episode, none with a copy or feedback; each once; chunks cut as the limit says
    assert sorted(taken["kafka"]) == sorted(training - replayed - {first}) != []
    assert chunks["kafka"] > 4 and chunks["archive"] > 4
