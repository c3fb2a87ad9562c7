"""Beam's fixed costs per job: four made once per process instead of once per use, two made smaller.

Measured on a batch run of 98 events from Kafka (py-spy, FnApiRunner; ~1.75 s a run whatever
the input), two Beam internals took a third of it, and they are the same in every run:

* **``PipelineOptions.view_as``** builds a new options object -- an ``argparse`` parser of every
  registered option, then a parse of the flags -- on each call, and Beam calls it for every
  transform it applies and every type check (~0.32 s a run). :class:`ViewCachingOptions` makes
  each view once: a view holds no state of its own (every view of one options object shares
  its ``_all_options`` dict, which is what Beam's ``view_as`` sets up), so the cached view reads
  and writes exactly what a fresh one would.
* **``inspect.signature``** of every method of every DoFn, three times per DoFn (graph
  construction, ``to_runner_api``, bundle processor), through
  ``apache_beam.typehints.decorators.get_signature`` (~0.2 s a run).
  :func:`memoize_signatures` wraps it with a cache keyed by the function (a bound method by its
  underlying function: its signature does not depend on the instance), held weakly.

* **``userstate.get_dofn_specs``** walks ``dir(dofn)`` and wraps every bound method to find
  state and timer parameters, for every ParDo several times per run (is it stateful? validate
  it; translate it): ~0.05 s of a run's ~0.2 s set-up. The parameters are the defaults of the
  class's methods, so :func:`memoize_signatures` also remembers the specs per DoFn *class*
  (an instance whose own attributes are methods is passed through uncached).

* **A lint of every ParDo's ``process`` source.** ``ParDo.__init__`` reads the source of its
  DoFn's ``process`` (``inspect.getsourcelines``, which tokenizes the file up to the method's
  end) to warn when it both yields and returns a value: 55 ParDos a run, 30-43 ms of a 100k-event
  Kafka run's construction, while its forked tasks need both cores. :func:`memoize_signatures`
  also remembers that answer per function (the source of a loaded function does not change);
  Beam's warnings about a method are logged the first time it is checked in a process.

* **The state sampler's last sleep.** Every bundle starts a thread that samples which step the
  bundle is in (Beam's per-step ``msecs`` metrics and its stuck-bundle reports). It sleeps a
  hundredth of its period (at least 1 ms) at first, then 1.2x longer each time up to the period,
  ``DEFAULT_SAMPLING_PERIOD_MS`` (200 ms); the bundle's end joins the thread, so it waits out the
  sleep under way. A 100k-event archive run (26 bundles, two of them 0.4-1.6 s long) waited
  0.07-0.19 s in those joins (timed around ``StateSampler.stop``), all on the run's critical
  path. :func:`shorten_state_sampling` makes the period 10 ms: the longest wait is 10 ms, the
  thread wakes 100 times a second in a long bundle (without the GIL), and the msecs it reports
  are finer, not different.

* **bzip2 on every pickle.** Beam's pickler (``apache_beam.internal.cloudpickle_pickler``)
  compresses every pickled function, DoFn, CombineFn and side-input view with bzip2 at level 9
  and decompresses it to use it, so that a pipeline's description stays small on its way to a
  remote runner. bzip2 sets up ~8 MB of tables per call whatever the input: ~0.25 ms to
  compress and ~0.04-0.2 ms to decompress a 1 KB pickle here, against ~0.04 and ~0.01 ms with
  zlib. A 100k-event Kafka run made 171 such pickles and read 276 (timed around both calls):
  70 and 50 ms, on the driver, mostly while its forked tasks need both cores or between its
  small bundles. Inside :func:`in_process_pickles` (the in-process runner: what is pickled is
  read back by the same process or its forks) the pickles made in that thread are zlib's at
  level 1, and so are those the SDK harness makes and reads again itself while it builds a
  bundle's operations (its ``ExecutionTreeCreator`` thread: 82 of the 171, in the same process
  whatever the runner); reading tells the two apart by their first byte (bzip2 streams start
  ``BZh``, zlib's ``x``), in any process where :func:`read_zlib_pickles` was called. Pickles a
  pipeline is made of outside :func:`in_process_pickles`, or in another thread, are bzip2 as
  ever: nothing another runner's workers read changes.

The first four are pure memoization of functions of their arguments; nothing Beam computes
changes. The fifth changes how often Beam samples, not what it runs; the sixth how pickles are
compressed, not what they hold (tested: ``tests/pipelines/test_beam_overhead.py``).
"""

from __future__ import annotations

import bz2
import contextlib
import threading
import types
import weakref
import zlib
from collections.abc import Iterator
from typing import Any

from apache_beam.options.pipeline_options import PipelineOptions

__all__ = ["STATE_SAMPLING_PERIOD_MS", "ViewCachingOptions", "in_process_pickles", "memoize_signatures",
           "read_zlib_pickles", "shorten_state_sampling"]

