"""The ``events`` view over an archive written by schema-1 code and by this code: ``purpose`` is visible."""

from __future__ import annotations

import shutil
from pathlib import Path

import duckdb

from pipelines.query import register_views
from streams.archive import PartitionRange, write_commit
from tests.pipelines.helpers import episodes, flat
from tests.pipelines.test_evaluations import _as_eval

FIXTURE = Path(__file__).resolve().parents[1] / "fixtures" / "archive-schema-v1"


def test_purpose_reads_across_schema_versions(tmp_path):
    root = tmp_path / "archive"
    shutil.copytree(FIXTURE, root)
    new = flat(episodes(2, seed=61) + [_as_eval(ep) for ep in episodes(1, seed=62)])
    write_commit(root, commit=2, topic="trajpipe.events", buckets=2, events=new,
                 positions=[(0, 10_000 + i) for i in range(len(new))],
                 offsets={0: PartitionRange(10_000, 10_000 + len(new))})
    con = duckdb.connect()
    assert register_views(con, archive=root) == ["events"]
    rows = con.execute("select schema_version, coalesce(episode_started.purpose, 'train') p, count(*) from events "
                       "where event_type = 'episode_started' group by all order by all").fetchall()
    assert rows == [(1, "train", 8), (3, "eval", 1), (3, "train", 2)]
