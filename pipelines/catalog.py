"""The analyst catalog: every table trajpipe writes, as DuckDB views and polars LazyFrames.

This is the one module that knows the on-disk layout of the tables (a change
of layout, e.g. to Delta tables, touches only this file):

* ``<data>/_commit_log/<V>/`` — the commit log of version ``V``: commit ``n``'s record is its manifest
  (a dataset written before the log: ``<data>/_manifests/<V>/<n>.json``, read the same)
  (pipelines/commit.py); it names every data file of the commit.
* ``<data>/<table>/recipe=<V>/...parquet`` — the dataset tables: ``steps``,
  ``trajectories``, ``dead_letters``, ``late_events`` and whatever other
  table a job commits the same way (``evaluations``, ``feedback``,
  ``corrections`` once those jobs write them): a top-level directory of
  ``<data>`` is a table.
* ``<archive>/_commit_log/`` (commit ``n``'s record is its manifest) + ``bucket=NN/c<n>.parquet`` — the event
  archive (:func:`streams.archive.read_commits` reads its manifests).
* ``<run>/policies/v<N>/policy.json`` — the policy store of a training run.

Views (each only if its table has data):

============================  ===============================================================
``events``                    the event archive (every committed archive commit)
``steps``, ``trajectories``   the dataset tables of the selected version (``recipe``, ``domain``
                              are hive keys; ``filename`` names the data file)
``dead_letters``              messages the trajectory job quarantined (``dataset_dead_letters``
                              is the same view under its old name)
``late_events``               events that came after their episode was written incomplete
``incomplete``                ``trajectories`` rows with ``complete = false``
``evaluation_pass_rates``     held-out pass rate per policy version x domain x level (finished,
                              non-aborted ``evaluations`` rows, each episode once)
``evaluations``, ``feedback``, ``corrections``, ...   any other table under ``<data>``
                              (``evaluations``: finished held-out episodes, each once)
``policies``                  published policies (one row per ``policy.json``)
``commits``                   commit history: every dataset commit of every version and every
                              archive commit, with its counts and time
``commit_files``              data file -> (table, version, commit, created_at): joins a row's
                              ``filename`` to the commit that made it visible
``dataset_versions``          every dataset version: recipe, commits, newest commit time
``catalog_info``              what this catalog shows: per table the version, commit and files
============================  ===============================================================

**Snapshot consistency.** A view lists the data files named by the committed
manifests of its version, never a directory glob, so a file that is staged,
half renamed or written by a commit that has not reached its commit point is
never read. A commit whose manifest exists but whose files are not all in
place yet (the renames after the commit point are under way) is not shown
either: the catalog shows the longest prefix of commits whose files are all
in place, so it never shows half a commit. ``as_of`` selects an earlier
commit of the version. A table that no manifest names (a directory some other
tool writes) is read from its ``*.parquet`` files and marked
``snapshot = false`` in ``catalog_info``.

**Object stores.** ``data`` may be ``s3://BUCKET/PREFIX`` (:mod:`schemas.locations`; settings from the
AWS environment variables): the manifests are read the same way, and each view reads its committed
files as a ``pyarrow.dataset`` registered on the connection (DuckDB scans it with projection and
filter pushdown; its ``httpfs`` extension is not needed). Its ``filename`` column is the file's
``s3://`` URI, its hive keys strings. ``archive`` may be an ``s3://`` URI the same way. A database
file (:func:`write_catalog`) cannot hold such a view (it would need ``httpfs`` and the credentials
in every client): it holds a copy of the snapshot's rows as a table instead.

**Following new commits.** The views are pinned to the commits that existed
when the catalog was opened: new commits are not seen until it is opened
again. ``trajpipe query`` and ``trajpipe report`` open it on every run (so
they always read the newest complete commit); a database file written by
:func:`write_catalog` (``trajpipe catalog --db FILE``) keeps its snapshot until
``trajpipe catalog`` is run again, which replaces the file atomically.

Examples:
    >>> cat = open_catalog()
    >>> cat.tables, cat.version
    ({}, None)
"""

from __future__ import annotations

import json
import os
from collections.abc import Iterable, Sequence
from dataclasses import dataclass, field
from datetime import datetime, timezone
from pathlib import Path, PurePosixPath
from typing import Any

import duckdb
import msgspec
import polars as pl
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as pads
import pyarrow.parquet as pq

