"""WriteDatasets: episodes → staged Parquet files of one commit (the driver commits them).

Everything a commit writes goes to ``<out>/_staging/<version>/<commit>/``
under names that do not end in ``.parquet`` (``*.parquet.tmp``), mirroring the
final layout; :mod:`pipelines.commit` makes it visible with a manifest and
renames. File names are deterministic (``c<commit>-s<shard>``) and rows are
sorted by ``(episode_id, step_index)``, so a rerun of the same input writes
the same bytes to the same names. Parquet row groups hold whole episodes
(about :data:`ROW_GROUP_ROWS` rows each): a reader that takes a row group as
its unit gets every step of an episode together.

Rows of GRPO groups that are not whole yet are *held* (:mod:`pipelines.groups`):
staged under ``state/held/`` (Arrow IPC, un-normalized), committed as state
and fed back into the next commit's writer, which writes them with the rest
of their group. Late events and the events kept for incomplete episodes are
staged by :func:`pipelines.late.write_late_files` (``late_events/`` and
``state/late.arrow``).

Examples:
    >>> final_path("steps", version="outcome-1a2b3c4d", domain="math", commit=3, shard=0)
    'steps/recipe=outcome-1a2b3c4d/domain=math/c00000003-s000.parquet'
"""

from __future__ import annotations

import collections
import itertools
import operator
import os
import uuid
import zlib
from collections.abc import Iterable, Iterator, Mapping, Sequence
from concurrent.futures import Future, ThreadPoolExecutor, wait
from pathlib import Path
from typing import Any, Tuple

import apache_beam as beam
import msgspec
import numpy as np
import pyarrow as pa
import pyarrow.compute as pc
import pyarrow.parquet as pq
from apache_beam.metrics import Metrics
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from pipelines.evaluations import evaluation_row
from pipelines.forked import ChainStage, in_global_window
from pipelines.gcpause import gc_paused
from pipelines.late import LateEpisode, write_late_files
from pipelines.groups import (
    DEFAULT_GROUP_TIMEOUT_S,
    CommitGroups,
    GroupState,
    GroupStats,
    GroupStatsMap,
    HeldGroup,
    HeldState,
    add_group_stats,
    decide_commit,
    group_key_strings,
    group_stats_of_tables,
    key_string,
)
from pipelines.normalize import STATS_TAG, RunningStats, normalize_tables
from pipelines.recipes import Recipe
from pipelines.rewards import step_passed
from pipelines.types import METRICS_NAMESPACE, Episode, GroupKey, PlainEpisode
from pipelines.verify import DATA_QUALITY_PREFIX, step_disagreements
from schemas.arrow import arrow_schema_for, events_to_table
from schemas.datasets import (
    EvaluationRow,
    StepRow,
    TrajectoryRow,
    Verification,
    context_tokens_of,
    evaluation_file_schema,
    step_file_schema,
    trajectory_file_schema,
)
from schemas.deadletter import DeadLetter
from schemas.events import Step
from schemas.locations import delete_file, join, open_output, read_feather, write_feather

__all__ = [
    "WriteDatasets",
    "write_shard",
    "episode_rows",
    "trajectory_row",
    "RowsBuffer",
    "step_figures",
    "episodes_to_tables",
    "rows_to_table",
    "final_path",
    "incomplete_path",
    "evaluations_path",
    "stage_files",
    "StagedCommit",
    "finalize_shard",
    "row_group_starts",
    "write_parquet",
    "STAGED_SUFFIX",
    "PENDING_FILE",
    "RUN_STATS_FILE",
    "GROUPS_FILE",
    "HELD_DIR",
    "ROW_GROUP_ROWS",
]

#: Suffix of staged files (so no ``*.parquet`` glob ever matches them).
STAGED_SUFFIX = ".tmp"
#: Staged pending-state file (events of unfinished episodes, archive schema, Arrow IPC).
PENDING_FILE = "pending.arrow"
#: Staged statistics of this run (``key -> [n, mean, m2]``): the domain families of the groups released.
RUN_STATS_FILE = "run-stats.json"
#: Staged held-group state (:class:`pipelines.groups.GroupState`, JSON).
GROUPS_FILE = "groups.json"
#: Staged directory (under ``state/``) of held rows, ``domain=<D>/s<shard>.{trajectories,steps}.arrow``.
HELD_DIR = "held"
#: Target rows per Parquet row group; a group ends only where an episode ends.
ROW_GROUP_ROWS = 65_536

_DEAD_LETTER_SCHEMA = arrow_schema_for(DeadLetter)


def final_path(table: str, *, version: str, domain: str, commit: int, shard: int) -> str:
    """Path of a dataset file relative to ``<out>`` (hive keys ``recipe`` and ``domain``)."""
    return f"{table}/recipe={version}/domain={domain}/c{commit:08d}-s{shard:03d}.parquet"


def evaluations_path(*, version: str, domain: str, commit: int) -> str:
    """Path (relative to ``<out>``) of a commit's evaluation rows of one domain (pipelines/evaluations.py)."""
    return f"evaluations/recipe={version}/domain={domain}/c{commit:08d}.parquet"


def incomplete_path(*, version: str, domain: str, commit: int) -> str:
    """Path (relative to ``<out>``) of a commit's incomplete trajectories of one domain."""
    return f"trajectories/recipe={version}/domain={domain}/c{commit:08d}-incomplete.parquet"


_LAST_RECIPE: list[Any] = [None, ("", "")]


def _recipe_ids(recipe: Recipe) -> tuple[str, str]:
    """``(version, content_hash)``, remembered for the last recipe object (a sha256 per episode adds up)."""
    if _LAST_RECIPE[0] is not recipe:
        _LAST_RECIPE[:] = [recipe, (recipe.version, recipe.content_hash)]
    return _LAST_RECIPE[1]


