"""Streaming, packed, resumable reader of the ``steps/`` training datasets: one sample per episode window.

:class:`TrajectoryStream` is a ``torch.utils.data.IterableDataset`` that reads
the Parquet files named by committed dataset manifests (never a ``*.tmp`` file,
never a file no manifest lists) through ``pyarrow.dataset``, one row group at a
time, rebuilds each episode's token stream and packs it into fixed-length
sequences. It yields whole :class:`PackedBatch` objects, so wrap it in a
``DataLoader(batch_size=None)`` (:class:`TrajectoryLoader` does that and keeps
track of what was consumed).

Layout read (schemas/datasets.py, docs/pipelines.md)::

    <data>/_commit_log/<recipe>/                     the version's commit log: commit n's record is its manifest
    <data>/_manifests/<recipe>/<n>.json              (legacy, a dataset not yet moved to the log) commit n
    <data>/steps/recipe=<recipe>/domain=<d>/c<commit>-s<shard>.parquet

``<data>`` is a local directory or ``s3://BUCKET/PREFIX``: manifests and data files are read through
:mod:`schemas.locations` (S3 settings from the AWS environment variables), the same bytes either way,
so an S3 dataset yields the same batches as its local copy.

What a sample is
----------------
A step's ``observation_token_ids`` are the ids appended to the episode's
context since the previous action, so an episode's token *stream* is
``obs_0 act_0 obs_1 act_1 ...`` and the model's input at step ``k`` was the
stream up to ``obs_k``, minus a recorded context cut (``context_cut_start``,
``context_cut_tokens``: the input was ``stream[:start] + stream[start+tokens:]``;
``rollout.context.model_input_of`` is the reference). A sample (one packed
*segment*) is one *window* of an episode (:func:`plan_windows`): a run of
consecutive steps with the same recorded cut, given as the stream with that
cut, so every action is trained on exactly the context the model saw. The
loss covers the action tokens of the window's *trained* steps (their
``loss_mask``), never observations. A run that does not fit ``seq_len`` is
split at step boundaries; its later windows cut more context and are
*inexact* (counted, :class:`DataCounts`). With ``seq_len >=`` the policy's
``max_model_len`` every window is exact.

Which steps are trained: ``trainable`` steps (unless
``StepFilter.include_untrainable``) that pass the :class:`StepFilter`. Filters
never remove rows: an episode's context needs all its steps. Episodes with no
trained step, and episodes whose step 0 has no observation ids (no recorded
context: legacy data, scripted rollouts without a tokenizer), are skipped and
counted.

Work units, sharding and order
------------------------------
A *unit* is one row group of one committed file. The trajectory job writes an
episode's steps into one file sorted by ``(episode_id, step_index)``, in row
groups that never split an episode; the stream checks it (a unit must hold
steps ``0..num_steps-1`` of each of its episodes) and raises :class:`DataError`
naming the file otherwise. Skipping such episodes instead would bias training
towards short episodes (the long ones straddle row groups), so it is an error.
Row groups whose Parquet statistics show that no step in them is trained
(filters, ``trainable``) are pruned: their episodes would all be skipped.
Units are numbered, and unit ``i`` belongs to shard ``i % num_shards`` where
``num_shards = world_size * num_workers`` and the shard of DataLoader worker
``w`` on rank ``r`` is ``r * num_workers + w``: no two workers of any rank read
the same unit.

* ``mode="offline"``: the commits visible at the first iteration are frozen
  (``snapshot_commit``); each epoch ``e`` shuffles the unit list with
  ``rng(seed, e)``.
* ``mode="tail"``: units are numbered in commit order (shuffled inside each
  commit with ``rng(seed, commit)``), so numbers never change as commits land;
  a shard that runs out of units polls the commit log every
  ``poll_interval_s`` and continues when a new commit is complete.

Episodes inside a unit are shuffled with ``rng(seed, epoch, unit)``. An
episode's windows are packed one after another into the same batch unless
they do not fit in an empty one, so a response is split across batches only
when it is larger than a batch.

Position (what goes into the trainer checkpoint)
------------------------------------------------
Each batch carries the :class:`ShardPosition` of the first window *not*
packed into any batch yet: ``(epoch, unit, episode, window)``. A window that
does not fit closes the batch (and so does an episode whose windows do not all
fit), so after a batch the packer is empty and restarting the shard at that
position reproduces the rest of the stream exactly.
:meth:`TrajectoryStream.state_dict` holds one position per shard plus the
DataLoader's round-robin phase (``next_worker``); on resume DataLoader worker
``p`` serves logical worker ``(p + next_worker) % num_workers``, so the
interleaving of workers continues where it stopped too.
"""

from __future__ import annotations

import faulthandler
import hashlib
import logging
import os
import time
import zlib
from collections.abc import Iterator, Sequence
from dataclasses import dataclass, field, fields
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

from schemas import locations as loc
from schemas.datasets import step_file_schema
from schemas.events import PURPOSE_EVAL
from schemas.commit_log import CommitLogError
from schemas.manifests import (
    COMMIT_LOG_DIR,
    MANIFEST_DIR,
    DatasetManifest,
    decode_manifest,
    decode_manifests,
    list_dataset_versions,
    read_dataset_records,
)

__all__ = [
    "MANIFEST_DIR",
    "STATE_FORMAT",
    "DataError",
    "DatasetCommit",
    "StepFilter",
    "ShardPosition",
    "Window",
    "plan_windows",
    "DataCounts",
    "PackedBatch",
    "TrajectoryStream",
    "TrajectoryLoader",
    "read_commit_manifest",
    "scan_commits",
    "list_recipes",
]

log = logging.getLogger(__name__)

#: Version of the :meth:`TrajectoryStream.state_dict` layout (2: positions are (unit, episode, window)).
STATE_FORMAT = 2

#: Columns the packer needs (the rest of StepRow is never read).
_COLUMNS = [
    "episode_id", "step_index", "num_steps", "policy_version", "policy_lineage", "status", "trainable",
    "observation_token_ids", "action_token_ids", "behaviour_logprobs", "loss_mask", "temperature", "top_p",
    "top_k", "context_cut_start", "context_cut_tokens", "return_to_go", "normalized_advantage",
    "group_advantage", "advantage",
]
_FORMAT = ds.ParquetFileFormat()
_LOCAL_FS = pafs.LocalFileSystem()
_ADVANTAGE_FIELDS = ("normalized_advantage", "group_advantage", "advantage")


class DataError(RuntimeError):
    """The datasets directory or a resume state is not what the stream expects."""


# ----------------------------------------------------------------------------- manifests


