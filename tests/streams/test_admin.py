"""ensure_topics against real brokers."""

from __future__ import annotations

import pytest
from kafka import KafkaAdminClient
from kafka.admin import NewTopic

from streams.admin import TopicMismatchError, ensure_topics, topic_partition_counts
from streams.config import Topics

pytestmark = pytest.mark.integration


def test_ensure_topics_is_idempotent(conn, topics):
    assert sorted(ensure_topics(conn, topics)) == sorted([topics.events, topics.dead_letters, topics.control])
    assert ensure_topics(conn, topics) == []
    admin = KafkaAdminClient(**conn.client_kwargs())
    try:
        counts = topic_partition_counts(admin, [topics.events, topics.dead_letters, topics.control])
    finally:
        admin.close()
    assert counts == {topics.events: 3, topics.dead_letters: 1, topics.control: 1}


def test_fewer_partitions_than_asked_is_an_error(conn, topic_name):
    admin = KafkaAdminClient(**conn.client_kwargs())
    try:
        admin.create_topics([NewTopic(topic_name, 1, 1)])
    finally:
        admin.close()
    topics = Topics(events=topic_name, dead_letters=f"{topic_name}.dl", control=f"{topic_name}.ctl", partitions=4)
    with pytest.raises(TopicMismatchError, match="1 partitions but 4"):
        ensure_topics(conn, topics)
    # asking for no more than it has is fine
    assert ensure_topics(conn, Topics(events=topic_name, dead_letters=f"{topic_name}.dl",
                                      control=f"{topic_name}.ctl", partitions=1)) == []


def test_a_broker_killed_while_the_topics_are_created_is_waited_for_and_asked_again(tmp_path, monkeypatch):
    """The broker answers the client's check, then dies under its CreateTopics request and restarts: the topics
    are created once it is back. (A fault run's `trajpipe synth` ended with `error: KafkaConnectionError`.)"""
    import signal

    from streams.broker import broker_status, free_port, start_broker, stop_broker
    from streams.config import KafkaConnection

    port, data_dir = free_port(restartable=True), tmp_path / "broker"
    start_broker(engine="kafka", port=port, data_dir=data_dir)
    lost: list[BaseException] = []
    real = KafkaAdminClient.create_topics

    def create_on_a_dying_broker(self, *args, **kwargs):
        if lost:
            return real(self, *args, **kwargs)
        import os

        import socket
        import time

        pid = broker_status(data_dir).pid
        os.kill(pid, signal.SIGKILL)  # under the request, as `kill -9` would
        try:
            return real(self, *args, **kwargs)
        except BaseException as err:
            lost.append(err)
            raise
        finally:
            for _ in range(400):  # its port free again (a JVM takes a moment to die)
                with socket.socket() as probe:
                    try:
                        probe.bind(("127.0.0.1", port))
                        break
                    except OSError:
                        time.sleep(0.05)
            start_broker(engine="kafka", port=port, data_dir=data_dir)  # back before the client asks again

    monkeypatch.setattr(KafkaAdminClient, "create_topics", create_on_a_dying_broker)
    try:
        conn = KafkaConnection(bootstrap_servers=f"127.0.0.1:{port}", request_timeout_ms=2_000, connect_timeout_s=60)
        topics = Topics(events="lost.events", dead_letters="lost.dl", control="lost.ctl", partitions=2)
        created = ensure_topics(conn, topics)
        assert len(lost) == 1 and getattr(lost[0], "retriable", False), lost
        assert set(created) <= {"lost.events", "lost.dl", "lost.ctl"}
        admin = KafkaAdminClient(**conn.client_kwargs())
        try:
            assert topic_partition_counts(admin, ["lost.events"]) == {"lost.events": 2}
        finally:
            admin.close()
    finally:
        stop_broker(data_dir)
