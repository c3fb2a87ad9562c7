"""Nothing of the worker is visible inside: environment, command lines, host paths, file descriptors.

The sandboxed probe reads every channel a program in the sandbox has to the
processes it can see (``/proc/<pid>/environ``, ``cmdline``, ``fd/*`` of every
visible pid and task) and prints what it read; the test then checks that the
worker's secret, its working directory and the sandbox's host paths appear
nowhere, and that the probe really could read pid 1 and itself.
"""

from __future__ import annotations

import json
import os

import pytest

from rollout.sandbox.argv import SANDBOX_ENV

SECRET = "s3cr3t-kafka-sasl-password-7f3a"

PROBE = r'''
import json, os
seen = {"pids": [], "environ": {}, "cmdline": {}, "fds": {}, "fd_data": {}}
for pid in sorted(p for p in os.listdir("/proc") if p.isdigit()):
    seen["pids"].append(int(pid))
    tasks = [f"/proc/{pid}"] + [f"/proc/{pid}/task/{t}" for t in os.listdir(f"/proc/{pid}/task")]
    for base in tasks:
        for name in ("environ", "cmdline"):
            try:
                with open(f"{base}/{name}", "rb") as fh:
                    seen[name][base] = fh.read().decode("utf-8", "replace")
            except OSError as err:
                seen[name][base] = f"<{err.errno}>"
    try:
        fds = os.listdir(f"/proc/{pid}/fd")
    except OSError as err:
        seen["fds"][pid] = f"<{err.errno}>"
        continue
    seen["fds"][pid] = {}
    for fd in fds:
        path = f"/proc/{pid}/fd/{fd}"
        try:
            seen["fds"][pid][fd] = os.readlink(path)
        except OSError as err:
            seen["fds"][pid][fd] = f"<{err.errno}>"
        try:  # reopen it and read what is there, without blocking on pipes
            rfd = os.open(path, os.O_RDONLY | os.O_NONBLOCK)
            try:
                seen["fd_data"][path] = os.read(rfd, 4096).decode("utf-8", "replace")
            finally:
                os.close(rfd)
        except OSError as err:
            seen["fd_data"][path] = f"<{err.errno}>"
print(json.dumps(seen))
'''


@pytest.fixture
def leaky_worker(monkeypatch, tmp_path):
    """The worker holds a secret in its environment and in an inheritable open file."""
    monkeypatch.setenv("TRAJPIPE_TEST_SASL_PASSWORD", SECRET)
    secret_file = tmp_path / "credentials"
    secret_file.write_text(SECRET)
    fd = os.open(secret_file, os.O_RDONLY)
    os.set_inheritable(fd, True)
    read_end, write_end = os.pipe()
    os.set_inheritable(read_end, True)
    os.write(write_end, SECRET.encode())
    yield {"file": str(secret_file), "fds": (fd, read_end)}
    for f in (fd, read_end, write_end):
        os.close(f)


def test_worker_secrets_are_not_readable_inside(limited, leaky_worker):
    r = limited.run(["python3", "-c", PROBE])
    assert r.ok, r
    seen = json.loads(r.stdout)
    # the probe really read pid 1 (bwrap) and itself: the check below is not vacuous
    assert 1 in seen["pids"] and len(seen["pids"]) >= 2
    assert "bwrap" in seen["cmdline"]["/proc/1"] and seen["environ"]["/proc/1"].startswith("PATH=")
    everything = r.stdout + r.stderr
    assert SECRET not in everything
    assert leaky_worker["file"] not in everything
    assert os.getcwd() not in everything  # the worker's working directory
    assert str(limited.dir) not in everything  # the sandbox's own host path


def test_every_visible_environment_is_the_sandbox_environment(limited, leaky_worker):
    r = limited.run(["python3", "-c", PROBE])
    seen = json.loads(r.stdout)
    expected = {f"{k}={v}" for k, v in SANDBOX_ENV.items()}
    for where, raw in seen["environ"].items():
        entries = set(filter(None, raw.split("\0")))
        assert entries - {"PWD=/work"} <= expected, (where, entries - expected)


def test_command_lines_hold_no_host_path(limited):
    r = limited.run(["python3", "-c", PROBE])
    seen = json.loads(r.stdout)
    for where, raw in seen["cmdline"].items():
        args = raw.split("\0")
        assert str(limited.dir) not in raw and str(limited.root) not in raw, (where, args)
        assert "--bind" not in args and "--ro-bind" not in args, (where, args)  # options went through a memfd


def test_no_worker_file_descriptor_is_inherited(limited, leaky_worker):
    r = limited.run(["python3", "-c", PROBE])
    seen = json.loads(r.stdout)
    me = max(seen["pids"])  # the probe itself (pid 1 is bwrap, the probe the last one started)
    own = seen["fds"][str(me)]
    # stdin (/dev/null), stdout and stderr pipes, and the descriptor listdir() had open on /proc/<me>/fd
    assert sorted(own, key=int)[:3] == ["0", "1", "2"] and len(own) <= 4, own
    assert own["0"] == "/dev/null" and own["1"].startswith("pipe:") and own["2"].startswith("pipe:")
    pid1 = seen["fds"]["1"]
    # bwrap's pid 1 keeps stdio and its own eventfd to the outer bwrap; nothing of the worker
    extra = {k: v for k, v in pid1.items() if k not in ("0", "1", "2")}
    assert all(v == "anon_inode:[eventfd]" for v in extra.values()), pid1
    for fd in leaky_worker["fds"]:
        link = os.readlink(f"/proc/self/fd/{fd}")
        assert all(link not in v.values() for v in seen["fds"].values() if isinstance(v, dict))