class DatasetCommit(msgspec.Struct, frozen=True, kw_only=True):
    """One committed dataset commit (commit ``n`` of ``_commit_log/<recipe>/``), as the trainer sees it.

    Attributes:
        commit: commit number (from 1, gap-free per recipe).
        recipe: dataset version ``<recipe name>-<hash8>``.
        files: its ``steps/`` data files, relative to the dataset root.
    """

    commit: int
    recipe: str
    files: tuple[str, ...]


def read_commit_manifest(path: Path | str, *, root: Path | str,
                         tables: Sequence[str] = ("steps",)) -> DatasetCommit:
    """Read one legacy commit manifest file (:class:`schemas.manifests.DatasetManifest`); keep its ``steps/`` files.

    Datasets are read from their commit log (:func:`scan_commits`); this reads a manifest file
    of the layout before it (``_manifests/<recipe>/<n>.json``), named by its path.

    Args:
        path: the manifest's location (a local path or an ``s3://`` URI).
        root: the dataset root it belongs to.
        tables: the step-shaped tables to keep (:func:`scan_commits`).

    Raises:
        DataError: the manifest is unreadable, not JSON, or not a dataset manifest.
    """
    parent = os.fspath(path).rpartition("/")[0]
    try:
        manifest = decode_manifest(loc.read_bytes(path))
    except (OSError, msgspec.DecodeError, msgspec.ValidationError) as err:
        raise DataError(f"commit manifest {path} is unreadable or has no `files` list: {err!r}") from err
    return _commit_of(manifest, recipe=parent.rpartition("/")[2], root=root, tables=tables)


def _commit_of(manifest: DatasetManifest, *, recipe: str, root: Path | str, tables: Sequence[str]) -> DatasetCommit:
    files = []
    for entry in manifest.files:
        rel = Path(entry.path)
        if not loc.is_remote(root) and rel.is_absolute() and rel.is_relative_to(root):
            rel = rel.relative_to(root)
        if rel.parts and rel.parts[0] in tables and rel.suffix == ".parquet":
            files.append(rel.as_posix())
    return DatasetCommit(commit=manifest.commit, recipe=recipe, files=tuple(sorted(set(files))))


def list_recipes(data_dir: Path | str) -> list[str]:
    """Dataset versions (recipes) that have a commit log (or legacy manifests)."""
    return list_dataset_versions(data_dir)


def scan_commits(data_dir: Path | str, *, recipe: str, after: int = 0, upto: int | None = None,
                 tables: Sequence[str] = ("steps",)) -> list[DatasetCommit]:
    """Committed and complete commits of one dataset version, in commit order.

    A commit is visible when the version's commit log has it (the commit point)
    **and** all its files are in place (the writer renames data files into
    place after the commit). Commits become visible strictly in order: scanning
    stops at the first incomplete commit, so a later commit never overtakes an
    earlier one. Tail mode passes ``after`` (the last commit it has seen) and
    reads the records of the new commits only.

    Args:
        data_dir: dataset root: a local directory or ``s3://BUCKET/PREFIX``.
        recipe: dataset version (``_commit_log/<recipe>/``).
        after: skip commits ``<= after``.
        upto: stop after this commit.
        tables: the step-shaped tables whose files to list (``steps``, and ``corrections``: feedback
            corrections as one-step samples, docs/feedback.md).

    Raises:
        DataError: the log is unreadable, or a commit's record is not a dataset manifest.
    """
    root: Path | str = os.fspath(data_dir) if loc.is_remote(data_dir) else Path(data_dir)
    where = f"{recipe} at {root}"
    try:
        records = read_dataset_records(root, recipe, after=after)
        if upto is not None:
            records = records[: max(upto - after, 0)]
        manifests = decode_manifests(records, first=after + 1, where=where)
    except CommitLogError as err:
        raise DataError(str(err)) from err
    if not manifests:
        return []
    if loc.is_remote(root):  # one listing per table, not a request per file
        in_place = {f for t in tables for f in loc.list_files(loc.join(str(root), t), suffix=".parquet")}.__contains__
    else:
        in_place = os.path.isfile
    out: list[DatasetCommit] = []
    for m in manifests:
        c = _commit_of(m, recipe=recipe, root=root, tables=tables)
        if not all(in_place(loc.join(str(root), f)) for f in c.files):
            break
        out.append(c)
    return out


# ----------------------------------------------------------------------------- filters


class StepFilter(msgspec.Struct, frozen=True, kw_only=True):
    """Which steps to train on. ``None`` means no bound.

    A filter chooses the steps whose action tokens enter the loss, never the
    rows read: a step that fails it is still context for the later steps of
    its episode.

    Attributes:
        domains: keep only these domains (partition key; whole files are skipped).
        min_policy_version: train steps acted by policy version >= this.
        max_policy_version: train steps acted by policy version <= this.
        min_advantage: train steps with ``normalized_advantage >= this``.
        max_advantage: train steps with ``normalized_advantage <= this``.
        statuses: train steps of episodes that ended with one of these statuses.
        include_untrainable: also train steps whose row says ``trainable=False``
            (episodes cut off by a timeout, error or shutdown: no verdict).
    """

    domains: tuple[str, ...] | None = None
    min_policy_version: int | None = None
    max_policy_version: int | None = None
    min_advantage: float | None = None
    max_advantage: float | None = None
    statuses: tuple[str, ...] | None = None
    include_untrainable: bool = False

    def expression(self) -> pc.Expression | None:
        """The trained-step condition as a pyarrow expression (row-group pruning by statistics)."""
        terms = []
        if not self.include_untrainable:
            terms.append(pc.field("trainable") == True)  # noqa: E712  (an Arrow expression, not a Python test)
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

    def trained(self, table: pa.Table) -> np.ndarray:
        """Per row of ``table``, whether the step is trained (the same condition as :meth:`expression`)."""
        keep = np.ones(table.num_rows, dtype=bool)
        if not self.include_untrainable:
            keep &= table.column("trainable").to_numpy(zero_copy_only=False).astype(bool)
        if self.min_policy_version is not None or self.max_policy_version is not None:
            v = table.column("policy_version").to_numpy()
            if self.min_policy_version is not None:
                keep &= v >= self.min_policy_version
            if self.max_policy_version is not None:
                keep &= v <= self.max_policy_version
        if self.min_advantage is not None or self.max_advantage is not None:
            a = table.column("normalized_advantage").to_numpy()
            if self.min_advantage is not None:
                keep &= a >= self.min_advantage
            if self.max_advantage is not None:
                keep &= a <= self.max_advantage
        if self.statuses is not None:
            keep &= pc.is_in(table.column("status"), pa.array(list(self.statuses))).to_numpy(zero_copy_only=False)
        return keep

    def accepts_domain(self, domain: str) -> bool:
        return self.domains is None or domain in self.domains

    def fingerprint(self) -> str:
        return hashlib.sha256(msgspec.json.encode(self)).hexdigest()[:16]


