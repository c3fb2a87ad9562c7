"""Evaluation as data, end to end: sandboxed rollouts → Kafka → Beam job → evaluations table, never training data.

One Kafka topic carries training rollouts and held-out evaluations (real
environments and sandboxes; the scripted solver with the tiny model's
tokenizer, so every episode is tokenized and would be trainable); a tiny model
(``trajpipe model init-tiny``) is published as version 1 on the control topic
and ``trajpipe eval --policy-version latest --policy hf`` evaluates it. The
trajectory job then writes the evaluation episodes to ``evaluations/`` with
the pass counts the evaluator saw, and the training tables and the trainer's
data loader hold the training episodes only.
"""

from __future__ import annotations

import json
import os
import signal
import subprocess
import sys
import threading
import time
from pathlib import Path

import duckdb
import pytest

from typer.testing import CliRunner

from pipelines.query import register_views
from pipelines.trajectory_job import run as run_job
from rollout.evaluate import EvalConfig, run_evaluation
from rollout.heldout import heldout_tasks
from rollout.policies.scripted import ScriptedPolicy
from rollout.reload import make_policy_published
from rollout.worker import RolloutConfig, RolloutWorker, make_scheduler
from streams.admin import ensure_topics
from streams.config import KafkaConnection, Topics
from streams.producer import EventProducer
from trainer.data import TrajectoryLoader, TrajectoryStream
from trajpipe.cli import app

pytestmark = [pytest.mark.integration, pytest.mark.slow]

ROOT = Path(__file__).resolve().parents[2]


def _trajpipe(*args: str, env: dict[str, str]):
    """Run a ``trajpipe`` command in this process (a new interpreter would spend ~30 s importing torch again)."""
    return CliRunner().invoke(app, list(args), env=env)


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    model = tmp_path_factory.mktemp("tiny") / "model"
    made = _trajpipe("model", "init-tiny", "--out", str(model), env={})
    assert made.exit_code == 0, made.output
    return model


def _env(topics: Topics, spool: Path) -> dict[str, str]:
    return {"TRAJPIPE_TOPICS__EVENTS": topics.events, "TRAJPIPE_TOPICS__CONTROL": topics.control,
            "TRAJPIPE_TOPICS__DEAD_LETTERS": topics.dead_letters, "TRAJPIPE_TOPICS__PARTITIONS": str(topics.partitions),
            "TRAJPIPE_SPOOL_DIR": str(spool)}


def _publish(conn: KafkaConnection, topics: Topics, version: int, location: Path, spool: Path) -> None:
    with EventProducer(conn, topics.control, spool_dir=spool) as producer:
        producer.emit(make_policy_published(version=version, location=str(location), producer_id="test",
                                            lineage="e2e", parent_version=version - 1 or None))
        assert producer.flush().spooled == 0


