"""The two exceptions of the sandbox package: the sandbox broke, or the host cannot run one."""

from __future__ import annotations

__all__ = ["SandboxError", "SandboxUnavailable"]


class SandboxError(RuntimeError):
    """The sandbox itself failed (not the command inside it): an environment error."""


class SandboxUnavailable(SandboxError):
    """The host cannot run sandboxes (bubblewrap missing, user namespaces or the asked-for limits backend absent)."""
