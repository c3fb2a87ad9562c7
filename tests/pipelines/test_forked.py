"""pipelines/forked.py: a chain of DoFns in forked workers gives what Beam's own fused stage gives.

On FnApiRunner, in process: the same outputs on every tag (finish_bundle outputs included), the same
counter totals, each element really processed in another process; a worker that dies or a DoFn that
raises fails the run with one clear message, never a hang. The pool outlives a run (the next run's
tasks go to the same processes, with the chain it sends them) but not a failed one.
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

from pipelines import forked as forked_module
from pipelines.forked import ChainStage, ForkedChain, ForkedWorkerDied, ToStage, close_pools, output_tag


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


def test_the_pool_outlives_a_run_and_each_run_sends_its_own_chain():
    groups = [(k, list(range(k, k + 7))) for k in range(1, 9)]
    first, _ = _run(groups, forked=True)
    pool = forked_module._POOLS[2]
    again, seen = _run([(k, [v + 1000 for v in vs]) for k, vs in groups], forked=True)  # other input, same pool
    assert forked_module._POOLS[2] is pool and set(first["pids"]) | set(again["pids"]) <= set(pool._processes)
    assert sorted(v for v in again["main"] if v >= 0) == sorted((k * 100 + v + 1000) ** 2 for k, vs in groups
                                                                  for v in vs)
    assert seen == 8 * 7  # the counters are this run's, not the pool's running total
    close_pools()
    fresh, _ = _run(groups, forked=True)
    assert not set(fresh["pids"]) & set(first["pids"])  # closed: new workers


def test_a_run_after_a_failed_one_gets_a_working_pool():
    groups = [(k, list(range(k, k + 3))) for k in range(1, 5)]
    before, _ = _run(groups, forked=True)
    pool = forked_module._POOLS[2]
    with pytest.raises(Exception, match="died before it answered"):
        _run([(1, [1, 2]), (2, [3, -1]), (3, [4])], forked=True)
    assert 2 not in forked_module._POOLS  # the broken pool was shut down and forgotten
    after_death, seen = _run(groups, forked=True)
    assert seen == 4 * 3 and forked_module._POOLS[2] is not pool and not set(after_death["pids"]) & set(before["pids"])
    with pytest.raises(Exception, match="value -2 is not allowed"):
        _run([(1, [1, 2]), (2, [-2]), (3, [5]), (4, [6])], forked=True)
    after_error, seen = _run(groups, forked=True)
    assert seen == 4 * 3 and sorted(v for v in after_error["main"] if v >= 0) == sorted(
        v for v in before["main"] if v >= 0)


class _Tracked(beam.DoFn):
    """Records its set-up and tear-down in ``log`` (a worker's chain cache, run here in the test's process)."""

    def __init__(self, name: str, log: list) -> None:
        self._name, self._log = name, log

    def setup(self) -> None:
        self._log.append(("setup", self._name))

    def teardown(self) -> None:
        self._log.append(("teardown", self._name))


def test_a_worker_sets_each_chain_up_once_and_tears_the_oldest_down(monkeypatch):
    from apache_beam.internal import pickler

    log: list = []
    monkeypatch.setattr(forked_module, "_CHAINS", type(forked_module._CHAINS)())
    monkeypatch.setattr(pickler, "loads", lambda blob: [ChainStage(blob.decode(), _Tracked(blob.decode(), log))])
    for name in ["a", "b", "a", "c", "a", "d"]:
        forked_module._chain(name, name.encode())
    assert log == [("setup", "a"), ("setup", "b"), ("setup", "c"), ("teardown", "b"), ("setup", "d"),
                   ("teardown", "c")]  # two kept; "a" was used again after "b", so "b" was the oldest
    assert list(forked_module._CHAINS) == ["a", "d"]


def test_kept_workers_end_with_a_killed_driver_and_ignore_ctrl_c(tmp_path):
    import signal
    import subprocess
    import sys
    import time

    driver = tmp_path / "driver.py"
    driver.write_text(
        "import os, sys, time\n"
        "from pipelines.forked import _pool\n"
        "pool = _pool(2)\n"
        "pids = {pool.submit(os.getpid).result() for _ in range(8)}\n"  # the workers started, now idle
        "print(' '.join(map(str, sorted(pool._processes))), flush=True)\n"
        "time.sleep(600)\n")
    proc = subprocess.Popen([sys.executable, str(driver)], stdout=subprocess.PIPE, text=True,
                            cwd=os.path.dirname(os.path.dirname(os.path.dirname(__file__))),
                            env={**os.environ, "PYTHONPATH": os.getcwd()})
    try:
        workers = [int(p) for p in proc.stdout.readline().split()]
        assert workers and proc.pid not in workers
        for pid in workers:
            os.kill(pid, signal.SIGINT)  # Ctrl-C reaches the process group: an idle worker stays
        time.sleep(0.5)
        assert all(_alive(pid) for pid in workers)
    finally:
        proc.kill()
        proc.wait()
    deadline = time.monotonic() + 10
    while any(_alive(pid) for pid in workers) and time.monotonic() < deadline:
        time.sleep(0.1)
    assert not any(_alive(pid) for pid in workers)  # no orphan waits forever for a driver that is gone


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().rsplit(")", 1)[1].split()[0] != "Z"
    except FileNotFoundError:
        return False


@pytest.mark.parametrize("loop_s, kept", [(1, True), (45, False)])
def test_a_loop_keeps_its_workers_for_a_short_wait_and_ends_them_before_a_long_one(loop_s, kept, tmp_path,
                                                                                    monkeypatch):
    """``pipeline run --loop``: between micro-batches the forked workers stay warm, unless the wait is long
    (>= pipelines.batch_job.IDLE_WORKERS_CLOSE_S), when their memory goes back first."""
    import time
    import types

    from pipelines import batch_job
    from tests.pipelines.helpers import episodes, flat, write_archive

    archive = write_archive(tmp_path / "archive", [flat(episodes(12))])
    waits: list[tuple[float, list[int]]] = []

    class _Stop(Exception):
        pass

    def sleep(seconds: float) -> None:  # the loop's wait: what is alive then, and end the loop
        waits.append((seconds, forked_module.worker_pids()))
        raise _Stop

    clock = types.SimpleNamespace(**{k: getattr(time, k) for k in dir(time) if not k.startswith("_")})
    clock.sleep = sleep
    monkeypatch.setattr(batch_job, "time", clock)
    with pytest.raises(_Stop):
        batch_job.run(["--source", "archive", "--archive", str(archive), "--out", str(tmp_path / "out"),
                       "--loop", str(loop_s), "--local-workers", "2"])
    ((seconds, pids),) = waits
    assert seconds == loop_s
    assert (len(pids) == 2) if kept else (pids == [])


class _Slow(beam.DoFn):
    """x → x², after a pause; x = -2 raises; each element leaves a file in ``where`` (what ran, and when)."""

    def __init__(self, where: str) -> None:
        self._where = where
        self._seen = Metrics.counter("test", "slow_seen")
        self._sizes = Metrics.distribution("test", "slow_size")

    def process(self, x):
        import time

        time.sleep(0.2)
        self._seen.inc()
        self._sizes.update(x)
        if x == -2:
            raise ValueError("value -2 is not allowed")
        with open(os.path.join(self._where, f"{x}.done"), "w") as f:
            f.write(str(os.getpid()))
        yield x * x


def _build(where: str, elements: list[int], prestart: list[int] | None):
    p = beam.Pipeline(runner=FnApiRunner())
    out = (p | beam.Create(elements, reshuffle=False)
           | ForkedChain([ChainStage("slow", _Slow(where))], workers=2, prestart=prestart))
    _COLLECTED.clear()
    out.main | beam.Map(_collect, "main")
    return p


def test_prestarted_tasks_run_while_the_pipeline_is_built_and_are_taken_by_the_pardo(tmp_path):
    elements = [1, 2, 3, 4, 5]
    with forked_module.prestart_scope():
        p = _build(str(tmp_path), elements, prestart=elements)
        pending = dict(forked_module._PRESTARTED)
        assert len(pending) == 1 and [t for t, _f in next(iter(pending.values()))] == [[1], [2], [3], [4]]  # in_flight 4
        next(iter(pending.values()))[0][1].result(timeout=60)  # the first task ran before p.run()
        assert (tmp_path / "1.done").exists()
        p.run().wait_until_finish()
        assert not any(forked_module._PRESTARTED.values())  # all four taken, none run twice
    assert sorted(_COLLECTED["main"]) == [1, 4, 9, 16, 25]
    assert sorted(f.name for f in tmp_path.iterdir()) == [f"{x}.done" for x in elements]


def test_prestarted_tasks_and_later_runs_on_their_pool_count_their_metrics(tmp_path):
    """The pool is forked as the pipeline is built, outside any bundle (its workers inherit no state tracker,
    where Beam sends metric updates): the tasks' counters and distributions still reach the run's metrics, in
    that run and in a later one whose tasks go to the same workers without prestart."""
    close_pools()  # a pool forked here, by the prestart
    for run, prestart in ((1, True), (2, False)):
        elements = [run * 10 + i for i in range(5)]
        where = tmp_path / str(run)
        where.mkdir()
        with forked_module.prestart_scope():
            p = _build(str(where), elements, prestart=elements if prestart else None)
            result = p.run()
            result.wait_until_finish()
        query = result.metrics().query(MetricsFilter().with_namespace("test"))
        assert [c.committed for c in query["counters"] if c.key.metric.name == "slow_seen"] == [5]
        sizes = [d.committed for d in query["distributions"] if d.key.metric.name == "slow_size"]
        assert len(sizes) == 1 and (sizes[0].min, sizes[0].max) == (min(elements), max(elements))
        assert sorted(_COLLECTED["main"]) == [x * x for x in elements]


def test_prestart_outside_a_scope_or_with_other_elements_runs_the_elements_the_pardo_gets(tmp_path):
    _build(str(tmp_path / "none"), [1, 2], prestart=[1, 2])  # no scope: nothing starts at expand
    assert not forked_module._PRESTARTED
    (tmp_path / "other").mkdir()
    with forked_module.prestart_scope():
        p = _build(str(tmp_path / "other"), [7, 8], prestart=[5, 6])  # not what the ParDo gets
        p.run().wait_until_finish()
        assert not forked_module._PRESTARTED  # discarded at the first task that differed
    assert sorted(_COLLECTED["main"]) == [49, 64]


def test_prestarted_tasks_no_pardo_took_are_ended_with_the_scope(tmp_path):
    """A pipeline that fails before its ParDo runs (or is never run): its prestarted tasks are cancelled or
    waited for at the scope's end; nothing they do happens after it."""
    with pytest.raises(RuntimeError, match="construction failed"):
        with forked_module.prestart_scope():
            _build(str(tmp_path), [1, 2, 3, 4, 5, 6], prestart=[1, 2, 3, 4, 5, 6])
            raise RuntimeError("construction failed after the read")
    assert not forked_module._PRESTARTED
    done = sorted(f.name for f in tmp_path.iterdir())
    import time

    time.sleep(0.5)
    assert sorted(f.name for f in tmp_path.iterdir()) == done  # no task still at work
    assert len(done) <= 4  # the fifth and sixth were never submitted


