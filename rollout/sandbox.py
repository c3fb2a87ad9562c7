"""Isolated, reproducible execution of model-produced commands and code.

Each :class:`Sandbox` owns a work directory on the host that is bind-mounted
at ``/work`` inside a bubblewrap (``bwrap``) container. Every :meth:`Sandbox.run`
starts a fresh container around one command::

    prlimit --cpu --as --nproc --fsize --nofile --core   (resource limits)
      bwrap --unshare-all --unshare-user --disable-userns (own user/pid/net/ipc/uts/cgroup ns)
            --die-with-parent --new-session
            --ro-bind /usr /usr  (+ /bin /lib* links, a few /etc files, the interpreter)
            --bind <work> /work --bind <tmp> /tmp --proc /proc --dev /dev
            --remount-ro /  --clearenv
        <command>

Why each piece:

* **Own uid.** When the worker runs as root, the command runs as an
  unprivileged uid allocated to this sandbox alone (a lock file per uid under
  the system temp dir). ``RLIMIT_NPROC`` counts processes *per real uid* and is
  ignored for root, so a shared or root uid would make the process limit
  meaningless; a private uid makes a fork bomb hit its own ceiling.
  Run as a normal user, the sandbox uses that user's uid and sets the process
  limit to the user's current process count plus ``max_processes``.
* **Network.** A new network namespace has only its own loopback, so even
  ``127.0.0.1`` services of the host are unreachable.
* **Filesystem.** The root is an empty tmpfs remounted read-only; only
  ``/work`` and ``/tmp`` (both directories of this sandbox on the host disk)
  are writable; the toolchain is bound read-only.
* **Lifetime.** The command is pid 2 of a new pid namespace under bwrap's
  reaper; when the command or bwrap dies, the kernel kills everything left in
  the namespace, so background processes never outlive :meth:`Sandbox.run`.
  A wall-clock timeout kills bwrap's process group.
* **Output.** stdout/stderr are read concurrently and kept up to
  ``max_output_bytes`` each (``truncated`` set); a command that keeps writing
  past ``output_kill_bytes`` is killed (``killed_reason="output_limit"``).

The host side never follows a symlink that the sandboxed code created:
manifests use ``lstat``, snapshots copy links as links, and
:meth:`Sandbox.read_file` / :meth:`Sandbox.write_file` refuse paths that resolve
outside the work directory.
"""

from __future__ import annotations

import ctypes
import errno
import fcntl
import hashlib
import os
import random
import selectors
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import uuid
from dataclasses import dataclass, field
from pathlib import Path
from typing import NewType, Sequence

__all__ = [
    "SandboxError",
    "SandboxUnavailable",
    "SandboxLimits",
    "CommandResult",
    "SnapshotId",
    "Sandbox",
    "sandbox_python",
]

SnapshotId = NewType("SnapshotId", str)

#: Path of the work directory inside the sandbox.
WORK_MOUNT = "/work"

#: Unprivileged uids handed out to sandboxes when the worker runs as root.
UID_BASE = 2_000_000
UID_POOL = 4096