def trajectory_row(episode: Episode, recipe: Recipe, *, disagreements: int | None = None,
                   steps_passed: int | None = None) -> TrajectoryRow:
    """The ``trajectories/`` row of an episode (complete or not).

    An episode not normalized yet gets ``group_advantage``/``normalized_return``
    0 and ``group_members`` 0 (:func:`pipelines.normalize.normalize_tables`
    fills them in). ``disagreements`` and ``steps_passed`` are the episode's totals of
    :func:`pipelines.verify.step_disagreements` and :func:`pipelines.rewards.step_passed`
    when the caller has them.
    """
    version, h = _recipe_ids(recipe)
    fin, started, complete = episode.finished, episode.started, episode.complete
    if disagreements is None:
        disagreements = sum(map(step_disagreements, episode.verdicts)) if complete else 0
    if steps_passed is None:
        steps_passed = sum(map(step_passed, episode.verdicts)) if complete else 0
    return TrajectoryRow(
        episode_id=episode.episode_id, domain=episode.domain, recipe=version, recipe_hash=h,
        task_id=episode.task_id, task_group=episode.task_group, policy_version=episode.policy_version,
        difficulty=started.difficulty if started is not None else 0, status=_status(episode),
        termination=episode.termination, trainable=episode.trainable, excluded_reason=episode.excluded_reason,
        complete=complete, incomplete_reason=episode.incomplete_reason, num_events=episode.num_events,
        num_steps=len(episode.steps) if complete else 0, steps_dropped=episode.steps_dropped,
        action_tokens=sum(map(len, map(_ACTION_TOKEN_IDS, episode.steps))) if complete else 0,
        tokens_masked=episode.tokens_masked, clipped=episode.clipped,
        outcome_reward=fin.outcome_reward if fin is not None and complete else 0.0,
        episode_return=episode.episode_return if complete else 0.0,
        normalized_return=episode.normalized_return if episode.normalized_return is not None else 0.0,
        group_advantage=episode.group_advantage if episode.group_advantage is not None else 0.0,
        group_size=episode.group_size, group_member=episode.group_member, group_members=episode.group_members,
        group_timed_out=episode.group_timed_out, policy_lineage=episode.policy_lineage,
        verifier_summary=fin.verifier_summary if fin is not None else "", verifier_disagreements=disagreements,
        completed_late=episode.completed_late,
        steps_passed=steps_passed,
        first_event_time=episode.first_event_time, last_event_time=episode.last_event_time,
    )


_ACTION_TOKEN_IDS = operator.attrgetter("action_token_ids")


def step_figures(verdicts: list[Verification], weights: Mapping[str, float]) -> tuple[float, bool, int]:
    """``(verification_score, step_passed, step_disagreements)`` of one step's verdicts, in one pass.

    The same three figures as :func:`pipelines.rewards.verification_score` (the same sums in the
    same order), :func:`pipelines.rewards.step_passed` and
    :func:`pipelines.verify.step_disagreements` (called only when the step has a pipeline re-run
    that does not count): three calls and three passes a step were ~6 % of row staging.

    Examples:
        >>> from schemas.datasets import Verification
        >>> v = [Verification(verifier="a", passed=True, score=1.0), Verification(verifier="b", passed=True, score=0.5),
        ...      Verification(verifier="a", passed=False, score=0.0, source="pipeline", counted=False)]
        >>> step_figures(v, {"b": 3.0})
        (0.625, True, 1)
        >>> step_figures(v[2:], {})  # no counted verdict: no score, no pass
        (0.0, False, 0)
    """
    total = num = 0.0
    counted = rerun = False
    passed = True
    for v in verdicts:
        if v.counted:
            counted = True
            if not v.passed:
                passed = False
            w = weights.get(v.verifier, 1.0) if weights else 1.0
            total += w
            num += w * v.score
        elif not rerun and v.source == "pipeline" and not v.verifier.startswith(DATA_QUALITY_PREFIX):
            rerun = True
    return (num / total if total > 0 else 0.0, counted and passed,
            step_disagreements(verdicts) if rerun else 0)


def _status(episode: Episode) -> str:
    return episode.finished.status.value if episode.finished is not None and episode.complete else "incomplete"


def episode_rows(episode: Episode, recipe: Recipe) -> tuple[TrajectoryRow, list[StepRow]]:
    """The dataset rows of an episode as objects, one per row (no step rows for an incomplete one).

    The rows :class:`RowsBuffer` builds (the one definition of every column),
    read back into :class:`~schemas.datasets.StepRow` objects with their
    partition keys: for tests and tools that look at single rows; the job
    writes tables. An episode not normalized yet gets
    ``normalized_advantage``/``group_advantage``/``group_size`` 0.
    """
    from schemas.codec import _dec_hook  # token arrays from lists, as the JSON form decodes them

    rows = RowsBuffer(recipe)
    rows.add(episode)
    keys = {"domain": episode.domain, "recipe": _recipe_ids(recipe)[0]}
    steps = [msgspec.convert({**r, **keys}, StepRow, dec_hook=_dec_hook) for r in rows.steps_table().to_pylist()]
    return rows.trajectory_rows[0], steps


