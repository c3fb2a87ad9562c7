"""A chain of DoFns run in forked worker processes: the in-process runner on both cores.

FnApiRunner runs a job's fused stages one bundle at a time in the driver's
process, so a batch job uses one core however many the machine has. Its
``multi_processing`` mode starts SDK worker processes that import Beam and
the job afresh and exchange every element over gRPC: measured here on the
batch job (100k events from Kafka), 12.3 CPU-s and 8.2 s against 5.4 CPU-s
and 5.6 s in one process.

:class:`ForkedChain` instead runs a *chain* of DoFns -- main output of one
into the next, as Beam fuses them -- inside one ParDo whose elements go to a
pool of processes forked from the driver
(:class:`concurrent.futures.ProcessPoolExecutor`, ``fork`` context). A fork
costs milliseconds and no import. The pool is kept for the life of the
process (one per worker count; :func:`close_pools` ends them) and serves
every bundle and every run after the one that forked it: a worker that has
done a task keeps the memory it faulted in, and fresh pages cost here ~16x
reused ones (docs/pipelines.md), so a forked worker's first task took
0.51-0.56 s against 0.27-0.30 s for its later ones (archive job, 100k events).
The chain is therefore not inherited but shipped: pickled once per bundle
(~2-3 KB: the DoFns carry references, such as
:class:`pipelines.committed.CommittedView`, not state), unpickled and set
up (``setup``) once per worker, its newest few chains kept and the older
ones torn down (``teardown``). Each worker also keeps freed heap memory
instead of giving it back to the kernel at once (:func:`_keep_heap`). A bundle that fails
(an exception, a worker that died) shuts its pool down; the next bundle
forks a new one. Each task (``per_task``
elements) is one *bundle* in a worker: ``start_bundle``, the elements through
the chain depth first, as Beam runs fused DoFns (each main output goes on into the next
DoFn before its producer goes on: a generator that reads is consumed as it reads),
``finish_bundle`` of each DoFn in order (what one emits there flows on into
the next). The outputs travel back pickled and leave the ParDo as they would
have left the DoFns: the last DoFn's main output as the main output, every
tagged output as ``"<stage>.<tag>"`` (:func:`output_tag`). The workers'
Beam counters and distributions are added to the driver's.

Use it for chains whose elements are large (a shuffle bucket of episodes, an
archive file) and whose outputs are small (row-part paths, statistics,
counts): the pickling is per element, the work per event. Only where the
DoFns' side effects are local files every process can reach, and nothing in
the chain uses a runtime that does not survive a fork (delta-rs' tokio
runtime panics in a forked child: the chain must not touch Delta tables or
object stores). A worker that dies (killed, out of memory) fails the bundle
with :class:`concurrent.futures.process.BrokenProcessPool`; an exception in a
DoFn fails it with that exception, as in one process.

Examples:
    >>> import apache_beam as beam
    >>> class Double(beam.DoFn):
    ...     def process(self, x):
    ...         yield 2 * x
    ...         yield beam.pvalue.TaggedOutput("odd", x) if x % 2 else None
    >>> out = _run_chain([ChainStage("double", Double(), ("odd",)), ChainStage("double2", Double())], [3])
    >>> out.outputs  # depth first: 6 goes on into double2 before double's tagged output is taken
    [(None, 12), ('double.odd', 3)]
"""

from __future__ import annotations

import contextlib
import ctypes
import gc
import importlib
import os
import signal
import threading
import time
import uuid
from collections import OrderedDict, deque
from collections.abc import Iterable, Iterator, Sequence
from concurrent.futures import Future, ProcessPoolExecutor
from concurrent.futures.process import BrokenProcessPool
from dataclasses import dataclass, field
from multiprocessing import get_context
from typing import Any, NamedTuple

import apache_beam as beam
from apache_beam.internal import pickler
from apache_beam.metrics.cells import CounterCell, DistributionCell
from apache_beam.metrics.execution import MetricsContainer, MetricsEnvironment
from apache_beam.runners.worker import statesampler
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.counters import CounterFactory
from apache_beam.utils.windowed_value import WindowedValue

from pipelines.beam_overhead import read_zlib_pickles

__all__ = ["ChainStage", "ForkedChain", "ToStage", "ForkedWorkerDied", "LAZY_IMPORTS", "close_pools", "in_global_window",
           "output_tag", "per_task", "usable_cpus", "worker_pids"]


