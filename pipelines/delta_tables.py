"""Every dataset commit published as one Delta Lake transaction per table (delta-rs, ``deltalake``).

The dataset's data tables -- ``steps``, ``trajectories``, ``evaluations``, ``dead_letters``,
``late_events`` -- are Delta tables: ``<out>/<table>/_delta_log/`` next to the hive-partitioned
Parquet files the job already writes (``recipe=<version>/domain=<d>/c<n>-s<k>.parquet``). No data
is copied or rewritten: commit ``n`` of a dataset version adds its files to each table it wrote
to, in **one Delta transaction per table**, every one carrying

* the same **batch id** ``<version>/<n:08d>`` and the input it covers (Kafka offsets or archive
  commits), the recipe hash, the source, mode and the run's counts, as commit metadata
  (``trajpipe.*`` keys of ``DeltaTable.history()``);
* the **application transaction** ``trajpipe.<version>`` = ``n`` (Delta's ``txn`` action), so a
  retry of the same commit adds nothing: :func:`publish_commit` skips a table whose transaction
  version is already ``>= n``.

Order of a commit (:func:`pipelines.commit.commit_staged`): staged files → manifest (the commit
point of the batch, naming every file of every table) → renames → the Delta transactions. A crash
anywhere after the manifest is rolled forward by the next run's :func:`pipelines.commit.recover`,
which ends with :func:`roll_forward`: every table's transaction version is brought up to the last
manifest, commit by commit, in order. A snapshot reader therefore never sees half a batch within a
table, and pairs tables by batch id: :func:`table_versions_at` gives, for one batch, the Delta
version of each table that contains it.

What the plain glob (``read_parquet('<out>/steps/**/*.parquet', hive_partitioning=true)``) sees
that a Delta snapshot does not: files of a commit whose manifest is written but whose transaction
is not (yet) -- between the renames and the Delta commit, or after a crash there until the next
run rolls it forward. Tables are append-only, so the glob never sees a removed file.

No checkpoints (see :mod:`schemas.delta`, which makes the transactions): a Parquet checkpoint in
``_delta_log/`` would be read as data by the glob above.

Concurrent writers: different dataset versions (recipes) on one ``<out>`` append to the same
Delta tables; delta-rs resolves concurrent appends with optimistic concurrency (blind appends do
not conflict; it retries the commit on the next log version). Two runs of one version are
serialized by :func:`pipelines.commit.commit_lock` before they get here (locally), or by the
dataset's commit log (object stores: one run's commit ``n`` is refused); a recovery that makes the
same commit's transaction at the same time as its run finds it made and skips it.

``<out>`` may be a local directory or ``s3://BUCKET/PREFIX``: the tables are then
``s3://.../<table>``, opened with :func:`schemas.storage.delta_storage_options`.

References: Delta Lake transaction protocol (``txn`` action, ``commitInfo``),
https://github.com/delta-io/delta/blob/master/PROTOCOL.md.

Examples:
    >>> batch_id("outcome-0a1b2c3d", 7)
    'outcome-0a1b2c3d/00000007'
    >>> app_id("outcome-0a1b2c3d")
    'trajpipe.outcome-0a1b2c3d'
"""

from __future__ import annotations

import json
import logging
import os
from collections.abc import Iterable
from pathlib import Path
from typing import TYPE_CHECKING

from schemas.delta import META_PREFIX, add_files, batches, txn_version
from schemas.locations import join

if TYPE_CHECKING:
    from pipelines.commit import CommittedFile, DatasetManifest

__all__ = ["DATA_TABLES", "app_id", "batch_id", "publish_commit", "roll_forward",
           "table_versions_at", "delta_batches"]

log = logging.getLogger(__name__)

#: The dataset's data tables, each a Delta table at ``<out>/<name>``.
DATA_TABLES = ("steps", "trajectories", "evaluations", "dead_letters", "late_events")


def app_id(version: str) -> str:
    """The Delta application-transaction id of one dataset version."""
    return f"trajpipe.{version}"


def batch_id(version: str, commit: int) -> str:
    """The batch id every table's transaction of commit ``commit`` carries."""
    return f"{version}/{commit:08d}"


def _table_files(manifest: DatasetManifest) -> dict[str, list[CommittedFile]]:
    out: dict[str, list[CommittedFile]] = {}
    for f in manifest.files:
        table = f.path.split("/", 1)[0]
        if table in DATA_TABLES and f.path.endswith(".parquet"):
            out.setdefault(table, []).append(f)
    return out


def _metadata(manifest: DatasetManifest) -> dict[str, str]:
    return {f"{META_PREFIX}{k}": v for k, v in {
        "batch_id": batch_id(manifest.version, manifest.commit),
        "version": manifest.version,
        "commit": str(manifest.commit),
        "recipe_hash": manifest.recipe_hash,
        "source": manifest.source,
        "mode": manifest.mode,
        "offsets": json.dumps(manifest.offsets, sort_keys=True),
        "archive_commits": json.dumps(manifest.archive_commits),
        "counts": json.dumps(manifest.counts, sort_keys=True),
        "created_at": manifest.created_at.isoformat(),
    }.items()}


def _commit_table(root: str, table: str, files: list[CommittedFile], manifest: DatasetManifest) -> int | None:
    return add_files(join(root, table), [(f.path.split("/", 1)[1], f.rows) for f in files],
                     app_id=app_id(manifest.version), version=manifest.commit, metadata=_metadata(manifest))


def publish_commit(root: Path | str, manifest: DatasetManifest) -> dict[str, int]:
    """Add one committed (renamed) dataset commit to its Delta tables: ``{table: new table version}``.

    Idempotent: a table that already holds the commit (application transaction) is skipped.

    Raises:
        schemas.delta.DeltaCommitError: a table refused the transaction.
    """
    root = os.fspath(root)
    done = {}
    for table, files in sorted(_table_files(manifest).items()):
        version = _commit_table(root, table, files, manifest)
        if version is not None:
            done[table] = version
    return done


def roll_forward(root: Path | str, manifests: Iterable[DatasetManifest]) -> int:
    """Publish, in commit order, every committed manifest a Delta table does not hold yet.

    Returns:
        How many table transactions were made (0 when every table was up to date).
    """
    root = os.fspath(root)
    manifests = sorted(manifests, key=lambda m: m.commit)
    if not manifests:
        return 0
    app = app_id(manifests[0].version)
    made = 0
    for table in DATA_TABLES:
        have = txn_version(join(root, table), app)
        for m in manifests:
            files = _table_files(m).get(table)
            if m.commit <= have or not files:
                continue
            log.warning("adding dataset commit %s of %s to the Delta table %s (rolled forward)", m.commit,
                        m.version, table)
            if _commit_table(root, table, files, m) is not None:
                made += 1
    return made


def delta_batches(table_root: Path | str) -> list[dict[str, str | int]]:
    """The dataset batches of a Delta table, oldest first: ``{"table_version", "batch_id", "commit", ...}``."""
    return [b for b in batches(table_root) if "batch_id" in b]


def table_versions_at(root: Path | str, version: str, commit: int) -> dict[str, int]:
    """For each Delta table of ``root``: the table version that includes commit ``commit`` of ``version``.

    That is the newest table version whose batch of this dataset version is ``<= commit`` -- the
    snapshot to pair with the other tables' for that batch. Tables that hold nothing of it
    by then are left out.
    """
    out = {}
    for table in DATA_TABLES:
        best = None
        for b in delta_batches(join(os.fspath(root), table)):
            if b["version"] == version and int(b["commit"]) <= commit:
                best = int(b["table_version"])
        if best is not None:
            out[table] = best
    return out