_ETC_FILES = (
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
_TOP_LEVEL_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

_SIGNAL_REASONS = {
    signal.SIGXCPU: "cpu_limit",
    signal.SIGXFSZ: "file_size_limit",
}
_STDERR_REASONS = (
    ("MemoryError", "memory_limit"),
    ("Cannot allocate memory", "memory_limit"),
    ("std::bad_alloc", "memory_limit"),
    ("Resource temporarily unavailable", "process_limit"),
    ("Cannot fork", "process_limit"),
    ("fork: retry", "process_limit"),
    ("File too large", "file_size_limit"),
)


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the command inside it): an environment error."""


class SandboxUnavailable(SandboxError):
    """The host cannot run sandboxes (bubblewrap missing or user namespaces disabled)."""


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits applied to every command run in a sandbox.

    Attributes:
        cpu_time_s: CPU seconds per process (``RLIMIT_CPU``); SIGXCPU at the limit.
        wall_time_s: default wall-clock timeout of :meth:`Sandbox.run`, seconds.
        memory_bytes: address space per process (``RLIMIT_AS``), bytes.
        max_processes: processes/threads the sandbox uid may have (``RLIMIT_NPROC``).
        max_file_bytes: largest file a process may write (``RLIMIT_FSIZE``), bytes.
        max_open_files: open file descriptors per process (``RLIMIT_NOFILE``).
        max_output_bytes: stdout and stderr are each kept up to this many bytes.
        output_kill_bytes: a command whose combined output passes this is killed.
        manifest_hash_bytes: files up to this size are hashed in manifests.
        max_manifest_files: manifests stop (and mark themselves partial) past this.
    """

    cpu_time_s: int = 10
    wall_time_s: float = 30.0
    memory_bytes: int = 1 << 30
    max_processes: int = 64
    max_file_bytes: int = 64 << 20
    max_open_files: int = 256
    max_output_bytes: int = 64 << 10
    output_kill_bytes: int = 8 << 20
    manifest_hash_bytes: int = 64 << 10
    max_manifest_files: int = 20_000

    def __post_init__(self) -> None:
        for name in ("cpu_time_s", "memory_bytes", "max_processes", "max_file_bytes",
                     "max_open_files", "max_output_bytes", "output_kill_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.`{name}` must be > 0, got {getattr(self, name)}")
        if self.wall_time_s <= 0:
            raise ValueError(f"SandboxLimits.`wall_time_s` must be > 0, got {self.wall_time_s}")


