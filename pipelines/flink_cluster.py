"""A Flink 1.19 standalone session cluster on this machine: one JobManager JVM and N TaskManager JVMs.

The same processes a Flink deployment runs (``StandaloneSessionClusterEntrypoint``,
``TaskManagerRunner``), started from the jars ``pipelines/runtime/install_flink_cluster.sh``
assembles into ``.cache/jars/flink-cluster/lib``, with a generated ``config.yaml``
(ephemeral ports, small memory) in the cluster directory. Beam's Python SDK
workers are processes each TaskManager starts for itself (``--environment_type=PROCESS``,
booted by :mod:`pipelines.sdk_worker_boot`), as on a cluster whose nodes have Python
and the project installed; not threads of the submitting process (LOOPBACK)::

    trajpipe flink-cluster up --dir /tmp/flink      # last line: {"flink_master": "localhost:PORT", ...}
    trajpipe pipeline run --source kafka --bootstrap 127.0.0.1:9092 --out /tmp/datasets \\
        --runner FlinkRunner --flink_master=localhost:PORT --environment_type=PROCESS \\
        --environment_config='{"command": "/tmp/flink/bin/beam-sdk-worker"}' --parallelism=2
    trajpipe flink-cluster down --dir /tmp/flink

(A shared ``worker_pool_main`` pool, ``--environment_type=EXTERNAL``, does not work
with two TaskManagers: both name their first worker ``1-1``, the pool keys workers by
that id, and one TaskManager's StopWorker kills the other's worker mid-bundle.)

In code (tests, bench)::

    with start_cluster(tmp / "flink", task_managers=2) as cluster:
        run([..., *cluster.beam_args()])
        cluster.jobs()   # the JobManager's /jobs/overview

Layout of the cluster directory: ``conf/`` (config.yaml, log4j.properties),
``bin/beam-sdk-worker`` (the SDK worker command), ``log/`` (``jobmanager.log``,
``taskmanager-<i>.log`` and each JVM's ``.out``, where the SDK workers' output goes too),
``tmp/`` (io/blob/web temp dirs), ``cluster.json`` (pids and addresses, for ``down``).
"""

from __future__ import annotations

import json
import logging
import os
import shlex
import signal
import subprocess
import sys
import time
import urllib.error
import urllib.request
from collections.abc import Sequence
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Any

from pipelines.runners import cache_dir, repo_root
from streams.broker import free_port

__all__ = [
    "FlinkCluster",
    "FlinkClusterError",
    "flink_cluster_lib",
    "start_cluster",
    "stop_cluster",
    "load_cluster",
    "probe_rest",
    "cluster_command",
    "JOBMANAGER_CLASS",
    "TASKMANAGER_CLASS",
]

_LOG = logging.getLogger(__name__)

JOBMANAGER_CLASS = "org.apache.flink.runtime.entrypoint.StandaloneSessionClusterEntrypoint"
TASKMANAGER_CLASS = "org.apache.flink.runtime.taskexecutor.TaskManagerRunner"
_BASH_JAVA_UTILS = "org.apache.flink.runtime.util.bash.BashJavaUtils"
_STATE_FILE = "cluster.json"

#: Flink 1.19's default ``env.java.opts.all`` (its flink-dist config.yaml): what Flink needs opened on Java 17.
_JAVA17_OPTS = (
    "--add-exports=java.base/sun.net.util=ALL-UNNAMED --add-exports=java.rmi/sun.rmi.registry=ALL-UNNAMED "
    "--add-exports=jdk.compiler/com.sun.tools.javac.api=ALL-UNNAMED "
    "--add-exports=jdk.compiler/com.sun.tools.javac.file=ALL-UNNAMED "
    "--add-exports=jdk.compiler/com.sun.tools.javac.parser=ALL-UNNAMED "
    "--add-exports=jdk.compiler/com.sun.tools.javac.tree=ALL-UNNAMED "
    "--add-exports=jdk.compiler/com.sun.tools.javac.util=ALL-UNNAMED "
    "--add-exports=java.security.jgss/sun.security.krb5=ALL-UNNAMED "
    "--add-opens=java.base/java.lang=ALL-UNNAMED --add-opens=java.base/java.net=ALL-UNNAMED "
    "--add-opens=java.base/java.io=ALL-UNNAMED --add-opens=java.base/java.nio=ALL-UNNAMED "
    "--add-opens=java.base/sun.nio.ch=ALL-UNNAMED --add-opens=java.base/java.lang.reflect=ALL-UNNAMED "
    "--add-opens=java.base/java.text=ALL-UNNAMED --add-opens=java.base/java.time=ALL-UNNAMED "
    "--add-opens=java.base/java.util=ALL-UNNAMED --add-opens=java.base/java.util.concurrent=ALL-UNNAMED "
    "--add-opens=java.base/java.util.concurrent.atomic=ALL-UNNAMED "
    "--add-opens=java.base/java.util.concurrent.locks=ALL-UNNAMED"
).split()

