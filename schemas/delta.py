"""Delta Lake transactions over Parquet files already in place (delta-rs, ``deltalake``).

trajpipe's writers (the archiver, the dataset commit) put Parquet files into hive-partitioned
directories (``k=v/...``) with their own commit protocols; this module makes each of their
commits one Delta transaction on the directory, without copying or rewriting data:
:func:`add_files` adds the files (``add`` actions with the partition values from their paths and
``numRecords`` statistics), tagged with an **application transaction** (Delta's ``txn`` action:
``app_id`` → ``version``) so a retry adds nothing, and with ``trajpipe.*`` commit metadata.

Commits skip delta-rs' Parquet checkpoints (``PostCommitHookProperties(create_checkpoint=False)``):
a checkpoint is a ``.parquet`` file in ``_delta_log/``, which the plain glob readers
(``read_parquet('<dir>/**/*.parquet')``) would read as data. Snapshot readers replay the JSON log
instead (one small file per commit).

Concurrent writers append blind (no reads of the table's data), which Delta's optimistic
concurrency resolves by retrying on the next log version; two writers creating the table at
once: the loser appends to the winner's table.

References: the Delta transaction protocol (``add``, ``txn``, ``commitInfo`` actions),
https://github.com/delta-io/delta/blob/master/PROTOCOL.md; delta-rs
``create_table_with_add_actions`` and ``DeltaTable.create_write_transaction``.

Examples:
    >>> partition_values("recipe=outcome-0a1b2c3d/domain=code/c00000007-s000.parquet")
    {'recipe': 'outcome-0a1b2c3d', 'domain': 'code'}
"""

from __future__ import annotations

import json
import os
from collections.abc import Mapping, Sequence
from pathlib import Path

import pyarrow as pa
import pyarrow.parquet as pq
from deltalake import CommitProperties, DeltaTable, PostCommitHookProperties, Schema, Transaction
from deltalake.exceptions import DeltaError, TableNotFoundError
from deltalake.transaction import AddAction, create_table_with_add_actions

from schemas import locations as loc
from schemas.storage import delta_storage_options

__all__ = ["DeltaCommitError", "META_PREFIX", "partition_values", "open_table", "txn_version", "add_files", "batches"]

#: Prefix of trajpipe's keys in a Delta commit's metadata (``DeltaTable.history()``).
META_PREFIX = "trajpipe."
_HOOKS = PostCommitHookProperties(create_checkpoint=False, cleanup_expired_logs=False)


class DeltaCommitError(RuntimeError):
    """A Delta transaction could not be made (e.g. a schema the table does not accept); the message says which."""


def partition_values(rel_path: str) -> dict[str, str]:
    """The hive partition values of a file path relative to the table root (its ``k=v`` directories)."""
    return dict(seg.split("=", 1) for seg in rel_path.split("/")[:-1] if "=" in seg)


def open_table(table_root: Path | str) -> DeltaTable | None:
    """The Delta table at ``table_root`` (a local path or an ``s3://`` URI), or None where there is none yet."""
    root = os.fspath(table_root)
    if loc.is_remote(root):
        if not loc.list_files(loc.join(root, "_delta_log"), suffix=".json"):
            return None
    elif not (Path(root) / "_delta_log").is_dir():
        return None
    try:
        return DeltaTable(root, storage_options=delta_storage_options(root) or None)
    except TableNotFoundError:
        return None


def txn_version(table_root: Path | str, app_id: str) -> int:
    """The application transaction version ``app_id`` has reached on the table (0: none yet, or no table)."""
    dt = open_table(table_root)
    return (dt.transaction_version(app_id) or 0) if dt is not None else 0


def _schema(table_root: str, first: str) -> tuple[Schema, list[str]]:
    cols = list(partition_values(first))
    fs, path = loc.filesystem(loc.join(table_root, first))
    file_schema = pq.read_schema(path, filesystem=fs)
    fields = list(file_schema) + [pa.field(c, pa.string()) for c in cols if c not in file_schema.names]
    return Schema.from_arrow(pa.schema(fields)), cols


