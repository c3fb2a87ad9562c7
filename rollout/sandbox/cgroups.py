"""Per-sandbox cgroups: kernel-enforced memory, process and CPU limits, and the kernel's verdict.

One cgroup per sandbox holds bubblewrap's pid 1 and so every process of the
command tree (bwrap's outer process stays outside). The command only starts
once pid 1 is inside: bwrap waits on ``--block-fd`` until :meth:`SandboxCgroup.attach`
is done.

Two backends, chosen by :func:`detect_cgroups`:

* **cgroup v2**, when the ``memory`` and ``pids`` controllers are delegated:
  the parent cgroup (``cgroup_parent``, or this process's own cgroup from
  ``/proc/self/cgroup``) lists them in ``cgroup.controllers`` *and* already
  enables them in ``cgroup.subtree_control`` (the no-internal-process rule
  forbids enabling them on a cgroup that holds this process, so an operator
  delegates an empty parent, e.g. ``mkdir /sys/fs/cgroup/trajpipe && echo
  '+memory +pids +cpu' > /sys/fs/cgroup/cgroup.subtree_control``). Limits:
  ``memory.max``, ``memory.swap.max = 0``, ``memory.oom.group = 1``,
  ``pids.max``, ``cpu.max``. Verdict counters: ``memory.events`` ``oom_kill``,
  ``pids.events`` ``max``.
* **cgroup v1**, when the ``memory`` and ``pids`` hierarchies are mounted and
  this process may create cgroups under its own cgroup in each: limits
  ``memory.limit_in_bytes`` (+ ``memory.memsw.limit_in_bytes`` at the same value
  and ``memory.swappiness = 0``: no swap), ``pids.max``, ``cpu.cfs_quota_us``.
  Verdict counters: ``memory.oom_control`` ``oom_kill``, ``pids.events`` ``max``.

Moving bwrap's pid 1 in (:meth:`SandboxCgroup.attach`) write-locks the
kernel's ``cgroup_threadgroup_rwsem``, a per-cpu rw-semaphore: after a quiet
spell the first such write waits for an RCU grace period (measured 4 ms on an
idle 2-core VM, 8-12 ms under load) while later ones within about a grace
period are cheap (0.15 ms). :meth:`SandboxCgroup.warm` starts that wait in a
background thread with a no-op migration (the worker's pid into its own
cgroup) right after bwrap is spawned, so it elapses while bwrap builds its
namespaces (attach median 12.0 -> 0.4 ms at load 4; the tail remains when the
host is busy).
(Mounting the hierarchy with ``favordynmods`` removes the wait altogether; a
host setting, not ours to change.)

Sandbox cgroups are named ``sb-<owner pid>-<owner start time>-<sandbox id>``
under a ``trajpipe-sandboxes`` directory. :meth:`SandboxCgroup.close` removes
them; a worker that crashed leaves them behind, and the next
:func:`create_cgroup` removes those whose owner process is gone and which are
empty (it never kills processes of a cgroup it cannot prove abandoned).
"""

from __future__ import annotations

import os
import signal
import threading
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Protocol

from rollout.sandbox.errors import SandboxError
from rollout.sandbox.limits import SandboxLimits

__all__ = [
    "CONTAINER_NAME",
    "CgroupSupport",
    "SandboxCgroup",
    "detect_cgroups",
    "create_cgroup",
    "warm_attach",
    "reap_stale_cgroups",
]

CONTAINER_NAME = "trajpipe-sandboxes"
_CPU_PERIOD_US = 100_000
_REQUIRED = ("memory", "pids")


@dataclass(frozen=True)
class CgroupSupport:
    """What :func:`detect_cgroups` found.

    Attributes:
        kind: ``cgroup2``, ``cgroup1`` or None (no usable delegation).
        reason: why the other kinds were not usable (for error messages and test skips).
        dirs: controller -> the ``trajpipe-sandboxes`` directory sandbox cgroups go in
            (one entry ``""`` for v2's single hierarchy).
        cpu: the cpu controller is available too.
        own_procs: ``cgroup.procs`` of this process's own cgroup in one of those
            hierarchies (the target of :func:`warm_attach`'s no-op migration), or None.
    """

    kind: str | None
    reason: str
    dirs: dict[str, Path] = field(default_factory=dict)
    cpu: bool = False
    own_procs: Path | None = None


class SandboxCgroup(Protocol):
    """The cgroup(s) of one sandbox."""

    kind: str

    def ensure(self) -> None:
        """Recreate the cgroup with its limits if something removed it."""

    def warm(self) -> None:
        """Start the grace period the next :meth:`attach` would wait for (background, best effort)."""

    def attach(self, pid: int) -> None:
        """Move process ``pid`` (bwrap's pid 1, blocked) into the cgroup, made again first if something removed it."""

    def counters(self) -> tuple[int, int]:
        """Cumulative (``oom_kill`` events, forks refused at ``pids.max``)."""

    def close(self) -> None:
        """Kill what is left inside and remove the cgroup (idempotent)."""


