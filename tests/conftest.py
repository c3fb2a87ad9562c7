"""Fixtures shared by all test packages.

Brokers are real (never mocked): one Kafka and one Tansu broker per test session,
each on a free port in its own temporary data dir, started on first use and stopped
at the end of the session.
"""

from __future__ import annotations

import re
import uuid
from collections.abc import Iterator

import pytest

from streams.broker import BrokerInfo, start_broker, stop_broker
from tests.helpers import free_port


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
