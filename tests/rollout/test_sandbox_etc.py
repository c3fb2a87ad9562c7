"""The sandbox's /etc: exactly the host's ETC_FILES, read-only, current on every run (one bound copy)."""

from __future__ import annotations

import hashlib
import json
import os
import time
from pathlib import Path

import pytest

from rollout.sandbox import Sandbox
from rollout.sandbox import etc as etc_mod
from rollout.sandbox.etc import ETC_FILES

from .conftest import TEST_LIMITS

# prints, for every entry of /etc, its kind and content digest (files) or its sorted entries with link targets (dirs)
DESCRIBE = r'''
import hashlib, json, os
out = {}
for name in sorted(os.listdir("/etc")):
    path = "/etc/" + name
    if os.path.isdir(path):
        out[name] = sorted((e, os.readlink(os.path.join(path, e)) if os.path.islink(os.path.join(path, e)) else "")
                           for e in os.listdir(path))
    else:
        out[name] = hashlib.sha256(open(path, "rb").read()).hexdigest()
print(json.dumps(out))
'''


def _host_view(paths) -> dict:
    out = {}
    for path in paths:
        if not os.path.exists(path):
            continue
        name = os.path.basename(path)
        if os.path.isdir(path):
            out[name] = sorted([e, os.readlink(os.path.join(path, e)) if os.path.islink(os.path.join(path, e)) else ""]
                               for e in os.listdir(path))
        else:
            out[name] = hashlib.sha256(Path(path).read_bytes()).hexdigest()
    return out


def test_etc_inside_is_exactly_the_hosts_files_read_only(sandbox):
    r = sandbox.run(["python3", "-c", DESCRIBE])
    assert r.exit_status == 0, r
    assert json.loads(r.stdout) == json.loads(json.dumps(_host_view(ETC_FILES)))
    w = sandbox.run("echo x > /etc/passwd; echo x > /etc/new; mkdir /etc/d; echo done")
    assert w.stdout == "done\n" and w.stderr.count("Read-only file system") == 3, w


def test_a_host_file_that_changes_is_seen_by_the_next_run(sandbox, monkeypatch):
    extra = Path(sandbox.root) / f"trajpipe-test-{os.getpid()}.conf"
    extra.write_text("v1\n")
    os.chmod(extra, 0o644)
    monkeypatch.setattr(etc_mod, "ETC_FILES", ETC_FILES + (str(extra),))
    try:
        assert sandbox.run(f"cat /etc/{extra.name}").stdout == "v1\n"
        time.sleep(0.01)
        extra.write_text("v2, longer\n")
        assert sandbox.run(f"cat /etc/{extra.name}").stdout == "v2, longer\n"
    finally:
        extra.unlink()
    assert sandbox.run(f"cat /etc/{extra.name}").exit_status != 0  # gone on the host, gone inside


def test_a_bind_inside_etc_falls_back_to_binding_file_by_file(sandbox_root):
    inside = next((p for p in ("/etc/ssl", "/etc/apt", "/etc/default") if os.path.isdir(p)), None)
    if inside is None:
        pytest.skip("no directory under /etc to bind")
    with Sandbox(sandbox_root, TEST_LIMITS, extra_ro_binds=[inside]) as sb:
        r = sb.run(f"ls {inside} >/dev/null && head -c 4 /etc/passwd && ls /etc | wc -l")
    assert r.exit_status == 0, r
    assert r.stdout.startswith(Path("/etc/passwd").read_text()[:4])
    assert int(r.stdout[4:].strip()) == sum(os.path.exists(p) for p in ETC_FILES) + 1
