"""Claiming a partition chunk batch by batch when the runner shrinks the restriction meanwhile.

CI caught the race on a real split (``test_dynamic_splits_lose_and_duplicate_nothing``):
a checkpoint between two batches left none of the next batch ours, the reader went on,
and its final claim of the stop fell below the failed attempt (``ValueError: Positions
claimed should strictly increase``). These replay that order deterministically.
"""

from __future__ import annotations

from apache_beam.io.restriction_trackers import OffsetRange, OffsetRestrictionTracker

from pipelines.sources_kafka import _claimed_batches
from streams.fetch import PartitionChunk


def _chunk(first: int, n: int) -> PartitionChunk:
    offsets = list(range(first, first + n))
    return PartitionChunk(topic="t", partition=0, offsets=offsets, keys=[None] * n,
                          values=[b"%d" % o for o in offsets], timestamps_ms=[0] * n, next_offset=first + n)


def test_checkpoint_between_batches_ends_with_an_empty_stop_marker():
    tracker = OffsetRestrictionTracker(OffsetRange(100, 200))
    got = []
    for batch, go_on in _claimed_batches(tracker, _chunk(100, 30), 10):
        got.append((list(batch.offsets), go_on))
        if len(got) == 1:
            primary, _residual = tracker.try_split(0)  # checkpoint: stop right after the first batch
            assert primary.stop == 110
        if not go_on:
            break
    # The second batch's claim (119) fails and none of it is ours: the caller is told to stop.
    assert got == [(list(range(100, 110)), True), ([], False)]
    tracker.check_done()  # everything up to the new stop was claimed


def test_split_inside_a_batch_keeps_exactly_the_records_below_the_new_stop():
    tracker = OffsetRestrictionTracker(OffsetRange(100, 200))
    got, stops = [], []
    for batch, go_on in _claimed_batches(tracker, _chunk(100, 30), 10):
        got.append((list(batch.offsets), go_on))
        if len(got) == 1:
            primary, _residual = tracker.try_split(0.05)  # the new stop falls inside the second batch
            stops.append(primary.stop)
    assert 110 < stops[0] < 120
    assert got == [(list(range(100, 110)), True), (list(range(110, stops[0])), False)]


def test_no_split_claims_every_batch():
    tracker = OffsetRestrictionTracker(OffsetRange(100, 130))
    got = [(len(b), go) for b, go in _claimed_batches(tracker, _chunk(100, 30), 10)]
    assert got == [(10, True)] * 3
    tracker.check_done()
