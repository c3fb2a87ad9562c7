"""Streaming, packed, resumable reader of the ``steps/`` training datasets.

:class:`TrajectoryStream` is a ``torch.utils.data.IterableDataset`` that reads
the Parquet files named by committed dataset manifests (never a ``*.tmp`` file,
never a file no manifest lists) through ``pyarrow.dataset``, one row group at a
time, and packs steps (observation tokens + action tokens) into fixed-length
sequences. It yields whole :class:`PackedBatch` objects, so wrap it in a
``DataLoader(batch_size=None)`` (:class:`TrajectoryLoader` does that and keeps
track of what was consumed).

Layout read (schemas/datasets.py, docs/pipelines.md)::

    <data>/_manifests/<recipe>/<n>.json              commit n of a dataset version
    <data>/steps/recipe=<recipe>/domain=<d>/c<commit>-s<shard>.parquet

Work units, sharding and order
------------------------------
A *unit* is one row group of one committed file (row groups whose Parquet
statistics exclude the filters are pruned). Units are numbered, and unit ``i``
belongs to shard ``i % num_shards`` where ``num_shards = world_size *
num_workers`` and the shard of DataLoader worker ``w`` on rank ``r`` is
``r * num_workers + w``: no two workers of any rank read the same unit.

* ``mode="offline"``: the commits visible at the first iteration are frozen
  (``snapshot_commit``); each epoch ``e`` shuffles the unit list with
  ``rng(seed, e)``.
* ``mode="tail"``: units are numbered in commit order (shuffled inside each
  commit with ``rng(seed, commit)``), so numbers never change as commits land;
  a shard that runs out of units polls the manifests every
  ``poll_interval_s`` and continues when a new commit is complete.

Rows inside a unit are shuffled with ``rng(seed, epoch, unit)``.

Position (what goes into the trainer checkpoint)
------------------------------------------------
Each batch carries the :class:`ShardPosition` of the first row *not* packed
into any batch yet: ``(epoch, unit, row)``. Packing is greedy and a step that
does not fit closes the batch, so after a batch the packer is empty and
restarting the shard at that position reproduces the rest of the stream
exactly. :meth:`TrajectoryStream.state_dict` holds one position per shard plus
the DataLoader's round-robin phase (``next_worker``); on resume DataLoader
worker ``p`` serves logical worker ``(p + next_worker) % num_workers``, so the
interleaving of workers continues where it stopped too.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
import zlib
from collections.abc import Iterator
from dataclasses import dataclass
from pathlib import Path
from typing import Any, Literal

import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.dataset as ds
import pyarrow.fs as pafs
import torch
from torch.utils.data import DataLoader, IterableDataset, get_worker_info

from schemas.datasets import step_file_schema

__all__ = [
    "MANIFEST_DIR",
    "STATE_FORMAT",
    "DatasetCommit",
    "StepFilter",
    "ShardPosition",
    "PackedBatch",
    "TrajectoryStream",
    "TrajectoryLoader",
    "read_commit_manifest",
    "scan_commits",
    "list_recipes",
]

log = logging.getLogger(__name__)

#: Directory of commit manifests under the dataset root.
MANIFEST_DIR = "_manifests"
#: Version of the :meth:`TrajectoryStream.state_dict` layout.
STATE_FORMAT = 1

#: Columns the packer needs (the rest of StepRow is never read).
_COLUMNS = [
    "event_id", "policy_version", "status", "observation_token_ids", "action_token_ids",
    "behaviour_logprobs", "loss_mask", "reward", "normalized_advantage", "group_advantage", "advantage",
]
_FORMAT = ds.ParquetFileFormat()
_LOCAL_FS = pafs.LocalFileSystem()
_ADVANTAGE_FIELDS = ("normalized_advantage", "group_advantage", "advantage")


class DataError(RuntimeError):
    """The datasets directory or a resume state is not what the stream expects."""


# ----------------------------------------------------------------------------- manifests


class DatasetCommit(msgspec.Struct, frozen=True, kw_only=True):
    """One committed dataset commit (``_manifests/<recipe>/<n>.json``), as the trainer sees it.

    Attributes:
        commit: commit number (from 1, gap-free per recipe).
        recipe: dataset version ``<recipe name>-<hash8>``.
        files: its ``steps/`` data files, relative to the dataset root.
    """

    commit: int
    recipe: str
    files: tuple[str, ...]


def read_commit_manifest(path: Path, *, root: Path) -> DatasetCommit:
    """Read one commit manifest (``pipelines.commit.DatasetManifest``, docs/pipelines.md); keep its ``steps/`` files.

    Only ``commit`` and ``files[].path`` (relative to the dataset root) are
    used; the trainer does not import ``pipelines``, so the manifest is read as
    plain JSON. A file entry may also be a bare path string.

    Raises:
        DataError: the manifest is not JSON or has no ``files`` list.
    """
    try:
        doc = json.loads(path.read_bytes())
        entries = doc["files"]
        commit = int(doc.get("commit", path.stem))
    except (OSError, ValueError, KeyError, TypeError) as err:
        raise DataError(f"commit manifest {path} is unreadable or has no `files` list: {err!r}") from err
    files = []
    for entry in entries:
        rel = Path(entry["path"] if isinstance(entry, dict) else entry)
        if rel.is_absolute() and rel.is_relative_to(root):
            rel = rel.relative_to(root)
        if rel.parts and rel.parts[0] == "steps" and rel.suffix == ".parquet":
            files.append(rel.as_posix())
    return DatasetCommit(commit=commit, recipe=path.parent.name, files=tuple(sorted(set(files))))


def list_recipes(data_dir: Path) -> list[str]:
    """Dataset versions (recipes) that have a manifest directory."""
    mdir = Path(data_dir) / MANIFEST_DIR
    return sorted(p.name for p in mdir.iterdir() if p.is_dir()) if mdir.is_dir() else []


def scan_commits(data_dir: Path, *, recipe: str, after: int = 0, upto: int | None = None) -> list[DatasetCommit]:
    """Committed and complete commits of one dataset version, in commit order.

    A commit is visible when its manifest exists (written atomically: the
    commit point) **and** all its files are in place (the writer renames data
    files into place after the manifest, as the archive does). Commits become
    visible strictly in order: scanning stops at the first missing or
    incomplete commit, so a later commit never overtakes an earlier one.

    Args:
        data_dir: dataset root.
        recipe: dataset version directory under ``_manifests/``.
        after: skip commits ``<= after``.
        upto: stop after this commit.
    """
    root = Path(data_dir)
    mdir = root / MANIFEST_DIR / recipe
    if not mdir.is_dir():
        return []
    numbered = {}
    for p in mdir.glob("*.json"):
        if p.name.startswith(".") or not p.stem.isdigit():
            continue  # a manifest being written (".<n>.json.tmp" or similar)
        numbered[int(p.stem)] = p
    out: list[DatasetCommit] = []
    n = after + 1
    while n in numbered and (upto is None or n <= upto):
        c = read_commit_manifest(numbered[n], root=root)
        if not all((root / f).is_file() for f in c.files):
            break
        out.append(c)
        n += 1
    return out


# ----------------------------------------------------------------------------- filters


class StepFilter(msgspec.Struct, frozen=True, kw_only=True):
    """Which steps to train on. ``None`` means no bound.

    Attributes:
        domains: keep only these domains (partition key; whole files are skipped).
        min_policy_version: keep steps acted by policy version >= this.
        max_policy_version: keep steps acted by policy version <= this.
        min_advantage: keep steps with ``normalized_advantage >= this``.
        max_advantage: keep steps with ``normalized_advantage <= this``.
        statuses: keep steps of episodes that ended with one of these statuses.
    """

    domains: tuple[str, ...] | None = None
    min_policy_version: int | None = None
    max_policy_version: int | None = None
    min_advantage: float | None = None
    max_advantage: float | None = None
    statuses: tuple[str, ...] | None = None

    def expression(self) -> pc.Expression | None:
        """The row filter as a pyarrow expression (pushed down to row-group statistics)."""
        terms = []
        if self.min_policy_version is not None:
            terms.append(pc.field("policy_version") >= self.min_policy_version)
        if self.max_policy_version is not None:
            terms.append(pc.field("policy_version") <= self.max_policy_version)
        if self.min_advantage is not None:
            terms.append(pc.field("normalized_advantage") >= self.min_advantage)
        if self.max_advantage is not None:
            terms.append(pc.field("normalized_advantage") <= self.max_advantage)
        if self.statuses is not None:
            terms.append(pc.field("status").isin(list(self.statuses)))
        expr = None
        for t in terms:
            expr = t if expr is None else expr & t
        return expr

    def accepts_domain(self, domain: str) -> bool:
        return self.domains is None or domain in self.domains

    def fingerprint(self) -> str:
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:16]


# ----------------------------------------------------------------------------- batches


class ShardPosition(msgspec.Struct, frozen=True, kw_only=True):
    """Where a shard's stream stands: the first row not yet packed into a batch.

    Attributes:
        shard: global shard id ``rank * num_workers + logical_worker``.
        epoch: epoch (always 0 in tail mode).
        unit: index into the shard's unit list of that epoch.
        row: row inside that unit (after filtering and shuffling).
        batches: batches this shard has emitted so far.
    """

    shard: int
    epoch: int = 0
    unit: int = 0
    row: int = 0
    batches: int = 0


@dataclass
class PackedBatch:
    """``batch_size`` packed sequences of ``seq_len`` tokens; every tensor is ``[B, L]`` unless noted.

    Each step is one *segment*: its observation tokens then its action tokens.
    Segments never attend to each other: ``position_ids`` restart at 0 in
    every segment (transformers builds the block-causal mask from them).
    Per-token fields are aligned with ``input_ids``: entry ``[b, t]`` is about
    token ``t`` (predicted from the tokens before it in its segment).

    Attributes:
        input_ids: token ids (int64); padding uses ``pad_id``.
        position_ids: position inside the segment (int64).
        loss_mask: action tokens the step's ``loss_mask`` keeps (bool); never
            the first token of a segment (nothing to predict it from), never padding.
        behaviour_logprobs: behaviour-policy log-prob of each action token
            (float32; 0 where unrecorded).
        has_behaviour_logprobs: the step recorded behaviour log-probs (bool).
        advantages: the step's advantage repeated on its tokens (float32).
        policy_versions: behaviour policy version of the step (int64; -1 on padding).
        segment_ids: index into ``sample_ids`` (int64; -1 on padding).
        sample_ids: ``event_id`` of each segment, in packing order (length S).
        sample_rewards: ``reward`` of each segment, ``[S]`` float32.
        num_tokens: non-padding tokens.
        position: stream position after this batch (see module docstring).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    has_behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    policy_versions: torch.Tensor
    segment_ids: torch.Tensor
    sample_ids: list[str]
    sample_rewards: torch.Tensor
    num_tokens: int
    position: ShardPosition

    _TENSORS = ("input_ids", "position_ids", "loss_mask", "behaviour_logprobs", "has_behaviour_logprobs",
                "advantages", "policy_versions", "segment_ids", "sample_rewards")

    def to(self, device: torch.device | str) -> PackedBatch:
        """A copy with every tensor on ``device``."""
        moved = {k: getattr(self, k).to(device, non_blocking=True) for k in self._TENSORS}
        return PackedBatch(**moved, sample_ids=self.sample_ids, num_tokens=self.num_tokens, position=self.position)

    def pin_memory(self) -> PackedBatch:
        pinned = {k: getattr(self, k).pin_memory() for k in self._TENSORS}
        return PackedBatch(**pinned, sample_ids=self.sample_ids, num_tokens=self.num_tokens, position=self.position)


