"""Resource limits under each mechanism (cgroup, rlimit), and verdicts that come from the kernel, not from output.

Every test runs once per backend (the ``limited`` fixture); the cgroup run is
skipped with the reason where the host delegates no cgroup. Limits are those
of ``conftest.TEST_LIMITS``: 512 MiB memory, 32 processes, 5 CPU-seconds, 8 MiB files.
"""

from __future__ import annotations

import os
import shutil
from pathlib import Path

import pytest

from rollout.sandbox import Sandbox, SandboxLimits, SandboxUnavailable, detect_cgroups

from .conftest import TEST_LIMITS

LIMIT_REASONS = {"memory_limit", "process_limit", "cpu_limit", "file_size_limit"}

# Grows by 16 MiB of touched memory until something stops it.
GROW = "chunks = []\nwhile True:\n    chunks.append(bytearray(16 << 20))\n"

# What a JVM or Go runtime does at start: reserve a large range PROT_NONE, then commit a little.
RESERVE = (
    "import ctypes\n"
    "libc = ctypes.CDLL(None, use_errno=True)\n"
    "libc.mmap.restype = ctypes.c_void_p\n"
    "libc.mmap.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int, ctypes.c_int, ctypes.c_int, ctypes.c_long]\n"
    "libc.mprotect.argtypes = [ctypes.c_void_p, ctypes.c_size_t, ctypes.c_int]\n"
    "PROT_NONE, PROT_RW, MAP_PRIVATE_ANON_NORESERVE = 0, 3, 0x2 | 0x20 | 0x4000\n"
    "base = libc.mmap(None, 8 << 30, PROT_NONE, MAP_PRIVATE_ANON_NORESERVE, -1, 0)\n"
    "assert base not in (None, ctypes.c_void_p(-1).value), ctypes.get_errno()\n"
    "assert libc.mprotect(base, 64 << 20, PROT_RW) == 0, ctypes.get_errno()\n"
    "ctypes.memset(base, 1, 64 << 20)\n"
    "print('reserved', 8 << 30, 'committed', 64 << 20)\n"
)


def test_backend_in_force_is_the_one_asked_for(limited, limits_backend):
    assert limited.limits_backend == ("rlimit" if limits_backend == "rlimit" else detect_cgroups().kind)


def test_memory_blowup_is_memory_limit(limited):
    r = limited.run(["python3", "-c", GROW], timeout_s=20)
    assert not r.timed_out
    assert r.killed_reason == "memory_limit", r
    if limited.limits_backend == "rlimit":
        # the kernel refused an allocation (ENOMEM); peak RSS was within 1/8 of the limit
        assert r.exit_status == 1
    else:
        assert r.exit_status == 137  # SIGKILL by the cgroup's OOM killer; oom_kill went up


def test_single_oversized_allocation(limited):
    r = limited.run(["python3", "-c", "x = bytearray(2 << 30)"])
    assert r.exit_status != 0
    if limited.limits_backend == "rlimit":
        # documented limit of the fallback: mmap of 2 GiB is refused at once, RSS stays ~10 MiB,
        # and the kernel keeps no record of the refusal, so nothing proves a memory violation
        assert r.killed_reason is None
    else:
        assert r.killed_reason == "memory_limit" and r.exit_status == 137


def test_a_worker_bigger_than_the_limit_does_not_make_every_failure_a_memory_limit(sandbox_root):
    # Found by the clean-clone `make test`: bwrap's outer process starts with the worker's peak RSS (exec records
    # the forked mm's high-water mark in ru_maxrss), so once pytest (or a worker holding a model) had grown past
    # 7/8 of the sandbox's memory limit, every failed command under the rlimit fallback was `memory_limit`.
    ballast = bytearray(TEST_LIMITS.memory_bytes + (128 << 20))
    for i in range(0, len(ballast), 4096):  # touch every page: resident, not just reserved
        ballast[i] = 1
    with Sandbox(sandbox_root, TEST_LIMITS, limits_backend="rlimit") as sb:
        failed = sb.run(["sh", "-c", "exit 1"])
        grown = sb.run(["python3", "-c", GROW], timeout_s=20)
    assert (failed.exit_status, failed.killed_reason) == (1, None), failed
    assert grown.killed_reason == "memory_limit", grown
    del ballast


