"""Dataset commit manifests (``<out>/_manifests/<version>/<n>.json``): the commit point of every dataset commit.

The trajectory job writes one :class:`DatasetManifest` per commit
(:mod:`pipelines.commit` holds the protocol: staging, the manifest, the
renames); readers (the trainer, the catalog, reports) decode the same type
instead of re-parsing the JSON. A commit names each of its files as a
:class:`CommittedFile`: the final path, the staged path and its rows.

Layout (docs/pipelines.md)::

    <out>/_manifests/<version>/<n>.json      commit n (8 digits, from 1, gap-free per version)

Examples:
    >>> m = DatasetManifest(commit=1, version="outcome-0a1b2c3d", recipe_hash="0a1b", source="archive",
    ...                     files=[CommittedFile(path="steps/recipe=outcome-0a1b2c3d/domain=math/c00000001-s000.parquet",
    ...                                          staged="_staging/outcome-0a1b2c3d/00000001/x", rows=3)])
    >>> decode_manifest(msgspec.json.encode(m)).files[0].rows
    3
    >>> manifest_path("outcome-0a1b2c3d", 1)
    '_manifests/outcome-0a1b2c3d/00000001.json'
"""

from __future__ import annotations

from datetime import datetime, timezone
from typing import Any

import msgspec

from schemas.datasets import DATASET_SCHEMA_VERSION
from schemas.events import SCHEMA_VERSION

__all__ = [
    "MANIFEST_DIR",
    "CommittedFile",
    "DatasetManifest",
    "decode_manifest",
    "manifest_path",
]

#: Directory of the commit manifests under the dataset root.
MANIFEST_DIR = "_manifests"


class CommittedFile(msgspec.Struct, frozen=True, kw_only=True):
    """One file of a commit.

    Attributes:
        path: final path, relative to ``<out>``.
        staged: staged path, relative to ``<out>``.
        rows: rows in the file (0 for state files).
    """

    path: str
    staged: str
    rows: int = 0


class DatasetManifest(msgspec.Struct, kw_only=True):
    """One dataset commit (``_manifests/<version>/<n>.json``).

    Attributes:
        commit: commit number, from 1, gap-free per version.
        version: dataset version ``<recipe name>-<hash8>``.
        recipe_hash: full sha256 of the recipe's canonical JSON.
        recipe: the recipe's fields (as in its YAML form).
        source: ``archive``, ``kafka`` or ``raw`` (records given in memory: tests, benchmarks).
        mode: ``batch`` (one commit per micro-batch) or ``stream`` (one commit
            per event-time window pane of the streaming job).
        window: ``[start, end)`` of the pane's event-time window, epoch seconds
            (stream; None for the end-of-stream pending commit).
        pane: ``ON_TIME``, ``LATE``, ... and the pane index, e.g. ``LATE/2`` (stream).
        archive_dir: the archive read (archive source).
        archive_commits: archive commits this commit covers.
        offsets: ``topic -> partition -> [start, end)`` covered (Kafka source); in
            stream mode the offsets of the records whose batches fell into the pane.
        files: every file of the commit (data and state).
        pending_file: the pending-state file after this commit (None: nothing pending).
        groups_file: the held-group state after this commit (None: the commit decided
            no groups, e.g. a stream's pending-state commit; the last one that did stands).
        held_parts: base paths (relative to ``<out>``) of the held groups' rows
            (``<base>.trajectories.arrow``, ``<base>.steps.arrow``), with ``groups_file``.
        late_state: the late-state files after this commit (pipelines/late.py):
            ``path -> newest event time in it`` (epoch seconds), in commit order;
            a file is dropped once that is older than the retention.
        norm_file: the persisted statistics file.
        clock_s: event-time clock (epoch seconds) after this commit.
        counts: the run's counts (events_in, episodes, steps, dead_letters, ...).
        schema_version: dataset row layout version.
        event_schema_version: event-model version of this reader.
        created_at: when the commit was made (UTC).
    """

    commit: int
    version: str
    recipe_hash: str
    source: str
    mode: str = "batch"
    window: list[float] | None = None
    pane: str | None = None
    recipe: dict[str, Any] = {}
    archive_dir: str | None = None
    archive_commits: list[int] = []
    offsets: dict[str, dict[int, list[int]]] = {}
    files: list[CommittedFile] = []
    pending_file: str | None = None
    groups_file: str | None = None
    held_parts: list[str] = []
    late_state: dict[str, float] = {}
    norm_file: str | None = None
    clock_s: float = 0.0
    counts: dict[str, int] = {}
    schema_version: int = DATASET_SCHEMA_VERSION
    event_schema_version: int = SCHEMA_VERSION
    created_at: datetime = msgspec.field(default_factory=lambda: datetime.now(timezone.utc))


_DECODER = msgspec.json.Decoder(DatasetManifest)


def decode_manifest(data: bytes) -> DatasetManifest:
    """Decode a manifest's JSON bytes.

    Raises:
        msgspec.DecodeError: not JSON.
        msgspec.ValidationError: JSON, but not a manifest (the message names the field).

    Examples:
        >>> decode_manifest(b'{"commit": 2, "version": "v-1", "recipe_hash": "h", "source": "kafka"}').commit
        2
    """
    return _DECODER.decode(data)


def manifest_path(version: str, commit: int) -> str:
    """The manifest of commit ``commit`` of ``version``, relative to the dataset root.

    Examples:
        >>> manifest_path("grpo-0123abcd", 12)
        '_manifests/grpo-0123abcd/00000012.json'
    """
    return f"{MANIFEST_DIR}/{version}/{commit:08d}.json"
