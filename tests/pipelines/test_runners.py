"""Runner options, and a tiny pipeline on each real runner (Prism, Flink local).

Wall times measured on the 2-core dev box (Beam 2.77, Prism 2.77, Flink 1.19 job server 2.62):
Prism ~2 s per job (plus ~4 s SDK import/worker start), Flink local ~45 s per job (JVM job server
+ embedded Flink start-up dominate; the pipeline itself is under a second).
"""

from __future__ import annotations

import time
from pathlib import Path

import apache_beam as beam
import duckdb
import polars as pl
import pytest
from apache_beam.options.pipeline_options import FlinkRunnerOptions, PortableOptions, PrismRunnerOptions, StandardOptions

from polars.testing import assert_frame_equal

from pipelines.runners import (
    RunnerConfigError,
    RunnerNotInstalledError,
    flink_job_server_jar,
    prism_location,
    runner_options,
)
from pipelines.trajectory_job import run
from tests.pipelines.helpers import episodes, flat, write_archive


def test_prism_defaults_and_overrides(monkeypatch, tmp_path):
    fake = tmp_path / "prism"
    fake.write_text("#!/bin/sh\n")
    fake.chmod(0o755)
    monkeypatch.setenv("TRAJPIPE_PRISM", str(fake))
    opts = runner_options("PrismRunner", "stream", [])
    assert opts.view_as(StandardOptions).runner == "PrismRunner"
    assert opts.view_as(StandardOptions).streaming is True
    assert opts.view_as(PrismRunnerOptions).prism_location == str(fake)
    assert opts.view_as(PortableOptions).environment_type == "LOOPBACK"
    opts = runner_options("PrismRunner", "batch", ["--environment_type=PROCESS", "--prism_location=/x/prism"])
    assert opts.view_as(PortableOptions).environment_type == "PROCESS"
    assert opts.view_as(PrismRunnerOptions).prism_location == "/x/prism"
    assert not opts.view_as(StandardOptions).streaming


def test_flink_defaults_local_and_remote(monkeypatch, tmp_path):
    jar = tmp_path / "job-server.jar"
    jar.write_bytes(b"PK")
    monkeypatch.setenv("TRAJPIPE_FLINK_JOB_SERVER_JAR", str(jar))
    opts = runner_options("FlinkRunner", "batch", [])
    assert opts.view_as(FlinkRunnerOptions).flink_master == "[local]"
    assert opts.view_as(FlinkRunnerOptions).flink_job_server_jar == str(jar)
    assert opts.view_as(PortableOptions).environment_type == "LOOPBACK"
    # A real cluster: the workers cannot call back into this process, so no LOOPBACK default.
    opts = runner_options("FlinkRunner", "batch", ["--flink_master", "flink:8081", "--environment_type=DOCKER"])
    assert opts.view_as(FlinkRunnerOptions).flink_master == "flink:8081"
    assert opts.view_as(PortableOptions).environment_type == "DOCKER"


def test_pass_through_runners_get_no_defaults():
    opts = runner_options("DataflowRunner", "stream", ["--project=p", "--region=europe-west4"])
    all_opts = opts.get_all_options()
    assert all_opts["runner"] == "DataflowRunner" and all_opts["project"] == "p" and all_opts["streaming"]
    assert all_opts["environment_type"] is None


@pytest.mark.parametrize("runner", ["FnApiRunner", "DirectRunner"])
def test_batch_only_runner_refuses_stream(runner):
    with pytest.raises(RunnerConfigError, match=f"`--runner` {runner} cannot run --mode stream.*PrismRunner"):
        runner_options(runner, "stream", [])


def test_other_errors_name_the_option(monkeypatch, tmp_path):
    with pytest.raises(RunnerConfigError, match="`--mode` must be one of batch, stream"):
        runner_options("PrismRunner", "micro", [])
    with pytest.raises(RunnerConfigError, match="`--runner`"):
        runner_options("FnApiRunner", "batch", ["--runner=FlinkRunner"])
    monkeypatch.setenv("TRAJPIPE_PRISM", str(tmp_path / "missing"))
    with pytest.raises(RunnerNotInstalledError, match="pipelines/runtime/install_prism.sh"):
        runner_options("PrismRunner", "batch", [])
    monkeypatch.setenv("TRAJPIPE_FLINK_JOB_SERVER_JAR", str(tmp_path / "missing.jar"))
    with pytest.raises(RunnerNotInstalledError, match="pipelines/runtime/install_flink_jobserver.sh"):
        runner_options("FlinkRunner", "batch", [])