# --------------------------------------------------------------------------- detection


def _mounts() -> list[tuple[str, str, str, list[str]]]:
    """(fstype, mount root, mount point, super options) of every cgroup mount."""
    out = []
    with open("/proc/self/mountinfo") as fh:
        for line in fh:
            left, _, right = line.partition(" - ")
            fields, rfields = left.split(), right.split()
            if len(rfields) >= 3 and rfields[0] in ("cgroup", "cgroup2"):
                out.append((rfields[0], fields[3], fields[4].replace("\\040", " "), rfields[2].split(",")))
    return out


def _own_cgroups() -> dict[str, str]:
    """Controller -> this process's cgroup path (``""`` key for the v2 unified hierarchy)."""
    out = {}
    with open("/proc/self/cgroup") as fh:
        for line in fh:
            hid, controllers, path = line.rstrip("\n").split(":", 2)
            if hid == "0" and controllers == "":
                out[""] = path
            else:
                for name in controllers.split(","):
                    out[name] = path
    return out


def _join(mount_root: str, mount_point: str, path: str) -> Path | None:
    if mount_root != "/" and not (path == mount_root or path.startswith(mount_root + "/")):
        return None
    rel = path[len(mount_root):] if mount_root != "/" else path
    return Path(mount_point + rel.rstrip("/")) if rel not in ("", "/") else Path(mount_point)


def _read_words(path: Path) -> set[str]:
    try:
        return set(path.read_text().split())
    except OSError:
        return set()


def _own_procs_v2() -> Path | None:
    own = _own_cgroups().get("")
    mount = next(((root, point) for kind, root, point, _ in _mounts() if kind == "cgroup2"), None)
    if own is None or mount is None:
        return None
    joined = _join(mount[0], mount[1], own)
    return joined / "cgroup.procs" if joined is not None else None


def _detect_v2(parent: str | None) -> tuple[CgroupSupport | None, str]:
    own_procs = _own_procs_v2()
    if parent is not None:
        base = Path(parent)
    else:
        own = _own_cgroups().get("")
        mount = next(((root, point) for kind, root, point, _ in _mounts() if kind == "cgroup2"), None)
        if own is None or mount is None:
            return None, "no cgroup v2 hierarchy"
        joined = _join(mount[0], mount[1], own)
        if joined is None:
            return None, "this process's cgroup v2 is outside the mounted hierarchy"
        base = joined
    offered = _read_words(base / "cgroup.controllers")
    missing = [c for c in _REQUIRED if c not in offered]
    if missing:
        return None, f"cgroup v2 at {base} does not offer {','.join(missing)} (offers: {' '.join(sorted(offered)) or 'none'})"
    enabled = _read_words(base / "cgroup.subtree_control")
    missing = [c for c in _REQUIRED if c not in enabled]
    if missing:
        return None, (f"cgroup v2 at {base} does not enable {','.join(missing)} for its children "
                      "(cgroup.subtree_control); delegate an empty cgroup and pass it as `cgroup_parent`")
    container = base / CONTAINER_NAME
    try:
        container.mkdir(exist_ok=True)
        wanted = [c for c in (*_REQUIRED, "cpu") if c in enabled]
        (container / "cgroup.subtree_control").write_text(" ".join("+" + c for c in wanted))
    except OSError as err:
        return None, f"cannot create cgroups under {base}: {err}"
    return CgroupSupport("cgroup2", "", {"": container}, cpu="cpu" in enabled, own_procs=own_procs), ""


def _detect_v1() -> tuple[CgroupSupport | None, str]:
    own = _own_cgroups()
    dirs: dict[str, Path] = {}
    for controller in (*_REQUIRED, "cpu"):
        mount = next(((root, point) for kind, root, point, opts in _mounts()
                      if kind == "cgroup" and controller in opts), None)
        if mount is None or controller not in own:
            if controller in _REQUIRED:
                return None, f"no cgroup v1 {controller} hierarchy"
            continue
        base = _join(mount[0], mount[1], own[controller])
        if base is None:
            if controller in _REQUIRED:
                return None, f"this process's v1 {controller} cgroup is outside the mounted hierarchy"
            continue
        container = base / CONTAINER_NAME
        try:
            container.mkdir(exist_ok=True)
        except OSError as err:
            if controller in _REQUIRED:
                return None, f"cannot create cgroup v1 {controller} cgroups under {base}: {err}"
            continue
        dirs[controller] = container
    # the container dirs are made under this process's own cgroup of each hierarchy
    return CgroupSupport("cgroup1", "", dirs, cpu="cpu" in dirs, own_procs=dirs["pids"].parent / "cgroup.procs"), ""


