"""How bubblewrap is invoked: its arguments, its environment, and what is bound inside.

Nothing of the worker reaches the sandbox through the spawn:

* **Environment.** bwrap is started with :data:`SANDBOX_ENV` as its whole
  environment (not the worker's), and ``--clearenv`` gives the command the same
  fixed set. bwrap stays alive as pid 1 of the sandbox's pid namespace, so its
  environment is readable at ``/proc/1/environ`` by the sandboxed code; that is
  why it must not be the worker's.
* **Command line.** bwrap's options (host paths of the work dir, the binds)
  travel through a memfd (``--args FD``); pid 1's ``/proc/1/cmdline``
  reads ``bwrap --args N -- <command>``.
* **File descriptors.** Only stdin/stdout/stderr pipes, the memfd, the status
  pipe and (cgroup backends) the start-gate pipe are passed; bwrap closes the
  last three before the command runs (``close_fds`` drops the rest).

Visible inside, read-only: ``/usr`` (and the ``/bin``, ``/lib*`` links), the
few ``/etc`` files in :data:`ETC_FILES` (an up-to-date copy bound at ``/etc``
in one mount, :mod:`rollout.sandbox.etc`), the interpreter prefix when it is not
under ``/usr``, and ``extra_ro_binds``. Writable: ``/work`` and ``/tmp`` (this
sandbox's own directories). ``/proc`` is the sandbox's own pid namespace,
``/dev`` a minimal tmpfs (null, zero, full, random, urandom, tty, pts).
"""

from __future__ import annotations

import functools
import os
import shutil
import sys
from pathlib import Path
from typing import NamedTuple, Sequence

from rollout.sandbox.errors import SandboxUnavailable
from rollout.sandbox.etc import ETC_FILES, etc_copy

__all__ = [
    "WORK_MOUNT",
    "ETC_FILES",
    "SANDBOX_ENV",
    "HostTools",
    "host_tools",
    "sandbox_python",
    "static_bwrap_args",
    "bwrap_args",
    "args_memfd",
]

#: Path of the work directory inside the sandbox.
WORK_MOUNT = "/work"

_TOP_LEVEL_LINKS = ("/bin", "/sbin", "/lib", "/lib32", "/lib64", "/libx32")

#: The whole environment of bwrap and of every sandboxed command (fixed for reproducibility).
SANDBOX_ENV: dict[str, str] = {
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

_SYSTEM_PATH = "/usr/bin:/bin:/usr/sbin:/sbin"


def _which(name: str) -> str | None:
    return shutil.which(name, path=os.environ.get("PATH", "") + ":" + _SYSTEM_PATH)


class HostTools(NamedTuple):
    """Absolute paths of the host programs a sandbox run execs (``nsenter`` None when it is not installed)."""

    bwrap: str
    prlimit: str
    chroot: str
    nsenter: str | None = None


@functools.cache
def host_tools() -> HostTools:
    """Absolute paths of ``bwrap``, ``prlimit``, ``chroot`` and ``nsenter`` (looked up once per process).

    ``nsenter`` (util-linux) is optional: without it bwrap makes each run's network namespace itself.

    Raises:
        SandboxUnavailable: one of them is not installed.
    """
    bwrap = _which("bwrap")
    if bwrap is None:
        raise SandboxUnavailable(
            "bubblewrap (`bwrap`) is not installed; install it with "
            "`apt-get install -y bubblewrap` (Debian/Ubuntu) or `dnf install bubblewrap`"
        )
    found = {}
    for name, package in (("prlimit", "util-linux"), ("chroot", "coreutils")):
        path = _which(name)
        if path is None:
            raise SandboxUnavailable(f"`{name}` ({package}) is not installed; install {package}")
        found[name] = os.path.realpath(path)
    nsenter = _which("nsenter")
    return HostTools(os.path.realpath(bwrap), found["prlimit"], found["chroot"],
                     os.path.realpath(nsenter) if nsenter else None)


def sandbox_python() -> str:
    """Interpreter path to use inside sandboxes (``/usr/bin/python3`` if present).

    Falls back to this process's base interpreter, whose prefix is then bound
    read-only into every sandbox.
    """
    if os.path.exists("/usr/bin/python3"):
        return "/usr/bin/python3"
    return os.path.realpath(os.path.join(sys.base_prefix, "bin", "python3"))


def _python_binds() -> list[str]:
    if sandbox_python().startswith("/usr/"):
        return []
    prefix = os.path.realpath(sys.base_prefix)
    return ["--ro-bind", prefix, prefix]


_static_cache: list[str] | None = None


def static_bwrap_args() -> list[str]:
    """bwrap arguments shared by every sandbox on this host (computed once per process)."""
    global _static_cache
    if _static_cache is not None:
        return _static_cache
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
    args += _python_binds()
    args += ["--proc", "/proc", "--dev", "/dev"]
    _static_cache = args
    return args


def bwrap_args(
    *,
    work: Path,
    tmp: Path,
    extra_ro_binds: Sequence[str],
    status_fd: int,
    block_fd: int | None,
    share_net: bool = False,
) -> list[str]:
    """bwrap's options for one run; they go into the ``--args`` memfd, not onto its argv.

    bwrap reads only options from ``--args``, so the command itself follows
    ``bwrap --args N --`` on the argv (``/proc/1/cmdline`` inside shows it,
    which is the sandbox's own command, no host detail).

    Args:
        work: host work directory, bound at :data:`WORK_MOUNT`.
        tmp: host directory bound at ``/tmp``.
        extra_ro_binds: absolute host paths bound read-only at the same place.
        status_fd: fd bwrap writes ``{"child-pid": N}`` and ``{"exit-code": N}`` to.
        block_fd: fd bwrap's pid 1 reads one byte from before it starts the
            command (the cgroup backends move it into the cgroup first), or None.
        share_net: keep the network namespace bwrap is started in (a fresh one made
            ahead, :mod:`rollout.sandbox.netns`) instead of making one.
    """
    args = list(static_bwrap_args())
    if share_net:
        args.insert(args.index("--unshare-all") + 1, "--share-net")
    if any(p == "/etc" or p.startswith("/etc/") for p in extra_ro_binds):
        # a bind inside /etc needs a mount point, which a read-only bound copy cannot get: bind file by file
        args += [a for path in ETC_FILES if os.path.exists(path) for a in ("--ro-bind", path, path)]
    else:
        args += ["--ro-bind", str(etc_copy()), "/etc"]
    for path in extra_ro_binds:
        args += ["--ro-bind", path, path]
    args += [
        "--bind", str(work), WORK_MOUNT,
        "--bind", str(tmp), "/tmp",
        "--remount-ro", "/",
        "--chdir", WORK_MOUNT,
        "--clearenv",
    ]
    for key, value in SANDBOX_ENV.items():
        args += ["--setenv", key, value]
    args += ["--json-status-fd", str(status_fd)]
    if block_fd is not None:
        args += ["--block-fd", str(block_fd)]
    return args


def args_memfd(args: Sequence[str]) -> int:
    """A memfd holding ``args`` NUL-separated, rewound, for ``bwrap --args FD``.

    The caller passes it to bwrap (``pass_fds``) and closes its own copy after the spawn.
    """
    fd = os.memfd_create("bwrap-args", os.MFD_CLOEXEC)
    try:
        data = b"".join(os.fsencode(a) + b"\0" for a in args)
        view = memoryview(data)
        while view:
            view = view[os.write(fd, view):]
        os.lseek(fd, 0, os.SEEK_SET)
    except OSError:
        os.close(fd)
        raise
    return fd
