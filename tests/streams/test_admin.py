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