_LOG4J = """\
# Written by pipelines/flink_cluster.py (Flink's log4j.properties, file appender only).
rootLogger.level = INFO
rootLogger.appenderRef.file.ref = MainAppender
logger.pekko.name = org.apache.pekko
logger.pekko.level = WARN
logger.akka.name = akka
logger.akka.level = WARN
logger.netty.name = org.apache.flink.shaded.netty4.io.netty
logger.netty.level = WARN
appender.main.name = MainAppender
appender.main.type = File
appender.main.append = true
appender.main.fileName = ${sys:log.file}
appender.main.layout.type = PatternLayout
appender.main.layout.pattern = %d{yyyy-MM-dd HH:mm:ss,SSS} %-5p %-60c %x - %m%n
"""


class FlinkClusterError(RuntimeError):
    """The cluster could not be started, reached or stopped; the message says why and where the logs are."""


def flink_cluster_lib(*, check: bool = True) -> Path:
    """The cluster's jar directory: ``$TRAJPIPE_FLINK_CLUSTER_LIB``, else ``<cache>/jars/flink-cluster/lib``.

    Raises:
        RunnerNotInstalledError: ``check`` and the directory holds no ``flink-runtime`` jar.
    """
    from pipelines.runners import RunnerNotInstalledError

    env = os.environ.get("TRAJPIPE_FLINK_CLUSTER_LIB")
    path = Path(env) if env else cache_dir() / "jars" / "flink-cluster" / "lib"
    if check and not any(path.glob("flink-runtime-*.jar")):
        raise RunnerNotInstalledError(
            f"Flink cluster jars not found in {path}; run `pipelines/runtime/install_flink_cluster.sh` "
            "(or `make install`; needs a JDK 11+ and Maven), or point TRAJPIPE_FLINK_CLUSTER_LIB at a Flink lib/")
    return path


@dataclass
class FlinkCluster:
    """A running session cluster (what ``cluster.json`` holds).

    Attributes:
        dir: the cluster directory (conf/, log/, tmp/).
        rest_port: the JobManager's REST port (``--flink_master=localhost:<rest_port>``).
        rpc_port: the JobManager's RPC port.
        sdk_worker_command: the executable TaskManagers start SDK workers with (PROCESS environment).
        task_managers: number of TaskManager processes.
        slots: task slots per TaskManager.
        pids: process ids by role (``jobmanager``, ``taskmanager-<i>``).
    """

    dir: str
    rest_port: int
    rpc_port: int
    sdk_worker_command: str
    task_managers: int
    slots: int
    pids: dict[str, int] = field(default_factory=dict)

    @property
    def rest_address(self) -> str:
        """``localhost:<rest port>``: what ``--flink_master`` takes."""
        return f"localhost:{self.rest_port}"

    @property
    def log_dir(self) -> Path:
        return Path(self.dir) / "log"

    def beam_args(self, *, parallelism: int | None = None) -> list[str]:
        """Beam options that run a job on this cluster, SDK workers started by its TaskManagers."""
        return [
            f"--flink_master={self.rest_address}",
            "--environment_type=PROCESS",
            "--environment_config=" + json.dumps({"command": self.sdk_worker_command}),
            f"--parallelism={parallelism or self.task_managers * self.slots}",
        ]

    def rest(self, path: str, *, timeout_s: float = 5.0) -> Any:
        """GET ``path`` of the JobManager's REST API, decoded from JSON."""
        return probe_rest(self.rest_address, path, timeout_s=timeout_s)

    def jobs(self) -> list[dict[str, Any]]:
        """The JobManager's ``/jobs/overview``: one dict per job (``jid``, ``name``, ``state``, ``tasks``, ...)."""
        return self.rest("/jobs/overview")["jobs"]

    def alive(self) -> dict[str, bool]:
        """Whether each process of the cluster is still running."""
        return {role: _pid_alive(pid) for role, pid in self.pids.items()}

    def __enter__(self) -> FlinkCluster:
        return self

    def __exit__(self, *exc: object) -> None:
        stop_cluster(self)


