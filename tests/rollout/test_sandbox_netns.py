"""Each run's network namespace made ahead (rollout/sandbox/netns.py), and the cgroup made again on attach.

With ``prepared_netns`` (the default, worker as root) the namespace comes from a
pool thread and is entered by ``nsenter`` before bwrap; these tests check from
inside that the command sees what bwrap's own namespace gave it (a namespace of
its own per run, only ``lo``, up, no route out, nothing it may change), that
the worker lets go of each namespace after its run, and that a forked child
makes its own pool.
"""

from __future__ import annotations

import os
import shutil
import threading
import time

import pytest

from rollout.sandbox import Sandbox, detect_cgroups
from rollout.sandbox import netns as netns_mod
from rollout.sandbox.argv import HostTools
from rollout.sandbox.launch import launch_argv

from .conftest import TEST_LIMITS

pytestmark = pytest.mark.skipif(os.geteuid() != 0 or shutil.which("nsenter") is None,
                                reason="namespaces are made ahead only when the worker is root and has nsenter")

# What the command sees of its network: its namespace, the interfaces, loopback working, no route out,
# and whether it may set lo down (it must not).
PROBE = r"""
import errno, fcntl, json, os, socket, struct
out = {"ns": os.readlink("/proc/self/ns/net")}
out["ifaces"] = sorted(line.split(":")[0].strip() for line in open("/proc/net/dev").read().splitlines()[2:])
out["inet6"] = sorted(line.split()[-1] for line in open("/proc/net/if_inet6"))
for family, host in ((socket.AF_INET, "127.0.0.1"), (socket.AF_INET6, "::1")):
    server = socket.socket(family); server.bind((host, 0)); server.listen()
    client = socket.create_connection(server.getsockname()[:2], timeout=2)
    conn, _ = server.accept(); client.sendall(b"x"); assert conn.recv(1) == b"x"
try:
    socket.create_connection(("192.0.2.1", 80), timeout=2)
    out["out"] = "connected"
except OSError as err:
    out["out"] = errno.errorcode.get(err.errno, str(err.errno))
with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
    try:
        fcntl.ioctl(s, 0x8914, struct.pack("16sH14x", b"lo", 0))  # SIOCSIFFLAGS: lo down
        out["lo_down"] = "allowed"
    except OSError as err:
        out["lo_down"] = errno.errorcode[err.errno]
print(json.dumps(out))
"""


def _probe(sb: Sandbox) -> dict:
    import json

    r = sb.run(["python3", "-c", PROBE])
    assert r.exit_status == 0, r
    return json.loads(r.stdout)


def _worker_net_fds() -> set[str]:
    out = set()
    for fd in os.listdir("/proc/self/fd"):
        try:
            link = os.readlink(f"/proc/self/fd/{fd}")
        except OSError:
            continue
        if link.startswith("net:["):
            out.add(link)
    return out


def test_each_run_has_a_fresh_namespace_with_only_a_working_loopback(sandbox_root):
    worker_ns = os.readlink("/proc/self/ns/net")
    with Sandbox(sandbox_root, TEST_LIMITS) as sb:
        assert sb._netns_pool is not None, netns_mod.netns_unavailable_reason()
        first, second = _probe(sb), _probe(sb)
    with Sandbox(sandbox_root, TEST_LIMITS, prepared_netns=False) as sb:
        assert sb._netns_pool is None
        by_bwrap = _probe(sb)
    assert len({worker_ns, first["ns"], second["ns"], by_bwrap["ns"]}) == 4  # one new namespace per run
    for seen in (first, second):
        # the same view bwrap's own namespace gives: only lo (127.0.0.1 and ::1 answer), no route out, no say
        assert {k: v for k, v in seen.items() if k != "ns"} == {k: v for k, v in by_bwrap.items() if k != "ns"}
        assert seen["ifaces"] == ["lo"] and seen["out"] == "ENETUNREACH" and seen["lo_down"] == "EPERM"


def test_the_worker_lets_go_of_each_namespace_after_its_run(sandbox_root):
    with Sandbox(sandbox_root, TEST_LIMITS) as sb:
        seen = _probe(sb)["ns"]
        held = _worker_net_fds()
    assert seen not in held  # released at the end of run(): the kernel frees it with its last process
    # what the worker still holds: its own namespace (the pool thread's way home) and the ready ones
    assert len(held - {os.readlink("/proc/self/ns/net")}) <= netns_mod.netns_pool()._size