# ----------------------------------------------------------------------------- windows


class Window(msgspec.Struct, frozen=True):
    """One sample of an episode: ``stream[:head] + stream[start:end]``, trained on steps ``first..last``.

    Attributes:
        first_step: first step whose action is trained in this window.
        last_step: last such step (the steps between are trained too, or
            context when they are not trained steps).
        head: tokens kept from the start of the stream.
        start: where the rest of the window starts in the stream (``>= head``).
        end: where it ends (the end of ``last_step``'s action, or earlier
            when that action alone is longer than the window: its tail is cut).
        exact: the window gives every trained action exactly the input the
            model saw (the recorded cut); False when it cuts more context.
    """

    first_step: int
    last_step: int
    head: int
    start: int
    end: int
    exact: bool

    @property
    def tokens(self) -> int:
        return self.head + self.end - self.start


def plan_windows(
    obs_tokens: Sequence[int],
    action_tokens: Sequence[int],
    *,
    cut_start: Sequence[int],
    cut_tokens: Sequence[int],
    trained: Sequence[bool],
    seq_len: int,
) -> list[Window]:
    """Split an episode into windows of at most ``seq_len`` tokens, exact whenever possible.

    With ``s_k``/``a_k``/``e_k`` the stream positions where step ``k``'s
    observation, action and the step end, the model's input at step ``k`` was
    ``stream[:c] + stream[c+n : a_k]`` for the step's recorded cut ``(c, n)``
    (``n = 0``: no cut). Consecutive steps with the same cut form a *run*;
    for a run, the sequence ``stream[:c] + stream[c+n : e_q]`` holds every
    action ``j..q`` of the run after exactly the input it was generated from.
    Windows cover the trained steps of each run in order:

    * **exact**: from a trained step ``p``, up to the last trained step ``q``
      of the run with ``e_q - n <= seq_len``: ``head = c`` (1 when uncut:
      ``stream[:1] + stream[1:e_q]`` is the uncut stream), ``start = c + n``,
      ``end = e_q``;
    * **inexact**, once ``e_p - n > seq_len`` (then every later step of the run
      is too long as well, since ``e`` grows): keep the head, drop the oldest
      tokens after it, ``start = max(c + n, e_q - (seq_len - head))``, and extend
      ``q`` only while step ``p`` keeps its whole observation
      (``head + e_q - s_p <= seq_len``). If step ``p``'s action alone does not
      fit after the head, ``start = a_p`` and ``end = start + seq_len - head``:
      the action's tail is cut off (and not trained).

    **Every window is exact when** ``seq_len >= max_model_len`` **of the
    policy that acted.** Proof: a rollout's input at step ``k`` has
    ``a_k - n_k`` tokens and its action at most ``max_model_len`` minus that
    (the engine generates into the same context: ``HFPolicy`` cuts inputs to
    ``max_model_len - max_tokens``, vLLM rejects longer requests), so
    ``e_k - n_k = (a_k - n_k) + |act_k| <= max_model_len <= seq_len`` for
    every step ``k``. A window is inexact only if its first step ``p`` has
    ``e_p - n_p > seq_len``, which never holds. (Tested in
    ``tests/trainer/test_data.py``.)

    Args:
        obs_tokens: ``|obs_k|`` per step (``obs_tokens[0] >= 1``: the prompt).
        action_tokens: ``|act_k|`` per step.
        cut_start: ``context_cut_start`` per step.
        cut_tokens: ``context_cut_tokens`` per step.
        trained: per step, whether its action is trained.
        seq_len: tokens per window, >= 2.

    Returns:
        The windows, in step order; none for a run without trained steps.

    Raises:
        ValueError: lengths differ, step 0 has no observation tokens, or a
            recorded cut does not lie inside its step's input.

    Examples:
        >>> # steps (obs, act): (3, 2), (2, 2), (1, 2); stream = 12 tokens; no cut
        >>> [(w.first_step, w.last_step, w.head, w.start, w.end, w.exact) for w in plan_windows(
        ...     [3, 2, 1], [2, 2, 2], cut_start=[0, 0, 0], cut_tokens=[0, 0, 0], trained=[True] * 3, seq_len=9)]
        [(0, 1, 1, 1, 9, True), (2, 2, 1, 4, 12, False)]
    """
    n_steps = len(obs_tokens)
    if not (len(action_tokens) == len(cut_start) == len(cut_tokens) == len(trained) == n_steps):
        raise ValueError("`obs_tokens`, `action_tokens`, `cut_start`, `cut_tokens` and `trained` must have one "
                         "entry per step")
    if n_steps == 0:
        return []
    if obs_tokens[0] < 1:
        raise ValueError("step 0 has no observation tokens: the episode has no recorded context")
    if seq_len < 2:
        raise ValueError(f"`seq_len` must be >= 2, got {seq_len}")
    L = int(seq_len)
    o = np.asarray(obs_tokens, dtype=np.int64)
    a_len = np.asarray(action_tokens, dtype=np.int64)
    e = np.cumsum(o + a_len)  # e_k: end of step k
    s = e - o - a_len  # s_k: start of obs_k
    a = s + o  # a_k: start of act_k
    cuts = [(int(c), int(n)) if n > 0 else (0, 0) for c, n in zip(cut_start, cut_tokens)]
    for k, (c, n) in enumerate(cuts):
        if n and (c < 0 or c + n > a[k]):
            raise ValueError(f"step {k}: context cut [{c}, {c + n}) is not inside its input of {a[k]} stream tokens")
    windows: list[Window] = []
    k = 0
    while k < n_steps:
        j = k
        while k + 1 < n_steps and cuts[k + 1] == cuts[j]:
            k += 1
        c, n = cuts[j]
        head = c if n else 1
        run = [i for i in range(j, k + 1) if trained[i]]
        i = 0
        while i < len(run):
            p = run[i]
            if e[p] - n <= L:
                while i + 1 < len(run) and e[run[i + 1]] - n <= L:
                    i += 1
                q = run[i]
                windows.append(Window(p, q, head, head + n, int(e[q]), True))
            else:
                while i + 1 < len(run) and head + e[run[i + 1]] - s[p] <= L:
                    i += 1
                q = run[i]
                start, end = max(head + n, int(e[q]) - (L - head)), int(e[q])
                lowest = int(a[p]) - (0 if head else 1)  # at least one token before the first action token
                if start > lowest:
                    start, end = lowest, lowest + L - head
                windows.append(Window(p, q, head, start, end, False))
            i += 1
        k += 1
    return windows