@dataclass(frozen=True)
class CommandResult:
    """What one sandboxed command did.

    Attributes:
        exit_status: the command's exit status; ``128 + N`` when it died of
            signal N inside the sandbox; ``-9`` when the sandbox killed it
            (timeout or output limit).
        stdout: captured standard output (UTF-8, undecodable bytes replaced), bounded.
        stderr: captured standard error, bounded.
        truncated: True if stdout or stderr was cut at ``max_output_bytes``.
        timed_out: True if the wall-clock timeout killed it.
        killed_reason: why it was stopped, if a limit was hit: ``timeout``,
            ``output_limit``, ``cpu_limit``, ``memory_limit``, ``process_limit``,
            ``file_size_limit`` or ``signal:<NAME>``. The last four are inferred
            from the exit status/stderr and are best effort.
        duration_ms: wall time from spawn to exit, milliseconds.
        files_changed: work-dir relative path -> ``added``/``modified``/``deleted``.
    """

    exit_status: int
    stdout: str
    stderr: str
    truncated: bool = False
    timed_out: bool = False
    killed_reason: str | None = None
    duration_ms: float = 0.0
    files_changed: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True if the command exited 0 and was not stopped."""
        return self.exit_status == 0 and self.killed_reason is None

    def to_dict(self) -> dict:
        """Plain JSON-serialisable form (for recording in a Step event)."""
        return {
            "exit_status": self.exit_status,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "truncated": self.truncated,
            "timed_out": self.timed_out,
            "killed_reason": self.killed_reason,
            "duration_ms": round(self.duration_ms, 3),
            "files_changed": dict(self.files_changed),
        }


# --------------------------------------------------------------------------- host probe

_probe_lock = threading.Lock()
_probe: dict[str, object] = {}


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":/usr/bin:/bin:/usr/sbin:/sbin")


def _host_tools() -> tuple[str, str]:
    """Paths of bwrap and prlimit, raising :class:`SandboxUnavailable` if missing."""
    bwrap = _which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "bubblewrap (`bwrap`) is not installed; install it with "
            "`apt-get install -y bubblewrap` (Debian/Ubuntu) or `dnf install bubblewrap`"
        )
    prlimit = _which("prlimit")
    if prlimit is None:
        raise SandboxUnavailable("`prlimit` (util-linux) is not installed; install util-linux")
    return bwrap, prlimit


def sandbox_python() -> str:
    """Interpreter path to use inside sandboxes (``/usr/bin/python3`` if present).

    Falls back to this process's base interpreter, whose prefix is then bound
    read-only into every sandbox.
    """
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3"
    return os.path.realpath(os.path.join(sys.base_prefix, "bin", "python3"))


def _python_binds() -> list[str]:
    python = sandbox_python()
    if python.startswith("/usr/"):
        return []
    prefix = os.path.realpath(sys.base_prefix)
    return ["--ro-bind", prefix, prefix]


def _static_bwrap_args() -> list[str]:
    """bwrap arguments shared by every sandbox on this host (computed once)."""
    args = [
        "--die-with-parent", "--new-session",
        "--unshare-all", "--unshare-user", "--disable-userns",
        "--hostname", "sandbox",
        "--ro-bind", "/usr", "/usr",
    ]
    for path in _TOP_LEVEL_LINKS:
        if os.path.islink(path):
            args += ["--symlink", os.readlink(path), path]
        elif os.path.isdir(path):
            args += ["--ro-bind", path, path]
    for path in _ETC_FILES:
        if os.path.exists(path):
            args += ["--ro-bind", path, path]
    args += _python_binds()
    args += ["--proc", "/proc", "--dev", "/dev"]
    return args


def _sandbox_env_args() -> list[str]:
    env = {
        "PATH": "/usr/local/bin:/usr/bin:/bin",
        "HOME": WORK_MOUNT,
        "TMPDIR": "/tmp",
        "LANG": "C.UTF-8",
        "LC_ALL": "C.UTF-8",
        "TZ": "UTC",
        "PYTHONDONTWRITEBYTECODE": "1",
        "PYTHONHASHSEED": "0",
        "PYTHONUNBUFFERED": "1",
    }
    args = ["--clearenv"]
    for key, value in env.items():
        args += ["--setenv", key, value]
    return args


# --------------------------------------------------------------------------- uid pool


class _UidLease:
    """An unprivileged uid held for one sandbox, exclusive across processes via flock."""

    def __init__(self) -> None:
        self.fd: int | None = None
        if os.geteuid() != 0:
            self.uid, self.gid = os.getuid(), os.getgid()
            return
        lock_dir = Path(tempfile.gettempdir()) / "trajpipe-sandbox-uids"
        lock_dir.mkdir(mode=0o700, exist_ok=True)
        start = random.randrange(UID_POOL)
        for i in range(UID_POOL):
            uid = UID_BASE + (start + i) % UID_POOL
            fd = os.open(lock_dir / f"{uid}.lock", os.O_CREAT | os.O_RDWR | os.O_CLOEXEC, 0o600)
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
            except BlockingIOError:
                os.close(fd)
                continue
            self.fd, self.uid, self.gid = fd, uid, uid
            return
        raise SandboxError(f"all {UID_POOL} sandbox uids are in use; close sandboxes or raise UID_POOL")

    def release(self) -> None:
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _uid_process_count(uid: int) -> int:
    return sum(1 for e in os.scandir("/proc") if e.name.isdigit() and _owned_by(e, uid))


# --------------------------------------------------------------------------- sandbox


class Sandbox:
    """A work directory plus the rules for running untrusted commands against it.

    Args:
        workdir_root: host directory under which this sandbox's directory is made
            (must be traversable by other users, e.g. under ``/tmp``).
        limits: resource limits for every command.
        extra_ro_binds: further host paths bound read-only at the same place
            (e.g. a toolchain under ``/opt``).

    Raises:
        SandboxUnavailable: bubblewrap or prlimit is missing, or bwrap cannot
            create namespaces on this host.

    Examples:
        >>> with Sandbox.create() as sb:                      # doctest: +SKIP
        ...     sb.write_file("a.txt", "hi")
        ...     sb.run("cat a.txt").stdout
        'hi'
    """

    def __init__(
        self,
        workdir_root: str | os.PathLike[str],
        limits: SandboxLimits | None = None,
        *,
        extra_ro_binds: Sequence[str] = (),
    ) -> None:
        self.limits = limits or SandboxLimits()
        self._bwrap, self._prlimit = _host_tools()
        self._extra_ro_binds = tuple(extra_ro_binds)
        for path in self._extra_ro_binds:
            if not os.path.isabs(path):
                raise ValueError(f"`extra_ro_binds` entries must be absolute paths, got {path!r}")
        self.root = Path(workdir_root)
        self.root.mkdir(parents=True, exist_ok=True)
        _check_traversable(self.root)
        self.sandbox_id = uuid.uuid4().hex[:16]
        self.dir = self.root / f"sb-{self.sandbox_id}"
        self._lease = _UidLease()
        if self._lease.fd is not None:
            _become_subreaper()
        self.uid, self.gid = self._lease.uid, self._lease.gid
        self.work = self.dir / "work"
        self._tmp = self.dir / "tmp"
        self._snapshots = self.dir / "snapshots"
        try:
            self.dir.mkdir(mode=0o711)
            os.chmod(self.dir, 0o711)
            for sub in (self.work, self._tmp):
                sub.mkdir(mode=0o755)
                os.chown(sub, self.uid, self.gid)
            self._snapshots.mkdir(mode=0o700)
        except OSError:
            self._lease.release()
            raise
        self._closed = False
        self._snapshot_count = 0
        self._check_host()

    @classmethod
    def create(
        cls,
        workdir_root: str | os.PathLike[str] | None = None,
        limits: SandboxLimits | None = None,
        **kwargs,
    ) -> "Sandbox":
        """Make a sandbox under ``workdir_root`` (default: ``$TMPDIR/trajpipe-sandboxes``)."""
        root = workdir_root if workdir_root is not None else Path(tempfile.gettempdir()) / "trajpipe-sandboxes"
        return cls(root, limits, **kwargs)

    # ----------------------------------------------------------------- lifecycle

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete the sandbox directory and release its uid. Idempotent."""
        if self._closed:
            return
        self._closed = True
        shutil.rmtree(self.dir, ignore_errors=True)
        self._lease.release()

    def __del__(self) -> None:  # last resort; close() is the contract
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown, nothing to report to
            pass

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.sandbox_id} is closed")

    def _check_host(self) -> None:
        """Run one trivial command per process to prove bwrap works here."""
        with _probe_lock:
            if _probe.get("ok"):
                return
            result = self.run(["/bin/true"], timeout_s=20, _probe=True)
            _probe["ok"] = result.exit_status == 0
            if not _probe["ok"]:
                self.close()
                hint = ""
                if "namespace" in result.stderr or "Operation not permitted" in result.stderr:
                    hint = ("; unprivileged user namespaces must be enabled "
                            "(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces>0)")
                raise SandboxUnavailable(
                    f"bwrap could not start a sandbox here (exit {result.exit_status}): "
                    f"{result.stderr.strip()[:500]}{hint}"
                )

    # ----------------------------------------------------------------- files

    def _host_path(self, path: str | os.PathLike[str]) -> Path:
        """Map a work-dir path (relative, or absolute under /work) to the host, refusing escapes."""
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
        """Write a file into the work dir (parents created), owned by the sandbox uid.

        Raises:
            SandboxError: the path is absolute outside ``/work`` or escapes it (also via symlinks).
        """
        self._check_open()
        data = content.encode() if isinstance(content, str) else content
        rel = Path(os.fspath(path).removeprefix(WORK_MOUNT + "/"))
        current = self.work
        for part in rel.parts[:-1]:
            current = current / part
            if current.is_symlink():
                raise SandboxError(f"path {path!r} goes through a symlink")
            if not current.exists():
                current.mkdir(mode=0o755)
                os.chown(current, self.uid, self.gid)
        target = self._host_path(path)
        try:
            fd = os.open(target, os.O_WRONLY | os.O_CREAT | os.O_TRUNC | os.O_NOFOLLOW | os.O_CLOEXEC, mode)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise SandboxError(f"path {path!r} is a symlink; refusing to follow it") from err
            raise
        try:
            os.write(fd, data)
            os.fchown(fd, self.uid, self.gid)
            os.fchmod(fd, mode)
        finally:
            os.close(fd)

    def read_file(self, path: str | os.PathLike[str], *, max_bytes: int | None = None) -> bytes:
        """Read a work-dir file (refusing symlinks and escapes)."""
        self._check_open()
        target = self._host_path(path)
        try:
            fd = os.open(target, os.O_RDONLY | os.O_NOFOLLOW | os.O_CLOEXEC)
        except OSError as err:
            if err.errno == errno.ELOOP:
                raise SandboxError(f"path {path!r} is a symlink; refusing to follow it") from err
            raise
        with os.fdopen(fd, "rb") as fh:
            return fh.read() if max_bytes is None else fh.read(max_bytes)

    def manifest(self) -> dict[str, tuple]:
        """Cheap fingerprint of the work dir: path -> (kind, size, mtime_ns, hash|None)."""
        self._check_open()
        out: dict[str, tuple] = {}
        limit = self.limits.max_manifest_files
        stack = [self.work]
        while stack:
            directory = stack.pop()
            try:
                entries = list(os.scandir(directory))
            except OSError:
                continue
            for entry in entries:
                if len(out) >= limit:
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
                    if st.st_size <= self.limits.manifest_hash_bytes:
                        try:
                            with open(entry.path, "rb", opener=_nofollow_opener) as fh:
                                digest = hashlib.blake2b(fh.read(), digest_size=8).hexdigest()
                        except OSError:
                            digest = None
                    out[rel] = ("file", st.st_size, st.st_mtime_ns, digest)
        return out

    # ----------------------------------------------------------------- snapshots

    def snapshot(self) -> SnapshotId:
        """Copy the work dir aside; :meth:`restore` brings it back exactly."""
        self._check_open()
        self._snapshot_count += 1
        snap = SnapshotId(f"snap-{self._snapshot_count:04d}")
        shutil.copytree(self.work, self._snapshots / snap, symlinks=True)
        return snap

    def restore(self, snapshot: SnapshotId) -> None:
        """Replace the work dir with a snapshot's contents.

        Raises:
            SandboxError: the snapshot does not exist in this sandbox.
        """
        self._check_open()
        source = self._snapshots / snapshot
        if not snapshot or "/" in snapshot or not source.is_dir():
            raise SandboxError(f"unknown snapshot {snapshot!r} for sandbox {self.sandbox_id}")
        staging = self.dir / f"restore-{uuid.uuid4().hex[:8]}"
        shutil.copytree(source, staging, symlinks=True)
        for dirpath, dirnames, filenames in os.walk(staging):
            for name in dirnames + filenames + ["."]:
                os.chown(os.path.join(dirpath, name), self.uid, self.gid, follow_symlinks=False)
        old = self.dir / f"old-{uuid.uuid4().hex[:8]}"
        os.rename(self.work, old)
        os.rename(staging, self.work)
        shutil.rmtree(old, ignore_errors=True)

    def snapshots(self) -> list[SnapshotId]:
        """Snapshot ids taken so far, oldest first."""
        return sorted(SnapshotId(p.name) for p in self._snapshots.iterdir())

    # ----------------------------------------------------------------- running

    def _argv(self, cmd: list[str], status_fd: int, nproc: int) -> list[str]:
        lim = self.limits
        argv = [
            self._prlimit,
            f"--cpu={lim.cpu_time_s}:{lim.cpu_time_s + 1}",
            f"--as={lim.memory_bytes}",
            f"--nproc={nproc}",
            f"--fsize={lim.max_file_bytes}",
            f"--nofile={lim.max_open_files}",
            "--core=0",
            "--",
            self._bwrap,
        ]
        argv += _static_args()
        for path in self._extra_ro_binds:
            argv += ["--ro-bind", path, path]
        argv += [
            "--bind", str(self.work), WORK_MOUNT,
            "--bind", str(self._tmp), "/tmp",
            "--remount-ro", "/",
            "--chdir", WORK_MOUNT,
        ]
        argv += _sandbox_env_args()
        argv += ["--json-status-fd", str(status_fd), "--"]
        return argv + cmd

    def run(
        self,
        cmd: list[str] | str,
        *,
        timeout_s: float | None = None,
        stdin: bytes | str | None = None,
        track_files: bool = True,
        _probe: bool = False,
    ) -> CommandResult:
        """Run one command in a fresh container over the work dir.

        Args:
            cmd: argv list, or a string run by ``/bin/sh -c``.
            timeout_s: wall-clock limit (default ``limits.wall_time_s``); the
                whole sandbox is killed when it passes.
            stdin: bytes fed to the command's standard input (default: empty).
            track_files: compute ``files_changed`` (one manifest before and after).

        Returns:
            The :class:`CommandResult`; limit violations are reported in it, never raised.

        Raises:
            SandboxError: bwrap itself failed to set the sandbox up.
        """
        self._check_open()
        if isinstance(cmd, str):
            argv_cmd = ["/bin/sh", "-c", cmd]
        elif cmd and all(isinstance(a, str) for a in cmd):
            argv_cmd = list(cmd)
        else:
            raise ValueError(f"`cmd` must be a non-empty list of str or a str, got {cmd!r}")
        timeout = self.limits.wall_time_s if timeout_s is None else float(timeout_s)
        if timeout <= 0:
            raise ValueError(f"`timeout_s` must be > 0, got {timeout_s}")
        before = self.manifest() if track_files else None
        nproc = self.limits.max_processes
        if os.geteuid() != 0:
            nproc += _uid_process_count(self.uid)
        status_r, status_w = os.pipe()
        data_in = stdin.encode() if isinstance(stdin, str) else stdin
        started = time.monotonic()
        kwargs: dict = {}
        if os.geteuid() == 0:
            kwargs = {"user": self.uid, "group": self.gid, "extra_groups": []}
        try:
            proc = subprocess.Popen(
                self._argv(argv_cmd, status_w, nproc),
                stdin=subprocess.PIPE if data_in else subprocess.DEVNULL,
                stdout=subprocess.PIPE,
                stderr=subprocess.PIPE,
                pass_fds=(status_w,),
                start_new_session=True,
                close_fds=True,
                **kwargs,
            )
        except OSError as err:
            os.close(status_r)
            os.close(status_w)
            raise SandboxError(f"could not start bwrap: {err}") from err
        os.close(status_w)
        try:
            out, err_out, truncated, killed = self._collect(proc, data_in, started + timeout)
        finally:
            status = _read_all(status_r)
            if self._lease.fd is not None:
                _reap_uid(self.uid)
        duration_ms = (time.monotonic() - started) * 1000.0
        rc = proc.returncode
        if '"child-pid"' not in status and not killed:
            raise SandboxError(f"bwrap failed to set up the sandbox (exit {rc}): {err_out.strip()[:500]}")
        if killed:
            exit_status, reason = -signal.SIGKILL, killed
        else:
            exit_status, reason = rc, _infer_reason(rc, err_out)
        changed = _diff_manifests(before, self.manifest()) if track_files and not _probe else {}
        return CommandResult(
            exit_status=exit_status,
            stdout=out,
            stderr=err_out,
            truncated=truncated,
            timed_out=killed == "timeout",
            killed_reason=reason,
            duration_ms=duration_ms,
            files_changed=changed,
        )

    def _collect(
        self, proc: subprocess.Popen, data_in: bytes | None, deadline: float
    ) -> tuple[str, str, bool, str | None]:
        """Pump stdin/stdout/stderr until exit or a limit; returns (out, err, truncated, killed)."""
        cap = self.limits.max_output_bytes
        bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
        total = 0
        truncated = False
        killed: str | None = None
        sel = selectors.DefaultSelector()
        sel.register(proc.stdout, selectors.EVENT_READ)
        sel.register(proc.stderr, selectors.EVENT_READ)
        if data_in:
            try:
                proc.stdin.write(data_in[: 1 << 20])
            except BrokenPipeError:
                pass
            finally:
                proc.stdin.close()
        try:
            while sel.get_map():
                remaining = deadline - time.monotonic()
                if remaining <= 0 and killed is None:
                    killed = "timeout"
                    _kill_group(proc)
                    deadline = time.monotonic() + 5.0  # drain what is left after the kill
                    continue
                if remaining <= 0:
                    break
                for key, _ in sel.select(timeout=min(remaining, 0.5)):
                    chunk = os.read(key.fd, 65536)
                    if not chunk:
                        sel.unregister(key.fileobj)
                        continue
                    total += len(chunk)
                    buf = bufs[key.fileobj]
                    room = cap - len(buf)
                    if room > 0:
                        buf += chunk[:room]
                    if len(chunk) > max(room, 0):
                        truncated = True
                    if total > self.limits.output_kill_bytes and killed is None:
                        killed = "output_limit"
                        _kill_group(proc)
            proc.wait(timeout=max(deadline - time.monotonic(), 5.0))
        except subprocess.TimeoutExpired:
            _kill_group(proc)
            proc.wait()
            killed = killed or "timeout"
        finally:
            sel.close()
            proc.stdout.close()
            proc.stderr.close()
        decode = lambda b: bytes(b).decode("utf-8", errors="replace")  # noqa: E731
        return decode(bufs[proc.stdout]), decode(bufs[proc.stderr]), truncated, killed


