"""The warm start from the log makes the base model pass held-out tasks it could not pass before.

The real path, as docs/trainer.md "Warm start" gives it: scripted demonstrations in the tiny model's tokens
(``trajpipe rollout --policy scripted --model tiny --levels 0``, task seed 1) → Kafka → ``trajpipe pipeline
run`` → ``trajpipe train`` (behaviour cloning, DeepSpeed; trainer/configs/bc-warmstart-loop.yaml with fewer
steps) → v1; then ``trajpipe eval`` runs the base model and v1 greedily on the held-out ``tools`` level-0 tasks
(rollout.heldout: disjoint by content from the demonstrations, which the scheduler never draws), in the sandboxed
environment, their episodes (purpose ``eval``) through Kafka.

The threshold is modest on purpose (the figure itself is ``bc_heldout_pass_rate`` in bench/learning.py):
the random-init base passes nothing, v1 at least half of the held-out tasks.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
import yaml

pytestmark = [pytest.mark.acceptance, pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1500)]  # minutes on a busy 2-core machine

REPO = Path(__file__).resolve().parents[2]


def _trajpipe(env: dict, *args) -> dict:
    proc = subprocess.run([sys.executable, "-m", "trajpipe", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    assert proc.returncode == 0, f"trajpipe {' '.join(map(str, args))}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_warm_start_beats_the_base_model_on_held_out_tasks(kafka_broker, topic_name, tmp_path):
    bootstrap = kafka_broker.bootstrap
    env = {**os.environ, "TRAJPIPE_TOPICS__EVENTS": topic_name, "TRAJPIPE_TOPICS__CONTROL": f"{topic_name}.ctl",
           "TRAJPIPE_TOPICS__DEAD_LETTERS": f"{topic_name}.dl", "TRAJPIPE_TOPICS__PARTITIONS": "2",
           "TRAJPIPE_SPOOL_DIR": str(tmp_path / "spool")}
    eval_env = {**env, "TRAJPIPE_TOPICS__EVENTS": f"{topic_name}.eval"}  # held-out episodes: never in the dataset
    tiny = tmp_path / "tiny"
    _trajpipe(env, "model", "init-tiny", "--out", tiny)

    demo = _trajpipe(env, "rollout", "--bootstrap", bootstrap, "--policy", "scripted", "--model", tiny,
                     "--domains", "tools", "--levels", "0", "--episodes", 24, "--seed", 1)
    assert demo["passed"] == 24
    demos = tmp_path / "demos"
    assert _trajpipe(env, "pipeline", "run", "--source", "kafka", "--bootstrap", bootstrap,
                     "--out", demos)["episodes"] == 24
    config = yaml.safe_load((REPO / "trainer" / "configs" / "bc-warmstart-loop.yaml").read_text())
    config["max_steps"] = 60  # one domain, one level: fewer steps than the two-domain recipe
    (tmp_path / "bc.yaml").write_text(yaml.safe_dump(config))
    bc = _trajpipe(env, "train", "--config", tmp_path / "bc.yaml", "--data", demos, "--model", tiny,
                   "--out", tmp_path / "bc")
    assert bc == {"steps": 60, "tokens": bc["tokens"], "policy_version": 1}

    held_out = ["--domains", "tools", "--levels", "0", "--tasks-per-level", 4, "--temperature", 0,
                "--max-steps", 5, "--max-tokens", 32]
    base = _trajpipe(eval_env, "eval", "--bootstrap", bootstrap, "--policy", "hf", "--model", tiny, *held_out)
    warm = _trajpipe(eval_env, "eval", "--bootstrap", bootstrap, "--policy", "hf",
                     "--model", tmp_path / "bc" / "policies" / "v1", *held_out)
    print(f"held-out tools/0: base {base['passed']}/4, warm start {warm['passed']}/4")
    assert base["errors"] == warm["errors"] == 0
    assert base["passed"] == 0
    assert warm["passed"] >= 2 > base["passed"]