def probe_rest(address: str, path: str = "/config", *, timeout_s: float = 5.0) -> Any:
    """GET ``http://<address><path>`` from a Flink REST API and decode the JSON answer.

    Args:
        address: ``host:port`` or an ``http(s)://`` URL of a JobManager's REST endpoint.
        path: the REST path (``/config``, ``/overview``, ``/jobs/overview``, ``/taskmanagers``).
        timeout_s: connect and read timeout.

    Raises:
        FlinkClusterError: nothing answers there, or the answer is not Flink's JSON.
    """
    base = address if address.startswith(("http://", "https://")) else f"http://{address}"
    url = base.rstrip("/") + path
    try:
        with urllib.request.urlopen(url, timeout=timeout_s) as resp:  # noqa: S310 - an http(s) URL built here
            return json.loads(resp.read())
    except (urllib.error.URLError, OSError, ValueError) as err:
        reason = getattr(err, "reason", err)
        raise FlinkClusterError(f"no Flink REST API answers at {base} ({path}: {reason})") from err


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    try:  # a zombie child of this process is not alive
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except OSError:
        return False


def _config(root: Path, *, rest_port: int, rpc_port: int, task_managers: int, slots: int,
            jm_memory: str, tm_memory: str, tm_network: str, heartbeat_timeout_s: float) -> str:
    tmp = root / "tmp"
    entries = {
        "jobmanager.rpc.address": "localhost",
        "jobmanager.rpc.port": rpc_port,
        "jobmanager.bind-host": "localhost",
        "jobmanager.memory.process.size": jm_memory,
        "rest.address": "localhost",
        "rest.bind-address": "localhost",
        "rest.port": rest_port,
        "taskmanager.host": "localhost",
        "taskmanager.bind-host": "localhost",
        "taskmanager.rpc.port": 0,  # 0: ephemeral (also blob.server.port and the data port by default)
        "taskmanager.numberOfTaskSlots": slots,
        "taskmanager.memory.process.size": tm_memory,
        # Beam's batch plans chain dozens of operators into one slot, each with its own buffer pools: the
        # default network share (~83 MiB of 1.3 GiB) fails them with "Insufficient number of network buffers".
        "taskmanager.memory.network.min": tm_network,
        "taskmanager.memory.network.max": tm_network,
        "taskmanager.memory.managed.fraction": 0.2,
        "parallelism.default": task_managers * slots,
        "cluster.evenly-spread-out-slots": "true",
        # A dead TaskManager fails the job in seconds, not the default 50 s.
        "heartbeat.interval": int(heartbeat_timeout_s * 1000 / 4),
        "heartbeat.timeout": int(heartbeat_timeout_s * 1000),
        "restart-strategy.type": "none",
        "io.tmp.dirs": str(tmp / "io"),
        "blob.storage.directory": str(tmp / "blob"),
        "web.tmpdir": str(tmp / "web"),
        "env.java.opts.all": " ".join(_JAVA17_OPTS),
    }
    lines = [f"# Written by pipelines/flink_cluster.py for {task_managers} TaskManagers x {slots} slots."]
    lines += [f"{k}: {json.dumps(v) if isinstance(v, str) else v}" for k, v in entries.items()]
    return "\n".join(lines) + "\n"


