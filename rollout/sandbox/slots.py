"""What a sandbox owns on the host (directories, a uid, a cgroup), made ahead of time by a small pool.

A :class:`Slot` is one sandbox's host state: ``sb-<id>/{work,tmp,snapshots}``
(``work`` and ``tmp`` owned by the leased uid), the :class:`~rollout.sandbox.uids.UidLease`
and the cgroup with its limits. Making one costs about 2 ms (a uid lock,
directories, three cgroup ``mkdir`` s and their limit files), all of it before
the first command can start, so :class:`SlotPool` keeps a few made by a
background thread and :meth:`~rollout.sandbox.Sandbox.create` takes one.

A slot is handed out **once** and destroyed by its sandbox's ``close()``;
nothing is ever returned to the pool or reused, so no episode can see another
one's files, uid or cgroup counters. Pools are per (root, limits, cgroup
hierarchy). Their unused slots are destroyed when the process exits
(:func:`close_pools`, registered with ``atexit``); a process forked from the
worker forgets the pools it inherited (they are the parent's) and makes its own.
"""

from __future__ import annotations

import atexit
import os
import shutil
import threading
import uuid
from dataclasses import dataclass
from pathlib import Path

from rollout.sandbox.cgroups import CgroupSupport, SandboxCgroup, create_cgroup, reap_stale_cgroups
from rollout.sandbox.errors import SandboxError
from rollout.sandbox.limits import SandboxLimits
from rollout.sandbox.uids import UidLease

__all__ = ["Slot", "make_slot", "SlotPool", "take_slot", "close_pools"]


@dataclass
class Slot:
    """The host state of one sandbox.

    Attributes:
        sandbox_id: 16 hex digits, unique; names the directory and the cgroup.
        dir: ``<root>/sb-<id>``, mode 0711.
        work: bound at ``/work``, owned by the sandbox uid.
        tmp: bound at ``/tmp``, owned by the sandbox uid.
        snapshots: host-only snapshot store, mode 0700.
        lease: the uid (private when the worker is root).
        cgroup: the sandbox cgroup with its limits, or None (rlimit backend).
        counters: the cgroup's ``(oom_kill, pids max)`` event counters when it was made
            (the baseline of the first run's verdict; (0, 0) without a cgroup).
    """

    sandbox_id: str
    dir: Path
    work: Path
    tmp: Path
    snapshots: Path
    lease: UidLease
    cgroup: SandboxCgroup | None
    counters: tuple[int, int] = (0, 0)

    def destroy(self) -> None:
        """Remove the cgroup (killing what is left in it) and the directories, release the uid."""
        if self.cgroup is not None:
            self.cgroup.close()
        shutil.rmtree(self.dir, ignore_errors=True)
        self.lease.release()


def make_slot(root: Path, *, limits: SandboxLimits, support: CgroupSupport | None) -> Slot:
    """Make a fresh slot under ``root`` (which must exist and be traversable).

    Raises:
        SandboxError: no uid is free, or the cgroup cannot be made.
        OSError: the directories cannot be made.
    """
    sandbox_id = uuid.uuid4().hex[:16]
    directory = root / f"sb-{sandbox_id}"
    lease = UidLease()
    slot = Slot(sandbox_id, directory, directory / "work", directory / "tmp", directory / "snapshots", lease, None)
    try:
        directory.mkdir(mode=0o711)
        os.chmod(directory, 0o711)
        for sub in (slot.work, slot.tmp):
            sub.mkdir(mode=0o755)
            os.chown(sub, lease.uid, lease.gid)
        slot.snapshots.mkdir(mode=0o700)
        if support is not None:
            slot.cgroup = create_cgroup(support, sandbox_id, limits)
            slot.counters = slot.cgroup.counters()
    except (OSError, SandboxError):
        shutil.rmtree(directory, ignore_errors=True)
        lease.release()
        raise
    return slot