class RowsBuffer:
    """Dataset rows of many episodes, kept as columns (no Python object per step): the definition of every column.

    ``add`` complete or incomplete episodes in the order the rows should have,
    then ``tables()`` gives the ``trajectories/`` and ``steps/`` file tables
    (the schemas of :mod:`schemas.datasets`, partition keys excluded). A
    trajectory row is one :func:`trajectory_row` per episode; a step row's
    columns are built here, and nowhere else (:func:`episode_rows` reads them
    back as objects).

    ``add`` keeps references only (the steps, one tuple of per-episode values,
    the per-step verdict figures); ``steps_table`` builds each column in one
    pass over every step added: step fields transposed in C
    (:func:`operator.attrgetter`), per-episode values made once and repeated
    by index, token counts and ``context_tokens`` vectorized over all episodes.
    """

    #: Step fields copied as they are, in ``_STEP_FIELDS`` order.
    _STEP_FIELDS = ("step_index", "event_id", "policy_version", "observation_token_ids", "action_token_ids",
                    "behaviour_logprobs", "context_cut_start", "context_cut_tokens", "event_time")
    #: Per-episode values repeated on each of its steps, in the order ``add`` records them.
    _EPISODE_FIELDS = ("episode_id", "task_id", "task_group", "status", "num_steps", "temperature", "top_p",
                       "top_k", "policy_lineage", "trainable", "group_advantage", "group_size")
    _ARRAYS = ("reward", "return_to_go", "advantage", "normalized_advantage")
    _get_step_fields = operator.attrgetter(*_STEP_FIELDS)

    def __init__(self, recipe: Recipe) -> None:
        self._recipe = recipe
        self._weights = recipe.verifier_weights
        self._trajs: list[TrajectoryRow] = []
        self._steps: list[Step] = []
        self._episodes: list[tuple[Any, ...]] = []
        self._step_counts: list[int] = []
        self._clipped: list[bool] = []
        self._cols: dict[str, list[Any]] = {k: [] for k in ("loss_mask", "verifications", "verification_score",
                                                             "verifier_disagreements", *self._ARRAYS)}
        self.steps = 0

    def __len__(self) -> int:
        return len(self._trajs)

    def add(self, episode: Episode | PlainEpisode) -> None:
        if type(episode) is PlainEpisode:  # the columnar path's rows, worked out already
            self._trajs.append(episode.row)
            if episode.steps:
                self._append(episode.row, episode.steps, episode.verdicts, episode.scores, episode.disagreements,
                             episode.loss_masks, (episode.rewards, episode.returns, episode.advantages, None),
                             episode.sampling, 0.0)
            return
        if not episode.complete or not episode.steps:
            self._trajs.append(trajectory_row(episode, self._recipe))
            return
        scores, passed, disagreements = zip(*map(step_figures, episode.verdicts, itertools.repeat(self._weights)))
        row = trajectory_row(episode, self._recipe, disagreements=sum(disagreements), steps_passed=sum(passed))
        self._trajs.append(row)
        self._append(row, episode.steps, episode.verdicts, scores, disagreements, episode.loss_masks,
                     (episode.rewards, episode.returns, episode.advantages, episode.normalized_advantages),
                     episode.sampling, float(episode.group_advantage or 0.0))

    def _append(self, row: TrajectoryRow, steps: list[Step], verdicts: list, scores: Sequence[float],
                disagreements: Sequence[int], loss_masks: list[np.ndarray], arrays: tuple, sampling: Any,
                group_advantage: float) -> None:
        """Keep a complete episode's step values (references; ``steps_table`` builds the columns)."""
        c, n = self._cols, len(steps)
        self._episodes.append((  # what the trajectory row has already worked out is read from it
            row.episode_id, row.task_id, row.task_group, row.status, n, sampling.temperature, sampling.top_p,
            sampling.top_k, row.policy_lineage, row.trainable, group_advantage, row.group_members))
        self._step_counts.append(n)
        self._clipped.append(row.clipped)
        self._steps += steps
        c["loss_mask"] += loss_masks
        c["verifications"] += verdicts
        c["verification_score"] += scores
        c["verifier_disagreements"] += disagreements
        rewards, returns, advantages, normalized = arrays
        c["reward"].append(rewards)
        c["return_to_go"].append(returns)
        c["advantage"].append(advantages)
        c["normalized_advantage"].append(normalized if normalized is not None else np.zeros(n))
        self.steps += n

    @property
    def trajectory_rows(self) -> list[TrajectoryRow]:
        """The ``trajectories/`` rows of everything added, in order (:func:`trajectory_row`)."""
        return self._trajs

    def steps_table(self) -> pa.Table:
        """The ``steps/`` table of everything added (:func:`~schemas.datasets.step_file_schema`)."""
        schema = step_file_schema()
        if not self.steps:
            return schema.empty_table()
        with gc_paused():
            columns: dict[str, Any] = dict(self._cols)
            for k in self._ARRAYS:
                columns[k] = np.concatenate(columns[k]).astype(np.float64)
            columns.update(zip(self._STEP_FIELDS, zip(*map(self._get_step_fields, self._steps))))
            counts = np.array(self._step_counts, dtype=np.int64)
            obs = np.fromiter(map(len, columns["observation_token_ids"]), np.int64, self.steps)
            act = np.fromiter(map(len, columns["action_token_ids"]), np.int64, self.steps)
            columns.update(observation_tokens=obs, action_tokens=act,
                           context_tokens=context_tokens_of(obs, act, counts))
            ends = np.cumsum(counts) - 1
            clipped = np.zeros(self.steps, dtype=bool)
            clipped[ends] = self._clipped
            columns["clipped"] = clipped
            episode_of_step = pa.array(np.repeat(np.arange(len(counts)), counts))
            per_episode = dict(zip(self._EPISODE_FIELDS, zip(*self._episodes)))
            arrays = []
            for f in schema:
                if f.name in per_episode:
                    arrays.append(pa.array(per_episode[f.name], type=f.type).take(episode_of_step))
                elif f.name == "recipe_hash":
                    arrays.append(pa.array([_recipe_ids(self._recipe)[1]] * self.steps, type=f.type))
                else:
                    arrays.append(_column(columns[f.name], f.type, lengths={"observation_token_ids": obs,
                                                                             "action_token_ids": act}.get(f.name)))
            return pa.Table.from_arrays(arrays, schema=schema)

    def tables(self) -> tuple[pa.Table, pa.Table]:
        """``(trajectories, steps)`` tables of everything added."""
        return rows_to_table(self._trajs, trajectory_file_schema()), self.steps_table()


def episodes_to_tables(episodes: Iterable[Episode], recipe: Recipe) -> tuple[pa.Table, pa.Table]:
    """``(trajectories, steps)`` tables of ``episodes``, rows in episode-id order (:class:`RowsBuffer`)."""
    rows = RowsBuffer(recipe)
    for episode in sorted(episodes, key=lambda e: e.episode_id):
        rows.add(episode)
    return rows.tables()


def rows_to_table(rows: Sequence[msgspec.Struct], schema: pa.Schema) -> pa.Table:
    """Columnar build of a table from row structs.

    Numpy-array list fields go through one concatenation, lists of Structs
    (``verifications``) through flat child arrays: no per-row Python objects
    reach Arrow except scalars.
    """
    if not rows:
        return schema.empty_table()
    with gc_paused():
        fields = type(rows[0]).__struct_fields__
        by_name = dict(zip(fields, zip(*map(msgspec.structs.astuple, rows))))  # one transposition, in C
        return pa.Table.from_arrays([_column(list(by_name[f.name]), f.type) for f in schema], schema=schema)


def _offsets(values: Sequence[Sequence[Any]], lengths: np.ndarray | None = None) -> pa.Array:
    if lengths is None:
        lengths = np.fromiter(map(len, values), dtype=np.int64, count=len(values))
    return pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def _column(values: Sequence[Any] | np.ndarray, typ: pa.DataType, *, lengths: np.ndarray | None = None) -> pa.Array:
    """An Arrow column of ``typ`` from ``values``; ``lengths``: the lengths of list ``values``, when known."""
    if isinstance(values, np.ndarray):
        return pa.array(values, type=typ)
    if pa.types.is_list(typ) and values and isinstance(values[0], np.ndarray):
        flat = np.concatenate(values) if len(values) else np.array([])
        return pa.ListArray.from_arrays(_offsets(values, lengths), pa.array(flat, type=typ.value_type), type=typ)
    if pa.types.is_list(typ) and pa.types.is_struct(typ.value_type):
        items = [v for vs in values for v in vs]
        struct = typ.value_type
        if items:
            by_name = dict(zip(type(items[0]).__struct_fields__, zip(*map(msgspec.structs.astuple, items))))
            children = [_column(list(by_name[f.name]), f.type) for f in struct]
        else:
            children = [pa.array([], type=f.type) for f in struct]
        child = pa.StructArray.from_arrays(children, fields=list(struct))
        return pa.ListArray.from_arrays(_offsets(values), child, type=typ)
    return pa.array(values, type=typ)


