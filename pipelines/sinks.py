"""WriteDatasets: episodes → staged Parquet files of one commit (the driver commits them).

Everything a commit writes goes to ``<out>/_staging/<version>/<commit>/``
under names that do not end in ``.parquet`` (``*.parquet.tmp``), mirroring the
final layout; :mod:`pipelines.commit` makes it visible with a manifest and
renames. File names are deterministic (``c<commit>-s<shard>``) and rows are
sorted by ``(episode_id, step_index)``, so a rerun of the same input writes
the same bytes to the same names.

Examples:
    >>> final_path("steps", version="outcome-1a2b3c4d", domain="math", commit=3, shard=0)
    'steps/recipe=outcome-1a2b3c4d/domain=math/c00000003-s000.parquet'
"""

from __future__ import annotations

import collections
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
import pyarrow.feather as feather
import pyarrow.parquet as pq
from apache_beam.metrics import Metrics
from apache_beam.transforms.window import GlobalWindow
from apache_beam.utils.windowed_value import WindowedValue

from pipelines.gcpause import gc_paused
from pipelines.normalize import STATS_TAG, NormState, RunningStats, merge_stats, normalize_tables, stats_of_tables
from pipelines.recipes import Recipe
from pipelines.types import METRICS_NAMESPACE, Episode
from schemas.arrow import arrow_schema_for, events_to_table
from schemas.datasets import StepRow, TrajectoryRow, step_file_schema, trajectory_file_schema
from schemas.deadletter import DeadLetter

__all__ = [
    "WriteDatasets",
    "write_shard",
    "episode_rows",
    "trajectory_row",
    "RowsBuffer",
    "episodes_to_tables",
    "rows_to_table",
    "final_path",
    "incomplete_path",
    "stage_files",
    "STAGED_SUFFIX",
    "PENDING_FILE",
    "RUN_STATS_FILE",
]

#: Suffix of staged files (so no ``*.parquet`` glob ever matches them).
STAGED_SUFFIX = ".tmp"
#: Staged pending-state file (events of unfinished episodes, archive schema, Arrow IPC).
PENDING_FILE = "pending.arrow"
#: Staged statistics of this run (``key -> [n, mean, m2]``).
RUN_STATS_FILE = "run-stats.json"

_DEAD_LETTER_SCHEMA = arrow_schema_for(DeadLetter)


def final_path(table: str, *, version: str, domain: str, commit: int, shard: int) -> str:
    """Path of a dataset file relative to ``<out>`` (hive keys ``recipe`` and ``domain``)."""
    return f"{table}/recipe={version}/domain={domain}/c{commit:08d}-s{shard:03d}.parquet"


def incomplete_path(*, version: str, domain: str, commit: int) -> str:
    """Path (relative to ``<out>``) of a commit's incomplete trajectories of one domain."""
    return f"trajectories/recipe={version}/domain={domain}/c{commit:08d}-incomplete.parquet"


_LAST_RECIPE: list[Any] = [None, ("", "")]


def _recipe_ids(recipe: Recipe) -> tuple[str, str]:
    """``(version, content_hash)``, remembered for the last recipe object (a sha256 per episode adds up)."""
    if _LAST_RECIPE[0] is not recipe:
        _LAST_RECIPE[:] = [recipe, (recipe.version, recipe.content_hash)]
    return _LAST_RECIPE[1]


def _verified(verdicts) -> bool:
    return all(v.passed for v in verdicts)


def trajectory_row(episode: Episode, recipe: Recipe) -> TrajectoryRow:
    """The ``trajectories/`` row of an episode (complete or not).

    An episode not normalized yet gets ``group_advantage``/``normalized_return``
    0 (:func:`pipelines.normalize.normalize_tables` fills them in).
    """
    version, h = _recipe_ids(recipe)
    fin, started, complete = episode.finished, episode.started, episode.complete
    return TrajectoryRow(
        episode_id=episode.episode_id, domain=episode.domain, recipe=version, recipe_hash=h,
        task_id=episode.task_id, task_group=episode.task_group, policy_version=episode.policy_version,
        difficulty=started.difficulty if started is not None else 0, status=_status(episode), complete=complete,
        incomplete_reason=episode.incomplete_reason, num_events=episode.num_events,
        num_steps=len(episode.steps) if complete else 0, steps_dropped=episode.steps_dropped,
        action_tokens=sum(len(s.action_token_ids) for s in episode.steps) if complete else 0,
        tokens_masked=episode.tokens_masked, clipped=episode.clipped,
        outcome_reward=fin.outcome_reward if fin is not None and complete else 0.0,
        episode_return=episode.episode_return if complete else 0.0,
        normalized_return=episode.normalized_return if episode.normalized_return is not None else 0.0,
        group_advantage=episode.group_advantage if episode.group_advantage is not None else 0.0,
        verifier_summary=fin.verifier_summary if fin is not None else "",
        steps_passed=sum(_verified(vs) for vs in episode.verdicts) if complete else 0,
        first_event_time=episode.first_event_time, last_event_time=episode.last_event_time,
    )


