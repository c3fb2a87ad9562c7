"""Per-process resource limits (``setrlimit`` via util-linux ``prlimit``).

Both backends set ``RLIMIT_CPU`` (SIGXCPU at the soft limit, SIGKILL a second
later), ``RLIMIT_FSIZE`` (SIGXFSZ), ``RLIMIT_NOFILE`` and ``RLIMIT_CORE = 0``.

The rlimit fallback (no cgroup delegation) adds:

* ``RLIMIT_DATA = memory_bytes``: since Linux 4.7 it bounds a process's
  private writable mappings (heap, anonymous ``mmap``), not its address
  space. A JVM or Go runtime reserving gigabytes as ``PROT_NONE`` starts, where
  ``RLIMIT_AS`` would fail it; the limit is per process, so several processes
  together may use up to ``max_processes x memory_bytes`` (only a cgroup bounds the sum).
* ``RLIMIT_NPROC = max_processes`` for the sandbox's private uid (plus the
  uid's current process count when the worker is not root and shares its uid).
"""

from __future__ import annotations

from rollout.sandbox.limits import SandboxLimits

__all__ = ["prlimit_args"]


def prlimit_args(limits: SandboxLimits, *, fallback_nproc: int | None) -> list[str]:
    """``prlimit`` options for one run.

    Args:
        limits: the sandbox limits.
        fallback_nproc: ``RLIMIT_NPROC`` to set when memory and processes are
            limited by rlimits (no cgroup); None under a cgroup backend.

    Returns:
        Options such as ``--cpu=5:6`` to put between ``prlimit`` and ``--``.

    Examples:
        >>> prlimit_args(SandboxLimits(cpu_time_s=5, memory_bytes=1 << 20), fallback_nproc=None)[:2]
        ['--cpu=5:6', '--fsize=67108864']
        >>> prlimit_args(SandboxLimits(memory_bytes=1 << 20), fallback_nproc=65)[-2:]
        ['--data=1048576', '--nproc=65']
    """
    args = [
        f"--cpu={limits.cpu_time_s}:{limits.cpu_time_s + 1}",
        f"--fsize={limits.max_file_bytes}",
        f"--nofile={limits.max_open_files}",
        "--core=0",
    ]
    if fallback_nproc is not None:
        args += [f"--data={limits.memory_bytes}", f"--nproc={fallback_nproc}"]
    return args
