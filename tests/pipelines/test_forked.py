"""pipelines/forked.py: a chain of DoFns in forked workers gives what Beam's own fused stage gives.

On FnApiRunner, in process: the same outputs on every tag (finish_bundle outputs included), the same
counter totals, each element really processed in another process; a worker that dies or a DoFn that
raises fails the run with one clear message, never a hang.
"""

from __future__ import annotations

import os

import apache_beam as beam
import pytest
from apache_beam.metrics import Metrics
from apache_beam.metrics.metric import MetricsFilter
from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from pipelines.forked import ChainStage, ForkedChain, ForkedWorkerDied, output_tag


class _Split(beam.DoFn):
    """(key, values) → each value; odd ones also tagged; per bundle the count on ``sizes`` from finish_bundle."""

    def __init__(self) -> None:
        self._seen = Metrics.counter("test", "values_seen")

    def start_bundle(self) -> None:
        self._n = 0

    def process(self, element):
        key, values = element
        for v in values:
            if v == -1:
                os._exit(3)  # a worker killed in the middle of an element
            if v == -2:
                raise ValueError("value -2 is not allowed")
            self._seen.inc()
            self._n += 1
            yield key * 100 + v
            if v % 2:
                yield beam.pvalue.TaggedOutput("odd", (key, v))

    def finish_bundle(self):
        window = GlobalWindow()
        yield beam.pvalue.TaggedOutput("sizes", WindowedValue(self._n, window.max_timestamp(), [window]))


class _Square(beam.DoFn):
    """x → (x², pid); per bundle one marker from finish_bundle (its main output goes on)."""

    def start_bundle(self) -> None:
        self._any = False

    def process(self, x):
        self._any = True
        yield x * x, os.getpid()

    def finish_bundle(self):
        if self._any:
            window = GlobalWindow()
            yield WindowedValue((-1, os.getpid()), window.max_timestamp(), [window])


def _chain() -> list[ChainStage]:
    return [ChainStage("split", _Split(), ("odd", "sizes")), ChainStage("square", _Square())]


def _run(groups: list[tuple[int, list[int]]], *, forked: bool, per_task: int = 1, workers: int = 2):
    """Outputs and the ``values_seen`` counter of the chain over ``groups`` grouped by key, fused or forked."""
    got = {}
    p = beam.Pipeline(runner=FnApiRunner())
    grouped = (p | beam.Create([(k, v) for k, vs in groups for v in vs], reshuffle=False)
               | beam.GroupByKey())  # (key, lazy iterable of values), as a shuffle hands them over
    if forked:
        out = grouped | ForkedChain(_chain(), workers=workers, grouped=True, per_task=per_task)
        main, odd, sizes = out.main, out[output_tag("split", "odd")], out[output_tag("split", "sizes")]
    else:
        split = (grouped | beam.MapTuple(lambda k, vs: (k, sorted(vs)))
                 | "Split" >> beam.ParDo(_Split()).with_outputs("odd", "sizes", main="main"))
        main, odd, sizes = split.main | "Square" >> beam.ParDo(_Square()), split.odd, split.sizes
    got["main"] = main | "Values" >> beam.Map(lambda kv: kv[0])
    got["pids"] = main | "Pids" >> beam.Map(lambda kv: kv[1]) | beam.Distinct()
    got["odd"], got["sizes"] = odd, sizes | beam.CombineGlobally(sum)
    _COLLECTED.clear()
    for name, pc in got.items():
        pc | f"Collect{name}" >> beam.Map(_collect, name)
    result = p.run()
    result.wait_until_finish()
    seen = result.metrics().query(MetricsFilter().with_name("values_seen"))["counters"]
    return dict(_COLLECTED), sum(c.committed for c in seen)


_COLLECTED: dict[str, list] = {}


def _collect(value, name: str) -> None:  # runs in this process (FnApiRunner in process): a module global
    _COLLECTED.setdefault(name, []).append(value)


@pytest.mark.parametrize("per_task", [1, 3])
def test_forked_chain_gives_the_fused_stages_outputs_and_counters(per_task):
    groups = [(k, list(range(k, k + 7))) for k in range(1, 9)]
    fused, fused_seen = _run(groups, forked=False)
    forked, forked_seen = _run(groups, forked=True, per_task=per_task)
    tasks = -(-8 // per_task)
    assert sorted(forked["odd"]) == sorted(fused["odd"]) and forked["sizes"] == fused["sizes"] == [8 * 7]
    assert sorted(v for v in forked["main"] if v >= 0) == sorted(v for v in fused["main"] if v >= 0)
    assert len(forked["main"]) == 8 * 7 + tasks
    assert fused_seen == forked_seen == 8 * 7
    # -1 is _Square's finish_bundle marker: one per bundle, and in the workers each task is one bundle
    assert forked["main"].count(-1) == tasks and fused["main"].count(-1) == 1
    assert forked["pids"] and os.getpid() not in forked["pids"]  # in the workers, never in the driver


@pytest.mark.parametrize("per_task", [1, 3])
def test_one_worker_runs_the_tasks_in_the_driver_with_the_same_outputs(per_task):
    groups = [(k, list(range(k, k + 7))) for k in range(1, 9)]
    forked, forked_seen = _run(groups, forked=True, per_task=per_task)
    inline, inline_seen = _run(groups, forked=True, per_task=per_task, workers=1)
    assert sorted(inline["main"]) == sorted(forked["main"]) and sorted(inline["odd"]) == sorted(forked["odd"])
    assert inline["sizes"] == forked["sizes"] == [8 * 7] and inline_seen == forked_seen == 8 * 7
    assert inline["pids"] == [os.getpid()]  # nothing forked


def test_a_worker_that_dies_fails_the_run_with_one_clear_message():
    with pytest.raises(Exception, match="a forked worker of split → square died before it answered"):
        _run([(1, [1, 2]), (2, [3, -1]), (3, [4])], forked=True)


def test_a_dofn_error_in_a_worker_fails_the_run_with_its_message():
    with pytest.raises(Exception, match="value -2 is not allowed"):
        _run([(1, [1, 2]), (2, [-2])], forked=True)


def test_forked_chain_options_are_checked():
    with pytest.raises(ValueError, match="`workers` and `per_task` must be >= 1"):
        ForkedChain(_chain(), workers=0)
    assert issubclass(ForkedWorkerDied, RuntimeError)
