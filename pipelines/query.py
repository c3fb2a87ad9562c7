"""DuckDB views over the event archive and the datasets, for analysts.

Views (each only if its directory exists):

* ``events`` — the event archive (one row per event; ``step.action_text``, ...).
  Fields added by later schema versions are null in older files:
  ``coalesce(episode_started.purpose, 'train')``.
* ``steps`` / ``trajectories`` — the datasets, every recipe version
  (``recipe`` and ``domain`` come from the hive partition keys).
* ``dataset_dead_letters`` — messages the trajectory job quarantined.
* ``late_events`` — events that came after their episode was written as
  incomplete (archive event schema plus ``late_reason``; pipelines/late.py).
* ``evaluations`` — one row per finished held-out evaluation episode
  (``purpose = "eval"``; schemas.datasets.EvaluationRow), once even when
  several dataset versions (recipes) were written under the same root.
* ``evaluation_pass_rates`` — per ``policy_version``, ``domain``,
  ``difficulty``: episodes, passed, ``pass_rate``, ``mean_reward``, mean
  tokens. Aborted episodes (stopped by a shutdown) are not attempts and are
  left out; ``error``/``timeout`` ones count as not passed.

Only committed files are read: the archive's are listed from its manifests;
the datasets' final files only ever appear after their commit (atomic rename).

From the shell::

    trajpipe query --archive data/archive --data data/datasets \\
        "select domain, count(*) episodes, avg(outcome_reward) from trajectories group by domain"
    trajpipe query --data data/datasets "select * from evaluation_pass_rates"

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
            # union_by_name: files of older schema versions lack newer struct fields (e.g. episode_started.purpose,
            # schema 3); by name, those read as null instead of the first file's schema hiding them everywhere.
            con.execute(f"create or replace view events as select * from read_parquet({_list(files)}, "
                        "hive_partitioning=true, union_by_name=true)")
            created.append("events")
    if data is not None:
        for name, sub in (("steps", "steps"), ("trajectories", "trajectories"),
                          ("dataset_dead_letters", "dead_letters"), ("late_events", "late_events")):
            root = Path(data) / sub
            if any(root.glob("**/*.parquet")):
                glob = str(root / "**" / "*.parquet").replace("'", "''")
                con.execute(f"create or replace view {name} as select * from "
                            f"read_parquet('{glob}', hive_partitioning=true, union_by_name=true)")
                created.append(name)
        root = Path(data) / "evaluations"
        if any(root.glob("**/*.parquet")):
            glob = str(root / "**" / "*.parquet").replace("'", "''")
            con.execute(f"create or replace view evaluations as select * exclude (_n) from ("
                        f"select *, row_number() over (partition by episode_id order by recipe) as _n from "
                        f"read_parquet('{glob}', hive_partitioning=true, union_by_name=true) where complete"
                        f") where _n = 1")
            con.execute(_PASS_RATES)
            created += ["evaluations", "evaluation_pass_rates"]
    return created


_PASS_RATES = """
create or replace view evaluation_pass_rates as
select policy_version, domain, difficulty, count(*) as episodes, count(*) filter (where passed) as passed,
       round(avg(passed::int), 4) as pass_rate, round(avg(outcome_reward), 4) as mean_reward,
       round(avg(prompt_tokens), 1) as mean_prompt_tokens, round(avg(action_tokens), 1) as mean_action_tokens,
       count(distinct eval_run) as eval_runs
from evaluations where status <> 'aborted'
group by all order by policy_version, domain, difficulty
"""
