"""The round trip that proves the learning signal: what the trainer scores is what the policy saw.

Real sandboxed rollouts of a transformers policy at v0 (>= 3 steps, two domains, GRPO groups)
→ a real Kafka broker → the Beam trajectory job → the trainer's data path (episode windows
rebuilt from the recorded token stream) → log-probs of every recorded action under the
*unchanged* v0 weights, on the recorded sampling distribution. They must equal the behaviour
log-probs the rollout recorded (float32 CPU: max |Δ| <= 1e-4).
"""

from __future__ import annotations

import json

import duckdb
import pytest

from pipelines.inputs import KafkaInput
from tests.helpers import assert_same_rows, read_rows
from pipelines.recipes import load_recipe
from pipelines.trajectory_job import run_batch
from rollout.model import init_tiny_model
from rollout.policies.hf import HFPolicy
from rollout.worker import RolloutConfig, RolloutWorker, make_scheduler
from schemas.events import SamplingParams
from streams.admin import ensure_topics
from streams.config import KafkaConnection, Topics
from streams.producer import EventProducer
from trainer.audit import audit_behaviour_logprobs

pytestmark = pytest.mark.integration


def test_hf_rollouts_round_trip_to_the_trainer_with_their_behaviour_logprobs(kafka_broker, topic_name, tmp_path):
    tiny = init_tiny_model(tmp_path / "tiny", seed=0)
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, request_timeout_ms=10_000)
    topics = Topics(events=topic_name, control=f"{topic_name}.ctl", dead_letters=f"{topic_name}.dl", partitions=3)
    ensure_topics(conn, topics)
    # Tempered nucleus sampling: the distribution the trainer must reproduce is not the raw one.
    policy = HFPolicy.from_pretrained(tiny, sampling=SamplingParams(temperature=0.7, top_p=0.9, max_tokens=16, seed=1))
    with EventProducer(conn, topics.events, spool_dir=tmp_path / "spool") as producer:
        worker = RolloutWorker(policy, emit=producer.emit, scheduler=make_scheduler(["math", "code"], seed=3),
                               config=RolloutConfig(episodes=8, concurrency=4, max_steps=3, group_size=2,
                                                    producer_id="round-trip"))
        counts = worker.run()
        assert producer.flush().spooled == 0
    assert counts.episodes == 8 and counts.groups == 4 and counts.errors == 0

    data = tmp_path / "datasets"
    job = run_batch(out=data, recipe=load_recipe("outcome"), input=KafkaInput(conn=conn, topic=topics.events))
    assert job["episodes"] == 8 and job["dead_letters"] == 0 and job["groups_released"] == 4
    rows = duckdb.sql(f"""select domain, count(distinct episode_id), min(num_steps), sum(len(action_token_ids)),
                                 count(distinct task_group)
                          from read_parquet('{data}/steps/**/*.parquet', hive_partitioning=true)
                          group by domain order by domain""").fetchall()
    assert [r[0] for r in rows] == ["code", "math"]  # two domains, sandboxed code included
    assert all(r[2] >= 3 for r in rows)  # every episode has >= 3 steps
    tokens = sum(r[3] for r in rows)
    # The same job with its episodes assembled, verified, rewarded and staged in 2 forked workers: the same rows.
    forked = run_batch(out=tmp_path / "forked", recipe=load_recipe("outcome"), workers=2,
                       input=KafkaInput(conn=conn, topic=topics.events))
    assert forked == job
    for table in ("steps", "trajectories"):
        assert_same_rows(read_rows(tmp_path / "forked", table), read_rows(data, table))

    audit = audit_behaviour_logprobs(data, tiny, policy_version=0, seq_len=2048)
    assert audit.episodes == 8 and audit.inexact_windows == 0 and audit.episodes_without_context == 0
    assert audit.tokens == tokens  # every recorded action token was compared
    assert audit.outside_support == 0
    assert audit.max_abs_err <= 1e-4, audit

    # The same audit as a command; bad input gets one clear line.
    from typer.testing import CliRunner

    from trajpipe.cli import app

    res = CliRunner().invoke(app, ["audit", "logprobs", "--data", str(data), "--model", str(tiny), "--seq-len", "2048"])
    assert res.exit_code == 0, res.output
    line = json.loads(res.stdout.strip().splitlines()[-1])
    assert line["policy_version"] == 0 and line["tokens"] == tokens and line["max_abs_err"] <= 1e-4
    res = CliRunner().invoke(app, ["audit", "logprobs", "--data", str(data), "--model", str(tiny),
                                   "--policy-version", "7"])
    assert res.exit_code == 2 and "no recorded action of policy version 7" in res.output
    res = CliRunner().invoke(app, ["audit", "logprobs", "--data", str(data), "--model", str(tmp_path)])
    assert res.exit_code == 2 and "is not a model directory" in res.output


@pytest.mark.slow
def test_vllm_rollouts_round_trip_to_the_trainer_with_their_behaviour_logprobs(kafka_broker, topic_name, tmp_path):
    """The same round trip with vLLM as the behaviour engine (`trajpipe rollout --policy vllm`, its own process).

    Measured bound (bench key ``behaviour_logprob_max_abs_err_vllm``): ~1e-6 for the tiny fp32 model on
    vLLM's CPU backend; asserted with margin at 1e-3 (other CPUs pick other kernels).
    """
    import json
    import os
    import subprocess
    import sys

    from tests.rollout.test_worker import REPO

    tiny = init_tiny_model(tmp_path / "tiny", seed=0)
    env = {**os.environ, "TRAJPIPE_TOPICS__EVENTS": topic_name, "TRAJPIPE_TOPICS__CONTROL": f"{topic_name}.ctl",
           "TRAJPIPE_TOPICS__DEAD_LETTERS": f"{topic_name}.dl", "TRAJPIPE_TOPICS__PARTITIONS": "3"}
    proc = subprocess.run(
        [sys.executable, "-m", "trajpipe", "rollout", "--bootstrap", kafka_broker.bootstrap, "--policy", "vllm",
         "--model", str(tiny), "--episodes", "8", "--group-size", "4", "--concurrency", "8", "--max-steps", "3",
         "--max-tokens", "16", "--temperature", "0.7", "--top-p", "0.9", "--domains", "math,code", "--seed", "2",
         "--spool-dir", str(tmp_path / "spool"), "--no-follow-policies"],
        cwd=REPO, env=env, capture_output=True, text=True, timeout=600, check=False)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["episodes"] == 8 and counts["groups"] == 2 and counts["errors"] == 0
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap)
    data = tmp_path / "datasets"
    job = run_batch(out=data, recipe=load_recipe("outcome"), input=KafkaInput(conn=conn, topic=topic_name))
    assert job["episodes"] == 8 and job["groups_released"] == 2
    audit = audit_behaviour_logprobs(data, tiny, policy_version=0, seq_len=2048)
    assert audit.episodes == 8 and audit.tokens > 0 and audit.inexact_windows == 0 and audit.outside_support == 0
    assert audit.max_abs_err <= 1e-3, audit