_detected: dict[str | None, CgroupSupport] = {}


def detect_cgroups(*, parent: str | None = None) -> CgroupSupport:
    """Find a cgroup hierarchy in which this process may create limited sandbox cgroups.

    Tries v2 first (``parent`` or this process's own cgroup), then v1. The
    result is cached per ``parent``.

    Args:
        parent: a delegated cgroup v2 directory to create sandbox cgroups under.

    Returns:
        The :class:`CgroupSupport`; ``kind`` None with a ``reason`` when neither works.
    """
    if parent in _detected:
        return _detected[parent]
    v2, why_v2 = _detect_v2(parent)
    if v2 is not None:
        result = v2
    elif parent is not None:
        result = CgroupSupport(None, why_v2)
    else:
        v1, why_v1 = _detect_v1()
        result = v1 if v1 is not None else CgroupSupport(None, f"{why_v2}; {why_v1}")
    _detected[parent] = result
    return result


# --------------------------------------------------------------------------- one sandbox's cgroup


def _start_time(pid: int) -> str | None:
    try:
        with open(f"/proc/{pid}/stat", "rb") as fh:
            return fh.read().rsplit(b")", 1)[1].split()[19].decode()
    except (OSError, IndexError):
        return None


_own_tag: tuple[int, str] | None = None


def _owner_tag() -> str:
    """``<pid>-<start time>`` of this process (read once per process: a forked child has its own pid)."""
    global _own_tag
    pid = os.getpid()
    if _own_tag is None or _own_tag[0] != pid:
        _own_tag = (pid, f"{pid}-{_start_time(pid)}")
    return _own_tag[1]


def _counter(path: Path, key: str) -> int:
    try:
        for line in path.read_text().splitlines():
            name, _, value = line.partition(" ")
            if name == key:
                return int(value)
    except (OSError, ValueError):
        pass
    return 0


def _procs(directory: Path) -> list[int]:
    try:
        return [int(p) for p in (directory / "cgroup.procs").read_text().split()]
    except (OSError, ValueError):
        return []


def _write(path: Path, value: str, *, optional: bool = False) -> None:
    try:
        path.write_text(value)
    except OSError as err:
        if not optional:
            raise SandboxError(f"cannot set {path} to {value!r}: {err}") from err


def _empty_and_remove(directory: Path, *, kill: bool) -> bool:
    """rmdir a cgroup; with ``kill``, SIGKILL its processes first (cgroup.kill on v2). True if gone."""
    if not directory.exists():
        return True
    if kill:
        deadline = time.monotonic() + 2.0
        while (pids := _procs(directory)) and time.monotonic() < deadline:
            if (directory / "cgroup.kill").exists():
                _write(directory / "cgroup.kill", "1", optional=True)
            else:
                for pid in pids:
                    try:
                        os.kill(pid, signal.SIGKILL)
                    except ProcessLookupError:
                        pass
            time.sleep(0.005)
    deadline = time.monotonic() + 1.0
    while True:
        try:
            directory.rmdir()
            return True
        except FileNotFoundError:
            return True
        except OSError:  # EBUSY while the last task's exit is still being accounted
            if time.monotonic() > deadline:
                return False
            time.sleep(0.01)


