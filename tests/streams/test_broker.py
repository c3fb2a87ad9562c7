"""The embedded broker (``streams/broker.py``) against real brokers over TCP."""

from __future__ import annotations

import json
import os
import socket
import subprocess
import sys
from pathlib import Path

import pytest

from streams.broker import BrokerError, BrokerInfo, broker_status, start_broker, stop_broker
from tests.helpers import consume_messages, free_port, produce_messages

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]
MESSAGES = [(f"episode-{i % 3}".encode(), f"event-{i}".encode()) for i in range(7)]


def _round_trip(info: BrokerInfo, topic: str) -> None:
    produce_messages(info.bootstrap, topic, MESSAGES)
    assert sorted(consume_messages(info.bootstrap, topic, len(MESSAGES))) == sorted(MESSAGES)


@pytest.mark.parametrize("engine", ["kafka", "tansu"])
def test_shared_broker_serves_produce_and_consume(engine: str, request: pytest.FixtureRequest, topic_name: str) -> None:
    info: BrokerInfo = request.getfixturevalue(f"{engine}_broker")
    assert info.engine == engine
    assert info.bootstrap == f"127.0.0.1:{info.port}"
    assert broker_status(info.data_dir) == info
    _round_trip(info, topic_name)


def test_tansu_lifecycle(tmp_path: Path, topic_name: str) -> None:
    info = start_broker(engine="tansu", port=free_port(), data_dir=tmp_path)
    assert broker_status(tmp_path) == info
    _round_trip(info, topic_name)

    assert stop_broker(tmp_path) is True
    assert broker_status(tmp_path) is None
    assert not (tmp_path / "broker.pid").exists()
    assert stop_broker(tmp_path) is False


def _cli(data_dir: Path, *args: str) -> subprocess.CompletedProcess:
    """``python -m trajpipe broker ARGS --data-dir DATA_DIR``.

    capture_output also proves ``start`` detaches the broker: run() returns only once every
    holder of the pipes has exited, and the broker must not hold them.
    """
    return subprocess.run(
        [sys.executable, "-m", "trajpipe", "broker", *args, "--data-dir", str(data_dir)],
        check=False,
        cwd=REPO_ROOT,
        capture_output=True,
        text=True,
        timeout=180,
    )


@pytest.mark.slow
def test_kafka_cli_lifecycle_and_restart_keeps_messages(tmp_path: Path, topic_name: str) -> None:
    # One test for both, to start Kafka twice rather than three times:
    # CLI start -> status -> produce & consume -> CLI stop, then the API restarts the same data dir.
    port = free_port(restartable=True)  # restarted on it below
    started = _cli(tmp_path, "start", "--port", str(port))
    try:
        assert started.returncode == 0, started.stderr
        assert started.stdout.strip().splitlines()[-1] == f"127.0.0.1:{port}"
        info = broker_status(tmp_path)
        assert info is not None and info.engine == "kafka" and info.bootstrap == f"127.0.0.1:{port}"

        status = _cli(tmp_path, "status")
        assert status.returncode == 0, status.stderr
        assert f"running: kafka pid {info.pid} at 127.0.0.1:{port}" in status.stdout

        refused = _cli(tmp_path, "start", "--port", str(free_port()))
        assert refused.returncode != 0
        assert "already running" in refused.stderr and f"127.0.0.1:{port}" in refused.stderr

        _round_trip(info, topic_name)
    finally:
        stopped = _cli(tmp_path, "stop")
    assert stopped.returncode == 0, stopped.stderr
    assert stopped.stdout.strip() == "stopped"
    status = _cli(tmp_path, "status")
    assert status.returncode == 1 and status.stdout.strip() == "not running"
    assert broker_status(tmp_path) is None
    assert (tmp_path / "kafka-logs").is_dir()

    # same data dir and port: the log was kept, storage is not formatted again
    again = start_broker(engine="kafka", port=port, data_dir=tmp_path)
    try:
        assert broker_status(tmp_path) == again
        assert again.pid != info.pid and again.bootstrap == info.bootstrap
        assert sorted(consume_messages(again.bootstrap, topic_name, len(MESSAGES))) == sorted(MESSAGES)
        assert (tmp_path / "broker.log").read_text().count("formatted storage") == 1
    finally:
        assert stop_broker(tmp_path) is True
    assert broker_status(tmp_path) is None
    assert stop_broker(tmp_path) is False
    assert _cli(tmp_path, "stop").stdout.strip() == "not running"


