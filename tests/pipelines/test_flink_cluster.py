"""The trajectory job on a real multi-process Flink session cluster (pipelines/flink_cluster.py).

Scripted rollouts in the sandbox → a real Kafka topic (2 partitions, one undecodable record) →
`trajpipe pipeline run` twice: FnApiRunner in process, and FlinkRunner submitted through Beam's
Flink job server to a session cluster of one JobManager JVM and two TaskManager JVMs whose SDK
workers are processes they start (PROCESS environment), writing the dataset to an S3-compatible store
(SeaweedFS, tests/s3_helpers.py) as Delta tables. The datasets must hold the same rows, the
JobManager must list the job FINISHED, and both TaskManagers must have run tasks and SDK workers.

Wall time (2-core box shared with other test runs, load ~8): cluster start ~30 s, rollouts ~20 s,
Flink job ~3 min (job server start, 138 tasks, 3 Python SDK worker starts per TaskManager).
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

from pipelines.flink_cluster import FlinkCluster, start_cluster, stop_cluster
from pipelines.runners import RunnerConfigError, flink_cluster_master, runner_options
from tests.helpers import assert_same_rows, free_port, produce_messages, read_rows, topic_env
from tests.s3_helpers import aws_environment

REPO = Path(__file__).resolve().parents[2]


def _trajpipe(env: dict, *args, timeout: float = 600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trajpipe", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=timeout)


def _ok(proc: subprocess.CompletedProcess) -> dict:
    assert proc.returncode == 0, proc.stderr[-4000:]
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_cluster_master_needs_an_sdk_environment(monkeypatch, tmp_path):
    jar = tmp_path / "job-server.jar"
    jar.write_bytes(b"PK")
    monkeypatch.setenv("TRAJPIPE_FLINK_JOB_SERVER_JAR", str(jar))
    with pytest.raises(RunnerConfigError, match="`--flink_master` flink-jm:8081 is a cluster.*--environment_type"):
        runner_options("FlinkRunner", "batch", ["--flink_master=flink-jm:8081"])
    with pytest.raises(RunnerConfigError, match="EXTERNAL` needs `--environment_config"):
        runner_options("FlinkRunner", "batch", ["--flink_master", "flink-jm:8081", "--environment_type=EXTERNAL"])
    opts = runner_options("FlinkRunner", "batch", ["--flink_master=flink-jm:8081", "--environment_type=PROCESS",
                                                   '--environment_config={"command": "/x/boot"}'])
    assert opts.get_all_options()["environment_type"] == "PROCESS"
    assert flink_cluster_master("FlinkRunner", ["--flink_master=flink-jm:8081"]) == "flink-jm:8081"
    assert flink_cluster_master("FlinkRunner", []) is None and flink_cluster_master("PrismRunner", []) is None


@pytest.mark.integration
def test_unreachable_flink_master_is_one_error_line(tmp_path):
    """Nothing listens on the master's port: exit 2 and one `error:` line, in seconds, before any job server."""
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    port = free_port()
    t0 = time.monotonic()
    proc = _trajpipe(env, "pipeline", "run", "--source", "archive", "--archive", tmp_path / "archive",
                     "--out", tmp_path / "out", "--runner", "FlinkRunner", f"--flink_master=localhost:{port}",
                     "--environment_type=PROCESS", '--environment_config={"command": "/bin/false"}', timeout=120)
    assert proc.returncode == 2, proc.stderr[-3000:]
    lines = proc.stderr.strip().splitlines()
    assert lines[-1].startswith(f"error: `--flink_master` localhost:{port}: no Flink REST API answers"), lines[-1]
    assert "trajpipe flink-cluster up" in lines[-1] and "Traceback" not in proc.stderr
    assert time.monotonic() - t0 < 60
    assert not (tmp_path / "out").exists()  # refused before anything was read or written


@pytest.fixture(scope="module")
def cluster(tmp_path_factory, s3_store) -> FlinkCluster:
    """A session cluster whose processes hold the S3 store's AWS variables, as a deployment's TaskManagers
    hold their credentials: the SDK workers they start write the dataset straight to the store."""
    with aws_environment(s3_store):
        c = start_cluster(tmp_path_factory.mktemp("flink"), task_managers=2, slots=1)
    try:
        yield c
    finally:
        stop_cluster(c)
        assert not any(c.alive().values())


