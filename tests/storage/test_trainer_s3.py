"""The trainer's outputs on an S3-compatible store (SeaweedFS): checkpoints, resume, metrics, the policy store.

* A run with ``out: s3://...`` (real DeepSpeed on CPU) that "dies" after step 5 (last checkpoint at step 4,
  v1 published there) and is resumed from the store to step 6 sees exactly the samples of an uninterrupted
  run with a local ``out``, with the same losses and, at the end, the same weights; a half-uploaded newer
  checkpoint (no ``latest`` naming it) is not the resume point;
* a policy published to ``s3://`` with a real Kafka control topic is downloaded by the rollout's reload
  path (``PolicyFollower`` → ``reload_policy`` of an ``HFPolicy``) into a local cache and loads the very
  weights on the store;
* ``trajpipe train --out s3://<missing bucket>`` or with a wrong secret: one ``error:`` line, exit 2,
  before training starts; ``--out s3://...`` runs as a real process.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import sys
import tempfile
import time
import uuid
from pathlib import Path

import pyarrow.parquet as pq
import pytest
import torch
from safetensors.torch import load as load_safetensors

from rollout.model import init_tiny_model
from rollout.policies.hf import HFPolicy
from rollout.reload import PolicyFollower, reload_policy
from schemas import locations as loc
from schemas.events import SamplingParams
from streams.admin import ensure_topics
from streams.config import KafkaConnection, Topics
from streams.producer import EventProducer
from trainer.config import load_train_config
from trainer.publish import read_policy
from trainer.recipes.rl import RLRecipe, run
from trainer.synthetic import make_step_rows, write_steps_commit

# ~4 min here on 2 busy cores (SeaweedFS, a Kafka broker, five DeepSpeed runs)
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


@pytest.fixture(scope="module")
def dataset(tiny_model, tmp_path_factory) -> Path:
    """Two committed synthetic commits (30 + 20 episodes) in a local dataset, ids within the model's vocabulary."""
    vocab = json.loads((tiny_model / "config.json").read_text())["vocab_size"]
    root = tmp_path_factory.mktemp("data") / "datasets"
    for c, n in ((1, 30), (2, 20)):
        write_steps_commit(root, make_step_rows(n, seed=c, vocab_size=vocab, id_prefix=f"c{c}-"), commit=c,
                           row_group_size=4)
    return root


def _cfg(model: Path, data: Path, out: str, **over):
    return load_train_config(None, model=str(model), out=out, **{"data.dir": str(data)},
                             **{"data.seq_len": 64, "data.batch_size": 2, "optim.lr": 1e-3, **over})


def _jsonl(location: str) -> list[dict]:
    return [json.loads(x) for x in loc.read_bytes(location).decode().splitlines()]


def _weights(version_dir: str) -> dict[str, torch.Tensor]:
    return load_safetensors(loc.read_bytes(loc.join(version_dir, "model.safetensors")))


