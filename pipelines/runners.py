"""Beam runner selection: where Prism and the Flink job server live, and per-runner default options.

Runners trajpipe runs on, and what each needs (docs/runners.md has the commands):

* ``FnApiRunner`` — Beam's in-process portable runner; batch only. The default
  for batch jobs and tests.
* ``PrismRunner`` — Beam's portable local runner (a Go binary); batch and
  stream (unbounded splittable DoFns, watermarks, event-time timers; no
  processing-time timers). Installed by ``pipelines/runtime/install_prism.sh`` from the
  Go module proxy into ``.cache/bin/prism``.
* ``FlinkRunner`` — Beam's Flink runner through its job server (a Java
  process); ``--flink_master=[local]`` runs an embedded Flink. The job server
  is assembled from Maven Central by ``pipelines/runtime/install_flink_jobserver.sh``
  into ``.cache/jars/flink-job-server/``.
* ``DataflowRunner``, ``SparkRunner``, ``PortableRunner`` and any other name —
  passed through untouched; give their options on the command line.

Only entry points call :func:`runner_options`; transforms never read options.

Examples:
    >>> opts = runner_options("FnApiRunner", "batch", ["--max_num_workers=2"])
    >>> opts.get_all_options()["runner"]
    'FnApiRunner'
    >>> try:
    ...     runner_options("FnApiRunner", "stream", [])
    ... except RunnerConfigError as err:
    ...     print(err)
    `--runner` FnApiRunner cannot run --mode stream (it has no unbounded sources, watermarks or timers); use --runner PrismRunner locally, or FlinkRunner/DataflowRunner on a cluster
"""

from __future__ import annotations

import os
from collections.abc import Sequence
from pathlib import Path

from apache_beam.options.pipeline_options import DebugOptions, PipelineOptions

from streams.config import ConfigError

__all__ = [
    "RUNNERS",
    "MODES",
    "BEAM_VERSION",
    "RunnerConfigError",
    "RunnerNotInstalledError",
    "repo_root",
    "cache_dir",
    "prism_location",
    "flink_job_server_jar",
    "runner_options",
    "disable_runner_splits",
    "PRISM_NO_SPLITS",
    "flink_cluster_master",
]

#: Runners with defaults here; any other name is passed to Beam as is.
RUNNERS = ("FnApiRunner", "PrismRunner", "FlinkRunner", "DirectRunner", "DataflowRunner", "SparkRunner",
           "PortableRunner")
MODES = ("batch", "stream")
#: The Beam release the Python SDK, Prism (``pipelines/runtime/install_prism.sh``) and these defaults are for.
BEAM_VERSION = "2.77.0"

_BATCH_ONLY = ("FnApiRunner", "DirectRunner", "BundleBasedDirectRunner")
#: Prism's experiment that turns off its runner-initiated bundle splits (:func:`disable_runner_splits`).
PRISM_NO_SPLITS = "prism_disable_sdf_split"


class RunnerConfigError(ConfigError):
    """An impossible runner/mode/option combination; the message names the option and the fix."""


class RunnerNotInstalledError(FileNotFoundError):
    """A runner's binary or jar is missing; the message gives the install command."""


def repo_root() -> Path:
    """The repository root (the directory holding ``pipelines/``)."""
    return Path(__file__).resolve().parent.parent


def cache_dir() -> Path:
    """Downloaded tools: ``$TRAJPIPE_CACHE``, else ``<repo root>/.cache``."""
    env = os.environ.get("TRAJPIPE_CACHE")
    return Path(env) if env else repo_root() / ".cache"


def prism_location(*, check: bool = True) -> Path:
    """Path of the Prism binary: ``$TRAJPIPE_PRISM``, else ``<cache>/bin/prism``.

    Args:
        check: raise if the file is not there.

    Raises:
        RunnerNotInstalledError: ``check`` and no executable at that path.
    """
    env = os.environ.get("TRAJPIPE_PRISM")
    path = Path(env) if env else cache_dir() / "bin" / "prism"
    if check and not (path.is_file() and os.access(path, os.X_OK)):
        raise RunnerNotInstalledError(
            f"Prism not found at {path}; run `pipelines/runtime/install_prism.sh` (or `make install`), "
            "or point TRAJPIPE_PRISM at a prism binary"
        )
    return path


