"""What one sandboxed command did: :class:`CommandResult`."""

from __future__ import annotations

from dataclasses import dataclass, field

__all__ = ["CommandResult"]


@dataclass(frozen=True)
class CommandResult:
    """What one sandboxed command did.

    Attributes:
        exit_status: the command's exit status; ``128 + N`` when it died of
            signal N inside the sandbox; ``-9`` when the sandbox killed it
            (timeout or output limit).
        stdout: captured standard output (UTF-8, undecodable bytes replaced), bounded.
        stderr: captured standard error, bounded.
        truncated: True if stdout or stderr was cut at ``max_output_bytes``.
        timed_out: True if the wall-clock timeout killed it.
        killed_reason: why it was stopped, if a limit was hit: ``timeout``,
            ``output_limit``, ``cpu_limit``, ``memory_limit``, ``process_limit``,
            ``file_size_limit`` or ``signal:<NAME>``. Decided from kernel facts
            only (our own timer, cgroup event counters, resource usage from
            ``wait4``), never from the command's output; the rules are in
            :func:`rollout.sandbox.verdict.judge`.
        duration_ms: wall time from spawn to exit, milliseconds.
        files_changed: work-dir relative path -> ``added``/``modified``/``deleted``.
    """

    exit_status: int
    stdout: str
    stderr: str
    truncated: bool = False
    timed_out: bool = False
    killed_reason: str | None = None
    duration_ms: float = 0.0
    files_changed: dict[str, str] = field(default_factory=dict)

    @property
    def ok(self) -> bool:
        """True if the command exited 0 and was not stopped."""
        return self.exit_status == 0 and self.killed_reason is None

    def to_dict(self) -> dict:
        """Plain JSON-serialisable form (for recording in a Step event)."""
        return {
            "exit_status": self.exit_status,
            "stdout": self.stdout,
            "stderr": self.stderr,
            "truncated": self.truncated,
            "timed_out": self.timed_out,
            "killed_reason": self.killed_reason,
            "duration_ms": round(self.duration_ms, 3),
            "files_changed": dict(self.files_changed),
        }