# ----------------------------------------------------------------------------- batches


class ShardPosition(msgspec.Struct, frozen=True, kw_only=True):
    """Where a shard's stream stands: the first window not yet packed into a batch.

    Attributes:
        shard: global shard id ``rank * num_workers + logical_worker``.
        epoch: epoch (always 0 in tail mode).
        unit: index into the shard's unit list of that epoch.
        episode: episode inside that unit (in its shuffled order, skipped episodes included).
        window: window of that episode (index into :func:`plan_windows`' list).
        batches: batches this shard has emitted so far.
    """

    shard: int
    epoch: int = 0
    unit: int = 0
    episode: int = 0
    window: int = 0
    batches: int = 0


@dataclass
class DataCounts:
    """What the stream did since the previous batch (summed into ``data/…`` metrics by the recipe).

    Attributes:
        episodes: episodes with a window in this batch.
        windows: windows (segments) in this batch.
        inexact_windows: windows that give their actions less context than the model saw.
        inexact_tokens: loss tokens in those windows.
        truncated_tokens: action tokens cut off (not trained) because the action
            alone is longer than ``seq_len``.
        episodes_without_context: episodes skipped: step 0 has no observation ids.
        episodes_untrained: episodes skipped: no trained step (filters, ``trainable``).
    """

    episodes: int = 0
    windows: int = 0
    inexact_windows: int = 0
    inexact_tokens: int = 0
    truncated_tokens: int = 0
    episodes_without_context: int = 0
    episodes_untrained: int = 0

    def as_dict(self) -> dict[str, int]:
        return {f.name: getattr(self, f.name) for f in fields(self)}


@dataclass
class PackedBatch:
    """``batch_size`` packed sequences of ``seq_len`` tokens; every tensor is ``[B, L]`` unless noted.

    Each episode window (:class:`Window`) is one *segment*: the episode's
    token stream with the window's cut. Segments never attend to each other:
    ``position_ids`` restart at 0 in every segment (transformers builds the
    block-causal mask from them). Per-token fields are aligned with
    ``input_ids``: entry ``[b, t]`` is about token ``t`` (predicted from the
    tokens before it in its segment). A token *belongs* to step ``k`` when it
    is in ``obs_k`` or ``act_k``.

    Attributes:
        input_ids: token ids (int64); padding uses ``pad_id``.
        position_ids: position inside the segment (int64).
        loss_mask: action tokens of the window's trained steps that their
            step's ``loss_mask`` keeps (bool); never observations, never the
            first token of a segment, never padding.
        behaviour_logprobs: behaviour-policy log-prob of each action token on
            its sampling distribution (float32; 0 elsewhere and where unrecorded).
        has_behaviour_logprobs: the token is an action token whose step
            recorded behaviour log-probs (bool).
        advantages: the step's advantage on its action tokens, 0 elsewhere (float32).
        policy_versions: behaviour policy version of the step the token belongs to (int64; -1 on padding).
        lineage_ids: index into ``lineages`` of that step's policy lineage (int64; -1 on padding).
        temperature: sampling temperature of the step the token belongs to
            (float32; 0 = greedy; 1 on padding).
        top_p: its top-p (float64, so ``1 - top_p`` rounds as the samplers
            round it; 1 on padding).
        top_k: its top-k (int64; -1 or 0: off; 0 on padding).
        segment_ids: index into ``sample_ids`` (int64; -1 on padding).
        episode_index: index into ``episode_ids`` (int64; -1 on padding); the
            windows of one episode share it: the response of per-response aggregation.
        sample_ids: one id per segment, ``<episode_id>#w<window>``, in packing order (length S).
        sample_exact: per segment, whether it gives every action the whole context
            the model saw (False: an inexact window, see :func:`plan_windows`).
        episode_ids: the batch's episodes, in packing order (length E).
        episode_returns: ``return_to_go`` of each episode's step 0 (its return ``G_0``), ``[E]`` float32.
        lineages: the distinct policy lineages of the batch ("" = base/unknown).
        num_tokens: non-padding tokens.
        counts: what the stream did since the previous batch (:class:`DataCounts`).
        position: stream position after this batch (see module docstring).
    """

    input_ids: torch.Tensor
    position_ids: torch.Tensor
    loss_mask: torch.Tensor
    behaviour_logprobs: torch.Tensor
    has_behaviour_logprobs: torch.Tensor
    advantages: torch.Tensor
    policy_versions: torch.Tensor
    lineage_ids: torch.Tensor
    temperature: torch.Tensor
    top_p: torch.Tensor
    top_k: torch.Tensor
    segment_ids: torch.Tensor
    episode_index: torch.Tensor
    sample_ids: list[str]
    sample_exact: list[bool]
    episode_ids: list[str]
    episode_returns: torch.Tensor
    lineages: list[str]
    num_tokens: int
    counts: DataCounts
    position: ShardPosition

    def _map(self, fn) -> PackedBatch:
        return PackedBatch(**{f.name: fn(v) if isinstance(v := getattr(self, f.name), torch.Tensor) else v
                              for f in fields(self)})

    def to(self, device: torch.device | str) -> PackedBatch:
        """A copy with every tensor on ``device``."""
        return self._map(lambda t: t.to(device, non_blocking=True))

    def pin_memory(self) -> PackedBatch:
        return self._map(lambda t: t.pin_memory())


@dataclass
class _Segment:
    """One window's tokens and per-token fields, ready to pack."""

    window: int
    ids: np.ndarray
    steps: np.ndarray  # step each token belongs to
    loss: np.ndarray
    blogp: np.ndarray
    has_blogp: np.ndarray
    adv: np.ndarray
    exact: bool
    truncated: int


@dataclass
class _EpisodeSteps:
    """Per-step values of one episode the packer spreads over tokens."""

    episode_id: str
    episode_return: float
    version: np.ndarray
    lineage: list[str]
    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray


class _Packer:
    """Next-fit packing of segments into ``batch_size`` rows of ``seq_len`` tokens."""

    def __init__(self, batch_size: int, seq_len: int, pad_id: int) -> None:
        self.B, self.L, self.pad_id = batch_size, seq_len, pad_id
        self.counts = DataCounts()
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
        self.lineage = np.full((B, L), -1, dtype=np.int64)
        self.temperature = np.ones((B, L), dtype=np.float32)
        self.top_p = np.ones((B, L), dtype=np.float64)
        self.top_k = np.zeros((B, L), dtype=np.int64)
        self.segment = np.full((B, L), -1, dtype=np.int64)
        self.episode = np.full((B, L), -1, dtype=np.int64)
        self.sample_ids: list[str] = []
        self.sample_exact: list[bool] = []
        self.episode_ids: list[str] = []
        self.episode_returns: list[float] = []
        self.lineages: dict[str, int] = {}
        self.row, self.col, self.tokens = 0, 0, 0

    def empty(self) -> bool:
        return not self.sample_ids

    def fits(self, length: int) -> bool:
        """Whether a segment of ``length`` (<= seq_len) tokens fits in this batch."""
        return self.col + length <= self.L or self.row + 1 < self.B

    def fits_all(self, lengths: Sequence[int]) -> bool:
        """Whether segments of these lengths all fit, packed one after another."""
        row, col = self.row, self.col
        for n in lengths:
            if col + n > self.L:
                row, col = row + 1, 0
                if row >= self.B:
                    return False
            col += n
        return True

    def add(self, seg: _Segment, ep: _EpisodeSteps) -> None:
        n = len(seg.ids)
        if self.col + n > self.L:
            self.row, self.col = self.row + 1, 0
        r, a, b = self.row, self.col, self.col + n
        self.input_ids[r, a:b] = seg.ids
        # padding after the last segment of a row keeps counting from 0, so it forms its own segment
        self.position_ids[r, a:b] = np.arange(n)
        self.position_ids[r, b:] = np.arange(self.L - b)
        self.loss_mask[r, a:b] = seg.loss
        self.loss_mask[r, a] = False
        self.blogp[r, a:b] = seg.blogp
        self.has_blogp[r, a:b] = seg.has_blogp
        self.adv[r, a:b] = seg.adv
        st = seg.steps
        self.version[r, a:b] = ep.version[st]
        lineage_of_step = np.array([self.lineages.setdefault(x, len(self.lineages)) for x in ep.lineage], np.int64)
        self.lineage[r, a:b] = lineage_of_step[st]
        self.temperature[r, a:b] = ep.temperature[st]
        self.top_p[r, a:b] = ep.top_p[st]
        self.top_k[r, a:b] = ep.top_k[st]
        self.segment[r, a:b] = len(self.sample_ids)
        if not self.episode_ids or self.episode_ids[-1] != ep.episode_id:
            self.episode_ids.append(ep.episode_id)
            self.episode_returns.append(ep.episode_return)
            self.counts.episodes += 1
        self.episode[r, a:b] = len(self.episode_ids) - 1
        self.sample_ids.append(f"{ep.episode_id}#w{seg.window}")
        self.sample_exact.append(bool(seg.exact))
        self.counts.windows += 1
        loss_tokens = int(self.loss_mask[r, a:b].sum())
        if not seg.exact:
            self.counts.inexact_windows += 1
            self.counts.inexact_tokens += loss_tokens
        self.counts.truncated_tokens += seg.truncated
        self.col = b
        self.tokens += n

    def emit(self, position: ShardPosition) -> PackedBatch:
        t = torch.from_numpy
        batch = PackedBatch(
            input_ids=t(self.input_ids), position_ids=t(self.position_ids), loss_mask=t(self.loss_mask),
            behaviour_logprobs=t(self.blogp), has_behaviour_logprobs=t(self.has_blogp), advantages=t(self.adv),
            policy_versions=t(self.version), lineage_ids=t(self.lineage), temperature=t(self.temperature),
            top_p=t(self.top_p), top_k=t(self.top_k), segment_ids=t(self.segment), episode_index=t(self.episode),
            sample_ids=self.sample_ids, sample_exact=self.sample_exact, episode_ids=self.episode_ids,
            episode_returns=torch.tensor(self.episode_returns, dtype=torch.float32),
            lineages=list(self.lineages), num_tokens=self.tokens, counts=self.counts, position=position,
        )
        self.counts = DataCounts()
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


def _list_column(col: pa.ChunkedArray, dtype: Any) -> tuple[np.ndarray, np.ndarray]:
    arr = col.combine_chunks() if col.num_chunks != 1 else col.chunk(0)
    values = arr.values.to_numpy(zero_copy_only=False).astype(dtype, copy=False)
    return values, arr.offsets.to_numpy()


@dataclass
class _UnitRows:
    """One unit's rows as flat numpy buffers (list columns as values + offsets), episodes found."""

    where: str
    episode_id: list[str]
    trained: np.ndarray
    policy_version: np.ndarray
    lineage: list[str]
    temperature: np.ndarray
    top_p: np.ndarray
    top_k: np.ndarray
    cut_start: np.ndarray
    cut_tokens: np.ndarray
    return_to_go: np.ndarray
    advantage: np.ndarray
    obs: tuple[np.ndarray, np.ndarray]
    act: tuple[np.ndarray, np.ndarray]
    blogp: tuple[np.ndarray, np.ndarray]
    mask: tuple[np.ndarray, np.ndarray]
    episodes: list[tuple[int, int]] = field(default_factory=list)  # row ranges, in packing (shuffled) order


def _drop_eval_rows(frag: ds.Fragment, table: pa.Table, where: str) -> pa.Table:
    """``table`` without rows whose ``purpose`` is ``eval``, when the file has such a column.

    The trajectory job never writes evaluation episodes to ``steps/`` (they go to
    ``evaluations/``, pipelines/evaluations.py); this guards against a file that
    does anyway (another writer, a hand-made dataset): held-out tasks are never trained on.
    """
    if "purpose" not in frag.physical_schema.names:
        return table
    keep = pc.fill_null(pc.not_equal(frag.to_table(columns=["purpose"]).column(0), PURPOSE_EVAL), True)
    dropped = table.num_rows - pc.sum(keep.cast(pa.int64())).as_py()
    if dropped:
        log.warning("%s: dropped %d rows of evaluation episodes (purpose=eval); they are never trained on",
                    where, dropped)
        table = table.filter(keep)
    return table