@pytest.mark.parametrize("script", [
    "echo MemoryError >&2; exit 1",
    "echo Killed >&2; exit 1",
    "echo 'Cannot allocate memory' >&2; echo 'std::bad_alloc' >&2; exit 1",
    "echo 'fork: retry: Resource temporarily unavailable' >&2; exit 1",
    "echo 'File too large' >&2; exit 1",
    "python3 -c 'raise MemoryError'",
])
def test_output_that_names_a_limit_is_not_a_violation(limited, script):
    r = limited.run(script)
    assert r.exit_status == 1 and r.killed_reason is None


@pytest.mark.parametrize("status", [137, 152, 153])  # 128 + SIGKILL, SIGXCPU, SIGXFSZ, by exit()
def test_exit_status_that_looks_like_a_limit_signal_is_not_a_violation(limited, status):
    r = limited.run(f"echo Killed >&2; exit {status}")
    assert r.exit_status == status
    assert r.killed_reason not in LIMIT_REASONS  # no OOM kill, no CPU used, no file at the size limit


def test_large_prot_none_reservation_runs(limited):
    r = limited.run(["python3", "-c", RESERVE])
    assert r.ok, r
    assert r.stdout == f"reserved {8 << 30} committed {64 << 20}\n"


@pytest.mark.skipif(shutil.which("java") is None, reason="no JVM installed")
def test_jvm_starts(limited):
    # the JVM reserves a heap of 1/4 of RAM up front; under RLIMIT_AS=512 MiB it could not start
    r = limited.run(["java", "-version"], timeout_s=30)
    assert r.ok, r
    assert "version" in r.stderr


def test_cpu_limit_stops_busy_process(limited):
    r = limited.run(["python3", "-c", "while True: pass"], timeout_s=20)
    assert r.killed_reason == "cpu_limit" and not r.timed_out
    assert r.exit_status == 128 + 24  # SIGXCPU at cpu_time_s=5 CPU-seconds


def test_file_size_limit(limited):
    r = limited.run("head -c 16M /dev/zero > big")
    assert r.killed_reason == "file_size_limit" and r.exit_status == 128 + 25  # SIGXFSZ
    assert os.path.getsize(limited.work / "big") == TEST_LIMITS.max_file_bytes


FORK_BOMB = (
    "import os, time\n"
    "n = 0\n"
    "try:\n"
    "    while True:\n"
    "        if os.fork() == 0:\n"
    "            time.sleep(30); os._exit(0)\n"
    "        n += 1\n"
    "except OSError as err:\n"
    "    print('forks', n, err.errno)\n"
    "    raise\n"
)


def test_fork_bomb_hits_process_limit(limited):
    r = limited.run(["python3", "-c", FORK_BOMB], timeout_s=8)
    assert not r.timed_out, "the process limit, not the wall clock, must stop the bomb"
    forks = int(r.stdout.split()[1])
    assert forks < limited.limits.max_processes and r.exit_status == 1
    if limited.limits_backend == "rlimit":
        # RLIMIT_NPROC refuses the fork with EAGAIN and records nothing: contained, not reported
        assert r.killed_reason is None
    else:
        # pids.max = 32 + 1 (bwrap's pid 1): python + 31 children, the 32nd fork refused
        assert forks == 31 and r.killed_reason == "process_limit"
    pids = [e.name for e in os.scandir("/proc") if e.name.isdigit() and _owner(e) == limited.uid]
    assert pids == []  # the sleeping children died with the pid namespace


def _owner(entry: os.DirEntry) -> int | None:
    try:
        return entry.stat().st_uid
    except OSError:
        return None


def test_cgroup_bounds_all_processes_together(sandbox_root):
    support = detect_cgroups()
    if support.kind is None:
        pytest.skip(f"no delegated cgroup on this host: {support.reason}")
    # 4 processes x 200 MiB = 800 MiB > 512 MiB; each alone is under RLIMIT_DATA, the cgroup sums them
    # the OOM killer may pick the parent (exit 137) or a child (the parent then exits 1)
    script = ("import os, sys, time\n"
              "kids = []\n"
              "for _ in range(3):\n"
              "    pid = os.fork()\n"
              "    if pid == 0:\n"
              "        x = bytearray(200 << 20); time.sleep(2); os._exit(0)\n"
              "    kids.append(pid)\n"
              "x = bytearray(200 << 20)\n"
              "time.sleep(2)\n"
              "sys.exit(1 if any(os.waitpid(k, 0)[1] for k in kids) else 0)\n")
    with Sandbox(sandbox_root, TEST_LIMITS, limits_backend="cgroup") as sb:
        r = sb.run(["python3", "-c", script])
    assert r.exit_status in (1, 137) and r.killed_reason == "memory_limit", r


