"""The pool of pre-made sandbox slots: each slot goes to one sandbox only, and nothing is left behind.

A slot (directories, uid lease, cgroup) is made ahead by a background thread
and destroyed by its sandbox's close(); these tests check that a pooled
sandbox starts from nothing of an earlier one's (files, uid, processes,
cgroup counters), that unused slots are destroyed when the pool closes or the
process exits, and that a forked child does not hand out its parent's slots.
"""

from __future__ import annotations

import fcntl
import os
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import pytest

from rollout.sandbox import Sandbox, SandboxLimits, detect_cgroups
from rollout.sandbox.slots import SlotPool, close_pools
from rollout.sandbox.uids import _uid_pids

from .conftest import TEST_LIMITS

LEAVE_TRACES = ("echo secret > /work/w.txt; echo secret > /tmp/t.txt; mkdir -p /work/d; "
                "(sleep 300 &) ; cat /proc/self/cgroup")


def _wait_ready(pool: SlotPool, n: int) -> None:
    deadline = time.monotonic() + 20
    while len(pool._ready) < n and time.monotonic() < deadline:
        time.sleep(0.01)
    assert len(pool._ready) >= n


def _uid_lock_is_free(uid: int) -> bool:
    fd = os.open(Path(tempfile.gettempdir()) / "trajpipe-sandbox-uids" / f"{uid}.lock", os.O_RDWR)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
        return True
    except BlockingIOError:
        return False
    finally:
        os.close(fd)


def test_pooled_sandboxes_start_from_nothing_of_an_earlier_one(sandbox_root, limits_backend):
    seen_ids, seen_dirs = set(), set()
    previous = None
    for _ in range(4):
        with Sandbox(sandbox_root, TEST_LIMITS, limits_backend=limits_backend, pool_size=2) as sb:
            assert sb.sandbox_id not in seen_ids and sb.dir not in seen_dirs
            assert sb.manifest() == {}
            r = sb.run("ls -A /work /tmp; id -u")
            assert r.stdout.split() == ["/tmp:", "/work:", str(sb.uid)], r  # both empty
            if previous is not None:
                assert not previous["dir"].exists()
                assert _uid_pids(previous["uid"]) == [] or os.geteuid() != 0
                if os.geteuid() == 0:  # leased while the previous sandbox still held its uid
                    assert sb.uid != previous["uid"]
            r = sb.run(LEAVE_TRACES)
            assert r.exit_status == 0 and sb.read_file("w.txt") == b"secret\n"
            if sb.limits_backend != "rlimit":
                assert sb.sandbox_id in r.stdout  # its own, fresh cgroup
            seen_ids.add(sb.sandbox_id)
            seen_dirs.add(sb.dir)
            previous = {"dir": sb.dir, "uid": sb.uid}
    assert not previous["dir"].exists()


def test_closing_a_pool_destroys_its_unused_slots(sandbox_root):
    support = detect_cgroups()
    support = support if support.kind is not None else None
    pool = SlotPool(Path(sandbox_root), limits=SandboxLimits(max_processes=17), support=support, size=3)
    taken = pool.take()
    _wait_ready(pool, 3)
    unused = list(pool._ready)
    assert all(s.work.is_dir() and s.sandbox_id != taken.sandbox_id for s in unused)
    cgroup_dirs = [d / n for d in (support.dirs.values() if support else ()) for n in os.listdir(d)
                   if any(n.endswith(s.sandbox_id) for s in unused)]
    assert len(cgroup_dirs) == (3 * len(support.dirs) if support else 0)
    pool.close()
    assert not any(s.dir.exists() for s in unused)
    assert not any(d.exists() for d in cgroup_dirs)
    if os.geteuid() == 0:
        assert all(_uid_lock_is_free(s.lease.uid) for s in unused)
    with pytest.raises(Exception, match="closed"):
        pool.take()
    taken.destroy()
    assert not taken.dir.exists()


def test_a_worker_that_exits_leaves_no_slot_behind(sandbox_root):
    root = Path(tempfile.mkdtemp(prefix="exiting-worker-", dir=sandbox_root))
    os.chmod(root, 0o711)
    script = ("import sys\nfrom rollout.sandbox import Sandbox\n"
              f"sb = Sandbox.create({str(root)!r}, pool_size=3)\n"
              "print(sb.run('echo ok').stdout.strip(), sb.sandbox_id, flush=True)\n"
              "sb.close()\n")
    out = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True, timeout=120,
                         env={**os.environ, "PYTHONPATH": os.getcwd()})
    assert out.returncode == 0, out.stderr
    assert out.stdout.split()[0] == "ok"
    assert list(root.iterdir()) == []  # the slots it had made ahead went at exit too


def test_a_forked_child_does_not_hand_out_its_parents_slots(sandbox_root):
    limits = SandboxLimits(max_processes=19)
    with Sandbox(sandbox_root, limits, pool_size=2) as first:
        first.run("true")
    from rollout.sandbox import slots
    pool = next(p for k, p in slots._pools.items() if k[1] == limits)
    _wait_ready(pool, 2)
    parents = {s.sandbox_id for s in pool._ready}
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:  # child: take a sandbox of the same kind, report its id
        code = 1
        try:
            os.close(read_end)
            with Sandbox(sandbox_root, limits, pool_size=2) as sb:
                os.write(write_end, sb.sandbox_id.encode())
            close_pools()
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    child_id = os.read(read_end, 64).decode()
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0
    assert child_id and child_id not in parents
    assert all(s.dir.is_dir() for s in pool._ready)  # the parent's slots are untouched
    with Sandbox(sandbox_root, limits, pool_size=2) as sb:
        assert sb.sandbox_id in parents and sb.run("echo ok").stdout == "ok\n"