from pipelines.commit import CommitError, DatasetLayout, DatasetManifest, read_manifests
from schemas import locations as loc
from schemas.manifests import list_dataset_versions
from streams.archive import is_archive, read_commits

__all__ = [
    "CatalogError",
    "Catalog",
    "TableFiles",
    "open_catalog",
    "write_catalog",
    "arrow_dataset",
    "ALL_VERSIONS",
    "DB_STORAGE_VERSION",
]

#: ``version=ALL_VERSIONS`` shows every dataset version side by side (each at its newest commit).
ALL_VERSIONS = "all"
#: DuckDB storage version of the database files :func:`write_catalog` writes: readable by the DuckDB CLI
#: from PyPI (duckdb-cli 1.5) as well as by the Python package (2.x), which writes a newer format by default.
DB_STORAGE_VERSION = "v1.2.0"
#: Views derived from other views (name -> SQL), created when their source exists.
_DERIVED = {
    "incomplete": ("trajectories", "select * from trajectories where not complete"),
    "dataset_dead_letters": ("dead_letters", "select * from dead_letters"),
    # Held-out evaluations (pipelines/evaluations.py): finished episodes, each once even when several versions
    # (recipes) are shown; aborted ones (stopped by a shutdown) are no attempts; error/timeout count as failed.
    "evaluation_pass_rates": ("evaluations", """
        select policy_version, domain, difficulty, count(*) as episodes, count(*) filter (where passed) as passed,
               round(avg(passed::int), 4) as pass_rate, round(avg(outcome_reward), 4) as mean_reward,
               round(avg(prompt_tokens), 1) as mean_prompt_tokens, round(avg(action_tokens), 1) as mean_action_tokens,
               count(distinct eval_run) as eval_runs
        from evaluations where status <> 'aborted'
        group by all order by policy_version, domain, difficulty"""),
}


class CatalogError(ValueError):
    """The catalog cannot be opened as asked (missing dataset, unknown version, commit out of range)."""


@dataclass(frozen=True)
class TableFiles:
    """The data files one view reads.

    Attributes:
        name: view name.
        files: absolute paths (or ``s3://`` URIs) of the Parquet files, in commit order.
        hive: the files sit in ``key=value`` directories whose keys become columns.
        version: dataset version shown (None: the archive, or every version).
        commit: newest commit shown (None: not committed through manifests).
        snapshot: the file list comes from commit manifests (False: a directory listing).
        schema_files: one file per commit (a commit writes one schema): what polars reads schemas from.
    """

    name: str
    files: tuple[str, ...]
    hive: bool = True
    version: str | None = None
    commit: int | None = None
    snapshot: bool = True
    schema_files: tuple[str, ...] = ()