class _Cgroup:
    """A sandbox cgroup in one or more hierarchies (v1: memory, pids, cpu; v2: one dir)."""

    def __init__(self, support: CgroupSupport, name: str, limits: SandboxLimits) -> None:
        self.kind = support.kind or ""
        self._support = support
        self._dirs = {c: d / name for c, d in support.dirs.items()}
        self._limits = limits
        self.ensure()

    def _configure(self) -> None:
        lim = self._limits
        quota = str(max(1000, int(lim.cpu_cores * _CPU_PERIOD_US)))
        if self.kind == "cgroup2":
            d = self._dirs[""]
            _write(d / "memory.max", str(lim.memory_bytes))
            _write(d / "memory.swap.max", "0", optional=not (d / "memory.swap.max").exists())
            _write(d / "memory.oom.group", "1", optional=True)
            _write(d / "pids.max", str(lim.max_processes + 1))
            if self._support.cpu:
                _write(d / "cpu.max", f"{quota} {_CPU_PERIOD_US}")
            return
        mem = self._dirs["memory"]
        _write(mem / "memory.limit_in_bytes", str(lim.memory_bytes))
        _write(mem / "memory.memsw.limit_in_bytes", str(lim.memory_bytes), optional=True)
        _write(mem / "memory.swappiness", "0", optional=True)
        _write(self._dirs["pids"] / "pids.max", str(lim.max_processes + 1))
        if "cpu" in self._dirs:
            _write(self._dirs["cpu"] / "cpu.cfs_period_us", str(_CPU_PERIOD_US))
            _write(self._dirs["cpu"] / "cpu.cfs_quota_us", quota)

    def ensure(self) -> None:
        created = False
        for directory in self._dirs.values():
            if not directory.is_dir():
                try:
                    directory.mkdir()
                except FileExistsError:
                    pass
                except OSError as err:
                    raise SandboxError(f"cannot create sandbox cgroup {directory}: {err}") from err
                created = True
        if created:
            self._configure()

    def warm(self) -> None:
        warm_attach(self._support)

    def attach(self, pid: int) -> None:
        # No existence check before every run (three stats on the start path): a write into a removed
        # cgroup fails with ENOENT, and the cgroup is made again, with its limits, before the gate opens.
        try:
            self._attach(pid)
        except FileNotFoundError:
            self.ensure()
            self._attach(pid)

    def _attach(self, pid: int) -> None:
        for directory in self._dirs.values():
            path = directory / "cgroup.procs"
            try:
                path.write_text(str(pid))
            except FileNotFoundError:
                raise
            except OSError as err:
                raise SandboxError(f"cannot set {path} to {str(pid)!r}: {err}") from err

    def counters(self) -> tuple[int, int]:
        if self.kind == "cgroup2":
            d = self._dirs[""]
            return _counter(d / "memory.events", "oom_kill"), _counter(d / "pids.events", "max")
        return (_counter(self._dirs["memory"] / "memory.oom_control", "oom_kill"),
                _counter(self._dirs["pids"] / "pids.events", "max"))

    def close(self) -> None:
        for directory in self._dirs.values():
            _empty_and_remove(directory, kill=True)


class _Warmer:
    """One daemon thread per process that does the no-op migration whenever :meth:`kick` is called.

    A thread of its own (started once), not one per run: ``Thread.start()`` waits until the new
    thread is scheduled, which on a loaded host costs more than the grace period it is meant to hide.
    """

    def __init__(self) -> None:
        self._lock = threading.Lock()
        self._wake = threading.Event()
        self._target: Path | None = None
        self._thread: threading.Thread | None = None

    def kick(self, procs: Path) -> None:
        with self._lock:
            self._target = procs
            if self._thread is None:
                self._thread = threading.Thread(target=self._loop, name="sandbox-cgroup-warm", daemon=True)
                self._thread.start()
        self._wake.set()

    def _loop(self) -> None:
        while True:
            self._wake.wait()
            self._wake.clear()
            with self._lock:
                procs = self._target
            try:
                fd = os.open(procs, os.O_WRONLY | os.O_CLOEXEC)
                try:
                    os.write(fd, str(os.getpid()).encode())
                finally:
                    os.close(fd)
            except OSError:
                pass  # only a head start: the attach then waits for the grace period itself


_warmer = _Warmer()


def warm_attach(support: CgroupSupport) -> None:
    """Move this process into the cgroup it is already in, from a daemon thread (see the module docs).

    The write takes the migration lock, so the RCU grace period the next
    attach would wait for elapses now, in the background; no process changes cgroup.
    Returns at once.
    """
    if support.own_procs is not None:
        _warmer.kick(support.own_procs)


def reap_stale_cgroups(support: CgroupSupport) -> int:
    """Remove empty sandbox cgroups whose owner process is gone; returns how many were removed."""
    removed = 0
    for container in support.dirs.values():
        try:
            entries = list(os.scandir(container))
        except OSError:
            continue
        for entry in entries:
            parts = entry.name.split("-")
            if len(parts) != 4 or parts[0] != "sb" or not entry.is_dir(follow_symlinks=False):
                continue
            pid, start = parts[1], parts[2]
            if f"{pid}-{start}" == _owner_tag() or (pid.isdigit() and _start_time(int(pid)) == start):
                continue  # owner alive (this process's own, without reading /proc)
            if not _procs(Path(entry.path)) and _empty_and_remove(Path(entry.path), kill=False):
                removed += 1
    return removed


def create_cgroup(support: CgroupSupport, sandbox_id: str, limits: SandboxLimits) -> SandboxCgroup:
    """Make the cgroup(s) for one sandbox, after clearing abandoned ones.

    Raises:
        SandboxError: ``support`` has no usable kind, or the cgroup cannot be made.
    """
    if support.kind is None:
        raise SandboxError(f"no usable cgroups: {support.reason}")
    reap_stale_cgroups(support)
    return _Cgroup(support, f"sb-{_owner_tag()}-{sandbox_id}", limits)
