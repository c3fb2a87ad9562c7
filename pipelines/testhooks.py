"""Test-only hooks into the batch job: simulated crashes at commit points, and in-memory input records.

Nothing outside ``tests/`` (and benchmarks) sets these; the commands and the
public functions (:func:`pipelines.batch_job.run_batch`,
:func:`pipelines.commit.commit_staged`) carry no test parameter. A hook is
armed for the duration of a ``with`` block, in the process that runs the
driver (the commit protocol runs on the driver, so a crash fires whichever
runner executes the job)::

    with testhooks.crash_at("after_manifest"), pytest.raises(CommitError):
        run_batch(out=out, recipe=recipe, input=ArchiveInput(root))

    counts = testhooks.run_batch_on_records([batch], out=out, recipe=recipe)   # the tests' Kafka stand-in

Examples:
    >>> with crash_at("before_delta"):
    ...     crashes_at("before_delta"), crashes_at("before_manifest")
    (True, False)
    >>> crashes_at("before_delta")
    False
"""

from __future__ import annotations

import contextlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any, ClassVar

if TYPE_CHECKING:
    from pipelines.recipes import Recipe
    from pipelines.types import RawRecords

__all__ = [
    "CRASH_POINTS",
    "RAW_SOURCE",
    "InMemoryInput",
    "crash_at",
    "crashes_at",
    "in_memory_records",
    "injected_records",
    "run_batch_on_records",
]

#: Points of :func:`pipelines.commit.commit_staged` a simulated crash can hit: before the manifest is written;
#: after it (one staged file renamed, the rest not); after the renames, before the Delta transactions.
CRASH_POINTS = ("before_manifest", "after_manifest", "before_delta")
#: The manifest's ``source`` for records injected by :func:`in_memory_records`.
RAW_SOURCE = "raw"

_crash_at: str | None = None
_records: list[RawRecords] | None = None


@contextlib.contextmanager
def crash_at(point: str) -> Iterator[None]:
    """Within the block, the batch commit raises ``CommitError`` at ``point`` (one of :data:`CRASH_POINTS`)."""
    global _crash_at
    if point not in CRASH_POINTS:
        raise ValueError(f"unknown crash point {point!r}; one of {', '.join(CRASH_POINTS)}")
    before, _crash_at = _crash_at, point
    try:
        yield
    finally:
        _crash_at = before


def crashes_at(point: str) -> bool:
    """Whether a simulated crash is armed at ``point`` (asked by :func:`pipelines.commit.commit_staged`)."""
    return _crash_at == point


@dataclass(frozen=True)
class InMemoryInput:
    """The batch job's input (like :class:`pipelines.inputs.KafkaInput`) for the records :func:`in_memory_records`
    injects; without them the job refuses it."""

    #: The manifest's ``source``.
    source: ClassVar[str] = RAW_SOURCE


@contextlib.contextmanager
def in_memory_records(records: Sequence[RawRecords]) -> Iterator[None]:
    """Within the block, a batch run of :class:`InMemoryInput` reads ``records`` (Kafka record batches)."""
    global _records
    before, _records = _records, list(records)
    try:
        yield
    finally:
        _records = before


def injected_records() -> list[RawRecords] | None:
    """The records :func:`in_memory_records` injected (None: none)."""
    return _records


def run_batch_on_records(records: Sequence[RawRecords], *, out: str | Path, recipe: Recipe,
                         **kwargs: Any) -> dict[str, int]:
    """:func:`pipelines.batch_job.run_batch` over in-memory ``records`` (the manifest's source is ``raw``)."""
    from pipelines.batch_job import run_batch  # (the job imports this module)

    with in_memory_records(records):
        return run_batch(out=out, recipe=recipe, input=InMemoryInput(), **kwargs)
