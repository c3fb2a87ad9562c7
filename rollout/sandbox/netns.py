"""Network namespaces made ahead of time: a fresh one for every run, its loopback already up.

bwrap's ``--unshare-net`` makes the sandbox's network namespace inside the
``clone`` that starts the container and then configures its loopback over
netlink (add ``127.0.0.1/8``, set the link up); on the dev VM that is about
1 ms of every start (``copy_net_ns`` in the clone, two netlink round trips),
more when the host is busy. When the worker is root, a :class:`NetnsPool`
makes those namespaces beforehand in a daemon thread of its own (``unshare``
of the thread's network namespace, ``lo`` up, an fd kept, back to the worker's
namespace), and a run enters one before bwrap starts: util-linux ``nsenter
--net=/proc/<worker>/fd/<fd> --setuid=U --setgid=G`` replaces ``chroot
--userspec`` as the program that drops the uid (:mod:`rollout.sandbox.launch`),
and bwrap gets ``--share-net`` (keep the namespace it was started in).

What the command sees is what bwrap's own namespace gave it: a namespace of
its own, nothing in it but ``lo`` (up, ``127.0.0.1/8`` and ``::1``), no route
out. Each namespace goes to **one run** and is released when that run ends
(the kernel frees it with its last process); none is reused. The namespace
belongs to the worker's user namespace rather than the sandbox's, so the
command, which has no capability there, cannot change its interfaces,
addresses, routes or ``net.*`` sysctls (under bwrap's own it could not
either: bwrap drops every capability). The fd is not passed to any process:
``nsenter`` (still root at that moment) opens the worker's ``/proc/<pid>/fd/<fd>``
itself and closes it after ``setns``.

Only the pool's own thread ever changes its network namespace; the worker's
other threads (Kafka clients, the policy) never leave theirs.
"""

from __future__ import annotations

import ctypes
import fcntl
import os
import socket
import struct
import threading

__all__ = ["Netns", "NetnsPool", "netns_pool", "netns_unavailable_reason"]

_CLONE_NEWNET = 0x40000000
_SIOCGIFFLAGS = 0x8913
_SIOCSIFFLAGS = 0x8914
_IFF_UP = 0x1
_IFREQ = "16sH14x"  # struct ifreq: name, ifr_flags, padding to 40 bytes

#: How long :meth:`NetnsPool.take` waits for the pool thread when none is ready before falling back.
_TAKE_WAIT_S = 0.5
#: How long the constructor waits for the first namespace (it takes about a millisecond).
_FIRST_WAIT_S = 10.0


class Netns:
    """A network namespace held open by an fd of this process, for one run.

    Attributes:
        fd: the ``/proc/thread-self/ns/net`` fd that keeps the namespace alive.
        path: ``/proc/<this pid>/fd/<fd>``, which a child of this process (as root) can open to enter it.
    """

    def __init__(self, fd: int) -> None:
        self.fd: int | None = fd
        self.path = f"/proc/{os.getpid()}/fd/{fd}"

    def close(self) -> None:
        """Drop our reference; the kernel frees the namespace once no process is left in it. Idempotent."""
        if self.fd is not None:
            os.close(self.fd)
            self.fd = None


def _check(ret: int, what: str) -> None:
    if ret != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"{what}: {os.strerror(err)}")


def _loopback_up() -> None:
    """Set ``lo`` of the calling thread's network namespace up (the kernel gives it 127.0.0.1/8 and ::1)."""
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as sock:
        flags = struct.unpack(_IFREQ, fcntl.ioctl(sock, _SIOCGIFFLAGS, struct.pack(_IFREQ, b"lo", 0)))[1]
        fcntl.ioctl(sock, _SIOCSIFFLAGS, struct.pack(_IFREQ, b"lo", flags | _IFF_UP))