#: Views made so far, per options object (weakly: they go with it).
_VIEWS: "weakref.WeakKeyDictionary[PipelineOptions, dict[type, PipelineOptions]]" = weakref.WeakKeyDictionary()


class ViewCachingOptions(PipelineOptions):
    """Pipeline options whose ``view_as(cls)`` makes each class's view once (see the module docstring).

    Get one from any options object with ``options.view_as(ViewCachingOptions)`` (it shares their
    values), and hand it to ``beam.Pipeline``. Defines no options of its own.

    Examples:
        >>> from apache_beam.options.pipeline_options import StandardOptions
        >>> opts = PipelineOptions(["--runner=FnApiRunner"]).view_as(ViewCachingOptions)
        >>> opts.view_as(StandardOptions) is opts.view_as(StandardOptions)
        True
        >>> opts.view_as(StandardOptions).runner = "PrismRunner"; opts.get_all_options()["runner"]
        'PrismRunner'
    """

    def view_as(self, cls: type) -> Any:
        views = _VIEWS.setdefault(self, {})
        view = views.get(cls)
        if view is None:
            view = views[cls] = super().view_as(cls)
        return view


_BOUND: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()
_PLAIN: "weakref.WeakKeyDictionary[Any, Any]" = weakref.WeakKeyDictionary()


def _per_function(original: Any, *, bound: "weakref.WeakKeyDictionary[Any, Any]",
                  plain: "weakref.WeakKeyDictionary[Any, Any]") -> Any:
    """``original`` (a function of one callable) remembering its answers per Python function.

    A bound method's answer is kept in ``bound`` under its function (it does not depend on the
    instance), a function's in ``plain``; anything else (builtins, callable objects, classes) is
    passed through. The wrapper is marked ``_trajpipe_memoized`` and keeps ``original`` as ``__wrapped__``.
    """

    def memoized(fn):
        if isinstance(fn, types.MethodType) and isinstance(fn.__func__, types.FunctionType):
            cache, key = bound, fn.__func__
        elif isinstance(fn, types.FunctionType):
            cache, key = plain, fn
        else:
            return original(fn)
        got = cache.get(key)
        if got is None:
            got = cache[key] = original(fn)
        return got

    memoized._trajpipe_memoized = True  # type: ignore[attr-defined]
    memoized.__wrapped__ = original  # type: ignore[attr-defined]
    return memoized


def memoize_signatures() -> None:
    """Make Beam's ``get_signature`` remember its answers (idempotent; see the module docstring).

    Functions and bound methods (keyed by their function) are remembered; anything else
    (builtins, callable objects, classes) is passed through uncached. The first call also
    memoizes Beam's DoFn state specs and its yield-and-return check (the module docstring).
    """
    from apache_beam.transforms import core, ptransform, util
    from apache_beam.typehints import decorators

    original = decorators.get_signature
    if getattr(original, "_trajpipe_memoized", False):
        return

    get_signature = _per_function(original, bound=_BOUND, plain=_PLAIN)
    for module in (decorators, core, ptransform, util):  # every module that imported the name
        if getattr(module, "get_signature", None) is original:
            module.get_signature = get_signature
    _memoize_dofn_specs()
    _memoize_yield_return_check()


#: Per function: Beam's answer to "does this ``process`` both yield and return a value?".
_YIELD_RETURN: "weakref.WeakKeyDictionary[Any, bool]" = weakref.WeakKeyDictionary()


def _memoize_yield_return_check() -> None:
    """Beam's ``_check_fn_use_yield_and_return`` (``ParDo.__init__``) remembered per function (the module docstring)."""
    from apache_beam.transforms import core

    original = getattr(core, "_check_fn_use_yield_and_return", None)
    if original is None or getattr(original, "_trajpipe_memoized", False):
        return  # a Beam without the check, or already wrapped

    # ParDo.__init__ looks it up on the module; a method's answer is its function's
    core._check_fn_use_yield_and_return = _per_function(original, bound=_YIELD_RETURN, plain=_YIELD_RETURN)


#: Per DoFn class: per set of class methods its instance hides, ``(state specs, timer specs)``.
_SPECS: "weakref.WeakKeyDictionary[type, dict[frozenset, tuple[frozenset, frozenset]]]" = weakref.WeakKeyDictionary()


