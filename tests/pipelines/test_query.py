"""`trajpipe query`: analyst views over a real archive and real datasets."""

from __future__ import annotations

import json
import subprocess
import sys

import duckdb

from pipelines.query import register_views
from pipelines.trajectory_job import run
from tests.pipelines.helpers import episodes, flat, write_archive


def test_views_and_cli_over_archive_and_datasets(tmp_path):
    eps = episodes(12, seed=4)
    archive = write_archive(tmp_path / "archive", [flat(eps[:6]), flat(eps[6:])])
    # an uncommitted file beside the committed ones must stay invisible
    (archive / "bucket=00" / "c00000003.parquet.tmp").write_bytes(b"partial")
    counts = run(["--source", "archive", "--archive", str(archive), "--out", str(tmp_path / "ds")])
    con = duckdb.connect()
    assert register_views(con, archive=archive, data=tmp_path / "ds") == ["events", "steps", "trajectories"]
    n_events = sum(len(e) for e in eps)
    assert con.sql("select count(*) from events").fetchall() == [(n_events,)]
    assert con.sql("select count(*) from trajectories").fetchall() == [(12,)]
    assert con.sql("select count(*) from steps").fetchall() == [(counts["steps"],)]
    # steps join back to their source events by event_id
    joined = con.sql("select count(*) from steps s join events e using (event_id) where e.event_type = 'step'")
    assert joined.fetchall() == [(counts["steps"],)]

    out = subprocess.run(
        [sys.executable, "-m", "trajpipe", "query", "--archive", str(archive), "--data", str(tmp_path / "ds"),
         "--format", "json", "select domain, count(*) n from trajectories group by domain order by domain"],
        check=True, capture_output=True, text=True, timeout=120,
    )
    rows = [json.loads(line) for line in out.stdout.splitlines()]
    assert sum(r["n"] for r in rows) == 12 and {r["domain"] for r in rows} <= {"code", "math", "docqa", "tools"}
    bad = subprocess.run([sys.executable, "-m", "trajpipe", "query", "--data", str(tmp_path / "ds"), "select * from nope"],
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and "nope" in bad.stderr