#: Modules numpy and Arrow import on first use, which the job's chains reach (``numpy.ma`` by a ``take`` with
#: numpy indices, Arrow's feather and acero for the row parts and group statistics, ``pandas_compat``): ~0.15
#: CPU-s together. Imported in the driver before the fork; else every forked worker imports them again.
LAZY_IMPORTS = ("numpy.ma", "pyarrow.feather", "pyarrow.acero", "pyarrow.pandas_compat")


class ForkedWorkerDied(RuntimeError):
    """A forked worker ended without answering (killed, out of memory): the bundle failed, nothing of it counts."""


class ChainStage(NamedTuple):
    """One DoFn of a chain: its ``name`` (qualifies its tagged outputs), the DoFn, its output tags."""

    name: str
    fn: beam.DoFn
    tags: tuple[str, ...] = ()


class ToStage(NamedTuple):
    """An output that skips ahead: ``value`` goes into the chain's stage named ``stage``, not into the next one.

    For a stage that has already done what the stages between it and ``stage`` do to a value
    (:class:`pipelines.frames.AssembleInPlace`'s plain episodes, processed by the columnar path, go
    straight to row staging). Only a later stage of the same chain; a main output only.
    """

    stage: str
    value: Any


def output_tag(stage: str, tag: str) -> str:
    """The tag under which :class:`ForkedChain` emits ``stage``'s tagged output ``tag``."""
    return f"{stage}.{tag}"


def usable_cpus() -> int:
    """CPUs this process may run on (its affinity mask, not the machine's count)."""
    return len(os.sched_getaffinity(0))