@pytest.mark.slow
@pytest.mark.integration
@pytest.mark.flink_cluster
@pytest.mark.timeout(900)
def test_trajectory_job_on_session_cluster_same_rows_as_fnapi(kafka_broker, cluster, s3_store, tmp_path):
    """FnApiRunner writes a local dataset; the cluster writes the same job's dataset to S3 (SeaweedFS)."""
    from rollout.model import init_tiny_model

    topic = f"flink-cluster-{os.getpid()}"
    env = {**topic_env(topic, tmp_path / "spool"), **s3_store.env()}
    flink_out = s3_store.uri(f"flink-{os.getpid()}-{time.time_ns()}")
    b = kafka_broker.bootstrap
    tiny = init_tiny_model(tmp_path / "tiny", seed=0)
    made = _ok(_trajpipe(env, "rollout", "--bootstrap", b, "--policy", "scripted", "--model", tiny,
                         "--domains", "code,math,tools", "--episodes", 12, "--concurrency", 4, "--seed", 7,
                         "--no-follow-policies"))
    produce_messages(b, topic, [(b"junk-episode", b"not an event frame")])
    common = ["pipeline", "run", "--source", "kafka", "--bootstrap", b]
    t0 = time.monotonic()
    fn = _ok(_trajpipe(env, *common, "--out", tmp_path / "fnapi"))
    t1 = time.monotonic()
    flink = _ok(_trajpipe(env, *common, "--out", flink_out, "--runner", "FlinkRunner",
                          *cluster.beam_args()))
    print(f"fnapi {t1 - t0:.1f}s, flink session cluster {time.monotonic() - t1:.1f}s; rollouts: {made}")

    assert fn["episodes"] == 12 and fn["dead_letters"] == 1 and fn["events_in"] > 12
    assert flink == fn
    for name in ("steps", "trajectories", "dead_letters"):
        # A dead letter's `timestamp` is when the run detected the problem (schemas/deadletter.py): not compared.
        # the cluster's rows as its Delta tables hold them, FnApiRunner's as the files on disk
        fn_rows = read_rows(tmp_path / "fnapi", name).drop("timestamp", strict=False)
        with aws_environment(s3_store):  # the test process reads the store with the same variables
            flink_rows = read_rows(flink_out, name, delta=True).drop("timestamp", strict=False)
        assert fn_rows.height > 0, name
        assert_same_rows(flink_rows, fn_rows)

    # It ran on the cluster: the JobManager lists it FINISHED, every task finished, and both TaskManagers
    # received tasks and started their own Python SDK workers.
    jobs = cluster.jobs()
    assert [j["state"] for j in jobs] == ["FINISHED"], jobs
    assert jobs[0]["tasks"]["finished"] == jobs[0]["tasks"]["total"] > 0
    for i in range(cluster.task_managers):
        log = (cluster.log_dir / f"taskmanager-{i}.log").read_text()
        assert "Received task" in log and "Python sdk harness starting" in log, f"taskmanager-{i}"
    # A second run finds nothing new on the topic: the Flink run's commit covers the offsets it read.
    again = _ok(_trajpipe(env, *common, "--out", flink_out))
    assert again["events_in"] == 0 and again["episodes"] == 0


def test_flink_cluster_command_errors_are_one_line(tmp_path):
    env = {**os.environ, "PYTHONPATH": str(REPO)}
    proc = _trajpipe(env, "flink-cluster", "down", "--dir", tmp_path, timeout=120)
    assert proc.returncode == 2 and "Traceback" not in proc.stderr
    assert proc.stderr.strip().splitlines()[-1] == (
        f"error: no Flink cluster in {tmp_path} (no cluster.json); start one with "
        f"`trajpipe flink-cluster up --dir {tmp_path}`")
    proc = _trajpipe(env, "flink-cluster", "sideways", "--dir", tmp_path, timeout=120)
    assert proc.returncode == 2
    assert proc.stderr.strip().splitlines()[-1] == "error: unknown action 'sideways'; use up, down or status"