def _episode_blocks(table: pa.Table, where: str) -> list[tuple[int, int]]:
    """Row ranges of the unit's episodes, checked to hold steps ``0..num_steps-1`` in order.

    Raises:
        DataError: an episode is split, unsorted or incomplete in this unit.
    """
    n = table.num_rows
    if n == 0:
        return []
    eid = table.column("episode_id").combine_chunks()
    change = pc.not_equal(eid.slice(1), eid.slice(0, n - 1)).to_numpy(zero_copy_only=False) if n > 1 else np.zeros(0, bool)
    starts = np.concatenate([[0], np.flatnonzero(change) + 1])
    stops = np.concatenate([starts[1:], [n]])
    step = table.column("step_index").to_numpy()
    num_steps = table.column("num_steps").to_numpy()
    block_start = np.repeat(starts, stops - starts)
    block_len = np.repeat(stops - starts, stops - starts)
    bad = (step != np.arange(n) - block_start) | (num_steps != block_len)
    if bad.any():
        row = int(np.flatnonzero(bad)[0])
        b = int(np.searchsorted(starts, row, side="right") - 1)
        a, z = int(starts[b]), int(stops[b])
        raise DataError(
            f"{where}: episode {eid[a].as_py()} has steps {step[a:z].tolist()} (num_steps={int(num_steps[a])}) "
            "in this row group; the trainer needs every episode whole inside one row group, its steps "
            "0..num_steps-1 sorted by (episode_id, step_index): rewrite the dataset with the current trajectory job "
            "(row groups aligned to episodes), or `trainer.synthetic.write_steps_commit` for synthetic data"
        )
    if len(starts) > 1 and pc.count_distinct(eid).as_py() != len(starts):
        raise DataError(f"{where}: an episode appears in two separate runs of rows; rows must be sorted by "
                        "(episode_id, step_index): rewrite the dataset with the current trajectory job")
    return list(zip(starts.tolist(), stops.tolist()))


