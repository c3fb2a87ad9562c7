"""The embedded broker with ``auth="sasl-ssl"``: TLS, SCRAM users, ACLs, and the errors clients get."""

from __future__ import annotations

import stat
import subprocess
import sys
from pathlib import Path

import msgspec
import pytest

from schemas.events import EpisodeStarted
from streams.admin import ensure_topics
from streams.broker import BrokerError, broker_status, start_broker
from streams.config import KafkaConnection, Topics
from streams.consumer import OffsetRange, end_offsets, read_range
from streams.errors import KafkaAccessDenied, KafkaAuthError, KafkaUnavailable, check_kafka
from streams.fetch import PartitionReader, read_partition
from streams.producer import EventProducer
from tests.helpers import free_port

pytestmark = pytest.mark.integration

REPO_ROOT = Path(__file__).resolve().parents[2]


def _events(n: int) -> list[EpisodeStarted]:
    return [EpisodeStarted(event_id=f"e{i}", episode_id=f"ep{i}", seq=0, producer_id="w0", domain="math",
                           task_id="t", task_spec="{}") for i in range(n)]


def test_acl_user_produces_and_reads_over_sasl_ssl(kafka_auth_broker, topic_name, tmp_path, monkeypatch):
    import streams.fetch as fetch

    received = []
    recv = fetch._recv_large
    monkeypatch.setattr(fetch, "_recv_large", lambda transport: received.append(recv(transport)) or received[-1])
    info = kafka_auth_broker.info
    assert broker_status(info.data_dir) == info and info.auth == "sasl-ssl"
    auth_dir = info.data_dir / "auth"
    for name in ("ca.key", "server.pem", "admin.password"):  # private material: owner only
        assert stat.S_IMODE((auth_dir / name).stat().st_mode) == 0o600, name
    assert stat.S_IMODE((info.data_dir / "server.properties").stat().st_mode) == 0o600
    conn = kafka_auth_broker.conn("alice")
    topics = Topics(events=topic_name, dead_letters=f"{topic_name}.dl", control=f"{topic_name}.ctl", partitions=2)
    assert len(ensure_topics(conn, topics)) == 3
    with EventProducer(conn, topic_name, spool_dir=tmp_path) as producer:
        for ev in _events(5):
            producer.emit(ev)
        assert producer.flush().spooled == 0
    end = end_offsets(conn, topic_name)
    assert sum(end.values()) == 5
    ranges = [OffsetRange(topic=topic_name, partition=p, start=0, end=e) for p, e in end.items()]
    assert sum(len(batch) for batch in read_range(conn, ranges)) == 5  # kafka-python's consumer
    with PartitionReader(conn) as reader:  # the fetch path (kafka-python's connection, our Fetch requests)
        assert sum(len(c) for r in ranges for c in read_partition(reader, r)) == 5
    assert received and all(err is None for _data, err in received)  # its TLS connection, with 1 MiB recvs


def test_plaintext_and_unverified_tls_clients_are_refused(kafka_auth_broker):
    plain = KafkaConnection(bootstrap_servers=kafka_auth_broker.bootstrap, client_id="plain")
    with pytest.raises(KafkaAuthError, match="kafka.security_protocol"):
        check_kafka(plain)
    no_ca = msgspec.structs.replace(kafka_auth_broker.conn("alice"), ssl_cafile=None)
    with pytest.raises(KafkaAuthError, match="could not verify the certificate.*kafka.ssl_cafile"):
        check_kafka(no_ca)


def test_wrong_password_is_one_error_naming_client_user_and_setting(kafka_auth_broker):
    conn = kafka_auth_broker.conn("alice", client_id="trajpipe-archiver", password="not-the-password")
    with pytest.raises(KafkaAuthError) as err:
        check_kafka(conn)
    msg = str(err.value)
    assert "rejected the credentials of client 'trajpipe-archiver'" in msg
    assert "user 'alice'" in msg and "kafka.sasl_password_file" in msg
    assert "not-the-password" not in msg and "not-the-password" not in repr(conn)
    # the same through the components that build kafka-python clients, instead of a bootstrap timeout
    with pytest.raises(KafkaAuthError, match="rejected the credentials"):
        ensure_topics(conn, Topics(events="trajpipe.x"))
    with pytest.raises(KafkaAuthError, match="rejected the credentials"):
        PartitionReader(conn)


def test_missing_acl_is_access_denied_naming_user_and_fix(kafka_auth_broker, topic_name, tmp_path):
    with pytest.raises(KafkaAccessDenied, match=r"denied client 'trajpipe-test' \(SASL SCRAM-SHA-512 user 'bob'\)"
                                                r".*trajpipe broker acl add --user bob"):
        ensure_topics(kafka_auth_broker.conn("bob"), Topics(events=topic_name))
    ensure_topics(kafka_auth_broker.conn("alice"), Topics(events=topic_name, dead_letters=f"{topic_name}.dl",
                                                         control=f"{topic_name}.ctl", partitions=1))
    # reader may read but not write: the refused events stay in the spool, and flush() says why
    with pytest.raises(KafkaAccessDenied, match=f"write to topic '{topic_name}'"):
        with EventProducer(kafka_auth_broker.conn("reader"), topic_name, spool_dir=tmp_path) as producer:
            producer.emit(_events(1)[0])
            producer.flush()
    assert producer.stats().pending == 1