def test_a_prestarted_task_that_fails_fails_the_run_and_the_rest_are_ended(tmp_path):
    with forked_module.prestart_scope():
        p = _build(str(tmp_path), [1, -2, 3, 4], prestart=[1, -2, 3, 4])
        with pytest.raises(Exception, match="value -2 is not allowed"):
            p.run().wait_until_finish()
        assert not any(forked_module._PRESTARTED.values())


class _GcProbe(beam.DoFn):
    """x → (pid, objects frozen here, whether a reference cycle made here was collected, gc thresholds)."""

    def process(self, x):
        import gc
        import weakref

        class Node:
            pass

        node = Node()
        node.me = node  # a cycle: only the collector frees it
        gone = weakref.ref(node)
        del node
        gc.collect()
        yield os.getpid(), gc.get_freeze_count(), gone() is None, gc.get_threshold()


def test_a_worker_freezes_what_came_with_the_fork_and_still_collects_its_own_garbage():
    # A full pass of the collector walked every object the worker was forked with (Beam, the modules: ~136k
    # objects), 0.1-0.2 s each time it came during a task; frozen, they are left out of its passes.
    p = beam.Pipeline(runner=FnApiRunner())
    out = (p | beam.Create(list(range(6)), reshuffle=False)
           | ForkedChain([ChainStage("gc", _GcProbe())], workers=2))
    _COLLECTED.clear()
    out.main | beam.Map(_collect, "probe")
    p.run().wait_until_finish()
    probes = _COLLECTED["probe"]
    assert len(probes) == 6 and os.getpid() not in {pid for pid, *_ in probes}
    assert all(frozen > 1000 for _, frozen, _, _ in probes)  # the inherited heap
    assert all(collected for _, _, collected, _ in probes)  # a task's own cyclic garbage is not frozen with it
    assert {threshold for *_, threshold in probes} == {forked_module._WORKER_GC_THRESHOLD}


class _Skipper(beam.DoFn):
    """x → x into the next stage; a negative x (as ``-x``) straight to the stage named ``to``."""

    def __init__(self, to: str) -> None:
        self._to = to

    def process(self, x):
        yield ToStage(self._to, -x) if x < 0 else x


class _Add(beam.DoFn):
    def __init__(self, n: int) -> None:
        self._n = n

    def process(self, x):
        yield x + self._n


def test_a_value_sent_to_a_later_stage_skips_the_stages_between():
    chain = [ChainStage("skip", _Skipper("last")), ChainStage("middle", _Add(10)), ChainStage("last", _Add(1000))]
    result = forked_module._run_chain(chain, [1, -2, 3])
    assert sorted(v for _, v in result.outputs) == [1002, 1011, 1013]  # 2 skipped "middle"; 1 and 3 did not


def test_a_value_sent_to_an_earlier_or_unknown_stage_is_an_error():
    for to in ("skip", "nowhere"):
        chain = [ChainStage("skip", _Skipper(to)), ChainStage("last", _Add(1))]
        with pytest.raises(ValueError, match="not a later stage of its chain"):
            forked_module._run_chain(chain, [-1])