def test_every_thread_of_the_worker_stays_in_its_namespace(sandbox_root):
    worker_ns = os.readlink("/proc/self/ns/net")
    with Sandbox(sandbox_root, TEST_LIMITS) as sb:
        sb.run("true")
    pool = netns_mod.netns_pool()
    deadline = time.monotonic() + 10
    while len(pool._ready) < pool._size and time.monotonic() < deadline:  # the thread made the next ones
        time.sleep(0.01)
    assert len(pool._ready) == pool._size
    # only the pool thread ever leaves, and only inside _make; idle, it is back home like every other thread
    tasks = os.listdir("/proc/self/task")
    assert [t for t in tasks if os.readlink(f"/proc/self/task/{t}/ns/net") != worker_ns] == []
    assert any(t.name == "sandbox-netns-pool" and t.is_alive() for t in threading.enumerate())


def test_a_forked_child_makes_its_own_pool(sandbox_root):
    with Sandbox(sandbox_root, TEST_LIMITS) as sb:
        sb.run("true")
    parent_pool = netns_mod.netns_pool()
    assert parent_pool is not None
    read_end, write_end = os.pipe()
    pid = os.fork()
    if pid == 0:
        code = 1
        try:
            os.close(read_end)
            fresh = netns_mod._pool is None
            with Sandbox(sandbox_root, TEST_LIMITS) as child_sb:
                ok = child_sb.run("echo ok").stdout == "ok\n"
            os.write(write_end, b"1" if fresh and ok and netns_mod._pool is not parent_pool else b"0")
            code = 0
        finally:
            os._exit(code)
    os.close(write_end)
    answer = os.read(read_end, 1)
    os.close(read_end)
    _, status = os.waitpid(pid, 0)
    assert os.waitstatus_to_exitcode(status) == 0 and answer == b"1"
    assert netns_mod.netns_pool() is parent_pool  # the parent's pool goes on


@pytest.mark.parametrize("error", [OSError(1, "unshare(CLONE_NEWNET): Operation not permitted"),
                                   RuntimeError("a bug in the pool thread")])
def test_a_pool_that_cannot_start_falls_back_to_bwraps_namespace(sandbox_root, monkeypatch, error):
    def broken(self, home):
        raise error

    monkeypatch.setattr(netns_mod.NetnsPool, "_make", broken)
    monkeypatch.setattr(netns_mod, "_pool", None)
    monkeypatch.setattr(netns_mod, "_pool_error", None)
    with Sandbox(sandbox_root, TEST_LIMITS) as sb:  # no hang, no error: bwrap makes the namespace
        assert sb._netns_pool is None
        assert str(error) in netns_mod.netns_unavailable_reason()
        r = sb.run("cat /proc/net/dev")
        assert r.exit_status == 0 and "lo:" in r.stdout, r


def test_launch_argv_refuses_a_namespace_it_cannot_enter():
    tools = HostTools("/usr/bin/bwrap", "/usr/bin/prlimit", "/usr/sbin/chroot", None)
    with pytest.raises(ValueError, match="nsenter"):
        launch_argv(tools, drop_to=(7, 7), prlimit_opts=[], memfd=3, cmd=["true"], netns="/proc/1/fd/3")
    with pytest.raises(ValueError, match="drop_to"):
        launch_argv(tools._replace(nsenter="/usr/bin/nsenter"), drop_to=None, prlimit_opts=[], memfd=3,
                    cmd=["true"], netns="/proc/1/fd/3")


def test_a_removed_cgroup_is_made_again_before_the_command_runs(sandbox_root):
    support = detect_cgroups()
    if support.kind is None:
        pytest.skip(f"no delegated cgroup on this host: {support.reason}")
    with Sandbox(sandbox_root, TEST_LIMITS, limits_backend="cgroup") as sb:
        sb._cgroup.close()  # something removed it (no existence check runs before each command any more)
        dirs = list(sb._cgroup._dirs.values())
        assert not any(d.exists() for d in dirs)
        r = sb.run("cat /proc/self/cgroup")
        assert r.exit_status == 0 and r.stdout.count(sb.sandbox_id) >= 1, r
        pids_dir = sb._cgroup._dirs.get("pids", sb._cgroup._dirs.get(""))
        assert (pids_dir / "pids.max").read_text().strip() == str(TEST_LIMITS.max_processes + 1)
