"""The analyst commands behind ``trajpipe query``, ``trajpipe catalog`` and ``trajpipe report`` (docs/analytics.md).

The views come from :mod:`pipelines.catalog`, the reports from
:mod:`pipelines.reports` and :mod:`pipelines.report_html`; this module turns
flags into a catalog, runs the SQL and writes the result in the asked format.
"""

from __future__ import annotations

import io
import json
import sys
from datetime import datetime
from decimal import Decimal
from pathlib import Path
from typing import Any, Sequence

import duckdb
import pyarrow as pa

from pipelines.catalog import Catalog, CatalogError, open_catalog, write_catalog
from pipelines.reports import REPORTS, ReportError, report_sql
from schemas import locations as loc

__all__ = ["FORMATS", "AnalyticsError", "open_for_cli", "run_query", "write_result", "query_command",
           "catalog_command", "report_command"]

#: Output formats of ``query`` and ``report``.
FORMATS = ("table", "csv", "json", "parquet")


class AnalyticsError(ValueError):
    """Wrong input to an analyst command; the message says what exists and how to fix it."""


def parse_as_of(value: int | str | None) -> int | datetime | None:
    """``--as-of``: a commit number from 1, or an ISO 8601 time.

    Examples:
        >>> parse_as_of("3"), parse_as_of("2026-12-02T10:15:00Z").isoformat()
        (3, '2026-12-02T10:15:00+00:00')
    """
    if value is None or isinstance(value, int) and not isinstance(value, bool):
        when = value
    elif str(value).strip().isdigit():
        when = int(str(value).strip())
    else:
        try:
            when = datetime.fromisoformat(str(value).strip().replace("Z", "+00:00"))
        except ValueError:
            raise AnalyticsError(f"`--as-of` is a commit number from 1 or an ISO 8601 time "
                                 f"(e.g. 2026-12-02T10:15:00Z), got {value!r}") from None
    if isinstance(when, int) and when < 1:
        raise AnalyticsError(f"`--as-of` is a commit number from 1, got {when}")
    return when


def open_for_cli(*, data: Path | str | None, archive: Path | str | None, runs: Sequence[Path | str] = (),
                 version: str | None = None, as_of: int | str | None = None) -> Catalog:
    """:func:`open_catalog` with command-line errors (flags named, what exists listed).

    ``data``, ``archive``: a local directory or ``s3://BUCKET/PREFIX`` (:mod:`schemas.locations`).
    ``as_of``: a commit number, or an ISO 8601 time (``2026-12-02T10:15:00Z``; no zone: UTC).
    """
    if data is None and archive is None:
        raise AnalyticsError("give `--data DIR` (a dataset root) and/or `--archive DIR` (an event archive)")
    for flag, path in (("--data", data), ("--archive", archive), *(("--runs", r) for r in runs)):
        if path is not None and not loc.is_remote(path) and not Path(path).is_dir():
            parent = Path(path).parent
            there = ", ".join(sorted(p.name for p in parent.iterdir())[:12]) if parent.is_dir() else "nothing"
            raise AnalyticsError(f"`{flag}` {path} is not a directory; {parent} holds: {there}")
    as_of = parse_as_of(as_of)
    remote = [(flag, p) for flag, p in (("--data", data), ("--archive", archive), *(("--runs", r) for r in runs))
              if p is not None and loc.is_remote(p)]
    flag = uri = None
    writers = {"--data": ("a dataset", "pipeline run"), "--archive": ("an archive", "archive"),
               "--runs": ("a training run", "train")}
    try:
        for flag, uri in remote:
            if not loc.exists(uri):
                what, write = writers[flag]
                raise AnalyticsError(f"`{flag}` {uri} does not exist (no such bucket, or nothing under that prefix); "
                                     f"write {what} there with `trajpipe {write} --out {uri}`")
        flag = uri = None
        return open_catalog(data=data, archive=archive, runs=runs, version=version, as_of=as_of)
    except CatalogError as err:
        raise AnalyticsError(str(err)) from err
    except OSError as err:
        if not remote:
            raise
        flag, uri = (flag, uri) if uri is not None else remote[0] if len(remote) == 1 else \
            ("--data/--archive", " and ".join(str(p) for _, p in remote))
        raise AnalyticsError(f"`{flag}` {uri} cannot be read: {_one_line(err)}; check the bucket and the AWS_* "
                             "variables (AWS_ENDPOINT_URL, AWS_ACCESS_KEY_ID, AWS_SECRET_ACCESS_KEY)") from err


def run_query(catalog: Catalog, sql: str) -> pa.Table:
    """Run ``sql`` over the catalog's views; DuckDB's error becomes one line naming the views.

    Raises:
        AnalyticsError: bad SQL (DuckDB's message) or an unknown view (the views are listed).
    """
    con = catalog.connect()
    try:
        return con.sql(sql).to_arrow_table()
    except duckdb.CatalogException as err:
        raise AnalyticsError(f"{_one_line(err)}; views: {', '.join(catalog.views)}") from err
    except duckdb.Error as err:
        raise AnalyticsError(f"query failed: {_one_line(err)}") from err
    finally:
        con.close()


def _json_value(value: Any) -> Any:
    """JSON for what Arrow rows hold beyond JSON's types: DuckDB's HUGEINT sums arrive as ``Decimal``."""
    if isinstance(value, Decimal):
        return int(value) if value == value.to_integral_value() else float(value)
    return str(value)  # timestamps, dates, bytes


def _one_line(err: BaseException) -> str:
    return " ".join(str(err).split())


