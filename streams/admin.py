"""Topic administration: create the project's topics, idempotently.

:func:`ensure_topics` creates the events topic with ``Topics.partitions``
partitions and the dead-letters and control topics with one partition each
(control events are few and must stay in order; dead letters are rare).

A topic that already exists is fine. One that exists with *fewer* partitions
than asked raises :class:`TopicMismatchError`: events are keyed by
``episode_id``, and silently using (or growing) a different partition count
would change which partition an episode lands on. More partitions than asked
is accepted and logged.

Examples:
    >>> topic_specs(Topics(partitions=8))
    {'trajpipe.events': 8, 'trajpipe.dead-letters': 1, 'trajpipe.control': 1}
"""

from __future__ import annotations

import logging
import time
from typing import Any

from kafka import KafkaAdminClient
from kafka import errors as kafka_errors
from kafka.admin import NewTopic

from streams.config import ConfigError, KafkaConnection, Topics

__all__ = ["TopicMismatchError", "ensure_topics", "topic_specs", "topic_partition_counts"]

log = logging.getLogger(__name__)


class TopicMismatchError(ConfigError):
    """A topic exists with fewer partitions than the settings ask for."""


def topic_specs(topics: Topics) -> dict[str, int]:
    """``topic name -> partition count`` the project needs.

    Examples:
        >>> topic_specs(Topics(events="ev", dead_letters="dl", control="ctl", partitions=2))
        {'ev': 2, 'dl': 1, 'ctl': 1}
    """
    return {topics.events: topics.partitions, topics.dead_letters: 1, topics.control: 1}


def topic_partition_counts(admin: KafkaAdminClient, names: list[str]) -> dict[str, int]:
    """Partition counts of the named topics that exist (missing topics are left out)."""
    out: dict[str, int] = {}
    for desc in admin.describe_topics(names):
        if desc.get("error_code", 0) == 0 and desc.get("partitions"):
            out[desc["name"]] = len(desc["partitions"])
    return out


def ensure_topics(conn: KafkaConnection, topics: Topics, *, timeout_s: float = 30.0) -> list[str]:
    """Create the events, dead-letters and control topics that do not exist yet.

    Args:
        conn: the cluster.
        topics: names, events partition count and replication factor.
        timeout_s: how long to wait for new topics to show up in metadata.

    Returns:
        Names of the topics this call created (empty when all existed).

    Raises:
        TopicMismatchError: a topic exists with fewer partitions than asked.
        kafka.errors.KafkaError: the broker refused to create a topic.
    """
    specs = topic_specs(topics)
    admin = KafkaAdminClient(**conn.client_kwargs())
    try:
        existing = _describe(admin, list(specs))
        created: list[str] = []
        for name, partitions in specs.items():
            if name in existing:
                continue
            try:
                admin.create_topics(
                    [NewTopic(name, partitions, topics.replication_factor)],
                    timeout_ms=int(timeout_s * 1000),
                )
                created.append(name)
                log.info("created topic %s (%d partitions)", name, partitions)
            except kafka_errors.TopicAlreadyExistsError:
                pass  # created concurrently by another process
        counts = _wait_for(admin, specs, timeout_s)
        for name, partitions in specs.items():
            have = counts[name]
            if have < partitions:
                raise TopicMismatchError(
                    f"topic {name!r} exists with {have} partitions but {partitions} were asked for; "
                    f"delete it, use a new topic name, or set `partitions` to {have}"
                )
            if have > partitions:
                log.info("topic %s has %d partitions (asked for %d); using it as is", name, have, partitions)
        return created
    finally:
        admin.close()


def _describe(admin: KafkaAdminClient, names: list[str]) -> dict[str, int]:
    try:
        return topic_partition_counts(admin, names)
    except kafka_errors.UnknownTopicOrPartitionError:
        # Some brokers fail the whole request when one topic is missing.
        out: dict[str, int] = {}
        for name in names:
            try:
                out.update(topic_partition_counts(admin, [name]))
            except kafka_errors.UnknownTopicOrPartitionError:
                pass
        return out


def _wait_for(admin: KafkaAdminClient, specs: dict[str, Any], timeout_s: float) -> dict[str, int]:
    deadline = time.monotonic() + timeout_s
    while True:
        counts = _describe(admin, list(specs))
        if all(name in counts for name in specs):
            return counts
        if time.monotonic() >= deadline:
            missing = sorted(set(specs) - set(counts))
            raise kafka_errors.KafkaTimeoutError(f"topics {missing} not visible in metadata after {timeout_s}s")
        time.sleep(0.1)