def _tiny_job(options, out: Path) -> float:
    """Create → Map → WriteToText; return the wall time of the run."""
    t0 = time.monotonic()
    with beam.Pipeline(options=options) as p:
        _ = (p | beam.Create(range(10)) | beam.Map(lambda x: x * x)
             | beam.io.WriteToText(str(out / "squares"), shard_name_template="-SS"))
    return time.monotonic() - t0


def _squares(out: Path) -> list[int]:
    return sorted(int(line) for f in out.glob("squares*") for line in f.read_text().split())


@pytest.mark.integration
@pytest.mark.slow
# Beam's LOOPBACK worker logs a CANCELLED gRPC stream from a thread when the runner hangs up.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_tiny_pipeline_on_prism(tmp_path):
    prism_location()  # fails with the install command if missing
    wall = _tiny_job(runner_options("PrismRunner", "batch", []), tmp_path)
    assert _squares(tmp_path) == [x * x for x in range(10)]
    print(f"prism tiny job: {wall:.1f}s")


@pytest.mark.integration
@pytest.mark.slow
# Beam's LOOPBACK worker logs a CANCELLED gRPC stream from a thread when the runner hangs up.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_tiny_pipeline_on_flink_local(tmp_path):
    flink_job_server_jar()  # fails with the install command if missing
    wall = _tiny_job(runner_options("FlinkRunner", "batch", ["--parallelism=1"]), tmp_path)
    assert _squares(tmp_path) == [x * x for x in range(10)]
    print(f"flink tiny job: {wall:.1f}s")


def _table(out: Path, name: str) -> pl.DataFrame:
    """All rows of ``<out>/<name>/`` (hive columns included), sorted on every sortable column."""
    df = pl.from_arrow(duckdb.connect().sql(
        f"select * from read_parquet('{out}/{name}/**/*.parquet', hive_partitioning=true)").arrow())
    keys = [c for c, t in df.schema.items() if not isinstance(t, (pl.List, pl.Struct, pl.Array))]
    return df.sort(keys)


@pytest.mark.integration
@pytest.mark.slow
# Beam's LOOPBACK worker logs a CANCELLED gRPC stream from a thread when the runner hangs up.
@pytest.mark.filterwarnings("ignore::pytest.PytestUnhandledThreadExceptionWarning")
def test_trajectory_job_same_rows_on_flink_and_fnapi(tmp_path):
    """Acceptance: the batch job on FlinkRunner writes the same steps/ and trajectories/ rows as on FnApiRunner."""
    archive = write_archive(tmp_path / "archive", [flat(episodes(12, seed=5))])
    common = ["--source", "archive", "--archive", str(archive)]
    fn_counts = run([*common, "--out", str(tmp_path / "fnapi")])
    t0 = time.monotonic()
    flink_args = [a for a in runner_options("FlinkRunner", "batch", ["--parallelism=2"]).get_all_options(
        drop_default=True, retain_unknown_options=True).items()]
    flink_counts = run([*common, "--out", str(tmp_path / "flink"), "--runner", "FlinkRunner",
                        *(f"--{k}={v}" for k, v in flink_args if k != "runner")])
    print(f"trajectory job on flink local: {time.monotonic() - t0:.1f}s")
    assert flink_counts == fn_counts and fn_counts["episodes"] == 12
    for name in ("steps", "trajectories"):
        fn_rows, flink_rows = _table(tmp_path / "fnapi", name), _table(tmp_path / "flink", name)
        assert fn_rows.height > 0
        assert_frame_equal(flink_rows, fn_rows, check_exact=False, rel_tol=1e-9, abs_tol=1e-12)