def row_group_starts(episode_ids: pa.Array | pa.ChunkedArray, *, target: int = ROW_GROUP_ROWS) -> list[int]:
    """First row of each Parquet row group of rows sorted by episode: groups end only where an episode ends.

    Greedy: each group takes whole episodes while it stays within ``target``
    rows; an episode longer than ``target`` gets a group of its own.

    Examples:
        >>> row_group_starts(pa.array(["a", "a", "b", "b", "b", "c", "d", "d"]), target=4)  # a a | b b b c | d d
        [0, 2, 6]
        >>> row_group_starts(pa.array(["a"] * 5 + ["b"]), target=2)  # a is longer than a group
        [0, 5]
    """
    n = len(episode_ids)
    if n <= target:
        return [0]
    ids = episode_ids.combine_chunks() if isinstance(episode_ids, pa.ChunkedArray) else episode_ids
    changed = pc.not_equal(ids.slice(1), ids.slice(0, n - 1)).to_numpy(zero_copy_only=False)
    starts = np.concatenate([[0], np.flatnonzero(changed) + 1, [n]])  # episode starts, then the end
    out = [0]
    while out[-1] + target < n:
        i = int(np.searchsorted(starts, out[-1] + target, side="right")) - 1  # last episode start within target
        nxt = int(starts[i])
        if nxt <= out[-1]:  # the group's first episode alone is longer than target
            nxt = int(starts[np.searchsorted(starts, out[-1], side="right")])
        if nxt >= n:
            break
        out.append(nxt)
    return out


def write_parquet(table: pa.Table, path: str | Path, *, row_group_rows: int = ROW_GROUP_ROWS) -> None:
    """Write a dataset file; with an ``episode_id`` column (sorted), row groups hold whole episodes.

    zstd; dictionary pages and min/max statistics for the scalar columns only
    (ids, names: few distinct values, and min/max lets readers skip row
    groups); token and logprob lists are near-unique and only cost time there. ``path`` is a
    location (:mod:`schemas.locations`: a local path or an ``s3://`` URI).
    """
    scalar = [f.name for f in table.schema if not pa.types.is_list(f.type)]
    if "episode_id" in table.column_names:
        starts = row_group_starts(table["episode_id"], target=row_group_rows)
    else:
        starts = list(range(0, max(table.num_rows, 1), row_group_rows))
    ends = [*starts[1:], table.num_rows]
    with open_output(path) as sink, pq.ParquetWriter(sink, table.schema, compression="zstd", use_dictionary=scalar,
                                                     write_statistics=scalar) as writer:
        for start, end in zip(starts, ends):
            writer.write_table(table.slice(start, end - start), row_group_size=max(end - start, 1))



def write_shard(staging: str | Path, version: str, commit: int, domain: str, shard: int, trajs: pa.Table,
                steps: pa.Table, *, stats: Mapping[str, RunningStats] | None,
                groups: Mapping[GroupKey, Any] | None = None, mode: str, eps: float) -> list[str]:
    """One (domain, shard)'s rows → its staged steps and trajectories files; returns their final paths.

    Rows are sorted by ``(episode_id, step_index)`` (deterministic bytes
    whatever order they came in); with ``stats`` set they are normalized first
    (:func:`pipelines.normalize.normalize_tables`, group statistics from ``groups``).
    """
    trajs = _sorted(trajs, [("episode_id", "ascending")])
    steps = _sorted(steps, [("episode_id", "ascending"), ("step_index", "ascending")])
    if stats is not None:
        trajs, steps = normalize_tables(trajs, steps, stats, groups or {}, mode=mode, eps=eps, domain=domain)
    out = []
    for table, data in (("trajectories", trajs), ("steps", steps)):
        if data.num_rows == 0:
            continue
        rel = final_path(table, version=version, domain=domain, commit=commit, shard=shard)
        write_parquet(data, join(str(staging), rel + STAGED_SUFFIX))
        out.append(rel)
    return out


def _sorted(table: pa.Table, keys: list[tuple[str, str]]) -> pa.Table:
    """``table`` sorted by ``keys``; no copy when it already is (one part written in order)."""
    idx = pc.sort_indices(table, sort_keys=keys).to_numpy()
    if np.array_equal(idx, np.arange(len(idx))):
        return table
    return table.take(idx)


def _held_part(domain: str, shard: int) -> str:
    """Staged base path (relative to the staging directory) of a (domain, shard)'s held rows."""
    return f"state/{HELD_DIR}/domain={domain}/s{shard:03d}"


def finalize_shard(staging: str | Path, version: str, commit: int, domain: str, shard: int, trajs: pa.Table,
                   steps: pa.Table, groups: CommitGroups, *, mode: str, eps: float) -> tuple[list[str], int, int]:
    """One (domain, shard)'s un-normalized rows (new and held) → its staged files; ``(paths, steps, trajs)`` written.

    Rows of groups ``groups`` holds go to the shard's held part
    (``state/held/...``, Arrow IPC, sorted); the others are normalized with
    ``groups.norm`` and their released group's statistics and written
    (:func:`write_shard`). The counts are those of the rows written to the dataset.

    Raises:
        ValueError: rows of a group neither released nor held (the held state
            does not match the held rows).
    """
    files: list[str] = []
    held_keys = groups.held_keys(domain)
    keys = group_key_strings(trajs) if trajs.num_rows else None
    released_keys = [key_string(tg, pv) for d, tg, pv in groups.released if d == domain]
    if keys is not None and not pc.all(pc.is_in(keys, value_set=pa.array(released_keys + held_keys,
                                                                         pa.string()))).as_py():
        raise ValueError(f"rows of domain {domain!r} shard {shard} belong to groups neither released nor held: the "
                         "held-group state (`_state/<V>/groups-<n>.json`) does not match its held rows "
                         "(`_state/<V>/held-<n>/`); restore both from the same commit")
    if held_keys and keys is not None:
        is_held = pc.is_in(keys, value_set=pa.array(held_keys, pa.string()))
        held_trajs = trajs.filter(is_held)
        if held_trajs.num_rows:
            step_held = pc.is_in(steps["episode_id"], value_set=held_trajs["episode_id"])
            held_steps = steps.filter(step_held)
            trajs, steps = trajs.filter(pc.invert(is_held)), steps.filter(pc.invert(step_held))
            base = _held_part(domain, shard)
            for table, data in (("trajectories", _sorted(held_trajs, [("episode_id", "ascending")])),
                                ("steps", _sorted(held_steps, [("episode_id", "ascending"),
                                                               ("step_index", "ascending")]))):
                write_feather(data, join(str(staging), f"{base}.{table}.arrow{STAGED_SUFFIX}"))
                files.append(f"{base}.{table}.arrow")
    files += write_shard(staging, version, commit, domain, shard, trajs, steps, stats=groups.norm,
                         groups=groups.released, mode=mode, eps=eps)
    return files, steps.num_rows, trajs.num_rows


