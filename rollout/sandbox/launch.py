"""How bwrap is started: a spawn that can use ``vfork``, the uid dropped by ``chroot --userspec``, rlimits by ``prlimit``.

CPython starts a child with ``vfork(2)`` unless it must run Python-level code
between fork and exec: a ``preexec_fn``, or ``user``/``group``/``extra_groups``
(the set*id calls). Then it ``fork``\\ s, copying the worker's page tables. A
rollout worker holds a policy model, so that copy is paid on every command:
measured on the dev VM, spawning ``/bin/true`` with ``user=`` took 52 ms from a
process holding 1 GiB and 294 ms from one holding 4 GiB (``vfork``: 1.5-4 ms
at every size). So the worker passes none of them. As root, the first
program of the chain is coreutils ``chroot --userspec=+U:+G --groups=
--skip-chdir /``: ``setgroups(0)``, ``setgid(G)``, ``setuid(U)`` (real,
effective and saved ids; no supplementary group), then exec, exactly what
``user=``/``group=``/``extra_groups=[]`` did; ``chroot("/")`` changes nothing
and ``+`` makes the ids numeric without a user database lookup. (util-linux
``setpriv`` does the same but costs 3 ms more per run here: it loads
libcap-ng and looks the numeric ids up through NSS first.) ::

    [chroot --userspec=+U:+G --groups= --skip-chdir /]   (worker is root)
      prlimit --cpu .. --                                (rlimits, :mod:`rollout.sandbox.rlimits`)
        bwrap --args <memfd> -- <command>

When the run's network namespace was made ahead (:mod:`rollout.sandbox.netns`),
util-linux ``nsenter --net=/proc/<worker>/fd/<fd> --setuid=U --setgid=G --``
takes ``chroot``'s place: ``setns`` into that namespace (still as root, which
``setns`` needs), then ``setgroups(0)``, ``setgid(G)``, ``setuid(U)`` and exec,
the same identity ``chroot --userspec`` gives (``test_command_has_only_the_sandbox_identity``).
The chain stays three programs long; bwrap then keeps the namespace (``--share-net``).

(``prlimit(2)`` on bwrap's pid 1 at its start gate would save the ``prlimit``
exec, but it needs ``CAP_SYS_RESOURCE`` for another uid, which the dev VMs
do not grant even to root.)
"""

from __future__ import annotations

import subprocess
from typing import Sequence

from rollout.sandbox.argv import SANDBOX_ENV, HostTools

__all__ = ["launch_argv", "start_bwrap"]


def launch_argv(
    tools: HostTools,
    *,
    drop_to: tuple[int, int] | None,
    prlimit_opts: Sequence[str],
    memfd: int,
    cmd: Sequence[str],
    netns: str | None = None,
) -> list[str]:
    """The argv that starts bwrap for one run.

    Args:
        tools: paths of the host programs.
        drop_to: ``(uid, gid)`` to become before bwrap (the worker is root), or None.
        netns: path of a network namespace to enter before dropping the uid (needs
            ``drop_to`` and ``tools.nsenter``), or None.
        prlimit_opts: ``prlimit`` options (:func:`rollout.sandbox.rlimits.prlimit_args`).
        memfd: the fd holding bwrap's options (``--args``).
        cmd: the sandboxed command.

    Examples:
        >>> tools = HostTools("/usr/bin/bwrap", "/usr/bin/prlimit", "/usr/sbin/chroot")
        >>> launch_argv(tools, drop_to=(7, 8), prlimit_opts=["--core=0"], memfd=5, cmd=["true"])[:7]
        ['/usr/sbin/chroot', '--userspec=+7:+8', '--groups=', '--skip-chdir', '/', '/usr/bin/prlimit', '--core=0']
        >>> launch_argv(tools, drop_to=None, prlimit_opts=["--core=0"], memfd=5, cmd=["true"])[2:]
        ['--', '/usr/bin/bwrap', '--args', '5', '--', 'true']
        >>> tools = tools._replace(nsenter="/usr/bin/nsenter")
        >>> launch_argv(tools, drop_to=(7, 8), prlimit_opts=[], memfd=5, cmd=["true"], netns="/proc/9/fd/4")[:5]
        ['/usr/bin/nsenter', '--net=/proc/9/fd/4', '--setuid=7', '--setgid=8', '--']

    Raises:
        ValueError: ``netns`` without ``drop_to`` or without ``nsenter``.
    """
    if netns is not None and (drop_to is None or tools.nsenter is None):
        raise ValueError("`netns` needs `drop_to` (the worker is root) and util-linux `nsenter`")
    argv: list[str] = []
    if drop_to is not None:
        uid, gid = drop_to
        if netns is not None:
            argv += [tools.nsenter, f"--net={netns}", f"--setuid={uid}", f"--setgid={gid}", "--"]
        else:
            argv += [tools.chroot, f"--userspec=+{uid}:+{gid}", "--groups=", "--skip-chdir", "/"]
    argv += [tools.prlimit, *prlimit_opts, "--"]
    return [*argv, tools.bwrap, "--args", str(memfd), "--", *cmd]


def start_bwrap(argv: list[str], *, with_stdin: bool, pass_fds: Sequence[int]) -> subprocess.Popen:
    """Spawn ``argv`` with nothing of the worker's: fixed env, ``cwd=/``, only ``pass_fds``, own session.

    No ``preexec_fn``, ``user``, ``group`` or ``extra_groups``, so CPython may ``vfork``.

    Raises:
        OSError: the spawn failed.
    """
    return subprocess.Popen(
        argv,
        stdin=subprocess.PIPE if with_stdin else subprocess.DEVNULL,
        stdout=subprocess.PIPE,
        stderr=subprocess.PIPE,
        pass_fds=tuple(pass_fds),
        env=dict(SANDBOX_ENV),
        cwd="/",
        start_new_session=True,
        close_fds=True,
    )