def test_eval_episodes_reach_only_the_evaluations_table(kafka_broker, topic_name, sandbox_root, tiny_model, tmp_path):
    from transformers import AutoTokenizer

    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, client_id="test-eval-e2e")
    topics = Topics(events=topic_name, control=f"{topic_name}.control", dead_letters=f"{topic_name}.dl",
                    partitions=2)
    ensure_topics(conn, topics)
    env = _env(topics, tmp_path / "spool")
    model = tiny_model
    tokenizer = AutoTokenizer.from_pretrained(model)

    # Training rollouts and a scripted evaluation (noise: some held-out tasks fail), on one topic.
    def scripted(version: int) -> ScriptedPolicy:
        return ScriptedPolicy(noise=0.5, seed=3, policy_version=version, tokenizer=tokenizer, max_prompt_tokens=1536)

    t0 = time.monotonic()
    with EventProducer(conn, topics.events, spool_dir=tmp_path / "spool-test") as producer:
        train = RolloutWorker(scripted(0), emit=producer.emit,
                              config=RolloutConfig(episodes=6, concurrency=2, max_steps=8, run_id="train"),
                              scheduler=make_scheduler(["math", "code"], seed=0)).run()
        cfg = EvalConfig(domains=("math", "code"), levels=(0, 1), tasks_per_level=2, max_steps=8, concurrency=2)
        t1 = time.monotonic()
        scripted_eval = run_evaluation(scripted(0), emit=producer.emit, config=cfg, eval_run="eval-scripted")
        t2 = time.monotonic()
        # The tiny model is published as version 1 on the control topic, as the trainer does.
        _publish(conn, topics, 1, model, tmp_path / "spool-ctl")
        assert producer.flush().spooled == 0
    assert train.episodes == 6 and scripted_eval.episodes == 8 and scripted_eval.errors == 0
    assert 0 < scripted_eval.passed < scripted_eval.episodes, "noise 0.5 should fail some and pass some"

    # On-demand evaluation of the newest published version with the hf policy (greedy).
    ev = _trajpipe("eval", "--bootstrap", kafka_broker.bootstrap, "--policy-version", "latest", "--policy", "hf",
                   "--domains", "math", "--levels", "0", "--tasks-per-level", "2", "--max-steps", "2",
                   "--max-tokens", "16", env=env)
    assert ev.exit_code == 0, ev.output
    t3 = time.monotonic()
    hf_eval = json.loads(ev.stdout.strip().splitlines()[-1])
    assert (hf_eval["policy_version"], hf_eval["episodes"], hf_eval["policy_lineage"]) == (1, 2, "e2e")
    assert hf_eval["by_domain_level"]["math/0"]["episodes"] == 2
    missing = _trajpipe("eval", "--bootstrap", kafka_broker.bootstrap, "--policy-version", "9", env=env)
    assert missing.exit_code == 2 and "policy version 9 is not published" in missing.stderr

    # The trajectory job over the topic.
    out = tmp_path / "datasets"
    counts = run_job(["--source", "kafka", "--bootstrap", kafka_broker.bootstrap, "--topic", topics.events,
                      "--out", str(out)])
    assert (counts["episodes"], counts["evaluations"], counts["dead_letters"]) == (6 + 8 + 2, 10, 0)
    print(f"train rollouts {t1 - t0:.0f} s, scripted eval {t2 - t1:.0f} s, hf eval CLI {t3 - t2:.0f} s, "
          f"job {time.monotonic() - t3:.0f} s")

    con = duckdb.connect()
    register_views(con, data=out)
    per_version = dict(con.execute("select policy_version, sum(passed::int) || '/' || count(*) from evaluations "
                                   "group by 1").fetchall())
    assert per_version == {0: f"{scripted_eval.passed}/8", 1: f"{hf_eval['passed']}/2"}
    by_cell = {f"{d}/{lvl}": (n, k) for d, lvl, n, k in con.execute(
        "select domain, difficulty, episodes, passed from evaluation_pass_rates where policy_version = 0").fetchall()}
    assert by_cell == {key: (c.episodes, c.passed) for key, c in scripted_eval.by_domain_level.items()}
    runs = dict(con.execute("select policy_version, any_value(eval_run) from evaluations group by 1").fetchall())
    assert runs == {0: "eval-scripted", 1: hf_eval["eval_run"]}
    eval_ids = {r[0] for r in con.execute("select episode_id from evaluations").fetchall()}
    assert len(eval_ids) == 10
    held_out = {t.task_id for d in ("math", "code") for lvl in (0, 1) for t in heldout_tasks(d, lvl, 2)}
    assert {r[0] for r in con.execute("select task_id from evaluations").fetchall()} <= held_out
    train_ids = {r[0] for r in con.execute("select episode_id from trajectories").fetchall()}
    assert len(train_ids) == 6 and not train_ids & eval_ids
    assert not {r[0] for r in con.execute("select distinct episode_id from steps").fetchall()} & eval_ids
    assert not {r[0] for r in con.execute("select task_id from trajectories").fetchall()} & held_out

    # The trainer's loader yields training episodes only.
    stream = TrajectoryStream(out, seq_len=2048, batch_size=2, shuffle=False)
    yielded = {e for batch in TrajectoryLoader(stream) for e in batch.episode_ids}
    assert yielded and yielded <= train_ids and not yielded & eval_ids


def test_follow_evaluates_each_new_version_and_stops_cleanly_on_sigterm(kafka_broker, topic_name, tiny_model,
                                                                         tmp_path):
    """``trajpipe eval --follow`` (its own process): waits for a first version, evaluates v1 then v2 as they are
    published, and exits 0 on SIGTERM with its events flushed."""
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, client_id="test-eval-follow")
    topics = Topics(events=topic_name, control=f"{topic_name}.control", dead_letters=f"{topic_name}.dl",
                    partitions=1)
    ensure_topics(conn, topics)
    env = {**os.environ, **_env(topics, tmp_path / "spool"), "PYTHONPATH": str(ROOT)}
    proc = subprocess.Popen([sys.executable, "-m", "trajpipe", "eval", "--bootstrap", kafka_broker.bootstrap,
                             "--policy-version", "latest", "--follow", "--domains", "math", "--levels", "0",
                             "--tasks-per-level", "1", "--max-steps", "1", "--max-tokens", "8"],
                            cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True)
    lines: list[dict] = []
    reader = threading.Thread(target=lambda: lines.extend(json.loads(ln) for ln in proc.stdout), daemon=True)
    reader.start()

    def wait_for(n: int) -> None:
        deadline = time.monotonic() + 240
        while len(lines) < n and proc.poll() is None and time.monotonic() < deadline:
            time.sleep(0.2)
        assert len(lines) >= n, (lines, proc.poll())

    try:
        time.sleep(2)  # nothing published yet: the evaluator waits, it does not fail
        assert proc.poll() is None
        _publish(conn, topics, 1, tiny_model, tmp_path / "spool-ctl")
        wait_for(1)
        _publish(conn, topics, 2, tiny_model, tmp_path / "spool-ctl")
        wait_for(2)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(timeout=60) == 0, proc.stderr.read()
    finally:
        if proc.poll() is None:
            proc.kill()
    reader.join(timeout=10)
    assert [(ln["policy_version"], ln["episodes"]) for ln in lines] == [(1, 1), (2, 1)]
    assert lines[0]["eval_run"] != lines[1]["eval_run"]