def _java() -> str:
    java_home = os.environ.get("JAVA_HOME")
    return str(Path(java_home) / "bin" / "java") if java_home else "java"


def _resource_params(lib: Path, conf: Path, which: str) -> tuple[list[str], list[str]]:
    """(JVM options, ``-D`` dynamic configs) for a JobManager/TaskManager, as Flink's start scripts get them."""
    cmd = [_java(), *_JAVA17_OPTS, "-cp", f"{lib}/*", _BASH_JAVA_UTILS, which, "--configDir", str(conf)]
    if which == "GET_JM_RESOURCE_PARAMS":
        cmd += ["-D", "jobmanager.memory.off-heap.size=134217728b"]  # what jobmanager.sh passes
    try:
        out = subprocess.run(cmd, capture_output=True, text=True, timeout=60, check=True).stdout
    except (subprocess.CalledProcessError, subprocess.TimeoutExpired, OSError) as err:
        raise FlinkClusterError(f"Flink's BashJavaUtils {which} failed: {getattr(err, 'stderr', '') or err}") from err
    results = [line.split(":", 1)[1] for line in out.splitlines() if line.startswith("BASH_JAVA_UTILS_EXEC_RESULT:")]
    if len(results) < 2:
        raise FlinkClusterError(f"Flink's BashJavaUtils {which} printed no resource parameters: {out[-500:]}")
    return shlex.split(results[0]), shlex.split(results[1])


def _spawn(cmd: Sequence[str], *, log: Path, env: dict[str, str] | None = None) -> int:
    out = open(log, "ab")  # noqa: SIM115 - the child holds it; closed here after the fork
    try:
        proc = subprocess.Popen(list(cmd), stdout=out, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL,
                                env=env, start_new_session=True)
    finally:
        out.close()
    return proc.pid


def _jvm(lib: Path, conf: Path, log_dir: Path, name: str, main: str, jvm_params: list[str],
         dynamic: list[str]) -> int:
    log_file = log_dir / f"{name}.log"
    cmd = [_java(), *jvm_params, *_JAVA17_OPTS, f"-Dlog.file={log_file}",
           f"-Dlog4j.configurationFile=file:{conf / 'log4j.properties'}",
           "-cp", f"{lib}/*", main, "--configDir", str(conf), *dynamic]
    return _spawn(cmd, log=log_dir / f"{name}.out")


def _write_sdk_worker_command(path: Path) -> None:
    """The PROCESS environment's command: this interpreter booting an SDK worker with the project importable."""
    pythonpath = os.pathsep.join(p for p in (str(repo_root()), os.environ.get("PYTHONPATH")) if p)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text("#!/bin/sh\n# Written by pipelines/flink_cluster.py: one Beam Python SDK worker "
                    "(pipelines/sdk_worker_boot.py).\n"
                    f"PYTHONPATH={shlex.quote(pythonpath)}; export PYTHONPATH\n"
                    f'exec {shlex.quote(sys.executable)} -m pipelines.sdk_worker_boot "$@"\n')
    path.chmod(0o755)


