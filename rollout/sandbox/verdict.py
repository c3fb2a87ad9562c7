"""Why a command stopped, decided from kernel facts only.

The command's output is never read here: a program that prints
``MemoryError`` or ``Killed`` has violated nothing. What counts:

* our own decisions (the wall-clock timer, the output cap);
* cgroup event counters, which only the kernel increments: ``oom_kill``
  (memory.events / memory.oom_control) and the pids controller's ``max``
  (a fork refused at ``pids.max``);
* the exit status bubblewrap relays (``128 + N`` for a death by signal N),
  corroborated by ``wait4`` resource usage where a program could fake it by
  exiting with that number itself: ``cpu_limit`` needs the CPU time actually
  used to reach :data:`CPU_SLACK` of the limit, ``file_size_limit`` needs a file at exactly
  ``max_file_bytes`` (where the kernel's write check stops a file);
* under the rlimit fallback only, ``memory_limit`` when the command failed
  with its peak resident memory (``ru_maxrss`` of the whole tree) within
  ``memory_bytes // 8`` of the limit. The kernel answers a refused
  allocation with ``ENOMEM`` and keeps no record of it, so a single
  oversized request refused at once (peak far below the limit) cannot be told
  apart from a program that merely exits 1, and is not reported.

Limits are reported only for a command that did not exit 0 (it was stopped,
or gave up); a program that survived a refused fork and exited 0 is ``ok``.
"""

from __future__ import annotations

import signal
from dataclasses import dataclass

__all__ = ["KernelFacts", "judge", "RLIMIT_MEMORY_MARGIN_DIVISOR", "CPU_SLACK"]

#: Under the rlimit fallback a failure counts as ``memory_limit`` when peak RSS
#: reached ``memory_bytes - memory_bytes // RLIMIT_MEMORY_MARGIN_DIVISOR``.
RLIMIT_MEMORY_MARGIN_DIVISOR = 8

#: ``cpu_limit`` needs ``wait4`` CPU time >= this fraction of ``RLIMIT_CPU``. The kernel checks the
#: rlimit against tick-sampled user+system time, while ``wait4`` reports scheduler runtime; in a VM
#: they differ by several percent (measured: SIGXCPU at 5 s with 4.74 s reported). A fifth of slack
#: still separates "spent its CPU budget" from "called exit(152)" after a few milliseconds.
CPU_SLACK = 0.8


@dataclass(frozen=True)
class KernelFacts:
    """What the kernel and our own supervision recorded about one command.

    Attributes:
        exit_status: bubblewrap's exit status (the command's, or ``128 + N``
            for signal N); negative when we killed bwrap ourselves.
        stopped_by_us: ``timeout`` or ``output_limit`` when we killed it, else None.
        oom_kills: increase of the sandbox cgroup's ``oom_kill`` counter (0 without cgroups).
        forks_refused: increase of the pids controller's ``max`` event counter.
        peak_rss_bytes: largest resident set of any process of the tree
            (``wait4`` ``ru_maxrss``), or None when the usage was not collected.
        cpu_time_s: user + system CPU seconds of the tree from ``wait4``, or None.
        file_at_size_limit: a file of exactly ``max_file_bytes`` exists in the sandbox.
    """

    exit_status: int
    stopped_by_us: str | None = None
    oom_kills: int = 0
    forks_refused: int = 0
    peak_rss_bytes: int | None = None
    cpu_time_s: float | None = None
    file_at_size_limit: bool = False


def judge(
    facts: KernelFacts,
    *,
    cpu_time_limit_s: float,
    memory_limit_bytes: int,
    rlimit_memory: bool,
) -> str | None:
    """The ``killed_reason`` for a command, or None if no limit stopped it.

    Args:
        facts: what was recorded about the run.
        cpu_time_limit_s: the ``RLIMIT_CPU`` soft limit in force.
        memory_limit_bytes: the sandbox memory limit.
        rlimit_memory: memory was limited by ``RLIMIT_DATA`` (no cgroup), so the
            peak-RSS rule applies.

    Returns:
        ``timeout``, ``output_limit``, ``memory_limit``, ``process_limit``,
        ``cpu_limit``, ``file_size_limit``, ``signal:<NAME>`` or None.

    Examples:
        >>> judge(KernelFacts(exit_status=1), cpu_time_limit_s=5,
        ...       memory_limit_bytes=512 << 20, rlimit_memory=True)
        >>> judge(KernelFacts(exit_status=137, oom_kills=1), cpu_time_limit_s=5,
        ...       memory_limit_bytes=512 << 20, rlimit_memory=False)
        'memory_limit'
    """
    if facts.stopped_by_us is not None:
        return facts.stopped_by_us
    status = facts.exit_status
    if status == 0:
        return None
    if facts.oom_kills > 0:
        return "memory_limit"
    if facts.forks_refused > 0:
        return "process_limit"
    sig = status - 128 if status > 128 else None
    used_cpu = facts.cpu_time_s is not None and facts.cpu_time_s >= cpu_time_limit_s * CPU_SLACK
    if sig in (signal.SIGXCPU, signal.SIGKILL) and used_cpu:
        return "cpu_limit"
    if sig == signal.SIGXFSZ and facts.file_at_size_limit:
        return "file_size_limit"
    if rlimit_memory and facts.peak_rss_bytes is not None:
        threshold = memory_limit_bytes - memory_limit_bytes // RLIMIT_MEMORY_MARGIN_DIVISOR
        if facts.peak_rss_bytes >= threshold:
            return "memory_limit"
    if sig is not None:
        try:
            return f"signal:{signal.Signals(sig).name}"
        except ValueError:
            return None
    return None
