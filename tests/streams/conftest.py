"""Fixtures for the streams tests: connections to the session brokers, event factories, readers."""

from __future__ import annotations

import pytest

from schemas.codec import decode_event
from schemas.events import AnyEvent, EpisodeStarted, Step, make_event_id
from streams.broker import BrokerInfo
from streams.config import KafkaConnection, Topics
from streams.consumer import ConsumerRecord, end_offsets, ranges_from, read_range


def make_events(episodes: int, steps: int, *, prefix: str = "ep", first_seq: int = 0) -> list[AnyEvent]:
    """Events of ``episodes`` episodes, seq ``first_seq`` .. ``first_seq + steps - 1`` each, interleaved."""
    out: list[AnyEvent] = []
    for seq in range(first_seq, first_seq + steps):
        for e in range(episodes):
            episode_id = f"{prefix}-{e}"
            env = dict(event_id=make_event_id(episode_id, seq), episode_id=episode_id, seq=seq,
                       producer_id="test", domain="math", task_id=f"t{e}")
            if seq == 0:
                out.append(EpisodeStarted(**env, task_spec="{}"))
            else:
                out.append(Step(**env, step_index=seq - 1, action_text=f"a{seq}",
                                action_token_ids=[seq, e, 7], behaviour_logprobs=[-0.5, -0.25, -0.125]))
    return out


def read_all(conn: KafkaConnection, topic: str) -> list[ConsumerRecord]:
    """Every record of ``topic`` up to its current end offsets, partition by partition in offset order."""
    records = [r for batch in read_range(conn, ranges_from(topic=topic, start={}, end=end_offsets(conn, topic)),
                                         stall_timeout_s=10) for r in batch]
    return sorted(records, key=lambda r: (r.partition, r.offset))


def assert_episode_order(records: list[ConsumerRecord]) -> dict[str, list[int]]:
    """Decode, check each episode's seqs rise in offset order within its one partition; return them."""
    seqs: dict[str, list[int]] = {}
    partition_of: dict[str, int] = {}
    for r in records:
        ev = decode_event(r.value)
        assert r.key == ev.episode_id.encode()
        assert partition_of.setdefault(ev.episode_id, r.partition) == r.partition
        seqs.setdefault(ev.episode_id, []).append(ev.seq)
    for episode_id, s in seqs.items():
        assert s == sorted(s), f"{episode_id} out of order: {s}"
    return seqs


@pytest.fixture(params=["kafka", "tansu"])
def broker(request: pytest.FixtureRequest) -> BrokerInfo:
    """Each session broker in turn (the test runs once per engine)."""
    return request.getfixturevalue(f"{request.param}_broker")


@pytest.fixture
def conn(broker: BrokerInfo) -> KafkaConnection:
    """Connection to the parametrized broker, with test-sized timeouts."""
    return KafkaConnection(bootstrap_servers=broker.bootstrap, client_id="trajpipe-test", request_timeout_ms=5_000)


@pytest.fixture
def topics(topic_name: str) -> Topics:
    """Per-test topic names (events has 3 partitions)."""
    return Topics(events=topic_name, dead_letters=f"{topic_name}.dl", control=f"{topic_name}.ctl", partitions=3)
