"""The verdict rules on hand-made kernel facts (no sandbox needed).

Limits used throughout: 5 CPU-seconds, 512 MiB memory. The rlimit memory rule's
threshold is 512 MiB - 512 MiB // 8 = 448 MiB.
"""

from __future__ import annotations

import pytest

from rollout.sandbox.verdict import KernelFacts, judge

MiB = 1 << 20


def _judge(rlimit_memory: bool = False, **facts) -> str | None:
    return judge(KernelFacts(**facts), cpu_time_limit_s=5, memory_limit_bytes=512 * MiB,
                 rlimit_memory=rlimit_memory)


def test_our_own_kill_wins():
    assert _judge(exit_status=-9, stopped_by_us="timeout", oom_kills=1) == "timeout"
    assert _judge(exit_status=-9, stopped_by_us="output_limit") == "output_limit"


def test_exit_zero_is_never_a_violation():
    assert _judge(exit_status=0, oom_kills=1, forks_refused=3, peak_rss_bytes=511 * MiB, rlimit_memory=True) is None


def test_cgroup_counters():
    assert _judge(exit_status=137, oom_kills=1) == "memory_limit"
    assert _judge(exit_status=1, oom_kills=1) == "memory_limit"  # a child was OOM-killed, the parent gave up
    assert _judge(exit_status=1, forks_refused=1) == "process_limit"
    assert _judge(exit_status=137) == "signal:SIGKILL"  # SIGKILL without an OOM kill: not memory


@pytest.mark.parametrize("cpu, expected", [
    (4.0, "cpu_limit"),          # 4.0 >= 0.8 x 5
    (3.99, "signal:SIGXCPU"),    # below the slack: exit(152) is not proof of a CPU limit
    (None, "signal:SIGXCPU"),    # usage not collected
])
def test_sigxcpu_needs_the_cpu_time_spent(cpu, expected):
    assert _judge(exit_status=128 + 24, cpu_time_s=cpu) == expected


def test_sigkill_at_the_hard_cpu_limit():
    assert _judge(exit_status=137, cpu_time_s=6.0) == "cpu_limit"  # ignored SIGXCPU, hard limit 5 + 1


def test_sigxfsz_needs_a_file_at_the_limit():
    assert _judge(exit_status=128 + 25, file_at_size_limit=True) == "file_size_limit"
    assert _judge(exit_status=128 + 25) == "signal:SIGXFSZ"


@pytest.mark.parametrize("peak_mib, expected", [
    (448, "memory_limit"),   # exactly at 512 - 64
    (447, None),             # below it
    (10, None),              # printed MemoryError with no memory pressure
])
def test_rlimit_memory_rule(peak_mib, expected):
    assert _judge(exit_status=1, peak_rss_bytes=peak_mib * MiB, rlimit_memory=True) == expected


def test_peak_rss_is_ignored_when_a_cgroup_limits_memory():
    assert _judge(exit_status=1, peak_rss_bytes=500 * MiB, rlimit_memory=False) is None
