"""The batch job's counts as data: staged beside the commit's files, summed by the driver at commit.

Beam metrics are for watching a job; whether a runner reports *committed*
metrics at all is up to the runner (Dataflow does, some portable runners do
not, and a metric bumped by the last bundle is not always reported before the
job ends). A commit's counts must not depend on that, so every DoFn that
counts an event outcome keeps its counts twice: as a Beam counter (for
monitoring, unchanged names ``pipeline/...``, added at each bundle's end) and in a :class:`BundleCounts`,
which leaves one ``{name: n}`` dict per bundle on the DoFn's ``counts``
output (:data:`COUNTS_TAG`) from ``finish_bundle``. The runner keeps the
outputs of the bundles it commits and drops those of failed attempts, so the
sum of these dicts is exact, as committed metrics are. :class:`StageCounts`
sums them and writes one file, ``<staging>/_counts/bundles.json`` (with the
run's event-time clock); a single-writer step (the GRPO group decision, the
feedback file) writes its own ``_counts/<name>.json`` beside its files. The
driver sums ``_counts/*.json`` (:func:`read_staged_counts`), adds what it
reads from the staged files themselves (rows of ``steps/`` from the Parquet
footers, complete rows of ``evaluations/``, rows of the pending state read
back), and writes the total into the manifest. The ``_counts`` files do not
end in ``.tmp``: they are no part of the commit, and go with the staging
directory.

Examples:
    >>> sum_counts([{"duplicates": 2}, {"duplicates": 1, "events_in": 5}, {}])
    {'duplicates': 3, 'events_in': 5}
"""

from __future__ import annotations

from collections import Counter
from collections.abc import Iterable, Iterator, Mapping
from pathlib import Path

import apache_beam as beam
import msgspec
from apache_beam.metrics import Metrics
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from pipelines.types import METRICS_NAMESPACE
from schemas import locations as loc

__all__ = ["COUNTS_TAG", "COUNTS_DIR", "CLOCK_KEY", "BundleCounts", "StageCounts", "sum_counts",
           "write_counts_file", "read_staged_counts"]

#: Output tag of the per-bundle count dicts.
COUNTS_TAG = "counts"
#: Directory (under a commit's staging directory) of the count files.
COUNTS_DIR = "_counts"
#: Key of the run's event-time clock (epoch seconds, a float) in ``bundles.json``.
CLOCK_KEY = "clock_s"


class _Slot:
    __slots__ = ("_owner", "_name")

    def __init__(self, owner: "BundleCounts", name: str) -> None:
        self._owner, self._name = owner, name

    def inc(self, n: int = 1) -> None:
        if n:
            self._owner._n[self._name] += n


class BundleCounts:
    """Named counters kept as Beam metrics and as per-bundle data (see the module docstring).

    ``counts[name].inc(n)`` or ``counts.inc(name, n)``; :meth:`output` from
    ``finish_bundle`` (or :meth:`emit` from ``process`` of a single-element
    step) puts the bundle's dict on :data:`COUNTS_TAG`, adds it to the Beam
    counters, and starts a new one. The counters get a bundle's counts at its
    end, once per name, not at each ``inc``: a Beam counter's ``inc`` looks up
    the bundle's metrics container each time (~1.5 us; ~2 % of a forked Kafka
    read task, a few per episode), and the runner reports a bundle's metrics
    when it ends anyway.
    """

    def __init__(self, names: Iterable[str]) -> None:
        self._metrics = {k: Metrics.counter(METRICS_NAMESPACE, k) for k in names}
        self._n: Counter = Counter()

    def __getitem__(self, name: str) -> _Slot:
        if name not in self._metrics:
            raise KeyError(f"no counter {name!r}; known: {sorted(self._metrics)}")
        return _Slot(self, name)

    def inc(self, name: str, n: int = 1) -> None:
        if name not in self._metrics:
            raise KeyError(f"no counter {name!r}; known: {sorted(self._metrics)}")
        if n:
            self._n[name] += n

    def _take(self) -> dict[str, int]:
        """The counts so far, added to the Beam counters; the next ones start from nothing."""
        n, self._n = self._n, Counter()
        for name, k in n.items():
            if k:
                self._metrics[name].inc(k)
        return {name: k for name, k in n.items() if k}

    def emit(self) -> Iterator[beam.pvalue.TaggedOutput]:
        """The counts so far on :data:`COUNTS_TAG` (from ``process``), then start again."""
        n = self._take()
        if n:
            yield beam.pvalue.TaggedOutput(COUNTS_TAG, n)

    def output(self) -> Iterator[beam.pvalue.TaggedOutput]:
        """The bundle's counts on :data:`COUNTS_TAG` (from ``finish_bundle``: global window), then start again."""
        n = self._take()
        if n:
            window = GlobalWindow()
            yield beam.pvalue.TaggedOutput(COUNTS_TAG, WindowedValue(n, window.max_timestamp(), [window]))


def sum_counts(dicts: Iterable[Mapping[str, int]]) -> dict[str, int]:
    """Key-wise sum of count dicts."""
    total: Counter = Counter()
    for d in dicts:
        total.update(d)
    return dict(total)


def write_counts_file(staging: str | Path, name: str, counts: Mapping[str, float]) -> str:
    """Write ``<staging>/_counts/<name>.json`` (atomically; a retry of a single writer rewrites the same file)."""
    loc.write_atomic(loc.join(str(staging), COUNTS_DIR, f"{name}.json"),
                     msgspec.json.encode(dict(sorted(counts.items()))))
    return f"{COUNTS_DIR}/{name}.json"


def read_staged_counts(staging: str | Path) -> tuple[dict[str, int], float | None]:
    """``(summed counts, clock_s)`` of a commit's count files; clock None when no file carried one.

    Raises:
        FileNotFoundError: the job wrote no ``bundles.json`` (it did not run to the end).
    """
    d = loc.join(str(staging), COUNTS_DIR)
    if not loc.exists(loc.join(d, "bundles.json")):
        raise FileNotFoundError(f"{loc.join(d, 'bundles.json')} is missing: the job's StageCounts step did not run")
    total: Counter = Counter()
    clock = None
    for path in loc.list_files(d, suffix=".json"):
        if path.rsplit("/", 1)[-1].startswith("."):  # a temporary file of an interrupted write
            continue
        counts = msgspec.json.decode(loc.read_bytes(path), type=dict[str, float])
        if CLOCK_KEY in counts:
            clock = counts.pop(CLOCK_KEY)
        total.update({k: int(v) for k, v in counts.items()})
    return dict(total), clock


class StageCounts(beam.PTransform):
    """Per-bundle count dicts (one or many PCollections) + the run's clock → ``_counts/bundles.json``.

    Args:
        staging: the commit's staging directory.

    Input: ``(counts, clock)``: a PCollection (or tuple of them) of count dicts, and a one-float
    PCollection (the run's event-time clock, epoch seconds). Output: the file's relative path.
    """

    def __init__(self, staging: str | Path) -> None:
        super().__init__()
        self._staging = str(staging)

    def expand(self, pcolls):
        counts, clock = pcolls
        counts = tuple(counts) if isinstance(counts, (tuple, list)) else (counts,)
        merged = counts[0] if len(counts) == 1 else counts | "AllCounts" >> beam.Flatten()
        staging = self._staging
        return (
            merged
            | "SumCounts" >> beam.CombineGlobally(sum_counts)
            | "WriteCounts" >> beam.Map(lambda c, clock_s: write_counts_file(staging, "bundles",
                                                                            {**c, CLOCK_KEY: clock_s}),
                                        clock_s=beam.pvalue.AsSingleton(clock))
        )
