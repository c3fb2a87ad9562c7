"""The process pump: feed stdin, drain stdout/stderr within bounds, enforce the wall clock, reap bwrap.

bwrap's exit is watched through a pidfd and collected with ``wait4``, so
the caller gets the kernel's wait status and resource usage of bwrap's
outer process (not just a return code).
"""

from __future__ import annotations

import os
import resource
import selectors
import signal
import subprocess
import time
from dataclasses import dataclass

__all__ = ["PumpResult", "pump", "kill_group", "read_status_until", "read_available"]

#: After a kill, how long to keep draining what the dying processes wrote.
_DRAIN_AFTER_KILL_S = 5.0


@dataclass(frozen=True)
class PumpResult:
    """What the pump saw.

    Attributes:
        stdout: captured standard output (decoded, bounded).
        stderr: captured standard error (decoded, bounded).
        truncated: either stream was cut at the cap.
        stopped_by_us: ``timeout`` or ``output_limit`` when the pump killed bwrap.
        returncode: bwrap's exit code (negative signal number if it was killed).
        usage: ``wait4`` resource usage of bwrap's outer process.
    """

    stdout: str
    stderr: str
    truncated: bool
    stopped_by_us: str | None
    returncode: int
    usage: resource.struct_rusage | None


def kill_group(proc: subprocess.Popen) -> None:
    """SIGKILL bwrap's process group; its pid 1 dies with it (``--die-with-parent``) and takes the namespace."""
    try:
        os.killpg(proc.pid, signal.SIGKILL)
    except ProcessLookupError:
        pass


def pump(
    proc: subprocess.Popen,
    *,
    stdin_data: bytes | None,
    deadline: float,
    max_output_bytes: int,
    output_kill_bytes: int,
) -> PumpResult:
    """Run ``proc`` (bwrap) to completion under the wall-clock and output limits.

    Args:
        proc: bwrap, started with stdout and stderr pipes (stdin a pipe if ``stdin_data``).
        stdin_data: bytes for the command's stdin (the first MiB is sent), or None.
        deadline: ``time.monotonic()`` value at which the whole sandbox is killed.
        max_output_bytes: each stream is kept up to this many bytes.
        output_kill_bytes: bwrap is killed once both streams together pass this.

    Returns:
        The :class:`PumpResult`; ``proc.returncode`` is set as well.
    """
    bufs = {proc.stdout: bytearray(), proc.stderr: bytearray()}
    total = 0
    truncated = False
    stopped: str | None = None
    usage = None
    pidfd = os.pidfd_open(proc.pid)
    sel = selectors.DefaultSelector()
    sel.register(proc.stdout, selectors.EVENT_READ)
    sel.register(proc.stderr, selectors.EVENT_READ)
    sel.register(pidfd, selectors.EVENT_READ)
    if stdin_data:
        try:
            proc.stdin.write(stdin_data[: 1 << 20])
        except BrokenPipeError:
            pass
        finally:
            try:
                proc.stdin.close()
            except BrokenPipeError:
                pass
    try:
        while len(sel.get_map()) > 0:
            remaining = deadline - time.monotonic()
            if remaining <= 0:
                if stopped is None:
                    stopped = "timeout"
                    kill_group(proc)
                    deadline = time.monotonic() + _DRAIN_AFTER_KILL_S
                    continue
                break  # still open 5 s after the kill: abandon the streams
            for key, _ in sel.select(timeout=min(remaining, 0.5)):
                if key.fileobj == pidfd:
                    _, status, usage = os.wait4(proc.pid, 0)
                    proc.returncode = os.waitstatus_to_exitcode(status)
                    sel.unregister(pidfd)
                    continue
                chunk = os.read(key.fd, 65536)
                if not chunk:
                    sel.unregister(key.fileobj)
                    continue
                total += len(chunk)
                buf = bufs[key.fileobj]
                room = max_output_bytes - len(buf)
                if room > 0:
                    buf += chunk[:room]
                if len(chunk) > max(room, 0):
                    truncated = True
                if total > output_kill_bytes and stopped is None:
                    stopped = "output_limit"
                    kill_group(proc)
        if proc.returncode is None:
            kill_group(proc)
            _, status, usage = os.wait4(proc.pid, 0)
            proc.returncode = os.waitstatus_to_exitcode(status)
            stopped = stopped or "timeout"
    finally:
        sel.close()
        os.close(pidfd)
        proc.stdout.close()
        proc.stderr.close()
    decode = lambda b: bytes(b).decode("utf-8", errors="replace")  # noqa: E731
    return PumpResult(decode(bufs[proc.stdout]), decode(bufs[proc.stderr]), truncated, stopped,
                      proc.returncode, usage)


def read_status_until(fd: int, marker: bytes, *, deadline: float) -> bytes:
    """Read bwrap's JSON status pipe until ``marker`` and a newline arrived, EOF, or the deadline.

    Used to learn ``child-pid`` (bwrap's pid 1, blocked on ``--block-fd``) before the command starts.
    """
    data = bytearray()
    sel = selectors.DefaultSelector()
    sel.register(fd, selectors.EVENT_READ)
    try:
        while True:
            idx = data.find(marker)
            if idx >= 0 and data.find(b"\n", idx) >= 0:
                return bytes(data)
            remaining = deadline - time.monotonic()
            if remaining <= 0 or not sel.select(timeout=remaining):
                return bytes(data)
            chunk = os.read(fd, 4096)
            if not chunk:
                return bytes(data)
            data += chunk
    finally:
        sel.close()


def read_available(fd: int) -> bytes:
    """Everything readable from ``fd`` now (it is closed afterwards)."""
    chunks = []
    try:
        os.set_blocking(fd, False)
        while True:
            try:
                chunk = os.read(fd, 65536)
            except BlockingIOError:
                break
            if not chunk:
                break
            chunks.append(chunk)
    finally:
        os.close(fd)
    return b"".join(chunks)
