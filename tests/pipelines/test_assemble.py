"""Batch assembly on frames (AssembleEpisodesFromFrames) and the streaming stateful twin."""

import apache_beam as beam
import msgspec
from apache_beam.testing.util import assert_that, equal_to

from pipelines.assemble import AssembleEpisodesStreaming, dedupe_events
from pipelines.frames import AssembleEpisodesFromFrames, EventsToFrames
from tests.pipelines.helpers import episodes, make_pipeline


def test_dedupe_counts_copies_and_conflicts():
    ep = episodes(1)[0]
    other = msgspec.structs.replace(ep[2], event_id="not-canonical")
    unique, dups, conflicts = dedupe_events([ep[3], *ep, ep[0], other])
    assert [e.seq for e in unique] == list(range(len(ep))) and dups == 2
    assert [c.event_id for c in conflicts] == ["not-canonical"]


def test_frames_from_several_fragments_dedupe():
    ep = episodes(1)[0]
    with make_pipeline() as p:
        out = (p | beam.Create([(ep[0].episode_id, ep[:3]), (ep[0].episode_id, ep[1:])]) | EventsToFrames()
               | AssembleEpisodesFromFrames())
        assert_that(out["episodes"] | beam.Map(lambda e: (e.episode_id, e.num_events)),
                    equal_to([(ep[0].episode_id, len(ep))]))


def test_complete_pending_incomplete_and_gap():
    eps = episodes(4, seed=9)  # synthetic episode i starts at base + i seconds
    c, a, d, b = eps
    # a: complete, split over two fragments with a duplicate; b: unfinished and the newest (it sets the
    # clock) -> pending; c (3 s older) unfinished -> incomplete; d (~1 s older) has a seq gap -> incomplete.
    frags = [(a[0].episode_id, a[:4]), (a[0].episode_id, a[3:]), (b[0].episode_id, b[:-1]),
             (c[0].episode_id, c[:-1]), (d[0].episode_id, d[:2] + d[3:])]
    with make_pipeline() as p:
        out = p | beam.Create(frags) | EventsToFrames() | AssembleEpisodesFromFrames(incomplete_after_s=0.5,
                                                                                     clock_floor_s=0)
        assert_that(out["episodes"] | beam.Map(lambda e: (e.episode_id, e.complete, len(e.steps), e.num_events)),
                    equal_to([(a[0].episode_id, True, a[-1].num_steps, len(a))]), label="complete")
        assert_that(out["pending"] | beam.Map(lambda kv: kv[0]), equal_to([b[0].episode_id]), label="pending")
        assert_that(out["incomplete"] | beam.Map(lambda e: (e.episode_id, e.incomplete_reason)),
                    equal_to([(c[0].episode_id, "unfinished"), (d[0].episode_id, "gap")]), label="incomplete")


def test_streaming_assembler_emits_complete_and_times_out_unfinished():
    a, b = episodes(2, seed=11)
    frags = [(a[0].episode_id, a[:3]), (a[0].episode_id, a[2:]), (b[0].episode_id, b[:-1])]
    with make_pipeline() as p:
        stamped = (p | beam.Create(frags)
                   | beam.Map(lambda f: beam.window.TimestampedValue(f, max(e.event_time for e in f[1]).timestamp())))
        out = stamped | AssembleEpisodesStreaming(incomplete_after_s=60)
        assert_that(out.episodes | beam.Map(lambda e: (e.episode_id, e.num_events)),
                    equal_to([(a[0].episode_id, len(a))]), label="complete")
        assert_that(out.incomplete | beam.Map(lambda e: (e.episode_id, e.incomplete_reason)),
                    equal_to([(b[0].episode_id, "unfinished")]), label="incomplete")


def test_streaming_assembler_sends_open_episodes_to_pending_at_end_of_input():
    a, b = episodes(2, seed=12)
    frags = [(a[0].episode_id, a[:-1]), (b[0].episode_id, b[:-1])]  # neither finishes
    t_a, t_b = 1_000.0, 2_000.0
    with make_pipeline() as p:
        stamped = (p | beam.Create(list(zip(frags, (t_a, t_b))))
                   | beam.Map(lambda ft: beam.window.TimestampedValue(ft[0], ft[1])))
        # a's timer (1000 + 60) is before the end of input (1500): idle, so incomplete; b's (2060) is
        # after it: it only fired because the input ended, so b is still open -> pending.
        out = stamped | AssembleEpisodesStreaming(incomplete_after_s=60, end_of_input_s=1_500.0)
        assert_that(out.incomplete | beam.Map(lambda e: e.episode_id), equal_to([a[0].episode_id]), label="inc")
        assert_that(out.pending | beam.Map(lambda kv: (kv[0], len(kv[1]))),
                    equal_to([(b[0].episode_id, len(b) - 1)]), label="pending")


def _raw_batches(eps, *, size: int):
    """The episodes' events interleaved as Kafka record batches of ``size``; one record unkeyed, one garbled,
    one re-delivered copy in a later batch."""
    from pipelines.types import RawRecords
    from schemas.codec import encode_event

    evs = [ep[k] for k in range(max(map(len, eps))) for ep in eps if k < len(ep)]
    recs = [(ev.episode_id.encode(), encode_event(ev)) for ev in evs]
    recs[3] = (None, recs[3][1])            # no key: decoded to find its episode
    recs.insert(5, (b"ep-x", b"TJ\x01"))     # truncated frame: a dead letter
    recs.append(recs[7])                      # an at-least-once copy, batches later
    return [RawRecords(topic="t", partition=0, offsets=list(range(i, i + len(chunk))), keys=[k for k, _ in chunk],
                       values=[v for _, v in chunk], timestamps_ms=[0] * len(chunk))
            for i, chunk in ((i, recs[i:i + size]) for i in range(0, len(recs), size))]


def test_bucketed_shuffle_assembles_the_same_episodes_as_one_bucket():
    from pipelines.frames import KeyFrames

    eps = episodes(9, seed=21)
    batches = _raw_batches(eps, size=7)  # episodes straddle batches
    for buckets in (1, 4):  # assert_that checks each run when its pipeline finishes
        with make_pipeline() as p:
            read = p | f"Create{buckets}" >> beam.Create(batches) | KeyFrames(buckets=buckets)
            out = read.frames | AssembleEpisodesFromFrames()
            summary = out["episodes"] | beam.Map(lambda e: (e.episode_id, e.num_events, len(e.steps)))
            assert_that(summary, equal_to([(ep[0].episode_id, len(ep), ep[-1].num_steps) for ep in eps]))
            dead = (read.dead_letters, out["dead_letters"]) | beam.Flatten()
            assert_that(dead | beam.Map(lambda d: (d.reason, d.source_offset)), equal_to([("truncated", 5)]),
                        label="dead")
