"""One private, unprivileged uid per sandbox, and making sure none of its processes outlive a run.

When the worker runs as root, each sandbox leases a uid from
``UID_BASE .. UID_BASE + UID_POOL`` (an ``flock``-ed file per uid under the
system temp dir, so leases are exclusive across worker processes). The
command runs as that uid: it owns nothing of the host, ``RLIMIT_NPROC``
(counted per real uid, ignored for root) bounds exactly this sandbox, and
"every process of the uid is gone" is an exact test that nothing survived.

As a normal user the sandbox shares the user's uid; the process limit is then
the user's current process count plus ``max_processes`` (rlimit fallback).
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import random
import resource
import select
import signal
import tempfile
import time
from pathlib import Path

from rollout.sandbox.errors import SandboxError

__all__ = [
    "UID_BASE",
    "UID_POOL",
    "UidLease",
    "become_subreaper",
    "reap_uid",
    "reap_adopted",
    "uid_process_count",
    "check_traversable",
]

#: Unprivileged uids handed out to sandboxes when the worker runs as root.
UID_BASE = 2_000_000
UID_POOL = 4096


class UidLease:
    """An unprivileged uid held for one sandbox, exclusive across processes via ``flock``.

    Attributes:
        uid: the uid commands run as.
        gid: the gid commands run as.
        private: True when the uid belongs to this sandbox alone (worker is root).

    Raises:
        SandboxError: every uid of the pool is leased.
    """

    def __init__(self) -> None:
        self._fd: int | None = None
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
            self._fd, self.uid, self.gid = fd, uid, uid
            return
        raise SandboxError(f"all {UID_POOL} sandbox uids are in use; close sandboxes or raise UID_POOL")

    @property
    def private(self) -> bool:
        return self._fd is not None

    def release(self) -> None:
        """Give the uid back (idempotent)."""
        if self._fd is not None:
            os.close(self._fd)
            self._fd = None


def uid_process_count(uid: int) -> int:
    """Processes on the host whose ``/proc`` entry is owned by ``uid``."""
    return len(_uid_pids(uid))


_subreaper_done = False


def become_subreaper() -> None:
    """Adopt orphaned descendants (prctl ``PR_SET_CHILD_SUBREAPER``) so we can reap them.

    bwrap's outer process exits as soon as its pid 1 reports the command's exit,
    before that pid 1 is reaped; without this the orphan becomes a zombie of the
    host's init (reaped only later, counting toward the uid's ``RLIMIT_NPROC``),
    and its resource usage, which includes the command's, would be lost to us.

    Raises:
        SandboxError: the prctl call failed.
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


def _uid_pids(uid: int) -> list[int]:
    pids = []
    for entry in os.scandir("/proc"):
        if entry.name.isdigit():
            try:
                if entry.stat().st_uid == uid:
                    pids.append(int(entry.name))
            except OSError:
                pass
    return pids


def reap_uid(uid: int, *, timeout_s: float = 5.0) -> list[resource.struct_rusage]:
    """Wait until no process of a private sandbox uid is left: SIGKILL the live, reap the dead.

    The pid namespace already dooms them once bwrap is gone, but the kernel tears
    it down asynchronously; waiting here makes "nothing outlives run()" exact.

    Returns:
        The ``wait4`` resource usage of every process reaped here (bwrap's pid 1,
        adopted as subreaper: its usage includes the command's).

    Raises:
        SandboxError: a process of the uid survived SIGKILL for ``timeout_s``.
    """
    deadline = time.monotonic() + timeout_s
    me = os.getpid()
    usages = []
    while True:
        live = []
        for pid in _uid_pids(uid):
            state = _proc_state(pid)
            if state is None:
                continue
            if state[0] == "Z":
                if state[1] == me:
                    try:
                        got, _, usage = os.wait4(pid, os.WNOHANG)
                    except ChildProcessError:
                        continue
                    if got == pid:
                        usages.append(usage)
                continue  # another parent's zombie runs nothing; its parent will reap it
            live.append(pid)
            try:
                os.kill(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
        if not live:
            return usages
        if time.monotonic() > deadline:
            raise SandboxError(f"processes {live[:10]} of sandbox uid {uid} survived SIGKILL")
        time.sleep(0.002)


def reap_adopted(pid: int, *, timeout_s: float = 5.0) -> resource.struct_rusage | None:
    """Reap bwrap's pid 1 (adopted by us as subreaper once bwrap's outer process exited).

    It dies on its own (``--die-with-parent``); after ``timeout_s`` it is killed.

    Returns:
        Its ``wait4`` usage, which includes the command's (pid 1 reaped it);
        None when it is not our child (already reaped by bwrap's outer process).
    """
    state = _proc_state(pid)
    if state is None or state[1] != os.getpid():
        return None
    try:
        pidfd = os.pidfd_open(pid)
    except OSError:
        return None
    try:
        ready, _, _ = select.select([pidfd], [], [], timeout_s)
        if not ready:
            os.kill(pid, signal.SIGKILL)
        _, _, usage = os.wait4(pid, 0)
        return usage
    except (ChildProcessError, ProcessLookupError):
        return None
    finally:
        os.close(pidfd)


def check_traversable(root: Path) -> None:
    """As root, the sandbox uid must be able to reach the work dir through every ancestor.

    Raises:
        SandboxError: an ancestor lacks the execute bit for others.
    """
    if os.geteuid() != 0:
        return
    for directory in [root.resolve(), *root.resolve().parents]:
        if not os.stat(directory).st_mode & 0o001:
            raise SandboxError(
                f"`workdir_root` {root} is not reachable by the sandbox uid: {directory} lacks "
                "the execute bit for others; use a directory under /tmp or `chmod o+x` it"
            )