class TrajectoryStream(IterableDataset):
    """Packed training batches of episode windows from committed ``steps/`` files, sharded, seeded, resumable.

    Args:
        data_dir: dataset root (holds ``_commit_log/`` and ``steps/``): a local directory or ``s3://BUCKET/PREFIX``.
        seq_len: tokens per packed sequence (and the longest window).
        batch_size: packed sequences per batch.
        recipe: dataset version to read; default: the only one present.
        filters: which steps to train (default: every ``trainable`` step).
        advantage_field: StepRow column used as the advantage
            (``normalized_advantage``, ``group_advantage`` or ``advantage``).
        mode: ``offline`` (epochs over a frozen snapshot) or ``tail`` (follow new commits).
        seed: seed of every shuffle.
        shuffle: shuffle unit order and episodes inside units.
        max_epochs: offline: stop after this many epochs (None: repeat forever).
        poll_interval_s: tail: seconds between commit log scans when out of data.
        idle_timeout_s: tail: stop after this long without a new commit (None: never).
        num_workers: DataLoader workers that will iterate this dataset (0 = main process).
        rank: this process's rank; default ``torch.distributed`` rank (0 if not initialized).
        world_size: number of ranks; default ``torch.distributed`` world size.
        pad_id: token id used for padding.
        drop_last: drop the final partial batch when a finite stream ends.
        tables: step-shaped tables to read: ``("steps",)`` (default), plus ``"corrections"`` for the
            feedback corrections (one-step samples: prompt = the recorded context of the corrected step,
            target = the correction; docs/feedback.md), or ``("corrections",)`` alone.

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
        tables: Sequence[str] = ("steps",),
    ) -> None:
        super().__init__()
        if not tables or not set(tables) <= {"steps", "corrections"}:
            raise ValueError(f"`tables` must name steps and/or corrections, got {tuple(tables)}")
        self.tables = tuple(sorted(set(tables), key=("steps", "corrections").index))
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
        self.data_dir: Path | str = os.fspath(data_dir).rstrip("/") if loc.is_remote(data_dir) else Path(data_dir)
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
                    if recipes else f"{self.data_dir} has no committed dataset yet (no {COMMIT_LOG_DIR}/<recipe>/)"
                )
            self.recipe = recipes[0]
        return self.recipe

    def _freeze_snapshot(self) -> None:
        """Offline mode reads the commits visible when training starts, and keeps to them on resume."""
        if self.mode == "offline" and self.snapshot_commit is None:
            commits = scan_commits(self.data_dir, recipe=self._resolve_recipe(), tables=self.tables)
            if not commits:
                raise DataError(f"{self.data_dir}: dataset {self.recipe} has no complete commit to train on")
            self.snapshot_commit = commits[-1].commit

    def positions(self) -> dict[int, ShardPosition]:
        """Each shard's position after the batches consumed so far (shard id -> position)."""
        return dict(self._positions)

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
            "tables": list(self.tables),
        }

    def load_state_dict(self, state: dict[str, Any]) -> None:
        """Continue from a :meth:`state_dict`; the stream settings must be the same.

        Raises:
            DataError: the state was written with different data settings
                (which would make "the next sample" mean something else), or by
                a trainer with another position format.
        """
        if state.get("format") != STATE_FORMAT:
            raise DataError(
                f"dataset position format {state.get('format')} is not {STATE_FORMAT}: the checkpoint was written by "
                "a trainer that packed steps, not episode windows; its position cannot be mapped onto episodes, "
                "so start a new run (a new --out) from its published policy"
            )
        mine = {"mode": self.mode, "seed": self.seed, "filters": self.filters.fingerprint(),
                "advantage_field": self.advantage_field, "seq_len": self.seq_len,
                "batch_size": self.batch_size, "num_shards": self.num_shards, "rank": self.rank}
        diff = {k: (state.get(k), v) for k, v in mine.items() if state.get(k) != v}
        if tuple(state.get("tables", ("steps",))) != self.tables:  # positions written before corrections: steps
            diff["tables"] = (state.get("tables", ["steps"]), list(self.tables))
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
        # Pruning by statistics is safe: a row group none of whose rows is a trained step holds only episodes
        # that would be skipped (row groups hold whole episodes; a split one is an error either way).
        expr = self.filters.expression()
        units = []
        for rel in commit.files:
            if not self.filters.accepts_domain(_domain_of(rel)):
                continue
            frag = self._fragment(rel)
            for piece in frag.split_by_row_group(filter=expr, schema=step_file_schema()):
                units.append(_Unit(file=rel, row_group=piece.row_groups[0].id, commit=commit.commit))
        if self.shuffle and self.mode == "tail":
            order = _rng(self.seed, commit.commit).permutation(len(units))
            units = [units[i] for i in order]
        self._unit_cache[commit.commit] = units
        return units

    def _fragment(self, rel: str, *, row_groups: list[int] | None = None) -> ds.ParquetFileFragment:
        """The committed file ``rel`` (relative to the dataset root), on its filesystem."""
        if isinstance(self.data_dir, Path):
            return _FORMAT.make_fragment(str(self.data_dir / rel), filesystem=_LOCAL_FS, row_groups=row_groups)
        fs, path = loc.filesystem(loc.join(self.data_dir, rel))  # one S3 client per process (workers too)
        return _FORMAT.make_fragment(path, filesystem=fs, row_groups=row_groups)

    def _epoch_units(self, epoch: int, shard: int) -> list[_Unit]:
        """Offline: this shard's units of one epoch."""
        commits = scan_commits(self.data_dir, recipe=self._resolve_recipe(), upto=self.snapshot_commit,
                               tables=self.tables)
        if not commits or commits[-1].commit != self.snapshot_commit:
            raise DataError(f"{self.data_dir}: commits up to {self.snapshot_commit} of {self.recipe} are gone")
        units = [u for c in commits for u in self._units_of(c)]
        if self.shuffle:
            order = _rng(self.seed, epoch).permutation(len(units))
            units = [units[i] for i in order]
        return units[shard::self.num_shards]

    def _tail_units(self, shard: int, known: list[_Unit], seen_commit: int) -> tuple[list[_Unit], int]:
        """Tail: extend this shard's unit list with newly complete commits."""
        new = scan_commits(self.data_dir, recipe=self._resolve_recipe(), after=seen_commit, tables=self.tables)
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

    def _read_unit(self, unit: _Unit, epoch: int) -> _UnitRows:
        where = f"{unit.file} (row group {unit.row_group})"
        frag = self._fragment(unit.file, row_groups=[unit.row_group])
        table = _drop_eval_rows(frag, frag.to_table(schema=step_file_schema(), columns=_COLUMNS), where)
        episodes = _episode_blocks(table, where)
        if self.shuffle and len(episodes) > 1:
            episodes = [episodes[i] for i in _rng(self.seed, epoch, unit.key()).permutation(len(episodes))]
        return _UnitRows(
            where=where,
            episode_id=table.column("episode_id").to_pylist(),
            trained=self.filters.trained(table),
            policy_version=table.column("policy_version").to_numpy(),
            lineage=table.column("policy_lineage").to_pylist(),
            temperature=table.column("temperature").to_numpy().astype(np.float32),
            top_p=table.column("top_p").to_numpy().astype(np.float64),
            top_k=table.column("top_k").to_numpy().astype(np.int64),
            cut_start=table.column("context_cut_start").to_numpy(),
            cut_tokens=table.column("context_cut_tokens").to_numpy(),
            return_to_go=table.column("return_to_go").to_numpy(),
            advantage=table.column(self.advantage_field).to_numpy(),
            obs=_list_column(table.column("observation_token_ids"), np.int64),
            act=_list_column(table.column("action_token_ids"), np.int64),
            blogp=_list_column(table.column("behaviour_logprobs"), np.float32),
            mask=_list_column(table.column("loss_mask"), bool),
            episodes=episodes,
        )

    def _episode(self, rows: _UnitRows, a: int, b: int, counts: DataCounts) -> tuple[_EpisodeSteps, list[_Segment]]:
        """The windows of the episode in rows ``a..b-1`` (empty, and counted, when it is skipped).

        Raises:
            DataError: a recorded context cut lies outside its step's input.
        """
        (ov, oo), (av, ao), (bv, bo), (mv, mo) = rows.obs, rows.act, rows.blogp, rows.mask
        ep = _EpisodeSteps(
            episode_id=rows.episode_id[a], episode_return=float(rows.return_to_go[a]),
            version=rows.policy_version[a:b], lineage=rows.lineage[a:b], temperature=rows.temperature[a:b],
            top_p=rows.top_p[a:b], top_k=rows.top_k[a:b],
        )
        obs_len, act_len = oo[a + 1:b + 1] - oo[a:b], ao[a + 1:b + 1] - ao[a:b]
        trained = rows.trained[a:b]
        if obs_len[0] == 0:
            counts.episodes_without_context += 1
            return ep, []
        if not trained.any():
            counts.episodes_untrained += 1
            return ep, []
        try:
            windows = plan_windows(obs_len, act_len, cut_start=rows.cut_start[a:b], cut_tokens=rows.cut_tokens[a:b],
                                   trained=trained, seq_len=self.seq_len)
        except ValueError as err:
            raise DataError(f"{rows.where}: episode {ep.episode_id}: {err}; the rollout recorded an impossible "
                            "context cut, regenerate these episodes") from err
        n = b - a
        parts, act_mask, act_blogp, act_has = [], [], [], []
        for k in range(n):
            r = a + k
            parts += [ov[oo[r]:oo[r + 1]], av[ao[r]:ao[r + 1]]]
            m = mv[mo[r]:mo[r + 1]]
            act_mask.append(m if len(m) == act_len[k] else np.ones(act_len[k], dtype=bool))
            lp = bv[bo[r]:bo[r + 1]]
            has = len(lp) == act_len[k]
            act_blogp.append(lp if has else np.zeros(act_len[k], dtype=np.float32))
            act_has.append(np.full(act_len[k], has, dtype=bool))
        ids = np.concatenate(parts)
        lens = np.stack([obs_len, act_len], axis=1).ravel()
        is_act = np.repeat(np.tile(np.array([False, True]), n), lens)
        step_of = np.repeat(np.repeat(np.arange(n), 2), lens)
        loss = np.zeros(len(ids), dtype=bool)
        loss[is_act] = np.concatenate(act_mask) & trained[step_of[is_act]]
        blogp = np.zeros(len(ids), dtype=np.float32)
        blogp[is_act] = np.concatenate(act_blogp)
        has_blogp = np.zeros(len(ids), dtype=bool)
        has_blogp[is_act] = np.concatenate(act_has)
        adv = np.where(is_act, rows.advantage[a:b][step_of], 0.0).astype(np.float32)
        ends = np.cumsum(obs_len + act_len)
        segments = []
        for wi, w in enumerate(windows):
            idx = np.concatenate([np.arange(w.head), np.arange(w.start, w.end)])
            st = step_of[idx]
            seg_loss = loss[idx] & (st >= w.first_step) & (st <= w.last_step)
            truncated = int(loss[w.end:ends[w.last_step]].sum()) if w.end < ends[w.last_step] else 0
            seg_loss[0] = False
            if not seg_loss.any():
                counts.truncated_tokens += truncated
                continue
            segments.append(_Segment(window=wi, ids=ids[idx], steps=st, loss=seg_loss, blogp=blogp[idx],
                                     has_blogp=has_blogp[idx], adv=adv[idx], exact=w.exact, truncated=truncated))
        if not segments:
            counts.episodes_untrained += 1
        return ep, segments

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

    def _pack_units(self, shard: int, epoch: int, units: list[_Unit], start: ShardPosition, packer: _Packer,
                    count: list[int]) -> Iterator[PackedBatch]:
        """Pack ``units[start.unit:]`` from ``(start.episode, start.window)``; ``count[1]`` counts windows packed."""

        def emit(ui: int, ei: int, wi: int) -> PackedBatch:
            count[0] += 1
            return packer.emit(ShardPosition(shard=shard, epoch=epoch, unit=ui, episode=ei, window=wi,
                                             batches=count[0]))

        for ui in range(start.unit, len(units)):
            rows = self._read_unit(units[ui], epoch)
            first_unit = ui == start.unit
            for ei in range(start.episode if first_unit else 0, len(rows.episodes)):
                w0 = start.window if first_unit and ei == start.episode else 0
                ep, segments = self._episode(rows, *rows.episodes[ei], packer.counts)
                segments = [s for s in segments if s.window >= w0]
                if not segments:
                    continue
                # a response stays in one batch unless it is larger than a batch (per-response aggregation)
                if w0 == 0 and not packer.empty() and not packer.fits_all([len(s.ids) for s in segments]):
                    yield emit(ui, ei, segments[0].window)
                for seg in segments:
                    if not packer.fits(len(seg.ids)):
                        yield emit(ui, ei, seg.window)
                    packer.add(seg, ep)
                    count[1] += 1

    def _iter_offline(self, shard: int, start: ShardPosition) -> Iterator[PackedBatch]:
        packer = _Packer(self.batch_size, self.seq_len, self.pad_id)
        count = [start.batches, 0]
        epoch, pos = start.epoch, start
        while self.max_epochs is None or epoch < self.max_epochs:
            units = self._epoch_units(epoch, shard)
            packed_before = count[1]
            yield from self._pack_units(shard, epoch, units, pos, packer, count)
            if count[1] == packed_before and (pos.unit, pos.episode, pos.window) == (0, 0, 0):
                log.warning("shard %d: a whole epoch of its data holds no trained step; it stops", shard)
                break
            epoch, pos = epoch + 1, ShardPosition(shard=shard)
        if not packer.empty() and not self.drop_last:
            count[0] += 1
            yield packer.emit(ShardPosition(shard=shard, epoch=epoch, batches=count[0]))

    def _iter_tail(self, shard: int, start: ShardPosition) -> Iterator[PackedBatch]:
        packer = _Packer(self.batch_size, self.seq_len, self.pad_id)
        count = [start.batches, 0]
        self._tail_total = 0
        units: list[_Unit] = []
        units, seen = self._tail_units(shard, units, 0)
        pos = start
        idle_since = time.monotonic()
        while True:
            if pos.unit < len(units):
                end = len(units)
                yield from self._pack_units(shard, 0, units, pos, packer, count)
                pos = ShardPosition(shard=shard, unit=end)
                idle_since = time.monotonic()
                continue
            units, new_seen = self._tail_units(shard, units, seen)
            if new_seen != seen:
                seen = new_seen
                if pos.unit < len(units):
                    continue
                idle_since = time.monotonic()  # a commit landed, just none of it for this shard
            if self.idle_timeout_s is not None and time.monotonic() - idle_since >= self.idle_timeout_s:
                break
            time.sleep(self.poll_interval_s)
        if not packer.empty() and not self.drop_last:
            count[0] += 1
            yield packer.emit(ShardPosition(shard=shard, unit=pos.unit, batches=count[0]))