def write_result(table: pa.Table, *, fmt: str, out: Path | str | None, title: str | None = None,
                 ) -> dict[str, Any] | None:
    """Write ``table`` as ``fmt`` to ``out`` (stdout when None); returns counts when a file was written.

    ``out`` is a local path or ``s3://BUCKET/KEY`` (the object appears whole when written).
    ``json`` is JSON Lines (one object per row); ``parquet`` needs ``out``.
    """
    from schemas import locations as loc

    if fmt not in FORMATS:
        raise AnalyticsError(f"`--format` {fmt!r} is not one of {', '.join(FORMATS)}")
    if fmt == "parquet" and out is None:
        raise AnalyticsError("`--format parquet` writes a file: give `--out FILE.parquet`")
    if out is not None and not loc.is_remote(out) and Path(out).is_dir():
        raise AnalyticsError(f"`--out` {out} is a directory; give a file path")
    if fmt == "parquet":
        import pyarrow.parquet as pq

        with loc.open_output(out) as sink:
            pq.write_table(table, sink)
    elif fmt == "csv":
        import pyarrow.csv as pacsv

        if out is None:
            sys.stdout.flush()
            pacsv.write_csv(table, sys.stdout.buffer)
            sys.stdout.buffer.flush()
        else:
            with loc.open_output(out) as sink:
                pacsv.write_csv(table, sink)
    elif fmt == "json":
        text = "".join(json.dumps(row, default=_json_value) + "\n" for row in table.to_pylist())
        _emit(text, out)
    else:
        from rich.console import Console
        from rich.table import Table

        view = Table(*table.column_names, title=title)
        for row in table.to_pylist():
            view.add_row(*("" if v is None else f"{v:.4g}" if isinstance(v, float) else str(v) for v in row.values()))
        if out is None:
            Console().print(view)
        else:
            buf = io.StringIO()
            Console(file=buf, width=200).print(view)
            _emit(buf.getvalue(), out)
    return None if out is None else {"out": str(out), "format": fmt, "rows": table.num_rows}


def _emit(text: str, out: Path | str | None) -> None:
    from schemas import locations as loc

    if out is None:
        sys.stdout.write(text)
        sys.stdout.flush()
    else:
        with loc.open_output(out) as sink:
            sink.write(text.encode("utf-8"))


def query_command(sql: str, *, data: Path | str | None, archive: Path | str | None, runs: Sequence[Path | str],
                  version: str | None, as_of: int | str | None, fmt: str, out: Path | str | None) -> dict[str, Any] | None:
    """``trajpipe query``: returns counts when ``--out`` wrote a file."""
    if fmt not in FORMATS:
        raise AnalyticsError(f"`--format` {fmt!r} is not one of {', '.join(FORMATS)}")
    catalog = open_for_cli(data=data, archive=archive, runs=runs, version=version, as_of=as_of)
    if not catalog.tables:
        raise AnalyticsError(f"no committed data under {data or ''} {archive or ''}".strip()
                             + f"; views: {', '.join(catalog.views) or 'none'}")
    return write_result(run_query(catalog, sql), fmt=fmt, out=out)


def catalog_command(*, db: Path, data: Path | str | None, archive: Path | str | None, runs: Sequence[Path | str],
                    version: str | None, as_of: int | str | None) -> dict[str, Any]:
    """``trajpipe catalog``: write the DuckDB database file; returns its counts."""
    if db.is_dir():
        raise AnalyticsError(f"`--db` {db} is a directory; give a file path such as {db / 'catalog.duckdb'}")
    if not db.parent.is_dir():
        raise AnalyticsError(f"`--db` {db}: directory {db.parent} does not exist")
    catalog = open_for_cli(data=data, archive=archive, runs=runs, version=version, as_of=as_of)
    try:
        return write_catalog(catalog, db)
    except CatalogError as err:
        raise AnalyticsError(str(err)) from err


def report_command(name: str, *, data: Path | str | None, archive: Path | str | None, runs: Sequence[Path | str],
                   version: str | None, as_of: int | str | None, fmt: str, out: Path | str | None) -> dict[str, Any] | None:
    """``trajpipe report list|html|NAME``: returns counts when a file was written."""
    if name == "list":
        table = pa.Table.from_pylist([{"report": r.name, "title": r.title} for r in REPORTS.values()]
                                     + [{"report": "html", "title": "every chart in one self-contained HTML file"}])
        return write_result(table, fmt=fmt, out=out)
    if name != "html" and name not in REPORTS:
        raise AnalyticsError(f"no report {name!r}; reports: {', '.join(REPORTS)}, html (`trajpipe report list`)")
    if name == "html" and out is None:
        raise AnalyticsError("`trajpipe report html` writes a file: give `--out report.html`")
    if fmt not in FORMATS:
        raise AnalyticsError(f"`--format` {fmt!r} is not one of {', '.join(FORMATS)}")
    catalog = open_for_cli(data=data, archive=archive, runs=runs, version=version, as_of=as_of)
    try:
        if name == "html":
            from pipelines.report_html import write_html_report

            return write_html_report(catalog, out)
        sql = report_sql(name, catalog.views)
    except ReportError as err:
        raise AnalyticsError(str(err)) from err
    table = run_query(catalog, sql)
    if fmt == "json" and out is None:  # one machine-readable document
        print(json.dumps({"report": name, "title": REPORTS[name].title, "version": catalog.version,
                          "columns": table.column_names, "rows": table.to_pylist()}, default=_json_value), flush=True)
        return None
    return write_result(table, fmt=fmt, out=out, title=REPORTS[name].title)