def _status(episode: Episode) -> str:
    return episode.finished.status.value if episode.finished is not None and episode.complete else "incomplete"


def _verification_score(verdicts: list) -> float:
    return sum([v.score for v in verdicts]) / len(verdicts) if verdicts else 0.0


def episode_rows(episode: Episode, recipe: Recipe) -> tuple[TrajectoryRow, list[StepRow]]:
    """The dataset rows of an episode, one object per row (no step rows for an incomplete one).

    The definition of every column; :class:`RowsBuffer` builds the same
    tables column-wise (tests hold the two equal). An episode not normalized
    yet gets ``normalized_advantage``/``group_advantage`` 0.
    """
    version, h = _recipe_ids(recipe)
    norm = episode.normalized_advantages
    status = _status(episode)
    steps: list[StepRow] = []
    if episode.complete:
        last = len(episode.steps) - 1
        for t, (s, vs) in enumerate(zip(episode.steps, episode.verdicts)):
            steps.append(StepRow(
                episode_id=episode.episode_id, step_index=s.step_index, event_id=s.event_id,
                domain=episode.domain, recipe=version, recipe_hash=h, task_id=episode.task_id,
                task_group=episode.task_group, policy_version=s.policy_version, status=status,
                num_steps=len(episode.steps), observation_token_ids=s.observation_token_ids,
                action_token_ids=s.action_token_ids, behaviour_logprobs=s.behaviour_logprobs,
                loss_mask=episode.loss_masks[t], reward=float(episode.rewards[t]),
                return_to_go=float(episode.returns[t]), advantage=float(episode.advantages[t]),
                normalized_advantage=float(norm[t]) if norm is not None else 0.0,
                group_advantage=float(episode.group_advantage or 0.0), verifications=vs,
                verification_score=_verification_score(vs), clipped=episode.clipped and t == last,
                event_time=s.event_time,
            ))
    return trajectory_row(episode, recipe), steps


