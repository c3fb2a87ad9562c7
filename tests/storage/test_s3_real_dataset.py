"""A real dataset on the object store: scripted sandboxed rollouts -> Kafka -> the Beam job -> Delta on S3.

The job's sinks still write local files (issue 14's next step moves them onto Delta); here the
committed ``steps`` of a real run are published as a Delta table on SeaweedFS with the storage
layer, one Delta commit per dataset commit (its id as commit metadata, the commit number as the
application transaction), and read back by the data's consumers' readers -- polars and DuckDB --
with every row, episode and token count equal to what the job reported and committed locally.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import duckdb
import polars as pl
import pyarrow.dataset as pads
import pytest
from deltalake import CommitProperties, DeltaTable, Transaction, write_deltalake

from pipelines.catalog import open_catalog
from schemas.storage import delta_storage_options

# ~1.5 min here under load (four `trajpipe` processes, a Kafka broker and SeaweedFS)
pytestmark = [pytest.mark.slow, pytest.mark.integration, pytest.mark.timeout(1200)]

REPO = Path(__file__).resolve().parents[2]


def _trajpipe(env: dict, *args) -> dict:
    proc = subprocess.run([sys.executable, "-m", "trajpipe", *map(str, args)], cwd=REPO, env=env,
                          capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, f"trajpipe {' '.join(map(str, args))}\n{proc.stderr[-3000:]}"
    return json.loads(proc.stdout.strip().splitlines()[-1])


def test_a_real_datasets_steps_published_to_delta_on_s3_read_back_equal(kafka_broker, s3_store, tmp_path,
                                                                        monkeypatch):
    from rollout.model import init_tiny_model

    topic = f"s3-dataset-{os.getpid()}"
    env = {**{k: v for k, v in os.environ.items() if not k.startswith(("TRAJPIPE_", "AWS_"))},
           "PYTHONPATH": str(REPO), "TRAJPIPE_TOPICS__EVENTS": topic, "TRAJPIPE_TOPICS__CONTROL": f"{topic}.ctl",
           "TRAJPIPE_TOPICS__DEAD_LETTERS": f"{topic}.dl", "TRAJPIPE_SPOOL_DIR": str(tmp_path / "spool")}
    b, data = kafka_broker.bootstrap, tmp_path / "datasets"
    tiny = init_tiny_model(tmp_path / "tiny", seed=0)
    rollout = ["rollout", "--bootstrap", b, "--policy", "scripted", "--model", tiny, "--domains",
               "code,math,docqa,tools", "--concurrency", 4, "--no-follow-policies", "--noise", 0.3]
    jobs = []
    for seed in (1, 2):  # two micro-batches: two dataset commits
        _trajpipe(env, *rollout, "--episodes", 6, "--seed", seed)
        jobs.append(_trajpipe(env, "pipeline", "run", "--source", "kafka", "--bootstrap", b, "--out", data))
    assert all(j["steps"] > 0 and j["dead_letters"] == 0 for j in jobs), jobs

    for name, value in s3_store.env().items():
        monkeypatch.setenv(name, value)
    uri = s3_store.uri("real-dataset", "steps")
    options = delta_storage_options(uri)
    published: list[str] = []
    for commit in (1, 2):  # each local dataset commit becomes one Delta commit, in order
        steps = open_catalog(data=data, as_of=commit).tables["steps"]
        new = [f for f in steps.files if f not in published]
        published += new
        rows = pads.dataset(new, format="parquet", partitioning="hive",
                            partition_base_dir=str(data / "steps")).to_table()
        write_deltalake(uri, rows, mode="append", partition_by=["domain"], storage_options=options,
                        commit_properties=CommitProperties(
                            custom_metadata={"trajpipe.batch_id": f"{steps.version}/commit-{commit}"},
                            app_transactions=[Transaction(app_id=f"trajpipe.steps.{steps.version}", version=commit)]))

    table = DeltaTable(uri, storage_options=options)
    version = steps.version
    assert table.version() == 1 and table.transaction_version(f"trajpipe.steps.{version}") == 2
    assert sorted(c["trajpipe.batch_id"] for c in table.history()) == [f"{version}/commit-1", f"{version}/commit-2"]
    query = "select count(*), count(distinct episode_id), sum(context_tokens) from {}"
    delta_steps = table.to_pyarrow_dataset()  # noqa: F841 - queried by name
    by_duckdb = duckdb.sql(query.format("delta_steps")).fetchall()[0]
    lf = pl.scan_delta(uri, storage_options=options)
    by_polars = lf.select(pl.len(), pl.col("episode_id").n_unique(), pl.col("context_tokens").sum()).collect().row(0)
    files = ", ".join(f"'{f}'" for f in published)
    local = duckdb.sql(query.format(f"read_parquet([{files}], hive_partitioning=true)")).fetchall()[0]
    assert by_duckdb == by_polars == local
    assert local[0] == sum(j["steps"] for j in jobs) and local[1] == sum(j["episodes"] for j in jobs)
    # version 0 is the first micro-batch, as the job committed it
    assert DeltaTable(uri, version=0, storage_options=options).to_pyarrow_dataset().count_rows() == jobs[0]["steps"]
