"""The :class:`Sandbox`: a work directory plus the rules for running untrusted commands against it.

It wires the pieces of this package together; each piece is one isolation
mechanism and is documented and testable on its own:

* :mod:`~rollout.sandbox.argv` - bubblewrap's arguments, environment and binds
  (namespaces, filesystem, nothing of the worker's environment or argv inside);
* :mod:`~rollout.sandbox.uids` - a private uid per sandbox, subreaping, nothing outlives a run;
* :mod:`~rollout.sandbox.cgroups` / :mod:`~rollout.sandbox.rlimits` - the resource limits;
* :mod:`~rollout.sandbox.pump` - output bounds and the wall clock;
* :mod:`~rollout.sandbox.verdict` - why a command stopped, from kernel facts;
* :mod:`~rollout.sandbox.files` - host-side file I/O, manifests, snapshots;
* :mod:`~rollout.sandbox.launch` - the spawn (``vfork``-able; ``chroot --userspec`` drops the uid);
* :mod:`~rollout.sandbox.netns` - each run's network namespace, made ahead when the worker is root.

One run::

    [nsenter --net=<made ahead> --setuid=U --setgid=G --]  (worker is root; else, without
                                                            nsenter: chroot --userspec=+U:+G ...)
      prlimit --cpu --fsize --nofile --core [--data --nproc] --  (rlimits)
        bwrap --args <memfd> --                            (env: SANDBOX_ENV only)
              [--block-fd: pid 1 waits until it is in the sandbox cgroup]
          <command>
"""

from __future__ import annotations

import json
import os
import resource
import signal
import subprocess
import tempfile
import threading
import time
from pathlib import Path
from typing import Sequence

from rollout.sandbox.argv import args_memfd, bwrap_args, host_tools
from rollout.sandbox.cgroups import SandboxCgroup, detect_cgroups
from rollout.sandbox.errors import SandboxError, SandboxUnavailable
from rollout.sandbox.files import SnapshotId, WorkDir, diff_manifests, has_file_of_size
from rollout.sandbox.launch import launch_argv, start_bwrap
from rollout.sandbox.limits import SandboxLimits
from rollout.sandbox.netns import Netns, netns_pool
from rollout.sandbox.pump import kill_group, pump, read_available, read_status_until
from rollout.sandbox.results import CommandResult
from rollout.sandbox.rlimits import prlimit_args
from rollout.sandbox.slots import take_slot
from rollout.sandbox.uids import (
    become_subreaper,
    check_traversable,
    reap_adopted,
    reap_uid,
    uid_process_count,
)
from rollout.sandbox.verdict import KernelFacts, judge

__all__ = ["Sandbox", "LIMITS_BACKENDS"]

#: Accepted values of ``limits_backend``.
LIMITS_BACKENDS = ("auto", "cgroup", "rlimit")

_probe_lock = threading.Lock()
_probe_ok = False