def start_cluster(
    dir: str | Path,
    *,
    task_managers: int = 2,
    slots: int = 1,
    jm_memory: str = "768m",
    tm_memory: str = "1792m",
    tm_network: str = "384m",
    heartbeat_timeout_s: float = 20.0,
    timeout_s: float = 180.0,
) -> FlinkCluster:
    """Start a session cluster in ``dir`` and wait until every TaskManager has registered.

    Args:
        dir: cluster directory (created; conf/, log/, tmp/, cluster.json).
        task_managers: TaskManager processes (>= 1).
        slots: task slots per TaskManager (>= 1).
        jm_memory: ``jobmanager.memory.process.size``.
        tm_memory: ``taskmanager.memory.process.size`` of each TaskManager.
        tm_network: its network buffer memory (``taskmanager.memory.network.min`` = ``max``).
        heartbeat_timeout_s: a TaskManager silent this long is dead (its job fails).
        timeout_s: how long to wait for the REST API to list every TaskManager.

    Returns:
        The running cluster (stop it with :func:`stop_cluster`, or use it as a context manager).

    Raises:
        FlinkClusterError: bad sizes, a cluster already running in ``dir``, a process that died at start,
            or not ready in ``timeout_s`` (the processes started are stopped again).
        RunnerNotInstalledError: the cluster jars are not installed.
    """
    if task_managers < 1 or slots < 1:
        raise FlinkClusterError(f"`--task-managers` ({task_managers}) and `--slots` ({slots}) must be >= 1")
    lib = flink_cluster_lib()
    root = Path(dir).resolve()
    existing = _load_state(root)
    if existing is not None and any(existing.alive().values()):
        raise FlinkClusterError(f"a Flink cluster is already running in {root} (REST {existing.rest_address}); "
                                f"stop it with `trajpipe flink-cluster down --dir {root}`")
    conf, log_dir = root / "conf", root / "log"
    for d in (conf, log_dir, root / "tmp" / "io", root / "tmp" / "blob", root / "tmp" / "web"):
        d.mkdir(parents=True, exist_ok=True)
    cluster = FlinkCluster(dir=str(root), rest_port=free_port(), rpc_port=free_port(),
                           sdk_worker_command=str(root / "bin" / "beam-sdk-worker"), task_managers=task_managers,
                           slots=slots)
    _write_sdk_worker_command(Path(cluster.sdk_worker_command))
    (conf / "config.yaml").write_text(_config(
        root, rest_port=cluster.rest_port, rpc_port=cluster.rpc_port, task_managers=task_managers, slots=slots,
        jm_memory=jm_memory, tm_memory=tm_memory, tm_network=tm_network, heartbeat_timeout_s=heartbeat_timeout_s))
    (conf / "log4j.properties").write_text(_LOG4J)
    jm_jvm, jm_dyn = _resource_params(lib, conf, "GET_JM_RESOURCE_PARAMS")
    tm_jvm, tm_dyn = _resource_params(lib, conf, "GET_TM_RESOURCE_PARAMS")
    try:
        cluster.pids["jobmanager"] = _jvm(lib, conf, log_dir, "jobmanager", JOBMANAGER_CLASS, jm_jvm, jm_dyn)
        for i in range(task_managers):
            cluster.pids[f"taskmanager-{i}"] = _jvm(lib, conf, log_dir, f"taskmanager-{i}", TASKMANAGER_CLASS,
                                                    tm_jvm, tm_dyn)
        _save_state(cluster)
        _wait_ready(cluster, timeout_s=timeout_s)
    except BaseException:
        stop_cluster(cluster)
        raise
    _LOG.info("Flink session cluster up: REST %s, %d TaskManagers x %d slots, logs %s",
              cluster.rest_address, task_managers, slots, log_dir)
    return cluster


def _wait_ready(cluster: FlinkCluster, *, timeout_s: float) -> None:
    deadline = time.monotonic() + timeout_s
    registered = 0
    while time.monotonic() < deadline:
        dead = [role for role, ok in cluster.alive().items() if not ok]
        if dead:
            raise FlinkClusterError(f"Flink cluster process {', '.join(dead)} exited at start; see "
                                    f"{cluster.log_dir}/{dead[0]}.out and .log")
        try:
            registered = len(cluster.rest("/taskmanagers", timeout_s=2.0)["taskmanagers"])
        except FlinkClusterError:
            registered = 0
        if registered >= cluster.task_managers:
            return
        time.sleep(0.5)
    raise FlinkClusterError(f"Flink cluster not ready after {timeout_s:g} s ({registered}/{cluster.task_managers} "
                            f"TaskManagers registered); see the logs in {cluster.log_dir}")


def _save_state(cluster: FlinkCluster) -> None:
    path = Path(cluster.dir) / _STATE_FILE
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(asdict(cluster), indent=2))
    tmp.replace(path)


def _load_state(root: Path) -> FlinkCluster | None:
    try:
        return FlinkCluster(**json.loads((root / _STATE_FILE).read_text()))
    except FileNotFoundError:
        return None
    except (ValueError, TypeError) as err:
        raise FlinkClusterError(f"{root / _STATE_FILE} is not a cluster record ({err})") from err