#: Step rows a stage-rows buffer holds before it writes a part file.
PART_ROWS = 50_000


class _StageRowsFn(beam.DoFn):
    """Complete episodes → un-normalized row *parts* (Arrow IPC), one per (domain, shard) per bundle.

    Emits ``((domain, shard), part base path)``, and on ``stats`` one
    ``{group key: GroupStats}`` per flush: its parts' per-group statistics
    (:func:`pipelines.groups.group_stats_of_tables`), merged;
    the parts of a commit live under ``<staging>/_parts/`` until
    :class:`_FinalizeShardFn` merges them.
    Names are random: a retried bundle writes new parts, and only the parts of
    bundles that succeeded are ever emitted.
    """

    def __init__(self, staging: str, recipe: Recipe, shards: int) -> None:
        self._staging, self._recipe, self._shards = staging, recipe, shards

    def start_bundle(self) -> None:
        self._buf: dict[tuple[str, int], list[Episode]] = {}
        self._n = 0

    def process(self, episode: Episode) -> Iterator[tuple[tuple[str, int], str]]:
        key = (episode.domain, zlib.crc32(episode.episode_id.encode()) % self._shards)
        self._buf.setdefault(key, []).append(episode)
        self._n += len(episode.steps) + 1
        if self._n >= PART_ROWS:
            yield from self._flush()

    def finish_bundle(self) -> Iterator[Any]:
        for out in self._flush():
            yield in_global_window(out)

    def _flush(self) -> Iterator[Any]:
        stats = GroupStatsMap()
        for key, episodes in sorted(self._buf.items()):
            trajs, steps = episodes_to_tables(episodes, self._recipe)  # in order: the merge rarely re-sorts
            base = join(self._staging, "_parts", uuid.uuid4().hex)
            write_feather(trajs, f"{base}.trajectories.arrow")
            write_feather(steps, f"{base}.steps.arrow")
            add_group_stats(stats, group_stats_of_tables(trajs, steps, domain=key[0]))
            yield key, base
        if stats:  # one element per flush, not one per group: each costs the runner a pickle and a combine
            yield beam.pvalue.TaggedOutput(STATS_TAG, stats)
        self._buf, self._n = {}, 0


def _read_parts(bases: Sequence[str]) -> tuple[pa.Table, pa.Table]:
    trajs = pa.concat_tables([read_feather(f"{b}.trajectories.arrow", memory_map=True) for b in bases])
    steps = pa.concat_tables([read_feather(f"{b}.steps.arrow", memory_map=True) for b in bases])
    return trajs, steps


class _MergeGroupStats(beam.CombineFn):
    """Part statistics ``{group key: GroupStats}`` → the run's, one dict (empty when there are no parts)."""

    def create_accumulator(self) -> GroupStatsMap:
        return GroupStatsMap()

    def add_input(self, acc: dict[GroupKey, GroupStats], stats: Mapping[GroupKey, GroupStats]) -> dict:
        return add_group_stats(acc, stats)

    def merge_accumulators(self, accs: Iterable[dict[GroupKey, GroupStats]]) -> dict[GroupKey, GroupStats]:
        accs = iter(accs)
        out = next(accs, GroupStatsMap())
        for acc in accs:
            add_group_stats(out, acc)
        return out

    def extract_output(self, acc: dict[GroupKey, GroupStats]) -> dict[GroupKey, GroupStats]:
        return acc


class _Decider:
    """The commit's group decision (:func:`pipelines.groups.decide_commit`), once per bundle of side inputs."""

    def __init__(self, held: Mapping[GroupKey, HeldGroup], timeout_s: float,
                 prior: Mapping[str, RunningStats]) -> None:
        self._held, self._timeout_s, self._prior = dict(held), timeout_s, dict(prior)
        self._last: tuple[Any, CommitGroups] | None = None

    def __call__(self, run_groups: Mapping[GroupKey, GroupStats], clock_s: float) -> CommitGroups:
        if self._last is None or self._last[0] is not run_groups:
            self._last = (run_groups, decide_commit(run_groups, self._held, clock_s=clock_s,
                                                    timeout_s=self._timeout_s, prior=self._prior))
        return self._last[1]


