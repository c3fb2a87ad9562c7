"""A child process that ends with its supervisor: ``trajpipe loop``'s parts do not outlive a killed loop.

The loop starts each part (rollout worker, archiver, Beam job, trainer, evaluator) as ``python -m trajpipe
...`` in its own session, so that a Ctrl-C at the terminal reaches the loop only. A loop that is killed itself
(``kill -9``, the OOM killer) cannot stop them in order, and an orphaned trainer would go on publishing policy
versions that nothing evaluates. So the loop puts its pid in :data:`ENV` of every part it starts, and the part,
first thing in :func:`trajpipe.cli.main`, calls :func:`exit_with_parent`: the kernel then sends it SIGTERM
when the loop dies (Linux ``prctl(PR_SET_PDEATHSIG)``, see ``man 2 PR_SET_PDEATHSIG``), and each part
handles SIGTERM as its clean stop (a rollout worker flushes its events, the evaluator aborts the evaluation in
flight without recording it as done, the trainer ends at once and resumes from its last checkpoint).

Set in the child itself after ``exec`` rather than in a ``preexec_fn`` (which Python documents as unsafe in a
process with threads, as the loop is). The window between ``fork`` and the ``prctl`` call is closed by
comparing ``getppid()`` with the recorded pid: a loop that died before the call has already re-parented the
child, which then stops at once.

Examples:
    >>> env = lifeline_env(1234)
    >>> env == {ENV: "1234"}
    True
"""

from __future__ import annotations

import ctypes
import logging
import os
import signal
import sys
from collections.abc import MutableMapping

__all__ = ["ENV", "lifeline_env", "exit_with_parent"]

log = logging.getLogger(__name__)

#: The supervisor's pid, set by ``trajpipe loop`` in the environment of each part it starts.
ENV = "TRAJPIPE_EXIT_WITH_PARENT"
#: ``<linux/prctl.h>``: deliver a signal to this process when its parent thread dies.
PR_SET_PDEATHSIG = 1


def lifeline_env(parent_pid: int) -> dict[str, str]:
    """The environment entry that makes a ``trajpipe`` child end when ``parent_pid`` dies."""
    return {ENV: str(parent_pid)}


def exit_with_parent(environ: MutableMapping[str, str] | None = None, *, sig: int = signal.SIGTERM) -> bool:
    """If :data:`ENV` names our parent, have the kernel send ``sig`` to this process when the parent dies.

    :data:`ENV` is removed from ``environ`` (the process environment by default), so that a process this one
    starts is not tied to a parent it does not have.

    Args:
        environ: where to read (and remove) :data:`ENV`; default ``os.environ``.
        sig: the signal delivered on the parent's death (SIGTERM: the parts' clean stop).

    Returns:
        True when the lifeline is set; False when :data:`ENV` is absent or empty, or on a system without
        ``PR_SET_PDEATHSIG`` (not Linux: logged; ``trajpipe loop --resume`` still stops the leftovers).

    Raises:
        ValueError: :data:`ENV` is not a pid.
    """
    environ = os.environ if environ is None else environ
    value = environ.pop(ENV, "")
    if not value:
        return False
    if not value.isdigit():
        raise ValueError(f"{ENV}={value!r} is not a process id")
    if not sys.platform.startswith("linux"):
        log.warning("%s is set but this system has no PR_SET_PDEATHSIG: this process outlives its parent", ENV)
        return False
    libc = ctypes.CDLL(None, use_errno=True)
    if libc.prctl(PR_SET_PDEATHSIG, int(sig), 0, 0, 0) != 0:
        err = ctypes.get_errno()
        raise OSError(err, f"prctl(PR_SET_PDEATHSIG): {os.strerror(err)}")
    if os.getppid() != int(value):  # the parent died before the prctl call: nobody will signal us
        os.kill(os.getpid(), sig)
    return True