class Sandbox:
    """A work directory plus the rules for running untrusted commands against it.

    Args:
        workdir_root: host directory under which this sandbox's directory is made
            (must be traversable by other users, e.g. under ``/tmp``).
        limits: resource limits for every command.
        extra_ro_binds: further host paths bound read-only at the same place
            (e.g. a toolchain under ``/opt``).
        limits_backend: ``auto`` (a per-sandbox cgroup when the host delegates
            one, else rlimits), ``cgroup`` (require a cgroup) or ``rlimit``.
        cgroup_parent: a delegated cgroup v2 directory to create sandbox
            cgroups under (default: this process's own cgroup).
        pool_size: keep this many sandboxes' host state (directories, uid,
            cgroup) made ahead by a background thread, per (root, limits,
            cgroup hierarchy); 0 makes it here. Never reused: see :mod:`~rollout.sandbox.slots`.
        prepared_netns: give each run a fresh network namespace made ahead by a
            background thread (worker is root and util-linux ``nsenter`` is installed;
            :mod:`~rollout.sandbox.netns`); False, or where that is not possible,
            bwrap makes it during the start. Either way one new namespace per run.

    Attributes:
        limits_backend: the mechanism in force: ``cgroup2``, ``cgroup1`` or ``rlimit``.

    Raises:
        SandboxUnavailable: bubblewrap, prlimit or chroot is missing, bwrap cannot
            create namespaces here, or ``limits_backend="cgroup"`` and no cgroup is delegated.
        ValueError: an unknown ``limits_backend`` or a relative ``extra_ro_binds`` entry.

    Examples:
        >>> with Sandbox.create() as sb:                      # doctest: +SKIP
        ...     sb.write_file("a.txt", "hi")
        ...     sb.run("cat a.txt").stdout
        'hi'
    """

    def __init__(
        self,
        workdir_root: str | os.PathLike[str],
        limits: SandboxLimits | None = None,
        *,
        extra_ro_binds: Sequence[str] = (),
        limits_backend: str = "auto",
        cgroup_parent: str | None = None,
        pool_size: int = 2,
        prepared_netns: bool = True,
    ) -> None:
        if limits_backend not in LIMITS_BACKENDS:
            raise ValueError(f"`limits_backend` must be one of {', '.join(LIMITS_BACKENDS)}, got {limits_backend!r}")
        self.limits = limits or SandboxLimits()
        self._tools = host_tools()
        self._extra_ro_binds = tuple(extra_ro_binds)
        for path in self._extra_ro_binds:
            if not os.path.isabs(path):
                raise ValueError(f"`extra_ro_binds` entries must be absolute paths, got {path!r}")
        support = None
        if limits_backend != "rlimit":
            support = detect_cgroups(parent=cgroup_parent)
            if support.kind is None:
                if limits_backend == "cgroup":
                    raise SandboxUnavailable(
                        f"`limits_backend='cgroup'` but no cgroup is delegated here ({support.reason}); "
                        "use limits_backend='rlimit' or 'auto'"
                    )
                support = None
        self.root = Path(workdir_root)
        self.root.mkdir(parents=True, exist_ok=True)
        check_traversable(self.root)
        become_subreaper()
        self._slot = take_slot(self.root, limits=self.limits, support=support, pool_size=pool_size)
        self.sandbox_id, self.dir = self._slot.sandbox_id, self._slot.dir
        self._lease = self._slot.lease
        self.uid, self.gid = self._lease.uid, self._lease.gid
        self.work, self._tmp = self._slot.work, self._slot.tmp
        self._cgroup: SandboxCgroup | None = self._slot.cgroup
        self.limits_backend = self._cgroup.kind if self._cgroup is not None else "rlimit"
        self._counters = self._slot.counters  # read when the slot was made; nothing has run in it since
        self._netns_pool = None
        if prepared_netns and os.geteuid() == 0 and self._tools.nsenter is not None:
            self._netns_pool = netns_pool()
        self._files = WorkDir(self.work, self._slot.snapshots, uid=self.uid, gid=self.gid,
                              hash_bytes=self.limits.manifest_hash_bytes,
                              max_files=self.limits.max_manifest_files)
        self._closed = False
        self._check_host()

    @classmethod
    def create(
        cls,
        workdir_root: str | os.PathLike[str] | None = None,
        limits: SandboxLimits | None = None,
        **kwargs,
    ) -> "Sandbox":
        """Make a sandbox under ``workdir_root`` (default: ``$TMPDIR/trajpipe-sandboxes``)."""
        root = workdir_root if workdir_root is not None else Path(tempfile.gettempdir()) / "trajpipe-sandboxes"
        return cls(root, limits, **kwargs)

    # ----------------------------------------------------------------- lifecycle

    def __enter__(self) -> "Sandbox":
        return self

    def __exit__(self, *exc_info: object) -> None:
        self.close()

    def close(self) -> None:
        """Delete the sandbox directory and cgroup, release its uid. Idempotent."""
        if self._closed:
            return
        self._closed = True
        self._slot.destroy()

    def __del__(self) -> None:  # last resort; close() is the contract
        try:
            self.close()
        except Exception:  # noqa: BLE001 - interpreter shutdown, nothing to report to
            pass

    def _check_open(self) -> None:
        if self._closed:
            raise SandboxError(f"sandbox {self.sandbox_id} is closed")

    def _check_host(self) -> None:
        """Run one trivial command per process to prove bwrap works here."""
        global _probe_ok
        with _probe_lock:
            if _probe_ok:
                return
            try:
                result = self.run(["/bin/true"], timeout_s=20, _probe=True)
            except SandboxError as err:
                self.close()
                raise SandboxUnavailable(f"bwrap could not start a sandbox here: {err}") from err
            _probe_ok = result.exit_status == 0
            if not _probe_ok:
                self.close()
                hint = ""
                if "namespace" in result.stderr or "Operation not permitted" in result.stderr:
                    hint = ("; unprivileged user namespaces must be enabled "
                            "(sysctl kernel.unprivileged_userns_clone=1, user.max_user_namespaces>0)")
                raise SandboxUnavailable(
                    f"bwrap could not start a sandbox here (exit {result.exit_status}): "
                    f"{result.stderr.strip()[:500]}{hint}"
                )

    # ----------------------------------------------------------------- files

    def write_file(self, path: str | os.PathLike[str], content: str | bytes, *, mode: int = 0o644) -> None:
        """Write a file into the work dir (parents created), owned by the sandbox uid.

        Raises:
            SandboxError: the path is absolute outside ``/work`` or escapes it (also via symlinks).
        """
        self._check_open()
        self._files.write_file(path, content, mode=mode)

    def read_file(self, path: str | os.PathLike[str], *, max_bytes: int | None = None) -> bytes:
        """Read a work-dir file (refusing symlinks and escapes)."""
        self._check_open()
        return self._files.read_file(path, max_bytes=max_bytes)

    def manifest(self) -> dict[str, tuple]:
        """Cheap fingerprint of the work dir: path -> (kind, size, mtime_ns, hash|None)."""
        self._check_open()
        return self._files.manifest()

    def snapshot(self) -> SnapshotId:
        """Copy the work dir aside; :meth:`restore` brings it back exactly."""
        self._check_open()
        return self._files.snapshot()

    def restore(self, snapshot: SnapshotId) -> None:
        """Replace the work dir with a snapshot's contents.

        Raises:
            SandboxError: the snapshot does not exist in this sandbox.
        """
        self._check_open()
        self._files.restore(snapshot)

    def snapshots(self) -> list[SnapshotId]:
        """Snapshot ids taken so far, oldest first."""
        return self._files.snapshots()

    # ----------------------------------------------------------------- running

    def run(
        self,
        cmd: list[str] | str,
        *,
        timeout_s: float | None = None,
        stdin: bytes | str | None = None,
        track_files: bool = True,
        _probe: bool = False,
    ) -> CommandResult:
        """Run one command in a fresh container over the work dir.

        Args:
            cmd: argv list, or a string run by ``/bin/sh -c``.
            timeout_s: wall-clock limit (default ``limits.wall_time_s``); the
                whole sandbox is killed when it passes.
            stdin: bytes fed to the command's standard input (default: empty).
            track_files: compute ``files_changed`` (one manifest before and after).

        Returns:
            The :class:`CommandResult`; limit violations are reported in it, never raised.

        Raises:
            SandboxError: bwrap itself failed to set the sandbox up, or the cgroup could not take it.
        """
        self._check_open()
        if isinstance(cmd, str):
            argv_cmd = ["/bin/sh", "-c", cmd]
        elif cmd and all(isinstance(a, str) for a in cmd):
            argv_cmd = list(cmd)
        else:
            raise ValueError(f"`cmd` must be a non-empty list of str or a str, got {cmd!r}")
        timeout = self.limits.wall_time_s if timeout_s is None else float(timeout_s)
        if timeout <= 0:
            raise ValueError(f"`timeout_s` must be > 0, got {timeout_s}")
        before = self.manifest() if track_files else None
        if self._cgroup is not None:
            self._cgroup.warm()  # the attach's grace period elapses while bwrap starts and sets up its namespaces
        data_in = stdin.encode() if isinstance(stdin, str) else stdin
        netns = self._netns_pool.take() if self._netns_pool is not None else None
        try:
            return self._run(argv_cmd, timeout=timeout, data_in=data_in, netns=netns,
                             before=before, track_files=track_files, probe=_probe)
        finally:
            if netns is not None:
                self._netns_pool.release(netns)  # every process in it is gone: the kernel frees it

    def _run(self, argv_cmd: list[str], *, timeout: float, data_in: bytes | None, netns: Netns | None,
             before: dict | None, track_files: bool, probe: bool) -> CommandResult:
        """Spawn, admit into the cgroup, pump, reap and judge one command (``run`` checked the arguments)."""
        started = time.monotonic()
        proc, status_r, block_w = self._spawn(argv_cmd, with_stdin=bool(data_in), netns=netns)
        # bwrap's outer process inherits our peak RSS: exec records the old (vforked: our) mm's high-water mark in the
        # new program's ru_maxrss. Read after the fork (a peak only grows), its own wait4 peak means something
        # only above this bound.
        spawner_peak_kb = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
        status, admit_error = b"", None
        if block_w is not None:
            status, admit_error = self._admit(proc, status_r, block_w, deadline=started + timeout)
        usages = []
        try:
            pumped = pump(proc, stdin_data=data_in, deadline=started + timeout,
                          max_output_bytes=self.limits.max_output_bytes,
                          output_kill_bytes=self.limits.output_kill_bytes)
        finally:
            status += read_available(status_r)
            pid1 = _child_pid(status)
            if pid1 is not None:
                usages.append(reap_adopted(pid1))
            if self._lease.private:
                usages += reap_uid(self.uid)
        duration_ms = (time.monotonic() - started) * 1000.0
        if admit_error is not None:
            raise SandboxError(f"{admit_error}; bwrap said: {pumped.stderr.strip()[:500]!r}") from admit_error
        if b'"child-pid"' not in status and pumped.stopped_by_us is None:
            raise SandboxError(f"bwrap failed to set up the sandbox (exit {pumped.returncode}): "
                               f"{pumped.stderr.strip()[:500]}")
        exit_status = -9 if pumped.stopped_by_us else pumped.returncode
        reason = judge(self._facts(exit_status, pumped.stopped_by_us, pumped.usage, usages,
                                   spawner_peak_kb=spawner_peak_kb),
                       cpu_time_limit_s=self.limits.cpu_time_s,
                       memory_limit_bytes=self.limits.memory_bytes,
                       rlimit_memory=self._cgroup is None)
        changed = diff_manifests(before, self.manifest()) if track_files and not probe else {}
        return CommandResult(
            exit_status=exit_status,
            stdout=pumped.stdout,
            stderr=pumped.stderr,
            truncated=pumped.truncated,
            timed_out=pumped.stopped_by_us == "timeout",
            killed_reason=reason,
            duration_ms=duration_ms,
            files_changed=changed,
        )

    def _spawn(self, argv_cmd: list[str], *, with_stdin: bool,
               netns: Netns | None) -> tuple[subprocess.Popen, int, int | None]:
        """Start bwrap (behind nsenter or chroot, and prlimit) with nothing of the worker's: env, cwd, fds, argv."""
        status_r, status_w = os.pipe()
        block_r, block_w = os.pipe() if self._cgroup is not None else (None, None)
        own = [status_w] + ([block_r] if block_r is not None else [])
        try:
            memfd = args_memfd(bwrap_args(work=self.work, tmp=self._tmp,
                                          extra_ro_binds=self._extra_ro_binds,
                                          status_fd=status_w, block_fd=block_r,
                                          share_net=netns is not None))
        except OSError as err:
            for fd in (status_r, block_w, *own):
                if fd is not None:
                    os.close(fd)
            raise SandboxError(f"could not prepare bwrap's arguments: {err}") from err
        own.append(memfd)
        nproc = None
        if self._cgroup is None:
            nproc = self.limits.max_processes + (0 if self._lease.private else uid_process_count(self.uid))
        argv = launch_argv(self._tools, drop_to=(self.uid, self.gid) if os.geteuid() == 0 else None,
                           prlimit_opts=prlimit_args(self.limits, fallback_nproc=nproc),
                           memfd=memfd, cmd=argv_cmd, netns=netns.path if netns is not None else None)
        try:
            proc = start_bwrap(argv, with_stdin=with_stdin, pass_fds=own)
        except OSError as err:
            os.close(status_r)
            if block_w is not None:
                os.close(block_w)
            raise SandboxError(f"could not start bwrap: {err}") from err
        finally:
            for fd in own:
                os.close(fd)
        return proc, status_r, block_w

    def _admit(self, proc: subprocess.Popen, status_r: int, block_w: int, *,
               deadline: float) -> tuple[bytes, SandboxError | None]:
        """Move bwrap's (blocked) pid 1 into the cgroup, then let it start the command.

        On any failure bwrap is killed *before* the gate opens, so the command
        never runs outside its cgroup.

        Returns:
            What bwrap wrote to its status fd so far, and the attach error if there was one.
        """
        status = read_status_until(status_r, b'"child-pid"', deadline=deadline)
        pid1 = _child_pid(status)
        error = None
        try:
            if pid1 is None:
                kill_group(proc)  # bwrap failed before its pid 1 existed; run() reports its stderr
            else:
                try:
                    self._cgroup.attach(pid1)
                    os.write(block_w, b"g")
                except SandboxError as err:
                    kill_group(proc)
                    error = err
        finally:
            os.close(block_w)
        return status, error

    def _facts(self, exit_status: int, stopped_by_us: str | None, outer_usage, reaped: list, *,
               spawner_peak_kb: int) -> KernelFacts:
        """The kernel facts of one command.

        ``outer_usage`` is bwrap's outer process (collected by the pump); ``reaped`` are processes we reaped
        ourselves (bwrap's pid 1 when adopted, the uid's leftovers), which never ran our image. The outer
        process's ``ru_maxrss`` starts at the spawner's own peak (``spawner_peak_kb``, recorded at its exec),
        so it is evidence of the command's peak only when above it: a worker that holds a model must not
        see every failed command as ``memory_limit``.
        """
        reaped = [u for u in reaped if u is not None]
        usages = [u for u in (outer_usage, *reaped) if u is not None]
        peaks = [u.ru_maxrss for u in reaped]
        if outer_usage is not None and outer_usage.ru_maxrss > spawner_peak_kb:
            peaks.append(outer_usage.ru_maxrss)
        oom = forks = 0
        if self._cgroup is not None:
            now = self._cgroup.counters()
            oom, forks = now[0] - self._counters[0], now[1] - self._counters[1]
            self._counters = now
        at_size = False
        if exit_status == 128 + signal.SIGXFSZ:  # is a file stopped exactly at the limit?
            at_size = has_file_of_size([self.work, self._tmp], self.limits.max_file_bytes)
        return KernelFacts(
            exit_status=exit_status,
            stopped_by_us=stopped_by_us,
            oom_kills=max(oom, 0),
            forks_refused=max(forks, 0),
            peak_rss_bytes=max(peaks) * 1024 if peaks else None,
            cpu_time_s=sum(u.ru_utime + u.ru_stime for u in usages) if usages else None,
            file_at_size_limit=at_size,
        )


def _child_pid(status: bytes) -> int | None:
    """bwrap's pid 1 (host pid) from the first JSON object on its status fd."""
    line = status.split(b"\n", 1)[0]
    try:
        pid = json.loads(line).get("child-pid")
    except (ValueError, AttributeError):
        return None
    return pid if isinstance(pid, int) else None
