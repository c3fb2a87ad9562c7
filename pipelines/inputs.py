"""What a trajectory job reads, typed: the input a caller names, and the part of it one batch commit covers.

A caller names the input (:class:`KafkaInput`: a cluster and a topic; :class:`ArchiveInput`:
an event archive); the batch job plans, from the earlier commits' manifests, what its commit
covers (:class:`KafkaPlan`: an offset range per partition; :class:`ArchivePlan`: the archive
files of the commits no earlier dataset commit covers), reads exactly that, and records it in
the manifest (:meth:`KafkaPlan.manifest_fields`, :meth:`ArchivePlan.manifest_fields`). The
manifest's ``source`` is the input's :attr:`~KafkaInput.source` string (``kafka``,
``archive``). The streaming job takes a :class:`KafkaInput` and plans per window pane
(pipelines/stream_commit.py).

Examples:
    >>> from streams.config import KafkaConnection
    >>> KafkaInput(conn=KafkaConnection(bootstrap_servers="127.0.0.1:9092"), topic="events").source
    'kafka'
    >>> plan = ArchivePlan(input=ArchiveInput("data/archive"), files=())
    >>> plan.has_input, plan.manifest_fields()
    (False, {'archive_dir': 'data/archive', 'archive_commits': []})
"""

from __future__ import annotations

from collections.abc import Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any, ClassVar

from pipelines.archive_source import ArchiveFile
from streams.config import KafkaConnection
from streams.consumer import OffsetRange

__all__ = ["KafkaInput", "ArchiveInput", "BatchInput", "KafkaPlan", "ArchivePlan"]


@dataclass(frozen=True)
class KafkaInput:
    """The events topic of a Kafka cluster."""

    #: The manifest's ``source``.
    source: ClassVar[str] = "kafka"
    #: The cluster, security settings included.
    conn: KafkaConnection
    #: The events topic.
    topic: str


@dataclass(frozen=True)
class ArchiveInput:
    """An event archive (streams/archive.py)."""

    #: The manifest's ``source``.
    source: ClassVar[str] = "archive"
    #: The archive root: a local directory, or ``s3://BUCKET/PREFIX`` (batch job only).
    location: str | Path


#: What a batch run reads.
BatchInput = KafkaInput | ArchiveInput


@dataclass(frozen=True)
class KafkaPlan:
    """The offsets of ``input.topic`` one batch commit covers: from the last commit's end offsets to the end at
    job start."""

    input: KafkaInput
    #: partition -> first offset not covered yet (absent: 0).
    start: Mapping[int, int]
    #: partition -> end offset at job start.
    end: Mapping[int, int]
    #: The non-empty ``[start, end)`` ranges to read.
    ranges: tuple[OffsetRange, ...]

    @property
    def has_input(self) -> bool:
        return bool(self.ranges)

    def manifest_fields(self) -> dict[str, Any]:
        """The manifest's ``offsets``: ``{topic: {partition: [start, end]}}`` for every partition at start."""
        start = self.start
        return {"offsets": {self.input.topic: {p: [start.get(p, 0), e] for p, e in sorted(self.end.items())}}}


@dataclass(frozen=True)
class ArchivePlan:
    """The archive files one batch commit covers: those of the archive commits no earlier dataset commit covers."""

    input: ArchiveInput
    files: tuple[ArchiveFile, ...]

    @property
    def has_input(self) -> bool:
        return bool(self.files)

    def manifest_fields(self) -> dict[str, Any]:
        """The manifest's ``archive_dir`` and ``archive_commits`` (sorted, each once)."""
        return {"archive_dir": str(self.input.location), "archive_commits": sorted({f.commit for f in self.files})}