_static_args_cache: list[str] | None = None


def _static_args() -> list[str]:
    global _static_args_cache
    if _static_args_cache is None:
        _static_args_cache = _static_bwrap_args()
    return _static_args_cache


def _check_traversable(root: Path) -> None:
    """As root, the sandbox uid must be able to reach the work dir through every ancestor."""
    if os.geteuid() != 0:
        return
    for directory in [root.resolve(), *root.resolve().parents]:
        if not os.stat(directory).st_mode & 0o001:
            raise SandboxError(
                f"`workdir_root` {root} is not reachable by the sandbox uid: {directory} lacks "
                "the execute bit for others; use a directory under /tmp or `chmod o+x` it"
            )


def _nofollow_opener(path: str, flags: int) -> int:
    return os.open(path, flags | os.O_NOFOLLOW | os.O_CLOEXEC)


def _kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL bwrap's process group; the pid namespace takes everything inside with it."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


_subreaper_done = False


def _become_subreaper() -> None:
    """Adopt orphaned descendants (prctl PR_SET_CHILD_SUBREAPER) so we can reap them.

    bwrap's outer process exits before its in-namespace child is reaped; without
    this the orphan becomes a zombie of the host's init, which may reap it only
    seconds later, and zombies count toward the sandbox uid's ``RLIMIT_NPROC``.
    """
    global _subreaper_done
    if _subreaper_done:
        return
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(36, 1, 0, 0, 0) != 0:  # 36 = PR_SET_CHILD_SUBREAPER
        raise SandboxError(f"prctl(PR_SET_CHILD_SUBREAPER) failed: errno {ctypes.get_errno()}")
    _subreaper_done = True


