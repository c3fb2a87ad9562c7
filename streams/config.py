"""Connection and topic settings passed to every streams component.

Components take these plain, typed objects; only entry points (``trajpipe/``)
read flags, ``TRAJPIPE_*`` environment variables or config files to build them.

Examples:
    >>> conn = KafkaConnection(bootstrap_servers="127.0.0.1:9092", client_id="archiver")
    >>> conn.client_kwargs()["bootstrap_servers"]
    ['127.0.0.1:9092']
    >>> KafkaConnection(security_protocol="SASL_SSL", sasl_mechanism="SCRAM-SHA-512", sasl_username="alice",
    ...                 sasl_password="s3cret")  # doctest: +ELLIPSIS
    KafkaConnection(..., sasl_username='alice', sasl_password=***, ...)
    >>> Topics().events
    'trajpipe.events'
"""

from __future__ import annotations

from typing import Any, Literal

import msgspec

__all__ = ["KafkaConnection", "Topics", "ConfigError"]


class ConfigError(ValueError):
    """A setting is missing, malformed or incompatible with another one."""


class KafkaConnection(msgspec.Struct, kw_only=True, frozen=True):
    """How to reach a Kafka cluster.

    Attributes:
        bootstrap_servers: comma-separated ``host:port`` list.
        client_id: client id reported to the broker.
        security_protocol: ``PLAINTEXT``, ``SSL``, ``SASL_PLAINTEXT`` or ``SASL_SSL``.
        sasl_mechanism: ``PLAIN``, ``SCRAM-SHA-256``, ``SCRAM-SHA-512`` (SASL only).
        sasl_username: SASL user name.
        sasl_password: SASL password.
        ssl_cafile: CA bundle (PEM) to verify the brokers.
        ssl_certfile: client certificate (PEM) for mutual TLS.
        ssl_keyfile: client private key (PEM) for mutual TLS.
        request_timeout_ms: how long a request may take before the client gives up.
        connect_timeout_s: how long a client waits for a bootstrap server to accept it
            before it gives up with :class:`streams.errors.KafkaUnavailable`.

    The password never shows in ``repr()`` (logs, tracebacks); ``sasl_password`` is set.
    """

    bootstrap_servers: str = "127.0.0.1:9092"
    client_id: str = "trajpipe"
    security_protocol: Literal["PLAINTEXT", "SSL", "SASL_PLAINTEXT", "SASL_SSL"] = "PLAINTEXT"
    sasl_mechanism: str | None = None
    sasl_username: str | None = None
    sasl_password: str | None = None
    ssl_cafile: str | None = None
    ssl_certfile: str | None = None
    ssl_keyfile: str | None = None
    request_timeout_ms: int = 30_000
    connect_timeout_s: float = 30.0

    def __repr__(self) -> str:
        fields = ", ".join(
            f"{f}={'***' if f == 'sasl_password' and v is not None else repr(v)}"
            for f in self.__struct_fields__ for v in [getattr(self, f)]
        )
        return f"KafkaConnection({fields})"

    def __post_init__(self) -> None:
        if not self.connect_timeout_s > 0:
            raise ConfigError(f"`connect_timeout_s` must be > 0 seconds, got {self.connect_timeout_s}")
        servers = [s.strip() for s in self.bootstrap_servers.split(",") if s.strip()]
        if not servers:
            raise ConfigError("`bootstrap_servers` is empty; pass --bootstrap host:port")
        for s in servers:
            host, _, port = s.rpartition(":")
            if not host or not port.isdigit():
                raise ConfigError(f"`bootstrap_servers` entry {s!r} is not host:port")
        if self.security_protocol.startswith("SASL") and not (self.sasl_mechanism and self.sasl_username):
            raise ConfigError(
                f"`security_protocol` {self.security_protocol} needs `sasl_mechanism` and `sasl_username`"
            )

    @property
    def servers(self) -> list[str]:
        """The bootstrap servers as a list."""
        return [s.strip() for s in self.bootstrap_servers.split(",") if s.strip()]

    def client_kwargs(self) -> dict[str, Any]:
        """Keyword arguments shared by kafka-python's producer, consumer and admin client.

        ``kafka_client`` is :func:`streams.kafka_net.net_client`: kafka-python's network client
        without its warning about a large fetch's parse "blocking the event loop".
        """
        from streams.kafka_net import net_client  # kafka-python imports only where a client is built

        kw: dict[str, Any] = {
            "kafka_client": net_client,
            "bootstrap_servers": self.servers,
            "client_id": self.client_id,
            "security_protocol": self.security_protocol,
            "request_timeout_ms": self.request_timeout_ms,
            "bootstrap_timeout_ms": int(self.connect_timeout_s * 1000),
        }
        if self.security_protocol.startswith("SASL"):
            kw.update(
                sasl_mechanism=self.sasl_mechanism,
                sasl_plain_username=self.sasl_username,
                sasl_plain_password=self.sasl_password,
            )
        for key in ("ssl_cafile", "ssl_certfile", "ssl_keyfile"):
            if getattr(self, key):
                kw[key] = getattr(self, key)
        return kw


class Topics(msgspec.Struct, kw_only=True, frozen=True):
    """Names and partition counts of the project's topics.

    Attributes:
        events: step/episode events, keyed by ``episode_id``.
        dead_letters: messages that failed to decode, with reason and source position.
        control: control events such as ``policy_published``.
        partitions: partition count of the events topic.
        replication_factor: replication factor for all topics (1 on one broker).
    """

    events: str = "trajpipe.events"
    dead_letters: str = "trajpipe.dead-letters"
    control: str = "trajpipe.control"
    partitions: int = 4
    replication_factor: int = 1

    def __post_init__(self) -> None:
        if self.partitions < 1:
            raise ConfigError(f"`partitions` must be >= 1, got {self.partitions}")
        if self.replication_factor < 1:
            raise ConfigError(f"`replication_factor` must be >= 1, got {self.replication_factor}")