@dataclass
class Catalog:
    """Every table of one dataset root (and archive, and training runs), pinned to a snapshot.

    Build it with :func:`open_catalog`. ``tables`` are Parquet-backed views;
    ``frames`` small in-memory tables (commit history, policies, versions).

    Attributes:
        data: dataset root (``trajpipe pipeline run --out``): a local directory, or an ``s3://`` URI (a string).
        archive: event archive: a local directory, or an ``s3://`` URI (a string).
        runs: training run directories searched for published policies.
        version: the dataset version shown (``all``: every version).
        as_of: the commit asked for (None: the newest complete one).
        tables: view name -> its files.
        frames: view name -> an Arrow table.
        versions: every dataset version -> its visible commits (manifests).
    """

    data: Path | str | None = None
    archive: Path | str | None = None
    runs: tuple[Path | str, ...] = ()
    version: str | None = None
    as_of: int | None = None
    tables: dict[str, TableFiles] = field(default_factory=dict)
    frames: dict[str, pa.Table] = field(default_factory=dict)
    versions: dict[str, list[DatasetManifest]] = field(default_factory=dict)

    @property
    def views(self) -> list[str]:
        """Every view name, sorted."""
        derived = [n for n, (src, _) in _DERIVED.items() if src in self.tables]
        return sorted([*self.tables, *self.frames, *derived])

    def view_sql(self, name: str) -> str:
        """The ``select`` a Parquet-backed view runs (DuckDB SQL).

        Local files: ``read_parquet`` of their absolute paths. Files on an object store: the Arrow
        dataset :meth:`register` registers as ``_arrow_<name>``.
        """
        t = self.tables[name]
        if _remote(t):
            sql = f"select * from {_arrow_name(name)}"
        else:
            files = "[" + ", ".join(_quote(f) for f in t.files) + "]"
            sql = (f"select * from read_parquet({files}, hive_partitioning={'true' if t.hive else 'false'}, "
                   "union_by_name=true, filename=true)")
        if name == "evaluations":  # finished eval episodes, each once even when several versions are shown
            sql = (f"select * from ({sql}) where complete "
                   "qualify row_number() over (partition by episode_id order by recipe) = 1")
        return sql

    def register(self, con: duckdb.DuckDBPyConnection) -> list[str]:
        """Create every view on ``con`` (in-memory frames are registered, not copied); returns the names."""
        for name, t in self.tables.items():
            if _remote(t):
                con.register(_arrow_name(name), arrow_dataset(t))
            con.execute(f"create or replace view {name} as {self.view_sql(name)}")
        for name, table in self.frames.items():
            con.register(name, table)
        for name, (src, sql) in _DERIVED.items():
            if src in self.tables:
                con.execute(f"create or replace view {name} as {sql}")
        return self.views

    def scan(self, name: str) -> pl.LazyFrame:
        """The view ``name`` as a polars LazyFrame (same rows and columns as the DuckDB view).

        Raises:
            CatalogError: no such view.
        """
        if name in self.frames:
            return pl.from_arrow(self.frames[name]).lazy()
        if name in _DERIVED and _DERIVED[name][0] in self.tables:
            src = self.scan(_DERIVED[name][0])
            if name == "incomplete":
                return src.filter(~pl.col("complete"))
            if name == "dataset_dead_letters":
                return src
            return pl.from_arrow(self.connect().execute(f"select * from {name}").arrow()).lazy()  # an aggregate
        if name not in self.tables:
            raise CatalogError(f"no view {name!r}; views: {', '.join(self.views) or 'none'}")
        if name == "evaluations":  # the view's rows (see view_sql), not the table's
            return pl.from_arrow(self.connect().execute("select * from evaluations").arrow()).lazy()
        t = self.tables[name]
        if _remote(t):
            return pl.scan_pyarrow_dataset(arrow_dataset(t))
        schema = pa.unify_schemas([pq.read_schema(f) for f in t.schema_files or t.files], promote_options="permissive")
        return pl.scan_parquet(list(t.files), schema=pl.from_arrow(schema.empty_table()).schema,
                               hive_partitioning=t.hive, missing_columns="insert", include_file_paths="filename")

    def connect(self, database: str = ":memory:") -> duckdb.DuckDBPyConnection:
        """A new DuckDB connection with every view registered."""
        con = duckdb.connect(database)
        self.register(con)
        return con


def _quote(text: str) -> str:
    return "'" + str(text).replace("'", "''") + "'"


def _remote(t: TableFiles) -> bool:
    return loc.is_remote(t.files[0])


def _arrow_name(view: str) -> str:
    return f"_arrow_{view}"


def arrow_dataset(t: TableFiles) -> pads.FileSystemDataset:
    """The files of ``t`` as one ``pyarrow.dataset`` with the columns DuckDB's ``read_parquet`` view gives.

    Those are: every file column (schemas of ``t.schema_files`` unified by name, as ``union_by_name``),
    ``filename`` (the file's location) and the hive keys Arrow parses from the paths. ``filename`` and
    the keys are each fragment's partition expression, so Arrow fills them and prunes files by them.
    """
    fs, _ = loc.filesystem(t.files[0])
    paths = {f: loc.filesystem(f)[1] for f in t.files}
    # Hive keys as strings, as DuckDB's view reads them (``bucket=06`` is '06', not 6).
    keys = sorted({seg.split("=", 1)[0] for p in paths.values() for seg in p.split("/")[:-1] if "=" in seg})
    hive_keys = pads.partitioning(pa.schema([(k, pa.string()) for k in keys]), flavor="hive")
    found = pads.dataset(list(paths.values()), filesystem=fs, format="parquet",
                         partitioning=hive_keys if t.hive else None)
    keys = {frag.path: frag.partition_expression for frag in found.get_fragments()}
    columns = pa.unify_schemas([pq.read_schema(paths[f], filesystem=fs) for f in t.schema_files or t.files],
                               promote_options="permissive")
    hive = sorted((f for f in found.schema if f.name not in columns.names), key=lambda f: f.name)
    schema = pa.schema([*columns, pa.field("filename", pa.string()), *hive])
    fmt = pads.ParquetFileFormat()
    fragments = [fmt.make_fragment(path, filesystem=fs,
                                   partition_expression=keys[path] & (pc.field("filename") == pc.scalar(f)))
                 for f, path in paths.items()]
    return pads.FileSystemDataset(fragments, schema=schema, format=fmt, filesystem=fs)