class _FinalizeShardFn(beam.DoFn):
    """The parts of one (domain, shard) → its staged, normalized files, and its held rows.

    Each call applies the commit's group decision
    (:func:`pipelines.groups.decide_commit` of the run's group statistics, the
    held state of the last commit and the event-time clock — the same
    decision in every shard): rows of released groups are normalized with
    ``prior ⊕`` the released groups' domain statistics and written, rows of
    held groups staged as held state (:func:`finalize_shard`). Parts under
    the commit's ``_parts/`` are removed once merged; held parts of the last
    commit (committed state) are only read.

    A shard's work (read its parts, normalize, sort, Parquet-encode) is Arrow
    and numpy code that releases the GIL, so the shards of a bundle run on a
    small thread pool, up to ``threads`` at a time: on one worker that gets
    several shards in a bundle (FnApiRunner gets all of them) they share the
    cores. Results, and the metrics (which are per thread in Beam), are taken
    in the bundle's own thread.
    """

    def __init__(self, staging: str, version: str, commit: int, *, mode: str = "none", eps: float = 1e-6,
                 prior: Mapping[str, RunningStats] | None = None, held: Mapping[GroupKey, HeldGroup] | None = None,
                 timeout_s: float = DEFAULT_GROUP_TIMEOUT_S, threads: int | None = None) -> None:
        self._staging, self._version, self._commit = staging, version, commit
        self._mode, self._eps = mode, eps
        self._prior = dict(prior or {})
        self._held, self._timeout_s = dict(held or {}), timeout_s
        self._threads = threads
        self._steps = Metrics.counter(METRICS_NAMESPACE, "steps_written")
        self._trajs = Metrics.counter(METRICS_NAMESPACE, "trajectories_written")
        self._normalized = Metrics.counter(METRICS_NAMESPACE, "episodes_normalized")

    def setup(self) -> None:
        threads = self._threads or min(4, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="finalize-shard")
        self._in_flight_max = threads
        self._decide = _Decider(self._held, self._timeout_s, self._prior)

    def start_bundle(self) -> None:
        self._in_flight: collections.deque[Future] = collections.deque()

    def process(self, element: tuple[tuple[str, int], Iterable[str]], run_groups: Mapping[GroupKey, GroupStats],
                clock_s: float) -> Iterator[str]:
        (domain, shard), bases = element
        groups = self._decide(run_groups, clock_s)
        self._in_flight.append(self._pool.submit(self._finalize, domain, shard, sorted(bases), groups))
        while len(self._in_flight) >= self._in_flight_max:  # bounds memory: one shard's tables per thread
            yield from self._collect(self._in_flight.popleft())

    def finish_bundle(self) -> Iterator[WindowedValue]:
        window = GlobalWindow()
        while self._in_flight:
            for rel in self._collect(self._in_flight.popleft()):
                yield WindowedValue(rel, window.max_timestamp(), [window])

    def teardown(self) -> None:
        self._pool.shutdown(wait=True, cancel_futures=True)

    def _collect(self, future: Future) -> list[str]:
        try:
            files, n_steps, n_trajs = future.result()
        except BaseException:
            # A shard's error fails the bundle, once the bundle's other shards have stopped writing:
            # a retry on this instance must not race a thread still writing the same staged file.
            wait(self._in_flight)
            self._in_flight.clear()
            raise
        self._steps.inc(n_steps)
        self._trajs.inc(n_trajs)
        self._normalized.inc(n_trajs)
        return files

    def _finalize(self, domain: str, shard: int, bases: list[str], groups: CommitGroups) -> tuple[list[str], int, int]:
        trajs, steps = _read_parts(bases)
        out = finalize_shard(self._staging, self._version, self._commit, domain, shard, trajs, steps, groups,
                             mode=self._mode, eps=self._eps)
        staged_parts = join(self._staging, "_parts")
        for b in bases:
            if b.startswith(staged_parts):  # never the last commit's held parts: committed state
                for table in ("trajectories", "steps"):
                    delete_file(f"{b}.{table}.arrow")
        return out


class _StageGroupStateFn(beam.DoFn):
    """The run's group statistics → the commit's group decision → staged held state and run statistics.

    One element (the run's ``{group key: GroupStats}``); writes
    ``state/groups.json`` (the groups held now) and ``state/run-stats.json``
    (the released groups' domain statistics, which the commit merges into the
    persisted ones), and counts ``groups_released``, ``groups_held``,
    ``groups_timed_out`` and ``episodes_held``.
    """

    def __init__(self, staging: str, *, prior: Mapping[str, RunningStats], held: Mapping[GroupKey, HeldGroup],
                 timeout_s: float) -> None:
        self._staging = staging
        self._decide = _Decider(held, timeout_s, prior)
        self._c = {k: Metrics.counter(METRICS_NAMESPACE, k)
                   for k in ("groups_released", "groups_held", "groups_timed_out", "episodes_held")}

    def process(self, run_groups: Mapping[GroupKey, GroupStats], clock_s: float) -> Iterator[str]:
        from pipelines.counts import write_counts_file

        groups = self._decide(run_groups, clock_s)
        for k, v in groups.counts().items():
            self._c[k].inc(v)
        # One writer per commit: its counts beside the state it stages, for the commit (pipelines/counts.py).
        write_counts_file(self._staging, "groups", groups.counts())
        yield from _write_group_state(groups, self._staging)


def _write_group_state(groups: CommitGroups, staging: str | Path) -> Iterator[str]:
    state = join(str(staging), "state")
    for name, data in ((GROUPS_FILE, msgspec.json.encode(GroupState.of(groups.held))),
                       (RUN_STATS_FILE, msgspec.json.encode(groups.run))):
        with open_output(join(state, name + STAGED_SUFFIX)) as f:
            f.write(data)
    yield "state/" + GROUPS_FILE
    yield "state/" + RUN_STATS_FILE


def _write_incomplete(trajs: list[TrajectoryRow], staging: str, version: str, commit: int) -> Iterator[str]:
    by_domain: dict[str, list[TrajectoryRow]] = {}
    for tr in trajs:
        by_domain.setdefault(tr.domain, []).append(tr)
    for domain in sorted(by_domain):
        rows = sorted(by_domain[domain], key=lambda tr: tr.episode_id)
        rel = incomplete_path(version=version, domain=domain, commit=commit)
        write_parquet(rows_to_table(rows, trajectory_file_schema()), join(staging, rel + STAGED_SUFFIX))
        yield rel


def _write_evaluations(rows: list[EvaluationRow], staging: str, version: str, commit: int) -> Iterator[str]:
    by_domain: dict[str, list[EvaluationRow]] = {}
    for row in rows:
        by_domain.setdefault(row.domain, []).append(row)
    for domain in sorted(by_domain):
        ordered = sorted(by_domain[domain], key=lambda r: (r.episode_id, r.complete))
        rel = evaluations_path(version=version, domain=domain, commit=commit)
        write_parquet(rows_to_table(ordered, evaluation_file_schema()), join(staging, rel + STAGED_SUFFIX))
        yield rel


def _write_dead_letters(letters: list[DeadLetter], staging: str, version: str, commit: int) -> Iterator[str]:
    if not letters:
        return
    letters = sorted(letters, key=lambda d: (d.source_topic, d.source_partition, d.source_offset, d.reason, d.message))
    rel = f"dead_letters/recipe={version}/c{commit:08d}.parquet"
    write_parquet(rows_to_table(letters, _DEAD_LETTER_SCHEMA), join(staging, rel + STAGED_SUFFIX))
    yield rel


def _write_late(items: list[LateEpisode], staging: str, version: str, commit: int) -> list[str]:
    return write_late_files(items, staging, version=version, commit=commit, suffix=STAGED_SUFFIX)


def _write_pending(fragments: list[tuple[str, list]], staging: str) -> Iterator[str]:
    if not fragments:
        return
    events = [e for _, evs in sorted(fragments, key=lambda f: f[0]) for e in sorted(evs, key=lambda e: e.seq)]
    write_feather(events_to_table(events), join(staging, "state", PENDING_FILE + STAGED_SUFFIX))
    yield "state/" + PENDING_FILE


_INCOMPLETE, _DEAD_LETTERS, _PENDING, _EVALUATIONS, _LATE = "incomplete", "dead_letters", "pending", "evaluations", "late"