def test_crash_and_resume_from_s3_sees_the_same_samples_losses_and_weights(s3_env, tiny_model, dataset, tmp_path):
    over = {"log_sample_ids": True, "objective.name": "ppo", "checkpoint.every": 2, "data.max_epochs": None}
    local = str(tmp_path / "a")
    run(_cfg(tiny_model, dataset, local, **over, max_steps=6, **{"publish.every": 4}), progress=False)  # uninterrupted
    out = s3_env.uri(f"train-{uuid.uuid4().hex[:8]}")
    crashed = RLRecipe(_cfg(tiny_model, dataset, out, **over, **{
        "checkpoint.at_end": False, "publish.at_end": False, "publish.every": 4}), progress=False)
    crashed.setup()
    crashed.train(max_steps=5)
    crashed.cleanup()  # no final checkpoint or publication: the process "died" after step 5
    ckpts = loc.join(out, "checkpoints")
    assert loc.read_bytes(loc.join(ckpts, "latest")) == b"step-4"
    assert [n for n in loc.list_dir(ckpts) if n.startswith("step-")] == ["step-2", "step-4"]  # keep_last 2
    assert read_policy(loc.join(out, "policies", "v1")).location == loc.join(out, "policies", "v1")
    # A newer checkpoint whose upload was cut short: files on the store, but `latest` never named it.
    loc.upload_dir(tmp_path / "a" / "checkpoints" / "step-6", loc.join(ckpts, "step-6"))
    for f in loc.list_files(loc.join(ckpts, "step-6"), suffix="optim_states.pt"):
        loc.delete_file(f)

    summary = run(_cfg(tiny_model, dataset, out, **over, resume=True, max_steps=6, **{"publish.every": 4}),
                  progress=False)
    assert summary["steps"] == 6 and summary["policy_version"] == 2

    a = {d["step"]: d["sample_ids"] for d in _jsonl(f"{local}/samples.jsonl")}
    b = _jsonl(loc.join(out, "samples.jsonl"))
    assert [d["step"] for d in b] == [1, 2, 3, 4, 5, 5, 6]  # step 5 replayed from the step-4 checkpoint
    assert [d["sample_ids"] for d in b[:4]] + [b[5]["sample_ids"], b[6]["sample_ids"]] == [a[s] for s in range(1, 7)]
    la = {d["step"]: d["train/loss"] for d in _jsonl(f"{local}/metrics.jsonl") if "train/loss" in d}
    lb = [d for d in _jsonl(loc.join(out, "metrics.jsonl")) if "train/loss" in d]
    assert [d["step"] for d in lb] == [1, 2, 3, 4, 5, 5, 6]
    assert {d["step"]: d["train/loss"] for d in lb[5:]} == pytest.approx({5: la[5], 6: la[6]}, rel=1e-4, abs=1e-6)
    assert loc.read_bytes(loc.join(ckpts, "latest")) == b"step-6"
    # the same policies, in the same store layout, as the local run: v1 at step 4, v2 at step 6, one lineage
    records = [read_policy(loc.join(out, "policies", f"v{v}")) for v in (1, 2)]
    assert [r.train_step for r in records] == [4, 6] and records[0].lineage == records[1].lineage != ""
    for v in (1, 2):
        wa, wb = _weights(f"{local}/policies/v{v}"), _weights(loc.join(out, "policies", f"v{v}"))
        assert wa.keys() == wb.keys()
        for k in wa:
            torch.testing.assert_close(wb[k], wa[k], rtol=1e-5, atol=1e-6, msg=k)


def test_a_policy_published_to_s3_is_reloaded_by_the_rollout_with_the_same_weights(
        s3_env, kafka_broker, topic_name, tiny_model, dataset, tmp_path):
    conn = KafkaConnection(bootstrap_servers=kafka_broker.bootstrap, request_timeout_ms=10_000)
    topics = Topics(events=topic_name, control=f"{topic_name}.ctl", dead_letters=f"{topic_name}.dl", partitions=1)
    ensure_topics(conn, topics)
    store = s3_env.uri(f"policies-{uuid.uuid4().hex[:8]}")
    with EventProducer(conn, topics.control, spool_dir=tmp_path / "spool") as control:
        def emit(event) -> None:
            control.emit(event)
            control.flush()

        summary = run(_cfg(tiny_model, dataset, str(tmp_path / "run"), max_steps=2,
                           **{"objective.name": "grpo", "publish.store": store}), emit_event=emit, progress=False)
    assert summary["policy_version"] == 1 and not (tmp_path / "run" / "policies").exists()

    sampling = SamplingParams(temperature=1.0, max_tokens=8, seed=1)
    base = HFPolicy.from_pretrained(tiny_model, sampling=sampling)
    with PolicyFollower(conn, topics.control) as follower:  # reads the control topic from its beginning
        deadline = time.monotonic() + 30
        while (event := follower.take(newer_than=0)) is None and time.monotonic() < deadline:
            time.sleep(0.1)
    assert event is not None and event.version == 1 and event.location == loc.join(store, "v1")
    cache = tmp_path / "cache"
    policy = reload_policy(base, event, cache_dir=cache)
    assert policy.policy_version == 1 and Path(policy.location).parent == cache
    assert (Path(policy.location) / "policy.json").is_file() and not list(cache.glob(".*"))  # no temporary left
    on_store = _weights(event.location)
    loaded = policy.model.state_dict()
    assert set(on_store) <= set(loaded)
    for k, v in on_store.items():
        assert torch.equal(loaded[k], v), k
    # trained: not the base weights
    assert any(not torch.equal(base.model.state_dict()[k], v) for k, v in on_store.items())
    # a second reload of the same version uses the cached copy
    assert reload_policy(base, event, cache_dir=cache).location == policy.location