class RowsBuffer:
    """Dataset rows of many episodes, kept as columns: :func:`episode_rows` without a Python object per step.

    ``add`` complete or incomplete episodes in the order the rows should have,
    then ``tables()`` gives the ``trajectories/`` and ``steps/`` file tables
    (the schemas of :mod:`schemas.datasets`, partition keys excluded).
    """

    _LISTED = ("episode_id", "step_index", "event_id", "task_id", "task_group", "policy_version", "status",
               "num_steps", "observation_token_ids", "action_token_ids", "behaviour_logprobs", "loss_mask",
               "group_advantage", "verifications", "verification_score", "clipped", "event_time")
    _ARRAYS = ("reward", "return_to_go", "advantage", "normalized_advantage")

    def __init__(self, recipe: Recipe) -> None:
        self._recipe = recipe
        self._trajs: list[TrajectoryRow] = []
        self._cols: dict[str, list[Any]] = {k: [] for k in self._LISTED + self._ARRAYS}
        self.steps = 0

    def __len__(self) -> int:
        return len(self._trajs)

    def add(self, episode: Episode) -> None:
        self._trajs.append(trajectory_row(episode, self._recipe))
        if not episode.complete or not episode.steps:
            return
        ss, c, n = episode.steps, self._cols, len(episode.steps)
        c["episode_id"] += [episode.episode_id] * n
        c["step_index"] += [s.step_index for s in ss]
        c["event_id"] += [s.event_id for s in ss]
        c["task_id"] += [episode.task_id] * n
        c["task_group"] += [episode.task_group] * n
        c["policy_version"] += [s.policy_version for s in ss]
        c["status"] += [_status(episode)] * n
        c["num_steps"] += [n] * n
        c["observation_token_ids"] += [s.observation_token_ids for s in ss]
        c["action_token_ids"] += [s.action_token_ids for s in ss]
        c["behaviour_logprobs"] += [s.behaviour_logprobs for s in ss]
        c["loss_mask"] += episode.loss_masks
        c["group_advantage"] += [float(episode.group_advantage or 0.0)] * n
        c["verifications"] += episode.verdicts
        c["verification_score"] += [_verification_score(vs) for vs in episode.verdicts]
        c["clipped"] += [False] * (n - 1) + [episode.clipped]
        c["event_time"] += [s.event_time for s in ss]
        c["reward"].append(episode.rewards)
        c["return_to_go"].append(episode.returns)
        c["advantage"].append(episode.advantages)
        norm = episode.normalized_advantages
        c["normalized_advantage"].append(norm if norm is not None else np.zeros(n))
        self.steps += n

    def tables(self) -> tuple[pa.Table, pa.Table]:
        """``(trajectories, steps)`` tables of everything added."""
        schema = step_file_schema()
        with gc_paused():
            columns = dict(self._cols)
            for k in self._ARRAYS:
                columns[k] = np.concatenate(columns[k]).astype(np.float64) if columns[k] else np.array([])
            columns["recipe_hash"] = [_recipe_ids(self._recipe)[1]] * self.steps
            steps = pa.Table.from_arrays([_column(columns[f.name], f.type) for f in schema], schema=schema)
        return rows_to_table(self._trajs, trajectory_file_schema()), steps


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


def _offsets(values: Sequence[Sequence[Any]]) -> pa.Array:
    lengths = np.fromiter((len(v) for v in values), dtype=np.int64, count=len(values))
    return pa.array(np.concatenate([[0], np.cumsum(lengths)]).astype(np.int32))


def _column(values: list[Any] | np.ndarray, typ: pa.DataType) -> pa.Array:
    if isinstance(values, np.ndarray):
        return pa.array(values, type=typ)
    if pa.types.is_list(typ) and values and isinstance(values[0], np.ndarray):
        flat = np.concatenate(values) if len(values) else np.array([])
        return pa.ListArray.from_arrays(_offsets(values), pa.array(flat, type=typ.value_type), type=typ)
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


