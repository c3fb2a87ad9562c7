"""The policy follower on a broker that requires SASL_SSL and ACLs (``kafka_auth_broker``)."""

from __future__ import annotations

import time

import pytest

from rollout.reload import PolicyFollower, make_policy_published
from streams.admin import ensure_topics
from streams.config import Topics
from streams.errors import KafkaAccessDenied, KafkaAuthError
from streams.producer import EventProducer

pytestmark = pytest.mark.integration


def test_follower_sees_publications_as_an_acl_user_and_refusals_are_clear(kafka_auth_broker, topic_name, tmp_path):
    control = f"{topic_name}.ctl"
    alice = kafka_auth_broker.conn("alice", client_id="trajpipe-rollout")
    ensure_topics(alice, Topics(events=topic_name, dead_letters=f"{topic_name}.dl", control=control))
    with PolicyFollower(alice, control) as follower, EventProducer(alice, control, spool_dir=tmp_path) as producer:
        producer.emit(make_policy_published(version=3, location="/policies/v3", producer_id="test"))
        producer.flush()
        deadline = time.monotonic() + 30  # a bound on waiting, not a measured time
        while follower.latest is None and time.monotonic() < deadline:
            time.sleep(0.1)
        assert follower.latest is not None and follower.latest.version == 3

    with pytest.raises(KafkaAccessDenied, match=f"user 'bob'.*read topic '{control}'"):
        PolicyFollower(kafka_auth_broker.conn("bob", client_id="trajpipe-rollout"), control).start()
    with pytest.raises(KafkaAuthError, match="rejected the credentials of client 'trajpipe-rollout'"):
        PolicyFollower(kafka_auth_broker.conn("alice", client_id="trajpipe-rollout", password="nope"), control).start()