def _trajpipe(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trajpipe", *args], cwd=cwd, capture_output=True, text=True,
                          timeout=600, env={**os.environ, "PYTHONPATH": str(REPO), **env})


def _train(args: list[str], env: dict[str, str], cwd: Path) -> subprocess.CompletedProcess:
    return _trajpipe(["train", *args], env, cwd)


def test_train_out_s3_as_a_command_and_bad_buckets_are_one_line(s3_env, tiny_model, dataset, tmp_path, request):
    out = s3_env.uri(f"cli-{uuid.uuid4().hex[:8]}")
    args = ["--data", str(dataset), "--model", str(tiny_model), "--objective", "bc", "--max-steps", "2",
            "--config", str(tmp_path / "r.yaml")]
    (tmp_path / "r.yaml").write_text("# trajpipe train --config r.yaml ...\ndata: {seq_len: 64, batch_size: 2}\n")
    # a short TMPDIR: under pytest-xdist tmp_path/tmp is too long for the DataLoader workers' sockets
    scratch = Path(tempfile.mkdtemp(prefix="tps3-", dir="/tmp"))
    request.addfinalizer(lambda: shutil.rmtree(scratch, ignore_errors=True))
    proc = _train([*args, "--out", out], {**s3_env.env(), "TMPDIR": str(scratch)}, tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert [p.name for p in scratch.iterdir() if p.name.startswith("trajpipe-train-")] == []  # scratch removed
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert (summary["steps"], summary["policy_version"]) == (2, 1) and summary["tokens"] > 0
    assert loc.read_bytes(loc.join(out, "checkpoints", "latest")) == b"step-2"
    assert read_policy(loc.join(out, "policies", "v1")).train_step == 2
    assert len([d for d in _jsonl(loc.join(out, "metrics.jsonl")) if "train/loss" in d]) == 2  # steps taken
    assert sorted(p.name for p in tmp_path.iterdir()) == ["r.yaml"]  # nothing written locally

    # the analyst's side, all on the store: the run's published policy in `trajpipe query --runs s3://...`,
    # the result written with `--out s3://...` (Parquet), read back from the store
    result = loc.join(out, "analysis", "policies.parquet")
    proc = _trajpipe(["query", "--data", str(dataset), "--runs", out, "--format", "parquet", "--out", result,
                      "select version, train_step, run, location from policies"], s3_env.env(), tmp_path)
    assert proc.returncode == 0, proc.stderr[-3000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1]) == {"out": result, "format": "parquet", "rows": 1}
    with loc.open_input(result) as f:
        rows = pq.read_table(f).to_pylist()
    assert rows == [{"version": 1, "train_step": 2, "run": out, "location": loc.join(out, "policies", "v1")}]
    for query_args, says in (
            (["--runs", f"{out}-nothing-here"], "`--runs`"),
            (["--out", f"s3://missing-{uuid.uuid4().hex[:8]}/x.json", "--format", "json"], "`--out`"),
    ):
        proc = _trajpipe(["query", "--data", str(dataset), *query_args, "select 1 as one"], s3_env.env(), tmp_path)
        lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
        assert proc.returncode == 2 and len(lines) == 1 and says in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr

    bucket = f"missing-{uuid.uuid4().hex[:8]}"
    wrong = {**s3_env.env(), "AWS_SECRET_ACCESS_KEY": "wrong"}
    for flag_args, env, says in (
            (["--out", f"s3://{bucket}/run"], s3_env.env(), f"bucket {bucket!r} does not exist"),
            (["--out", f"{out}-2"], wrong, "cannot be read"),
    ):
        proc = _train([*args, *flag_args], env, tmp_path)
        lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
        assert proc.returncode == 2 and len(lines) == 1 and "`--out`" in lines[0] and says in lines[0], proc.stderr
        assert "Traceback" not in proc.stderr and proc.stdout == ""
    # a checkpoint directory in the recipe on a missing bucket: refused the same way, naming the setting
    (tmp_path / "r.yaml").write_text(f"data: {{seq_len: 64, batch_size: 2}}\ncheckpoint: {{dir: s3://{bucket}/c}}\n")
    proc = _train([*args, "--out", str(tmp_path / "run")], s3_env.env(), tmp_path)
    lines = [x for x in proc.stderr.splitlines() if x.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "checkpoint.dir" in lines[0], proc.stderr
    assert not (tmp_path / "run").exists()
