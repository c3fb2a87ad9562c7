"""Durable file writes shared by every writer of trajpipe's stores (archive, datasets, spool, policies).

A file becomes visible only complete: written to a temporary name, fsync'ed,
renamed over the target, and the directory fsync'ed so the rename survives a crash.

Examples:
    >>> import tempfile, pathlib
    >>> d = pathlib.Path(tempfile.mkdtemp())
    >>> atomic_write(d / "m.json", b"{}")
    >>> (d / "m.json").read_bytes(), sorted(p.name for p in d.iterdir())
    (b'{}', ['m.json'])
"""

from __future__ import annotations

import os
from pathlib import Path

__all__ = ["fsync_dir", "atomic_write"]


def fsync_dir(path: Path) -> None:
    """fsync a directory, making renames and creations inside it durable."""
    fd = os.open(path, os.O_RDONLY)
    try:
        os.fsync(fd)
    finally:
        os.close(fd)


def atomic_write(path: Path, data: bytes) -> None:
    """Write ``data`` to ``path`` atomically and durably (tmp + fsync + rename + dir fsync)."""
    path = Path(path)
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_name(f".{path.name}.tmp")
    with open(tmp, "wb") as f:
        f.write(data)
        f.flush()
        os.fsync(f.fileno())
    os.replace(tmp, path)
    fsync_dir(path.parent)