def _sandbox_cgroup_dirs(sb: Sandbox) -> list[Path]:
    return [d / name for d in detect_cgroups().dirs.values() for name in os.listdir(d) if name.endswith(sb.sandbox_id)]


def test_cgroup_is_removed_on_close_and_abandoned_ones_on_next_create(sandbox_root):
    support = detect_cgroups()
    if support.kind is None:
        pytest.skip(f"no delegated cgroup on this host: {support.reason}")
    sb = Sandbox(sandbox_root, TEST_LIMITS, limits_backend="cgroup")
    dirs = _sandbox_cgroup_dirs(sb)
    assert len(dirs) == len(support.dirs) and all(d.is_dir() for d in dirs)
    sb.run("true")
    sb.close()
    assert not any(d.exists() for d in dirs)
    # a crashed worker's leftovers: owner pid 999999999 does not exist
    leftovers = [d / "sb-999999999-1-deadbeefdeadbeef" for d in support.dirs.values()]
    for d in leftovers:
        d.mkdir()
    with Sandbox(sandbox_root, TEST_LIMITS, limits_backend="cgroup"):
        assert not any(d.exists() for d in leftovers)


def test_unknown_backend_and_missing_cgroup_are_refused(sandbox_root, tmp_path):
    with pytest.raises(ValueError, match="limits_backend"):
        Sandbox(sandbox_root, TEST_LIMITS, limits_backend="cgroups")
    with pytest.raises(SandboxUnavailable, match="cgroup_parent|does not offer"):
        Sandbox(sandbox_root, TEST_LIMITS, limits_backend="cgroup", cgroup_parent=str(tmp_path))


def test_cgroup_v1_limits_are_written(sandbox_root):
    support = detect_cgroups()
    if support.kind != "cgroup1":
        pytest.skip(f"host's sandbox cgroups are not v1 ({support.kind or support.reason})")
    limits = SandboxLimits(memory_bytes=300 << 20, max_processes=10, cpu_cores=0.5)
    with Sandbox(sandbox_root, limits, limits_backend="cgroup") as sb:
        dirs = _sandbox_cgroup_dirs(sb)
        mem = next(d for d in dirs if (d / "memory.limit_in_bytes").exists())
        pids = next(d for d in dirs if (d / "pids.max").exists())
        assert (mem / "memory.limit_in_bytes").read_text().strip() == str(300 << 20)
        assert (pids / "pids.max").read_text().strip() == "11"  # 10 + bwrap's pid 1
        cpu = [d for d in dirs if (d / "cpu.cfs_quota_us").exists()]
        if cpu:
            assert (cpu[0] / "cpu.cfs_quota_us").read_text().strip() == "50000"  # 0.5 x 100000 us


def test_command_runs_inside_its_cgroup(sandbox_root):
    support = detect_cgroups()
    if support.kind is None:
        pytest.skip(f"no delegated cgroup on this host: {support.reason}")
    with Sandbox(sandbox_root, TEST_LIMITS, limits_backend="cgroup") as sb:
        lines = sb.run("cat /proc/self/cgroup").stdout.splitlines()
    wanted = ("memory", "pids") if support.kind == "cgroup1" else ("",)
    for controller in wanted:
        line = next(ln for ln in lines if ln.split(":")[1].split(",").count(controller) or
                    (controller == "" and ln.startswith("0::")))
        assert line.endswith(sb.sandbox_id), line


def test_cgroup_v2_detection_explains_what_is_missing(tmp_path):
    # detection only: a directory that offers no controllers, then one that offers them but
    # does not enable them for children (the usual state of a non-delegated cgroup)
    bare = tmp_path / "bare"
    bare.mkdir()
    (bare / "cgroup.controllers").write_text("hugetlb\n")
    assert "does not offer memory,pids" in detect_cgroups(parent=str(bare)).reason
    offered = tmp_path / "offered"
    offered.mkdir()
    (offered / "cgroup.controllers").write_text("cpu memory pids\n")
    (offered / "cgroup.subtree_control").write_text("cpu\n")
    support = detect_cgroups(parent=str(offered))
    assert support.kind is None and "cgroup_parent" in support.reason