def _visible(root: Path | str, manifests: list[DatasetManifest]) -> list[DatasetManifest]:
    """The longest prefix of commits whose data files are all in place (never half a commit)."""
    if loc.is_remote(root):  # one listing, not a request per file
        present = set(loc.list_files(root, suffix=".parquet")).__contains__
    else:
        present = os.path.exists
    out = []
    for m in manifests:
        if not all(present(loc.join(str(root), f.path)) for f in m.files if f.path.endswith(".parquet")):
            break
        out.append(m)
    return out


def _table_of(path: str) -> str | None:
    """Table of a committed file path (``steps/recipe=V/...parquet`` -> ``steps``); None for state files."""
    head, _, rest = path.partition("/")
    return head if rest and path.endswith(".parquet") and not head.startswith(("_", ".")) else None


def _dataset_versions(data: Path | str) -> dict[str, list[DatasetManifest]]:
    out = {}
    for name in list_dataset_versions(data):
        try:
            manifests = read_manifests(DatasetLayout(out=str(data), version=name, recipe_hash=""))
        except CommitError as err:
            raise CatalogError(str(err)) from err
        out[name] = _visible(data, manifests)
    return out


def _what_is_there(path: Path | str) -> str:
    if loc.is_remote(path):
        entries = loc.list_dir(path)[:12]
    else:
        path = Path(path)
        entries = sorted(p.name + ("/" if p.is_dir() else "") for p in path.iterdir())[:12] if path.is_dir() else []
    return ", ".join(entries) if entries else "nothing"


def _table_dirs(data: Path | str) -> list[str]:
    """Top-level directories of ``data`` that may be tables (identifier names, not ``_``-prefixed)."""
    if loc.is_remote(data):
        names = loc.list_dir(data)  # prefixes and objects; an object's name (``x.json``) is no identifier
    else:
        names = [p.name for p in Path(data).iterdir() if p.is_dir()] if Path(data).is_dir() else []
    return sorted(n for n in names if n.isidentifier() and not n.startswith("_"))


def _commit_rows(versions: dict[str, list[DatasetManifest]], archive: Path | str | None) -> pa.Table:
    rows = []
    for version, manifests in versions.items():
        for m in manifests:
            data_files = [f for f in m.files if _table_of(f.path)]
            rows.append({
                "source": "dataset", "version": version, "commit": m.commit, "created_at": m.created_at,
                "input": m.source, "mode": m.mode, "files": len(data_files), "rows": sum(f.rows for f in data_files),
                "events_in": m.counts.get("events_in"), "episodes": m.counts.get("episodes"),
                "steps": m.counts.get("steps"), "dead_letters": m.counts.get("dead_letters"),
                "clock": datetime.fromtimestamp(m.clock_s, timezone.utc) if m.clock_s else None,
                "counts": json.dumps(m.counts, sort_keys=True)})
    if archive is not None:
        for c in read_commits(archive):
            rows.append({
                "source": "archive", "version": None, "commit": c.commit, "created_at": c.created_at,
                "input": c.topic, "mode": "batch", "files": len(c.files), "rows": c.events,
                "events_in": c.events + c.dead_letters,
                "episodes": None, "steps": None, "dead_letters": c.dead_letters, "clock": None,
                "counts": json.dumps({"events": c.events, "dead_letters": c.dead_letters})})
    schema = pa.schema([("source", pa.string()), ("version", pa.string()), ("commit", pa.int64()),
                        ("created_at", pa.timestamp("us", tz="UTC")), ("input", pa.string()), ("mode", pa.string()),
                        ("files", pa.int64()), ("rows", pa.int64()), ("events_in", pa.int64()),
                        ("episodes", pa.int64()), ("steps", pa.int64()), ("dead_letters", pa.int64()),
                        ("clock", pa.timestamp("us", tz="UTC")), ("counts", pa.string())])
    return pa.Table.from_pylist(rows, schema=schema)


