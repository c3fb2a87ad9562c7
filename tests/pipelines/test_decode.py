"""DecodeAndValidate: good records become fragments, bad ones dead letters with reasons."""

import apache_beam as beam
from apache_beam.testing.util import assert_that, equal_to

from pipelines.decode import DecodeAndValidate
from pipelines.types import RawRecords
from schemas.codec import encode_event
from tests.pipelines.helpers import episodes, make_pipeline


def _batch(values, keys):
    return RawRecords(topic="trajpipe.events", partition=2, offsets=list(range(100, 100 + len(values))),
                      keys=keys, values=values, timestamps_ms=[0] * len(values))


def test_good_and_bad_records_are_split():
    ep = episodes(1, seed=3)[0]
    good = [encode_event(e) for e in ep]
    key = ep[0].episode_id.encode()
    future = bytearray(good[1]); future[4:6] = (99).to_bytes(2, "big")
    values = [*good[:2], b"garbage!", good[2][:9], bytes(future), None, good[1][:4], *good[2:]]
    keys = [key, key, key, key, key, key, key] + [key] * (len(good) - 2)
    keys[1] = b"other-episode"  # key_mismatch
    with make_pipeline() as p:
        out = p | beam.Create([_batch(values, keys)]) | DecodeAndValidate()
        assert_that(out.fragments | beam.Map(lambda f: (f[0], sorted(e.seq for e in f[1]))),
                    equal_to([(ep[0].episode_id, [e.seq for e in ep if e.seq != 1])]), label="fragments")
        assert_that(out.dead_letters | beam.Map(lambda d: (d.reason, d.source_partition, d.source_offset)),
                    equal_to([("key_mismatch", 2, 101), ("bad_magic", 2, 102), ("truncated", 2, 103),
                              ("future_version", 2, 104), ("truncated", 2, 105), ("truncated", 2, 106)]),
                    label="dead")


def test_one_fragment_per_episode_per_batch():
    eps = episodes(3, seed=1)
    values = [encode_event(e) for ep in eps for e in ep]
    keys = [e.episode_id.encode() for ep in eps for e in ep]
    with make_pipeline() as p:
        out = p | beam.Create([_batch(values, keys)]) | DecodeAndValidate()
        assert_that(out.fragments | beam.Map(lambda f: (f[0], len(f[1]))),
                    equal_to([(ep[0].episode_id, len(ep)) for ep in eps]))


def test_future_event_times_and_record_times_are_counted_and_kept():
    """An event more than max_future_s ahead of the wall clock (by its event_time, or by its record's Kafka
    timestamp) is counted in pipeline/future_events and still goes to its fragment."""
    import time
    from datetime import datetime, timezone

    import msgspec
    from apache_beam.metrics.metric import MetricsFilter

    ep = episodes(1, seed=5)[0]
    shift = datetime.now(timezone.utc) - ep[0].event_time
    evs = [msgspec.structs.replace(e, event_time=e.event_time + shift) for e in ep]  # now, on the producer's clock
    evs[-1] = msgspec.structs.replace(evs[-1], event_time=evs[-1].event_time.replace(year=evs[-1].event_time.year + 1))
    stamps = [int(time.time() * 1000)] * len(evs)
    stamps[0] += 3600 * 1000  # a record stamped an hour ahead (CreateTime of a fast producer)
    batch = RawRecords(topic="t", partition=0, offsets=list(range(len(evs))), keys=[e.episode_id.encode() for e in evs],
                       values=[encode_event(e) for e in evs], timestamps_ms=stamps)
    p = make_pipeline()
    out = p | beam.Create([batch]) | DecodeAndValidate(max_future_s=300)
    assert_that(out.fragments | beam.Map(lambda f: len(f[1])), equal_to([len(evs)]))
    result = p.run()
    result.wait_until_finish()
    [counter] = result.metrics().query(MetricsFilter().with_name("future_events"))["counters"]
    assert counter.committed == 2
