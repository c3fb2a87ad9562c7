"""Every command that talks to Kafka: an unreachable broker, a wrong password and a missing ACL are
one ``error:`` line naming the client and the setting to fix, exit status 2, in bounded time."""

from __future__ import annotations

import os
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from tests.helpers import free_port

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]

# argv after `trajpipe`, per command; `{tmp}` is the test's tmp_path
COMMANDS = {
    "topics": ["topics"],
    "synth": ["synth", "--episodes", "2"],
    "archive": ["archive", "--out", "{tmp}/archive", "--until-end"],
    "pipeline": ["pipeline", "run", "--source", "kafka", "--out", "{tmp}/datasets"],
    "rollout": ["rollout", "--episodes", "1", "--domains", "math", "--policy", "scripted"],
    "train": ["train", "--data", "{tmp}/data", "--model", "{tmp}/model", "--out", "{tmp}/run", "--max-steps", "1",
              "--bootstrap", "{bootstrap}"],
}
CLIENT = {"topics": "trajpipe-admin", "synth": "trajpipe-synth", "archive": "trajpipe-archiver",
          "pipeline": "trajpipe-pipeline", "rollout": "trajpipe-rollout", "train": "trajpipe-trainer"}


def _run(command: str, tmp_path: Path, env: dict[str, str], bootstrap: str) -> subprocess.CompletedProcess:
    args = [a.format(tmp=tmp_path, bootstrap=bootstrap) for a in COMMANDS[command]]
    if command == "train":  # `train` checks its local flags first: give it a real model and data dir
        from rollout.model import init_tiny_model

        (tmp_path / "data").mkdir(exist_ok=True)
        if not (tmp_path / "model").exists():
            init_tiny_model(tmp_path / "model", seed=0)
    topic = f"test.cli.{uuid.uuid4().hex[:8]}"
    env = {**env, "TRAJPIPE_TOPICS__EVENTS": topic, "TRAJPIPE_TOPICS__DEAD_LETTERS": f"{topic}.dl",
           "TRAJPIPE_TOPICS__CONTROL": f"{topic}.ctl", "TRAJPIPE_KAFKA__CONNECT_TIMEOUT_S": "2",
           "PYTHONPATH": str(REPO_ROOT)}
    # the timeout guards against a hang; it is not what the test measures
    return subprocess.run([sys.executable, "-m", "trajpipe", *args], cwd=tmp_path, env=env, capture_output=True,
                          text=True, timeout=180, check=False)


def _one_error_line(proc: subprocess.CompletedProcess) -> str:
    assert proc.returncode == 2, proc.stderr[-3000:]
    assert "Traceback" not in proc.stderr, proc.stderr[-3000:]
    errors = [line for line in proc.stderr.splitlines() if line.startswith("error: ")]
    assert len(errors) == 1, proc.stderr[-3000:]
    return errors[0]


def _plain_env() -> dict[str, str]:
    return {k: v for k, v in os.environ.items() if not k.startswith("TRAJPIPE_")}


@pytest.mark.parametrize("command", list(COMMANDS))
def test_unreachable_broker(command, tmp_path):
    bootstrap = f"127.0.0.1:{free_port()}"  # nothing listens there
    proc = _run(command, tmp_path, {**_plain_env(), "TRAJPIPE_BOOTSTRAP": bootstrap}, bootstrap)
    line = _one_error_line(proc)
    assert f"cannot reach Kafka at {bootstrap} for client '{CLIENT[command]}' within 2 s" in line
    assert "kafka.bootstrap_servers" in line and "kafka.connect_timeout_s" in line


def test_synth_with_a_spool_dir_spools_when_the_broker_is_unreachable(tmp_path):
    bootstrap = f"127.0.0.1:{free_port()}"
    proc = _run("synth", tmp_path, {**_plain_env(), "TRAJPIPE_BOOTSTRAP": bootstrap,
                                    "TRAJPIPE_SPOOL_DIR": str(tmp_path / "spool")}, bootstrap)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert "events kept in the spool; they replay on the next run" in proc.stderr
    assert next((tmp_path / "spool").glob("*.spool")).stat().st_size > 8


@pytest.mark.parametrize("command", list(COMMANDS))
def test_wrong_password(command, kafka_auth_broker, tmp_path):
    wrong = tmp_path / "wrong.password"
    wrong.write_text("Wrong-Password-4711\n")
    env = kafka_auth_broker.env("alice", password_file=wrong)
    proc = _run(command, tmp_path, env, kafka_auth_broker.bootstrap)
    line = _one_error_line(proc)
    assert f"Kafka rejected the credentials of client '{CLIENT[command]}' (SASL SCRAM-SHA-512 user 'alice')" in line
    assert "kafka.sasl_password_file" in line
    assert "Wrong-Password-4711" not in proc.stdout + proc.stderr


@pytest.mark.parametrize("command", list(COMMANDS))
def test_missing_acl(command, kafka_auth_broker, tmp_path):
    proc = _run(command, tmp_path, kafka_auth_broker.env("bob"), kafka_auth_broker.bootstrap)
    line = _one_error_line(proc)
    assert f"Kafka denied client '{CLIENT[command]}' (SASL SCRAM-SHA-512 user 'bob') permission to" in line
    assert "trajpipe broker acl add --user bob" in line
    assert kafka_auth_broker.password("bob") not in proc.stdout + proc.stderr
