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
from streams.errors import KafkaUnavailable, check_kafka, kafka_access_errors

__all__ = [
    "ACL_OPERATIONS",
    "TopicMismatchError",
    "ensure_topics",
    "grant_acls",
    "raise_if_unauthorized",
    "topic_partition_counts",
    "topic_specs",
    "upsert_scram_user",
]

#: Operations :func:`grant_acls` knows, by the name the command line uses.
ACL_OPERATIONS = ("read", "write", "describe", "create")

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
        streams.errors.KafkaUnavailable: no broker answered within ``conn.connect_timeout_s`` (at the
            start, or after it went away mid-request), or it went away three times.
        streams.errors.KafkaAuthError: the broker refused this client's TLS or SASL credentials.
        streams.errors.KafkaAccessDenied: an ACL does not let this client describe or create the topics.
        kafka.errors.KafkaError: the broker refused to create a topic.
    """
    specs = topic_specs(topics)
    attempt = 0
    while True:
        attempt += 1
        check_kafka(conn)  # waits for a broker that is down (KafkaUnavailable past connect_timeout_s)
        try:
            with kafka_access_errors(conn, what=f"describe/create topics {', '.join(specs)}"):
                return _ensure(conn, topics, specs, timeout_s)
        except kafka_errors.KafkaError as err:
            # The broker went away after answering check_kafka (killed, restarting): wait for it and ask
            # again; a non-retriable answer (a refusal) is final, and so is a broker lost again and again.
            if not getattr(err, "retriable", False):
                raise
            if attempt == _ENSURE_ATTEMPTS:
                raise KafkaUnavailable(
                    f"lost Kafka at {conn.bootstrap_servers} {attempt} times while creating the topics "
                    f"{', '.join(specs)} (last: {type(err).__name__}: {err}): check the broker's health and log"
                ) from None
            log.warning("lost Kafka while creating topics (%s: %s); asking again", type(err).__name__, err)


#: Times :func:`ensure_topics` asks a broker that went away mid-request before it gives up.
_ENSURE_ATTEMPTS = 3


def _ensure(conn: KafkaConnection, topics: Topics, specs: dict[str, int], timeout_s: float) -> list[str]:
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


def raise_if_unauthorized(conn: KafkaConnection, topic: str) -> None:
    """Raise if an ACL keeps ``topic`` from this client (to its metadata, it looks like a missing topic).

    Raises:
        kafka.errors.TopicAuthorizationFailedError: the broker refused to describe ``topic``.
    """
    admin = KafkaAdminClient(**conn.client_kwargs())
    try:
        for desc in admin.describe_topics([topic]):
            if desc.get("error_code") == kafka_errors.TopicAuthorizationFailedError.errno:
                raise kafka_errors.TopicAuthorizationFailedError(topic)
    finally:
        admin.close()


def upsert_scram_user(conn: KafkaConnection, user: str, password: str, *, mechanism: str = "SCRAM-SHA-512") -> None:
    """Create ``user`` with ``password``, or change its password (AlterUserScramCredentials).

    Args:
        conn: an admin's connection (a ``super.users`` member, or one with Cluster ALTER).
        user: the SCRAM user name.
        password: its new password.
        mechanism: ``SCRAM-SHA-512`` or ``SCRAM-SHA-256``.

    Raises:
        ConfigError: an empty user or password, an unknown mechanism, or the broker refused it
            (the message is the broker's).
    """
    from kafka.admin import ScramMechanism, UserScramCredentialUpsertion

    if not user or not password:
        raise ConfigError("a SCRAM user needs a non-empty `user` and `password` (a --password-file with one line)")
    mech = {"SCRAM-SHA-512": ScramMechanism.SCRAM_SHA_512, "SCRAM-SHA-256": ScramMechanism.SCRAM_SHA_256}.get(mechanism)
    if mech is None:
        raise ConfigError(f"`mechanism` {mechanism!r} is not SCRAM-SHA-512 or SCRAM-SHA-256")
    check_kafka(conn)
    admin = KafkaAdminClient(**conn.client_kwargs())
    try:
        with kafka_access_errors(conn, what=f"alter the SCRAM credentials of {user!r}"):
            result = admin.alter_user_scram_credentials([UserScramCredentialUpsertion(user, mech, password)])
    finally:
        admin.close()
    if result.get(user):
        raise ConfigError(f"the broker refused SCRAM user {user!r}: {result[user]}")


def grant_acls(conn: KafkaConnection, user: str, *, topic_prefix: str, group_prefix: str | None,
               operations: tuple[str, ...] = ACL_OPERATIONS) -> int:
    """Allow ``user`` the ``operations`` on every topic (and consumer group) whose name starts with a prefix.

    Topics get each of ``operations``; groups (when ``group_prefix`` is given) get READ and
    DESCRIBE, which committing offsets needs. Existing identical ACLs are fine.

    Args:
        conn: an admin's connection.
        user: the principal is ``User:<user>``.
        topic_prefix: e.g. ``trajpipe.``; an empty string means every topic.
        group_prefix: consumer-group prefix, or None for no group ACLs.
        operations: names from :data:`ACL_OPERATIONS`.

    Returns:
        How many ACL bindings were created.

    Raises:
        ConfigError: an unknown operation, or the broker refused an ACL.
    """
    from kafka.admin import ACL, ACLOperation, ACLPermissionType, ACLResourcePatternType, ResourcePattern, ResourceType

    unknown = sorted(set(operations) - set(ACL_OPERATIONS))
    if unknown or not operations:
        raise ConfigError(f"`operations` {unknown or '(none)'} unknown; use some of: {', '.join(ACL_OPERATIONS)}")
    principal = f"User:{user}"

    def acl(resource: ResourceType, name: str, op: ACLOperation) -> ACL:
        pattern = ACLResourcePatternType.PREFIXED if name else ACLResourcePatternType.LITERAL
        return ACL(principal, "*", op, ACLPermissionType.ALLOW, ResourcePattern(resource, name or "*", pattern))

    acls = [acl(ResourceType.TOPIC, topic_prefix, ACLOperation[op.upper()]) for op in operations]
    if group_prefix is not None:
        acls += [acl(ResourceType.GROUP, group_prefix, op) for op in (ACLOperation.READ, ACLOperation.DESCRIBE)]
    check_kafka(conn)
    admin = KafkaAdminClient(**conn.client_kwargs())
    try:
        with kafka_access_errors(conn, what=f"create ACLs for {principal}"):
            result = admin.create_acls(acls)
    finally:
        admin.close()
    if result.get("failed"):
        raise ConfigError(f"the broker refused an ACL for {principal}: {result['failed'][0].__name__}")
    return len(result.get("succeeded", []))
