"""What a sandboxed command may use: :class:`SandboxLimits`.

How each limit is enforced depends on the limits backend (see
:mod:`rollout.sandbox.cgroups` and :mod:`rollout.sandbox.rlimits`); the
attribute docs name both mechanisms.
"""

from __future__ import annotations

from dataclasses import dataclass

__all__ = ["SandboxLimits"]


@dataclass(frozen=True)
class SandboxLimits:
    """Resource limits applied to every command run in a sandbox.

    Attributes:
        cpu_time_s: CPU seconds per process (``RLIMIT_CPU``, both backends);
            SIGXCPU at the limit, SIGKILL one second later.
        wall_time_s: default wall-clock timeout of :meth:`Sandbox.run`, seconds.
        memory_bytes: memory of the whole sandbox, bytes. cgroup backends:
            ``memory.max`` (v2) / ``memory.limit_in_bytes`` (v1) with swap off,
            counting every process together, enforced by the kernel's OOM killer.
            rlimit fallback: ``RLIMIT_DATA`` per process (private writable
            mappings; untouched ``PROT_NONE`` reservations are free).
        max_processes: processes and threads of the command tree. cgroup
            backends: ``pids.max`` (plus one for bubblewrap's pid 1). rlimit
            fallback: ``RLIMIT_NPROC`` of the sandbox's private uid.
        cpu_cores: CPU bandwidth of the whole sandbox in cores (cgroup
            ``cpu.max`` / ``cpu.cfs_quota_us``); not enforced by the rlimit fallback.
        max_file_bytes: largest file a process may write (``RLIMIT_FSIZE``), bytes.
        max_open_files: open file descriptors per process (``RLIMIT_NOFILE``).
        max_output_bytes: stdout and stderr are each kept up to this many bytes.
        output_kill_bytes: a command whose combined output passes this is killed.
        manifest_hash_bytes: files up to this size are hashed in manifests.
        max_manifest_files: manifests stop (and mark themselves partial) past this.
    """

    cpu_time_s: int = 10
    wall_time_s: float = 30.0
    memory_bytes: int = 1 << 30
    max_processes: int = 64
    cpu_cores: float = 1.0
    max_file_bytes: int = 64 << 20
    max_open_files: int = 256
    max_output_bytes: int = 64 << 10
    output_kill_bytes: int = 8 << 20
    manifest_hash_bytes: int = 64 << 10
    max_manifest_files: int = 20_000

    def __post_init__(self) -> None:
        for name in ("cpu_time_s", "memory_bytes", "max_processes", "max_file_bytes",
                     "max_open_files", "max_output_bytes", "output_kill_bytes"):
            if getattr(self, name) <= 0:
                raise ValueError(f"SandboxLimits.`{name}` must be > 0, got {getattr(self, name)}")
        if self.wall_time_s <= 0:
            raise ValueError(f"SandboxLimits.`wall_time_s` must be > 0, got {self.wall_time_s}")
        if self.cpu_cores <= 0:
            raise ValueError(f"SandboxLimits.`cpu_cores` must be > 0, got {self.cpu_cores}")
