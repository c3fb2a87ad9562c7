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