def _proc_state(pid: int) -> tuple[str, int] | None:
    """(state letter, ppid) of a process, None if it is gone."""
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            fields = fh.read().rsplit(b")", 1)[1].split()
    except OSError:
        return None
    return fields[0].decode(), int(fields[1])


def _reap_uid(uid: int, timeout_s: float = 5.0) -> None:
    """Wait until no process of a private sandbox uid is left: SIGKILL the live, reap the dead.

    The pid namespace already dooms them once bwrap is gone, but the kernel tears
    it down asynchronously; waiting here makes "nothing outlives run()" exact.
    """
    deadline = time.monotonic() + timeout_s
    me = os.getpid()
    while True:
        pids = [int(e.name) for e in os.scandir("/proc") if e.name.isdigit() and _owned_by(e, uid)]
        live = []
        for pid in pids:
            state = _proc_state(pid)
            if state is None:
                continue
            if state[0] == "Z":
                if state[1] == me:
                    try:
                        os.waitpid(pid, os.WNOHANG)
                    except ChildProcessError:
                        pass
                continue  # another parent's zombie runs nothing; its parent will reap it
            live.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not live:
            return
        if time.monotonic() > deadline:
            raise SandboxError(f"processes {live[:10]} of sandbox uid {uid} survived SIGKILL")
        time.sleep(0.002)


def _owned_by(entry: os.DirEntry, uid: int) -> bool:
    try:
        return entry.stat().st_uid == uid
    except OSError:
        return False


def _read_all(fd: int) -> str:
    chunks = []
    try:
        os.set_blocking(fd, False)
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks).decode("utf-8", errors="replace")


def _infer_reason(rc: int, stderr: str) -> str | None:
    if rc == 0:
        return None
    if rc > 128:
        sig = rc - 128
        if sig in _SIGNAL_REASONS:
            return _SIGNAL_REASONS[sig]
        if sig == signal.SIGKILL:
            return "signal:SIGKILL"
        try:
            return f"signal:{signal.Signals(sig).name}"
        except ValueError:
            pass
    tail = stderr[-4096:]
    for needle, reason in _STDERR_REASONS:
        if needle in tail:
            return reason
    return None


def _diff_manifests(before: dict | None, after: dict) -> dict[str, str]:
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
