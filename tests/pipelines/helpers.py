"""Test helpers: synthetic archives and a FnApiRunner TestPipeline."""

from __future__ import annotations

import itertools
from pathlib import Path

from apache_beam.runners.portability.fn_api_runner import FnApiRunner
from apache_beam.testing.test_pipeline import TestPipeline

from schemas.events import Event
from streams.archive import PartitionRange, write_commit
from streams.synth import generate_episodes

TOPIC = "trajpipe.events"


def make_pipeline() -> TestPipeline:
    """A TestPipeline on FnApiRunner (the DirectRunner may try to download Prism)."""
    return TestPipeline(runner=FnApiRunner())


def write_archive(root: Path, commits: list[list[Event]], *, buckets: int = 4) -> Path:
    """Write an event archive (docs/archive.md) with one commit per list of events."""
    (root / "_commits").mkdir(parents=True, exist_ok=True)
    offset = 0
    for n, events in enumerate(commits, start=1):
        positions = [(0, offset + i) for i in range(len(events))]
        write_commit(root, commit=n, topic=TOPIC, buckets=buckets, events=events, positions=positions,
                     offsets={0: PartitionRange(offset, offset + len(events))})
        offset += len(events)
    return root


def episodes(n: int, seed: int = 0) -> list[list[Event]]:
    return list(generate_episodes(n, seed=seed))


def flat(eps: list[list[Event]]) -> list[Event]:
    return list(itertools.chain.from_iterable(eps))
