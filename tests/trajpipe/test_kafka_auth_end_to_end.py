"""synth -> archive -> pipeline run -> train (publishing) against a broker that requires SASL_SSL and ACLs.

Every command connects as ``alice`` with the settings of the environment (the password from a
file), and the password appears in no output: stdout, stderr, archive, datasets, manifests,
the training run's files, the broker's log.
"""

from __future__ import annotations

import json
import subprocess
import sys
import uuid
from pathlib import Path

import pytest

from rollout.model import init_tiny_model
from schemas.codec import decode_event
from schemas.manifests import list_dataset_versions, read_dataset_records
from streams.consumer import OffsetRange, end_offsets, read_range

pytestmark = [pytest.mark.integration, pytest.mark.slow]

REPO_ROOT = Path(__file__).resolve().parents[2]


def _trajpipe(env: dict, outputs: list[str], *args) -> dict:
    proc = subprocess.run([sys.executable, "-m", "trajpipe", *map(str, args)], cwd=REPO_ROOT, env=env,
                          capture_output=True, text=True, timeout=900, check=False)
    outputs += [proc.stdout, proc.stderr]
    assert proc.returncode == 0, f"trajpipe {' '.join(map(str, args))}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def _files_holding(root: Path, secret: bytes) -> list[Path]:
    return [p for p in root.rglob("*") if p.is_file() and secret in p.read_bytes()]


def test_synth_archive_pipeline_train_publish_on_the_authenticated_broker(kafka_auth_broker, tmp_path):
    topic = f"trajpipe.e2e.{uuid.uuid4().hex[:8]}"
    env = kafka_auth_broker.env("alice", TRAJPIPE_TOPICS__EVENTS=topic, TRAJPIPE_TOPICS__DEAD_LETTERS=f"{topic}.dl",
                                TRAJPIPE_TOPICS__CONTROL=f"{topic}.ctl", TRAJPIPE_TOPICS__PARTITIONS="2",
                                TRAJPIPE_SPOOL_DIR=str(tmp_path / "spool"), PYTHONPATH=str(REPO_ROOT))
    tiny = init_tiny_model(tmp_path / "tiny", seed=0)
    outputs: list[str] = []

    vocab = json.loads((tiny / "config.json").read_text())["vocab_size"]
    synth = _trajpipe(env, outputs, "synth", "--episodes", 12, "--seed", 1, "--vocab-size", vocab)
    archived = _trajpipe(env, outputs, "archive", "--out", tmp_path / "archive", "--until-end")
    assert archived["events"] == synth["events"] and archived["dead_letters"] == 0
    data = tmp_path / "datasets"
    built = _trajpipe(env, outputs, "pipeline", "run", "--source", "kafka", "--out", data)
    assert built["episodes"] == 12
    (tmp_path / "bc.yaml").write_text(
        "# trajpipe train --config bc.yaml --data datasets --model tiny --out run --bootstrap B\n"
        "mode: offline\nmax_steps: 2\nobjective: {name: bc, min_advantage: -1.0e9}\n"
        "data: {seq_len: 512, batch_size: 2, max_epochs: 100, num_workers: 0}\nengine: {zero_stage: 0}\n")
    trained = _trajpipe(env, outputs, "train", "--config", tmp_path / "bc.yaml", "--data", data, "--model", tiny,
                        "--out", tmp_path / "run", "--bootstrap", kafka_auth_broker.bootstrap)
    assert trained["policy_version"] == 1

    # the trainer's announcement reached the control topic, over SASL_SSL
    conn = kafka_auth_broker.conn("alice")
    end = end_offsets(conn, f"{topic}.ctl")
    records = [r for batch in read_range(conn, [OffsetRange(topic=f"{topic}.ctl", partition=p, start=0, end=e)
                                               for p, e in end.items()]) for r in batch]
    published = [decode_event(r.value) for r in records]
    assert [(e.event_type, e.version) for e in published] == [("policy_published", 1)]

    # nothing the commands printed or wrote holds the password
    secret = kafka_auth_broker.password("alice")
    assert not [o for o in outputs if secret in o]
    for root in (tmp_path, kafka_auth_broker.info.data_dir / "broker.log"):
        root = Path(root)
        held = [root] if root.is_file() and secret.encode() in root.read_bytes() else (
            _files_holding(root, secret.encode()) if root.is_dir() else [])
        assert held == [] or held == [kafka_auth_broker.password_files["alice"]], held
    records = [r for v in list_dataset_versions(data) for r in read_dataset_records(data, v)]
    assert records and all(secret.encode() not in r for r in records)
