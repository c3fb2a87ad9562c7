"""pipelines/beam_overhead.py: cached views and memoized signatures change nothing Beam computes; sampling still
samples; zlib pickles only inside in_process_pickles (or Beam's harness thread), readable with bzip2 ones."""

from __future__ import annotations

import base64
import bz2
import functools
import threading
import time
from concurrent.futures import ProcessPoolExecutor
from multiprocessing import get_context

import apache_beam as beam
from apache_beam.options.pipeline_options import DebugOptions, PipelineOptions, StandardOptions, TypeOptions
from apache_beam.transforms import core
from apache_beam.typehints import decorators

from apache_beam.internal import cloudpickle_pickler, pickler
from apache_beam.options.pipeline_options import DirectOptions

from pipelines import forked
from pipelines.batch_job import _in_process
from pipelines.beam_overhead import (STATE_SAMPLING_PERIOD_MS, ViewCachingOptions, in_process_pickles,
                                     memoize_signatures, read_zlib_pickles, shorten_state_sampling)


class _Fn(beam.DoFn):
    def process(self, element, side=None, *, kw=1):
        yield element

    def finish_bundle(self):
        return None


def test_cached_views_share_the_options_values():
    base = PipelineOptions(["--runner=FnApiRunner", "--experiments=a", "--no_pipeline_type_check"])
    opts = base.view_as(ViewCachingOptions)
    assert opts.view_as(StandardOptions) is opts.view_as(StandardOptions)
    assert opts.view_as(StandardOptions).runner == "FnApiRunner"
    assert opts.view_as(TypeOptions).pipeline_type_check is False
    opts.view_as(DebugOptions).add_experiment("b")  # through a cached view: visible everywhere, base included
    assert opts.view_as(DebugOptions).experiments == ["a", "b"] == base.view_as(DebugOptions).experiments
    opts.view_as(StandardOptions).runner = "PrismRunner"
    assert opts.get_all_options()["runner"] == "PrismRunner" == base.view_as(StandardOptions).runner
    assert opts.get_all_options() == base.get_all_options()


def test_memoized_signatures_equal_beams():
    memoize_signatures()
    memoize_signatures()  # idempotent: one wrapper, around Beam's own function
    patched = decorators.get_signature
    original = patched.__wrapped__
    assert core.get_signature is patched and not getattr(original, "_trajpipe_memoized", False)
    a, b = _Fn(), _Fn()
    callables = [a.process, b.process, a.finish_bundle, lambda x, y=2: x, len, str.strip, _Fn,
                 functools.partial(lambda x, y: x, 1), core.get_function_args_defaults]
    for f in callables:
        assert patched(f) == original(f), f
    assert patched(a.process) is patched(b.process)  # bound methods: one entry per function
    assert core.get_function_arguments(a, "process") == (["element", "side"], [None])



class _Stateful(beam.DoFn):
    BAG = beam.transforms.userstate.BagStateSpec("bag", beam.coders.VarIntCoder())
    TIMER = beam.transforms.userstate.TimerSpec("t", beam.TimeDomain.WATERMARK)

    def process(self, element, bag=beam.DoFn.StateParam(BAG), t=beam.DoFn.TimerParam(TIMER)):
        yield element

    @beam.transforms.userstate.on_timer(TIMER)
    def fire(self, bag=beam.DoFn.StateParam(BAG)):
        return None


class _Duplicate(beam.DoFn):
    BAG = beam.transforms.userstate.BagStateSpec("bag", beam.coders.VarIntCoder())

    def process(self, element, a=beam.DoFn.StateParam(BAG), b=beam.DoFn.StateParam(BAG)):
        yield element


def test_memoized_dofn_specs_equal_beams():
    import pytest
    from apache_beam.transforms import userstate

    memoize_signatures()
    memoize_signatures()
    patched = userstate.get_dofn_specs
    original = patched.__wrapped__
    assert patched._trajpipe_memoized and not getattr(original, "_trajpipe_memoized", False)
    stateful = _Stateful()
    borrowed = _Fn()
    borrowed.finish_bundle = stateful.process  # a bound method of another DoFn: its parameters count here
    fns = [_Fn(), _Fn(), stateful, _Stateful(), beam.Map(lambda x: x).fn, beam.FlatMap(str.split).fn, borrowed]
    for fn in fns * 2:  # twice: the second answers come from the memo
        assert patched(fn) == original(fn), fn
    assert patched(stateful) == ({_Stateful.BAG}, {_Stateful.TIMER})
    assert patched(borrowed) == ({_Stateful.BAG}, {_Stateful.TIMER}) != patched(_Fn())
    assert userstate.is_stateful_dofn(stateful) and not userstate.is_stateful_dofn(_Fn())
    got = patched(stateful)
    got[0].clear()  # callers get their own sets: the memo is untouched
    assert patched(stateful) == ({_Stateful.BAG}, {_Stateful.TIMER})
    for _ in range(2):  # an invalid DoFn raises every time, as in Beam
        with pytest.raises(ValueError, match="duplicate"):
            patched(_Duplicate())


class _YieldsAndReturns(beam.DoFn):
    def process(self, element):
        if element:
            return [element]
        yield element


def test_memoized_yield_return_check_equals_beams():
    memoize_signatures()
    patched = core._check_fn_use_yield_and_return
    original = patched.__wrapped__
    assert patched._trajpipe_memoized and not getattr(original, "_trajpipe_memoized", False)
    fns = [_YieldsAndReturns().process, _YieldsAndReturns().process, _Fn().process, _Stateful().process,
           lambda x: [x], len, functools.partial(len)]
    for fn in fns * 2:  # twice: the second answers come from the memo
        assert patched(fn) == original(fn), fn
    assert patched(_YieldsAndReturns().process) is True and patched(_Fn().process) is False
    assert core.ParDo(_YieldsAndReturns()).fn.__class__ is _YieldsAndReturns  # ParDo still builds


