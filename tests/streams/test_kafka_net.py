"""kafka-python's network client as this project builds it: no false "blocking the event loop" warning on a large
fetch, no ERROR for a metadata refresh or a socket read cut short by the client's own close (streams/kafka_net.py)."""

from __future__ import annotations

import errno
import logging
import os
import signal
import time

import kafka.errors as Errors
import pytest
from kafka import KafkaAdminClient, KafkaConsumer, KafkaProducer

import streams.kafka_net as kafka_net
from streams.admin import ensure_topics
from streams.consumer import end_offsets, ranges_from, read_range
from streams.fetch import PartitionReader, read_partition


def _cluster_log() -> logging.Logger:
    return logging.getLogger("kafka.cluster")


class _Net:
    _io_thread = None  # no IO thread: the client's loop runs on the caller's, as before kafka-python started one


class _Client:
    """What net_client's close marking reads of a client: its selector's IO thread."""

    _net = _Net()


def _log_while_closing(*errors) -> None:
    """Log a failed refresh for each of ``errors`` from inside a close marked as net_client marks it."""
    def close():
        for err in errors:
            _cluster_log().error("Metadata refresh: failed %s", err)

    kafka_net._close_marked(_Client(), close)


def _log_recv_failure(err: BaseException) -> None:
    """What kafka.net.transport's ``_sock_recv`` logs when ``sock.recv`` raises ``err``."""
    try:
        raise err
    except BaseException:
        logging.getLogger("kafka.net.transport").exception("%s: Error receiving network data closing socket",
                                                           "<KafkaTCPTransport [none] (closed)>")


_CLOSE_ARTIFACTS = (Errors.Cancelled(), RuntimeError("Transport closed for writes"), RuntimeError("NetworkSelector closed!"),
                    Errors.KafkaConnectionError("Node not connected"))


def test_a_refresh_cancelled_by_a_close_is_debug_not_error(caplog):
    caplog.set_level(logging.INFO, logger="kafka.cluster")
    _log_while_closing(*_CLOSE_ARTIFACTS)
    assert [r for r in caplog.records if r.name == "kafka.cluster"] == []

    caplog.set_level(logging.DEBUG, logger="kafka.cluster")
    _log_while_closing(*_CLOSE_ARTIFACTS)
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "kafka.cluster"] == [
        ("DEBUG", "Metadata refresh: failed Cancelled"),
        ("DEBUG", "Metadata refresh: failed Transport closed for writes"),
        ("DEBUG", "Metadata refresh: failed NetworkSelector closed!"),
        ("DEBUG", "Metadata refresh: failed KafkaConnectionError: Node not connected"),
    ]
    assert not kafka_net._CLOSING  # the mark ends with the close


def test_a_read_woken_by_its_clients_close_is_debug_but_another_read_failure_is_an_error(caplog):
    """kafka-python #3097: the close sets the socket to None, and a read it woke calls ``None.recv``."""
    caplog.set_level(logging.INFO, logger="kafka.net.transport")
    gone, closed = AttributeError("'NoneType' object has no attribute 'recv'"), OSError(errno.EBADF, "Bad file descriptor")
    kafka_net._close_marked(_Client(), lambda: (_log_recv_failure(gone), _log_recv_failure(closed)))
    assert [r for r in caplog.records if r.name == "kafka.net.transport"] == []
    reset = ConnectionResetError(errno.ECONNRESET, "Connection reset by peer")
    kafka_net._close_marked(_Client(), lambda: _log_recv_failure(reset))  # the broker's doing, close or not
    _log_recv_failure(gone)  # not in a close: whatever set the socket to None, it is not ours to hide
    assert [(r.levelname, type(r.exc_info[1])) for r in caplog.records if r.name == "kafka.net.transport"] == [
        ("ERROR", ConnectionResetError), ("ERROR", AttributeError)]


def test_a_refresh_that_really_failed_is_still_an_error(caplog):
    """Another cause, another message, or the same two outside a close (a connection the broker dropped)."""
    caplog.set_level(logging.INFO, logger="kafka.cluster")
    _log_while_closing(Errors.KafkaConnectionError("broker gone"), "a string, not an error", [1, 2])
    _cluster_log().error("something else: %s", Errors.Cancelled())
    for err in _CLOSE_ARTIFACTS:
        _cluster_log().error("Metadata refresh: failed %s", err)
    assert [(r.levelname, r.getMessage()) for r in caplog.records if r.name == "kafka.cluster"] == [
        ("ERROR", "Metadata refresh: failed KafkaConnectionError: broker gone"),
        ("ERROR", "Metadata refresh: failed a string, not an error"),
        ("ERROR", "Metadata refresh: failed [1, 2]"),
        ("ERROR", "something else: Cancelled"),
        ("ERROR", "Metadata refresh: failed Cancelled"),
        ("ERROR", "Metadata refresh: failed Transport closed for writes"),
        ("ERROR", "Metadata refresh: failed NetworkSelector closed!"),
        ("ERROR", "Metadata refresh: failed KafkaConnectionError: Node not connected"),
    ]


