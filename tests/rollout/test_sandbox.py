"""Hostile-code tests: each attack is contained, reported in the CommandResult, and we live on."""

from __future__ import annotations

import os
import socket
import threading
import time

import pytest

from rollout.bench_sandbox import measure_start
from rollout.sandbox import Sandbox, SandboxError
from rollout.sandbox.uids import _uid_pids as _uid_processes




def test_runs_commands_and_tracks_files(sandbox):
    sandbox.write_file("in.txt", "hello\n")
    r = sandbox.run("cat in.txt; mkdir out; echo x > out/a.txt; rm in.txt")
    assert r.exit_status == 0 and r.stdout == "hello\n" and r.killed_reason is None
    assert r.files_changed == {"in.txt": "deleted", "out": "added", "out/a.txt": "added"}
    assert sandbox.read_file("out/a.txt") == b"x\n"
    assert sandbox.run(["python3", "-c", "print(6*7)"]).stdout == "42\n"


def test_infinite_loop_is_stopped_by_wall_timeout(sandbox):
    t0 = time.monotonic()
    r = sandbox.run("while :; do :; done", timeout_s=1.5)
    assert r.timed_out and r.killed_reason == "timeout" and r.exit_status == -9
    assert time.monotonic() - t0 < 60  # a failure bound only (a hang); timed_out is what proves the kill
    assert _uid_processes(sandbox.uid) == []  # nothing left behind
    assert sandbox.run("echo alive").stdout == "alive\n"  # the sandbox is reusable


def test_cannot_write_outside_work_dir(sandbox, tmp_path):
    host_file = tmp_path / "host.txt"
    host_file.write_text("original")
    os.chmod(tmp_path, 0o777)
    r = sandbox.run(f"echo pwned > {host_file}; echo pwned > /etc/passwd; echo pwned > /usr/x; "
                    f"echo pwned > /x; echo pwned > ../escape; ln -s {host_file} link; echo done")
    assert r.stdout.strip() == "done"
    assert r.stderr.count("pwned") == 0 and "Read-only file system" in r.stderr or "No such file" in r.stderr
    assert host_file.read_text() == "original"
    assert "pwned" not in open("/etc/passwd").read()
    # the host side refuses to follow the symlink the sandbox planted
    with pytest.raises(SandboxError):
        sandbox.read_file("link")
    with pytest.raises(SandboxError):
        sandbox.write_file("link", "pwned")
    with pytest.raises(SandboxError):
        sandbox.write_file("../x", "pwned")
    assert host_file.read_text() == "original"


def test_cannot_reach_host_loopback(sandbox):
    server = socket.socket()
    server.bind(("127.0.0.1", 0))
    server.listen(1)
    port = server.getsockname()[1]
    accepted = []
    server.settimeout(3)

    def accept():
        try:
            accepted.append(server.accept())
        except OSError:
            pass

    t = threading.Thread(target=accept)
    t.start()
    probe = ("import socket\ns = socket.socket()\ns.settimeout(2)\n"
             f"print(s.connect_ex(('127.0.0.1', {port})))")
    r = sandbox.run(["python3", "-c", probe])
    t.join()
    server.close()
    assert r.exit_status == 0 and r.stdout.strip() != "0"  # refused or unreachable, never connected
    assert accepted == []
    # sanity: the host itself can reach it while listening
    with socket.create_server(("127.0.0.1", 0)) as srv:
        assert socket.create_connection(srv.getsockname(), timeout=2)


def test_huge_output_is_bounded(sandbox):
    r = sandbox.run("yes 0123456789", timeout_s=10)
    assert r.truncated and len(r.stdout.encode()) <= sandbox.limits.max_output_bytes
    assert r.killed_reason == "output_limit" and not r.timed_out
    r2 = sandbox.run("head -c 200000 /dev/zero | tr '\\0' a")
    assert r2.exit_status == 0 and r2.truncated and len(r2.stdout) == sandbox.limits.max_output_bytes


def test_snapshot_restore(sandbox):
    sandbox.write_file("a.txt", "v1")
    snap = sandbox.snapshot()
    sandbox.run("echo v2 > a.txt; mkdir -p d; echo new > d/b.txt")
    assert sandbox.read_file("a.txt") == b"v2\n"
    sandbox.restore(snap)
    assert sandbox.read_file("a.txt") == b"v1"
    assert "d/b.txt" not in sandbox.manifest()
    r = sandbox.run("echo v3 > a.txt && cat a.txt")  # restored files stay writable by the sandbox
    assert r.stdout == "v3\n"
    with pytest.raises(SandboxError):
        sandbox.restore("snap-9999")


def test_closed_sandbox_refuses_work(sandbox_root):
    sb = Sandbox(sandbox_root)
    sb.close()
    with pytest.raises(SandboxError):
        sb.run("true")
    assert not sb.dir.exists()


def test_measure_start_reports_percentiles():
    out = measure_start(5)
    assert 0 < out["sandbox_start_p50_ms"] <= out["sandbox_start_p95_ms"]


@pytest.mark.parametrize("setup, path", [
    ("mkdir 'solution.txt > out'", "solution.txt > out"),  # the target is a directory (a make bench eval episode)
    ("echo x > f", "f/inner.txt"),  # a parent is a file
    ("true", "d/" + "n" * 300),  # a name longer than the file system takes
    ("true", "a\0b"),  # a NUL byte in the path
])
def test_a_write_the_work_dir_cannot_take_is_a_sandbox_error(sandbox, setup, path):
    """A path the policy chose (WRITE <path>) that cannot be written is one clear SandboxError, never an OSError
    (the envs turn it into a failed step: "write failed: ..."); the sandbox goes on."""
    assert sandbox.run(setup).exit_status == 0
    with pytest.raises(SandboxError, match="cannot write"):
        sandbox.write_file(path, "x")
    with pytest.raises(SandboxError):
        sandbox.read_file(path)
    sandbox.write_file("ok.txt", "fine")
    assert sandbox.read_file("ok.txt") == b"fine"