class _Sleepy(beam.DoFn):
    def process(self, element):
        time.sleep(0.3)
        yield element


def test_shortened_state_sampling_still_samples(monkeypatch):
    """The bundle state sampler's period is 10 ms after the call; Beam's step msecs are still measured."""
    from apache_beam.metrics import monitoring_infos
    from apache_beam.runners.portability.fn_api_runner import FnApiRunner
    from apache_beam.runners.worker import statesampler
    from apache_beam.utils.counters import CounterFactory

    init = statesampler.StateSampler.__init__
    # Beam's own period for this test (a job run earlier in this process shortened it), restored after it.
    monkeypatch.setattr(init, "__defaults__", (statesampler.DEFAULT_SAMPLING_PERIOD_MS,))
    assert statesampler.StateSampler("a", CounterFactory()).sampling_period_ms == 200
    shorten_state_sampling()
    shorten_state_sampling()  # idempotent
    assert statesampler.StateSampler("a", CounterFactory()).sampling_period_ms == STATE_SAMPLING_PERIOD_MS == 10
    assert statesampler.StateSampler("a", CounterFactory(), 50).sampling_period_ms == 50  # explicit: kept
    p = beam.Pipeline(runner=FnApiRunner())
    _ = p | beam.Create([1]) | "Sleep" >> beam.ParDo(_Sleepy())
    result = p.run()
    result.wait_until_finish()
    msecs = [monitoring_infos.extract_counter_value(mi) for mi in result.monitoring_infos()
             if mi.urn == monitoring_infos.PROCESS_BUNDLE_MSECS_URN and mi.labels.get("PTRANSFORM", "").endswith("Sleep")]
    assert msecs and max(msecs) >= 250  # the 0.3 s in process(), sampled every <= 10 ms


def _compression(encoded: bytes) -> str:
    raw = base64.b64decode(encoded)
    return {b"B": "bzip2", b"x": "zlib"}[raw[:1]]


def _dumps_in_thread(name: str, obj) -> bytes:
    out = []
    t = threading.Thread(target=lambda: out.append(pickler.dumps(obj)), name=name)
    t.start()
    t.join()
    return out[0]


def test_pickles_are_zlib_only_inside_in_process_pickles_and_both_kinds_read():
    read_zlib_pickles()
    read_zlib_pickles()  # idempotent
    obj = {"fn": _Fn(), "n": list(range(50))}
    stock = base64.b64encode(bz2.compress(cloudpickle_pickler._dumps(obj), 9))  # as Beam made it before the switch
    outside = pickler.dumps(obj)
    with in_process_pickles():
        inside = pickler.dumps(obj)
        other_thread = _dumps_in_thread("Thread-x", obj)  # the flag is this thread's
        with in_process_pickles(False):  # disabled: changes nothing, the enclosing setting holds
            nested = pickler.dumps(obj)
        with in_process_pickles():  # nested: the outer setting comes back on its exit
            pass
        still = pickler.dumps(obj)
    after = pickler.dumps(obj)
    assert [_compression(e) for e in (stock, outside, inside, other_thread, nested, still, after)] == [
        "bzip2", "bzip2", "zlib", "bzip2", "zlib", "zlib", "bzip2"]
    for encoded in (stock, outside, inside, after):
        back = pickler.loads(encoded)
        assert back["n"] == list(range(50)) and isinstance(back["fn"], _Fn)
    with in_process_pickles(False):
        assert _compression(pickler.dumps(obj)) == "bzip2"


def test_beams_harness_thread_pickles_with_zlib():
    """What the SDK harness pickles while it builds a bundle's operations, it reads in the same process."""
    read_zlib_pickles()
    assert _compression(_dumps_in_thread("ExecutionTreeCreator_0", [1, 2])) == "zlib"
    assert pickler.loads(_dumps_in_thread("ExecutionTreeCreator_0", [1, 2])) == [1, 2]


def test_a_worker_forked_before_the_switch_reads_zlib_pickles():
    """A forked-chain worker forked before this process first read zlib pickles reads them (its initializer)."""
    cloudpickle_pickler.bz2 = bz2  # as before any in-process run here
    try:
        with ProcessPoolExecutor(1, mp_context=get_context("fork"), initializer=forked._init_worker) as pool:
            assert pool.submit(abs, -1).result() == 1  # the worker exists now, forked without the switch
            with in_process_pickles():
                blob = pickler.dumps({"n": [1, 2, 3]})
            assert _compression(blob) == "zlib"
            assert pool.submit(pickler.loads, blob).result() == {"n": [1, 2, 3]}
    finally:
        read_zlib_pickles()


def test_only_an_in_process_run_makes_zlib_pickles():
    from apache_beam.options.pipeline_options import PipelineOptions

    multi = PipelineOptions(["--direct_running_mode=multi_processing"])
    assert multi.view_as(DirectOptions).direct_running_mode == "multi_processing"
    assert _in_process("FnApiRunner", None)
    assert _in_process("FnApiRunner", PipelineOptions(["--direct_running_mode=multi_threading"]))
    assert not _in_process("FnApiRunner", multi)  # its SDK workers are fresh interpreters: bzip2 only
    assert not _in_process("PrismRunner", None) and not _in_process("FlinkRunner", None)
