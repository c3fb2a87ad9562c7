"""DuckDB views over the event archive and the datasets, for analysts.

Views (each only if its directory exists):

* ``events`` — the event archive (one row per event; ``step.action_text``, ...).
* ``steps`` / ``trajectories`` — the datasets, every recipe version
  (``recipe`` and ``domain`` come from the hive partition keys).
* ``dataset_dead_letters`` — messages the trajectory job quarantined.
* ``late_events`` — events that came after their episode was written as
  incomplete (archive event schema plus ``late_reason``; pipelines/late.py).
* ``feedback`` — ratings and corrections given with ``trajpipe feedback``, one
  row per feedback event and dataset version (``applied``: the version's
  rewards took it; pipelines/feedback.py, docs/feedback.md).
* ``corrections`` — corrections turned into supervised samples (prompt = the
  recorded context of the corrected step, target = the correction's tokens).

Only committed files are read: the archive's are listed from its manifests;
the datasets' final files only ever appear after their commit (atomic rename).

From the shell::

    trajpipe query --archive data/archive --data data/datasets \\
        "select domain, count(*) episodes, avg(outcome_reward) from trajectories group by domain"

Examples:
    >>> import duckdb
    >>> con = duckdb.connect()
    >>> register_views(con)
    []
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from streams.archive import committed_files

__all__ = ["register_views"]


def _list(paths: list[Path]) -> str:
    return "[" + ", ".join("'" + str(p).replace("'", "''") + "'" for p in paths) + "]"


def register_views(
    con: duckdb.DuckDBPyConnection, *, archive: Path | None = None, data: Path | None = None
) -> list[str]:
    """Create the analyst views on ``con``; returns the names created.

    Args:
        con: a DuckDB connection.
        archive: event archive directory (``trajpipe archive --out``).
        data: dataset root (``trajpipe pipeline run --out``).
    """
    created = []
    if archive is not None:
        files = committed_files(Path(archive))
        if files:
            con.execute(f"create or replace view events as select * from read_parquet({_list(files)}, "
                        "hive_partitioning=true)")
            created.append("events")
    if data is not None:
        for name, sub in (("steps", "steps"), ("trajectories", "trajectories"),
                          ("dataset_dead_letters", "dead_letters"), ("late_events", "late_events"),
                          ("feedback", "feedback"), ("corrections", "corrections")):
            root = Path(data) / sub
            if any(root.glob("**/*.parquet")):
                glob = str(root / "**" / "*.parquet").replace("'", "''")
                con.execute(f"create or replace view {name} as select * from "
                            f"read_parquet('{glob}', hive_partitioning=true, union_by_name=true)")
                created.append(name)
    return created
