"""Fixtures shared by all test packages.

Brokers are real (never mocked): one Kafka and one Tansu broker per test session,
each on a free port in its own temporary data dir, started on first use and stopped
at the end of the session. So is the object store: one SeaweedFS S3 gateway (``s3_store``).
"""

from __future__ import annotations

import os
import re
import secrets
import sys
import uuid
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path

import pytest

from streams.broker import BrokerInfo, start_broker, stop_broker
from streams.config import KafkaConnection
from tests.helpers import free_port
from tests.s3_helpers import S3Store, aws_environment, start_seaweedfs, stop_seaweedfs


@pytest.fixture(autouse=True)
def _fresh_forked_workers() -> Iterator[None]:
    """Each test forks its own pipeline workers: a pool kept from an earlier test would not see its monkeypatches."""
    yield
    forked = sys.modules.get("pipelines.forked")
    if forked is not None:
        forked.close_pools()


def _session_broker(tmp_path_factory: pytest.TempPathFactory, engine: str) -> Iterator[BrokerInfo]:
    data_dir = tmp_path_factory.mktemp(f"{engine}-broker")
    info = start_broker(engine=engine, port=free_port(), data_dir=data_dir)
    try:
        yield info
    finally:
        stop_broker(data_dir)


@pytest.fixture(scope="session")
def kafka_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerInfo]:
    """A single-node Apache Kafka (KRaft) broker shared by the whole session."""
    yield from _session_broker(tmp_path_factory, "kafka")


@pytest.fixture(scope="session")
def tansu_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[BrokerInfo]:
    """A Tansu broker (memory storage) shared by the whole session."""
    yield from _session_broker(tmp_path_factory, "tansu")


@dataclass(frozen=True)
class AuthBroker:
    """The session's ``--auth sasl-ssl`` Kafka broker and its SCRAM users.

    Users (random passwords, made per session, in ``password_files``):

    * ``alice``: read, write, describe and create on topics ``trajpipe.*`` and ``test.*``, and
      read/describe on groups ``trajpipe*`` and ``test*``.
    * ``reader``: read and describe only on those topics (cannot produce).
    * ``bob``: no ACL at all (authenticates, may do nothing).
    """

    info: BrokerInfo
    password_files: dict[str, Path]

    @property
    def bootstrap(self) -> str:
        return self.info.bootstrap

    def password(self, user: str) -> str:
        return self.password_files[user].read_text().strip()

    def conn(self, user: str, *, client_id: str = "trajpipe-test", password: str | None = None,
             **kw) -> KafkaConnection:
        """A client connection as ``user`` (``password`` overrides the real one)."""
        return KafkaConnection(bootstrap_servers=self.bootstrap, client_id=client_id, security_protocol="SASL_SSL",
                               sasl_mechanism="SCRAM-SHA-512", sasl_username=user,
                               sasl_password=password if password is not None else self.password(user),
                               ssl_cafile=str(self.info.ca_file), **kw)

    def env(self, user: str, *, password_file: Path | None = None, **extra: str) -> dict[str, str]:
        """Environment for a ``trajpipe`` subprocess that connects as ``user`` (the password from a file)."""
        env = {k: v for k, v in os.environ.items() if not k.startswith("TRAJPIPE_")}
        return {**env, "TRAJPIPE_BOOTSTRAP": self.bootstrap, "TRAJPIPE_KAFKA__SECURITY_PROTOCOL": "SASL_SSL",
                "TRAJPIPE_KAFKA__SASL_MECHANISM": "SCRAM-SHA-512", "TRAJPIPE_KAFKA__SASL_USERNAME": user,
                "TRAJPIPE_KAFKA__SASL_PASSWORD_FILE": str(password_file or self.password_files[user]),
                "TRAJPIPE_KAFKA__SSL_CAFILE": str(self.info.ca_file), **extra}


@pytest.fixture(scope="session")
def kafka_auth_broker(tmp_path_factory: pytest.TempPathFactory) -> Iterator[AuthBroker]:
    """A Kafka broker that requires SASL_SSL (SCRAM-SHA-512, a CA made for it) and enforces ACLs."""
    from streams.admin import grant_acls, upsert_scram_user
    from streams.broker import admin_connection

    data_dir = tmp_path_factory.mktemp("kafka-auth-broker")
    secrets_dir = tmp_path_factory.mktemp("kafka-auth-secrets")
    info = start_broker(engine="kafka", port=free_port(), data_dir=data_dir, auth="sasl-ssl")
    try:
        admin = admin_connection(data_dir)
        files = {}
        for user in ("alice", "reader", "bob"):
            files[user] = secrets_dir / f"{user}.password"
            files[user].write_text(f"pw-{user}-{secrets.token_urlsafe(12)}\n")
            files[user].chmod(0o600)
            upsert_scram_user(admin, user, files[user].read_text().strip())
        for prefix in ("trajpipe.", "test."):
            grant_acls(admin, "alice", topic_prefix=prefix, group_prefix=prefix.rstrip("."))
            grant_acls(admin, "reader", topic_prefix=prefix, group_prefix=prefix.rstrip("."),
                       operations=("read", "describe"))
        yield AuthBroker(info=info, password_files=files)
    finally:
        stop_broker(data_dir)


@pytest.fixture(scope="session")
def s3_store(tmp_path_factory: pytest.TempPathFactory) -> Iterator[S3Store]:
    """A real S3-compatible store (SeaweedFS, tests/s3_helpers.py) with one bucket, shared by the session.

    ``s3_store.env()`` holds the AWS_* variables clients use; the server is stopped at the end.
    """
    store = start_seaweedfs(tmp_path_factory.mktemp("seaweedfs"))
    try:
        yield store
    finally:
        stop_seaweedfs(store)


@pytest.fixture
def s3_env(s3_store: S3Store) -> Iterator[S3Store]:
    """The session's S3 store, with its AWS_* variables in this process for the test (tests/s3_helpers.py)."""
    with aws_environment(s3_store):
        yield s3_store


@pytest.fixture
def topic_name(request: pytest.FixtureRequest) -> str:
    """A topic name no other test uses: ``test.<test name>.<random>``, legal for Kafka."""
    name = re.sub(r"[^a-zA-Z0-9._-]+", "-", request.node.name).strip("-")[:100]
    return f"test.{name}.{uuid.uuid4().hex[:8]}"


# --- fuzz tests (tests/fuzzing.py): Hypothesis profiles, and the inputs tried per target after `make fuzz`
from tests import fuzzing  # noqa: E402

fuzzing.register_profiles()


def pytest_unconfigure(config: pytest.Config) -> None:
    """After a run under the ``fuzz`` profile: one JSON line of inputs tried per target (and failed tests)."""
    if config.getoption("hypothesis_profile", None) != "fuzz" or not fuzzing.COUNTS:
        return
    import json

    reporter = config.pluginmanager.get_plugin("terminalreporter")
    failed = len(reporter.stats.get("failed", [])) + len(reporter.stats.get("error", [])) if reporter else 0
    print(json.dumps({**{t: fuzzing.COUNTS[t] for t in fuzzing.TARGETS}, "failures": failed}), flush=True)