def load_cluster(dir: str | Path) -> FlinkCluster:
    """The cluster recorded in ``dir`` (by :func:`start_cluster`).

    Raises:
        FlinkClusterError: no cluster was started there.
    """
    root = Path(dir).resolve()
    cluster = _load_state(root)
    if cluster is None:
        raise FlinkClusterError(f"no Flink cluster in {root} (no {_STATE_FILE}); start one with "
                                f"`trajpipe flink-cluster up --dir {root}`")
    return cluster


def stop_cluster(cluster: FlinkCluster | str | Path, *, timeout_s: float = 30.0) -> dict[str, int]:
    """Stop every process of the cluster: SIGTERM (Flink shuts down cleanly), SIGKILL after ``timeout_s``.

    Args:
        cluster: the cluster, or its directory.
        timeout_s: grace period before SIGKILL.

    Returns:
        ``{"stopped": n, "killed": k}``: processes that were running, and of those the ones SIGKILLed.
    """
    if not isinstance(cluster, FlinkCluster):
        cluster = load_cluster(cluster)
    running = {role: pid for role, pid in cluster.pids.items() if _pid_alive(pid)}
    # TaskManagers first, so the JobManager does not log them as lost for long.
    order = sorted(running, key=lambda r: r == "jobmanager")
    for role in order:
        try:
            os.killpg(running[role], signal.SIGTERM)  # the session holds the JVM and its SDK workers
        except ProcessLookupError:
            pass
    deadline = time.monotonic() + timeout_s
    while time.monotonic() < deadline and any(_pid_alive(p) for p in running.values()):
        _reap(running.values())
        time.sleep(0.2)
    killed = 0
    for pid in running.values():
        if _pid_alive(pid):
            killed += 1
            try:
                os.killpg(pid, signal.SIGKILL)
            except ProcessLookupError:
                pass
    _reap(running.values())
    return {"stopped": len(running), "killed": killed}


def _reap(pids) -> None:
    for pid in pids:
        try:
            os.waitpid(pid, os.WNOHANG)
        except ChildProcessError:
            pass


def cluster_command(action: str, *, dir: str | Path, task_managers: int = 2, slots: int = 1,
                    timeout_s: float = 180.0) -> dict[str, Any]:
    """``trajpipe flink-cluster up|down|status``: what each prints as its last line.

    Args:
        action: ``up`` (start and wait until ready), ``down`` (stop), ``status`` (ask the REST API).
        dir: the cluster directory.
        task_managers: TaskManagers to start (``up``).
        slots: slots per TaskManager (``up``).
        timeout_s: how long ``up`` waits for the TaskManagers to register.

    Returns:
        ``up``: ``flink_master``, ``task_managers``, ``slots`` and the Beam options to pass (``beam_args``);
        ``down``: ``stopped``, ``killed``; ``status``: ``task_managers`` registered, ``slots``, ``jobs`` and
        ``jobs_finished``.

    Raises:
        FlinkClusterError: an unknown action, or the cluster cannot be started, found or reached.
    """
    if action == "up":
        cluster = start_cluster(dir, task_managers=task_managers, slots=slots, timeout_s=timeout_s)
        return {"flink_master": cluster.rest_address, "task_managers": cluster.task_managers, "slots": cluster.slots,
                "beam_args": " ".join(shlex.quote(a) for a in cluster.beam_args())}
    if action == "down":
        return stop_cluster(dir)
    if action == "status":
        cluster = load_cluster(dir)
        if not any(cluster.alive().values()):
            raise FlinkClusterError(f"the Flink cluster in {cluster.dir} is not running; start it with "
                                    f"`trajpipe flink-cluster up --dir {cluster.dir}`")
        tms = cluster.rest("/taskmanagers")["taskmanagers"]
        jobs = cluster.jobs()
        return {"flink_master": cluster.rest_address, "task_managers": len(tms),
                "slots": sum(t["slotsNumber"] for t in tms), "jobs": len(jobs),
                "jobs_finished": sum(j["state"] == "FINISHED" for j in jobs)}
    raise FlinkClusterError(f"unknown action {action!r}; use up, down or status")