def _memoize_dofn_specs() -> None:
    """Beam's ``get_dofn_specs`` remembered per DoFn class (see the module docstring)."""
    from apache_beam.transforms import userstate

    original = userstate.get_dofn_specs
    if getattr(original, "_trajpipe_memoized", False):
        return

    def get_dofn_specs(dofn):
        own = getattr(dofn, "__dict__", {})
        if any(isinstance(v, types.MethodType) for v in own.values()):
            return original(dofn)  # bound methods set on the instance: their parameters are its own
        # Beam looks at bound methods only: an instance attribute (a plain function, as Map's
        # wrapper sets ``process``) hides the class's method of that name, so it is part of the key.
        cls = type(dofn)
        hidden = frozenset(k for k in own if callable(getattr(cls, k, None)))
        per_class = _SPECS.setdefault(cls, {})
        specs = per_class.get(hidden)
        if specs is None:
            state, timers = original(dofn)  # raises for an invalid DoFn: nothing is remembered
            specs = per_class[hidden] = (frozenset(state), frozenset(timers))
        return set(specs[0]), set(specs[1])

    get_dofn_specs._trajpipe_memoized = True  # type: ignore[attr-defined]
    get_dofn_specs.__wrapped__ = original  # type: ignore[attr-defined]
    userstate.get_dofn_specs = get_dofn_specs  # its callers look it up on the module (userstate.get_dofn_specs)


#: The state sampler's longest sleep, ms, after :func:`shorten_state_sampling` (Beam's own: 200).
STATE_SAMPLING_PERIOD_MS = 10


def shorten_state_sampling() -> None:
    """Beam's bundle state samplers made with a :data:`STATE_SAMPLING_PERIOD_MS` period (idempotent).

    The period is the default of ``StateSampler.__init__``'s ``sampling_period_ms``, which the
    bundle processor does not pass: the default is what changes, for every sampler made after
    this call (a sampler made with an explicit period keeps it).
    """
    from apache_beam.runners.worker import statesampler

    init = statesampler.StateSampler.__init__
    code = init.__code__
    if not init.__defaults__ or code.co_varnames[code.co_argcount - 1] != "sampling_period_ms":
        return  # a Beam whose signature moved: its own period stays
    init.__defaults__ = (*init.__defaults__[:-1], STATE_SAMPLING_PERIOD_MS)


#: Per thread: inside :func:`in_process_pickles` (the pickles it makes are zlib's).
_ZLIB_PICKLES = threading.local()
#: The thread in which Beam's SDK harness builds a bundle's operations (``thread_name_prefix`` of
#: ``BundleProcessor.__init__``'s executor). It pickles each DoFn again, with its windowing, for the
#: operation that the harness sets up next in its own thread: those pickles never leave the process.
_TREE_THREAD = "ExecutionTreeCreator"


class _PickleCompression:
    """What Beam's cloudpickle pickler calls ``bz2``: bzip2 as ever, zlib inside :func:`in_process_pickles`; reads both.

    Examples:
        >>> c = _PickleCompression
        >>> c.compress(b"x" * 100)[:3], c.decompress(c.compress(b"abc"))
        (b'BZh', b'abc')
        >>> with in_process_pickles():
        ...     z = c.compress(b"abc")
        >>> z[:1], c.decompress(z)
        (b'x', b'abc')
    """

    @staticmethod
    def compress(data: bytes, compresslevel: int = 9) -> bytes:
        if getattr(_ZLIB_PICKLES, "on", False) or threading.current_thread().name.startswith(_TREE_THREAD):
            return zlib.compress(data, 1)
        return bz2.compress(data, compresslevel)

    @staticmethod
    def decompress(data: bytes) -> bytes:
        if data[:1] == b"x":  # a zlib stream's first byte (deflate, 32 KB window); bzip2's is "B"
            return zlib.decompress(data)
        return bz2.decompress(data)


def read_zlib_pickles() -> None:
    """Make Beam's cloudpickle pickler read zlib pickles too, and compress through :class:`_PickleCompression` (idempotent).

    Outside :func:`in_process_pickles` what it writes changes only in the SDK harness's
    ``ExecutionTreeCreator`` thread, whose pickles are read back in the same process. Call it in
    every process that may read a pickle made inside one: this one, and a process forked before
    it was called (:func:`pipelines.forked._init_worker` does).
    """
    from apache_beam.internal import cloudpickle_pickler

    if cloudpickle_pickler.bz2 is not _PickleCompression:
        cloudpickle_pickler.bz2 = _PickleCompression  # the module's only uses: bz2.compress, bz2.decompress


@contextlib.contextmanager
def in_process_pickles(enabled: bool = True) -> Iterator[None]:
    """Within: the pickles Beam makes in this thread are zlib's (the module docstring), when ``enabled``.

    Only for pipelines whose pickles stay in this process and its forks (the in-process
    runner, ``direct_running_mode`` other than ``multi_processing``): a remote runner's workers
    read bzip2 only. Nests; the previous setting comes back on exit.
    """
    if not enabled:
        yield
        return
    read_zlib_pickles()
    before = getattr(_ZLIB_PICKLES, "on", False)
    _ZLIB_PICKLES.on = True
    try:
        yield
    finally:
        _ZLIB_PICKLES.on = before
