"""How a run is started: the identity and rlimits the command gets, a spawn that can vfork, the cgroup warm-up.

The spawn no longer uses ``Popen(user=, group=, extra_groups=)`` (which makes
CPython fork the worker) but ``chroot --userspec``; these tests check, from inside the
sandbox, that the command still holds exactly the private uid/gid (real,
effective, saved, filesystem), no supplementary group and no capability, and
that every rlimit is in force, under each limits backend.
"""

from __future__ import annotations

import os
import subprocess
import threading
import time

import pytest

from rollout.sandbox import Sandbox, detect_cgroups
from rollout.sandbox import launch
from rollout.sandbox.cgroups import warm_attach

from .conftest import TEST_LIMITS

STATUS = "grep -E '^(Uid|Gid|Groups|CapInh|CapPrm|CapEff|CapAmb|NoNewPrivs):' /proc/self/status"


def _fields(text: str) -> dict[str, list[str]]:
    return {k: v.split() for k, _, v in (line.partition(":") for line in text.splitlines())}


def test_command_has_only_the_sandbox_identity(limited):
    r = limited.run(STATUS)
    assert r.exit_status == 0, r
    status = _fields(r.stdout)
    if os.geteuid() == 0:  # private uid: real, effective, saved and fs ids all dropped
        assert status["Uid"] == [str(limited.uid)] * 4 and status["Gid"] == [str(limited.gid)] * 4
        assert status["Groups"] == []
    else:
        assert status["Uid"] == [str(os.getuid())] * 4
    for caps in ("CapInh", "CapPrm", "CapEff", "CapAmb"):
        assert int(status[caps][0], 16) == 0, (caps, status)
    assert status["NoNewPrivs"] == ["1"]


def test_rlimits_are_in_force_inside(limited):
    lines = limited.run("cat /proc/self/limits").stdout.splitlines()
    soft_hard = {ln[:26].strip(): ln[26:].split()[:2] for ln in lines[1:]}
    assert soft_hard["Max cpu time"] == [str(TEST_LIMITS.cpu_time_s), str(TEST_LIMITS.cpu_time_s + 1)]
    assert soft_hard["Max file size"] == [str(TEST_LIMITS.max_file_bytes)] * 2
    assert soft_hard["Max open files"] == [str(TEST_LIMITS.max_open_files)] * 2
    assert soft_hard["Max core file size"] == ["0", "0"]
    if limited.limits_backend == "rlimit":
        assert soft_hard["Max data size"] == [str(TEST_LIMITS.memory_bytes)] * 2
        if os.geteuid() == 0:
            assert soft_hard["Max processes"] == [str(TEST_LIMITS.max_processes)] * 2


def test_spawn_leaves_cpython_free_to_vfork(sandbox, monkeypatch):
    # CPython forks (copying the worker's page tables) when any of these is given; vfork otherwise
    seen = []
    real_popen = subprocess.Popen

    def spy(*args, **kwargs):
        seen.append(kwargs)
        return real_popen(*args, **kwargs)

    monkeypatch.setattr(launch.subprocess, "Popen", spy)
    assert sandbox.run("true").exit_status == 0
    assert len(seen) == 1
    forcing = {"preexec_fn", "user", "group", "extra_groups"}
    assert not forcing & {k for k, v in seen[0].items() if v is not None}, seen[0]
    assert seen[0]["close_fds"] is True and seen[0]["start_new_session"] is True
    assert getattr(subprocess, "_USE_VFORK", True)


def test_cgroup_warm_up_moves_nothing(sandbox_root):
    support = detect_cgroups()
    if support.kind is None or support.own_procs is None:
        pytest.skip(f"no delegated cgroup on this host: {support.reason}")
    before = open("/proc/self/cgroup").read()
    procs_before = support.own_procs.read_text().split()
    warm_attach(support)
    assert any(t.name == "sandbox-cgroup-warm" for t in threading.enumerate())
    time.sleep(0.5)  # the no-op migration waits one RCU grace period (milliseconds)
    assert open("/proc/self/cgroup").read() == before
    assert str(os.getpid()) in procs_before and str(os.getpid()) in support.own_procs.read_text().split()
    with Sandbox(sandbox_root, TEST_LIMITS, limits_backend="cgroup") as sb:  # and attaching still works
        assert sb.run("cat /proc/self/cgroup").stdout.count(sb.sandbox_id) >= 1