def _tag(value: Any, kind: str) -> tuple[str, Any]:
    return kind, value


def _write_collected(item: tuple[str, Iterable[Any]], staging: str, version: str, commit: int) -> Iterator[str]:
    """One kind's whole collection (``WriteDatasets``' ``Collect``) → its staged files (each writer sorts its rows)."""
    kind, values = item
    values = list(values)
    if kind == _PENDING:
        yield from _write_pending(values, staging)
    elif kind == _LATE:
        yield from _write_late(values, staging, version, commit)
    else:
        write = {_INCOMPLETE: _write_incomplete, _DEAD_LETTERS: _write_dead_letters,
                 _EVALUATIONS: _write_evaluations}[kind]
        yield from write(values, staging, version, commit)


class StagedCommit(msgspec.Struct, kw_only=True):
    """What :func:`stage_files` staged.

    Attributes:
        files: the staged files' final relative paths (held parts and state as ``state/...``).
        counts: ``groups_released``, ``groups_held``, ``groups_timed_out``,
            ``episodes_held`` (empty when the commit decided no groups).
    """

    files: list[str]
    counts: dict[str, int] = {}


def stage_files(
    staging: str | Path,
    recipe: Recipe,
    *,
    commit: int,
    episodes: Sequence[Episode] = (),
    evaluations: Sequence[Episode] = (),
    pending: Sequence[tuple[str, list]] = (),
    dead_letters: Sequence[DeadLetter] = (),
    late: Sequence[LateEpisode] = (),
    prior: Mapping[str, RunningStats] | None = None,
    held: HeldState | None = None,
    clock_s: float = 0.0,
    group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S,
    shards: int = 1,
) -> StagedCommit:
    """Write one commit's staged files in this process: the same files :class:`WriteDatasets` writes.

    For a single writer that holds all of a commit's elements (the streaming
    job's per-window commit). With ``held`` given, the commit decides the GRPO
    groups (:func:`pipelines.groups.decide_commit`, the batch job's rule):
    released groups are written, held ones (with the held rows of ``held``)
    staged as the new held state.

    Args:
        staging: ``<out>/_staging/<version>/<commit>``.
        recipe: the recipe.
        commit: the commit number (names the files).
        episodes: complete (rewarded, clipped, not normalized) and incomplete training episodes.
        evaluations: evaluation episodes, complete or not (pipelines/evaluations.py): rows of
            ``evaluations/`` only, never of the training tables or their statistics.
        pending: ``(episode_id, events)`` of open episodes.
        dead_letters: this commit's dead letters.
        late: this commit's late events and events to keep (pipelines/late.py).
        prior: persisted statistics; released rows are normalized with ``prior ⊕`` the released groups'.
        held: the held state of the last commit; None: this commit decides no groups
            (it must then have no complete episodes, e.g. the streaming job's pending-state commit).
        clock_s: the event-time clock after this commit (group timeouts).
        group_timeout_s: event-time seconds a group waits for missing members.
        shards: files per (table, domain).

    Raises:
        ValueError: complete episodes given without ``held``.
    """
    complete = [e for e in episodes if e.complete]
    incomplete = [trajectory_row(e, recipe) for e in episodes if not e.complete]
    if complete and held is None:
        raise ValueError("stage_files got complete episodes but no `held` state: pass the last commit's HeldState "
                         "(pipelines.commit.load_held_state) so their groups can be decided")
    files: list[str] = []
    counts: dict[str, int] = {}
    if held is not None:
        tables: dict[tuple[str, int], list[tuple[pa.Table, pa.Table]]] = {}
        by_shard: dict[tuple[str, int], list[Episode]] = {}
        for episode in complete:
            shard = zlib.crc32(episode.episode_id.encode()) % shards
            by_shard.setdefault((episode.domain, shard), []).append(episode)
        run: dict[GroupKey, GroupStats] = {}
        for key, shard_episodes in sorted(by_shard.items()):
            trajs, steps = episodes_to_tables(shard_episodes, recipe)
            tables.setdefault(key, []).append((trajs, steps))
            for gk, st in group_stats_of_tables(trajs, steps, domain=key[0]).items():
                run[gk] = run[gk].merge(st) if gk in run else st
        for part in held.parts:
            tables.setdefault((part.domain, part.shard % shards), []).append(_read_parts([part.base]))
        groups = decide_commit(run, held.groups.by_key(), clock_s=clock_s, timeout_s=group_timeout_s,
                               prior=prior or {})
        for (domain, shard), ts in sorted(tables.items()):
            trajs, steps = pa.concat_tables([t for t, _ in ts]), pa.concat_tables([s for _, s in ts])
            files += finalize_shard(staging, recipe.version, commit, domain, shard, trajs, steps, groups,
                                    mode=recipe.normalization, eps=recipe.eps)[0]
        files += _write_group_state(groups, staging)
        counts = groups.counts()
    files += _write_incomplete(incomplete, str(staging), recipe.version, commit)
    files += _write_evaluations([evaluation_row(e, recipe) for e in evaluations], str(staging), recipe.version,
                                commit)
    files += _write_dead_letters(list(dead_letters), str(staging), recipe.version, commit)
    files += _write_pending(list(pending), str(staging))
    files += _write_late(list(late), str(staging), recipe.version, commit)
    return StagedCommit(files=files, counts=counts)