@pytest.mark.parametrize("engine", ["kafka", "tansu"])
def test_start_on_busy_port_names_the_port(engine: str, tmp_path: Path) -> None:
    with socket.socket() as listener:
        listener.bind(("127.0.0.1", 0))
        listener.listen()
        port = listener.getsockname()[1]
        with pytest.raises(BrokerError, match=f"port {port} is already in use"):
            start_broker(engine=engine, port=port, data_dir=tmp_path)
    assert broker_status(tmp_path) is None
    assert not (tmp_path / "broker.pid").exists()


@pytest.mark.parametrize("engine", ["kafka", "tansu"])
def test_second_start_on_a_live_data_dir_is_refused(engine: str, request: pytest.FixtureRequest) -> None:
    info: BrokerInfo = request.getfixturevalue(f"{engine}_broker")
    with pytest.raises(BrokerError, match="already running") as err:
        start_broker(engine=engine, port=free_port(), data_dir=info.data_dir)
    assert info.bootstrap in str(err.value)
    assert broker_status(info.data_dir) == info  # untouched


@pytest.mark.parametrize("engine", ["kafka", "tansu"])
def test_stale_pid_file_never_kills_a_foreign_process(engine: str, tmp_path: Path) -> None:
    sleeper = subprocess.Popen(["sleep", "60"])
    try:
        record = {"pid": sleeper.pid, "engine": engine, "port": 9092, "bootstrap": "127.0.0.1:9092"}
        (tmp_path / "broker.pid").write_text(json.dumps(record))
        assert broker_status(tmp_path) is None
        assert stop_broker(tmp_path, timeout_s=1) is False
        assert sleeper.poll() is None, "stop_broker signalled a process that is not our broker"
        assert not (tmp_path / "broker.pid").exists()
    finally:
        sleeper.kill()
        sleeper.wait()


def test_dead_pid_in_pid_file_is_not_running(tmp_path: Path) -> None:
    gone = subprocess.Popen(["true"])
    gone.wait()
    record = {"pid": gone.pid, "engine": "tansu", "port": 1, "bootstrap": "127.0.0.1:1"}
    (tmp_path / "broker.pid").write_text(json.dumps(record))
    assert broker_status(tmp_path) is None
    assert stop_broker(tmp_path) is False


def test_missing_kafka_jars_say_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.setenv("TRAJPIPE_KAFKA_JARS", str(tmp_path / "no-jars"))
    with pytest.raises(BrokerError, match=r"make kafka-jars.*--engine tansu"):
        start_broker(engine="kafka", port=free_port(), data_dir=tmp_path / "broker")


def test_missing_java_says_what_to_do(tmp_path: Path, monkeypatch: pytest.MonkeyPatch) -> None:
    monkeypatch.delenv("JAVA_HOME", raising=False)
    monkeypatch.setenv("PATH", str(tmp_path))  # no java on it
    with pytest.raises(BrokerError, match=r"`java` not found.*--engine tansu"):
        start_broker(engine="kafka", port=free_port(), data_dir=tmp_path / "broker")


def test_unknown_engine_is_refused(tmp_path: Path) -> None:
    with pytest.raises(BrokerError, match="unknown broker `engine` 'redpanda'"):
        start_broker(engine="redpanda", port=free_port(), data_dir=tmp_path)


@pytest.mark.slow
def test_start_timeout_kills_the_broker_and_shows_its_log(tmp_path: Path) -> None:
    port = free_port()
    with pytest.raises(BrokerError, match="did not answer a metadata request in time") as err:
        start_broker(engine="kafka", port=port, data_dir=tmp_path, timeout_s=0.5)
    assert "last lines of" in str(err.value) and "broker.log" in str(err.value)
    assert broker_status(tmp_path) is None
    assert not (tmp_path / "broker.pid").exists()
    java = [p for p in os.listdir("/proc") if p.isdigit() and str(tmp_path) in _cmdline(int(p))]
    assert java == [], "the timed-out broker was left running"


def _cmdline(pid: int) -> str:
    try:
        return Path(f"/proc/{pid}/cmdline").read_bytes().decode(errors="replace")
    except OSError:
        return ""


def test_a_restartable_port_is_below_the_range_outgoing_connections_take_theirs_from():
    low = int(Path("/proc/sys/net/ipv4/ip_local_port_range").read_text().split()[0])
    ports = {free_port(restartable=True) for _ in range(20)}
    assert all(10_000 <= p < low for p in ports) and len(ports) > 1
    assert all(free_port(restartable=True, avoid=p) != p for p in ports)