def flink_job_server_jar(*, check: bool = True) -> Path:
    """Path of the Flink job server jar: ``$TRAJPIPE_FLINK_JOB_SERVER_JAR``, else under ``<cache>/jars``.

    Args:
        check: raise if the file is not there.

    Raises:
        RunnerNotInstalledError: ``check`` and no file at that path.
    """
    env = os.environ.get("TRAJPIPE_FLINK_JOB_SERVER_JAR")
    path = Path(env) if env else cache_dir() / "jars" / "flink-job-server" / "beam-runners-flink-job-server.jar"
    if check and not path.is_file():
        raise RunnerNotInstalledError(
            f"Flink job server jar not found at {path}; run `pipelines/runtime/install_flink_jobserver.sh` "
            "(needs a JDK 11+ and Maven), or point TRAJPIPE_FLINK_JOB_SERVER_JAR at a job server jar"
        )
    return path


def _given(extra: Sequence[str], flag: str) -> bool:
    return any(a == flag or a.startswith(flag + "=") for a in extra)


def runner_options(runner: str, mode: str, extra: Sequence[str] = ()) -> PipelineOptions:
    """Beam options for ``runner`` in ``mode``: sensible defaults, then ``extra`` (which wins).

    Defaults per runner:

    * ``PrismRunner``: ``--prism_location=<prism_location()>``, ``--environment_type=LOOPBACK``.
    * ``FlinkRunner``: ``--flink_master=[local]``, ``--flink_job_server_jar=<flink_job_server_jar()>``,
      and, when the master is ``[local]``, ``--environment_type=LOOPBACK`` (an embedded Flink that
      runs the Python SDK in this process). A cluster master (``host:port``, e.g. the session cluster of
      :mod:`pipelines.flink_cluster`) gets no environment default: ``--environment_type`` must be given
      (``EXTERNAL`` with ``--environment_config=HOST:PORT`` of a worker pool, ``DOCKER`` or ``PROCESS``).
    * every mode ``stream``: ``--streaming``.

    Args:
        runner: Beam runner name (``--runner``).
        mode: ``batch`` or ``stream`` (``--mode``).
        extra: further Beam command-line options; they override the defaults
            (e.g. ``--flink_master=host:8081 --environment_type=DOCKER``).

    Returns:
        The options, with ``runner`` set.

    Raises:
        RunnerConfigError: unknown ``mode``, a batch-only runner asked to stream, or a Flink cluster master
            without an SDK environment (``--environment_type``, and ``--environment_config`` for EXTERNAL).
        RunnerNotInstalledError: Prism or the Flink job server is needed but not installed.
    """
    if mode not in MODES:
        raise RunnerConfigError(f"`--mode` must be one of {', '.join(MODES)}, got {mode!r}")
    if not runner:
        raise RunnerConfigError("`--runner` is empty; use FnApiRunner (batch), PrismRunner, FlinkRunner, ...")
    if _given(extra, "--runner"):
        raise RunnerConfigError("give the runner once, as `--runner`, not again among the pass-through options")
    if mode == "stream" and runner in _BATCH_ONLY:
        raise RunnerConfigError(
            f"`--runner` {runner} cannot run --mode stream (it has no unbounded sources, watermarks or timers); "
            "use --runner PrismRunner locally, or FlinkRunner/DataflowRunner on a cluster"
        )
    args: list[str] = [f"--runner={runner}"]
    if runner == "PrismRunner":
        if not _given(extra, "--prism_location"):
            args.append(f"--prism_location={prism_location()}")
        if not _given(extra, "--environment_type"):
            args.append("--environment_type=LOOPBACK")
    elif runner == "FlinkRunner":
        master = _option(extra, "--flink_master")
        if master is None:
            args.append("--flink_master=[local]")
        if not _given(extra, "--flink_job_server_jar") and not _given(extra, "--job_endpoint"):
            args.append(f"--flink_job_server_jar={flink_job_server_jar()}")
        if master in (None, "[local]", "[auto]") and not _given(extra, "--environment_type"):
            args.append("--environment_type=LOOPBACK")
        elif master not in (None, "[local]", "[auto]"):
            _check_cluster_environment(extra, master)
    if mode == "stream" and not _given(extra, "--streaming"):
        args.append("--streaming")
    return PipelineOptions(args + list(extra))


