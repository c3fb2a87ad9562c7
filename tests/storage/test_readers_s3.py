"""The dataset readers on an S3-compatible store (SeaweedFS): `trajpipe query`, polars, the trainer.

One dataset is written twice by the batch job from the same Kafka topic, in two commits: to
SeaweedFS (``pipeline run --out s3://...``) and to a local directory. Then:

* ``trajpipe query --data s3://...`` (a real process, the AWS_* variables in its environment) gives
  the same counts as ``--data DIR`` -- steps, trajectories, per domain, the ``filename`` column's
  files -- at the newest commit and with ``--as-of 1``;
* polars ``scan_delta`` on the S3 table, and the catalog's polars frame of the view, give the same rows;
* the trainer's loader yields the same packed batches (token ids, advantages, episode ids, in order,
  shuffle off) from S3 as from the local copy, and a real ``trajpipe train --data s3://... --max-steps 2`` runs;
* a bucket that does not exist, or a wrong secret, ends the command with one error line, exit 2.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import uuid
from pathlib import Path

import polars as pl
import pytest
import torch
import yaml

from pipelines.catalog import open_catalog
from pipelines.trajectory_job import run
from schemas import locations as loc
from schemas.codec import encode_event
from schemas.storage import delta_storage_options
from streams.synth import generate_episodes
from tests.helpers import create_topics, produce_messages
from tests.pipelines.helpers import flat
from tests.s3_helpers import aws_environment
from trainer.data import TrajectoryLoader, TrajectoryStream

# ~6 min here on 2 busy cores (a Kafka broker, SeaweedFS, four job runs, a DeepSpeed run)
pytestmark = [pytest.mark.integration, pytest.mark.slow, pytest.mark.timeout(1500)]

REPO = Path(__file__).resolve().parents[2]
N = 24
#: Token ids below the tiny model's vocabulary (rollout.model.init_tiny_model: 1994 ids), so `trajpipe train` runs on them.
VOCAB = 1024

COUNTS_SQL = """
select 'steps' as what, count(*) as n, count(distinct filename) as files from steps
union all select 'trajectories', count(*), count(distinct filename) from trajectories
union all select 'domain=' || domain, count(*), count(distinct filename) from steps group by domain
order by what
"""


@pytest.fixture(scope="module")
def s3_env(s3_store):
    """The AWS_* variables of the test store in this process, for the module."""
    with aws_environment(s3_store):
        yield s3_store


@pytest.fixture(scope="module")
def datasets(kafka_broker, s3_env, tmp_path_factory) -> tuple[str, str]:
    """``(s3 uri, local dir)``: the same dataset, two commits of N episodes each, written by the batch job."""
    topic = create_topics(kafka_broker.bootstrap, f"test.readers-s3.{uuid.uuid4().hex[:8]}")
    uri = s3_env.uri(f"readers-{uuid.uuid4().hex[:8]}", "datasets")
    local = str(tmp_path_factory.mktemp("readers") / "datasets")
    eps = list(generate_episodes(2 * N, seed=41, vocab_size=VOCAB))
    for part in (eps[:N], eps[N:]):
        produce_messages(kafka_broker.bootstrap, topic, [(e.episode_id.encode(), encode_event(e)) for e in flat(part)])
        args = ["--source", "kafka", "--bootstrap", kafka_broker.bootstrap, "--topic", topic]
        assert run([*args, "--out", uri]) == run([*args, "--out", local])
    return uri, local


@pytest.fixture(scope="module")
def tiny_model(tmp_path_factory) -> Path:
    from rollout.model import init_tiny_model

    return init_tiny_model(tmp_path_factory.mktemp("tiny") / "model", seed=0)


def _trajpipe(env: dict[str, str], *args: str) -> subprocess.CompletedProcess:
    base = {k: v for k, v in os.environ.items() if not k.startswith(("TRAJPIPE_", "AWS_"))}
    return subprocess.run([sys.executable, "-m", "trajpipe", *args], cwd=REPO, capture_output=True, text=True,
                          env={**base, "PYTHONPATH": str(REPO), **env}, timeout=900)


def _query(env: dict[str, str], data: str, *extra: str) -> list[dict]:
    proc = _trajpipe(env, "query", "--data", data, "--format", "json", *extra, COUNTS_SQL)
    assert proc.returncode == 0, proc.stderr[-3000:]
    return [json.loads(line) for line in proc.stdout.splitlines() if line.strip()]


def test_query_on_s3_counts_what_it_counts_locally_now_and_as_of_commit_1(datasets, s3_store):
    uri, local = datasets
    for as_of in ((), ("--as-of", "1")):
        on_s3, on_disk = _query(s3_store.env(), uri, *as_of), _query({}, local, *as_of)
        assert on_s3 == on_disk, as_of
        counts = {r["what"]: r["n"] for r in on_s3}
        assert counts["trajectories"] == (N if as_of else 2 * N), on_s3
        assert counts["steps"] == sum(n for w, n in counts.items() if w.startswith("domain=")) > 0
        assert len([w for w in counts if w.startswith("domain=")]) > 1
    newest, first = _query(s3_store.env(), uri), _query(s3_store.env(), uri, "--as-of", "1")
    assert {r["what"]: r["files"] for r in newest}["steps"] > {r["what"]: r["files"] for r in first}["steps"]
    # `filename` names the object, and joins to `commit_files` as it does locally
    proc = _trajpipe(s3_store.env(), "query", "--data", uri, "--format", "json",
                     "select min(s.filename) as f, count(distinct c.commit) as commits "
                     "from steps s join commit_files c using (filename)")
    assert proc.returncode == 0, proc.stderr[-3000:]
    row = json.loads(proc.stdout.splitlines()[-1])
    assert row["f"].startswith(f"{uri}/steps/recipe=") and row["commits"] == 2


def test_report_html_of_an_s3_dataset_is_written_to_the_store(datasets, s3_store):
    uri, _ = datasets
    out = f"{uri}-reports/report.html"
    proc = _trajpipe(s3_store.env(), "report", "html", "--data", uri, "--out", out)
    assert proc.returncode == 0, proc.stderr[-3000:]
    counts = json.loads(proc.stdout.strip().splitlines()[-1])
    assert counts["out"] == out and counts["charts"] > 0
    with aws_environment(s3_store):
        page = loc.read_bytes(out)
    assert len(page) == counts["bytes"] and page.lstrip().lower().startswith(b"<!doctype html") and b"plotly" in page


def test_polars_scan_delta_on_s3_agrees(datasets, s3_env):
    uri, local = datasets
    s3_steps = pl.scan_delta(loc.join(uri, "steps"), storage_options=delta_storage_options(uri))
    local_steps = pl.scan_delta(loc.join(local, "steps"))
    by_domain = [f.group_by("domain").agg(pl.len(), pl.col("episode_id").n_unique()).sort("domain").collect()
                 for f in (s3_steps, local_steps)]
    assert by_domain[0].equals(by_domain[1]) and by_domain[0]["episode_id"].sum() == 2 * N
    # the catalog's polars frame of the view (a pyarrow dataset on S3) has the same rows as the local view's
    views = [open_catalog(data=d).scan("steps").group_by("domain").agg(pl.len(), pl.col("episode_id").n_unique())
             .sort("domain").collect() for d in (uri, local)]
    assert views[0].equals(views[1]) and views[0].equals(by_domain[0].cast(views[0].schema))


def _batches(data: str) -> list:
    stream = TrajectoryStream(data, seq_len=512, batch_size=2, shuffle=False, mode="offline", max_epochs=1,
                              rank=0, world_size=1)
    return list(TrajectoryLoader(stream))


def test_the_trainer_reads_the_same_batches_from_s3(datasets, s3_env):
    uri, local = datasets
    on_s3, on_disk = _batches(uri), _batches(local)
    assert len(on_s3) == len(on_disk) > 1
    assert sum(len(set(b.episode_ids)) for b in on_s3) >= N  # the episodes of both commits, not an empty stream
    for a, b in zip(on_s3, on_disk):
        assert a.episode_ids == b.episode_ids and a.sample_ids == b.sample_ids
        for name in ("input_ids", "advantages", "loss_mask", "behaviour_logprobs", "position_ids"):
            assert torch.equal(getattr(a, name), getattr(b, name)), name
        assert a.position == b.position


def test_trajpipe_train_on_s3_runs_two_steps(datasets, s3_store, tiny_model, tmp_path):
    uri, _ = datasets
    (tmp_path / "r.yaml").write_text(yaml.safe_dump(
        {"data": {"seq_len": 128, "batch_size": 2, "num_workers": 1}, "optim": {"lr": 1e-3}}))
    proc = _trajpipe(s3_store.env(), "train", "--data", uri, "--model", str(tiny_model), "--out", str(tmp_path / "run"),
                     "--objective", "bc", "--max-steps", "2", "--config", str(tmp_path / "r.yaml"))
    assert proc.returncode == 0, proc.stderr[-3000:]
    summary = json.loads(proc.stdout.strip().splitlines()[-1])
    assert summary["steps"] == 2 and summary["tokens"] > 0


@pytest.mark.parametrize("case", ["no such bucket", "wrong secret"])
@pytest.mark.parametrize("command", ["query", "train"])
def test_an_unreadable_store_is_one_error_line(datasets, s3_store, tiny_model, tmp_path, case, command):
    uri, _ = datasets
    env = s3_store.env()
    if case == "no such bucket":
        uri = uri.replace(f"s3://{s3_store.bucket}/", f"s3://no-such-bucket-{uuid.uuid4().hex[:6]}/")
    else:
        env["AWS_SECRET_ACCESS_KEY"] = "not-the-secret"
    if command == "query":
        args = ["query", "--data", uri, "select count(*) from steps"]
    else:
        args = ["train", "--data", uri, "--model", str(tiny_model), "--out", str(tmp_path / "run")]
    proc = _trajpipe(env, *args)
    lines = [line for line in proc.stderr.splitlines() if line.startswith("error:")]
    assert proc.returncode == 2 and len(lines) == 1 and "Traceback" not in proc.stderr, proc.stderr[-3000:]
    assert "--data" in lines[0] and uri in lines[0], lines


def _episode_ids(data: str) -> list[str]:
    return [e for b in _batches(data) for e in b.episode_ids]


def test_the_trainer_tails_new_commits_on_s3(kafka_broker, s3_env):
    """Online training on S3: a ``mode="tail"`` stream reads commit 1, then picks up commit 2 made while it runs.

    Every episode comes once, commit 1's before commit 2's, and the tail sees what an offline read of the
    finished dataset sees.
    """
    topic = create_topics(kafka_broker.bootstrap, f"test.tail-s3.{uuid.uuid4().hex[:8]}")
    uri = s3_env.uri(f"tail-{uuid.uuid4().hex[:8]}", "datasets")
    args = ["--source", "kafka", "--bootstrap", kafka_broker.bootstrap, "--topic", topic, "--out", uri]
    eps = list(generate_episodes(2 * N, seed=43, vocab_size=VOCAB))
    produce_messages(kafka_broker.bootstrap, topic, [(e.episode_id.encode(), encode_event(e)) for e in flat(eps[:N])])
    run(args)
    first = set(_episode_ids(uri))
    assert first

    # idle_timeout_s only ends the test if commit 2 never shows up (it then fails below)
    stream = TrajectoryStream(uri, seq_len=512, batch_size=1, shuffle=False, mode="tail", poll_interval_s=0.2,
                              idle_timeout_s=120.0, rank=0, world_size=1)
    seen: list[str] = []
    second: set[str] | None = None
    for batch in TrajectoryLoader(stream):
        seen += [e for e in batch.episode_ids if not seen or e != seen[-1]]
        if second is None and set(seen) >= first:  # commit 1 read: commit 2 lands while the stream waits
            produce_messages(kafka_broker.bootstrap, topic,
                             [(e.episode_id.encode(), encode_event(e)) for e in flat(eps[N:])])
            run(args)
            second = set(_episode_ids(uri)) - first
            assert second
        if second is not None and set(seen) >= first | second:
            break
    assert second is not None and set(seen) == first | second
    assert len(seen) == len(set(seen))  # each episode once
    assert set(seen[:len(first)]) == first  # commit 1's episodes before commit 2's
    assert set(seen) == set(_episode_ids(uri))  # what an offline read of the finished dataset gives
