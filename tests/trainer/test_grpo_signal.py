"""GRPO on real groups carries a learning signal: a few steps raise the good actions and lower the bad ones.

All through the real commands on a real broker, as a user would run them:

1. demonstrations: the scripted solver speaking the tiny model's tokenizer
   (``trajpipe rollout --policy scripted --model``) on a pool of two math tasks → Kafka →
   ``trajpipe pipeline run``;
2. warm start: ``trajpipe train --objective bc`` on them (the offline path) → policy v1;
3. ``trajpipe rollout --policy hf --model v1 --group-size 4`` on the same tasks at
   temperature 1 → Kafka → ``trajpipe pipeline run``: groups of four distinct episodes,
   group advantages over each complete group;
4. the round trip holds for the trained policy too (v1's log-probs come back);
5. ``trajpipe train --objective grpo`` from v1, two steps → v2: the weights change, and
   under v2 the positive-advantage actions are more likely and the negative ones less.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import pytest
import torch
from safetensors.torch import load_file

from rollout.model import init_tiny_model
from trainer.audit import advantage_logprobs, audit_behaviour_logprobs

pytestmark = [pytest.mark.slow, pytest.mark.integration]

REPO = Path(__file__).resolve().parents[2]


def _trajpipe(env: dict, *args: str) -> dict:
    proc = subprocess.run([sys.executable, "-m", "trajpipe", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"trajpipe {' '.join(map(str, args))}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _env(topic: str, spool: Path) -> dict:
    return {**os.environ, "TRAJPIPE_TOPICS__EVENTS": topic, "TRAJPIPE_TOPICS__CONTROL": f"{topic}.ctl",
            "TRAJPIPE_TOPICS__DEAD_LETTERS": f"{topic}.dl", "TRAJPIPE_TOPICS__PARTITIONS": "2",
            "TRAJPIPE_SPOOL_DIR": str(spool)}


def test_grpo_steps_on_real_groups_raise_positive_and_lower_negative_advantage_actions(kafka_broker, topic_name,
                                                                                      tmp_path):
    bootstrap = kafka_broker.bootstrap
    tiny = init_tiny_model(tmp_path / "tiny", seed=0)
    demos_env, rollout_env = _env(f"{topic_name}.demos", tmp_path / "s1"), _env(f"{topic_name}.rl", tmp_path / "s2")
    pool = ["--domains", "math", "--task-pool", "2", "--seed", "7"]

    # 1. demonstrations (two runs of 20: the curriculum would promote the scheduler after 20 passes)
    for _ in range(2):
        demo = _trajpipe(demos_env, "rollout", "--bootstrap", bootstrap, "--policy", "scripted", "--model", tiny,
                         "--episodes", 20, *pool)
        assert demo["passed"] == 20
    demos = tmp_path / "demos"
    assert _trajpipe(demos_env, "pipeline", "run", "--source", "kafka", "--bootstrap", bootstrap,
                     "--out", demos)["episodes"] == 40

    # 2. warm start by behaviour cloning
    (tmp_path / "bc.yaml").write_text(
        "# trajpipe train --config bc.yaml --data demos --model tiny --out bc\n"
        "mode: offline\nmax_steps: 40\nobjective: {name: bc, min_advantage: -1.0e9}\n"
        "data: {seq_len: 1024, batch_size: 4, max_epochs: 1000, num_workers: 0}\n"
        "optim: {lr: 3.0e-3, warmup_steps: 5, schedule: cosine}\nengine: {zero_stage: 0}\n")
    assert _trajpipe(demos_env, "train", "--config", tmp_path / "bc.yaml", "--data", demos, "--model", tiny,
                     "--out", tmp_path / "bc")["policy_version"] == 1
    v1 = tmp_path / "bc" / "policies" / "v1"

    # 3. the warm policy's own rollouts in GRPO groups of four
    rollout = _trajpipe(rollout_env, "rollout", "--bootstrap", bootstrap, "--policy", "hf", "--model", v1,
                        "--group-size", 4, "--episodes", 32, "--max-steps", 8, "--max-tokens", 24,
                        "--temperature", "1.0", "--concurrency", 8, "--no-follow-policies", *pool)
    assert rollout["groups"] == 8 and rollout["errors"] == 0
    data = tmp_path / "rl"
    job = _trajpipe(rollout_env, "pipeline", "run", "--source", "kafka", "--bootstrap", bootstrap, "--out", data)
    assert job["episodes"] == 32 and job["groups_released"] == 8 and job["groups_held"] == 0
    groups = duckdb.sql(f"""
        select task_group, count(*), count(distinct episode_id), list(group_member order by group_member),
               sum(group_advantage), stddev_pop(outcome_reward), min(policy_version), max(policy_version)
        from read_parquet('{data}/trajectories/**/*.parquet', hive_partitioning=true)
        group by task_group""").fetchall()
    assert len(groups) == 8
    for _, n, distinct, members, adv_sum, _, vmin, vmax in groups:
        assert n == distinct == 4 and members == [0, 1, 2, 3] and (vmin, vmax) == (1, 1)
        assert abs(adv_sum) < 1e-5  # complete-group advantages have mean 0
    assert any(sd > 0 for *_, sd, _, _ in groups), "no group with both passes and failures: no signal"

    # 4. the round trip holds for the trained policy too
    audit = audit_behaviour_logprobs(data, v1, policy_version=1, seq_len=2048)
    assert audit.tokens > 0 and audit.inexact_windows == 0 and audit.max_abs_err <= 1e-4, audit

    # 5. two GRPO steps from v1 (continuing its lineage: none of its rollouts count as stale or foreign)
    (tmp_path / "grpo.yaml").write_text(
        "# trajpipe train --config grpo.yaml --data rl --model bc/policies/v1 --out grpo\n"
        "mode: offline\nmax_steps: 2\nobjective: {name: grpo, max_staleness: 0}\n"
        "data: {seq_len: 2048, batch_size: 8, num_workers: 0}\noptim: {lr: 1.0e-4}\nengine: {zero_stage: 1}\n")
    summary = _trajpipe(rollout_env, "train", "--config", tmp_path / "grpo.yaml", "--data", data, "--model", v1,
                        "--out", tmp_path / "grpo")
    assert summary == {"steps": 2, "tokens": summary["tokens"], "policy_version": 2}
    metrics = [json.loads(x) for x in (tmp_path / "grpo" / "metrics.jsonl").read_text().splitlines()[1:]]
    assert all(m["train/foreign_fraction"] == 0 and m["train/stale_fraction"] == 0 for m in metrics)
    assert metrics[0]["train/mean_ratio"] == pytest.approx(1.0, abs=1e-4)  # v1 scores its own samples: ratio 1
    assert metrics[0]["train/grad_norm"] > 0
    v2 = tmp_path / "grpo" / "policies" / "v2"
    before, after = load_file(v1 / "model.safetensors"), load_file(v2 / "model.safetensors")
    assert max(float((after[k] - before[k]).abs().max()) for k in before) > 0
    old, new = advantage_logprobs(data, v1), advantage_logprobs(data, v2)
    print(f"passed {rollout['passed']}/32; mean log-prob of positive-advantage action tokens ({old.positive_tokens}) "
          f"{old.positive_mean_logprob:.4f} -> {new.positive_mean_logprob:.4f}, negative ({old.negative_tokens}) "
          f"{old.negative_mean_logprob:.4f} -> {new.negative_mean_logprob:.4f}; audit of v1 {audit.max_abs_err:.2e}")
    assert old.positive_tokens > 0 and old.negative_tokens > 0
    assert new.positive_mean_logprob > old.positive_mean_logprob, (old, new)
    assert new.negative_mean_logprob < old.negative_mean_logprob, (old, new)