def _commit_file_rows(data: Path | str, versions: dict[str, list[DatasetManifest]]) -> pa.Table:
    rows = [{"filename": loc.join(str(data), f.path), "table": _table_of(f.path), "version": v, "commit": m.commit,
             "created_at": m.created_at, "rows": f.rows}
            for v, ms in versions.items() for m in ms for f in m.files if _table_of(f.path)]
    schema = pa.schema([("filename", pa.string()), ("table", pa.string()), ("version", pa.string()),
                        ("commit", pa.int64()), ("created_at", pa.timestamp("us", tz="UTC")), ("rows", pa.int64())])
    return pa.Table.from_pylist(rows, schema=schema)


def _version_rows(versions: dict[str, list[DatasetManifest]], shown: str | None) -> pa.Table:
    rows = [{"version": v, "recipe": v.rsplit("-", 1)[0], "recipe_hash": ms[-1].recipe_hash if ms else None,
             "commits": len(ms), "newest_commit_at": ms[-1].created_at if ms else None,
             "shown": shown in (v, ALL_VERSIONS)} for v, ms in versions.items()]
    schema = pa.schema([("version", pa.string()), ("recipe", pa.string()), ("recipe_hash", pa.string()),
                        ("commits", pa.int64()), ("newest_commit_at", pa.timestamp("us", tz="UTC")),
                        ("shown", pa.bool_())])
    return pa.Table.from_pylist(rows, schema=schema)


def _policy_files(run: Path | str) -> list[str]:
    """``policies/v*/policy.json`` under a run directory or its children (local or ``s3://``), sorted."""
    if not loc.is_remote(run):
        return sorted(str(p) for p in {*Path(run).glob("policies/v*/policy.json"),
                                       *Path(run).glob("*/policies/v*/policy.json")})
    base = os.fspath(run).rstrip("/")
    found = []
    for path in loc.list_files(base, suffix="policy.json"):
        parts = path[len(base) + 1:].split("/")  # policies/v<N>/policy.json or <run>/policies/v<N>/policy.json
        if len(parts) in (3, 4) and parts[-1] == "policy.json" and parts[-3] == "policies" \
                and parts[-2].startswith("v"):
            found.append(path)
    return sorted(found)


def _policy_rows(runs: Iterable[Path | str]) -> pa.Table:
    rows = []
    seen: set[str] = set()
    for run in runs:
        for name in _policy_files(run):
            path = PurePosixPath(name) if loc.is_remote(name) else Path(name)
            key = name if loc.is_remote(name) else str(Path(name).resolve())
            if key in seen or path.parent.name.startswith("."):
                continue  # .v<N>.tmp: a policy being written
            seen.add(key)
            try:
                rec = json.loads(loc.read_bytes(name))
            except (OSError, json.JSONDecodeError):
                continue
            rows.append({"version": rec.get("version"), "parent_version": rec.get("parent_version"),
                         "lineage": rec.get("lineage", ""), "train_step": rec.get("train_step"),
                         "format": rec.get("format", "merged"), "adapter": rec.get("adapter"),
                         "base_model": rec.get("base_model", ""), "location": name.rsplit("/", 1)[0],
                         "run": name.rsplit("/", 3)[0] if loc.is_remote(name) else str(path.parent.parent.parent),
                         "created_at": msgspec.convert(rec.get("created_at"), datetime | None)})
    schema = pa.schema([("version", pa.int64()), ("parent_version", pa.int64()), ("lineage", pa.string()),
                        ("train_step", pa.int64()), ("format", pa.string()), ("adapter", pa.string()),
                        ("base_model", pa.string()), ("location", pa.string()), ("run", pa.string()),
                        ("created_at", pa.timestamp("us", tz="UTC"))])
    return pa.Table.from_pylist(rows, schema=schema)