class _Packer:
    """Greedy packing of segments into ``batch_size`` rows of ``seq_len`` tokens."""

    def __init__(self, batch_size: int, seq_len: int, pad_id: int) -> None:
        self.B, self.L, self.pad_id = batch_size, seq_len, pad_id
        self._reset()

    def _reset(self) -> None:
        B, L = self.B, self.L
        self.input_ids = np.full((B, L), self.pad_id, dtype=np.int64)
        self.position_ids = np.tile(np.arange(L, dtype=np.int64), (B, 1))
        self.loss_mask = np.zeros((B, L), dtype=bool)
        self.blogp = np.zeros((B, L), dtype=np.float32)
        self.has_blogp = np.zeros((B, L), dtype=bool)
        self.adv = np.zeros((B, L), dtype=np.float32)
        self.version = np.full((B, L), -1, dtype=np.int64)
        self.segment = np.full((B, L), -1, dtype=np.int64)
        self.ids: list[str] = []
        self.rewards: list[float] = []
        self.row, self.col, self.tokens = 0, 0, 0

    def empty(self) -> bool:
        return not self.ids

    def fits(self, length: int) -> bool:
        """Whether a segment of ``length`` (<= seq_len) tokens fits in this batch."""
        return self.col + length <= self.L or self.row + 1 < self.B

    def add(self, *, sample_id: str, obs: np.ndarray, act: np.ndarray, blogp: np.ndarray, mask: np.ndarray,
            adv: float, version: int, reward: float) -> None:
        n = len(obs) + len(act)
        if self.col + n > self.L:
            self.row, self.col = self.row + 1, 0
        r, a, b = self.row, self.col, self.col + n
        o = a + len(obs)
        self.input_ids[r, a:o] = obs
        self.input_ids[r, o:b] = act
        # padding after the last segment of a row keeps counting from 0, so it forms its own segment
        self.position_ids[r, a:b] = np.arange(n)
        self.position_ids[r, b:] = np.arange(self.L - b)
        self.loss_mask[r, o:b] = mask
        self.loss_mask[r, a] = False
        if len(blogp) == len(act):
            self.blogp[r, o:b] = blogp
            self.has_blogp[r, o:b] = True
        self.adv[r, a:b] = adv
        self.version[r, a:b] = version
        self.segment[r, a:b] = len(self.ids)
        self.ids.append(sample_id)
        self.rewards.append(reward)
        self.col = b
        self.tokens += n

    def emit(self, position: ShardPosition) -> PackedBatch:
        t = torch.from_numpy
        batch = PackedBatch(
            input_ids=t(self.input_ids), position_ids=t(self.position_ids), loss_mask=t(self.loss_mask),
            behaviour_logprobs=t(self.blogp), has_behaviour_logprobs=t(self.has_blogp), advantages=t(self.adv),
            policy_versions=t(self.version), segment_ids=t(self.segment), sample_ids=self.ids,
            sample_rewards=torch.tensor(self.rewards, dtype=torch.float32), num_tokens=self.tokens, position=position,
        )
        self._reset()
        return batch


