"""BundleCounts: the per-bundle dicts and the Beam counters carry the same counts."""

from __future__ import annotations

import apache_beam as beam
import pytest
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.testing.util import assert_that, equal_to

from pipelines.counts import COUNTS_TAG, BundleCounts, sum_counts
from pipelines.types import METRICS_NAMESPACE


class _CountFn(beam.DoFn):
    def __init__(self) -> None:
        self._c = BundleCounts(("seen", "odd", "never"))
        self._odd = self._c["odd"]

    def process(self, x: int):
        self._c.inc("seen")
        self._odd.inc(x % 2)
        self._c["never"].inc(0)
        yield x

    def finish_bundle(self):
        yield from self._c.output()


def test_counters_get_the_bundle_counts_when_it_ends():
    with beam.Pipeline(runner="FnApiRunner") as p:
        out = (p | beam.Create(list(range(25)), reshuffle=False)
               | beam.ParDo(_CountFn()).with_outputs(COUNTS_TAG, main="main"))
        totals = out[COUNTS_TAG] | beam.combiners.ToList() | beam.Map(sum_counts)
        assert_that(totals, equal_to([{"seen": 25, "odd": 12}]))
    result = p.result
    counters = {m.key.metric.name: m.committed
                for m in result.metrics().query(MetricsFilter().with_namespace(METRICS_NAMESPACE))["counters"]}
    assert counters == {"seen": 25, "odd": 12}  # a name never incremented past 0 is no counter


def test_counts_are_taken_once_and_names_are_checked():
    c = BundleCounts(("a", "b"))
    c.inc("a", 2)
    c["b"].inc()
    c["b"].inc(3)
    (first,) = list(c.emit())
    assert first.tag == COUNTS_TAG and first.value == {"a": 2, "b": 4}
    assert list(c.emit()) == []  # started again
    with pytest.raises(KeyError, match="no counter 'c'"):
        c.inc("c")
    with pytest.raises(KeyError, match="no counter 'c'"):
        c["c"]