class SlotPool:
    """Keeps ``size`` fresh slots of one (root, limits, cgroup support) ready, made by a daemon thread.

    Args:
        root: where the slots' directories go.
        limits: the limits their cgroups are made with.
        support: the cgroup hierarchy, or None (rlimit backend).
        size: how many to keep ready (>= 1).
    """

    def __init__(self, root: Path, *, limits: SandboxLimits, support: CgroupSupport | None, size: int) -> None:
        if size < 1:
            raise ValueError(f"`size` must be >= 1, got {size}")
        self._root, self._limits, self._support, self._size = root, limits, support, size
        self._ready: list[Slot] = []
        self._cond = threading.Condition()
        self._closed = False
        self._failed = False  # the refiller hit an error: take() makes slots itself and raises it
        self._thread = threading.Thread(target=self._refill, name="sandbox-slot-pool", daemon=True)
        self._thread.start()

    def take(self) -> Slot:
        """A slot nobody has had, made now if none is ready.

        Raises:
            SandboxError: the pool is closed, or making a slot failed.
            OSError: making a slot's directories failed.
        """
        if self._support is not None:
            reap_stale_cgroups(self._support)  # a crashed worker's cgroups go on every create, pooled or not
        with self._cond:
            if self._closed:
                raise SandboxError("the sandbox slot pool is closed (interpreter shutting down)")
            slot = self._ready.pop(0) if self._ready else None
            self._cond.notify()
        return slot if slot is not None else make_slot(self._root, limits=self._limits, support=self._support)

    def _refill(self) -> None:
        while True:
            with self._cond:
                while not self._closed and (self._failed or len(self._ready) >= self._size):
                    self._cond.wait()
                if self._closed:
                    return
            try:
                slot = make_slot(self._root, limits=self._limits, support=self._support)
            except (OSError, SandboxError):
                with self._cond:
                    self._failed = True
                continue
            with self._cond:
                if self._closed:
                    slot.destroy()
                    return
                self._ready.append(slot)

    def close(self) -> None:
        """Stop refilling and destroy the slots nobody took. Idempotent."""
        with self._cond:
            self._closed = True
            ready, self._ready = self._ready, []
            self._cond.notify_all()
        self._thread.join(timeout=10)
        for slot in ready:
            slot.destroy()

    def forget(self) -> None:
        """In a forked child: drop the parent's slots without touching them (only our copy of each uid lock)."""
        for slot in self._ready:
            slot.lease.release()  # closes this process's copy of the lock fd; the parent's lock stays
        self._ready = []
        self._closed = True


_pools: dict[tuple, SlotPool] = {}
_pools_lock = threading.Lock()


def take_slot(root: Path, *, limits: SandboxLimits, support: CgroupSupport | None, pool_size: int) -> Slot:
    """A fresh slot; from this process's pool for (root, limits, support) when ``pool_size`` > 0.

    Raises:
        SandboxError, OSError: as :func:`make_slot`.
    """
    if pool_size <= 0:
        return make_slot(root, limits=limits, support=support)
    hierarchy = None if support is None else (support.kind, tuple(sorted((k, str(v)) for k, v in support.dirs.items())))
    key = (str(root.resolve()), limits, hierarchy, pool_size)
    with _pools_lock:
        pool = _pools.get(key)
        if pool is None:
            pool = _pools[key] = SlotPool(root, limits=limits, support=support, size=pool_size)
    return pool.take()


def close_pools() -> None:
    """Destroy every unused slot of this process's pools (runs at exit)."""
    with _pools_lock:
        pools = list(_pools.values())
        _pools.clear()
    for pool in pools:
        pool.close()


def _forget_pools_after_fork() -> None:
    global _pools_lock
    _pools_lock = threading.Lock()
    for pool in _pools.values():
        pool.forget()
    _pools.clear()


atexit.register(close_pools)
os.register_at_fork(after_in_child=_forget_pools_after_fork)
