"""Isolated, reproducible execution of model-produced commands and code.

Each :class:`Sandbox` owns a work directory on the host, bind-mounted at
``/work`` inside a bubblewrap container; every :meth:`Sandbox.run` starts a
fresh container around one command. The package is split by mechanism:

=====================  =====================================================
module                 job
=====================  =====================================================
``core``               :class:`Sandbox`: wires the pieces below together
``argv``               bwrap arguments, environment, binds (what is visible)
``launch``             the spawn: ``vfork``-able, ``nsenter``/``chroot`` drops the uid
``netns``              each run's network namespace, made ahead (worker as root)
``uids``               private uid per sandbox, subreaper, reaping
``cgroups``            per-sandbox cgroup v2 / v1 limits and event counters
``rlimits``            per-process rlimits (and the no-cgroup fallback)
``pump``               stdin/stdout/stderr within bounds, wall clock, ``wait4``
``verdict``            ``killed_reason`` from kernel facts only
``files``              host-side file I/O, manifests, snapshots
``limits``/``results`` :class:`SandboxLimits`, :class:`CommandResult`
=====================  =====================================================

The security model, and the test behind each claim, is in ``docs/security.md``.
"""

from rollout.sandbox.argv import WORK_MOUNT, sandbox_python
from rollout.sandbox.cgroups import detect_cgroups
from rollout.sandbox.core import LIMITS_BACKENDS, Sandbox
from rollout.sandbox.errors import SandboxError, SandboxUnavailable
from rollout.sandbox.files import SnapshotId
from rollout.sandbox.limits import SandboxLimits
from rollout.sandbox.results import CommandResult

__all__ = [
    "SandboxError",
    "SandboxUnavailable",
    "SandboxLimits",
    "CommandResult",
    "SnapshotId",
    "Sandbox",
    "sandbox_python",
    "detect_cgroups",
    "LIMITS_BACKENDS",
    "WORK_MOUNT",
]