def test_a_forked_worker_starts_with_no_close_under_way():
    """The jobs fork their workers from a driver whose other threads may be closing a client at that moment."""
    def close():
        pid = os.fork()  # inside a marked close, as a closing thread of the driver would be at the fork
        if pid == 0:  # the child: nothing of it is closing; its own close marks and unmarks as usual
            try:
                ok = not kafka_net._CLOSING
                kafka_net._close_marked(_Client(), lambda: None)
                os._exit(0 if ok and not kafka_net._CLOSING else 3)
            except BaseException:
                os._exit(4)
        return pid

    pid = kafka_net._close_marked(_Client(), close)
    deadline = time.monotonic() + 20
    while (done := os.waitpid(pid, os.WNOHANG))[0] == 0 and time.monotonic() < deadline:
        time.sleep(0.05)
    if done[0] == 0:
        os.kill(pid, signal.SIGKILL)
        os.waitpid(pid, 0)
        pytest.fail("the forked child hung")
    assert os.waitstatus_to_exitcode(done[1]) == 0
    assert not kafka_net._CLOSING


@pytest.mark.integration
def test_clients_closed_mid_refresh_log_no_error(conn, topics, caplog):
    """Forty rounds of the clients the jobs build and close, each closed right after a refresh was asked for.

    Before the close was marked: 30 such rounds logged "Metadata refresh: failed Cancelled" 11 times and
    "Metadata refresh: failed Transport closed for writes" twice, all at ERROR, all on the closing clients'
    IO threads (the kind is a race: a round may log neither). Each round also reads an exact range.
    """
    ensure_topics(conn, topics)
    producer = KafkaProducer(**conn.client_kwargs())
    for k in range(600):
        producer.send(topics.events, key=f"e{k}".encode(), value=b"y" * 100)
    producer.close()
    caplog.set_level(logging.DEBUG, logger="kafka.cluster")
    caplog.set_level(logging.DEBUG, logger="kafka.net.transport")
    for i in range(40):
        end_offsets(conn, topics.events)
        with PartitionReader(conn) as reader:
            reader._client.cluster.request_update()
        producer = KafkaProducer(**conn.client_kwargs())
        producer.send(topics.events, b"x")
        producer.close()
        consumer = KafkaConsumer(topics.events, **conn.client_kwargs())
        consumer.poll(timeout_ms=10)
        consumer.close()
        # an exact-range read closes its consumer with the next fetch in flight: 30 such reads logged one each of
        # "NetworkSelector closed!", "Node not connected" and kafka-python #3097's None.recv, at ERROR
        end = {tp: n - i % 3 for tp, n in end_offsets(conn, topics.events).items()}
        assert sum(map(len, read_range(conn, ranges_from(topic=topics.events, start={}, end=end)))) > 0
    failed = [(r.name, r.levelname, r.getMessage()) for r in caplog.records
              if r.name == "kafka.cluster" and r.getMessage().startswith("Metadata refresh: failed")
              or r.name == "kafka.net.transport" and r.msg == kafka_net._RECV_FAILED]
    assert [f for f in failed if f[1] != "DEBUG"] == []
    assert not kafka_net._CLOSING


@pytest.mark.integration
def test_every_client_kind_gets_the_threshold(conn, monkeypatch):
    """Producer, consumer, admin client and PartitionReader are all built by net_client (a spy counts them)."""
    built = []
    real = kafka_net.KafkaNetClient

    def spy(**configs):
        built.append(configs.get("slow_task_threshold_secs"))
        return real(**configs)

    monkeypatch.setattr(kafka_net, "KafkaNetClient", spy)
    for make in (lambda: KafkaProducer(**conn.client_kwargs()), lambda: KafkaConsumer(**conn.client_kwargs()),
                 lambda: KafkaAdminClient(**conn.client_kwargs()), lambda: PartitionReader(conn)):
        client = make()
        client.close()
    assert built == [kafka_net.SLOW_STEP_WARN_S] * 4


@pytest.mark.integration
def test_large_fetches_log_no_warning(conn, topics, caplog):
    """30 MB of incompressible records in one partition, read by a consumer and by the job's reader.

    With kafka-python's own threshold (0.1 s) this logged "Task ... ran for 0.103s ... It is blocking the
    event loop" on this machine (two of two runs of 20 MB); every record still arrives.
    """
    caplog.set_level(logging.INFO)
    ensure_topics(conn, topics)
    producer = KafkaProducer(**conn.client_kwargs(), linger_ms=20, batch_size=1 << 20, max_request_size=8 << 20)
    for _ in range(300):
        producer.send(topics.events, key=b"one-key", value=os.urandom(100_000))
    producer.flush()
    producer.close()
    ranges = ranges_from(topic=topics.events, start={}, end=end_offsets(conn, topics.events))
    assert sum(len(batch) for batch in read_range(conn, ranges, stall_timeout_s=10)) == 300
    with PartitionReader(conn) as reader:
        assert sum(len(c) for r in ranges for c in read_partition(reader, r, stall_timeout_s=10)) == 300
    noisy = [(r.name, r.levelname, r.getMessage()) for r in caplog.records
             if r.name.startswith("kafka") and r.levelno >= logging.WARNING]
    assert noisy == []