class NetnsPool:
    """Keeps ``size`` fresh network namespaces ready, made by a daemon thread; each is handed out once.

    Args:
        size: how many to keep ready (>= 1).

    Raises:
        OSError: this process cannot make a network namespace (the worker is not root, or
            namespaces are disabled); raised by the first one, made here.
    """

    def __init__(self, size: int = 2) -> None:
        if size < 1:
            raise ValueError(f"`size` must be >= 1, got {size}")
        self._size = size
        self._libc = ctypes.CDLL(None, use_errno=True)
        self._ready: list[Netns] = []
        self._cond = threading.Condition()
        self._closed = False
        self.failure: str | None = None  # why the thread stopped making namespaces
        first: list[Netns | Exception] = []
        self._thread = threading.Thread(target=self._run, args=(first,), name="sandbox-netns-pool", daemon=True)
        self._thread.start()
        with self._cond:
            if not self._cond.wait_for(lambda: first, timeout=_FIRST_WAIT_S):
                self._closed = True
                self._cond.notify_all()
                raise OSError(f"no network namespace made within {_FIRST_WAIT_S:.0f} s")
        if isinstance(first[0], Exception):
            raise OSError(f"cannot make a network namespace: {first[0]}") from first[0]
        probe = first[0]
        same = os.stat(probe.path).st_ino == os.fstat(probe.fd).st_ino
        probe.close()
        if not same:
            self.close()
            raise OSError(f"/proc/{os.getpid()}/fd does not show this process's fds (another pid namespace's /proc)")

    def _make(self, home: int) -> Netns:
        """A new namespace with ``lo`` up; the calling (pool) thread is back in ``home`` afterwards.

        Raises:
            OSError: the namespace could not be made or set up (the thread is back home), or the
                thread could not go back home (it must then stop: :meth:`_run` does).
        """
        _check(self._libc.unshare(_CLONE_NEWNET), "unshare(CLONE_NEWNET)")
        fd = None
        try:
            fd = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            _loopback_up()
        except OSError:
            if fd is not None:
                os.close(fd)
                fd = None
            raise
        finally:
            # never leave this thread in the new namespace; if it cannot go back, it stops making them
            if self._libc.setns(home, _CLONE_NEWNET) != 0:
                err = ctypes.get_errno()
                if fd is not None:
                    os.close(fd)
                raise OSError(err, f"setns back to the worker's network namespace: {os.strerror(err)}")
        return Netns(fd)

    def _run(self, first: list) -> None:
        home = None
        try:
            home = os.open("/proc/thread-self/ns/net", os.O_RDONLY | os.O_CLOEXEC)
            first_made = self._make(home)
        except Exception as err:  # noqa: BLE001 - handed to the constructor, which raises it
            with self._cond:
                first.append(err)
                self._cond.notify_all()
            if home is not None:
                os.close(home)
            return
        try:
            with self._cond:
                if self._closed:  # the constructor gave up waiting
                    first_made.close()
                    return
                first.append(first_made)
                self._cond.notify_all()
            while True:
                with self._cond:
                    while not self._closed and len(self._ready) >= self._size:
                        self._cond.wait()
                    if self._closed:
                        return
                try:
                    made = self._make(home)
                except OSError as err:
                    with self._cond:
                        self.failure = str(err)
                        self._closed = True
                        self._cond.notify_all()
                    return
                with self._cond:
                    if self._closed:
                        made.close()
                        return
                    self._ready.append(made)
                    self._cond.notify_all()
        finally:
            os.close(home)

    def take(self) -> Netns | None:
        """A namespace nobody has had, or None (the pool stopped or is slow: bwrap makes one itself).

        Taking one does not wake the pool thread (its work would compete with the start this
        namespace is for); :meth:`release` does. When none is ready, the thread is woken and
        waited for, up to half a second.
        """
        with self._cond:
            if not self._ready and not self._closed:
                self._cond.notify_all()
                self._cond.wait_for(lambda: self._ready or self._closed, timeout=_TAKE_WAIT_S)
            return self._ready.pop(0) if self._ready else None

    def release(self, netns: Netns) -> None:
        """The run that took ``netns`` is over: drop it and let the thread make the next one."""
        netns.close()
        with self._cond:
            self._cond.notify_all()

    def close(self) -> None:
        """Stop the thread and release the namespaces nobody took. Idempotent."""
        with self._cond:
            self._closed = True
            ready, self._ready = self._ready, []
            self._cond.notify_all()
        for netns in ready:
            netns.close()

    def forget(self) -> None:
        """In a forked child: close our copies of the parent's namespaces (its thread does not exist here)."""
        for netns in self._ready:
            netns.close()
        self._ready = []
        self._closed = True


_pool: NetnsPool | None = None
_pool_error: str | None = None
_pool_lock = threading.Lock()


def netns_pool() -> NetnsPool | None:
    """This process's :class:`NetnsPool`, made on first use; None where none can be made.

    Then bwrap makes each run's namespace itself; :func:`netns_unavailable_reason` says why.
    """
    global _pool, _pool_error
    with _pool_lock:
        if _pool is None and _pool_error is None:
            if os.geteuid() != 0:
                _pool_error = "the worker is not root (entering a namespace needs CAP_SYS_ADMIN)"
            else:
                try:
                    _pool = NetnsPool()
                except OSError as err:
                    _pool_error = str(err)
        return _pool


def netns_unavailable_reason() -> str | None:
    """Why :func:`netns_pool` returned None (the worker is not root, namespaces disabled, ...), or None."""
    return _pool_error


def _forget_after_fork() -> None:
    global _pool, _pool_error, _pool_lock
    _pool_lock = threading.Lock()
    if _pool is not None:
        _pool.forget()
    _pool, _pool_error = None, None


os.register_at_fork(after_in_child=_forget_after_fork)
