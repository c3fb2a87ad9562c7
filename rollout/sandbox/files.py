"""The host side of a sandbox's work directory: file I/O, manifests and snapshots.

Everything here runs with the worker's privileges on files the sandboxed code
controls, so nothing follows a symlink the sandbox may have planted:
manifests use ``lstat``, snapshots copy links as links, and
:meth:`WorkDir.read_file` / :meth:`WorkDir.write_file` refuse paths that
resolve outside the work directory. Files written by the host are owned by
the sandbox uid so the command can change them.
"""

from __future__ import annotations

import errno
import hashlib
import os
import shutil
import uuid
from pathlib import Path
from typing import NewType

from rollout.sandbox.argv import WORK_MOUNT
from rollout.sandbox.errors import SandboxError

__all__ = ["SnapshotId", "WorkDir", "diff_manifests", "has_file_of_size"]

SnapshotId = NewType("SnapshotId", str)


def _path_error(path: str | os.PathLike[str], verb: str, err: OSError | ValueError) -> SandboxError:
    """The one-line error of a host-side read or write of ``path`` that failed with ``err``."""
    if isinstance(err, OSError) and err.errno == errno.ELOOP:
        return SandboxError(f"path {path!r} is a symlink; refusing to follow it")
    return SandboxError(f"cannot {verb} {path!r}: {getattr(err, 'strerror', None) or err}")


def _nofollow_opener(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)