def open_catalog(
    *,
    data: Path | str | None = None,
    archive: Path | str | None = None,
    runs: Sequence[Path | str] = (),
    version: str | None = None,
    as_of: int | datetime | None = None,
) -> Catalog:
    """Read the manifests and pin every table to a snapshot.

    Args:
        data: dataset root (``trajpipe pipeline run --out``): a local directory or ``s3://BUCKET/PREFIX``.
        archive: event archive (``trajpipe archive --out``): a local directory or ``s3://BUCKET/PREFIX``.
        runs: training run directories (``trajpipe train --out``) or their parents; their
            ``policies/v*/policy.json`` make the ``policies`` view.
        version: dataset version ``<recipe>-<hash8>`` (or just the recipe name when one version has it);
            ``all`` for every version side by side; None: the version committed most recently.
        as_of: show the version as of this commit (1-based), or as of this time (its newest
            commit made at or before it: time travel); None: its newest complete commit.

    Returns:
        The catalog.

    Raises:
        CatalogError: the data root holds no dataset, the version or commit does not exist.
        OSError: an object store could not be read (unreachable, no such bucket, credentials refused).
    """
    # absolute: the views store their file paths, and a catalog file is opened from anywhere
    if data is not None:
        data = os.fspath(data).rstrip("/") if loc.is_remote(data) else Path(data).resolve()
    if archive is not None:
        archive = os.fspath(archive).rstrip("/") if loc.is_remote(archive) else Path(archive).resolve()
    cat = Catalog(data=data, archive=archive, runs=tuple(r if loc.is_remote(r) else Path(r) for r in runs), as_of=as_of)
    if archive is not None:
        if not is_archive(archive):
            raise CatalogError(f"{archive} is not an event archive (no _archive.json, no _commit_log/); it holds "
                               f"{_what_is_there(archive)}")
        commits = [c for c in read_commits(archive) if c.files]
        if commits:
            cat.tables["events"] = TableFiles("events", tuple(loc.join(str(archive), f) for c in commits
                                                              for f in c.files),
                                              commit=commits[-1].commit,
                                              schema_files=tuple(loc.join(str(archive), c.files[0]) for c in commits))
    if data is not None:
        if is_archive(data):
            raise CatalogError(f"{data} holds no dataset: it is an event archive (_archive.json); give it as "
                               "`--archive`")
        cat.versions = versions = _dataset_versions(data)
        tables = _table_dirs(data)
        if not versions and not tables:
            raise CatalogError(f"{data} holds no dataset (no _commit_log/ and no tables); it holds "
                               f"{_what_is_there(data)}; write one with `trajpipe pipeline run --out {data}`")
        cat.version = _select_version(versions, version, as_of)
        if isinstance(as_of, datetime):
            cat.as_of = as_of = _commit_at(versions[cat.version], cat.version, as_of)
        shown = list(versions) if cat.version == ALL_VERSIONS else [cat.version] if cat.version else []
        cat.tables.update(_version_tables(data, {v: versions[v][:as_of] for v in shown},
                                          one=None if cat.version == ALL_VERSIONS else cat.version))
        committed = {t for ms in versions.values() for m in ms for f in m.files if (t := _table_of(f.path))}
        for t in tables:  # tables no manifest names: another tool writes them; read what is there
            if t not in committed and t not in cat.tables:
                files = tuple(loc.list_files(loc.join(str(data), t), suffix=".parquet"))
                if files:
                    cat.tables[t] = TableFiles(t, files, snapshot=False)
        cat.frames["commits"] = _commit_rows(versions, archive)
        cat.frames["commit_files"] = _commit_file_rows(data, versions)
        cat.frames["dataset_versions"] = _version_rows(versions, cat.version)
    elif archive is not None:
        cat.frames["commits"] = _commit_rows({}, archive)
    if cat.runs:
        cat.frames["policies"] = _policy_rows(cat.runs)
    cat.frames["catalog_info"] = pa.Table.from_pylist(
        [{"view": t.name, "version": t.version, "commit": t.commit, "files": len(t.files), "snapshot": t.snapshot,
          "opened_at": datetime.now(timezone.utc)} for t in cat.tables.values()],
        schema=pa.schema([("view", pa.string()), ("version", pa.string()), ("commit", pa.int64()),
                          ("files", pa.int64()), ("snapshot", pa.bool_()),
                          ("opened_at", pa.timestamp("us", tz="UTC"))]))
    return cat


def _version_tables(data: Path | str, shown: dict[str, list[DatasetManifest]], *, one: str | None
                    ) -> dict[str, TableFiles]:
    """The tables of the shown versions' commits: every data file the manifests name, in commit order."""
    named: dict[str, list[str]] = {}
    firsts: dict[str, list[str]] = {}
    last: dict[str, tuple[str, int]] = {}
    for v, manifests in shown.items():
        for m in manifests:
            for f in m.files:
                if (t := _table_of(f.path)) is not None:
                    named.setdefault(t, []).append(loc.join(str(data), f.path))
                    if last.get(t) != (v, m.commit):
                        last[t] = (v, m.commit)
                        firsts.setdefault(t, []).append(loc.join(str(data), f.path))
    return {t: TableFiles(t, tuple(files), version=one, commit=last[t][1] if one else None,
                          schema_files=tuple(firsts[t])) for t, files in named.items()}


