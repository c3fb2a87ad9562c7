"""schemas/delta.py: writers adding files to a Delta table that does not exist yet, all at once."""

from __future__ import annotations

import concurrent.futures
import multiprocessing
import time
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
import pytest
from deltalake import DeltaTable

from schemas import delta


def _add(root: str, writer: int, at: float) -> int | None:
    name = f"domain=d{writer}/part-{writer}.parquet"
    (Path(root) / name).parent.mkdir(parents=True, exist_ok=True)
    pq.write_table(pa.table({"writer": [writer] * (writer + 1)}), Path(root) / name)
    while time.time() < at:  # the writers start together
        pass
    return delta.add_files(root, [(name, writer + 1)], app_id=f"trajpipe.w{writer}", version=1,
                           metadata={"trajpipe.writer": str(writer)})


@pytest.mark.slow
def test_writers_creating_a_table_at_once_create_it_once_and_each_adds_its_files(tmp_path):
    """Four processes add their file to a table none has created, at the same moment, several times: the table
    is created once (a losing create appends instead; delta-rs retried it as a second CREATE TABLE at version 1,
    see tests/storage/test_commit_log.py) and holds every writer's rows and transaction."""
    with concurrent.futures.ProcessPoolExecutor(4, mp_context=multiprocessing.get_context("spawn")) as pool:
        for r in range(4):
            root = str(tmp_path / f"table-{r}")
            Path(root).mkdir()
            list(pool.map(_add, [root] * 4, range(4), [time.time() + 0.3] * 4))
            log = sorted((Path(root) / "_delta_log").glob("*.json"))
            creates = sum(b'"operation":"CREATE TABLE"' in p.read_bytes() for p in log)
            assert creates == 1 and len(log) == 4, [p.name for p in log]
            dt = DeltaTable(root)
            assert sorted(dt.to_pyarrow_table()["writer"].to_pylist()) == [w for w in range(4) for _ in range(w + 1)]
            assert [dt.transaction_version(f"trajpipe.w{w}") for w in range(4)] == [1] * 4
            assert sorted(b["writer"] for b in delta.batches(root)) == ["0", "1", "2", "3"]