class WriteDatasets(beam.PTransform):
    """Write one commit's staged files under ``staging`` (see the module docstring).

    Input: a dict of PCollections — ``episodes`` (complete, rewarded and
    clipped; or a tuple of such PCollections, branches of one job) and/or
    ``staged_parts`` and ``staged_stats`` (tuples of the two outputs of
    :meth:`stage_rows` run in :class:`pipelines.forked.ForkedChain` s),
    ``incomplete`` (Episodes with ``complete=False``), ``pending``
    (``(episode_id, events)``), ``dead_letters`` (DeadLetter), ``late``
    (:class:`~pipelines.late.LateEpisode`: the late-events table and the late
    state; optional), ``evaluations`` (evaluation episodes, complete or not, or a
    tuple of such PCollections; optional: the ``evaluations/`` rows) and ``clock`` (one float: the run's event-time clock,
    epoch seconds; default 0). The run's statistics come from the staged
    parts themselves.

    Complete episodes become rows where they are (each bundle writes its
    rows, un-normalized, as Arrow *part* files under ``<staging>/_parts/``,
    and emits its parts' per-group statistics as one dict, which one
    ``CombineGlobally`` merges into the run's). A GroupByKey of the part
    *paths* per (domain, shard), joined by the held parts of the last
    commit, then merges each shard's parts and applies the commit's group
    decision (side inputs: the run's group statistics and the clock;
    :func:`pipelines.groups.decide_commit`): rows of released groups are
    normalized with ``prior ⊕`` the released groups' domain statistics
    (vectorized: :func:`pipelines.normalize.normalize_tables`), sorted and
    written; rows of held groups are staged as held state. One more step
    applies the same decision to stage the held groups' state and the run's
    domain statistics. The rows never go through Beam's coders: normalizing
    the episodes in the pipeline would need the statistics of all of them
    first, i.e. one more pass that encodes and decodes every episode, tokens
    and all.

    Args:
        staging: ``<out>/_staging/<version>/<commit>``.
        recipe: the recipe (names the version, fills ``recipe_hash``).
        commit: the commit number (names the files).
        shards: files per (table, domain) per commit; episodes are spread by
            ``crc32(episode_id) % shards``.
        prior: persisted statistics of earlier commits (``NormState.stats``).
        held: the held state of the last commit (:func:`pipelines.commit.load_held_state`).
        group_timeout_s: event-time seconds a group waits for missing members.

    Returns:
        PCollection of the staged files' final relative paths (informational).
    """

    def __init__(self, staging: str | Path, recipe: Recipe, *, commit: int, shards: int = 1,
                 prior: Mapping[str, RunningStats] | None = None, held: HeldState | None = None,
                 group_timeout_s: float = DEFAULT_GROUP_TIMEOUT_S) -> None:
        super().__init__()
        if shards < 1:
            raise ValueError(f"`shards` must be >= 1, got {shards}")
        if group_timeout_s < 0:
            raise ValueError(f"`group_timeout_s` must be >= 0, got {group_timeout_s}")
        self._staging, self._recipe, self._commit, self._shards = str(staging), recipe, commit, shards
        self._prior = dict(prior or {})
        self._held = held or HeldState()
        self._timeout_s = group_timeout_s

    def stage_rows(self, name: str = "stage") -> ChainStage:
        """Its row staging (complete episodes → parts) as a stage of a :class:`pipelines.forked.ForkedChain`.

        Main output: ``((domain, shard), part base path)``; tagged output ``STATS_TAG``: each part's
        group statistics. Hand them to :meth:`expand` as ``staged_parts`` and ``staged_stats``.
        """
        return ChainStage(name, _StageRowsFn(self._staging, self._recipe, self._shards), (STATS_TAG,))

    def expand(self, pcolls: dict):
        staging, version, commit = self._staging, self._recipe.version, self._commit
        # Complete and incomplete episodes are written separately: a Flatten of the two would be one
        # more encode/decode pass of every row on FnApiRunner (it materializes multi-input Flattens).
        branches = pcolls.get("episodes", ())
        branches = tuple(branches) if isinstance(branches, (tuple, list)) else (branches,)
        staged = [
            b | f"StageRows{i or ''}" >> beam.ParDo(self.stage_rows().fn)
            .with_output_types(Tuple[Tuple[str, int], str]).with_outputs(STATS_TAG, main="parts")
            for i, b in enumerate(branches)
        ]
        parts = [st.parts for st in staged] + list(pcolls.get("staged_parts", ()))
        partial_stats = [st[STATS_TAG] for st in staged] + list(pcolls.get("staged_stats", ()))
        p = parts[0].pipeline
        if self._held.parts:
            held_parts = [((h.domain, h.shard % self._shards), h.base) for h in self._held.parts]
            parts.append(p | "HeldParts" >> beam.Create(held_parts, reshuffle=False).with_output_types(
                Tuple[Tuple[str, int], str]))
        parts = parts[0] if len(parts) == 1 else tuple(parts) | "AllParts" >> beam.Flatten()
        partial_stats = (partial_stats[0] if len(partial_stats) == 1
                         else tuple(partial_stats) | "AllPartStats" >> beam.Flatten())
        group_stats = partial_stats | "RunGroupStats" >> beam.CombineGlobally(_MergeGroupStats())
        clock = pcolls.get("clock")
        if clock is None:
            clock = p | "NoClock" >> beam.Create([0.0])
        held = self._held.groups.by_key()
        data_files = (
            parts
            | "GroupParts" >> beam.GroupByKey()
            | "FinalizeShards" >> beam.ParDo(
                _FinalizeShardFn(staging, version, commit, mode=self._recipe.normalization, eps=self._recipe.eps,
                                 prior=self._prior, held=held, timeout_s=self._timeout_s),
                run_groups=beam.pvalue.AsSingleton(group_stats), clock_s=beam.pvalue.AsSingleton(clock))
        )
        state_files = (
            group_stats
            | "StageGroupState" >> beam.ParDo(
                _StageGroupStateFn(staging, prior=self._prior, held=held, timeout_s=self._timeout_s),
                clock_s=beam.pvalue.AsSingleton(clock))
        )
        # The run's small collections each go to one writer call. Tagged with their kind, they cross one
        # GroupByKey together: a ToList per kind made the runner build a CombineGlobally (~10 ms of
        # construction) and run two more stages (~5-10 ms each) per kind.
        recipe = self._recipe
        tagged = [
            pcolls["incomplete"]
            | "IncompleteRows" >> beam.Map(trajectory_row, recipe).with_output_types(TrajectoryRow)
            | "TagIncomplete" >> beam.Map(_tag, _INCOMPLETE),
            pcolls["dead_letters"] | "TagDeadLetters" >> beam.Map(_tag, _DEAD_LETTERS),
            pcolls["pending"] | "TagPending" >> beam.Map(_tag, _PENDING),
        ]
        if "evaluations" in pcolls:
            evals = pcolls["evaluations"]
            evals = tuple(evals) if isinstance(evals, (tuple, list)) else (evals,)
            tagged += [e | f"EvaluationRows{i or ''}" >> beam.Map(evaluation_row, version)
                       | f"TagEvaluations{i or ''}" >> beam.Map(_tag, _EVALUATIONS) for i, e in enumerate(evals)]
        if "late" in pcolls:
            tagged.append(pcolls["late"] | "TagLate" >> beam.Map(_tag, _LATE))
        collected_files = (
            tuple(tagged)
            | "AllCollected" >> beam.Flatten()
            | "Collect" >> beam.GroupByKey()
            | "WriteCollected" >> beam.FlatMap(_write_collected, staging, version, commit)
        )
        outputs = [data_files, state_files, collected_files]
        return tuple(outputs) | "StagedFiles" >> beam.Flatten()