def per_task(elements: int, workers: int, *, tasks_per_worker: int = 4) -> int:
    """Elements per task so that ``elements`` make about ``tasks_per_worker`` tasks per worker.

    Examples:
        >>> per_task(50, 2), per_task(32, 2), per_task(3, 2)
        (6, 4, 1)
    """
    return max(1, elements // (workers * tasks_per_worker))


@dataclass
class _Result:
    """What one task made: ``(tag or None, value)`` pairs, and the Beam metric updates of its worker."""

    outputs: list[tuple[str | None, Any]] = field(default_factory=list)
    counters: dict[tuple[str, str], int] = field(default_factory=dict)
    distributions: dict[tuple[str, str], tuple[int, int, int, int]] = field(default_factory=dict)


#: The pools kept for the life of the process, by worker count (:func:`_pool`, :func:`close_pools`).
_POOLS: dict[int, ProcessPoolExecutor] = {}
_POOLS_LOCK = threading.Lock()

#: In a worker: the chains it was sent, by token, set up; the newest :data:`_KEEP_CHAINS` are kept (a run has
#: at most two forked chains, the read's and the assembly's; an older chain's resources, such as a Kafka
#: connection, are let go when it is torn down).
_CHAINS: OrderedDict[str, Sequence[ChainStage]] = OrderedDict()
_KEEP_CHAINS = 2

#: glibc's ``mallopt`` parameters (malloc.h) and a worker's values: allocations below 64 MiB come from the
#: heap, which keeps up to 512 MiB free at its top instead of giving it back (:func:`_keep_heap`).
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_WORKER_TRIM_BYTES, _WORKER_MMAP_BYTES = 512 << 20, 64 << 20

#: How often a worker checks that the driver that forked it still runs (:func:`_init_worker`).
_PARENT_POLL_S = 1.0


def _pool(workers: int) -> ProcessPoolExecutor:
    """The process's pool of ``workers`` forked workers; forked on first use."""
    with _POOLS_LOCK:
        pool = _POOLS.get(workers)
        if pool is None:
            pool = _POOLS[workers] = ProcessPoolExecutor(workers, mp_context=get_context("fork"),
                                                         initializer=_init_worker)
        return pool


def _drop_pool(pool: ProcessPoolExecutor) -> None:
    """Shut ``pool`` down (its pending tasks cancelled, its workers joined) and forget it."""
    with _POOLS_LOCK:
        for n, p in list(_POOLS.items()):
            if p is pool:
                del _POOLS[n]
    pool.shutdown(wait=True, cancel_futures=True)


def close_pools() -> None:
    """End every kept pool of forked workers (their memory goes back; the next bundle forks new ones).

    For a process that wants its workers' memory back between runs, and for tests, whose
    monkeypatches a worker forked earlier would not see.
    """
    with _POOLS_LOCK:
        pools = list(_POOLS.values())
        _POOLS.clear()
    for pool in pools:
        pool.shutdown(wait=True, cancel_futures=True)


#: Tasks submitted while the pipeline was still being built (:func:`prestart_scope`): token → ``(elements, future)``
#: in submission order, taken by the running ParDo (:meth:`_ForkedChainFn._submit`) when its task is the same.
_PRESTARTED: dict[str, deque[tuple[list[Any], Future]]] = {}
_PRESTART_SCOPE = threading.local()


@contextlib.contextmanager
def prestart_scope() -> Iterator[None]:
    """Within it, a :class:`ForkedChain` given its elements (``prestart=``) submits its first tasks at once.

    A batch job knows its Kafka ranges before it builds the pipeline; Beam then spends ~0.15 s building,
    translating and running the small stages before the read, on one core. Started at ``expand``, the
    forked read tasks use the other core meanwhile, and the ParDo, when it runs, takes their futures
    instead of submitting the same tasks. At the scope's end, tasks no ParDo took (the pipeline failed
    before it, or its elements came otherwise) are cancelled, or waited for when already running, so
    nothing they write appears after the run is over.
    """
    tokens: list[str] = []
    outer = getattr(_PRESTART_SCOPE, "tokens", None)
    _PRESTART_SCOPE.tokens = tokens
    try:
        yield
    finally:
        _PRESTART_SCOPE.tokens = outer
        for token in tokens:
            _discard_prestarted(token)


def _discard_prestarted(token: str) -> None:
    """Forget ``token``'s prestarted tasks no ParDo took: cancelled if queued, waited for if running."""
    with _POOLS_LOCK:
        entries = _PRESTARTED.pop(token, None)
    futures = [f for _elements, f in entries or ()]
    for f in futures:
        f.cancel()
    for f in futures:
        if not f.cancelled():
            try:
                f.result()
            except Exception:  # noqa: BLE001 - its run has ended or failed already; only its end matters (a
                pass  # second Ctrl-C while waiting still ends the wait)


def _take_prestarted(token: str, task: list[Any]) -> Future | None:
    """The future of ``token``'s next prestarted task if it is ``task``; else None (and any others are discarded)."""
    with _POOLS_LOCK:
        entries = _PRESTARTED.get(token)
        if not entries:
            return None
        if entries[0][0] == task:
            return entries.popleft()[1]
    _discard_prestarted(token)  # elements came in another order or grouping: run them as they come
    return None


def worker_pids() -> list[int]:
    """The process ids of the kept pools' workers (for a benchmark that counts their CPU time while they live)."""
    with _POOLS_LOCK:
        return sorted(pid for pool in _POOLS.values() for pid in (getattr(pool, "_processes", None) or {}))


#: A worker's collector thresholds (Python's default: 700, 10, 10; see :func:`_init_worker`).
_WORKER_GC_THRESHOLD = (20_000, 10, 10)


def _init_worker() -> None:
    """A new worker: it ends with the driver, leaves Ctrl-C to it, and keeps its heap (:func:`_keep_heap`).

    A kept worker waits between runs; were the driver killed (``kill -9``, an OOM kill)
    it would wait forever (it holds its task queue's write end itself), so a thread
    ends it within a second of its parent's end. Ctrl-C reaches the whole process group:
    the driver stops the run and shuts the pool down; an idle worker's
    ``KeyboardInterrupt`` would only print a traceback.

    What the worker was forked with (Beam, the modules, the driver's state: ~136k objects
    in the Kafka job) is frozen (``gc.freeze``, as Python's docs advise for a forked child):
    a full pass of the collector walked all of it, 0.1-0.2 s each time one came in a task
    (in about half of a 100k-event run's tasks). The worker's own objects are collected as
    before, so a task's cyclic garbage does not outlive it; the frozen ones are never
    collected in the worker, and they do not grow. The young generation is collected every
    :data:`_WORKER_GC_THRESHOLD` allocations instead of 700: a task allocates millions of
    short-lived containers and most are freed before a pass; the collector's time in a run's
    tasks went ~0.16 → ~0.05 CPU-s (0.45 before the freeze).
    """
    signal.signal(signal.SIGINT, signal.SIG_IGN)
    read_zlib_pickles()  # the chains it is sent may be pickled in the driver's in_process_pickles
    gc.set_threshold(*_WORKER_GC_THRESHOLD)
    gc.freeze()  # what came with the fork lives as long as the worker: the collector's full passes skip it
    parent = os.getppid()

    def watch_parent() -> None:
        while os.getppid() == parent:
            time.sleep(_PARENT_POLL_S)
        os._exit(1)

    threading.Thread(target=watch_parent, name="forked-parent-watch", daemon=True).start()
    _keep_heap()


def _keep_heap() -> None:
    """In a new worker (glibc only): keep freed memory for the next task and run.

    glibc gives the top of its heap back above 128 KiB free and serves allocations
    from 128 KiB (growing with use) by ``mmap``, unmapped when freed; Arrow's default
    pool (mimalloc) purges freed pages after 10 ms. Either way every task faults
    fresh pages again. In a worker the heap keeps up to 512 MiB free, allocations
    below 64 MiB come from it, and Arrow allocates through it too
    (:func:`pyarrow.system_memory_pool`). Measured (docs/pipelines.md, seventh pass):
    the Kafka job's workers faulted ~40 % fewer pages; Arrow through the heap made the
    archive job 3-7 % faster and the Kafka job no slower. The pool's workers are
    long-lived, so what they keep is the working set of their next task.
    """
    try:
        if not os.confstr("CS_GNU_LIBC_VERSION").startswith("glibc"):
            return
    except (ValueError, OSError):  # not glibc (musl has no such name)
        return
    try:
        libc = ctypes.CDLL(None)
        libc.mallopt(_M_MMAP_THRESHOLD, _WORKER_MMAP_BYTES)
        libc.mallopt(_M_TRIM_THRESHOLD, _WORKER_TRIM_BYTES)
    except (OSError, AttributeError):  # not the glibc we looked for: the defaults stay
        return
    import pyarrow as pa

    pa.set_memory_pool(pa.system_memory_pool())


def _chain(token: str, blob: bytes) -> Sequence[ChainStage]:
    """In a worker: the chain ``token`` names, unpickled from ``blob`` and set up the first time."""
    chain = _CHAINS.get(token)
    if chain is None:
        chain = pickler.loads(blob)
        for stage in chain:
            stage.fn.setup()
        _CHAINS[token] = chain
        while len(_CHAINS) > _KEEP_CHAINS:
            for stage in _CHAINS.popitem(last=False)[1]:
                stage.fn.teardown()
    else:
        _CHAINS.move_to_end(token)
    return chain


_GLOBAL_WINDOWS = (GlobalWindow(),)  # one window, its end: both immutable, shared by every value wrapped
_GLOBAL_END = _GLOBAL_WINDOWS[0].max_timestamp()


def in_global_window(out: Any) -> Any:
    """``out`` (a value or a ``TaggedOutput``) in the global window, as a ``finish_bundle`` must emit it."""
    if isinstance(out, beam.pvalue.TaggedOutput):
        return beam.pvalue.TaggedOutput(out.tag, WindowedValue(out.value, _GLOBAL_END, _GLOBAL_WINDOWS))
    return WindowedValue(out, _GLOBAL_END, _GLOBAL_WINDOWS)


def _unwrap(value: Any) -> Any:
    return value.value if isinstance(value, WindowedValue) else value


def _run_chain(chain: Sequence[ChainStage], elements: Sequence[Any]) -> _Result:
    """``elements`` through ``chain`` as one bundle (see the module docstring)."""
    result = _Result()
    index = {stage.name: i for i, stage in enumerate(chain)}
    for stage in chain:
        stage.fn.start_bundle()

    def route(i: int, outputs: Iterable[Any] | None) -> None:
        # Depth first, as Beam runs fused stages: a main output goes on into the next stage at once.
        name, last = chain[i].name, i == len(chain) - 1
        for out in outputs or ():
            if out is None:
                continue
            if isinstance(out, beam.pvalue.TaggedOutput):
                result.outputs.append((output_tag(name, out.tag), _unwrap(out.value)))
                continue
            value = _unwrap(out)
            if type(value) is ToStage:
                j = index.get(value.stage, -1)
                if j <= i:
                    raise ValueError(f"stage {name!r} sent a value to {value.stage!r}, which is not a later stage "
                                     f"of its chain ({', '.join(index)})")
                route(j, chain[j].fn.process(value.value))
            elif last:
                result.outputs.append((None, value))
            else:
                route(i + 1, chain[i + 1].fn.process(value))

    for value in elements:
        route(0, chain[0].fn.process(value))
    for i, stage in enumerate(chain):
        route(i, stage.fn.finish_bundle())
    return result


def _work(token: str, blob: bytes, elements: Sequence[Any]) -> _Result:
    """In a forked worker: run the chain ``token`` over ``elements``; collect the Beam metrics they updated.

    Beam sends a metric update to the calling thread's state tracker (the bundle's, in the driver). A
    worker's thread has whatever tracker the forking thread had: the bundle's that forked it, or none
    at all where the pool was forked outside a bundle (tasks started as the pipeline is built,
    ``prestart``; the pool a later run keeps), where every update was dropped. So each task runs under a
    tracker of its own, whose one state holds a fresh container: this task's updates, all of them.
    """
    chain = _chain(token, blob)
    container = MetricsContainer("forked")
    tracker = statesampler.StateSampler("forked", CounterFactory())  # not started: no sampling thread
    outer = statesampler.get_current_tracker()
    statesampler.set_current_tracker(tracker)
    try:
        with tracker.scoped_state("forked", "process", metrics_container=container):
            result = _run_chain(chain, elements)
    finally:
        statesampler.set_current_tracker(outer)
    for key, cell in container.metrics.items():
        name = (key.metric_name.namespace, key.metric_name.name)
        if isinstance(cell, CounterCell):
            result.counters[name] = cell.get_cumulative()
        elif isinstance(cell, DistributionCell):
            d = cell.get_cumulative()
            result.distributions[name] = (d.sum, d.count, d.min, d.max)
    return result


class _ForkedChainFn(beam.DoFn):
    def __init__(self, chain: Sequence[ChainStage], workers: int, in_flight: int, grouped: bool,
                 per_task: int) -> None:
        self._chain, self._workers, self._in_flight, self._grouped = list(chain), workers, in_flight, grouped
        self._per_task = per_task
        self._pool: ProcessPoolExecutor | None = None
        self._futures: deque[Future] = deque()
        self._prestarted: str | None = None  # the token of the tasks :meth:`prestart` submitted

    def _pack(self) -> None:
        """Import the lazy modules (once here, not once in every forked worker) and pickle the chain for them."""
        for name in LAZY_IMPORTS:
            importlib.import_module(name)
        self._token, self._blob = uuid.uuid4().hex, pickler.dumps(self._chain)

    def prestart(self, elements: Sequence[Any]) -> str:
        """Submit the first tasks of ``elements`` (those the ParDo will get) now; returns their token."""
        self._pack()
        self._prestarted = self._token
        pool = _pool(self._workers)
        elements = list(elements)
        tasks = [elements[i:i + self._per_task] for i in range(0, len(elements), self._per_task)]
        entries = deque((task, pool.submit(_work, self._token, self._blob, task)) for task in tasks[:self._in_flight])
        with _POOLS_LOCK:
            _PRESTARTED[self._token] = entries
        return self._token

    def setup(self) -> None:
        if self._workers > 1:  # the workers set up their own copies
            if self._prestarted is None:  # else prestart packed it (this is Beam's copy of the DoFn)
                self._pack()
        else:
            for name in LAZY_IMPORTS:
                importlib.import_module(name)
            for stage in self._chain:
                stage.fn.setup()

    def start_bundle(self) -> None:
        self._close()  # the pool of an earlier bundle that failed (a --loop process runs many)
        if self._workers > 1:
            self._pool = _pool(self._workers)
        self._futures = deque()
        self._task: list[Any] = []

    def process(self, element: Any) -> Iterator[Any]:
        if self._grouped:
            element = (element[0], list(element[1]))  # a GroupByKey's lazy iterable: listed to be pickled
        self._task.append(element)
        if len(self._task) >= self._per_task:
            yield from self._submit(windowed=False)
        while self._futures and (len(self._futures) > self._in_flight or self._futures[0].done()):
            yield from self._emit(self._result(self._futures.popleft()), windowed=False)

    def finish_bundle(self) -> Iterator[Any]:
        try:
            if self._task:
                yield from self._submit(windowed=True)
            while self._futures:
                yield from self._emit(self._result(self._futures.popleft()), windowed=True)
        finally:
            self._close()  # a failed bundle's pool is shut down; a finished one's is kept

    def _submit(self, *, windowed: bool) -> Iterator[Any]:
        task, self._task = self._task, []
        if self._pool is None:  # one worker: the task runs here, its metrics straight into the bundle's
            yield from self._emit(_run_chain(self._chain, task), windowed=windowed)
        else:
            future = _take_prestarted(self._prestarted, task) if self._prestarted is not None else None
            self._futures.append(future or self._pool.submit(_work, self._token, self._blob, task))

    def teardown(self) -> None:
        self._close()
        if self._workers == 1:
            for stage in self._chain:
                stage.fn.teardown()

    def _result(self, future: Future) -> _Result:
        try:
            return future.result()
        except BrokenProcessPool as err:
            if self._pool is not None:  # broken for good: the next bundle forks a new one
                _drop_pool(self._pool)
                self._pool = None
            stages = " → ".join(s.name for s in self._chain)
            raise ForkedWorkerDied(
                f"a forked worker of {stages} died before it answered (killed? out of memory?); nothing of this "
                "run was committed: run it again, with --local-workers 1 to keep it in one process") from err

    def _close(self) -> None:
        """Let go of the pool: kept when the bundle finished, shut down with tasks still in it (it failed)."""
        if self._prestarted is not None and self._futures:  # failed: prestarted tasks not taken end too
            _discard_prestarted(self._prestarted)
        if self._pool is not None:
            if self._futures:  # the bundle failed: its other tasks must not go on writing
                for f in self._futures:
                    f.cancel()
                self._futures.clear()
                _drop_pool(self._pool)
            self._pool = None

    @staticmethod
    def _emit(result: _Result, *, windowed: bool) -> Iterator[Any]:
        container = MetricsEnvironment.current_container()
        if container is not None:  # a worker's metric updates (none for a task run here: they went in directly)
            from apache_beam.metrics.metricbase import MetricName

            for (ns, name), n in result.counters.items():
                container.get_counter(MetricName(ns, name)).inc(n)
            for (ns, name), (total, count, lo, hi) in result.distributions.items():
                cell = container.get_distribution(MetricName(ns, name))
                if count == 1:
                    cell.update(total)
                elif count > 1:  # min and max exact; count and sum approximate (only max is read: job_counts)
                    cell.update(lo)
                    cell.update(hi)
        for tag, value in result.outputs:
            out = value if tag is None else beam.pvalue.TaggedOutput(tag, value)
            yield in_global_window(out) if windowed else out  # from finish_bundle: Beam needs the window


class ForkedChain(beam.PTransform):
    """Run ``chain`` (DoFns fused main → main) over each element in ``workers`` forked processes.

    With ``workers=1`` nothing is forked: the tasks run in the bundle's own process, one after the
    other, with the same outputs and tags (for a stage whose input is too small to pay for a fork).

    Returns a ``DoOutputsTuple``: ``main`` is the last DoFn's main output;
    ``result[output_tag(stage, tag)]`` each stage's tagged output. A worker's
    task, one bundle of the chain, is ``per_task`` elements (fewer, larger
    bundles: fewer row parts and partial statistics; more: better balance);
    ``in_flight`` tasks at most are submitted and not yet emitted (it bounds the
    driver's memory). ``grouped``: the elements are a GroupByKey's ``(key, values)``
    (the values are listed to be pickled). ``prestart``: the elements the ParDo will get, when they are
    known as the pipeline is built (a ``beam.Create``); within :func:`prestart_scope` its first
    ``in_flight`` tasks are submitted at ``expand``, not when the ParDo runs. See the module docstring
    for when it fits.
    """

    def __init__(self, chain: Sequence[ChainStage], *, workers: int, in_flight: int | None = None,
                 grouped: bool = False, per_task: int = 1, output_type: Any = None,
                 prestart: Sequence[Any] | None = None) -> None:
        super().__init__()
        if workers < 1 or per_task < 1:
            raise ValueError(f"`workers` and `per_task` must be >= 1, got {workers} and {per_task}")
        self._per_task = per_task
        self._chain, self._workers = list(chain), workers
        self._in_flight = in_flight or 2 * workers
        self._type, self._grouped = output_type, grouped
        self._prestart = None if prestart is None else list(prestart)

    def expand(self, pcoll):
        tags = [output_tag(s.name, t) for s in self._chain for t in s.tags]
        fn = _ForkedChainFn(self._chain, self._workers, self._in_flight, self._grouped, self._per_task)
        scope = getattr(_PRESTART_SCOPE, "tokens", None)
        if self._prestart and self._workers > 1 and not self._grouped and scope is not None:
            scope.append(fn.prestart(self._prestart))
        pardo = beam.ParDo(fn)
        if self._type is not None:
            pardo = pardo.with_output_types(self._type)
        return pcoll | pardo.with_outputs(*tags, main="main")