# ----------------------------------------------------------------------------- the stream


@dataclass(frozen=True)
class _Unit:
    file: str
    row_group: int
    commit: int

    def key(self) -> int:
        return zlib.crc32(f"{self.file}:{self.row_group}".encode())


def _rng(*seed: int) -> np.random.Generator:
    return np.random.default_rng([int(s) & 0xFFFFFFFF for s in seed])


def _domain_of(rel: str) -> str:
    for part in Path(rel).parts:
        if part.startswith("domain="):
            return part[len("domain="):]
    return ""


@dataclass
class _Columns:
    """One unit's rows as flat numpy buffers (list columns as values + offsets)."""

    n: int
    event_id: list[str]
    policy_version: np.ndarray
    reward: np.ndarray
    advantage: np.ndarray
    obs: tuple[np.ndarray, np.ndarray]
    act: tuple[np.ndarray, np.ndarray]
    blogp: tuple[np.ndarray, np.ndarray]
    mask: tuple[np.ndarray, np.ndarray]


def _list_column(col: pa.ChunkedArray, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    values = arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return values, arr.offsets.to_numpy()


class TrajectoryStream(IterableDataset):
    """Packed training batches from committed ``steps/`` files, sharded, seeded and resumable.

    Args:
        data_dir: dataset root (holds ``_manifests/`` and ``steps/``).
        seq_len: tokens per packed sequence.
        batch_size: packed sequences per batch.
        recipe: dataset version to read; default: the only one present.
        filters: which steps to keep.
        advantage_field: StepRow column used as the advantage
            (``normalized_advantage``, ``group_advantage`` or ``advantage``).
        mode: ``offline`` (epochs over a frozen snapshot) or ``tail`` (follow new commits).
        seed: seed of every shuffle.
        shuffle: shuffle unit order and rows inside units.
        max_epochs: offline: stop after this many epochs (None: repeat forever).
        poll_interval_s: tail: seconds between manifest scans when out of data.
        idle_timeout_s: tail: stop after this long without a new commit (None: never).
        num_workers: DataLoader workers that will iterate this dataset (0 = main process).
        rank: this process's rank; default ``torch.distributed`` rank (0 if not initialized).
        world_size: number of ranks; default ``torch.distributed`` world size.
        pad_id: token id used for padding.
        drop_last: drop the final partial batch when a finite stream ends.

    Raises:
        ValueError: an argument is out of range.
    """

    def __init__(
        self,
        data_dir: str | Path,
        *,
        seq_len: int,
        batch_size: int,
        recipe: str | None = None,
        filters: StepFilter | None = None,
        advantage_field: str = "normalized_advantage",
        mode: Literal["offline", "tail"] = "offline",
        seed: int = 0,
        shuffle: bool = True,
        max_epochs: int | None = 1,
        poll_interval_s: float = 1.0,
        idle_timeout_s: float | None = None,
        num_workers: int = 0,
        rank: int | None = None,
        world_size: int | None = None,
        pad_id: int = 0,
        drop_last: bool = False,
    ) -> None:
        super().__init__()
        if seq_len < 2:
            raise ValueError(f"`seq_len` must be >= 2, got {seq_len}")
        if batch_size < 1:
            raise ValueError(f"`batch_size` must be >= 1, got {batch_size}")
        if mode not in ("offline", "tail"):
            raise ValueError(f"`mode` must be 'offline' or 'tail', got {mode!r}")
        if advantage_field not in _ADVANTAGE_FIELDS:
            raise ValueError(f"`advantage_field` must be one of {_ADVANTAGE_FIELDS}, got {advantage_field!r}")
        if max_epochs is not None and max_epochs < 1:
            raise ValueError(f"`max_epochs` must be >= 1 or None, got {max_epochs}")
        if rank is None or world_size is None:
            dist_on = torch.distributed.is_available() and torch.distributed.is_initialized()
            rank = torch.distributed.get_rank() if dist_on and rank is None else (rank or 0)
            world_size = torch.distributed.get_world_size() if dist_on and world_size is None else (world_size or 1)
        if not 0 <= rank < world_size:
            raise ValueError(f"`rank` {rank} must be in [0, world_size={world_size})")
        self.data_dir = Path(data_dir)
        self.seq_len, self.batch_size = seq_len, batch_size
        self.filters = filters or StepFilter()
        self.advantage_field = advantage_field
        self.mode, self.seed, self.shuffle = mode, seed, shuffle
        self.max_epochs = max_epochs if mode == "offline" else None
        self.poll_interval_s, self.idle_timeout_s = poll_interval_s, idle_timeout_s
        self.num_workers, self.rank, self.world_size = num_workers, rank, world_size
        self.pad_id, self.drop_last = pad_id, drop_last
        self.recipe = recipe
        self.snapshot_commit: int | None = None
        self._positions: dict[int, ShardPosition] = {}
        self._next_worker = 0
        self._unit_cache: dict[int, list[_Unit]] = {}  # commit -> its units (per process)

    # -- sharding ------------------------------------------------------------

    @property
    def workers(self) -> int:
        return max(self.num_workers, 1)

    @property
    def num_shards(self) -> int:
        return self.world_size * self.workers

    def _shard_of_logical(self, logical: int) -> int:
        return self.rank * self.workers + logical

    # -- state ---------------------------------------------------------------

    def _resolve_recipe(self) -> str:
        if self.recipe is None:
            recipes = list_recipes(self.data_dir)
            if len(recipes) != 1:
                raise DataError(
                    f"{self.data_dir} holds {len(recipes)} dataset versions {recipes}; pick one with `recipe`"
                    if recipes else f"{self.data_dir} has no committed dataset yet (no {MANIFEST_DIR}/<recipe>/)"
                )
            self.recipe = recipes[0]
        return self.recipe

    def _freeze_snapshot(self) -> None:
        """Offline mode reads the commits visible when training starts, and keeps to them on resume."""
        if self.mode == "offline" and self.snapshot_commit is None:
            commits = scan_commits(self.data_dir, recipe=self._resolve_recipe())
            if not commits:
                raise DataError(f"{self.data_dir}: dataset {self.recipe} has no complete commit to train on")
            self.snapshot_commit = commits[-1].commit

    def state_dict(self) -> dict[str, Any]:
        """This rank's position: JSON-serialisable, goes into the trainer checkpoint."""
        self._freeze_snapshot()
        return {
            "format": STATE_FORMAT,
            "recipe": self._resolve_recipe(),
            "mode": self.mode,
            "seed": self.seed,
            "filters": self.filters.fingerprint(),
            "advantage_field": self.advantage_field,
            "seq_len": self.seq_len,
            "batch_size": self.batch_size,
            "rank": self.rank,
            "num_shards": self.num_shards,
            "snapshot_commit": self.snapshot_commit,
            "next_worker": self._next_worker,
            "shards": {str(k): msgspec.to_builtins(v) for k, v in sorted(self._positions.items())},
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`; the stream settings must be the same.

        Raises:
            DataError: the state was written with different data settings
                (which would make "the next sample" mean something else).
        """
        if state.get("format") != STATE_FORMAT:
            raise DataError(f"dataset position format {state.get('format')} is not {STATE_FORMAT}")
        mine = {"mode": self.mode, "seed": self.seed, "filters": self.filters.fingerprint(),
                "advantage_field": self.advantage_field, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "num_shards": self.num_shards, "rank": self.rank}
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if self.recipe is not None and state.get("recipe") != self.recipe:
            diff["recipe"] = (state.get("recipe"), self.recipe)
        if diff:
            raise DataError(
                "cannot resume: the checkpoint's dataset position was written with other data settings "
                + ", ".join(f"{k}: checkpoint {a!r} vs now {b!r}" for k, (a, b) in diff.items())
                + "; resume with the same data settings and number of ranks/workers"
            )
        self.recipe = state["recipe"]
        self.snapshot_commit = state["snapshot_commit"]
        self._next_worker = int(state["next_worker"])
        self._positions = {int(k): msgspec.convert(v, ShardPosition) for k, v in state["shards"].items()}

    def record(self, batch: PackedBatch) -> None:
        """Note that ``batch`` was consumed (called by :class:`TrajectoryLoader` as it hands batches out)."""
        self._positions[batch.position.shard] = batch.position
        logical = batch.position.shard - self.rank * self.workers
        self._next_worker = (logical + 1) % self.workers

    # -- units ---------------------------------------------------------------

    def _units_of(self, commit: DatasetCommit) -> list[_Unit]:
        if commit.commit in self._unit_cache:
            return self._unit_cache[commit.commit]
        expr = self.filters.expression()
        units = []
        for rel in commit.files:
            if not self.filters.accepts_domain(_domain_of(rel)):
                continue
            frag = _FORMAT.make_fragment(str(self.data_dir / rel), filesystem=_LOCAL_FS)
            for piece in frag.split_by_row_group(filter=expr, schema=step_file_schema()):
                units.append(_Unit(file=rel, row_group=piece.row_groups[0].id, commit=commit.commit))
        if self.shuffle and self.mode == "tail":
            order = _rng(self.seed, commit.commit).permutation(len(units))
            units = [units[i] for i in order]
        self._unit_cache[commit.commit] = units
        return units

    def _epoch_units(self, epoch: int, shard: int) -> list[_Unit]:
        """Offline: this shard's units of one epoch."""
        commits = scan_commits(self.data_dir, recipe=self._resolve_recipe(), upto=self.snapshot_commit)
        if not commits or commits[-1].commit != self.snapshot_commit:
            raise DataError(f"{self.data_dir}: commits up to {self.snapshot_commit} of {self.recipe} are gone")
        units = [u for c in commits for u in self._units_of(c)]
        if self.shuffle:
            order = _rng(self.seed, epoch).permutation(len(units))
            units = [units[i] for i in order]
        return units[shard::self.num_shards]

    def _tail_units(self, shard: int, known: list[_Unit], seen_commit: int) -> tuple[list[_Unit], int]:
        """Tail: extend this shard's unit list with newly complete commits."""
        new = scan_commits(self.data_dir, recipe=self._resolve_recipe(), after=seen_commit)
        if not new:
            return known, seen_commit
        total = self._tail_total
        for c in new:
            for u in self._units_of(c):
                if total % self.num_shards == shard:
                    known.append(u)
                total += 1
        self._tail_total = total
        return known, new[-1].commit

    def _read_unit(self, unit: _Unit, epoch: int) -> _Columns:
        frag = _FORMAT.make_fragment(str(self.data_dir / unit.file), filesystem=_LOCAL_FS, row_groups=[unit.row_group])
        table = frag.to_table(schema=step_file_schema(), columns=_COLUMNS, filter=self.filters.expression())
        n = table.num_rows
        if self.shuffle and n > 1:
            table = table.take(_rng(self.seed, epoch, unit.key()).permutation(n))
        return _Columns(
            n=n,
            event_id=table.column("event_id").to_pylist(),
            policy_version=table.column("policy_version").to_numpy(),
            reward=table.column("reward").to_numpy(),
            advantage=table.column(self.advantage_field).to_numpy(),
            obs=_list_column(table.column("observation_token_ids"), np.int64),
            act=_list_column(table.column("action_token_ids"), np.int64),
            blogp=_list_column(table.column("behaviour_logprobs"), np.float32),
            mask=_list_column(table.column("loss_mask"), bool),
        )

    # -- iteration -----------------------------------------------------------

    def __iter__(self) -> Iterator[PackedBatch]:
        info = get_worker_info()
        physical, n_workers = (info.id, info.num_workers) if info is not None else (0, 0)
        if n_workers != self.num_workers:
            raise ValueError(
                f"TrajectoryStream was built with `num_workers`={self.num_workers} but runs in a DataLoader "
                f"with {n_workers} workers; pass the DataLoader's num_workers to the stream"
            )
        self._resolve_recipe()
        self._freeze_snapshot()
        logical = (physical + self._next_worker) % self.workers
        shard = self._shard_of_logical(logical)
        start = self._positions.get(shard, ShardPosition(shard=shard))
        if self.mode == "offline":
            yield from self._iter_offline(shard, start)
        else:
            yield from self._iter_tail(shard, start)

    def _segments(self, cols: _Columns, row: int):
        (ov, oo), (av, ao), (bv, bo), (mv, mo) = cols.obs, cols.act, cols.blogp, cols.mask
        obs, act = ov[oo[row]:oo[row + 1]], av[ao[row]:ao[row + 1]]
        blogp, mask = bv[bo[row]:bo[row + 1]], mv[mo[row]:mo[row + 1]]
        if len(mask) != len(act):
            mask = np.ones(len(act), dtype=bool)
        L = self.seq_len
        if len(obs) + len(act) > L:
            # keep the action (what is trained on); cut the oldest context first, then the action's tail
            keep_obs = max(L - len(act), min(len(obs), 1))
            obs = obs[len(obs) - keep_obs:]
            keep_act = L - len(obs)
            act, mask = act[:keep_act], mask[:keep_act]
            blogp = blogp[:keep_act] if len(blogp) else blogp
        return dict(sample_id=cols.event_id[row], obs=obs, act=act, blogp=blogp, mask=mask,
                    adv=float(cols.advantage[row]), version=int(cols.policy_version[row]),
                    reward=float(cols.reward[row]))

    def _pack_units(self, shard: int, epoch: int, units: list[_Unit], start_unit: int, start_row: int,
                    packer: _Packer, count: list[int]) -> Iterator[PackedBatch]:
        for ui in range(start_unit, len(units)):
            cols = self._read_unit(units[ui], epoch)
            for ri in range(start_row if ui == start_unit else 0, cols.n):
                seg = self._segments(cols, ri)
                n = len(seg["obs"]) + len(seg["act"])
                if not packer.fits(n):
                    count[0] += 1
                    yield packer.emit(ShardPosition(shard=shard, epoch=epoch, unit=ui, row=ri, batches=count[0]))
                packer.add(**seg)

    def _iter_offline(self, shard: int, start: ShardPosition) -> Iterator[PackedBatch]:
        packer = _Packer(self.batch_size, self.seq_len, self.pad_id)
        count = [start.batches]
        epoch, unit, row = start.epoch, start.unit, start.row
        while self.max_epochs is None or epoch < self.max_epochs:
            units = self._epoch_units(epoch, shard)
            yield from self._pack_units(shard, epoch, units, unit, row, packer, count)
            epoch, unit, row = epoch + 1, 0, 0
        if not packer.empty() and not self.drop_last:
            count[0] += 1
            yield packer.emit(ShardPosition(shard=shard, epoch=epoch, unit=0, row=0, batches=count[0]))

    def _iter_tail(self, shard: int, start: ShardPosition) -> Iterator[PackedBatch]:
        packer = _Packer(self.batch_size, self.seq_len, self.pad_id)
        count = [start.batches]
        self._tail_total = 0
        units: list[_Unit] = []
        units, seen = self._tail_units(shard, units, 0)
        unit, row = start.unit, start.row
        idle_since = time.monotonic()
        while True:
            if unit < len(units):
                end = len(units)
                yield from self._pack_units(shard, 0, units, unit, row, packer, count)
                unit, row = end, 0
                idle_since = time.monotonic()
                continue
            units, new_seen = self._tail_units(shard, units, seen)
            if new_seen != seen:
                seen = new_seen
                if unit < len(units):
                    continue
                idle_since = time.monotonic()  # a commit landed, just none of it for this shard
            if self.idle_timeout_s is not None and time.monotonic() - idle_since >= self.idle_timeout_s:
                break
            time.sleep(self.poll_interval_s)
        if not packer.empty() and not self.drop_last:
            count[0] += 1
            yield packer.emit(ShardPosition(shard=shard, epoch=0, unit=unit, row=0, batches=count[0]))


class TrajectoryLoader:
    """A DataLoader over a :class:`TrajectoryStream` that remembers what it handed out.

    Every batch it yields is recorded as consumed (the trainer checkpoints only
    between optimizer steps, when every handed-out batch has been trained on),
    so :meth:`state_dict` is the exact position to resume from.

    Args:
        stream: the dataset (its ``num_workers`` is the DataLoader's).
        pin_memory: pin batches (GPU training).
        prefetch_factor: batches each worker prepares ahead.
    """

    def __init__(self, stream: TrajectoryStream, *, pin_memory: bool = False, prefetch_factor: int = 4) -> None:
        self.stream = stream
        self._loader = DataLoader(
            stream, batch_size=None, num_workers=stream.num_workers, pin_memory=pin_memory,
            prefetch_factor=prefetch_factor if stream.num_workers else None,
            persistent_workers=False, multiprocessing_context="fork" if stream.num_workers and os.name == "posix" else None,
        )

    def __iter__(self) -> Iterator[PackedBatch]:
        for batch in self._loader:
            self.stream.record(batch)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)
