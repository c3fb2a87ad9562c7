"""Shared fixtures for the rollout tests: a real bwrap sandbox (skipped only if bwrap is absent)."""

from __future__ import annotations

import os
import shutil
import tempfile

import pytest

from rollout.sandbox import Sandbox, SandboxLimits, detect_cgroups

#: The limits of the ``sandbox`` and ``limited`` fixtures (small, so tests hit them fast).
TEST_LIMITS = SandboxLimits(cpu_time_s=5, wall_time_s=10, memory_bytes=512 << 20, max_processes=32,
                            max_file_bytes=8 << 20, max_output_bytes=64 << 10, output_kill_bytes=1 << 20)


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
    with Sandbox(sandbox_root, TEST_LIMITS) as sb:
        yield sb


@pytest.fixture(params=["cgroup", "rlimit"])
def limits_backend(request):
    """Each limits mechanism in turn; the cgroup one is skipped (with the reason) where the host lacks it."""
    if request.param == "cgroup":
        support = detect_cgroups()
        if support.kind is None:
            pytest.skip(f"no delegated cgroup on this host: {support.reason}")
    return request.param


@pytest.fixture
def limited(sandbox_root, limits_backend):
    """A sandbox with :data:`TEST_LIMITS` enforced by the ``limits_backend`` under test."""
    with Sandbox(sandbox_root, TEST_LIMITS, limits_backend=limits_backend) as sb:
        yield sb
