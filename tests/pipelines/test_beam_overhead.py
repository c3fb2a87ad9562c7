"""pipelines/beam_overhead.py: cached option views and memoized signatures change nothing Beam computes."""

from __future__ import annotations

import functools

import apache_beam as beam
from apache_beam.options.pipeline_options import DebugOptions, PipelineOptions, StandardOptions, TypeOptions
from apache_beam.transforms import core
from apache_beam.typehints import decorators

from pipelines.beam_overhead import ViewCachingOptions, memoize_signatures


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