def _check_compatible(dt: DeltaTable, schema: Schema, cols: list[str], table_root: str) -> None:
    """Refuse a table these files do not belong to: other partition columns, a column they lack,
    or a primitive column of another type.

    delta-rs' ``create_write_transaction`` does not check the ``add`` actions against the table's
    schema: without this, files of another layout would be appended to (and misread as) a table
    some other tool made at the same path. Files with *more* (a newer event or dataset schema:
    new columns, new struct fields) are accepted; the table's schema is not widened, so a Delta
    reader sees the columns the table was made with, and the new ones through the files.
    """
    have, want = json.loads(dt.schema().to_json()), json.loads(schema.to_json())
    have_cols = list(dt.metadata().partition_columns)
    ours = {f["name"]: f["type"] for f in want["fields"]}
    clash = [f["name"] for f in have["fields"] if f["name"] not in ours
             or isinstance(f["type"], str) and f["type"] != ours[f["name"]]]
    if have_cols != cols or clash:
        def names(s: dict) -> str:
            return ", ".join(f"{f['name']}: {f['type'] if isinstance(f['type'], str) else f['type']['type']}"
                             for f in s["fields"])[:300]
        raise DeltaCommitError(
            f"the Delta table {table_root} has columns ({names(have)}) partitioned by {have_cols}, which the "
            f"files trajpipe writes there ({names(want)}, partitioned by {cols}) do not fit; it was made by "
            f"another tool: move it away (the commit is kept and is added on the next run)")


def add_files(table_root: Path | str, files: Sequence[tuple[str, int]], *, app_id: str, version: int,
              metadata: Mapping[str, str]) -> int | None:
    """Add Parquet files already under ``table_root`` to its Delta table in one transaction.

    Args:
        table_root: the table directory (created as a Delta table by the first call).
        files: ``(path relative to table_root, rows)`` of each file; hive ``k=v`` directories
            give the partition values (every file of a table has the same keys).
        app_id: application transaction id.
        version: its new version; a table already at ``>= version`` is left as is.
        metadata: commit metadata (keys should start with :data:`META_PREFIX`).

    Returns:
        The table's new version, or None when the transaction was already made.

    Raises:
        DeltaCommitError: the table refused the transaction.
    """
    table_root = os.fspath(table_root)
    table_root = table_root if loc.is_remote(table_root) else str(Path(table_root))
    options = delta_storage_options(table_root) or None
    dt = open_table(table_root)
    if dt is not None and (dt.transaction_version(app_id) or 0) >= version:
        return None
    schema, cols = _schema(table_root, files[0][0])
    if dt is not None:
        _check_compatible(dt, schema, cols, table_root)
    actions = []
    for rel, rows in files:
        size, mtime_ms = loc.size_and_mtime_ms(loc.join(table_root, rel))
        actions.append(AddAction(path=rel, size=size, partition_values=partition_values(rel),
                                 modification_time=mtime_ms, data_change=True,
                                 stats=json.dumps({"numRecords": rows})))
    def props(**kw: int) -> CommitProperties:
        return CommitProperties(custom_metadata=dict(metadata),
                                app_transactions=[Transaction(app_id=app_id, version=version)], **kw)

    try:
        if dt is None:
            try:
                # no retry: delta-rs retries a create that lost the race for version 0 as a second CREATE
                # TABLE at version 1 (schemas/commit_log.py, tests/storage/test_commit_log.py)
                create_table_with_add_actions(table_root, schema, actions, mode="error", partition_by=cols,
                                              storage_options=options, post_commithook_properties=_HOOKS,
                                              commit_properties=props(max_commit_retries=0))
                return 0
            except DeltaError:  # another writer created it first: append like any later commit
                dt = open_table(table_root)
                if dt is None:
                    raise
                if (dt.transaction_version(app_id) or 0) >= version:
                    return None
                _check_compatible(dt, schema, cols, table_root)
        dt.create_write_transaction(actions, mode="append", schema=schema, partition_by=cols,
                                    commit_properties=props(), post_commithook_properties=_HOOKS)
    except DeltaError as err:
        again = open_table(table_root)
        if again is not None and (again.transaction_version(app_id) or 0) >= version:
            return None  # another process (recovering the same commit) made this transaction first
        raise DeltaCommitError(f"cannot add {len(files)} files to the Delta table {table_root} "
                               f"({app_id} version {version}): {err}") from err
    return DeltaTable(table_root, storage_options=options).version()


def batches(table_root: Path | str) -> list[dict[str, str | int]]:
    """trajpipe's commits of a Delta table, oldest first: ``{"table_version": K, <metadata without prefix>...}``."""
    dt = open_table(table_root)
    if dt is None:
        return []
    out = []
    for entry in dt.history():
        if not any(k.startswith(META_PREFIX) for k in entry):
            continue
        row: dict[str, str | int] = {"table_version": int(entry["version"])}
        row.update({k[len(META_PREFIX):]: v for k, v in entry.items() if k.startswith(META_PREFIX)})
        out.append(row)
    return sorted(out, key=lambda r: int(r["table_version"]))