def _commit_at(manifests: list[DatasetManifest], version: str, when: datetime) -> int:
    """The newest commit of ``version`` made at or before ``when`` (naive times are UTC)."""
    when = when if when.tzinfo is not None else when.replace(tzinfo=timezone.utc)
    made = [m.commit for m in manifests if m.created_at <= when]
    if not made:
        first = manifests[0].created_at.isoformat() if manifests else "never"
        raise CatalogError(f"{version} has no commit at or before {when.isoformat()}; its first was made {first}")
    return made[-1]


def _select_version(versions: dict[str, list[DatasetManifest]], version: str | None,
                    as_of: int | datetime | None) -> str | None:
    names = ", ".join(f"{v} ({len(ms)} commits)" for v, ms in versions.items()) or "none"
    if version == ALL_VERSIONS:
        if as_of is not None:
            raise CatalogError("--as-of needs one dataset version; give --version V (versions: " + names + ")")
        return ALL_VERSIONS
    if version is not None:
        matches = [v for v in versions if v == version or v.rsplit("-", 1)[0] == version]
        if len(matches) != 1:
            what = "is ambiguous" if matches else "does not exist"
            raise CatalogError(f"dataset version {version!r} {what}; versions: {names}")
        version = matches[0]
    elif versions:
        committed = {v: ms[-1].created_at for v, ms in versions.items() if ms}
        version = max(committed, key=committed.get) if committed else next(iter(versions))
    if version is None and isinstance(as_of, datetime):
        raise CatalogError("--as-of needs a dataset; this root holds no committed version")
    if version is not None and isinstance(as_of, int) and not 1 <= as_of <= len(versions[version]):
        raise CatalogError(f"commit {as_of} of {version} does not exist; its commits are "
                           f"1..{len(versions[version])}" if versions[version] else f"{version} has no complete commit")
    return version


def write_catalog(catalog: Catalog, db: Path | str) -> dict[str, Any]:
    """Write the catalog's views into a DuckDB database file (replaced atomically).

    Parquet-backed views store their ``select`` (absolute file paths of the
    snapshot); the small frames are stored as tables. Any DuckDB client
    (``duckdb FILE``, the Python package, DBeaver, ...) opens them. Run it again
    to show newer commits (see the module docstring).

    A table on an object store (``s3://`` dataset or archive) is copied into the file as a table
    of the snapshot's rows (the same rows and columns as its view): a view would need DuckDB's
    ``httpfs`` extension and the store's credentials in every client that opens the file. The
    database file itself is local.

    Returns:
        Counts: ``{"db": path, "views": n, "tables": {view: files}, "version": V}``.
    """
    db = Path(db)
    tmp = db.with_name(f".{db.name}.tmp")
    for p in (tmp, tmp.with_name(tmp.name + ".wal")):
        p.unlink(missing_ok=True)
    con = duckdb.connect()
    try:
        con.execute(f"attach {_quote(str(tmp))} as cat (storage_version '{DB_STORAGE_VERSION}')")
        con.execute("use cat")
        for name, t in catalog.tables.items():
            if _remote(t):  # copied: see the docstring
                con.register(_arrow_name(name), arrow_dataset(t))
                con.execute(f"create table {name} as {catalog.view_sql(name)}")
                con.unregister(_arrow_name(name))
            else:
                con.execute(f"create view {name} as {catalog.view_sql(name)}")
        for name, table in catalog.frames.items():
            con.register(f"_src_{name}", table)
            con.execute(f"create table {name} as select * from _src_{name}")
            con.unregister(f"_src_{name}")
        for name, (src, sql) in _DERIVED.items():
            if src in catalog.tables:
                con.execute(f"create view {name} as {sql}")
        con.execute("use memory")
        con.execute("detach cat")
    finally:
        con.close()
    os.replace(tmp, db)
    return {"db": str(db), "version": catalog.version, "views": len(catalog.views),
            "tables": {t.name: len(t.files) for t in catalog.tables.values()}}
