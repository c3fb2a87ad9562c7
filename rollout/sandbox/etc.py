"""The ``/etc`` a sandbox sees: a copy of a few host files, bound read-only with one mount.

bwrap re-reads ``/proc/self/mountinfo`` for every ``--ro-bind`` (to make the
new mount and its submounts read-only), so each bind costs more than the one
before; binding the nine :data:`ETC_FILES` one by one took 2-4 ms of every
start on the dev VM. Instead :func:`etc_copy` keeps a host directory holding
copies of them (files by content, as a bind of the file would show them;
directories with their symlinks as they are) and the sandbox binds that
directory at ``/etc``. Before every run the host files are ``stat``-ed
(inode, size, mtime); when one changed (``ldconfig``, ``update-alternatives``,
a new user) a fresh copy is made, so a run sees what binding the files
themselves would have shown. Copies live under the system temp directory
(``trajpipe-sandbox-etc-*``, made with ``mkdtemp``, readable by all, writable
only by the worker) and are removed at exit.
"""

from __future__ import annotations

import atexit
import os
import shutil
import tempfile
import threading
from pathlib import Path

__all__ = ["ETC_FILES", "etc_copy"]

#: Host files visible read-only under ``/etc`` (when present): the dynamic loader's config, users, time zone.
ETC_FILES = (
    "/etc/alternatives",
    "/etc/ld.so.cache",
    "/etc/ld.so.conf",
    "/etc/ld.so.conf.d",
    "/etc/localtime",
    "/etc/passwd",
    "/etc/group",
    "/etc/nsswitch.conf",
    "/etc/os-release",
)

_lock = threading.Lock()
_current: tuple[tuple, Path] | None = None
_made: list[Path] = []


def _signature(paths: tuple[str, ...]) -> tuple:
    out = []
    for path in paths:
        try:
            st = os.stat(path)  # follows a symlink, as a bind of it would
        except OSError:
            out.append((path, None))
            continue
        out.append((path, st.st_ino, st.st_size, st.st_mtime_ns))
    return tuple(out)


def etc_copy(paths: tuple[str, ...] | None = None) -> Path:
    """A directory holding copies of ``paths`` (default :data:`ETC_FILES`) by base name, up to date.

    Args:
        paths: absolute host paths; those missing on the host are left out.

    Raises:
        OSError: the copy could not be made.
    """
    global _current
    paths = ETC_FILES if paths is None else paths
    signature = _signature(paths)
    with _lock:
        if _current is not None and _current[0] == signature:
            return _current[1]
        top = Path(tempfile.mkdtemp(prefix="trajpipe-sandbox-etc-"))
        _made.append(top)
        etc = top / "etc"
        etc.mkdir()
        for path, sig in zip(paths, signature):
            if sig[1] is None:
                continue
            target = etc / os.path.basename(path)
            if os.path.isdir(path):
                shutil.copytree(path, target, symlinks=True)
            else:
                shutil.copy2(path, target)
        for directory in (top, etc):
            os.chmod(directory, 0o755)
        _current = (signature, etc)
        return etc


@atexit.register
def _remove_copies() -> None:
    for top in _made:
        shutil.rmtree(top, ignore_errors=True)