def _option(extra: Sequence[str], flag: str) -> str | None:
    """The value of ``flag`` in ``extra`` (``--flag=v`` or ``--flag v``), or None."""
    for i, a in enumerate(extra):
        if a.startswith(flag + "="):
            return a.split("=", 1)[1]
        if a == flag:
            return extra[i + 1] if i + 1 < len(extra) else None
    return None


def _check_cluster_environment(extra: Sequence[str], master: str) -> None:
    """A Flink cluster's TaskManagers need an SDK environment they can start: say which, up front.

    Beam's default for a cluster is DOCKER, which fails only when the first task starts (and hangs where
    no Docker daemon runs); EXTERNAL without an address has nowhere to ask for workers.
    """
    env = _option(extra, "--environment_type")
    if env is None:
        raise RunnerConfigError(
            f"`--flink_master` {master} is a cluster: give the SDK workers' environment, "
            "`--environment_type=EXTERNAL --environment_config=HOST:PORT` (a Beam worker pool; "
            "`trajpipe flink-cluster up` starts one and prints its port), DOCKER or PROCESS")
    if env.upper() == "EXTERNAL" and not _option(extra, "--environment_config"):
        raise RunnerConfigError(
            "`--environment_type=EXTERNAL` needs `--environment_config=HOST:PORT`, the address of a Beam worker "
            "pool (python -m apache_beam.runners.worker.worker_pool_main --service_port=PORT)")


def flink_cluster_master(runner: str, extra: Sequence[str]) -> str | None:
    """The Flink cluster a job goes to: ``--flink_master`` when ``runner`` is FlinkRunner and it names a cluster.

    None for every other runner and for an embedded Flink (``[local]``, ``[auto]``, not given).

    Examples:
        >>> flink_cluster_master("FlinkRunner", ["--flink_master", "flink-jm:8081"])
        'flink-jm:8081'
        >>> flink_cluster_master("FlinkRunner", ["--flink_master=[local]"]) is None
        True
    """
    master = _option(extra, "--flink_master") if runner == "FlinkRunner" else None
    return None if master in (None, "[local]", "[auto]", "[collection]") else master


def disable_runner_splits(options: PipelineOptions) -> PipelineOptions:
    """Turn off runner-initiated bundle splits, which lose the state of stateful DoFns on Prism; returns ``options``.

    Prism (2.77) splits a bundle that reports no progress for two progress ticks (~0.2 s: routine on a
    loaded machine) whatever its stage, a stateful DoFn's included, and frees the keys of the residual
    while the primary still holds their uncommitted state. A second bundle of such a key then runs on a
    stale copy of the key's state, and when both persist one overwrites the other (or both fire their
    timers): events added to the state are lost. Splits are off for the whole job (the experiment is
    per job); splittable DoFns still checkpoint themselves (``defer_remainder``). Other runners ignore
    the experiment. Adds it to ``options`` in place (idempotent).

    Examples:
        >>> opts = disable_runner_splits(PipelineOptions(["--experiments=other"]))
        >>> opts.view_as(DebugOptions).experiments
        ['other', 'prism_disable_sdf_split']
    """
    options.view_as(DebugOptions).add_experiment(PRISM_NO_SPLITS)
    return options