def test_unreachable_broker_is_kafka_unavailable_within_the_timeout():
    conn = KafkaConnection(bootstrap_servers=f"127.0.0.1:{free_port()}", client_id="x", connect_timeout_s=0.5)
    with pytest.raises(KafkaUnavailable, match="cannot reach Kafka.*kafka.connect_timeout_s"):
        check_kafka(conn)


def test_auth_mode_needs_kafka_engine(tmp_path):
    with pytest.raises(BrokerError, match="needs `--engine kafka`"):
        start_broker(engine="tansu", port=free_port(), data_dir=tmp_path, auth="sasl-ssl")
    with pytest.raises(BrokerError, match="unknown broker `auth`"):
        start_broker(engine="kafka", port=free_port(), data_dir=tmp_path, auth="kerberos")


def _cli(*args: str) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "trajpipe", *args], cwd=REPO_ROOT, capture_output=True, text=True,
                          timeout=120, check=False)


def test_cli_user_add_and_acl_add_let_a_new_user_in(kafka_auth_broker, tmp_path, topic_name):
    data_dir = str(kafka_auth_broker.info.data_dir)
    pw = tmp_path / "carol.password"
    pw.write_text("carol-Secret-123\n")
    added = _cli("broker", "user", "add", "carol", "--password-file", str(pw), "--data-dir", data_dir)
    assert added.returncode == 0, added.stderr
    carol = kafka_auth_broker.conn("carol", password="carol-Secret-123")
    check_kafka(carol)  # authenticates ...
    topics = Topics(events=f"carol.{topic_name}", dead_letters="carol.dl", control="carol.ctl")
    with pytest.raises(KafkaAccessDenied):  # ... but may do nothing yet
        ensure_topics(carol, topics)
    granted = _cli("broker", "acl", "add", "--user", "carol", "--topic-prefix", "carol.", "--data-dir", data_dir)
    assert granted.returncode == 0, granted.stderr
    assert granted.stdout.strip().splitlines()[-1] == '{"acls": 6}'
    assert len(ensure_topics(carol, topics)) == 3
    assert "carol-Secret-123" not in added.stdout + added.stderr + granted.stdout + granted.stderr


def test_a_data_dir_keeps_the_auth_mode_it_was_formatted_with(tmp_path):
    (tmp_path / "kafka-logs").mkdir()
    (tmp_path / "kafka-logs" / "meta.properties").write_text("node.id=1\n")  # formatted, as after a first start
    (tmp_path / "auth.mode").write_text("sasl-ssl\n")
    with pytest.raises(BrokerError, match="first started with `--auth sasl-ssl`, not `--auth none`"):
        start_broker(engine="kafka", port=free_port(), data_dir=tmp_path)
    assert broker_status(tmp_path) is None  # nothing was launched


class _HangUpProxy:
    """A TCP proxy in front of ``target`` that resets the first ``hang_ups`` connections (a broker going down under
    the client, or a listener of another protocol) and forwards the later ones."""

    def __init__(self, target: tuple[str, int], hang_ups: int) -> None:
        import socket
        import threading

        self.target, self.left, self.seen = target, hang_ups, 0
        self.listener = socket.create_server(("127.0.0.1", 0))
        self.port = self.listener.getsockname()[1]
        threading.Thread(target=self._serve, daemon=True).start()

    def _serve(self) -> None:
        import contextlib
        import socket
        import struct
        import threading

        while True:
            try:
                client, _ = self.listener.accept()
            except OSError:
                return
            self.seen += 1
            if self.left > 0:
                self.left -= 1
                client.settimeout(5)
                with contextlib.suppress(OSError):
                    client.recv(4)  # the request's first bytes: the client is past its connect
                client.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))
                client.close()  # RST: ConnectionResetError on the client's side
                continue
            upstream = socket.create_connection(self.target)
            for a, b in ((client, upstream), (upstream, client)):
                threading.Thread(target=self._pipe, args=(a, b), daemon=True).start()

    @staticmethod
    def _pipe(a, b) -> None:
        try:
            while data := a.recv(65536):
                b.sendall(data)
        except OSError:
            pass
        finally:
            for s in (a, b):
                s.close()

    def close(self) -> None:
        self.listener.close()


@pytest.mark.parametrize("hang_ups, refused", [(1, False), (2, False), (1000, True)])
def test_a_hang_up_on_the_handshake_is_asked_again_and_only_a_listener_that_always_hangs_up_is_refused(
        kafka_broker, hang_ups, refused):
    """A broker killed or restarting while a client connects resets that connection; it used to be reported at
    once as a protocol mismatch ("the listener may require TLS or SASL", exit 2, the end of a --loop job).
    Now the client asks again; only the third hang-up is that error."""
    host, _, port = kafka_broker.bootstrap.rpartition(":")
    proxy = _HangUpProxy((host, int(port)), hang_ups)
    try:
        conn = KafkaConnection(bootstrap_servers=f"127.0.0.1:{proxy.port}", client_id="x", connect_timeout_s=20)
        if refused:
            with pytest.raises(KafkaAuthError, match=r"did not answer client 'x' over PLAINTEXT .* may require TLS"):
                check_kafka(conn)
            assert proxy.seen == 3
        else:
            check_kafka(conn)
            assert proxy.seen == hang_ups + 1
    finally:
        proxy.close()
