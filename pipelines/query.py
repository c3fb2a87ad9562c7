"""DuckDB views over the event archive and the datasets (kept for callers of :func:`register_views`).

The views and the layout they read live in :mod:`pipelines.catalog`; this is a thin wrapper.

Examples:
    >>> import duckdb
    >>> register_views(duckdb.connect())
    []
"""

from __future__ import annotations

from pathlib import Path

import duckdb

from pipelines.catalog import open_catalog

__all__ = ["register_views"]


def register_views(
    con: duckdb.DuckDBPyConnection, *, archive: Path | None = None, data: Path | None = None
) -> list[str]:
    """Create the analyst views of :func:`pipelines.catalog.open_catalog` on ``con``; returns the Parquet-backed ones
    and those derived from them.

    Args:
        con: a DuckDB connection.
        archive: event archive directory (``trajpipe archive --out``).
        data: dataset root (``trajpipe pipeline run --out``); every version side by side.
    """
    if archive is None and data is None:
        return []
    catalog = open_catalog(archive=archive, data=data, version="all")
    catalog.register(con)
    return [*catalog.tables, *(v for v in ("evaluation_pass_rates",) if v in catalog.views)]