#: Longest path of a Unix socket on Linux (``sun_path`` holds 108 bytes with the terminating NUL).
_AF_UNIX_PATH_MAX = 107


def _check_worker_socket_room() -> None:
    """Refuse a temporary directory whose path leaves no room for the DataLoader workers' sockets.

    A worker hands a batch's tensors to the trainer by file descriptor, through multiprocessing's
    resource sharer, which listens on ``<tempdir>/pymp-XXXXXXXX/listener-XXXXXXXX`` (32 characters
    past the temporary directory). Past 107 bytes the worker's ``bind`` fails with ``AF_UNIX path too
    long`` in its feeder thread and the trainer waits forever for the batch -- a silent hang, seen
    with a long ``TMPDIR``.

    Raises:
        DataError: the temporary directory's path is too long; the message says what to set.
    """
    import tempfile

    tmp = tempfile.gettempdir()
    if len(os.fsencode(tmp)) + 32 > _AF_UNIX_PATH_MAX:
        raise DataError(f"the temporary directory {tmp} ({len(os.fsencode(tmp))} bytes) is too long for the data "
                        f"loader workers' sockets (Unix socket paths hold {_AF_UNIX_PATH_MAX} bytes, the workers "
                        f"need {len(os.fsencode(tmp)) + 32}): set TMPDIR to a directory of at most "
                        f"{_AF_UNIX_PATH_MAX - 32} bytes, or train with data.num_workers: 0")


def _worker_dumps_its_stack_on_a_crash(_worker_id: int) -> None:
    """A DataLoader worker that dies of a fatal signal writes every thread's Python stack to stderr first.

    torch's own handler (installed before this runs) prints only "Unexpected segmentation
    fault encountered in worker" and the trainer then reports the worker as "exited
    unexpectedly"; :mod:`faulthandler` replaces it for SIGSEGV, SIGFPE, SIGABRT, SIGBUS and
    SIGILL and re-raises the signal, so the parent sees the same death, with the stack
    that caused it on stderr.
    """
    # Enabled in the parent already (PYTHONFAULTHANDLER, pytest), enable() alone would keep torch's
    # handler: it only reinstalls after a disable().
    faulthandler.disable()
    faulthandler.enable(file=2, all_threads=True)  # fd 2: a test's or a CLI runner's sys.stderr may have no file


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
        if stream.num_workers:
            _check_worker_socket_room()
        self._loader = DataLoader(
            stream, batch_size=None, num_workers=stream.num_workers, pin_memory=pin_memory,
            prefetch_factor=prefetch_factor if stream.num_workers else None,
            persistent_workers=False, multiprocessing_context="fork" if stream.num_workers and os.name == "posix" else None,
            worker_init_fn=_worker_dumps_its_stack_on_a_crash if stream.num_workers else None,
        )

    def __iter__(self) -> Iterator[PackedBatch]:
        for batch in self._loader:
            self.stream.record(batch)
            yield batch

    def state_dict(self) -> dict[str, Any]:
        return self.stream.state_dict()

    def load_state_dict(self, state: dict[str, Any]) -> None:
        self.stream.load_state_dict(state)
