"""Shared fixtures for the rollout tests: a real bwrap sandbox (skipped only if bwrap is absent)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from rollout.sandbox import Sandbox, SandboxLimits


@pytest.fixture(scope="session")
def sandbox_root():
    if shutil.which("bwrap") is None:
        pytest.skip("bubblewrap is not installed (apt-get install -y bubblewrap)")
    root = tempfile.mkdtemp(prefix="trajpipe-sbtest-")
    os.chmod(root, 0o711)
    yield root
    shutil.rmtree(root, ignore_errors=True)


@pytest.fixture
def sandbox(sandbox_root):
    limits = SandboxLimits(cpu_time_s=5, wall_time_s=10, memory_bytes=512 << 20, max_processes=32,
                           max_file_bytes=8 << 20, max_output_bytes=64 << 10, output_kill_bytes=1 << 20)
    with Sandbox(sandbox_root, limits) as sb:
        yield sb