class WorkDir:
    """File operations on one sandbox's work directory, never following the sandbox's symlinks.

    Args:
        work: the host directory bound at ``/work``.
        snapshots: host directory (not visible inside) holding snapshots.
        uid: owner given to files written from the host.
        gid: their group.
        hash_bytes: files up to this size are hashed in manifests.
        max_files: manifests stop (and mark themselves partial) past this.
    """

    def __init__(self, work: Path, snapshots: Path, *, uid: int, gid: int, hash_bytes: int, max_files: int) -> None:
        self.work = work
        self._snapshots = snapshots
        self._uid, self._gid = uid, gid
        self._hash_bytes = hash_bytes
        self._max_files = max_files
        self._snapshot_count = 0

    def host_path(self, path: str | os.PathLike[str]) -> Path:
        """Map a work-dir path (relative, or absolute under /work) to the host.

        Raises:
            SandboxError: the path is absolute outside ``/work`` or resolves outside it.
        """
        raw = os.fspath(path)
        if raw.startswith(WORK_MOUNT + "/"):
            raw = raw[len(WORK_MOUNT) + 1:]
        if os.path.isabs(raw) or not raw:
            raise SandboxError(f"path {path!r} must be relative to the work dir (or under {WORK_MOUNT}/)")
        candidate = self.work / raw
        work_real = os.path.realpath(self.work)
        parent_real = os.path.realpath(candidate.parent)
        if parent_real != work_real and not parent_real.startswith(work_real + os.sep):
            raise SandboxError(f"path {path!r} resolves outside the sandbox work dir")
        return Path(parent_real) / candidate.name

    def write_file(self, path: str | os.PathLike[str], content: str | bytes, *, mode: int = 0o644) -> None:
        """Write a file (parents created), owned by the sandbox uid.

        Raises:
            SandboxError: the path escapes the work dir or goes through a symlink, or the work dir
                cannot take it (the target is a directory, a parent is a file, a name too long, a
                NUL byte, a directory the sandboxed code made unwritable, ...): paths come from
                the policy's actions, and what the sandboxed code did to the work dir is its own.
        """
        data = content.encode() if isinstance(content, str) else content
        try:
            rel = Path(os.fspath(path).removeprefix(WORK_MOUNT + "/"))
            current = self.work
            for part in rel.parts[:-1]:
                current = current / part
                if current.is_symlink():
                    raise SandboxError(f"path {path!r} goes through a symlink")
                if not current.exists():
                    current.mkdir(mode=0o755)
                    os.chown(current, self._uid, self._gid)
            target = self.host_path(path)
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
            raise _path_error(path, "write", err) from err
        try:
            os.write(fd, data)
            os.fchown(fd, self._uid, self._gid)
            os.fchmod(fd, mode)
        except OSError as err:  # a full disk, a file size limit
            raise _path_error(path, "write", err) from err
        finally:
            os.close(fd)

    def read_file(self, path: str | os.PathLike[str], *, max_bytes: int | None = None) -> bytes:
        """Read a work-dir file.

        Raises:
            SandboxError: the path escapes the work dir, is a symlink, or is no readable file.
        """
        try:
            target = self.host_path(path)
            fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
            with os.fdopen(fd, "rb") as fh:
                return fh.read() if max_bytes is None else fh.read(max_bytes)
        except (OSError, ValueError) as err:  # ValueError: a NUL byte in the path
            raise _path_error(path, "read", err) from err

    def manifest(self) -> dict[str, tuple]:
        """Cheap fingerprint of the work dir: path -> (kind, size, mtime_ns, hash|None)."""
        out: dict[str, tuple] = {}
        stack = [self.work]
        while stack:
            directory = stack.pop()
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            for entry in entries:
                if len(out) >= self._max_files:
                    out["\x00partial"] = ("partial", 0, 0, None)
                    return out
                rel = os.path.relpath(entry.path, self.work)
                st = entry.stat(follow_symlinks=False)
                if entry.is_symlink():
                    out[rel] = ("link", 0, st.st_mtime_ns, os.readlink(entry.path))
                elif entry.is_dir(follow_symlinks=False):
                    out[rel] = ("dir", 0, 0, None)
                    stack.append(Path(entry.path))
                elif entry.is_file(follow_symlinks=False):
                    digest = None
                    if st.st_size <= self._hash_bytes:
                        try:
                            with open(entry.path, "rb", opener=_nofollow_opener) as fh:
                                digest = hashlib.blake2b(fh.read(), digest_size=8).hexdigest()
                        except OSError:
                            digest = None
                    out[rel] = ("file", st.st_size, st.st_mtime_ns, digest)
        return out

    def snapshot(self) -> SnapshotId:
        """Copy the work dir aside; :meth:`restore` brings it back exactly."""
        self._snapshot_count += 1
        snap = SnapshotId(f"snap-{self._snapshot_count:04d}")
        shutil.copytree(self.work, self._snapshots / snap, symlinks=True)
        return snap

    def restore(self, snapshot: SnapshotId) -> None:
        """Replace the work dir with a snapshot's contents.

        Raises:
            SandboxError: the snapshot does not exist.
        """
        source = self._snapshots / snapshot
        if not snapshot or "/" in snapshot or not source.is_dir():
            raise SandboxError(f"unknown snapshot {snapshot!r}; take one with snapshot() first")
        parent = self.work.parent
        staging = parent / f"restore-{uuid.uuid4().hex[:8]}"
        shutil.copytree(source, staging, symlinks=True)
        for dirpath, dirnames, filenames in os.walk(staging):
            for name in dirnames + filenames + ["."]:
                os.chown(os.path.join(dirpath, name), self._uid, self._gid, follow_symlinks=False)
        old = parent / f"old-{uuid.uuid4().hex[:8]}"
        os.rename(self.work, old)
        os.rename(staging, self.work)
        shutil.rmtree(old, ignore_errors=True)

    def snapshots(self) -> list[SnapshotId]:
        """Snapshot ids taken so far, oldest first."""
        return sorted(SnapshotId(p.name) for p in self._snapshots.iterdir())


def diff_manifests(before: dict | None, after: dict) -> dict[str, str]:
    """Path -> ``added``/``modified``/``deleted`` between two :meth:`WorkDir.manifest` results."""
    if before is None:
        return {}
    changed: dict[str, str] = {}
    for path, meta in after.items():
        if path.startswith("\x00"):
            continue
        old = before.get(path)
        if old is None:
            changed[path] = "added"
        elif old != meta:
            changed[path] = "modified"
    for path in before:
        if path not in after and not path.startswith("\x00"):
            changed[path] = "deleted"
    return dict(sorted(changed.items()))


def has_file_of_size(roots: list[Path], size: int, *, max_entries: int = 20_000) -> bool:
    """True if a regular file of exactly ``size`` bytes lies under one of ``roots`` (links not followed)."""
    seen = 0
    stack = list(roots)
    while stack:
        try:
            entries = list(os.scandir(stack.pop()))
        except OSError:
            continue
        for entry in entries:
            seen += 1
            if seen > max_entries:
                return False
            if entry.is_dir(follow_symlinks=False):
                stack.append(Path(entry.path))
            elif entry.is_file(follow_symlinks=False):
                try:
                    if entry.stat(follow_symlinks=False).st_size == size:
                        return True
                except OSError:
                    pass
    return False
