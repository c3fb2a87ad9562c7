"""End-to-end from a real broker (Tansu): offsets ranges, dead letters, reruns add nothing."""

import pytest
from kafka.admin import KafkaAdminClient, NewTopic

from pipelines.inputs import KafkaInput
from pipelines.recipes import load_recipe
from pipelines.trajectory_job import run_batch
from schemas.codec import encode_event
from streams.config import KafkaConnection
from tests.helpers import produce_messages
from tests.pipelines.helpers import episodes, flat

pytestmark = pytest.mark.integration


@pytest.mark.parametrize("workers", [None, 2], ids=["auto", "forked"])
def test_kafka_micro_batches(tansu_broker, topic_name, tmp_path, workers):
    """Micro-batches cover the topic once, the undecodable record a dead letter; in the runner or read,
    assembled and staged in 2 forked workers (``workers=2``; these few events stay in one process by default)."""
    conn = KafkaConnection(bootstrap_servers=tansu_broker.bootstrap, client_id="trajpipe-test", request_timeout_ms=5_000)
    admin = KafkaAdminClient(bootstrap_servers=tansu_broker.bootstrap)
    try:
        admin.create_topics([NewTopic(topic_name, num_partitions=2, replication_factor=1)])
    finally:
        admin.close()
    eps = episodes(12, seed=31)
    msgs = [(e.episode_id.encode(), encode_event(e)) for e in flat(eps[:8])] + [(b"ep-x", b"junk")]
    produce_messages(tansu_broker.bootstrap, topic_name, msgs)
    kw = dict(out=tmp_path / "out", recipe=load_recipe("outcome"),
              input=KafkaInput(conn=conn, topic=topic_name), workers=workers)
    c1 = run_batch(**kw)
    assert (c1["episodes"], c1["dead_letters"], c1["events_in"]) == (8, 1, len(msgs))
    assert set(run_batch(**kw).values()) == {0}  # nothing new on the topic
    produce_messages(tansu_broker.bootstrap, topic_name,
                     [(e.episode_id.encode(), encode_event(e)) for e in flat(eps[8:])])
    c3 = run_batch(**kw)
    assert (c3["episodes"], c3["events_in"], c3["dead_letters"]) == (4, len(flat(eps[8:])), 0)