def _write_parquet(table: pa.Table, path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    # Dictionary pages for the scalar columns (ids, names: few distinct values); token and logprob
    # lists are near-unique and only cost time in a dictionary.
    # Statistics likewise: min/max of ids and numbers let readers skip row groups; of token lists they don't.
    scalar = [f.name for f in table.schema if not pa.types.is_list(f.type)]
    pq.write_table(table, path, compression="zstd", use_dictionary=scalar, write_statistics=scalar)


def write_shard(staging: str | Path, version: str, commit: int, domain: str, shard: int, trajs: pa.Table,
                steps: pa.Table, *, stats: Mapping[str, RunningStats] | None, mode: str, eps: float) -> list[str]:
    """One (domain, shard)'s rows → its staged steps and trajectories files; returns their final paths.

    Rows are sorted by ``(episode_id, step_index)`` (deterministic bytes
    whatever order they came in); with ``stats`` set they are normalized first
    (:func:`pipelines.normalize.normalize_tables`).
    """
    trajs = _sorted(trajs, [("episode_id", "ascending")])
    steps = _sorted(steps, [("episode_id", "ascending"), ("step_index", "ascending")])
    if stats is not None:
        trajs, steps = normalize_tables(trajs, steps, stats, mode=mode, eps=eps, domain=domain)
    out = []
    for table, data in (("trajectories", trajs), ("steps", steps)):
        if data.num_rows == 0:
            continue
        rel = final_path(table, version=version, domain=domain, commit=commit, shard=shard)
        _write_parquet(data, Path(staging) / (rel + STAGED_SUFFIX))
        out.append(rel)
    return out


def _sorted(table: pa.Table, keys: list[tuple[str, str]]) -> pa.Table:
    """``table`` sorted by ``keys``; no copy when it already is (one part written in order)."""
    idx = pc.sort_indices(table, sort_keys=keys).to_numpy()
    if np.array_equal(idx, np.arange(len(idx))):
        return table
    return table.take(idx)


#: Step rows a stage-rows buffer holds before it writes a part file.
PART_ROWS = 50_000


class _StageRowsFn(beam.DoFn):
    """Complete episodes → un-normalized row *parts* (Arrow IPC), one per (domain, shard) per bundle.

    Emits ``((domain, shard), part base path)``, and on ``stats`` each
    part's normalization statistics (:func:`pipelines.normalize.stats_of_tables`);
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
        window = GlobalWindow()
        for out in self._flush():
            if isinstance(out, beam.pvalue.TaggedOutput):
                yield beam.pvalue.TaggedOutput(out.tag, WindowedValue(out.value, window.max_timestamp(), [window]))
            else:
                yield WindowedValue(out, window.max_timestamp(), [window])

    def _flush(self) -> Iterator[Any]:
        for key, episodes in sorted(self._buf.items()):
            trajs, steps = episodes_to_tables(episodes, self._recipe)  # in order: the merge rarely re-sorts
            base = Path(self._staging) / "_parts" / uuid.uuid4().hex
            base.parent.mkdir(parents=True, exist_ok=True)
            feather.write_feather(trajs, f"{base}.trajectories.arrow", compression="uncompressed")
            feather.write_feather(steps, f"{base}.steps.arrow", compression="uncompressed")
            for kv in stats_of_tables(trajs, steps, domain=key[0]).items():
                yield beam.pvalue.TaggedOutput(STATS_TAG, kv)
            yield key, str(base)
        self._buf, self._n = {}, 0


class _FinalizeShardFn(beam.DoFn):
    """The parts of one (domain, shard) → its staged, normalized files (``prior ⊕ run_stats``).

    A shard's work (read its parts, normalize, sort, Parquet-encode) is Arrow
    and numpy code that releases the GIL, so the shards of a bundle run on a
    small thread pool, up to ``threads`` at a time: on one worker that gets
    several shards in a bundle (FnApiRunner gets all of them) they share the
    cores. Results, and the metrics (which are per thread in Beam), are taken
    in the bundle's own thread.
    """

    def __init__(self, staging: str, version: str, commit: int, *, mode: str = "none", eps: float = 1e-6,
                 prior: Mapping[str, RunningStats] | None = None, threads: int | None = None) -> None:
        self._staging, self._version, self._commit = staging, version, commit
        self._mode, self._eps = mode, eps
        self._prior = dict(prior or {})
        self._threads = threads
        self._steps = Metrics.counter(METRICS_NAMESPACE, "steps_written")
        self._trajs = Metrics.counter(METRICS_NAMESPACE, "trajectories_written")
        self._normalized = Metrics.counter(METRICS_NAMESPACE, "episodes_normalized")

    def setup(self) -> None:
        threads = self._threads or min(4, os.cpu_count() or 1)
        self._pool = ThreadPoolExecutor(max_workers=threads, thread_name_prefix="finalize-shard")
        self._in_flight_max = threads

    def start_bundle(self) -> None:
        self._in_flight: collections.deque[Future] = collections.deque()

    def process(self, element: tuple[tuple[str, int], Iterable[str]],
                run_stats: Mapping[str, RunningStats]) -> Iterator[str]:
        (domain, shard), bases = element
        stats = NormState(recipe_hash="", stats=self._prior).merged(run_stats).stats
        self._in_flight.append(self._pool.submit(self._finalize, domain, shard, sorted(bases), stats))
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

    def _finalize(self, domain: str, shard: int, bases: list[str],
                  stats: Mapping[str, RunningStats]) -> tuple[list[str], int, int]:
        trajs = pa.concat_tables([feather.read_table(f"{b}.trajectories.arrow", memory_map=True) for b in bases])
        steps = pa.concat_tables([feather.read_table(f"{b}.steps.arrow", memory_map=True) for b in bases])
        files = write_shard(self._staging, self._version, self._commit, domain, shard, trajs, steps,
                            stats=stats, mode=self._mode, eps=self._eps)
        for b in bases:
            for table in ("trajectories", "steps"):
                Path(f"{b}.{table}.arrow").unlink(missing_ok=True)
        return files, steps.num_rows, trajs.num_rows


def _write_incomplete(trajs: list[TrajectoryRow], staging: str, version: str, commit: int) -> Iterator[str]:
    by_domain: dict[str, list[TrajectoryRow]] = {}
    for tr in trajs:
        by_domain.setdefault(tr.domain, []).append(tr)
    for domain in sorted(by_domain):
        rows = sorted(by_domain[domain], key=lambda tr: tr.episode_id)
        rel = incomplete_path(version=version, domain=domain, commit=commit)
        _write_parquet(rows_to_table(rows, trajectory_file_schema()), Path(staging) / (rel + STAGED_SUFFIX))
        yield rel


def _write_dead_letters(letters: list[DeadLetter], staging: str, version: str, commit: int) -> Iterator[str]:
    if not letters:
        return
    letters = sorted(letters, key=lambda d: (d.source_topic, d.source_partition, d.source_offset, d.reason, d.message))
    rel = f"dead_letters/recipe={version}/c{commit:08d}.parquet"
    _write_parquet(rows_to_table(letters, _DEAD_LETTER_SCHEMA), Path(staging) / (rel + STAGED_SUFFIX))
    yield rel


def _write_pending(fragments: list[tuple[str, list]], staging: str) -> Iterator[str]:
    if not fragments:
        return
    events = [e for _, evs in sorted(fragments, key=lambda f: f[0]) for e in sorted(evs, key=lambda e: e.seq)]
    path = Path(staging) / "state" / (PENDING_FILE + STAGED_SUFFIX)
    path.parent.mkdir(parents=True, exist_ok=True)
    feather.write_feather(events_to_table(events), path, compression="uncompressed")
    yield "state/" + PENDING_FILE


def _write_stats(stats: dict[str, Any], staging: str) -> Iterator[str]:
    path = Path(staging) / "state" / (RUN_STATS_FILE + STAGED_SUFFIX)
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_bytes(msgspec.json.encode(dict(sorted(stats.items()))))
    yield "state/" + RUN_STATS_FILE


def stage_files(
    staging: str | Path,
    recipe: Recipe,
    *,
    commit: int,
    episodes: Sequence[Episode] = (),
    pending: Sequence[tuple[str, list]] = (),
    dead_letters: Sequence[DeadLetter] = (),
    stats: Mapping[str, RunningStats] | None = None,
    prior: Mapping[str, RunningStats] | None = None,
    shards: int = 1,
) -> list[str]:
    """Write one commit's staged files in this process: the same files :class:`WriteDatasets` writes.

    For a single writer that holds all of a commit's elements (the streaming
    job's per-window commit).

    Args:
        staging: ``<out>/_staging/<version>/<commit>``.
        recipe: the recipe.
        commit: the commit number (names the files).
        episodes: complete (rewarded, clipped, not normalized) and incomplete episodes.
        pending: ``(episode_id, events)`` of open episodes.
        dead_letters: this commit's dead letters.
        stats: ``key -> RunningStats`` of this commit's complete episodes.
        prior: persisted statistics; complete episodes are normalized with ``prior ⊕ stats``.
        shards: files per (table, domain).

    Returns:
        The staged files' final relative paths.
    """
    by_shard: dict[tuple[str, int], list[Episode]] = {}
    incomplete = [trajectory_row(e, recipe) for e in episodes if not e.complete]
    for episode in (e for e in episodes if e.complete):
        shard = zlib.crc32(episode.episode_id.encode()) % shards
        by_shard.setdefault((episode.domain, shard), []).append(episode)
    merged = NormState(recipe_hash="", stats=dict(prior or {})).merged(dict(stats or {})).stats
    files = []
    for (domain, shard), shard_episodes in sorted(by_shard.items()):
        trajs, steps = episodes_to_tables(shard_episodes, recipe)
        files += write_shard(staging, recipe.version, commit, domain, shard, trajs, steps, stats=merged,
                             mode=recipe.normalization, eps=recipe.eps)
    files += _write_incomplete(incomplete, str(staging), recipe.version, commit)
    files += _write_dead_letters(list(dead_letters), str(staging), recipe.version, commit)
    files += _write_pending(list(pending), str(staging))
    files += _write_stats(dict(stats or {}), str(staging))
    return files


class WriteDatasets(beam.PTransform):
    """Write one commit's staged files under ``staging`` (see the module docstring).

    Input: a dict of PCollections — ``episodes`` (complete, rewarded and
    clipped; or a tuple of such PCollections, branches of one job),
    ``incomplete`` (Episodes with ``complete=False``), ``pending``
    (``(episode_id, events)``) and ``dead_letters`` (DeadLetter). The run's
    normalization statistics come from the staged parts themselves.

    Complete episodes become rows where they are (each bundle writes its
    rows, un-normalized, as Arrow *part* files under ``<staging>/_parts/``);
    a GroupByKey of the part *paths* per (domain, shard) then merges each
    shard's parts, normalizes them with ``prior ⊕ stats`` (a side input,
    vectorized: :func:`pipelines.normalize.normalize_tables`), sorts and
    writes them. The rows never go through Beam's coders: normalizing the
    episodes in the pipeline would need the statistics of all of them first,
    i.e. one more pass that encodes and decodes every episode, tokens and all.

    Args:
        staging: ``<out>/_staging/<version>/<commit>``.
        recipe: the recipe (names the version, fills ``recipe_hash``).
        commit: the commit number (names the files).
        shards: files per (table, domain) per commit; episodes are spread by
            ``crc32(episode_id) % shards``.
        prior: persisted statistics of earlier commits (``NormState.stats``).

    Returns:
        PCollection of the staged files' final relative paths (informational).
    """

    def __init__(self, staging: str | Path, recipe: Recipe, *, commit: int, shards: int = 1,
                 prior: Mapping[str, RunningStats] | None = None) -> None:
        super().__init__()
        if shards < 1:
            raise ValueError(f"`shards` must be >= 1, got {shards}")
        self._staging, self._recipe, self._commit, self._shards = str(staging), recipe, commit, shards
        self._prior = dict(prior or {})

    def expand(self, pcolls: dict):
        staging, version, commit = self._staging, self._recipe.version, self._commit
        # Complete and incomplete episodes are written separately: a Flatten of the two would be one
        # more encode/decode pass of every row on FnApiRunner (it materializes multi-input Flattens).
        branches = pcolls["episodes"]
        branches = tuple(branches) if isinstance(branches, (tuple, list)) else (branches,)
        staged = [
            b | f"StageRows{i or ''}" >> beam.ParDo(_StageRowsFn(staging, self._recipe, self._shards))
            .with_output_types(Tuple[Tuple[str, int], str]).with_outputs(STATS_TAG, main="parts")
            for i, b in enumerate(branches)
        ]
        if len(staged) == 1:
            parts, partial_stats = staged[0].parts, staged[0][STATS_TAG]
        else:
            parts = tuple(st.parts for st in staged) | "AllParts" >> beam.Flatten()
            partial_stats = tuple(st[STATS_TAG] for st in staged) | "AllPartStats" >> beam.Flatten()
        stats = partial_stats | "RunStats" >> beam.CombinePerKey(merge_stats)
        data_files = (
            parts
            | "GroupParts" >> beam.GroupByKey()
            | "FinalizeShards" >> beam.ParDo(
                _FinalizeShardFn(staging, version, commit, mode=self._recipe.normalization, eps=self._recipe.eps,
                                 prior=self._prior),
                run_stats=beam.pvalue.AsDict(stats))
        )
        recipe = self._recipe
        incomplete_files = (
            pcolls["incomplete"]
            | "IncompleteRows" >> beam.Map(trajectory_row, recipe).with_output_types(TrajectoryRow)
            | "CollectIncomplete" >> beam.combiners.ToList().without_defaults()
            | "WriteIncomplete" >> beam.FlatMap(_write_incomplete, staging, version, commit)
        )
        dead_files = (
            pcolls["dead_letters"]
            | "CollectDeadLetters" >> beam.combiners.ToList().without_defaults()
            | "WriteDeadLetters" >> beam.FlatMap(_write_dead_letters, staging, version, commit)
        )
        pending_files = (
            pcolls["pending"]
            | "CollectPending" >> beam.combiners.ToList().without_defaults()
            | "WritePending" >> beam.FlatMap(_write_pending, staging)
        )
        stats_files = (
            stats
            | "CollectStats" >> beam.combiners.ToDict()
            | "WriteStats" >> beam.FlatMap(_write_stats, staging)
        )
        return (data_files, incomplete_files, dead_files, pending_files, stats_files) | "StagedFiles" >> beam.Flatten()
